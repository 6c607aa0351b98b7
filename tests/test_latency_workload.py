"""The ``latency`` workload: percentiles, the interleaving protocol, ratios against the
interleaved baseline, the runner keeping them, bad input.

Right values: percentiles by hand (linear interpolation between order statistics, numpy's
default); the call order of the protocol (prefill both, then rounds alternating A B / B A) from
the workload's documented schedule; the number of tokens each cache holds from the context.
A tiny random Llama (2 layers) runs the end-to-end test; timing values themselves are not
asserted beyond their algebra (ratios = value / baseline value of the same call).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvbench
from kvbench.hf.attention import use_kvbench_attention
from kvbench.run.runner import run_suite
from kvbench.run.suite import parse_suite
from kvbench.workloads.latency import CPU_NOTE, Latency, percentile, summarize


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_percentiles_by_hand() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)  # 4 + 0.6 * (5 - 4)
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    s = summarize([10.0, 20.0, 30.0, 40.0])
    assert s["decode_ms_p50"] == 25.0 and s["decode_ms_mean"] == 25.0
    assert s["tokens_per_s"] == pytest.approx(40.0)  # 1000 ms / 25 ms
    with pytest.raises(ValueError):
        percentile([], 50)


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


def _workload(model, **params) -> tuple[Latency, SimpleNamespace]:
    w = Latency(Latency.validate({"type": "latency", **params}))
    ctx = SimpleNamespace(model=model, model_info={"max_position_embeddings": 256}, seed=0)
    w.ids = torch.randint(
        0, 128, (1, w.spec["context"]), generator=torch.Generator().manual_seed(1)
    )
    w.info = {}
    return w, ctx


class Recorder:
    """Wraps a model's forward to record which cache each call used and how many tokens."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []
        self.config = model.config

    def parameters(self):
        return self.model.parameters()

    def forward(self, input_ids=None, cache=None, use_cache=True, logits_to_keep=0):
        self.calls.append((id(cache), input_ids.shape[1]))
        return self.model(
            input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep
        )

    __call__ = forward


def test_protocol_prefill_then_alternating_rounds() -> None:
    model = Recorder(_tiny_model())
    w, ctx = _workload(model, context=40, steps=4, warmup=2, baseline="hf-dynamic")
    res = w.run(ctx, kvbench.get_method("kivi", bits=2, group_size=8, residual_length=8))
    calls = model.calls
    # prefill: P = 40 - 4 - 2 = 34 tokens, method first, then baseline
    assert [n for _, n in calls[:2]] == [34, 34]
    a, b = calls[0][0], calls[1][0]
    assert a != b
    # 6 rounds of one token each; order A B, B A, A B, ...
    order = [c for c, _ in calls[2:]]
    assert order == [a, b, b, a, a, b, b, a, a, b, b, a]
    assert all(n == 1 for _, n in calls[2:])
    assert len(res.per_layer["decode_ms"]) == 4 and len(res.per_layer["baseline_decode_ms"]) == 4


def test_end_to_end_metrics_and_ratios() -> None:
    model = _tiny_model()
    w, ctx = _workload(model, context=48, steps=5, warmup=1)
    res = w.run(
        ctx, kvbench.get_method("kivi", bits=2, value_bits=2, group_size=8, residual_length=8)
    )
    m, info, per = res.metrics, res.info, res.per_layer
    assert m["decode_ms_p50"] == pytest.approx(percentile(per["decode_ms"], 50))
    ref = summarize(per["baseline_decode_ms"])
    for k in ("decode_ms_p50", "decode_ms_p90", "decode_ms_p99", "tokens_per_s"):
        assert m[f"{k}_ratio"] == pytest.approx(m[k] / ref[k])
        assert info[f"baseline_{k}"] == pytest.approx(ref[k])
    assert m["prefill_ms_ratio"] == pytest.approx(m["prefill_ms"] / info["baseline_prefill_ms"])
    assert info["baseline"] == "full" and info["cuda_graphs"] is False
    assert info["threads"] == 1 and info["timing"] == "time.perf_counter_ns"
    assert info["timing_note"] == CPU_NOTE
    # auto: kvbench methods decode through LayerCache.attend (code-domain fast path when it fits)
    assert "LayerCache.attend" in info["attention_path"]
    assert m["bytes_total"] > 0
    # a peer runs through its transformers cache
    res = w.run(ctx, kvbench.get_method("hf-dynamic"))
    assert "transformers cache" in res.info["attention_path"]
    # 48 tokens x 2 layers x K and V x 2 heads x 16 x 4 bytes (float32 model)
    assert res.metrics["bytes_total"] == 48 * 2 * 2 * 2 * 16 * 4


def test_runner_keeps_interleaved_ratios(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner adds ``*_ratio`` against the ``full`` record only where the workload did not
    measure its own."""
    from kvbench.workloads import Result

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
    recs = {r["method"]: r["metrics"] for r in run_suite(suite, tmp_path, quiet=True)}
    assert recs["kivi"]["decode_ms_p50_ratio"] == 1.5  # the workload's own, not 4.0 / 1.0
    assert recs["kivi"]["prefill_ms_ratio"] == 4.0  # added by the runner: 40 / 10


@pytest.mark.parametrize(
    "params, match",
    [
        ({"context": 20, "steps": 20, "warmup": 3}, "context > warmup \\+ steps"),
        ({"steps": 0}, "steps >= 1"),
        ({"warmup": -1}, "warmup >= 0"),
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
    ctx = SimpleNamespace(model_info={"max_position_embeddings": 8192, "model_id": "m"}, shared={})
    with pytest.raises(ValueError, match="context=8200 exceeds the model's maximum context 8192"):
        w.prepare(ctx)
