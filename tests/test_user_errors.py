"""The harness as a user meets it: every bad input is one line naming the file, the entry and
the field (no traceback), caught before any model loads; Ctrl-C keeps what finished and says
how to resume; records get the umask's permissions; ``run --json`` is one object."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from kvbench.bench import validate
from kvbench.bench.suite import DEFAULT_CALIBRATION, load_suite, parse_suite
from kvbench.cli import main

SMOKE = Path(__file__).resolve().parents[1] / "suites" / "smoke.yaml"
MODEL_FREE = {
    "name": "mf",
    "model": "none",
    "methods": ["full", {"name": "kivi", "config": {"bits": [2, 4]}}],
    "workloads": [{"type": "bits", "head_dim": 64, "tokens": 1024}],
}


def _suite(tmp_path: Path, data: dict, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def _smoke() -> dict:
    return yaml.safe_load(SMOKE.read_text())


#: the index a method appended to suites/smoke.yaml's list gets (the list grows with each
#: method a contributor adds, so no test may hard-code it), and the index of its ``kitty`` entry
APPENDED = len(_smoke()["methods"])
KITTY = [m if isinstance(m, str) else m["name"] for m in _smoke()["methods"]].index("kitty")


def _error(capsys, *argv) -> str:
    rc = main([*argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


BAD_SUITES = [
    # (edit of smoke.yaml, the words the one-line error must contain)
    (
        lambda d: d.update(storage_dtype="float8_e4m3fn"),
        [
            "s.yaml",
            "field 'storage_dtype': 'float8_e4m3fn' is not allowed",
            "allowed: float16 or bfloat16",
            "or float32 (the compute dtype",
        ],
    ),
    (lambda d: d.update(seed="zero"), ["s.yaml", "field 'seed': 'zero'", "integer"]),
    (lambda d: d.update(threads=0), ["s.yaml", "field 'threads': 0", ">= 1"]),
    (
        lambda d: d.update(calibration={"text": "bogus", "tokens": -1, "foo": 1}),
        ["calibration", "['foo']", "allowed: ['text', 'tokens']"],
    ),
    (lambda d: d.update(calibration={"tokens": -1}), ["field 'calibration.tokens': -1", ">= 16"]),
    (lambda d: d.update(calibration={"text": 3}), ["field 'calibration.text': 3", "a text name"]),
    (
        lambda d: d["methods"].__setitem__(5, {"name": "kivi", "config": {"bits": 9}}),
        ["s.yaml", "methods[5] (kivi)", "field 'bits': 9", "allowed: 1..8 or 16"],
    ),
    (
        lambda d: d["methods"].__setitem__(5, {"name": "kivi", "config": {"bits": [2, 9]}}),
        ["methods[5] (kivi[bits=9])", "field 'bits': 9"],
    ),
    (
        lambda d: d["methods"].__setitem__(5, {"name": "kivi", "config": {"value_group_size": 0}}),
        ["methods[5] (kivi)", "field 'value_group_size': 0", ">= 1"],
    ),
    (lambda d: d["methods"].__setitem__(1, "kivii"), ["methods[1]", "kivi"]),
    (lambda d: d.update(methods=[]), ["s.yaml", "'methods' must be a non-empty list"]),
    (lambda d: d.update(workloads=[]), ["'workloads' must be a non-empty list"]),
    (
        lambda d: d["workloads"].append({"type": "fidelty"}),
        ["workloads[2]", "'fidelty'", "did you mean 'fidelity'"],
    ),
    (
        lambda d: d["methods"].append("kitty"),
        [f"methods[{KITTY}] and methods[{APPENDED}]", "label 'kitty'"],
    ),
    (
        lambda d: d["workloads"][0].update(tokens=-1),
        ["workloads[0] (fidelity)", "field 'tokens': -1", "integers >= 2"],
    ),
    (
        lambda d: d["workloads"][1].update(windows="two"),
        ["workloads[1] (perplexity)", "field 'windows': 'two'", "integers >= 1"],
    ),
    (
        lambda d: d["workloads"][1].update(protocol="exact"),
        [
            "workloads[1] (perplexity)",
            "field 'protocol': 'exact'",
            "'write-then-attend', 'in-chunk-full', 'exact-chunked'",
        ],
    ),
    # tokens 1280 - prefill 1024 = 256 tokens fed in chunks: a larger chunk is never one
    (
        lambda d: d["workloads"][1].update(chunk=300),
        [
            "workloads[1] (perplexity)",
            "field 'chunk': 300",
            "integers 1..256 (<= tokens - prefill)",
        ],
    ),
    (
        lambda d: d["model"].update(dtype="float23"),
        ["model", "field 'dtype': 'float23'", "float32", "did you mean"],
    ),
    (lambda d: d.update(modle={}), ["unknown key(s) ['modle']", "did you mean 'model'"]),
    # a passkey run of no examples divided by zero in the middle of the suite
    (
        lambda d: d["workloads"].append({"type": "passkey", "seeds": 0}),
        ["workloads[2] (passkey)", "field 'seeds': 0", "integers >= 1"],
    ),
    (
        lambda d: d["workloads"].append({"type": "passkey", "depths": []}),
        ["workloads[2] (passkey)", "field 'depths': []", "non-empty list"],
    ),
]


@pytest.mark.parametrize(("edit", "words"), BAD_SUITES)
def test_bad_suite_is_one_line_naming_file_entry_field(tmp_path, capsys, edit, words) -> None:
    data = _smoke()
    edit(data)
    err = _error(capsys, "run", str(_suite(tmp_path, data)), "--out", str(tmp_path / "o"))
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").glob("*.json"))


def test_every_bad_field_of_a_suite_in_one_refusal(tmp_path, capsys) -> None:
    """Four independent errors (a config field, a method name, a context past the model's
    maximum, and so past the smoke suite's PM-KVQ budget) are refused at once, each on its
    line, instead of one per run."""
    data = _smoke()
    data["methods"][5] = {"name": "kivi", "config": {"bits": 9}}
    data["methods"][1] = "kivii"
    data["workloads"][0].update(tokens=9000)  # SmolLM2-135M: 8192 positions
    rc = main(["run", str(_suite(tmp_path, data)), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    header, *lines = err.strip().splitlines()
    assert header.endswith("s.yaml: 4 errors:"), err
    assert [line.split(":")[0].strip() for line in lines] == [
        "methods[1]",
        "methods[5] (kivi)",
        "workloads[0] (fidelity)",
        "methods[10] (pm-kvq)",
    ], err
    assert "unknown method 'kivii'" in lines[0] and "did you mean 'kivi'" in lines[0], err
    assert "field 'bits': 9 is not allowed; allowed: 1..8 or 16" in lines[1], err
    assert "tokens=9000 exceeds the maximum context" in lines[2] and "8192" in lines[2], err
    assert "budget_tokens=1792 holds at most 1408 tokens" in lines[3], err
    assert not (tmp_path / "o").exists()


def test_parse_suite_collects_every_error() -> None:
    """:func:`parse_suite` alone: one ``ValueError`` listing every refused configuration of a
    sweep, a method name and a workload field, each message as a single error reads."""
    data = _smoke()
    data["methods"][5] = {"name": "kivi", "config": {"bits": [9, 2, 10]}}
    data["methods"].append("kivy")
    data["workloads"][1].update(windows="two")
    with pytest.raises(validate.SuiteErrors) as info:
        parse_suite(data, "s.yaml")
    bits = "s.yaml: methods[5] (kivi[bits={0}]): KIVIConfig: field 'bits': {0} is not allowed; "
    assert info.value.errors == [
        bits.format(9) + "allowed: 1..8 or 16",
        bits.format(10) + "allowed: 1..8 or 16",
        info.value.errors[2],
        "s.yaml: workloads[1] (perplexity): field 'windows': 'two' is not allowed; allowed: "
        "integers >= 1",
    ]
    assert info.value.errors[2].startswith(f"s.yaml: methods[{APPENDED}]: unknown method 'kivy'")
    text = str(info.value)
    assert text.splitlines()[0] == "s.yaml: 4 errors:"
    assert text.splitlines()[1:] == ["  " + e.removeprefix("s.yaml: ") for e in info.value.errors]
    # one error alone reads as before: its message, on one line
    data["methods"][5]["config"]["bits"] = [2, 9]
    data["methods"].pop()
    data["workloads"][1].update(windows=1)
    with pytest.raises(ValueError) as one:
        parse_suite(data, "s.yaml")
    assert str(one.value) == bits.format(9) + "allowed: 1..8 or 16"


def test_checks_of_devices_and_contexts_report_every_entry(monkeypatch) -> None:
    """The checks ``kvbench run`` adds (a device this torch lacks, contexts past the model's
    maximum) name every bad entry in the same refusal as the fields."""
    import torch

    from kvbench.bench.preflight import check_contexts

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = _smoke()
    data["model"]["device"] = "cuda"
    data["seed"] = -1
    data["workloads"][0].update(tokens=9000)
    data["workloads"][1].update(tokens=8200)
    checks = (validate.check_devices, check_contexts)
    with pytest.raises(validate.SuiteErrors) as info:
        parse_suite(data, "s.yaml", checks)
    assert [e.split(":")[1].strip() for e in info.value.errors] == [
        "field 'seed'",
        "model",
        "workloads[0] (fidelity)",
        "workloads[1] (perplexity)",
    ], info.value.errors
    assert "no CUDA device is available" in info.value.errors[1]
    assert "tokens=8200 exceeds" in info.value.errors[3]


def test_calibration_block_reaches_the_suite() -> None:
    s = load_suite(SMOKE)
    assert s.calibration == _smoke()["calibration"] and s.calibration["tokens"] == 1024
    d = _smoke()
    del d["calibration"]
    assert parse_suite(d, "x.yaml").calibration == DEFAULT_CALIBRATION


def test_set_paths_that_do_not_exist(capsys) -> None:
    err = _error(capsys, "run", str(SMOKE), "--set", "workloads.5.tokens=3")
    assert "--set workloads.5.tokens" in err and "2 entries" in err
    err = _error(capsys, "run", str(SMOKE), "--set", "seed.x=3")
    assert "'seed' is 0" in err
    err = _error(capsys, "run", str(SMOKE), "--set", "workloads.0.tokns=3")
    assert "unknown parameter(s) ['tokns']" in err


def test_cuda_on_a_cpu_torch_fails_before_the_model(tmp_path, capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d = _smoke()
    d["model"]["device"] = "cuda"
    err = _error(capsys, "run", str(_suite(tmp_path, d)), "--out", str(tmp_path / "o"))
    assert "s.yaml: model: device='cuda': no CUDA device is available" in err
    d["model"]["device"] = "tpu"
    err = _error(capsys, "run", str(_suite(tmp_path, d)), "--out", str(tmp_path / "o"))
    assert "allowed: cpu, cuda, cuda:N, mps" in err


def test_output_folder_that_is_a_file(tmp_path, capsys) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    err = _error(capsys, "run", str(_suite(tmp_path, MODEL_FREE)), "--out", str(f))
    assert f"--out {f}: is a file" in err


def test_read_only_output_folder(tmp_path, capsys, monkeypatch) -> None:
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(validate.tempfile, "mkstemp", refuse)
    err = _error(capsys, "run", str(_suite(tmp_path, MODEL_FREE)), "--out", str(tmp_path / "o"))
    assert "cannot write records there (Read-only file system)" in err


def test_unexpected_error_is_one_line_and_debug_shows_traceback(
    tmp_path, capsys, monkeypatch
) -> None:
    import kvbench.bench.workloads.bits as bits

    monkeypatch.setattr(bits.Bits, "run", lambda self, ctx, m: 1 / 0)
    argv = ["run", str(_suite(tmp_path, MODEL_FREE)), "--out", str(tmp_path / "o"), "--quiet"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "internal error: ZeroDivisionError" in err and "Traceback" not in err
    assert main([*argv, "--debug"]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_ctrl_c_keeps_finished_records_and_says_how_to_resume(
    tmp_path, capsys, monkeypatch
) -> None:
    import kvbench.bench.workloads.bits as bits

    real, calls = bits.Bits.run, []

    def interrupt_second(self, ctx, method):
        calls.append(method.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, ctx, method)

    monkeypatch.setattr(bits.Bits, "run", interrupt_second)
    out = tmp_path / "o"
    argv = ["run", str(_suite(tmp_path, MODEL_FREE)), "--out", str(out), "--quiet"]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert f"1 finished record(s) kept in {out}" in err and "resume with:" in err
    assert len(list(out.glob("*.json"))) == 1
    monkeypatch.setattr(bits.Bits, "run", real)
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["records"]) == 3
    assert sorted(r["label"] for r in summary["records"]) == [
        "full",
        "kivi[bits=2]",
        "kivi[bits=4]",
    ]


def test_records_get_the_umask_permissions(tmp_path) -> None:
    from kvbench.bench.records import write_atomic

    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640


def test_run_records_threads_and_memory(tmp_path) -> None:
    assert main(["run", str(_suite(tmp_path, MODEL_FREE)), "--out", str(tmp_path), "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert rec["manifest"]["threads"] >= 1
    assert rec["manifest"]["memory"]["peak_rss_bytes"] > 10 * 2**20


def test_free_cpus_subtracts_load(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "getloadavg", lambda: (6.2, 0, 0))
    assert validate.free_cpus() == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (30.0, 0, 0))
    assert validate.free_cpus() == 1


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--head-dim", "0"], "even integer >= 2"),
        (["--head-dim", "63"], "63 must be an even integer"),
        (["--tokens", "-5"], "-5 must be an integer >= 1"),
        (["--set", "bits=0"], "field 'bits': 0 is not allowed; allowed: 1..8 or 16"),
        (["--set", "bits=3.5"], "field 'bits': 3.5 is not allowed; allowed: 1..8 or 16"),
    ],
)
def test_bits_argument_ranges(capsys, args, words) -> None:
    try:
        rc = main(["bits", "kivi", *args])
    except SystemExit as exc:  # argparse
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and words in err, err


@pytest.mark.parametrize("limit", ["0", "-3", "two"])
def test_run_limit_is_refused_before_any_work(tmp_path, capsys, limit) -> None:
    """``--limit`` below 1 (or not an integer) is an argparse error naming the option, before
    the suite is read (no run log is written)."""
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "run",
                str(_suite(tmp_path, MODEL_FREE)),
                "--out",
                str(tmp_path / "o"),
                "--limit",
                limit,
            ]
        )
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--limit" in err and not (tmp_path / "o").exists(), err


def test_version_and_clean_help(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("kvbench ")
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and "kvbench run suites/" in out


def test_every_shipped_suite_parses() -> None:
    for p in sorted(SMOKE.parent.rglob("*.yaml")):
        load_suite(p)


def test_config_that_does_not_fit_the_model_names_the_entry() -> None:
    d = _smoke()
    d["methods"][5] = {"name": "kivi", "config": {"value_bits": 2, "value_group_size": 48}}
    suite = parse_suite(d, "s.yaml")  # fits until the head_dim is known
    info = {"head_dim": 64, "num_key_value_heads": 3}
    with pytest.raises(ValueError, match=r"s\.yaml: methods\[5\] \(kivi\): value_group_size=48"):
        validate.check_methods_for_model(suite.methods, info, suite.path)
    validate.check_methods_for_model(suite.methods, {**info, "head_dim": 96}, suite.path)


def test_model_free_config_error_names_entry_and_workload(tmp_path, capsys) -> None:
    d = {
        **MODEL_FREE,
        "methods": [{"name": "kivi", "config": {"value_bits": 2, "value_group_size": 48}}],
        "workloads": [
            {
                "type": "memory",
                "source": "synthetic",
                "context": 256,
                "num_layers": 1,
                "head_dim": 64,
            }
        ],
    }
    err = _error(capsys, "run", str(_suite(tmp_path, d)), "--out", str(tmp_path / "o"), "--quiet")
    assert "s.yaml: methods[0] (kivi) in workloads[0] (memory): value_group_size=48" in err


def test_a_closed_pipe_is_not_an_error() -> None:
    """``kvbench list | head -1``: the reader leaves early; kvbench prints no error."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvbench.cli", "list"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    proc.stdout.close()  # the reader is gone before kvbench writes its first line
    err = proc.stderr.read().decode()
    assert proc.wait() in (0, 141) and "Broken pipe" not in err and "error" not in err, err


def test_every_bad_field_of_one_method_entry_is_named() -> None:
    """Three refused fields of one entry give three errors (not the first one alone), each
    naming the entry, its field and the allowed values; a lone refused field stays one."""
    data = _smoke()
    data["methods"][5] = {"name": "kivi", "config": {"bits": 9, "value_bits": 17, "group_size": 0}}
    with pytest.raises(validate.SuiteErrors) as info:
        parse_suite(data, "s.yaml")
    pre = "s.yaml: methods[5] (kivi): KIVIConfig: field "
    assert sorted(info.value.errors) == sorted(
        [
            pre + "'bits': 9 is not allowed; allowed: 1..8 or 16",
            pre + "'value_bits': 17 is not allowed; allowed: 1..8 or 16",
            pre + "'group_size': 0 is not allowed; allowed: integers >= 1",
        ]
    )
    data["methods"][5] = {"name": "kivi", "config": {"bits": 9}}
    with pytest.raises(validate.SuiteErrors) as info:
        parse_suite(data, "s.yaml")
    assert info.value.errors == [pre + "'bits': 9 is not allowed; allowed: 1..8 or 16"]


def test_every_bad_parameter_of_one_workload_is_named() -> None:
    data = _smoke()
    data["workloads"][1].update(windows=0, chunk=0)
    with pytest.raises(validate.SuiteErrors) as info:
        parse_suite(data, "s.yaml")
    assert {e.split("field ")[1].split(":")[0] for e in info.value.errors} == {
        "'windows'",
        "'chunk'",
    }


def test_a_mistyped_field_does_not_hide_the_entry_s_bad_values() -> None:
    """An unknown config name is refused, and the known fields of the same entry are checked
    too: both the misspelt name and the out-of-range value are named."""
    data = _smoke()
    data["methods"][5] = {"name": "kivi", "config": {"bits": 9, "grop_size": 32}}
    with pytest.raises(validate.SuiteErrors) as info:
        parse_suite(data, "s.yaml")
    errors = info.value.errors
    assert len(errors) == 2, errors
    assert "unknown config field(s) ['grop_size']" in errors[0]
    assert errors[1] == (
        "s.yaml: methods[5] (kivi): KIVIConfig: field 'bits': 9 is not allowed; allowed: 1..8 or 16"
    )


def test_suite_storage_dtype_reaches_every_layer_cache_method() -> None:
    """docs/design.md#storage-dtype: the suite's ``storage_dtype`` is each layer-cache
    method's unless its entry sets the field (``null``: the compute dtype); transformers peers
    keep their own dtype; the compute dtype itself or no key leaves every config as written
    (so run ids stay those of records made before the key)."""
    d = {
        **MODEL_FREE,
        "model": {"id": "m", "dtype": "float32"},
        "storage_dtype": "float16",
        "methods": [
            "full",
            {"name": "kivi", "config": {"bits": [2, 4]}},
            {"name": "full", "label": "full f32", "config": {"storage_dtype": None}},
            {"name": "pn-mix", "config": {"storage_dtype": "bfloat16"}},
            "kvquant",
            "hf-dynamic",
        ],
    }
    got = {m.label: m.config.get("storage_dtype", "absent") for m in parse_suite(d).methods}
    assert got == {
        "full": "float16", "kivi[bits=2]": "float16", "kivi[bits=4]": "float16",
        "full f32": None, "pn-mix": "bfloat16", "kvquant": "float16", "hf-dynamic": "absent",
    }  # fmt: skip
    for same in ("float32", None):
        d["storage_dtype"] = same
        assert [m.config for m in parse_suite(d).methods][:2] == [{}, {"bits": 2}]
    d["storage_dtype"] = "float64"
    with pytest.raises(ValueError, match=r"field 'storage_dtype': 'float64' is not allowed; "):
        parse_suite(d, "s.yaml")
    d["storage_dtype"] = "float16"
    d["methods"] = [{"name": "hf-dynamic", "config": {"storage_dtype": "float16"}}]
    with pytest.raises(ValueError, match=r"methods\[0\] \(hf-dynamic\).*'storage_dtype'"):
        parse_suite(d, "s.yaml")  # a peer told to store 16-bit: refused, never faked
