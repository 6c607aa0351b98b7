"""The ``latency`` workload: the interleaving protocol, repeated prefill, where flush steps
land, metrics and ratios from injected raw timings, the runner keeping them, bad input.

Right values: the call order of the protocol from the workload's documented schedule; flush
steps from KIVI's key schedule worked out by hand; metrics from scripted timings (the
workload's timer replaced) with answers by hand.  A tiny random Llama (2 layers) runs every
test; no assertion reads real wall-clock speed.  The statistics themselves are tested in
tests/test_measure.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvbench
from kvbench.bench.context import RunContext
from kvbench.bench.runner import run_suite
from kvbench.bench.suite import parse_suite
from kvbench.bench.workloads.latency import CPU_NOTE, Latency
from kvbench.hf.attention import use_kvbench_attention

# tiny models gain nothing from intra-op threads (tests/conftest.py: one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=256,
    )
    return use_kvbench_attention(LlamaForCausalLM(cfg).eval())


def _workload(model, **params) -> tuple[Latency, RunContext]:
    w = Latency(Latency.validate({"type": "latency", **params}))
    ctx = RunContext(model=model, model_info={"max_position_embeddings": 256}, seed=0)
    w.ids = torch.randint(
        0, 128, (1, w.spec["context"]), generator=torch.Generator().manual_seed(1)
    )
    w.info = {}
    return w, ctx


class Recorder:
    """Wraps a model's forward to record which cache each call used and how many tokens."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []
        self.config, self.generation_config = model.config, model.generation_config

    def parameters(self):
        return self.model.parameters()

    def forward(self, input_ids=None, cache=None, use_cache=True, logits_to_keep=0):
        self.calls.append((cache, input_ids.shape[1]))  # kept alive: ids stay distinct
        return self.model(
            input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep
        )

    __call__ = forward


KIVI8 = dict(bits=2, value_bits=2, group_size=8, residual_length=8)
#: one baseline candidate (``full`` in the model's dtype): the two-cache protocol
ONE = ["model"]


def test_protocol_repeated_prefill_then_alternating_rounds() -> None:
    model = Recorder(_tiny_model())
    w, ctx = _workload(
        model,
        context=40,
        steps=4,
        warmup=2,
        baseline="hf-dynamic",
        baseline_storage_dtypes=["model"],
        prefill_repeats=2,
    )
    res = w.run(ctx, kvbench.get_method("kivi", bits=2, group_size=8, residual_length=8))
    calls = model.calls
    # prefill: P = 40 - 4 - 2 = 34 tokens, 2 rounds, method first then baseline first, each
    # into a fresh cache (4 distinct caches)
    assert [n for _, n in calls[:4]] == [34] * 4
    assert len({id(c) for c, _ in calls[:4]}) == 4
    b, a = calls[2][0], calls[3][0]  # round 2 is (baseline, method): these caches decode
    # 6 rounds of one token each into the last round's caches; order A B, B A, A B, ...
    order = [c for c, _ in calls[4:]]
    assert order == [a, b, b, a, a, b, b, a, a, b, b, a]
    assert all(n == 1 for _, n in calls[4:])
    assert len(res.per_layer["decode_ms"]) == 4 and len(res.per_layer["baseline_decode_ms"]) == 4
    assert len(res.per_layer["prefill_ms"]) == 2 and res.info["prefill_repeats"] == 2


def test_flush_steps_land_where_the_schedule_puts_them() -> None:
    """KIVI keys with R = 8 after a prompt of P = 40 - 12 - 2 = 26 tokens: 24 quantized, 2 in
    the residual; decode step j (0-based, warm-up included) leaves 3 + j, and the residual is
    flushed when it reaches 8, i.e. after j = 5 and j = 13: timed steps 3 and 11 (2 warm-up
    steps), a period of 8 steps.  Values slide one token per step: not a flush."""
    w, ctx = _workload(_tiny_model(), context=40, steps=12, warmup=2, prefill_repeats=1)
    res = w.run(ctx, kvbench.get_method("kivi", **KIVI8))
    assert res.info["flush_index"] == [3, 11] and res.metrics["flush_steps"] == 2
    assert res.info["flush_period"] == 8 and "quantized_tokens" in res.info["flush_period_source"]
    assert res.info["baseline_flush_index"] == []  # the full cache never shrinks
    # a shorter window that ends before the first flush holds none
    w, ctx = _workload(_tiny_model(), context=40, steps=3, warmup=2, prefill_repeats=1)
    res = w.run(ctx, kvbench.get_method("kivi", **KIVI8))  # P = 35: 32 + 3, flush after j = 4
    assert res.info["flush_index"] == [2]


