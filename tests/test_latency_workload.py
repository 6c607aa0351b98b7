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


def tiny_model() -> LlamaForCausalLM:
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
    model = Recorder(tiny_model())
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
    w, ctx = _workload(tiny_model(), context=40, steps=12, warmup=2, prefill_repeats=1)
    res = w.run(ctx, kvbench.get_method("kivi", **KIVI8))
    assert res.info["flush_index"] == [3, 11] and res.metrics["flush_steps"] == 2
    assert res.info["flush_period"] == 8 and "quantized_tokens" in res.info["flush_period_source"]
    assert res.info["baseline_flush_index"] == []  # the full cache never shrinks
    # a shorter window that ends before the first flush holds none
    w, ctx = _workload(tiny_model(), context=40, steps=3, warmup=2, prefill_repeats=1)
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
    w, ctx = _workload(tiny_model(), context=40, steps=12, warmup=2, baseline_storage_dtypes=ONE)
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
    w, ctx = _workload(tiny_model(), context=40, steps=12, warmup=2, baseline_storage_dtypes=ONE)
    res = w.run(ctx, kvbench.get_method("full"))
    m = res.metrics
    assert ScriptedTimer.samples == []
    assert m["decode_ms_p50_ratio"] == 2.0
    assert (m["decode_ms_p50_ratio_ci_low"], m["decode_ms_p50_ratio_ci_high"]) == (2.0, 2.0)
    assert "paired" in res.info["ratio_interval"] and "seed" in res.info["ratio_interval"]


class ThreadTimer(ScriptedTimer):
    """A scripted timer that also records the intra-op threads in force at each timed call."""

    threads: list[int] = []

    def __call__(self, fn):
        ThreadTimer.threads.append(torch.get_num_threads())
        return super().__call__(fn)


def _rounds(series: list[list[float]], warmup: int = 2) -> list[float]:
    """The scripted samples of one timed prefill of ``len(series)`` caches (5 ms each) and
    ``len(series[0])`` timed rounds after ``warmup`` warm-up rounds: round i calls the caches
    in ``series`` order rotated left by ``i + warmup`` (the warm-up rounds count in the
    rotation), cache k taking ``series[k][i]``."""
    n = len(series)
    seq = [5.0] * n
    for i in range(len(series[0])):
        k = (i + warmup) % n
        seq += [series[j][i] for j in [*range(k, n), *range(k)]]
    return seq


def _two_way(first: list[float], second: list[float], warmup: int = 2) -> list[float]:
    """:func:`_rounds` of two caches: a configuration's run (method, baseline)."""
    return _rounds([first, second], warmup)


def _prepass(b32: list[float], b16: list[float], warmup: int = 2) -> list[float]:
    """:func:`_rounds` of the pre-pass's four caches, ``float32 A, float32 B, float16 A,
    float16 B``, each copy of a dtype stepping the same times (``b32``, ``b16``)."""
    return _rounds([b32, b32, b16, b16], warmup)


