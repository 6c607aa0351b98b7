"""Records, suites, the runner's resume and metric check, and the compare gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.bench.records import (
    SCHEMA_VERSION,
    Record,
    RecordError,
    load_record,
    load_records,
    make_run_id,
    new_record,
    write_atomic,
    write_record,
)
from kvbench.bench.runner import run_suite
from kvbench.bench.suite import load_suite, parse_suite
from kvbench.report.compare import Gate, add_arguments, compare
from kvbench.report.compare import main as compare_main

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted([*ROOT.glob("tests/baseline/*.json"), *ROOT.glob("tests/baseline_model/*.json")])


def _rec(metrics: dict, method: str = "kivi", config: dict | None = None) -> Record:
    return new_record(
        method=method,
        config=config or {"bits": 2},
        model={"id": "m"},
        workload={"type": "bits"},
        metrics=metrics,
        manifest={},
    )


def test_run_id_is_stable_and_config_sensitive() -> None:
    a = make_run_id({"id": "m"}, "kivi", {"bits": 2, "group_size": 128}, {"type": "bits"})
    b = make_run_id({"id": "m"}, "kivi", {"group_size": 128, "bits": 2}, {"type": "bits"})
    c = make_run_id({"id": "m"}, "kivi", {"bits": 3, "group_size": 128}, {"type": "bits"})
    assert a == b != c and len(a) == 16


def test_write_atomic_leaves_no_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_atomic(path, {"a": object.__new__(type("X", (), {"__str__": None}))})
    assert json.loads(path.read_text()) == {"a": 1}  # old content intact
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left


def test_atomic_file_modes(tmp_path: Path) -> None:
    """Records get a plain file's mode (0o666 less the umask), sidecars and binary writes
    mkstemp's 0o600; bytes are written as given; a failed write leaves nothing."""
    import os
    import stat

    from kvbench.paths import atomic_file

    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "r.json", {"a": 1})
        with atomic_file(tmp_path / "sub" / "t.bin", "wb") as f:
            f.write(b"\x00\xff")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "sub" / "t.bin").stat().st_mode) == 0o600
    assert (tmp_path / "sub" / "t.bin").read_bytes() == b"\x00\xff"
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "sub" / "u.txt") as f:
        f.write("half")
        raise RuntimeError
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["t.bin"]


def test_load_record_schema_errors(tmp_path: Path) -> None:
    rec = _rec({"key_mse": 1.0})
    write_record(tmp_path / "ok.json", rec)
    assert load_record(tmp_path / "ok.json").metrics == {"key_mse": 1.0}
    newer = {**rec.to_json(), "schema_version": SCHEMA_VERSION + 1}
    write_atomic(tmp_path / "new.json", newer)
    msg = rf"schema_version {SCHEMA_VERSION + 1} .* up to schema_version {SCHEMA_VERSION}\b"
    with pytest.raises(RecordError, match=msg):
        load_record(tmp_path / "new.json")
    with pytest.raises(RecordError, match=msg):
        Record.from_json(newer)
    for key in ("run_id", "method", "config", "metrics"):
        with pytest.raises(RecordError, match=f"lacks '{key}'"):
            Record.from_json({k: v for k, v in rec.to_json().items() if k != key})
    with pytest.raises(RecordError, match=r"unknown record field\(s\) \['x'\]"):
        Record.from_json({**rec.to_json(), "x": 1})
    write_atomic(tmp_path / "junk.json", [1, 2])
    with pytest.raises(RecordError, match="not a kvbench record"):
        load_record(tmp_path / "junk.json")


def test_record_without_schema_version_is_version_1(tmp_path: Path) -> None:
    data = {k: v for k, v in _rec({"key_mse": 1.0}).to_json().items() if k != "schema_version"}
    write_atomic(tmp_path / "v0.json", data)
    got = load_record(tmp_path / "v0.json")
    assert got.schema_version == 1 and got.metrics == {"key_mse": 1.0}
    assert got.to_json() == {**data, "schema_version": 1}