class ScriptedTimer:
    """Replaces the workload's timer: runs each call, returns the next scripted ms."""

    samples: list[float] = []

    def __init__(self, device) -> None:
        self.how = "scripted"

    def __call__(self, fn):
        fn()
        return ScriptedTimer.samples.pop(0)


def test_metrics_from_injected_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw timings with a known answer.  Calls: 3 prefill rounds (M B, B M, M B), then 12 timed
    rounds (after 2 warm-up rounds, so they start M B) alternating.  The method's flush steps
    are timed steps 3 and 11 (see the test above), period 8."""
    import kvbench.bench.workloads.latency as lat

    pre_m, pre_b = [30.0, 10.0, 20.0], [10.0, 12.0, 8.0]  # medians 20 and 10
    meth = [2.0, 2.0, 3.0, 10.0, 2.0, 2.0, 3.0, 2.0, 2.0, 2.0, 2.0, 14.0]
    base = [1.0] * 12
    seq = [pre_m[0], pre_b[0], pre_b[1], pre_m[1], pre_m[2], pre_b[2]]
    for i in range(12):
        seq += [meth[i], base[i]] if i % 2 == 0 else [base[i], meth[i]]
    ScriptedTimer.samples = seq
    monkeypatch.setattr(lat, "Timer", ScriptedTimer)
    w, ctx = _workload(_tiny_model(), context=40, steps=12, warmup=2, baseline_storage_dtypes=ONE)
    m = w.run(ctx, kvbench.get_method("kivi", **KIVI8)).metrics
    assert ScriptedTimer.samples == []
    assert m["prefill_ms"] == 20.0 and m["prefill_ms_ratio"] == 2.0
    # steady: ten steps, eight of 2 ms and two of 3 ms
    assert m["decode_ms_p50"] == 2.0 and m["decode_ms_mean"] == pytest.approx(2.2)
    assert m["decode_ms_p90"] == pytest.approx(3.0)  # h = 8.1 between two 3 ms
    assert m["flush_steps"] == 2 and m["flush_ms_mean"] == 12.0 and m["flush_ms_max"] == 14.0
    amort = 2.2 + (12.0 - 2.2) / 8
    assert m["decode_ms_amortized"] == pytest.approx(amort)
    assert m["tokens_per_s"] == pytest.approx(1000 / amort)
    assert m["decode_ms_p50_ratio"] == 2.0 and m["decode_ms_mean_ratio"] == pytest.approx(2.2)
    assert m["decode_ms_amortized_ratio"] == pytest.approx(amort)
    assert m["tokens_per_s_ratio"] == pytest.approx(1 / amort)
    # the interval leaves the flush steps out as the ratio does: the baseline's median is 1
    # in every resample, the method's is that of drawn 2 and 3 ms steps (2 in most)
    assert m["decode_ms_p50_ratio_ci_low"] == 2.0
    assert 2.0 <= m["decode_ms_p50_ratio_ci_high"] <= 3.0


def test_step_ratio_interval_is_paired_over_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``full`` against itself, scripted: the machine slows from 1 to 12 ms a step over the
    rounds and the method's step is 2 x the baseline's of the same round.  Resampling rounds
    paired keeps the factor in every resample: interval [2, 2]; resampling the two series apart
    would mix fast and slow rounds (medians from 1 to 12 ms) into a wide one."""
    import kvbench.bench.workloads.latency as lat

    base = [float(i + 1) for i in range(12)]
    seq = [5.0] * 6  # 3 prefill rounds
    for i in range(12):
        pair = [2 * base[i], base[i]]
        seq += pair if i % 2 == 0 else pair[::-1]
    ScriptedTimer.samples = seq
    monkeypatch.setattr(lat, "Timer", ScriptedTimer)
    w, ctx = _workload(_tiny_model(), context=40, steps=12, warmup=2, baseline_storage_dtypes=ONE)
    res = w.run(ctx, kvbench.get_method("full"))
    m = res.metrics
    assert ScriptedTimer.samples == []
    assert m["decode_ms_p50_ratio"] == 2.0
    assert (m["decode_ms_p50_ratio_ci_low"], m["decode_ms_p50_ratio_ci_high"]) == (2.0, 2.0)
    assert "paired" in res.info["ratio_interval"] and "seed" in res.info["ratio_interval"]


