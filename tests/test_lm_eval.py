"""kvbench as an lm-evaluation-harness backend, and the ``lm_eval`` workload.

Right values: ``full`` through the kvbench backend equals lm-eval's own ``hf`` backend on the
same model (per-request log-likelihoods within float tolerance, identical greedy generations);
a 2-bit method's log-likelihoods equal kvbench's perplexity machinery
(:func:`kvbench.bench.workloads.perplexity.chunked_logits`) on the same context and continuation and
differ from ``full``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval not installed (pip install kvbench[lm-eval])"
)

from kvbench.integrations.lm_eval.backend import KVBenchLM  # noqa: E402
from kvbench.integrations.lm_eval.tasks import (  # noqa: E402
    TASK_DIR,
    TaskDataUnavailable,
    hub_guard,
    local_task_names,
)

GSM8K = Path(os.environ.get("KVBENCH_DATA_DIR", "")) / "gsm8k" / "test.jsonl"
_skip_without_gsm8k = pytest.mark.skipif(
    not os.environ.get("KVBENCH_DATA_DIR") or not GSM8K.is_file(),
    reason="needs dataset gsm8k: $KVBENCH_DATA_DIR/gsm8k/test.jsonl (set KVBENCH_DATA_DIR)",
)


def needs_gsm8k(test):
    """Skip without the local GSM8K rows; marked ``data`` so CI fails if it skips there."""
    return pytest.mark.data(_skip_without_gsm8k(test))


LL_TASK, GEN_TASK = "gsm8k_local_answer_ll", "gsm8k_local"


# ---------------------------------------------------------------------- no model needed
def test_directions_agree_with_lm_eval_registry():
    import lm_eval.api.metrics  # noqa: F401  (registers lm-eval's metrics)
    from lm_eval.api.registry import HIGHER_IS_BETTER_REGISTRY

    from kvbench.bench.workloads.metrics import HIGHER, LM_EVAL_DIRECTIONS, LOWER, direction

    checked = 0
    for name, higher in HIGHER_IS_BETTER_REGISTRY.items():
        if name in LM_EVAL_DIRECTIONS:
            assert LM_EVAL_DIRECTIONS[name] == (HIGHER if higher else LOWER), name
            checked += 1
    assert checked >= 10
    assert direction("lm_eval.gsm8k.exact_match,strict-match") == HIGHER
    assert direction("lm_eval.gsm8k_local_answer_ll.perplexity,none") == LOWER
    assert direction("lm_eval.gsm8k.exact_match_stderr,strict-match") == "none"
    assert direction("lm_eval.gsm8k.kv_quantized_fraction") == "none"  # coverage, informational


def test_unknown_method_and_field_named_through_lm_eval():
    with pytest.raises(ValueError, match=r"unknown method 'kivvi'.*did you mean 'kivi'"):
        lm_eval.simple_evaluate(model="kvbench", model_args="method=kivvi", tasks=[LL_TASK])
    with pytest.raises(ValueError, match=r"\['bitz'\].*method config fields: \[.*'bits'"):
        lm_eval.simple_evaluate(model="kvbench", model_args="method=kivi,bitz=2", tasks=[LL_TASK])
    with pytest.raises(ValueError) as err:
        KVBenchLM(method="kivi", nope=1)
    assert "'residual_length'" in str(err.value) and "token_axis_keys" not in str(err.value)
    assert "backend arguments: [" in str(err.value) and "'chunk'" in str(err.value)
    with pytest.raises(ValueError, match=r"bits"):  # a bad value: the method's own message
        KVBenchLM(method="kivi", bits=11)


def test_method_config_file_and_batch_refusal(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("method: kivi\nbits: 2\nresidual_length: 32\ngroup_size: 32\nnope: 1\n")
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['nope'\]"):
        KVBenchLM(method=None, method_config=str(cfg))
    with pytest.raises(ValueError, match=r"batch_size=4.*one request at a time"):
        KVBenchLM(method="full", batch_size=4)
    with pytest.raises(ValueError, match=r"batch_size='auto'"):
        KVBenchLM(method="full", batch_size="auto")


def test_local_tasks_listed():
    names = local_task_names()
    assert {LL_TASK, GEN_TASK} <= set(names)
    assert all(p.parent == TASK_DIR for p in names.values())


def test_hub_task_offline_names_task_and_local_route(tmp_path, monkeypatch):
    (tmp_path / "t.yaml").write_text(
        "task: needs_hub_task\ndataset_path: kvbench-test/not-a-dataset\noutput_type: "
        "loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
    )
    monkeypatch.setenv("KVBENCH_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with pytest.raises(TaskDataUnavailable) as err, hub_guard():
        tm.load_task_or_group(["needs_hub_task"])
    msg = str(err.value)
    assert "'needs_hub_task'" in msg and "kvbench-test/not-a-dataset" in msg
    assert "--include_path" in msg and "dataset_path: json" in msg and LL_TASK in msg
    from lm_eval.api.task import ConfigurableTask

    assert ConfigurableTask.download.__name__ == "download"  # restored
    assert not hasattr(ConfigurableTask.download, "__wrapped__")


def test_cli_registers_backend_and_adds_local_tasks(monkeypatch):
    import sys

    import lm_eval.__main__ as lm_main

    seen = {}

    def fake_cli():
        from lm_eval.api.registry import get_model

        seen["argv"] = list(sys.argv)
        seen["model"] = get_model("kvbench")

    monkeypatch.setattr(lm_main, "cli_evaluate", fake_cli)
    from kvbench.cli import main

    assert main(["lm-eval", "--model", "kvbench", "--tasks", LL_TASK]) == 0
    assert seen["model"] is KVBenchLM
    assert seen["argv"][:5] == ["lm-eval", "--model", "kvbench", "--tasks", LL_TASK]
    assert seen["argv"][-2:] == ["--include_path", str(TASK_DIR)]


def test_workload_validation():
    from kvbench.bench.workloads import WORKLOADS

    cls = WORKLOADS.get("lm_eval")
    spec = cls.validate({"type": "lm_eval", "tasks": "gsm8k"})
    assert spec["tasks"] == ["gsm8k"] and spec["chunk"] == 1
    with pytest.raises(ValueError, match="tasks"):
        cls.validate({"type": "lm_eval", "tasks": []})
    with pytest.raises(ValueError, match="field 'chunk': 0 is not allowed; allowed: integers"):
        cls.validate({"type": "lm_eval", "tasks": ["x"], "chunk": 0})
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['fewshot'\]"):
        cls.validate({"type": "lm_eval", "tasks": ["x"], "fewshot": 2})


def test_sidecar_beside_record_not_read_as_record(tmp_path):
    from kvbench.bench.records import load_records, sidecar_path, write_atomic, write_jsonl_atomic

    rec = tmp_path / "abcd.json"
    side = sidecar_path(rec, "samples.jsonl")
    assert side == tmp_path / "abcd.samples.jsonl"
    write_jsonl_atomic(side, [{"a": 1}, {"b": [2]}])
    assert [json.loads(x) for x in side.read_text().splitlines()] == [{"a": 1}, {"b": [2]}]
    write_atomic(
        rec, {"schema_version": 1, "run_id": "abcd", "method": "m", "config": {}, "metrics": {}}
    )
    assert len(load_records(tmp_path)) == 1
    with pytest.raises(ValueError):
        sidecar_path(rec, "x.json")


# ---------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def model_tok():
    from kvbench.hf.attention import register
    from kvbench.hf.models import load_model

    model, tok, _ = load_model(attn_implementation=register())
    return model, tok


def _evaluate(lm, tasks, limit, **kw):
    from kvbench.integrations.lm_eval.tasks import task_manager

    with hub_guard():
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            limit=limit,
            task_manager=task_manager(tasks),
            log_samples=True,
            bootstrap_iters=0,
            **kw,
        )


def _lls(out, task):
    return [s["resps"][0][0] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
@needs_gsm8k
def test_full_equals_hf_backend_loglikelihood_and_generation(model_tok):
    from lm_eval.models.huggingface import HFLM

    model, tok = model_tok
    kv = KVBenchLM(pretrained=model, tokenizer=tok, method="full")
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=1)
    kw = {"num_fewshot": 1, "gen_kwargs": {"max_gen_toks": 8}}
    a, b = (_evaluate(lm, [LL_TASK, GEN_TASK], 1, **kw) for lm in (kv, hf))
    for (ll_a, g_a), (ll_b, g_b) in zip(_lls(a, LL_TASK), _lls(b, LL_TASK)):
        assert ll_a == pytest.approx(ll_b, abs=1e-3, rel=1e-4) and g_a == g_b
    ta = [s["resps"][0][0] for s in a["samples"][GEN_TASK]]
    tb = [s["resps"][0][0] for s in b["samples"][GEN_TASK]]
    assert ta == tb and all(t.strip() for t in ta)
    ctx = [e["context_tokens"] for e in kv.request_log]
    assert len(ctx) == 2 and min(ctx) > 100  # 1-shot prompts
    # rolling log-likelihood (one window: prefix token + the text, decoded token by token)
    from lm_eval.api.instance import Instance

    req = Instance("loglikelihood_rolling", {}, ("The cat sat on the mat. It was warm.",), 0)
    assert kv.loglikelihood_rolling([req])[0] == pytest.approx(
        hf.loglikelihood_rolling([req])[0], abs=1e-3
    )


@pytest.mark.slow
@needs_gsm8k
def test_two_bit_loglikelihood_reads_quantized_context(model_tok):
    from kvbench.bench.workloads.perplexity import chunked_logits
    from kvbench.cache.registry import get_method

    model, tok = model_tok
    kw = {"bits": 2, "value_bits": 2, "group_size": 32, "residual_length": 32}
    kv = KVBenchLM(pretrained=model, tokenizer=tok, method="kivi", **kw)
    out = _evaluate(kv, [LL_TASK], 1, num_fewshot=1)
    (sample,) = out["samples"][LL_TASK]
    ((ll, _),) = _lls(out, LL_TASK)
    ctx, cont = kv._encode_pair(*sample["arguments"][0])
    ids, target = torch.tensor([ctx + cont]), torch.tensor(cont)[:, None]

    def own(method):  # kvbench's perplexity machinery: prefill ctx[:-1], then exact decode
        lp, _ = chunked_logits(model, ids, method, prefill=len(ctx) - 1, chunk=1)
        return float(lp[-len(cont) :].gather(1, target).sum())

    assert ll == pytest.approx(own(get_method("kivi", **kw)), abs=1e-4)
    assert abs(ll - own(get_method("full"))) > 1e-2  # the 2-bit past changes the numbers
    (entry,) = kv.request_log
    assert entry["quantized_fraction"] > 0.6  # R = 32 of > 100 context tokens stay exact
    assert entry["scored_tokens"] == len(cont) and entry["context_tokens"] == len(ctx)


@pytest.mark.slow
@needs_gsm8k
def test_workload_records_metrics_manifest_and_samples(tmp_path):
    from kvbench.bench.runner import run_suite
    from kvbench.bench.suite import parse_suite
    from kvbench.report.compare import Gate, compare
    from kvbench.report.tables import summary_table

    suite = parse_suite(
        {
            "name": "lm",
            "methods": [
                "full",
                {
                    "name": "kivi",
                    "config": {"bits": 2, "value_bits": 2, "group_size": 32, "residual_length": 32},
                },
            ],
            "workloads": [
                {
                    "type": "lm_eval",
                    "tasks": [LL_TASK],
                    "limit": 1,
                    "num_fewshot": 1,
                    "bootstrap_iters": 0,
                }
            ],
        }
    )
    recs = run_suite(suite, tmp_path, quiet=True)
    assert len(recs) == 2
    by = {r.method: r for r in recs}
    m = by["kivi"].metrics
    key = f"lm_eval.{LL_TASK}.perplexity,none"
    assert key in m and f"lm_eval.{LL_TASK}.acc,none" in m
    assert (
        0.5 < m["kv_quantized_fraction"] <= 1 and by["full"].metrics["kv_quantized_fraction"] == 0
    )
    assert m["nominal_key_bits"] < 16 and f"{key}_ratio" in m
    man = by["kivi"].manifest
    assert man["lm_eval"]["versions"][LL_TASK] == 1.0
    assert man["lm_eval"]["configs"][LL_TASK]["num_fewshot"] == 1
    assert man["datasets"]["gsm8k"]["source"] == "local"
    side = tmp_path / f"{by['kivi'].run_id}.samples.jsonl"
    rows = [json.loads(x) for x in side.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["kvbench"][0]["quantized_fraction"] > 0.5
    assert "lm_eval" in summary_table(recs) and key in summary_table(recs)
    worse = copy.deepcopy(by["kivi"])
    worse.metrics[key] *= 1.10  # perplexity up 10%: a regression (lower is better)
    gates = [Gate.parse(f"{key}:5%")]
    assert compare([by["kivi"]], [by["kivi"]], gates)[1] == []
    assert compare([by["kivi"]], [worse], gates)[1]
    from kvbench.report.plots import write_plots

    paths = write_plots(
        recs + [dataclasses.replace(worse, run_id="x", method="kivi2")], tmp_path / "plots"
    )
    assert any("lm_eval" in p.name and "perplexity" in p.name for p in paths)