def test_record_round_trip(tmp_path: Path) -> None:
    rec = _rec({"key_mse": 0.25, "bytes_total": 1000})
    rec.per_layer = {"0": [1.5, 2.5]}
    rec.manifest = {"label": "kivi[bits=2]", "flags": ["f"]}
    rec.files = {"samples": [{"i": 0}]}  # not part of the JSON
    write_record(tmp_path / "r.json", rec)
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == {
        "schema_version": SCHEMA_VERSION,
        "run_id": rec.run_id,
        "method": "kivi",
        "config": {"bits": 2},
        "model": {"id": "m"},
        "workload": {"type": "bits"},
        "metrics": {"key_mse": 0.25, "bytes_total": 1000},
        "per_layer": {"0": [1.5, 2.5]},
        "manifest": {"label": "kivi[bits=2]", "flags": ["f"]},
        "created": rec.created,
    }
    back = load_record(tmp_path / "r.json")
    assert back == rec and back.files == {}
    assert (back.label, back.flags, back.workload_type) == ("kivi[bits=2]", ["f"], "bits")


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_records_reserialise_byte_for_byte(path: Path, tmp_path: Path) -> None:
    rec = load_record(path)
    assert rec.schema_version == 1
    write_record(tmp_path / path.name, rec)
    assert (tmp_path / path.name).read_bytes() == path.read_bytes()


def test_committed_records_load() -> None:
    assert len(COMMITTED) > 50
    assert len(load_records(ROOT / "tests" / "baseline")) == len(
        list((ROOT / "tests" / "baseline").glob("*.json"))
    )
    export = json.loads((ROOT / "docs" / "results" / "default.json").read_text())
    recs = [Record.from_json(r) for r in export["records"]]  # exports carry no version: 1
    assert len(recs) == len(export["records"]) > 0
    assert all(r.schema_version == 1 and r.metrics for r in recs)


def test_runner_checks_declared_metrics(tmp_path: Path, monkeypatch) -> None:
    from kvbench.bench.workloads import Result
    from kvbench.bench.workloads.bits import Bits

    real = Bits.run

    def run(self, ctx, method) -> Result:
        out = real(self, ctx, method)
        return Result(metrics={**out.metrics, "made_up_metric": 1.0})

    monkeypatch.setattr(Bits, "run", run)
    suite = parse_suite({"model": "none", "methods": ["full"], "workloads": [{"type": "bits"}]})
    with pytest.raises(
        ValueError,
        match=r"workload 'bits' reported metric\(s\) \['made_up_metric'\] without a declared "
        r"direction; add them to Bits\.METRICS",
    ):
        run_suite(suite, tmp_path, quiet=True)
    assert not list(tmp_path.glob("*.json"))  # nothing written for the refused run


def test_gate_directions_and_thresholds() -> None:
    g = Gate.parse("attn_kl:5%")
    assert g.relative and g.threshold == pytest.approx(0.05)
    assert g.regressed(1.0, 1.1) and not g.regressed(1.0, 1.04) and not g.regressed(1.0, 0.5)
    h = Gate.parse("top1_agreement:0.01")  # higher is better: a drop is a regression
    assert h.regressed(0.9, 0.88) and not h.regressed(0.9, 0.895) and not h.regressed(0.9, 1.0)
    with pytest.raises(ValueError, match="unknown metric 'made_up': no workload declares it"):
        Gate.parse("made_up:1")
    # a typo names the metric it is close to (the workloads' own declarations)
    with pytest.raises(ValueError, match="did you mean 'next_token_kl'"):
        Gate.parse("next_token_k:5%")
    with pytest.raises(ValueError, match="METRIC:THRESHOLD"):
        Gate.parse("attn_kl")


