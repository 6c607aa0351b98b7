"""Small things a user hits (issue #41): a second run into a locked --out, a compare with nothing
in common, a context beyond the model's maximum, a non-UTF-8 suite, help texts, and the CPU
allocator's stray profiler warning."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from kvbench.bench.outlock import LOCK_NAME, output_lock
from kvbench.bench.preflight import check_contexts
from kvbench.bench.suite import load_suite, parse_suite
from kvbench.cli import build_parser, main
from kvbench.hf.models import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
BITS = {
    "name": "bits-tiny",
    "methods": ["full", "kivi"],
    "workloads": [{"type": "bits", "head_dim": 64, "tokens": 256}],
}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _suite(tmp_path: Path, data: dict, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def _one_error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


# --- one run per --out -----------------------------------------------------------------------


def test_second_run_into_a_locked_out_fails_naming_the_holder(tmp_path, capsys) -> None:
    suite, out = _suite(tmp_path, BITS), tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from kvbench.bench.outlock import output_lock\n"
            f"with output_lock({str(out)!r}):\n"
            "    print('locked', flush=True)\n"
            "    time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        out.mkdir()
        assert holder.stdout.readline().strip() == "locked"
        err = _one_error(capsys, ["run", str(suite), "--out", str(out), "--quiet"])
        assert f"pid {holder.pid} on host {socket.gethostname()} since 20" in err, err
        assert str(out / LOCK_NAME) in err
        assert not list(out.glob("*.json"))  # the second run wrote nothing
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: its lock file stays, and blocks nothing
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid
    assert main(["run", str(suite), "--out", str(out), "--quiet"]) == 0
    assert len(list(out.glob("*.json"))) == 2


def test_lock_is_exclusive_and_released(tmp_path) -> None:
    with output_lock(tmp_path) as path:
        info = json.loads(path.read_text())
        assert (info["pid"], info["host"]) == (os.getpid(), socket.gethostname())
        with pytest.raises(RuntimeError, match=rf"pid {os.getpid()} on host"):
            with output_lock(tmp_path):
                pass
    with output_lock(tmp_path):  # released: taken again
        pass


# --- compare with nothing in common ----------------------------------------------------------


def test_compare_with_no_common_records_says_so(tmp_path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    suite = _suite(tmp_path, BITS)
    assert main(["run", str(suite), "--out", str(a), "--quiet"]) == 0
    assert (
        main(["run", str(suite), "--out", str(b), "--quiet", "--set", "workloads.0.tokens=512"])
        == 0
    )
    capsys.readouterr()
    err = _one_error(capsys, ["compare", str(a), str(b)])
    assert "no records in common" in err
    assert f"{a} has 2 record(s), {b} has 2" in err
    err = _one_error(capsys, ["compare", str(a), str(b), "--json"])
    assert "no records in common" in err


# --- a context beyond the model's maximum ----------------------------------------------------


def test_context_beyond_the_maximum_is_refused_before_the_folder_is_made(tmp_path, capsys) -> None:
    data = {
        "name": "too-long",
        "model": {"id": DEFAULT_MODEL},
        "methods": ["full"],
        "workloads": [{"type": "latency", "context": 8193, "steps": 1, "warmup": 0}],
    }
    out = tmp_path / "out"
    err = _one_error(capsys, ["run", str(_suite(tmp_path, data)), "--out", str(out), "--quiet"])
    assert "workloads[0] (latency): context=8193" in err and "8192" in err, err
    assert not out.exists()


def test_run_suite_refuses_before_the_folder_is_made(tmp_path) -> None:
    from kvbench.bench.runner import run_suite

    data = {
        "name": "too-long",
        "models": [{"shape": "qwen3-8b"}],
        "methods": ["full"],
        "workloads": [{"type": "memory", "context": 40961}],
    }
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"context=40961 exceeds .*shape:qwen3-8b, 40960 tokens"):
        run_suite(parse_suite(data, "s.yaml"), out, quiet=True)
    assert not out.exists()


@pytest.mark.parametrize(
    "workload, refused",
    [
        ({"type": "ruler", "lengths": [1024, 8193]}, True),  # the longest of a list
        ({"type": "ruler", "lengths": [1024, 8192]}, False),  # exactly the maximum fits
        ({"type": "passkey", "length": 8193}, True),
        ({"type": "perplexity", "tokens": 8193, "prefill": 8000}, True),
        ({"type": "fidelity", "tokens": 8193, "prefill": 8000}, True),
        ({"type": "fidelity", "tokens": 8193, "prefill": 8000, "source": "synthetic"}, False),
        ({"type": "memory", "context": 8193}, True),
    ],
)
def test_check_contexts(tmp_path, workload: dict, refused: bool) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    suite = parse_suite(
        {"name": "x", "model": {"id": str(tmp_path)}, "methods": ["full"], "workloads": [workload]},
        "s.yaml",
    )
    if refused:
        with pytest.raises(ValueError, match=rf"exceeds the maximum context of {tmp_path}, 8192"):
            check_contexts(suite)
    else:
        check_contexts(suite)


def test_local_model_folder_maximum_is_read_from_its_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 100}))
    suite = parse_suite(
        {"name": "x", "model": {"id": str(tmp_path)}, "methods": ["full"],
         "workloads": [{"type": "latency", "context": 101}]},
        "s.yaml",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"context=101 exceeds .* 100 tokens"):
        check_contexts(suite)


# --- a non-UTF-8 suite file ------------------------------------------------------------------


def test_non_utf8_suite_names_the_file(tmp_path, capsys) -> None:
    p = tmp_path / "latin1.yaml"
    p.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{p}: not UTF-8 text \(byte 0xe9 at offset 9\)"):
        load_suite(p)
    assert str(p) in _one_error(capsys, ["run", str(p)])


# --- help texts ------------------------------------------------------------------------------


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", ["list", "bits", "run", "report"])
def test_every_argument_has_help(command: str) -> None:
    parser = _subparsers()[command]
    missing = [a.dest for a in parser._actions if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, f"kvbench {command}: arguments without help: {missing}"


@pytest.mark.parametrize(
    "command, option, words",
    [
        ("list", "--json", "JSON"),
        ("report", "--no-plots", "PNG"),
        ("bits", "method", "kvbench list"),
    ],
)
def test_help_says_what_an_argument_does(capsys, command: str, option: str, words: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(option))
    rest = text[text.index(line) :].split("\n  ", 2)  # the option's line and its wrapped help
    assert words in " ".join(rest[:2]), text


def test_run_help_lists_workload_types_and_their_parameters(capsys) -> None:
    from kvbench.bench.workloads import WORKLOADS

    with pytest.raises(SystemExit) as exc:
        main(["run", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    epilog = text[text.index("workload types (") :]
    entries: dict[str, str] = {}
    name = None
    for line in epilog.splitlines()[2:]:
        if line.startswith("  ") and not line.startswith("   "):
            name, _, rest = line.strip().partition(": ")
            entries[name] = rest
        elif name is not None:
            entries[name] += " " + line.strip()
    assert sorted(entries) == WORKLOADS.names()
    for name in WORKLOADS.names():
        for key in WORKLOADS.get(name).PARAMS:
            assert f"{key}=" in entries[name], (name, key)
    assert "passkey" in entries and "length=1024" in entries["passkey"]


# --- the CPU allocator's profiler warning ----------------------------------------------------

WARNING = "Memory block of unknown size was allocated before the profiling started"


def test_memory_run_prints_no_allocator_warning(tmp_path) -> None:
    data = {
        "name": "mem-tiny",
        "threads": 1,
        "methods": ["full", "kivi"],
        "workloads": [
            {"type": "memory", "source": "synthetic", "context": 64, "appends": 2, "num_layers": 1}
        ],
    }
    suite = _suite(tmp_path, data)
    got = subprocess.run(
        [sys.executable, "-m", "kvbench.cli", "run", str(suite), "--out", str(tmp_path / "o"),
         "--quiet", "--json"],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert len(json.loads(got.stdout)["records"]) == 2
    assert WARNING not in got.stderr, got.stderr


def test_stderr_filter_drops_only_the_warning_line() -> None:
    code = textwrap.dedent(
        f"""
        import os
        from kvbench.measure.stderr_filter import drop_stderr_lines
        with drop_stderr_lines():
            os.write(2, b"before\\n[W CPUAllocator.cpp:245] {WARNING}, profiler ...\\nafter\\n")
        os.write(2, b"outside\\n")
        try:
            with drop_stderr_lines():
                os.write(2, b"in a failing block\\n")
                raise KeyError("boom")
        except KeyError:
            pass
        """
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert got.returncode == 0, got.stderr
    assert got.stderr == "before\nafter\noutside\nin a failing block\n"