@pytest.mark.parametrize("faster", ["float16", "float32"])
def test_the_faster_baseline_is_picked(monkeypatch: pytest.MonkeyPatch, faster: str) -> None:
    """The pre-pass interleaves two caches each of ``full`` stored in float32 (the model's
    dtype) and in float16; the machine drifts from 1x to 12x over the rounds; the faster
    candidate's copies step in 8 ms x drift, the slower's in 10 ms x drift.  Then the
    configuration interleaves two caches: the method (12 ms x drift) and the chosen baseline,
    which now steps in 7.5 ms x drift.  The record names the faster with both pre-pass
    medians; the ratio and its paired interval are against the chosen baseline's rounds timed
    WITH the method (12 / 7.5 = 1.6), not the pre-pass's (that would give 1.5).  Every timed
    call runs at 1 thread."""
    import kvbench.bench.workloads.latency as lat

    drift = [float(i + 1) for i in range(12)]
    fast, slow = [8.0 * x for x in drift], [10.0 * x for x in drift]
    meth, base = [12.0 * x for x in drift], [7.5 * x for x in drift]
    b32, b16 = (slow, fast) if faster == "float16" else (fast, slow)
    samples = _prepass(b32, b16) + _two_way(meth, base)  # pre-pass (4 caches), then the run
    ScriptedTimer.samples, ThreadTimer.threads = samples, []
    monkeypatch.setattr(lat, "Timer", ThreadTimer)
    w, ctx = _workload(tiny_model(), context=40, steps=12, warmup=2, prefill_repeats=1)
    res = w.run(ctx, kvbench.get_method("kivi", **KIVI8))
    m, info = res.metrics, res.info
    assert ScriptedTimer.samples == []
    # medians over the steady steps (KIVI's flush steps 3 and 11, drift 4 and 12, left out
    # of the method's; full never flushes): drift 1..12 without 4 and 12 has median 6.5, as
    # has 1..12: method 12 x 6.5, baseline 7.5 x 6.5; candidates 8 x 6.5 and 10 x 6.5
    assert info["baseline_storage_dtype"] == faster
    assert info["baseline_candidates"] == {"float32": 6.5 * b32[0], "float16": 6.5 * b16[0]}
    assert m["decode_ms_p50"] == 78.0 and info["baseline_decode_ms_p50"] == 48.75
    assert m["decode_ms_p50_ratio"] == pytest.approx(1.6)
    assert res.per_layer["baseline_decode_ms"] == base
    assert res.per_layer[f"prepass_decode_ms_{faster}"] == fast
    assert res.per_layer[f"prepass_decode_ms_{faster}_b"] == fast
    assert "pre-pass" in info["ratio_baseline"] and faster in info["ratio_baseline"]
    # the interval pairs the method with the chosen baseline's rounds of this run
    from kvbench.bench.metrics import paired_ratio_ci

    lo, hi = m["decode_ms_p50_ratio_ci_low"], m["decode_ms_p50_ratio_ci_high"]
    assert (lo, hi) == paired_ratio_ci(meth, base, [3, 11], [], seed=0)
    assert (lo, hi) != paired_ratio_ci(meth, fast, [3, 11], [], seed=0)
    assert lo <= m["decode_ms_p50_ratio"] <= hi
    assert ThreadTimer.threads == [1] * ((4 + 4 * 12) + (2 + 2 * 12))  # prefill + steps