def test_compare_injected_regression_exit_codes(tmp_path: Path) -> None:
    import argparse

    base, same, worse = tmp_path / "base", tmp_path / "same", tmp_path / "worse"
    for d, kl in ((base, 0.10), (same, 0.10), (worse, 0.11)):  # +10% in a deterministic metric
        write_record(d / "r.json", _rec({"attn_kl": kl, "bytes_total": 1000}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def ns(base: str, new: str, fail_on: list[str]) -> argparse.Namespace:
        return parser.parse_args([base, new, *(f"--fail-on={g}" for g in fail_on)])

    assert compare_main(ns(base=str(base), new=str(same), fail_on=["attn_kl:5%"])) == 0
    assert compare_main(ns(base=str(base), new=str(worse), fail_on=["attn_kl:5%"])) == 1
    assert compare_main(ns(base=str(base), new=str(worse), fail_on=["attn_kl:15%"])) == 0


def test_compare_different_runs_names_keys() -> None:
    a, b = _rec({"attn_kl": 1.0}), _rec({"attn_kl": 1.0}, config={"bits": 3})
    with pytest.raises(ValueError, match=r"config\.bits"):
        compare([a], [b], [])


def test_compare_missing_run_fails() -> None:
    a, b = _rec({"attn_kl": 1.0}), _rec({"attn_kl": 1.0}, config={"bits": 3})
    _, failures = compare([a, b], [a], [])
    assert any("missing" in f for f in failures)


def test_suite_expansion_and_errors(tmp_path: Path) -> None:
    s = parse_suite(
        {
            "model": "none",
            "methods": [
                "full",
                {"name": "kivi", "config": {"group_size": [32, 64], "residual_length": 128}},
            ],
            "workloads": [{"type": "bits"}],
        }
    )
    assert [m.label for m in s.methods] == ["full", "kivi[group_size=32]", "kivi[group_size=64]"]
    p = tmp_path / "bad.yaml"
    p.write_text(
        "model: none\nmethods: [{name: kivi, config: {bitz: 2}}]\nworkloads: [{type: bits}]\n"
    )
    with pytest.raises(ValueError, match=r"bad\.yaml.*bitz.*allowed"):
        load_suite(p)
    p.write_text("model: none\nmethods: [kivy]\nworkloads: [{type: bits}]\n")
    with pytest.raises(ValueError, match="did you mean 'kivi'"):
        load_suite(p)
    p.write_text("model: none\nmethods: [kivi]\nworkloads: [{type: bitz}]\n")
    with pytest.raises(ValueError, match="unknown workload type 'bitz'"):
        load_suite(p)
    p.write_text("model: none\nmethods: [kivi]\nworkloads: [{type: bits, head: 3}]\n")
    with pytest.raises(ValueError, match="unknown parameter"):
        load_suite(p)


def test_runner_resumes(tmp_path: Path) -> None:
    suite = parse_suite(
        {
            "model": "none",
            "methods": [
                "full",
                {"name": "kivi", "config": {"group_size": [32, 128], "residual_length": 128}},
            ],
            "workloads": [{"type": "bits"}],
        }
    )
    recs = run_suite(suite, tmp_path, quiet=True)
    by_label = {r.label: r.metrics for r in recs}
    assert by_label["kivi[group_size=32]"]["nominal_key_bits"] == pytest.approx(3.0)
    # ratio against the full baseline of the same run: 3 / 16
    assert by_label["kivi[group_size=32]"]["nominal_key_bits_ratio"] == pytest.approx(3 / 16)
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 3
    (tmp_path / files[1].name).unlink()  # an interrupted sweep: one record missing
    mtimes = {f.name: f.stat().st_mtime_ns for f in files if f.exists()}
    recs2 = run_suite(suite, tmp_path, quiet=True)
    assert len(recs2) == 3 and len(list(tmp_path.glob("*.json"))) == 3
    for name, t in mtimes.items():  # existing records were skipped, not rewritten
        assert (tmp_path / name).stat().st_mtime_ns == t
