"""Failed records (*Failures* in :mod:`kvbench.integrations.ray`): what is written for a run
that produced no record, and where."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvbench.bench.records import SCHEMA_VERSION
from kvbench.bench.runner import PlannedRun
from kvbench.integrations.ray.worker import NodeInfo

FAILED_DIR = "failed"

FailedRecord = dict[str, Any]  # a failed record: the JSON object :func:`failed_record` builds


def failed_path(out_dir: str | Path, run_id: str) -> Path:
    """Where the failed record of ``run_id`` is written: ``OUT/failed/<run_id>.json``."""
    return Path(out_dir) / FAILED_DIR / f"{run_id}.json"


def failed_record(
    run: PlannedRun,
    message: str,
    attempts: int,
    node: NodeInfo,
    suite_path: str,
    timeout_s: float | None = None,
) -> FailedRecord:
    """The failed record of ``run``: ``message`` (the error), ``attempts`` (tries made),
    ``node`` (where the last one ran, empty when nowhere); with ``timeout_s``, the run was
    stopped by ``--run-timeout`` (``"timed_out": true``)."""
    timed_out = {} if timeout_s is None else {"timed_out": True, "timeout_s": timeout_s}
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "failed",
        "run_id": run.run_id,
        "method": run.method.name,
        "config": run.method.config,
        "label": run.method.label,
        "model": run.model_spec or {},
        "workload": run.workload_key,
        "metrics": {},
        "error": message,
        "attempts": attempts,
        **timed_out,
        "manifest": {"executor": "ray", "node": node, "suite": suite_path},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