def test_full_against_itself_when_its_dtype_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-pass picks float16 (9 ms x drift against float32's 10 ms x drift) once; its two
    float16 copies step alike: ``full`` vs itself 1 with the interval [1, 1] over 10 rounds in
    both records.  Then ``full`` stored in float16, the chosen baseline itself, steps in the
    same time as its interleaved baseline: ratio 1 with the interval [1, 1], and ``full`` in
    float32, 10 / 9 against it; the pre-pass is not timed again."""
    import kvbench.bench.workloads.latency as lat

    drift = [1.0 + 0.5 * (i % 5) for i in range(10)]
    b32, b16 = [10.0 * x for x in drift], [9.0 * x for x in drift]
    ScriptedTimer.samples = _prepass(b32, b16) + _two_way(b16, b16) + _two_way(b32, b16)
    monkeypatch.setattr(lat, "Timer", ScriptedTimer)
    w, ctx = _workload(tiny_model(), context=40, steps=10, warmup=2, prefill_repeats=1)
    same = w.run(ctx, kvbench.get_method("full", storage_dtype="float16"))
    other = w.run(ctx, kvbench.get_method("full"))
    assert ScriptedTimer.samples == []
    for res in (same, other):
        assert res.info["baseline_storage_dtype"] == "float16"
        assert res.info["baseline_candidates"] == {"float32": 20.0, "float16": 18.0}
        assert res.info["baseline_self_ratio"] == 1.0
        assert res.info["baseline_self_interval"] == [1.0, 1.0]
        assert res.info["baseline_self_rounds"] == 10
    m = same.metrics
    assert m["decode_ms_p50_ratio"] == 1.0
    assert (m["decode_ms_p50_ratio_ci_low"], m["decode_ms_p50_ratio_ci_high"]) == (1.0, 1.0)
    m = other.metrics
    assert m["decode_ms_p50_ratio"] == pytest.approx(10 / 9)
    assert m["decode_ms_p50_ratio_ci_low"] == pytest.approx(10 / 9)
    assert m["decode_ms_p50_ratio_ci_high"] == pytest.approx(10 / 9)


def test_prepass_times_four_distinct_caches() -> None:
    """Two candidates (``full`` in float32 and in float16): the pre-pass prefills four caches,
    distinct objects, two stored in the model's dtype and two in float16, and steps each once
    a round in the order ``float32 A, float32 B, float16 A, float16 B`` rotated left by the
    round (2 warm-up + 4 timed rounds): no cache is stepped twice in a round or stands in for
    another."""
    model = Recorder(tiny_model())
    w, ctx = _workload(model, context=40, steps=4, warmup=2, prefill_repeats=1)
    choice = w.choose_baseline(ctx)
    calls = model.calls
    assert [n for _, n in calls[:4]] == [34] * 4  # P = 40 - 4 - 2, one prefill each
    caches = [c for c, _ in calls[:4]]
    assert len({id(c) for c in caches}) == 4
    assert [c.method.config.storage_dtype for c in caches] == [None, None, "float16", "float16"]
    assert all(n == 1 for _, n in calls[4:])
    order = [c for c, _ in calls[4:]]
    assert order == [c for r in range(6) for c in caches[r % 4 :] + caches[: r % 4]]
    for steps in (choice.steps_ms, choice.steps_ms_b):
        assert sorted(steps) == ["float16", "float32"] and all(len(v) == 4 for v in steps.values())


@pytest.mark.parametrize("faster", ["float16", "float32"])
def test_self_ratio_pairs_the_chosen_copies(monkeypatch: pytest.MonkeyPatch, faster: str) -> None:
    """Scripted pre-pass: the faster dtype's copies A and B step in 8 ms x their own jitter
    (distinct values, so the interval depends on the rounds drawn, not only on ties), the
    slower's in 10 ms x the jitters swapped.  Every record carries the chosen dtype's A-vs-B
    ratio and interval; right values by hand in float64 from the record's per-round times
    (``prepass_decode_ms_<dtype>`` and ``..._b``): the ratio of the two medians, and the 2.5%
    and 97.5% linear quantiles of the ratio of medians over 2000 paired resamples of the
    rounds, drawn as the documented generator (seeded with the suite's seed, 0) draws them."""
    import statistics

    import kvbench.bench.workloads.latency as lat
    from kvbench.bench.metrics import RATIO_RESAMPLES

    ja = [1.013, 0.962, 1.047, 0.991, 1.028, 0.944, 1.071, 1.005, 0.977, 1.036, 0.958, 1.019]
    jb = [0.987, 1.042, 0.969, 1.011, 0.953, 1.064, 0.998, 1.026, 0.941, 1.033, 1.008, 0.972]
    fast = ([8.0 * j for j in ja], [8.0 * j for j in jb])
    slow = ([10.0 * j for j in jb], [10.0 * j for j in ja])
    b32, b16 = (slow, fast) if faster == "float16" else (fast, slow)
    ScriptedTimer.samples = _rounds([*b32, *b16]) + _two_way([3.0] * 12, [2.0] * 12)
    monkeypatch.setattr(lat, "Timer", ScriptedTimer)
    w, ctx = _workload(tiny_model(), context=40, steps=12, warmup=2, prefill_repeats=1)
    res = w.run(ctx, kvbench.get_method("full"))
    info = res.info
    assert ScriptedTimer.samples == []
    assert info["baseline_storage_dtype"] == faster
    a = res.per_layer[f"prepass_decode_ms_{faster}"]
    b = res.per_layer[f"prepass_decode_ms_{faster}_b"]
    assert (a, b) == fast

    def ratio(rounds: list[int], x: list[float], y: list[float]) -> float:
        return statistics.median([x[i] for i in rounds]) / statistics.median([y[i] for i in rounds])

    assert info["baseline_self_ratio"] == pytest.approx(ratio(list(range(12)), a, b), rel=1e-14)
    assert info["baseline_self_ratio"] != pytest.approx(ratio(list(range(12)), *slow), rel=1e-6)
    draws = torch.randint(
        0, 12, (RATIO_RESAMPLES, 12), generator=torch.Generator().manual_seed(0)
    ).tolist()
    r = sorted(ratio(d, a, b) for d in draws)

    def quantile(q: float) -> float:
        pos = q * (len(r) - 1)
        k = int(pos)
        return r[k] + (pos - k) * (r[k + 1] - r[k])

    lo, hi = info["baseline_self_interval"]
    assert (lo, hi) == pytest.approx((quantile(0.025), quantile(0.975)), rel=1e-12)
    assert lo < info["baseline_self_ratio"] < hi and lo < hi
    assert info["baseline_self_rounds"] == 12


def _prepared_shared(model, **params) -> tuple[Latency, RunContext, torch.Tensor]:
    """A ``prefill: shared`` latency workload at 40 tokens (4 steps, one prefill) over a fixed
    random prompt ``ids`` ``[1, 40]``, prepared on ``model``: ``(workload, context, ids)``;
    ``params`` add to or override its fields."""
    spec = dict(context=40, steps=4, prefill_repeats=1, prefill="shared") | params
    w = Latency(Latency.validate({"type": "latency", **spec}))
    ctx = RunContext(model=model, model_info={"max_position_embeddings": 256}, seed=0)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ctx.shared.token_ids[("latency-ids", "essays", 0, 40, 1)] = (ids, {})
    w.prepare(ctx)
    return w, ctx, ids


def test_full_against_itself_times_two_distinct_caches_of_one_state() -> None:
    """The ``full`` row's pair: two cache objects, prefilled from one shared capture, hold equal
    K/V in allocations of their own after the warm-up and timed steps (an append writes
    neither into the capture nor into the other cache)."""
    model = tiny_model()
    w, ctx, ids = _prepared_shared(model, warmup=2, baseline_storage_dtypes=ONE)
    captured = [k.clone() for k in w.prompt.captured.keys]
    full = kvbench.get_method("full")
    timed = w._time(ctx, {"method": full, "baseline": full})
    a, b = timed.caches["method"], timed.caches["baseline"]
    assert a is not b
    for la, lb in zip(a.layer_caches(), b.layer_caches(), strict=True):
        assert la is not lb and la.seq_length == lb.seq_length == 40
        for x, y in zip(la.keys_values(), lb.keys_values(), strict=True):
            assert torch.equal(x, y)
            assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    for k0, k1 in zip(captured, w.prompt.captured.keys, strict=True):
        assert torch.equal(k0, k1)


def test_prepass_runs_once_per_context_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three configurations at context 40 and two at 48 (threads 1), and one at 40 with
    threads 2, on one model's shared state: the pre-pass (two caches each of the two ``full``
    candidates timed alone) runs once per (context, threads), three times in all; every
    configuration times two caches, its own and the chosen baseline; records of one key carry
    the same choice and the same noise check."""
    timed: list[tuple[str, ...]] = []
    real = Latency._time

    def spy(self: Latency, ctx: RunContext, methods: dict) -> object:
        timed.append(tuple(methods))
        return real(self, ctx, methods)

    monkeypatch.setattr(Latency, "_time", spy)
    model = tiny_model()
    ctx = RunContext(model=model, model_info={"max_position_embeddings": 256}, seed=0)
    runs = [(40, 1, "full"), (40, 1, "kivi"), (40, 1, "hf-dynamic"), (48, 1, "full")]
    runs += [(48, 1, "kivi"), (40, 2, "full")]
    infos: dict[tuple[int, int], list[dict]] = {}
    for context, threads, name in runs:
        params = dict(context=context, threads=threads, steps=2, warmup=1, prefill_repeats=1)
        w = Latency(Latency.validate({"type": "latency", **params}))
        w.ids = torch.randint(0, 128, (1, context), generator=torch.Generator().manual_seed(1))
        w.info = {}
        config = KIVI8 if name == "kivi" else {}
        res = w.run(ctx, kvbench.get_method(name, **config))
        infos.setdefault((context, threads), []).append(res.info)
    prepass = ("float32 A", "float32 B", "float16 A", "float16 B")
    assert timed.count(prepass) == 3 and len(ctx.shared.latency_baselines) == 3
    assert [t for t in timed if t != prepass] == [("method", "baseline")] * len(runs)
    assert timed.index(prepass) == 0  # before the first configuration of its key
    for group in infos.values():
        assert len({i["baseline_storage_dtype"] for i in group}) == 1
        assert all(i["baseline_candidates"] == group[0]["baseline_candidates"] for i in group)
        for k in ("baseline_self_ratio", "baseline_self_interval", "baseline_self_rounds"):
            assert all(i[k] == group[0][k] for i in group) and group[0][k] is not None
        assert group[0]["baseline_self_rounds"] == 2


def test_steps_run_at_the_workload_threads_prefill_at_the_suites(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Suite threads 2 (torch's count when the run starts): the prefill calls see 2, every
    timed step the workload's ``threads`` (1 by default, 2 when set), recorded; torch's count
    is restored after the run."""
    import kvbench.bench.workloads.latency as lat

    monkeypatch.setattr(lat, "Timer", ThreadTimer)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for threads in (1, 2):
            ScriptedTimer.samples, ThreadTimer.threads = [1.0] * (2 + 2 * 3), []
            params = dict(context=40, steps=3, warmup=1, prefill_repeats=1)
            w, ctx = _workload(tiny_model(), baseline_storage_dtypes=ONE, threads=threads, **params)
            info = w.run(ctx, kvbench.get_method("full")).info
            assert ThreadTimer.threads == [2, 2] + [threads] * 6
            assert info["step_threads"] == threads and info["prefill_threads"] == 2
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_shared_prefill_captures_once_and_prefills_every_cache() -> None:
    """``prefill: shared``: ``prepare`` captures the prompt (P = 40 - 4 - 1 = 35 tokens) once per
    model; the kvbench caches (KIVI, both ``full`` baselines) and a peer's cache whose prefill
    is a replay (hf-dynamic) are prefilled from it without a model call, a peer whose prefill
    is not a replay (``replay_prefill`` answering False) by the model; every cache then holds P
    tokens and decodes the same 5 steps; no prefill is timed.  The shared prefill leaves the cache the
    model's own prefill leaves (same stored K/V)."""
    model = tiny_model()
    lengths: list[int] = []
    model.register_forward_pre_hook(
        lambda mod, args, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    w, ctx, ids = _prepared_shared(model, warmup=1)
    # the capture, then the pre-pass: two caches of each full candidate prefilled from it,
    # 5 rounds x 4
    assert lengths == [35] + [1] * 20 and len(ctx.shared.prompts) == 1
    Latency(w.spec).prepare(ctx)  # a second workload of the same spec reuses both
    assert lengths == [35] + [1] * 20 and len(ctx.shared.prompts) == 1
    lengths.clear()
    res = w.run(ctx, kvbench.get_method("kivi", **KIVI8))
    assert lengths == [1] * 10  # no prefill call: 5 rounds x 2 caches
    assert "prefill_ms" not in res.metrics and "prefill_ms_ratio" not in res.metrics
    assert "prefill_ms" not in res.per_layer and res.info["prefill_repeats"] == 0
    assert all(res.info["prefill_from_capture"].values())
    lengths.clear()
    res = w.run(ctx, kvbench.get_method("hf-dynamic"))
    assert lengths == [1] * 10  # the peer's prefill replayed from the capture
    assert all(res.info["prefill_from_capture"].values())
    assert res.metrics["bytes_total"] == 40 * 512  # all 40 tokens held
    lengths.clear()
    import kvbench.bench.workloads.latency as latency_module

    real = latency_module.replay_prefill
    latency_module.replay_prefill = lambda cache, captured: False  # a peer that is no replay
    try:
        res = w.run(ctx, kvbench.get_method("hf-dynamic"))
    finally:
        latency_module.replay_prefill = real
    assert lengths == [35] + [1] * 10  # then its prompt runs through the model
    assert res.info["prefill_from_capture"] == {"method": False, "baseline": True}
    assert res.metrics["bytes_total"] == 40 * 512
    # the captured prefill stores what the model's own prefill stores
    from kvbench.hf.cache import make_hf_cache

    a, b = (make_hf_cache(kvbench.get_method("full"), model) for _ in range(2))
    a.prefill_from(w.prompt.captured)
    model(input_ids=ids[:, :35], past_key_values=b, use_cache=True)
    for la, lb in zip(a.layer_caches(), b.layer_caches()):
        for x, y in zip(la.keys_values(), lb.keys_values()):
            torch.testing.assert_close(x, y)


def test_end_to_end_records() -> None:
    model = tiny_model()
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
        ({"threads": 0}, "field 'threads': 0 is not allowed; allowed: integers >= 1"),
        ({"prefill": "once"}, "field 'prefill': 'once' is not allowed"),
        ({"prefill": "shared"}, "field 'prefill_repeats': 3 is not allowed; allowed: 1"),
        ({"baseline_storage_dtypes": ["float8"]}, "field 'baseline_storage_dtypes'"),
        (
            {"baseline": "hf-dynamic"},
            "field 'baseline_storage_dtypes'.*allowed: \\['model'\\] for baseline 'hf-dynamic'",
        ),
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
    model = MaskRecorder(tiny_model())
    w, ctx = _batched(model, 3, context=40, steps=3, warmup=1, prefill_repeats=1, padding="left")
    res = w.run(ctx, kvbench.get_method("full"))
    lens = [36, 27, 18]
    ids, mask, pos = model.calls[0]
    assert ids.shape == mask.shape == pos.shape == (3, 36)
    assert mask.sum(-1).tolist() == lens and mask[:, -1].all()
    for b, k in enumerate(lens):
        assert pos[b, 36 - k :].tolist() == list(range(k))
        assert torch.equal(ids[b, 36 - k :], w.ids[b, 36 - k : 36])  # the row's own text
    decode = [c for c in model.calls if c[0].shape[1] == 1]
    # the pre-pass (full float32 A, B, float16 A, B): 4 rounds x 4, then the run (method,
    # baseline): 4 rounds x 2
    assert len(decode) == 16 + 8
    for i, (_, mask, pos) in enumerate(decode):
        j = i // 4 if i < 16 else (i - 16) // 2  # every cache of a round: the same position
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
    model = MaskRecorder(tiny_model())
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
        tiny_model(),
        4,
        context=40,
        steps=4,
        warmup=2,
        prefill_repeats=1,
        baseline_storage_dtypes=ONE,
    )
    m = w.run(ctx, kvbench.get_method("full")).metrics
    assert ScriptedTimer.samples == []
    assert m["decode_ms_mean"] == 5.0 and m["tokens_per_s"] == pytest.approx(800.0)
    assert m["tokens_per_s_ratio"] == pytest.approx(0.4)


def test_padded_batch_refuses_a_method_without_padding() -> None:
    w, ctx = _batched(tiny_model(), 2, context=40, steps=3, warmup=1, padding="left")
    with pytest.raises(ValueError, match="'hf-dynamic' does not support padded batches"):
        w.run(ctx, kvbench.get_method("hf-dynamic"))
    w, ctx = _batched(tiny_model(), 2, context=40, steps=3, warmup=1, prefill_repeats=1)
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


@pytest.mark.parametrize("name", ["hf-dynamic", "hf-quanto", "hf-fp8"])
def test_replayed_peer_prefill_is_the_models_own(name: str) -> None:
    """:func:`replay_prefill` of a peer's cache from the capture leaves exactly (bit for bit)
    the tensors the model's own prefill through that cache leaves, and the next decode step's
    logits equal.  Right value: the model's own prefill, run apart."""
    from kvbench.bench.workloads.latency import replay_prefill
    from kvbench.hf.cache import cache_kwarg
    from kvbench.hf.capture import capture_prompt
    from kvbench.hf.peers import hf_layer_tensors

    method = kvbench.get_method(name)
    if method.unavailable_reason():
        pytest.skip(method.unavailable_reason())
    model = tiny_model()
    ids = torch.randint(0, 128, (1, 41), generator=torch.Generator().manual_seed(2))
    prompt = capture_prompt(model, ids[:, :40])
    a, b = (method.transformers_cache(model) for _ in range(2))
    replayed = replay_prefill(a, prompt.captured)
    with torch.no_grad():
        model(input_ids=ids[:, :40], use_cache=True, **cache_kwarg(b, model))
    assert replayed
    for la, lb in zip(a.layers, b.layers, strict=True):
        ta, tb = hf_layer_tensors(la), hf_layer_tensors(lb)
        assert [x[:2] for x in ta] == [x[:2] for x in tb] and ta
        assert all(torch.equal(x[2], y[2]) for x, y in zip(ta, tb))
    with torch.no_grad():
        step = [
            model(input_ids=ids[:, 40:], use_cache=True, **cache_kwarg(c, model)) for c in (a, b)
        ]
    assert torch.equal(step[0].logits, step[1].logits)


def test_a_peer_whose_prefill_is_no_replay_is_refused() -> None:
    """A cache whose prefill ``update`` hands attention other K/V than it was given (its prompt
    would attend to a stored form, so the next layers' K/V are not the capture's) is no replay:
    :func:`replay_prefill` answers False."""
    from kvbench.bench.workloads.latency import replay_prefill
    from kvbench.hf.capture import capture_prompt

    class StoresFirst:
        def update(self, k, v, layer):
            return k.half().float(), v

    model = tiny_model()
    prompt = capture_prompt(model, torch.randint(0, 128, (1, 12)))
    assert not replay_prefill(StoresFirst(), prompt.captured)


def test_stored_prompt_attends_on_the_reference_route() -> None:
    """``prefill: shared`` with a ``prefill_attention: stored`` method: its prompt runs through
    the model (no capture can be its prefill) with its attention on the reference route (sdpa
    over the dequantized stored K/V: no ``LayerCache.attend`` call during the prompt), its
    decode steps on the attend route; the state equals the attend route's stored prefill up to
    float rounding.  Right value: the same prompt into a cache on the attend route."""
    from kvbench.cache.layer import LayerCache
    from kvbench.hf.cache import cache_kwarg, make_hf_cache

    model = tiny_model()
    method = kvbench.get_method("int4-block", block_size=16, prefill_attention="stored")
    w, ctx, ids = _prepared_shared(model, warmup=1)
    attends: list[int] = []
    real = LayerCache.attend

    def counting(self, query, *args, **kwargs):
        attends.append(query.shape[2])
        return real(self, query, *args, **kwargs)

    LayerCache.attend = counting
    try:
        res = w.run(ctx, method)
    finally:
        LayerCache.attend = real
    assert res.info["prefill_from_capture"] == {"method": False, "baseline": True}
    assert attends and set(attends) == {1}  # decode steps only: the prompt took sdpa
    assert res.info["attend_path_ran"] and res.info["attend_path_ran"] != ["None"]
    # the reference route's stored prefill leaves the attend route's state up to rounding
    from kvbench.bench.workloads.latency import stored_prompt

    a, b = (make_hf_cache(method, model, attend=True) for _ in range(2))
    with torch.no_grad():
        stored_prompt(
            a, lambda: model(input_ids=ids[:, :35], use_cache=True, **cache_kwarg(a, model))
        )
        model(input_ids=ids[:, :35], use_cache=True, **cache_kwarg(b, model))
    assert a.attend and b.attend
    for la, lb in zip(a.layer_caches(), b.layer_caches(), strict=True):
        for x, y in zip(la.keys_values(), lb.keys_values(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0.05)
