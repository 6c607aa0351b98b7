"""Provenance: what records and run logs carry (CPU model, command, load average) and how reports
and ``kvbench compare`` show it.  Expected lines are written out by hand from the records built
here; the load average comes from a counter standing in for ``os.getloadavg``."""

from __future__ import annotations

import copy
import json
import os
from argparse import Namespace
from pathlib import Path

import pytest

from kvbench.bench import manifest as mf
from kvbench.bench.records import Record, load_records, write_record
from kvbench.cli import main as cli_main
from kvbench.report import export as ex
from kvbench.report.compare import main as compare_main
from kvbench.report.provenance import differences, provenance_block
from kvbench.report.tables import main as report_main

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


MANIFEST = {
    "command": "make bench",
    "kvbench_version": "0.1.0",
    "git_sha": "abc",
    "python": "3.11.7",
    "torch": "2.13.0",
    "transformers": "5.0",
    "triton": None,
    "cpu_model": "AMD EPYC 7B13",
    "cpu_count": 2,
    "device": "cpu",
    "device_name": "AMD EPYC 7B13",
    "threads": 2,
    "model": {"model_id": "org/m", "weights_sha256": "f00d", "dtype": "float32"},
}


def rec(i: int, created: str, load: tuple[list, list], **changes) -> Record:
    m = {**copy.deepcopy(MANIFEST), "loadavg_start": load[0], "loadavg_end": load[1], **changes}
    return Record(
        run_id=f"r{i}",
        method="kivi",
        config={"bits": i},
        metrics={"key_mse": 0.5},
        model={"id": "org/m", "dtype": "float32"},
        workload={"type": "fidelity"},
        manifest=m,
        created=created,
    )


T0, T1, T2 = "2026-01-02T03:04:05+00:00", "2026-01-02T03:09:05+00:00", "2026-01-02T03:19:05+00:00"
AGREE_TAIL = [
    "- kvbench: 0.1.0",
    "- commit: `abc`",
    "- model: org/m",
    "- model sha256: `f00d`",
    "- dtype: float32",
    "- python: 3.11.7",
    "- torch: 2.13.0",
    "- transformers: 5.0",
    "- triton: none",
    "- CPU: AMD EPYC 7B13",
    "- cores: 2",
    "- threads: 2",
]


def test_block_of_records_that_agree() -> None:
    # listed out of time order: the earliest record's start and the latest record's end count
    recs = [
        rec(2, T1, ([0.9, 0.9, 0.9], [1.2, 0.9, 0.7])),
        rec(1, T0, ([0.5, 0.4, 0.3], [1.0, 0.8, 0.6])),
    ]
    assert provenance_block(recs).splitlines() == [
        "- command: `make bench`",
        f"- date (UTC): {T0} to {T1}",
        "- wall time: not recorded",
        "- load average: 0.50/0.40/0.30 at the start, 1.20/0.90/0.70 at the end (1/5/15 min)",
        *AGREE_TAIL,
    ]


def test_block_of_records_that_differ() -> None:
    load = ([0.5, 0.4, 0.3], [1.0, 0.8, 0.6])
    recs = [
        rec(1, T0, load),
        rec(2, T1, load),
        rec(3, T2, load, git_sha="def+dirty", threads=1, device="cuda:0", device_name="H100"),
    ]
    del recs[0].manifest["cpu_model"]  # a record written before cpu_model was recorded
    lines = provenance_block(recs).splitlines()
    assert lines[1] == f"- date (UTC): {T0} to {T2}"
    diff = [ln for ln in lines if "differs" in ln]
    assert diff == [
        "- commit: differs between records: `abc` (2 records), `def+dirty` (1 record)",
        "- CPU: differs between records: AMD EPYC 7B13 (2 records), not recorded (1 record)",
        "- GPU: differs between records: H100 (1 record), none (2 records)",
        "- threads: differs between records: 1 (1 record), 2 (2 records)",
    ]
    assert "- model sha256: `f00d`" in lines and "- cores: 2" in lines


def test_block_from_run_log_and_overrides() -> None:
    recs = [rec(1, T0, ([9, 9, 9], [9, 9, 9]))]
    runs = [
        {"started": T0, "ended": T1, "wall_s": 300.0, "loadavg_start": [0.1, 0.2, 0.3]},
        {"started": T1, "ended": T2, "wall_s": 600.0, "loadavg_end": [2.0, 1.5, 1.0]},
    ]
    lines = provenance_block(recs, runs).splitlines()
    assert lines[:4] == [
        "- command: `make bench`",
        f"- date (UTC): {T0} to {T2}",
        "- wall time: 15.0 min over 2 `kvbench run` invocations",
        "- load average: 0.10/0.20/0.30 at the start, 2.00/1.50/1.00 at the end (1/5/15 min)",
    ]
    lines = provenance_block(
        recs, runs[:1], command="make x", wall_s=90, machine="box"
    ).splitlines()
    assert lines[:5] == [
        "- command: `make x`",
        f"- date (UTC): {T0} to {T1}",
        "- wall time: 1.5 min",
        "- load average: 0.10/0.20/0.30 at the start, not recorded at the end (1/5/15 min)",
        "- machine: box",
    ]
    assert provenance_block(recs, wall_s=59.94).splitlines()[2] == "- wall time: 59.9 s"
    assert provenance_block(recs, runs, wall_s=61).splitlines()[2] == "- wall time: 1.0 min"