def test_end_to_end_records() -> None:
    model = _tiny_model()
    w, ctx = _workload(model, context=48, steps=5, warmup=1, prefill_repeats=1)
    res = w.run(ctx, kvbench.get_method("kivi", **KIVI8))
    m, info = res.metrics, res.info
    assert info["baseline"] == "full" and info["cuda_graphs"] is False
    assert info["threads"] == 1 and info["timing"] == "time.perf_counter_ns"
    assert info["timing_note"] == CPU_NOTE and len(info["loadavg"]) == 3
    assert "interpolation" in info["percentiles"]
    # auto: kvbench methods decode through LayerCache.attend (code-domain fast path when it fits)
    assert "LayerCache.attend" in info["attention_path"]
    assert m["bytes_total"] > 0
    assert info["protocol"] == info["baseline_protocol"] == "write-then-attend"
    # the step ratio's interval, from real (noisy) timings: the ratio lies inside it
    lo, hi = m["decode_ms_p50_ratio_ci_low"], m["decode_ms_p50_ratio_ci_high"]
    assert 0 < lo <= m["decode_ms_p50_ratio"] <= hi
    assert info["ratio_interval"].startswith("95% paired percentile bootstrap")
    # a peer runs through its transformers cache
    res = w.run(ctx, kvbench.get_method("hf-dynamic"))
    assert "transformers cache" in res.info["attention_path"]
    assert res.info["protocol"] == "transformers-update"
    # 48 tokens x 2 layers x K and V x 2 heads x 16 x 4 bytes (float32 model)
    assert res.metrics["bytes_total"] == 48 * 2 * 2 * 2 * 16 * 4


def test_runner_keeps_interleaved_ratios(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner adds ``*_ratio`` against the ``full`` record only where the workload did not
    measure its own."""
    from kvbench.bench.workloads import Result

    calls = iter([1.0, 4.0])

    def fake_run(self, ctx, method):
        v = next(calls)
        return Result({"decode_ms_p50": v, "decode_ms_p50_ratio": 1.5, "prefill_ms": 10 * v})

    monkeypatch.setattr(Latency, "run", fake_run)
    monkeypatch.setattr(Latency, "prepare", lambda self, ctx: None)
    monkeypatch.setattr(Latency, "needs_model", False)
    suite = parse_suite(
        {
            "model": "none",
            "methods": ["full", "kivi"],
            "workloads": [{"type": "latency", "context": 64}],
        }
    )
    recs = {r.method: r.metrics for r in run_suite(suite, tmp_path, quiet=True)}
    assert recs["kivi"]["decode_ms_p50_ratio"] == 1.5  # the workload's own, not 4.0 / 1.0
    assert recs["kivi"]["prefill_ms_ratio"] == 4.0  # added by the runner: 40 / 10


@pytest.mark.parametrize(
    "params, match",
    [
        (
            {"context": 20, "steps": 20, "warmup": 3},
            "field 'context': 20 .*> warmup \\+ steps = 23",
        ),
        ({"steps": 0}, "field 'steps': 0 is not allowed; allowed: integers >= 1"),
        (
            {"prefill_repeats": 0},
            "field 'prefill_repeats': 0 is not allowed; allowed: integers >= 1",
        ),
        ({"warmup": -1}, "field 'warmup': -1 is not allowed; allowed: integers >= 0"),
        ({"context": 2048.0}, "integers"),
        ({"path": "fast"}, "allowed"),
        ({"baseline": "fulll"}, "did you mean 'full'"),
        ({"stepz": 3}, "unknown parameter"),
    ],
)
def test_bad_params(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Latency.validate({"type": "latency", **params})


def test_context_beyond_model_maximum() -> None:
    w = Latency(Latency.validate({"type": "latency", "context": 8200}))
    ctx = RunContext(model_info={"max_position_embeddings": 8192, "model_id": "m"})
    with pytest.raises(ValueError, match="context=8200 exceeds the model's maximum context 8192"):
        w.prepare(ctx)


# ------------------------------------------------------------------ batches
class MaskRecorder(Recorder):
    """Records the ids, mask and positions of every call (a padded batch passes them)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kw):
        self.calls.append((input_ids, attention_mask, position_ids))
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw
        )

    __call__ = forward


def _batched(model, bs: int, **params):
    w, ctx = _workload(model, batch_size=bs, **params)
    w.ids = torch.randint(
        0, 128, (bs, w.spec["context"]), generator=torch.Generator().manual_seed(2)
    )
    return w, ctx


