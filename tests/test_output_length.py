"""The ``output_length`` workload (kvbench.bench.workloads.output_length): passages of whole
sentences, per-prompt length ratios to ``full`` and the shares longer / capped on stubbed
lengths computed by hand, and a tiny-Llama run that produces its metrics."""

from __future__ import annotations

import pytest

from kvbench.bench.context import RunContext
from kvbench.bench.intervals import wilson_ci
from kvbench.bench.workloads import check_metrics
from kvbench.bench.workloads.output_length import OutputLength, passages, spread
from kvbench.cache.registry import get_method


@pytest.fixture(scope="module")
def tiny():
    from tiny_lm import tiny_lm

    return tiny_lm(16)


def make(**params) -> OutputLength:
    return OutputLength(OutputLength.validate({"type": "output_length", **params}))


def test_passages_are_runs_of_whole_sentences() -> None:
    text = "One two three. Four five! Six seven eight nine? Ten. Eleven twelve."
    assert passages(text, 4) == ["One two three. Four five!", "Six seven eight nine?"]
    assert spread(10, 4) == [1, 3, 6, 8]
    assert len(set(spread(83, 16))) == 16
    with pytest.raises(ValueError):
        spread(3, 4)


def test_ratios_and_shares_on_stubbed_lengths(tiny) -> None:
    _, tok, info = tiny
    w = make(num_prompts=4, new_tokens=50)
    ctx = RunContext(tokenizer=tok, model_info=info, seed=0)
    full_lengths = [10, 20, 0, 50]
    mine = [10, 30, 3, 50]  # ratios 1, 1.5, 3 (full gave 0 tokens: max(., 1)), 1
    reason = ["eos", "eos", "eos", "length"]

    def stub(lengths, reasons):
        it = iter(zip(lengths, reasons))
        return lambda c, m, ids: dict(
            zip(("new_tokens", "stop_reason"), next(it)), text="x", prompt_tokens=1
        )

    w.generate = stub(full_lengths, ["eos", "eos", "eos", "length"])
    w.prepare(ctx)
    assert [r["new_tokens"] for r in w.full] == full_lengths
    w.generate = stub(mine, reason)
    res = w.run(ctx, get_method("full"))
    rows = res.per_layer["prompts"]
    assert [r["ratio"] for r in rows] == [1.0, 1.5, 3.0, 1.0]
    assert [r["longer"] for r in rows] == [False, True, True, False]
    m = res.metrics
    assert m["outlen_ratio_mean"] == pytest.approx(6.5 / 4)
    assert m["outlen_longer_share"] == 0.5
    assert (m["outlen_longer_share_ci_low"], m["outlen_longer_share_ci_high"]) == wilson_ci(2, 4)
    assert m["outlen_capped_share"] == 0.25
    assert m["outlen_full_capped_share"] == 0.25
    assert m["outlen_tokens_mean"] == pytest.approx(93 / 4)
    assert m["outlen_full_tokens_mean"] == 20
    check_metrics(OutputLength, m)


def test_tiny_llama_run_records_the_metrics(tiny) -> None:
    model, tok, info = tiny
    w = make(num_prompts=3, new_tokens=8, passage_words=30)
    ctx = RunContext(model=model, tokenizer=tok, model_info=info, seed=0)
    w.prepare(ctx)
    full = w.run(ctx, get_method("full"))
    assert all(r["ratio"] == 1.0 for r in full.per_layer["prompts"])  # full against itself
    res = w.run(ctx, get_method("kivi", bits=2, group_size=16, residual_length=16))
    check_metrics(OutputLength, res.metrics)
    assert {
        "outlen_prompts",
        "outlen_ratio_mean",
        "outlen_longer_share",
        "outlen_longer_share_ci_low",
        "outlen_longer_share_ci_high",
        "outlen_capped_share",
        "outlen_capped_share_ci_low",
        "outlen_capped_share_ci_high",
        "outlen_tokens_mean",
        "outlen_full_tokens_mean",
    } <= set(res.metrics)
    assert res.metrics["outlen_prompts"] == 3
    for r in res.per_layer["prompts"]:
        assert r["ratio"] == max(r["new_tokens"], 1) / max(r["full_new_tokens"], 1)
        assert r["capped"] == (r["stop_reason"] == "length")


@pytest.mark.parametrize(
    "params,match",
    [({"longer": 0.5}, "longer"), ({"num_prompts": 0}, "num_prompts"), ({"path": "x"}, "path")],
)
def test_bad_parameters_name_the_field(params, match) -> None:
    with pytest.raises(ValueError, match=match):
        make(**params)