def test_block_of_model_free_and_shape_records() -> None:
    free = rec(1, T0, ([], []))
    free.model, free.manifest["model"] = {}, {}
    shape = rec(2, T0, ([], []), model={"model_id": "shape:x", "random_weights": True})
    lines = provenance_block([free]).splitlines()
    assert "- model: none (model-free)" in lines and "- dtype: none (model-free)" in lines
    assert "- load average: not recorded" in lines
    lines = provenance_block([shape]).splitlines()
    assert "- model: shape:x" in lines and "- model sha256: none (random weights)" in lines


def _write(folder: Path, recs: list[Record]) -> Path:
    folder.mkdir()
    for r in recs:
        write_record(folder / f"{r.run_id}.json", r)
    return folder


def test_compare_warns_for_exactly_the_fields_that_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = [rec(1, T0, ([0.1] * 3, [0.2] * 3)), rec(2, T0, ([0.1] * 3, [0.2] * 3))]
    same = [rec(1, T1, ([3.0] * 3, [4.0] * 3), wall_s=9.0), rec(2, T2, ([5.0] * 3, [6.0] * 3))]
    same.append(rec(3, T2, ([0.1] * 3, [0.2] * 3)))  # one more run, same provenance: no warning
    a, b = _write(tmp_path / "a", base), _write(tmp_path / "b", same)
    assert differences(base, same) == []  # created, load average, wall time are per run
    args = dict(fail_on=[], min_change=1e-4, json=False)
    assert compare_main(Namespace(base=str(a), new=str(b), **args)) == 0
    assert capsys.readouterr().err == ""

    other = [
        rec(1, T1, ([0.1] * 3, [0.2] * 3), git_sha="def", cpu_model="Intel Xeon", threads=1),
        rec(2, T1, ([0.1] * 3, [0.2] * 3), cpu_model="Intel Xeon", threads=1),
    ]
    other[1].metrics["key_mse"] = 0.6  # a regression: the exit status is still the gate's
    c = _write(tmp_path / "c", other)
    assert compare_main(Namespace(base=str(a), new=str(c), **args)) == 0
    assert capsys.readouterr().err.splitlines() == [
        "warning: BASE and NEW differ in provenance; their numbers may not be comparable:",
        "  commit: `abc` (BASE) vs `abc`, `def` (NEW)",
        "  CPU: AMD EPYC 7B13 (BASE) vs Intel Xeon (NEW)",
        "  threads: 2 (BASE) vs 1 (NEW)",
    ]
    gated = dict(args, fail_on=["key_mse:1%"])
    assert compare_main(Namespace(base=str(a), new=str(c), **gated)) == 1
    assert "  threads: 2 (BASE) vs 1 (NEW)" in capsys.readouterr().err
    assert compare_main(Namespace(base=str(a), new=str(c), **dict(args, json=True))) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["provenance_differs"] == {
        "commit": {"base": ["abc"], "new": ["abc", "def"]},
        "CPU": {"base": ["AMD EPYC 7B13"], "new": ["Intel Xeon"]},
        "threads": {"base": ["2"], "new": ["1"]},
    }


def test_report_and_export_start_with_the_provenance(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recs = [rec(1, T0, ([0.5, 0.4, 0.3], [1.0, 0.8, 0.6]))]
    folder = _write(tmp_path / "res", recs)
    runs = [{"started": T0, "ended": T1, "wall_s": 120.0, "command": "make bench"}]
    (folder / mf.RUN_LOG).write_text("".join(json.dumps(e) + "\n" for e in runs))
    assert report_main(Namespace(results=[str(folder)], plots=None, no_plots=True, json=False)) == 0
    out = capsys.readouterr().out
    head = out.split("### ")[0].splitlines()
    assert head[:6] == [
        "## Provenance",
        "",
        "- command: `make bench`",
        f"- date (UTC): {T0} to {T1}",
        "- wall time: 2.0 min",
        "- load average: not recorded",
    ]
    assert head[6:] == [*AGREE_TAIL, ""]
    assert report_main(Namespace(results=[str(folder)], plots=None, no_plots=True, json=True)) == 0
    assert json.loads(capsys.readouterr().out)["provenance"] == head[2:-1]
    export = tmp_path / "e.json"
    argv = [
        "export",
        str(folder),
        "--out",
        str(export),
        "--command",
        "make bench",
        "--machine",
        "m",
    ]
    assert cli_main(argv) == 0
    data = ex.load_export(export)
    assert data["runs"] == runs and data["records"][0]["created"] == T0


def test_sigterm_closes_the_run_log_as_an_interrupt(tmp_path: Path, monkeypatch, capsys) -> None:
    """``kill`` / ``timeout`` send SIGTERM: the command stops as on Ctrl-C (the run log says
    ``interrupted``, not ``running`` forever), exits 128 + 15, and the previous handler is back."""
    import os
    import signal

    import kvbench.cli as cli

    def killed(args) -> int:
        with mf.run_log(tmp_path, "s.yaml"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs at the next bytecode boundary
                pass
        return 0

    monkeypatch.setattr(cli, "cmd_list", killed)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["list"]) == 143
    assert "interrupted" in capsys.readouterr().err
    assert [e["status"] for e in mf.read_run_log(tmp_path)] == ["interrupted"]
    assert signal.getsignal(signal.SIGTERM) is before
