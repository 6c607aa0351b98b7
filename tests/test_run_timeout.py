"""``kvbench run --run-timeout SECONDS``: one hung run cannot hold a sweep.

A workload registered in code (``sleepy``) hangs in one method's run while a flag file exists.
With ``--executor ray`` (a local Ray started once for the module, bound to 127.0.0.1) and a
2 s limit the hung run is stopped, its failed record says it timed out and with which limit,
the sweep's other runs are written, and a rerun (resume) computes that run again.  The local
executor refuses the flag.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from kvbench.bench.context import RunContext
from kvbench.bench.records import load_record
from kvbench.bench.suite import parse_suite
from kvbench.bench.workloads import LOWER, WORKLOADS, Result, Workload
from kvbench.cache.method import Method
from kvbench.cli import main

LIMIT_S = 2.0
#: a hung run gives up by itself after this long (so a broken timeout fails the test, not CI)
HANG_CAP_S = 60.0


@WORKLOADS.register("sleepy")
class Sleepy(Workload):
    """Sleeps in the run of method ``hang`` while the file ``hang_while`` exists (at most
    :data:`HANG_CAP_S`); every other run returns at once.  Metric: the seconds it slept."""

    type = "sleepy"
    METRICS = {"sleepy_s": LOWER}
    needs_model = False
    accepts_random_weights = True
    builds_caches = False
    shape_forward = False
    shape_reads_data = False
    layer_cache = False
    PARAMS = {"hang": "per-token", "hang_while": ""}

    def run(self, ctx: RunContext, method: Method) -> Result:
        t0 = time.perf_counter()
        if method.name == self.spec["hang"]:
            while os.path.exists(self.spec["hang_while"]) and time.perf_counter() - t0 < HANG_CAP_S:
                time.sleep(0.05)
        return Result({"sleepy_s": time.perf_counter() - t0})


def _register_in_worker() -> None:
    """Ray's worker_process_setup_hook: the workers know ``sleepy`` as this process does (the
    registry imported here, not the pickled copy a global reference would ship)."""
    from kvbench.bench.workloads import WORKLOADS as registry

    registry.register("sleepy", Sleepy)


def _suite_data(flag: Path) -> dict:
    return {
        "name": "t",
        "seed": 0,
        "threads": 1,
        "model": "none",
        "methods": ["full", "per-token", {"name": "kivi", "config": {"bits": 2}}],
        "workloads": [{"type": "sleepy", "hang_while": str(flag)}],
        "resources": {"num_cpus": 1},
    }


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind to 127.0.0.1, not the LAN
    ray = pytest.importorskip("ray")
    import ray._private.ray_constants as rc

    rc.ENABLE_RAY_CLUSTER = False
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Sleepy, by value
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"worker_process_setup_hook": _register_in_worker},
    )
    yield ray
    ray.shutdown()


def test_local_executor_refuses_run_timeout(tmp_path: Path, capsys) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(_suite_data(tmp_path / "flag")))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--run-timeout", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--run-timeout needs --executor ray" in err and "cannot stop a hung one" in err
    assert not out.exists()
    argv = ["run", str(path), "--out", str(out), "--executor", "ray", "--run-timeout", "0"]
    assert main(argv) == 2
    assert "--run-timeout must be > 0 seconds, got 0" in capsys.readouterr().err
    assert not out.exists()


def test_executor_refuses_a_limit_that_is_not_positive(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from kvbench.integrations.ray.scheduler import RayExecutor

    suite = parse_suite(_suite_data(tmp_path / "flag"), "t.yaml")
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="--run-timeout must be > 0 seconds"):
            RayExecutor(suite, tmp_path / "out", run_timeout_s=bad)


def test_hung_run_times_out_is_recorded_and_resume_retries_it(cluster, tmp_path: Path) -> None:
    from kvbench.integrations.ray import run_suite_ray
    from kvbench.integrations.ray.failed import failed_path

    flag = tmp_path / "flag"
    flag.touch()  # per-token hangs while it exists
    suite = parse_suite(_suite_data(flag), "t.yaml")
    out = tmp_path / "out"
    t0 = time.perf_counter()
    ex = run_suite_ray(suite, out, max_parallel=1, quiet=True, run_timeout_s=LIMIT_S)
    assert time.perf_counter() - t0 < HANG_CAP_S  # the sweep did not wait for the hung run
    (failed,) = ex.failed
    assert failed["method"] == "per-token" and failed["status"] == "failed"
    assert failed["timed_out"] is True and failed["timeout_s"] == LIMIT_S
    assert failed["error"].startswith("timed out: still running after --run-timeout 2 s")
    path = failed_path(out, failed["run_id"])
    assert json.loads(path.read_text()) == failed
    assert not (out / f"{failed['run_id']}.json").exists()  # resume must not skip it
    # the sweep went on after the kill: kivi (planned after per-token) ran on a fresh worker
    by_label = {r.manifest["label"]: r for r in ex.records}
    assert set(by_label) == {"full", "kivi"}
    assert by_label["full"].manifest["ray"]["worker"] == "w0"
    assert by_label["kivi"].manifest["ray"]["worker"] == "w1"
    assert all(r.metrics["sleepy_s"] < LIMIT_S for r in ex.records)
    before = {p.name: p.read_bytes() for p in out.glob("*.json")}
    assert len(before) == 2

    # resume through the CLI: only the timed-out run is computed, and it now finishes
    flag.unlink()
    spath = tmp_path / "s.yaml"
    spath.write_text(json.dumps(_suite_data(flag)))
    argv = ["run", str(spath), "--out", str(out), "--executor", "ray"]
    assert main([*argv, "--run-timeout", str(LIMIT_S), "--quiet", "--json"]) == 0
    after = {p.name: p.read_bytes() for p in out.glob("*.json")}
    assert {k: after[k] for k in before} == before  # nothing else recomputed
    retried = load_record(out / f"{failed['run_id']}.json")
    assert retried.method == "per-token" and retried.metrics["sleepy_s"] < LIMIT_S
    assert len(after) == 3 and not path.exists()  # the failed record went with the success
