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
    "lm_eval", reason="lm-eval not installed (pip install -e '.[lm-eval]')"
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

    from kvbench.bench.metrics import HIGHER, LM_EVAL_DIRECTIONS, LOWER, direction

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
    with pytest.raises(ValueError, match=r"batch_size=4.*one request at a time") as err:
        KVBenchLM(method="full", batch_size=4)
    msg = str(err.value)  # why, and what to use instead
    assert "left padding only" in msg and "chunk=C" in msg and "--model hf" in msg
    with pytest.raises(ValueError, match=r"batch_size='auto'"):
        KVBenchLM(method="full", batch_size="auto")
    with pytest.raises(
        ValueError, match=r"min_quantized_fraction=1.5 must be a number in \[0, 1\]"
    ):
        KVBenchLM(method="full", min_quantized_fraction=1.5)
    with pytest.raises(ValueError, match=r"kvbench backend: field 'protocol': 'chunked'"):
        KVBenchLM(method="full", protocol="chunked")
    # exact-chunked needs its caller to cut the calls (docs/design.md#protocols): refused
    with pytest.raises(ValueError, match=r"allowed: \['write-then-attend', 'in-chunk-full'\]$"):
        KVBenchLM(method="full", protocol="exact-chunked")


def test_local_tasks_listed():
    names = local_task_names()
    assert {LL_TASK, GEN_TASK} <= set(names)
    assert all(p.parent == TASK_DIR for p in names.values())


def test_local_gsm8k_without_data_names_both_tasks_and_the_data_folder(monkeypatch):
    # a new user offline without a data folder runs gsm8k_local_answer_ll: the error must name
    # that task (not only gsm8k_local) and say where the rows go
    import kvbench.data.loaders as loaders
    from kvbench.integrations.lm_eval.tasks import gsm8k_local

    def missing(name, split):
        raise FileNotFoundError(f"dataset {name!r} is not available (test)")

    monkeypatch.setattr(loaders, "load_rows", missing)
    with pytest.raises(TaskDataUnavailable) as err:
        gsm8k_local()
    msg = str(err.value)
    assert LL_TASK in msg and GEN_TASK in msg
    assert "$KVBENCH_DATA_DIR/gsm8k/test.jsonl" in msg and "dataset 'gsm8k'" in msg


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
    from lm_eval.tasks import TaskManager

    seen = {}

    def fake_cli():
        from lm_eval.api.registry import get_model

        seen["argv"] = list(sys.argv)
        seen["model"] = get_model("kvbench")
        seen["tasks"] = set(TaskManager(include_defaults=False).all_tasks)

    monkeypatch.setattr(lm_main, "cli_evaluate", fake_cli)
    from kvbench.cli import main

    assert main(["lm-eval", "--model", "kvbench", "--tasks", LL_TASK]) == 0
    assert seen["model"] is KVBenchLM
    assert seen["argv"] == ["lm-eval", "--model", "kvbench", "--tasks", LL_TASK]  # unchanged
    assert {LL_TASK, GEN_TASK} <= seen["tasks"]  # kvbench's folder on every task index


def test_workload_validation():
    from kvbench.bench.workloads import WORKLOADS

    cls = WORKLOADS.get("lm_eval")
    spec = cls.validate({"type": "lm_eval", "tasks": "gsm8k"})
    assert spec["tasks"] == ["gsm8k"] and spec["chunk"] == 1
    assert spec["protocol"] == "write-then-attend"
    with pytest.raises(ValueError, match=r"field 'protocol': 'x' is not allowed; allowed: \["):
        cls.validate({"type": "lm_eval", "tasks": ["x"], "protocol": "x"})
    with pytest.raises(ValueError, match=r"'exact-chunked' is not allowed; allowed: \['write"):
        cls.validate({"type": "lm_eval", "tasks": ["x"], "protocol": "exact-chunked"})
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
        recs + [dataclasses.replace(worse, run_id="x", manifest={**worse.manifest, "label": "k2"})],
        tmp_path / "plots",
    )
    assert any("lm_eval" in p.name and "perplexity" in p.name for p in paths)


