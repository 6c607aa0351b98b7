"""Refusals of an eviction suite's bad inputs before any work (issue 49): an evictor that scores by the decode
attention on a workload path that hands none over, a prefill-only budget above the tokens a
workload sees and a keep ratio outside (0, 1) are refused when the suite is read, naming the
field and the allowed values."""

from __future__ import annotations

import pytest

from kvbench.bench import validate
from kvbench.bench.preflight import check_contexts, evictor_problems
from kvbench.bench.suite import parse_suite

CHECKS = (validate.check_devices, check_contexts)
MODEL = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}


def _suite(methods: list, workloads: list) -> dict:
    return {"name": "s", "model": MODEL, "methods": methods, "workloads": workloads}


def test_an_evictor_scoring_by_decode_attention_on_a_path_without_it_is_refused() -> None:
    mem = {"type": "memory", "source": "model", "text": "essays", "context": 256}
    data = _suite(
        [
            {"name": "h2o", "config": {"keep_ratio": 0.5}},
            {"name": "tova", "label": "tova half", "config": {"keep_ratio": 0.5}},
            {"name": "snapkv", "config": {"keep_ratio": 0.5}},  # prefill only: fine
            {"name": "streamingllm", "config": {"keep_ratio": 0.5}},  # scores by position
        ],
        [{**mem, "path": "reference"}, {**mem, "path": "attend"}],
    )
    with pytest.raises(validate.SuiteErrors) as info:
        parse_suite(data, "s.yaml", CHECKS)
    errors = info.value.errors
    assert len(errors) == 2, errors
    assert errors[0].startswith("s.yaml: methods[0] (h2o) on workloads[0] (memory): field 'path'")
    assert "allowed with this method: path 'attend'" in errors[0]
    assert "methods[1] (tova half)" in errors[1]


def test_a_prefill_only_budget_above_the_tokens_seen_is_refused() -> None:
    ruler = {"type": "ruler11", "lengths": [512, 1024], "tasks": ["cwe"], "protect_suffix": 64}
    data = _suite(
        [
            {"name": "knorm", "config": {"budget_tokens": 600}},
            {"name": "snapkv", "config": {"budget_tokens": 512}},  # at most the shortest: fine
            {"name": "streamingllm", "config": {"budget_tokens": 600}},  # a decode cap: fine
        ],
        [ruler],
    )
    with pytest.raises(validate.SuiteErrors) as info:
        parse_suite(data, "s.yaml", CHECKS)
    (err,) = info.value.errors
    assert "methods[0] (knorm) on workloads[0] (ruler11): field 'budget_tokens': 600" in err
    assert "allowed: at most 512, or keep_ratio in (0, 1)" in err


@pytest.mark.parametrize("ratio", [0, 1, 1.5, -0.5])
def test_a_keep_ratio_outside_the_open_interval_is_refused_when_read(ratio) -> None:
    data = _suite(
        [{"name": "knorm", "config": {"keep_ratio": ratio}}],
        [{"type": "ruler11", "lengths": [512], "tasks": ["cwe"], "protect_suffix": 64}],
    )
    with pytest.raises(ValueError, match=r"keep_ratio.*allowed: a number in \(0, 1\)"):
        parse_suite(data, "s.yaml", CHECKS)


def test_a_question_aware_protocol_needs_tasks_with_a_question(monkeypatch) -> None:
    import dataclasses

    from kvbench.bench.tasks import ruler_tasks as rt

    bare = dataclasses.replace(rt.RULER11["cwe"], question=None)
    monkeypatch.setitem(rt.RULER11, "cwe", bare)
    data = _suite(
        ["full"],
        [
            {
                "type": "ruler11",
                "lengths": [512],
                "tasks": ["cwe"],
                "protocol": "question-aware",
                "protect_suffix": 64,
            }
        ],
    )
    with pytest.raises(ValueError, match=r"protocol.*'question-agnostic'"):
        parse_suite(data, "s.yaml", CHECKS)


def test_methods_that_are_not_evictors_raise_no_evictor_problem() -> None:
    data = _suite(
        ["full", "kivi"],
        [{"type": "memory", "source": "model", "text": "essays", "context": 256,
          "path": "reference"}],
    )  # fmt: skip
    assert evictor_problems(parse_suite(data, "s.yaml")) == []
