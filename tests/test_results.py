"""Records, suites, the runner's resume, and the compare gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.report.compare import Gate, compare
from kvbench.report.compare import main as compare_main
from kvbench.bench.records import (
    SCHEMA_VERSION,
    RecordError,
    load_record,
    make_run_id,
    new_record,
    write_atomic,
)
from kvbench.bench.runner import run_suite
from kvbench.bench.suite import load_suite, parse_suite


def _rec(metrics: dict, method: str = "kivi", config: dict | None = None) -> dict:
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


def test_load_record_schema_errors(tmp_path: Path) -> None:
    rec = _rec({"key_mse": 1.0})
    write_atomic(tmp_path / "ok.json", rec)
    assert load_record(tmp_path / "ok.json")["metrics"] == {"key_mse": 1.0}
    write_atomic(tmp_path / "old.json", {**rec, "schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(RecordError, match="schema_version"):
        load_record(tmp_path / "old.json")
    write_atomic(tmp_path / "none.json", {k: v for k, v in rec.items() if k != "schema_version"})
    with pytest.raises(RecordError, match="missing schema_version"):
        load_record(tmp_path / "none.json")


def test_gate_directions_and_thresholds() -> None:
    g = Gate.parse("attn_kl:5%")
    assert g.relative and g.threshold == pytest.approx(0.05)
    assert g.regressed(1.0, 1.1) and not g.regressed(1.0, 1.04) and not g.regressed(1.0, 0.5)
    h = Gate.parse("top1_agreement:0.01")  # higher is better: a drop is a regression
    assert h.regressed(0.9, 0.88) and not h.regressed(0.9, 0.895) and not h.regressed(0.9, 1.0)
    with pytest.raises(ValueError, match="no declared direction"):
        Gate.parse("made_up:1")
    with pytest.raises(ValueError, match="METRIC:THRESHOLD"):
        Gate.parse("attn_kl")


def test_compare_injected_regression_exit_codes(tmp_path: Path) -> None:
    import argparse

    base, same, worse = tmp_path / "base", tmp_path / "same", tmp_path / "worse"
    for d, kl in ((base, 0.10), (same, 0.10), (worse, 0.11)):  # +10% in a deterministic metric
        write_atomic(d / "r.json", _rec({"attn_kl": kl, "bytes_total": 1000}))
    ns = argparse.Namespace
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
    by_label = {r["manifest"]["label"]: r["metrics"] for r in recs}
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