# ---------------------------------------------------------------------- the CLI as a user meets it
def test_lm_eval_alone_does_not_know_kvbench():
    """The premise of `kvbench lm-eval`: lm-eval 0.4 has no model entry points, so a process
    that did not import the backend answers `--model kvbench` with its unknown-model error."""
    import subprocess
    import sys

    code = "from lm_eval.api.registry import get_model; get_model('kvbench')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "'kvbench', but no model for this name found" in r.stderr


def test_help_shows_lm_eval_run_options(capsys):
    from kvbench.cli import main

    for argv in (["lm-eval", "--help"], ["lm-eval"], ["lm-eval", "run", "-h"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "kvbench lm-eval --model kvbench" in out and "lm_eval --model kvbench" in out
        for opt in ("--model_args", "--num_fewshot", "--include_path", "--output_path"):
            assert opt in out, (argv, opt)  # lm-eval run's own options
        assert "min_quantized_fraction" in out


def test_docs_commands_use_the_wrapper():
    """Every command of docs/lm-eval.md that names `--model kvbench` runs `kvbench lm-eval`."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "lm-eval.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    commands = [c for b in blocks for c in b.replace("\\\n", " ").splitlines()]
    named = [c for c in commands if "--model kvbench" in c]
    assert named and all(c.lstrip().startswith("kvbench lm-eval ") for c in named), named
    flat = " ".join(text.split())  # lm-eval's error, why, and the fix
    assert "`lm_eval --model kvbench ...` does **not** work" in flat
    assert "but no model for this name found!" in flat


def test_include_path_merged_with_kvbench_tasks(tmp_path):
    from lm_eval.tasks import TaskManager

    from kvbench.integrations.lm_eval.cli import cli_patches, include_paths

    sep, tasks = os.pathsep, str(TASK_DIR)
    assert include_paths(None, TASK_DIR) == [tasks]
    assert include_paths("mine", TASK_DIR) == ["mine", tasks]
    assert include_paths(f"a{sep}{sep}b", TASK_DIR) == ["a", "b", tasks]
    assert include_paths(["a", f"b{sep}c"], TASK_DIR) == ["a", "b", "c", tasks]
    assert include_paths([tasks + "/", "a"], TASK_DIR) == [tasks + "/", "a"]  # once
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "t.yaml").write_text(
            f"task: {name}_task\ndataset_path: json\noutput_type: loglikelihood\n"
        )
    folders = f"{tmp_path / 'one'}{sep}{tmp_path / 'two'}"
    with cli_patches():
        tm = TaskManager(include_path=folders, include_defaults=False)
    assert {"one_task", "two_task", LL_TASK, GEN_TASK} <= set(tm.all_tasks)
    plain = TaskManager(include_path=str(tmp_path / "one"), include_defaults=False)
    assert LL_TASK not in plain.all_tasks  # restored on exit


def test_output_folder_named_after_method_and_config(tmp_path):
    from kvbench.integrations.lm_eval.naming import MAX_NAME, output_folder_name

    name = output_folder_name("pretrained=default,method=kivi,bits=2,value_bits=2,device=cpu")
    assert name == "default__kivi-bits2-value_bits2"
    assert output_folder_name("pretrained=org/m,value_bits=2,method=kivi,bits=2") == (
        "org_m__kivi-bits2-value_bits2"
    )
    assert output_folder_name("") == "default__full"
    assert output_folder_name({"pretrained": "default", "method": "kivi", "chunk": 4}) == (
        "default__kivi-chunk4"
    )
    cfg = tmp_path / "m.yaml"
    cfg.write_text("method: kivi\nbits: 4\ncalibration: {text: t, tokens: 8}\n")
    assert output_folder_name(f"method_config={cfg},bits=2,min_quantized_fraction=0") == (
        "default__kivi-bits2-calibrationtext_t_tokens_8"
    )
    long_a = output_folder_name("method=x," + ",".join(f"f{i}={i}" for i in range(60)))
    long_b = output_folder_name("method=x," + ",".join(f"f{i}={i + 1}" for i in range(60)))
    assert len(long_a) == len(long_b) == MAX_NAME and long_a != long_b


def test_quantized_fraction_per_task_by_hand():
    from kvbench.integrations.lm_eval.coverage import low_coverage_message, per_task

    log = [
        {"task": "a", "quantized_fraction": 0.5, "past_tokens_read": 10, "context_tokens": 20},
        {"task": "a", "quantized_fraction": 0.0, "past_tokens_read": 30, "context_tokens": 40},
        {"task": "b", "quantized_fraction": 0.9, "past_tokens_read": 10, "context_tokens": 300},
        {"task": "c", "quantized_fraction": None, "past_tokens_read": 10, "context_tokens": 5},
        {"task": "d", "quantized_fraction": 0.0, "past_tokens_read": 0, "context_tokens": 1},
    ]
    fr = per_task(log)
    assert fr == {"a": 5 / 40, "b": 0.9, "c": None, "d": 0.0}
    msg = low_coverage_message(fr, log, 0.5, "kivi", 128)
    assert "a: 0.125 (mean context 30 tokens)" in msg and "d: 0.000" in msg
    assert "b:" not in msg and "c:" not in msg and "residual_length=128" in msg
    assert low_coverage_message(fr, log, 0.0, "kivi", 128) is None


# ---------------------------------------------------------------------- tiny model, local task
TINY_TASK = "kvbench_test_tiny_ll"


def _tiny_task(folder: Path, words: int) -> Path:
    """A loglikelihood task over 3 local rows whose contexts have ``words`` essay words."""
    from kvbench.bench.tasks.haystack import haystack_sentences

    folder.mkdir(parents=True, exist_ok=True)
    text = " ".join(haystack_sentences("essay")[700:800]).split()
    rows = folder / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"q": " ".join(text[i * 7 : i * 7 + words]), "a": text[i * 7 + words]})
            + "\n"
            for i in range(3)
        )
    )
    (folder / "tiny.yaml").write_text(
        f"task: {TINY_TASK}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {rows}\n"
        "test_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: ' {{a}}'\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )
    return folder


def test_quantized_fraction_in_results_and_warned_once(tmp_path):
    import warnings

    from lm_eval.tasks import TaskManager
    from tiny_lm import tiny_lm

    from kvbench.integrations.lm_eval.coverage import LowQuantizedFractionWarning

    model, tok, _ = tiny_lm()
    tm = TaskManager(include_path=str(_tiny_task(tmp_path / "t", 30)), include_defaults=False)
    kw = {"bits": 2, "group_size": 8, "residual_length": 8}
    quant = KVBenchLM(pretrained=model, tokenizer=tok, method="kivi", **kw)
    short = KVBenchLM(pretrained=model, tokenizer=tok, method="kivi", bits=2)  # R = 128
    outs = {}
    for name, lm in (("quant", quant), ("short", short)):
        with warnings.catch_warnings(record=True) as seen, hub_guard():
            warnings.simplefilter("always")
            outs[name] = lm_eval.simple_evaluate(
                model=lm, tasks=[TINY_TASK], task_manager=tm, bootstrap_iters=0
            )
            lm.get_model_info()  # a second call: no second warning
        outs[name, "warned"] = [w for w in seen if w.category is LowQuantizedFractionWarning]
    got = outs["quant"]["config"]["kvbench_kv_quantized_fraction"][TINY_TASK]
    log = quant.request_log
    assert len(log) == 3 and min(e["context_tokens"] for e in log) > 40
    by_hand = sum(e["quantized_fraction"] * e["past_tokens_read"] for e in log) / sum(
        e["past_tokens_read"] for e in log
    )
    assert got == pytest.approx(by_hand) and 0.5 < got < 1
    assert outs["quant", "warned"] == []
    assert outs["short"]["config"]["kvbench_kv_quantized_fraction"] == {TINY_TASK: 0.0}
    assert outs["short"]["config"]["kvbench_min_quantized_fraction"] == 0.5
    (w,) = outs["short", "warned"]  # once, with the numbers
    assert f"{TINY_TASK}: 0.000 (mean context" in str(w.message)
    assert "residual_length=128" in str(w.message)
    silent = KVBenchLM(pretrained=model, tokenizer=tok, method="kivi", min_quantized_fraction=0)
    silent.request_log = list(short.request_log)
    full = KVBenchLM(pretrained=model, tokenizer=tok, method="full")
    full.request_log = [dict(e, quantized_fraction=0.0) for e in short.request_log]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        silent.get_model_info()
        full.get_model_info()  # exact storage: 0 is expected, no warning


def test_cli_two_methods_own_folders_and_merged_include_path(tmp_path, monkeypatch):
    """`kvbench lm-eval` end to end on a saved tiny model: two methods into one --output_path
    write two folders; the user's --include_path keeps kvbench's tasks; the results JSON
    carries kv_quantized_fraction."""
    from lm_eval.tasks import TaskManager
    from tiny_lm import tiny_lm

    from kvbench.cli import main

    model, tok, _ = tiny_lm()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    tasks = _tiny_task(tmp_path / "tasks", 20)
    built = []
    init = TaskManager.__init__

    def no_defaults(self, *a, **k):  # lm-eval's full index takes a minute: local tasks only
        k["include_defaults"] = False
        init(self, *a, **k)
        built.append(self)

    monkeypatch.setattr(TaskManager, "__init__", no_defaults)
    out = tmp_path / "out"
    common = ["--tasks", TINY_TASK, "--limit", "2", "--output_path", str(out), "--device", "cpu"]
    yaml_cfg = tmp_path / "run.yaml"  # lm-eval's --config: include_path from a YAML
    yaml_cfg.write_text(f"include_path: {tasks}\n")
    for args, where in (
        ("method=full", ["--include_path", str(tasks)]),
        ("method=kivi,bits=2,group_size=8,residual_length=8", ["--config", str(yaml_cfg)]),
    ):
        model_args = f"pretrained={tmp_path / 'model'},{args}"
        argv = ["lm-eval", "--model", "kvbench", "--model_args", model_args, *common]
        assert main([*argv, *where]) == 0
        assert {LL_TASK, GEN_TASK, TINY_TASK} <= set(built[-1].all_tasks)
    folders = sorted(p.name for p in out.iterdir())
    prefix = str(tmp_path / "model").strip("/").replace("/", "_")
    assert folders == [
        f"{prefix}__full",
        f"{prefix}__kivi-bits2-group_size8-residual_length8",
    ]
    (kivi,) = (out / folders[1]).glob("results_*.json")
    cfg = json.loads(kivi.read_text())["config"]
    assert cfg["kvbench_method"] == "kivi" and cfg["kvbench_config"]["residual_length"] == 8
    assert 0 < cfg["kvbench_kv_quantized_fraction"][TINY_TASK] <= 1
    (full,) = (out / folders[0]).glob("results_*.json")
    assert json.loads(full.read_text())["config"]["kvbench_kv_quantized_fraction"] == {
        TINY_TASK: 0.0
    }


def test_missing_lm_eval_hint_installs_from_the_clone(monkeypatch):
    # kvbench is not on the package index: `pip install 'kvbench[lm-eval]'` fails there
    import sys

    from kvbench.integrations.lm_eval import require_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(RuntimeError) as err:
        require_lm_eval()
    msg = str(err.value)
    assert "pip install -e '.[lm-eval]'" in msg and "kvbench[lm-eval]" not in msg
    assert "lm-eval>=0.4.13,<0.5" in msg


def test_bootstrap_stderr_forks_no_pool_under_kvbench(monkeypatch):
    """lm-eval's bootstrap standard error forks a ``multiprocessing.Pool`` unless
    ``DISABLE_MULTIPROC`` is set; a fork of this threaded process once left a pool worker in a
    futex wait for good.  Inside ``serial_bootstrap`` (around every kvbench lm-eval call) it
    runs in-process; the variable is restored after, and a user's own value is kept."""
    import multiprocessing
    import statistics

    from lm_eval.api.metrics import bootstrap_stderr

    from kvbench.integrations.lm_eval.tasks import serial_bootstrap

    def no_pool(*a, **k):
        raise AssertionError("multiprocessing.Pool used")

    monkeypatch.setattr(multiprocessing, "Pool", no_pool)
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    with pytest.raises(AssertionError, match="Pool used"):
        bootstrap_stderr(statistics.mean, [0.0, 1.0] * 8, iters=100)
    with serial_bootstrap():
        assert bootstrap_stderr(statistics.mean, [0.0, 1.0] * 8, iters=100) > 0
    assert "DISABLE_MULTIPROC" not in os.environ
    monkeypatch.setenv("DISABLE_MULTIPROC", "yes")
    with serial_bootstrap():
        assert os.environ["DISABLE_MULTIPROC"] == "yes"
    assert os.environ["DISABLE_MULTIPROC"] == "yes"
