"""Provenance: what records and run logs carry (CPU model, command, load average).  The load
average comes from a counter standing in for ``os.getloadavg``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvbench.bench import manifest as mf
from kvbench.bench.records import load_records
from kvbench.cli import main as cli_main

CPUINFO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
stepping\t: 0

processor\t: 1
vendor_id\t: AuthenticAMD
model\t\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
"""
#: an ARM /proc/cpuinfo: no "model name" line
CPUINFO_ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n"


def test_cpu_model_is_the_model_name_of_proc_cpuinfo() -> None:
    assert mf.parse_cpu_model(CPUINFO) == "AMD EPYC 7B13 64-Core Processor"
    assert mf.parse_cpu_model(CPUINFO_ARM) is None
    assert mf.parse_cpu_model("model name\t:   \nmodel name\t: Real One\n") == "Real One"


def test_cpu_model_falls_back_to_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mf, "parse_cpu_model", lambda text: None)
    monkeypatch.setattr(mf.platform, "processor", lambda: "")
    monkeypatch.setattr(mf.platform, "machine", lambda: "riscv64")
    mf.cpu_model.cache_clear()
    try:
        assert mf.cpu_model() == "riscv64"
        assert mf.device_name("cpu") == "riscv64"
        monkeypatch.setattr(mf.platform, "processor", lambda: "arm")
        mf.cpu_model.cache_clear()
        assert mf.cpu_model() == "arm"
    finally:
        mf.cpu_model.cache_clear()


class LoadCounter:
    """``os.getloadavg`` stand-in: the n-th call returns ``(n, n + 0.5, n + 0.25)``."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> tuple[float, float, float]:
        self.calls += 1
        return (float(self.calls), self.calls + 0.5, self.calls + 0.25)


def _load(n: int) -> list[float]:
    return [float(n), n + 0.5, n + 0.25]


SUITE = (
    "name: t\nseed: 0\nthreads: 1\nmodel: none\nmethods: [full, kivi]\nworkloads: [{type: bits}]\n"
)


def _suite(tmp_path: Path) -> Path:
    p = tmp_path / "t.yaml"
    p.write_text(SUITE)
    return p


def test_run_records_command_and_load_average(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``kvbench run`` through the CLI's ``main(argv)``: every record's manifest names that
    command line (shell-quoted) and the load average before and after its run; the run log holds
    the load average before and after the whole sweep, around the records' (counter order)."""
    monkeypatch.delenv(mf.COMMAND_ENV, raising=False)
    counter = LoadCounter()
    monkeypatch.setattr(os, "getloadavg", counter)
    suite, out = _suite(tmp_path), tmp_path / "my out"
    argv = ["run", str(suite), "--out", str(out), "--quiet"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    recs = {r.method: r for r in load_records(out)}
    line = f"kvbench run {suite} --out '{out}' --quiet"  # quoted by hand: the space in "my out"
    for r in recs.values():
        assert r.manifest["command"] == line and r.manifest["argv"] == line
    # calls: run log start (1), full start/end (2, 3), kivi start/end (4, 5), run log end (6)
    assert recs["full"].manifest["loadavg_start"] == _load(2)
    assert recs["full"].manifest["loadavg_end"] == _load(3)
    assert recs["kivi"].manifest["loadavg_start"] == _load(4)
    assert recs["kivi"].manifest["loadavg_end"] == _load(5)
    (entry,) = mf.read_run_log(out)
    assert entry["loadavg_start"] == _load(1) and entry["loadavg_end"] == _load(6)
    assert (entry["command"], entry["status"], entry["records"]) == (line, "finished", 2)
    assert entry["suite"] == str(suite) and entry["wall_s"] >= 0
    assert entry["started"] <= entry["ended"]
    assert len(load_records(out)) == 2  # the run log is not read as a record

    # a wrapper's command (the Makefile) is the command; argv stays the kvbench line
    monkeypatch.setenv(mf.COMMAND_ENV, "make bench OUT=x")
    assert cli_main([*argv, "--force"]) == 0
    capsys.readouterr()
    for r in load_records(out):
        assert r.manifest["command"] == "make bench OUT=x"
        assert r.manifest["argv"] == line + " --force"
    first, second = mf.read_run_log(out)  # a rerun appends: the first entry is kept
    assert first == entry and second["command"] == "make bench OUT=x"


def test_run_log_status(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), mf.run_log(tmp_path, "s.yaml"):
        assert mf.read_run_log(tmp_path)[0]["status"] == "running"
        raise KeyboardInterrupt
    with pytest.raises(ValueError), mf.run_log(tmp_path, "s.yaml"):
        raise ValueError("boom")
    assert [e["status"] for e in mf.read_run_log(tmp_path)] == ["interrupted", "failed"]
    (tmp_path / mf.RUN_LOG).write_text('{"suite": 1}\n[2]\n')
    with pytest.raises(ValueError, match=r"kvbench-run.jsonl:2: not a JSON object"):
        mf.read_run_log(tmp_path)
