"""suites/eviction.yaml and the refusals of its bad inputs before any work (issue 49): the
suite and the reduced CPU command its header gives parse; an evictor that scores by the decode
attention on a workload path that hands none over, a prefill-only budget above the tokens a
workload sees and a keep ratio outside (0, 1) are refused when the suite is read, naming the
field and the allowed values."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvbench.bench import validate
from kvbench.bench.preflight import check_contexts, evictor_problems
from kvbench.bench.suite import load_suite, parse_set, parse_suite
from kvbench.report.equal_bytes import BUDGETS, family

SUITE = Path(__file__).resolve().parents[1] / "suites" / "eviction.yaml"
CHECKS = (validate.check_devices, check_contexts)
MODEL = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}


def header_command() -> list[str]:
    """The reduced CPU command of the suite's header, as argv after ``kvbench``."""
    text = SUITE.read_text()
    block = re.search(r"#   kvbench run suites/eviction\.yaml(.*?)\n#   kvbench report", text, re.S)
    assert block, "the header gives the reduced command"
    body = " ".join(ln.lstrip("# ").rstrip("\\ ") for ln in block.group(1).splitlines())
    return shlex.split(body)


def test_the_suite_and_its_reduced_command_parse() -> None:
    suite = load_suite(SUITE, checks=CHECKS)
    argv = header_command()
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert "--limit" in argv and len(sets) >= 10
    reduced = load_suite(SUITE, parse_set(sets), checks=CHECKS)
    assert [w["type"] for w in reduced.workloads] == [w["type"] for w in suite.workloads]
    assert reduced.workloads[0]["lengths"] == [512] and reduced.workloads[2]["tokens"] == 512
    assert {w.get("protocol") for w in suite.workloads if w["type"] == "ruler11"} == {
        "question-agnostic",
        "question-aware",
    }


def test_the_suite_has_every_family_at_every_budget_and_16_bit_storage() -> None:
    suite = load_suite(SUITE)
    names = {m.name for m in suite.methods}
    assert {"full", "streamingllm", "snapkv", "h2o", "tova", "knorm"} <= names
    for m in suite.methods:
        q = m.config.get("quantizer")
        stored = q["config"] if isinstance(q, dict) else m.config
        assert stored.get("storage_dtype") == "float16", m.label
    keep = {}
    for m in suite.methods:
        q = m.config.get("quantizer")
        if isinstance(q, dict) and q["name"] == "full":
            keep.setdefault(m.name, set()).add(m.config["keep_ratio"])
    assert keep == {n: set(BUDGETS) for n in ("streamingllm", "snapkv", "h2o", "tova", "knorm")}

    class R:  # what family() reads of a record
        def __init__(self, m):
            self.method, self.config = m.name, m.config

    fams = {family(R(m)) for m in suite.methods}
    assert fams == {"full", "eviction", "quantization", "combined"}


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


CPU_SUITE = SUITE.with_name("eviction-cpu.yaml")


def test_the_cpu_suite_has_every_row_of_the_gpu_suite_and_no_latency() -> None:
    """suites/eviction-cpu.yaml copies eviction.yaml's rows (the suite format has no include):
    the same labels and configurations in the same order, the same model, seed and
    calibration; its workloads are the GPU suite's ruler11 (both protocols) and perplexity, at
    CPU sizes (no output_length, no latency)."""
    gpu, cpu = load_suite(SUITE, checks=CHECKS), load_suite(CPU_SUITE, checks=CHECKS)
    assert [(m.label, m.name, m.config) for m in cpu.methods] == [
        (m.label, m.name, m.config) for m in gpu.methods
    ]
    for key in ("seed", "models", "calibration"):
        assert getattr(cpu, key) == getattr(gpu, key), key
    assert [w["type"] for w in cpu.workloads] == ["ruler11", "ruler11", "perplexity"]
    ruler = [w for w in cpu.workloads if w["type"] == "ruler11"]
    assert [w["protocol"] for w in ruler] == ["question-agnostic", "question-aware"]
    (ppl,) = [w for w in cpu.workloads if w["type"] == "perplexity"]
    scored = (ppl["tokens"] - ppl["prefill"]) * ppl["windows"]
    assert scored >= 2 * 32, "two blocks of 32 scored tokens or more: the KL has an interval"
    assert ppl["tokens"] * min(BUDGETS) >= 64, "keep 0.125 keeps a meaningful share"