def test_padded_batch_feeds_each_row_its_mask_and_positions() -> None:
    """B = 3, d = 40, 3 timed + 1 warm-up steps: P = 36, rows keep 36 - (b * 18) // 2 = 36, 27,
    18 prompt tokens; the prefill masks the pads, positions restart at each row's first real
    token, every decode step feeds position lengths[b] + j and a mask one wider."""
    model = MaskRecorder(_tiny_model())
    w, ctx = _batched(model, 3, context=40, steps=3, warmup=1, prefill_repeats=1, padding="left")
    res = w.run(ctx, kvbench.get_method("full"))
    lens = [36, 27, 18]
    ids, mask, pos = model.calls[0]
    assert ids.shape == mask.shape == pos.shape == (3, 36)
    assert mask.sum(-1).tolist() == lens and mask[:, -1].all()
    for b, k in enumerate(lens):
        assert pos[b, 36 - k :].tolist() == list(range(k))
        assert torch.equal(ids[b, 36 - k :], w.ids[b, 36 - k : 36])  # the row's own text
    decode = [c for c in model.calls[3:] if c[0].shape[1] == 1]
    assert len(decode) == 12  # 4 rounds x (method, full float32, full float16)
    for i, (_, mask, pos) in enumerate(decode):
        j = i // 3  # every cache of a round decodes the same position
        assert pos.view(-1).tolist() == [k + j for k in lens]
        assert mask.shape == (3, 37 + j) and mask.sum(-1).tolist() == [k + j + 1 for k in lens]
    batch = res.info["batch"]
    assert batch["batch_size"] == 3 and batch["padding"] == "left"
    assert batch["row_prompt_tokens"] == lens and batch["pad_tokens"] == 0 + 9 + 18
    assert batch["pad_tokens_stored"] == 0 and batch["row_context_tokens"] == [40, 31, 22]
    # bytes held: each row its real tokens (prompt + 4 decoded), 512 bytes a token
    # (2 layers x K and V x 2 heads x 16 x 4 bytes): nothing is stored for pads
    assert res.metrics["bytes_total"] == (40 + 31 + 22) * 512
    # an unpadded batch: no mask, one batched cache of 3 x 40 tokens
    model = MaskRecorder(_tiny_model())
    w, ctx = _batched(model, 3, context=40, steps=3, warmup=1, prefill_repeats=1)
    res = w.run(ctx, kvbench.get_method("full"))
    assert all(m is None and p is None for _, m, p in model.calls)
    assert res.metrics["bytes_total"] == 3 * 40 * 512
    assert res.info["batch"]["pad_tokens"] == 0 and res.info["batch"]["padding"] == "none"


def test_batch_tokens_per_s_from_injected_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    """B = 4: a batch step of 5 ms (mean) generates 4 tokens: 800 tokens/s; the baseline's 2 ms
    steps give a ratio of 2 / 5."""
    import kvbench.bench.workloads.latency as lat

    meth, base = [4.0, 4.0, 4.0, 8.0], [2.0] * 4
    seq = [30.0, 10.0]
    for i in range(4):
        seq += [meth[i], base[i]] if i % 2 == 0 else [base[i], meth[i]]
    ScriptedTimer.samples = seq
    monkeypatch.setattr(lat, "Timer", ScriptedTimer)
    w, ctx = _batched(
        _tiny_model(), 4, context=40, steps=4, warmup=2, prefill_repeats=1, baseline_storage_dtypes=ONE
    )
    m = w.run(ctx, kvbench.get_method("full")).metrics
    assert ScriptedTimer.samples == []
    assert m["decode_ms_mean"] == 5.0 and m["tokens_per_s"] == pytest.approx(800.0)
    assert m["tokens_per_s_ratio"] == pytest.approx(0.4)


def test_padded_batch_refuses_a_method_without_padding() -> None:
    w, ctx = _batched(_tiny_model(), 2, context=40, steps=3, warmup=1, padding="left")
    with pytest.raises(ValueError, match="'hf-dynamic' does not support padded batches"):
        w.run(ctx, kvbench.get_method("hf-dynamic"))
    w, ctx = _batched(_tiny_model(), 2, context=40, steps=3, warmup=1, prefill_repeats=1)
    assert w.run(ctx, kvbench.get_method("hf-dynamic")).metrics["bytes_total"] > 0  # unpadded


@pytest.mark.parametrize(
    "params, match",
    [
        ({"batch_size": 0}, "field 'batch_size': 0 is not allowed; allowed: integers >= 1"),
        ({"batch_size": 2, "padding": "right"}, r"field 'padding': 'right' is not allowed.*'left'"),
        ({"padding": "left"}, "needs batch_size >= 2"),
    ],
)
def test_bad_batch_params(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Latency.validate({"type": "latency", **params})
