"""``kvbench run SUITE --executor ray``: the same suite, records and resume on a Ray cluster.

Ray (the extra ``ray``: ``pip install -e '.[ray]'``) places the work; kvbench only says what each worker holds
and in which order runs may start.  The pieces (docs/cluster.md has the user's view):

* **Workers.**  One Ray actor (:class:`~.worker.ModelWorker`) per model per device: its resources are the
  suite's ``resources:`` request (default ``num_cpus: 1``, and ``num_gpus: 1`` for a CUDA model),
  fixed when the actor is created.  It loads its model once and runs every (method config,
  workload) of that model it is handed, so runs sharing a model reuse the loaded model.  As many
  workers as the cluster fits (or ``max_parallel``) run at once; a model's workers are retired
  when its runs are handed out, freeing their slots for the next model.
* **Shared preparation.**  What the local runner computes once per model and workload
  (``workload.prepare``: captured Q/K/V, reference logits, tokenized windows) is computed by one
  worker (:meth:`.worker.ModelWorker.prepare`), returned into Ray's object store, and installed from
  there by the model's other workers instead of recomputed.
* **Order.**  As locally, the ``full`` baseline of a workload runs before that workload's other
  runs, which get ``*_ratio`` metrics against it.  Every run starts from
  ``torch.manual_seed(suite.seed)`` (:func:`kvbench.bench.runner.compute_record`), so its record
  does not depend on where or after what it ran: config, metrics and ``run_id`` equal the local
  executor's; the manifest adds the node and device (``manifest.node``, ``manifest.ray``).
* **Records.**  The driver owns the results folder: a worker returns the record and the driver
  writes it atomically (:func:`kvbench.bench.records.write_atomic`), exactly as locally, so a
  rerun skips finished runs.
* **Failures.**  A run whose worker process dies (``ray.exceptions.RayActorError``: killed, out
  of memory, node lost) is retried once on a fresh worker; if that dies too, or the run raises,
  a *failed record* ``OUT/failed/<run_id>.json`` (``"status": "failed"``, the error, the
  attempts, the node) is written and the sweep goes on.  Failed records live outside the result
  folder's top level, so ``kvbench report``/``compare`` and resume never take them for finished
  runs: a rerun retries them, and a success removes the failed record.
* **Timeouts.**  With ``run_timeout_s`` (``--run-timeout``), a run still going that many
  seconds after it reached its worker (or after the worker's model load, if later) is stopped by
  killing its worker, and a failed record with ``"timed_out": true`` and ``"timeout_s"`` is
  written; the sweep goes on on a fresh worker, and a rerun retries the run.
* **Ctrl-C.**  The driver kills its workers (which cancels their running tasks) and re-raises
  ``KeyboardInterrupt``; only complete records are on disk, and a rerun resumes.

The modules:

* :mod:`.connect`: reaching the cluster (``connect``, the token-authentication diagnosis,
  ``ClusterConnectError``, ``ClusterAuthError``, ``RayUnavailableError``) and sizing the work
  for it (``request_for``, ``slots``, ``check_capacity``).
* :mod:`.worker`: ``ModelWorker``, the Ray actor, and what it returns to the driver.
* :mod:`.scheduler`: ``RayExecutor``, the driver: workers, dispatch, retries, timeouts.
* :mod:`.failed`: failed records (``failed_path``, ``failed_record``).
* this package: the ``kvbench run`` glue (:func:`runner_from_args`, :func:`run_suite_ray`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvbench.bench.records import Record
from kvbench.bench.suite import Suite
from kvbench.integrations.ray.connect import import_ray
from kvbench.integrations.ray.failed import FailedRecord
from kvbench.integrations.ray.scheduler import RayExecutor


def run_suite_ray(suite: Suite, out_dir: str | Path, **kwargs: Any) -> RayExecutor:
    """Run ``suite`` on Ray (keyword arguments: those of :class:`RayExecutor`); returns the
    executor, whose ``records``, ``failed`` and ``timings`` describe the sweep."""
    ex = RayExecutor(suite, out_dir, **kwargs)
    ex.run()
    return ex


class RayRunner:
    """A ``run_suite``-compatible callable for ``kvbench run --executor ray`` (the CLI's
    ``--address``, ``--max-parallel``, ``--progress-workers``, ``--run-timeout``); after the
    call its ``failed`` attribute lists the failed records and ``executor`` is the
    :class:`RayExecutor`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.failed: list[FailedRecord] = []
        self.executor: RayExecutor | None = None

    def __call__(
        self,
        suite: Suite,
        out_dir: str | Path,
        *,
        limit: int | None = None,
        force: bool = False,
        quiet: bool = False,
        skip_unavailable: bool = False,
    ) -> list[Record]:
        args = self.args
        ex = RayExecutor(
            suite,
            out_dir,
            address=args.address,
            max_parallel=args.max_parallel,
            progress_workers=args.progress_workers,
            run_timeout_s=args.run_timeout,
            limit=limit,
            force=force,
            quiet=quiet,
            skip_unavailable=skip_unavailable,
        )
        self.executor = ex
        ex.run()
        self.failed = ex.failed
        return ex.records


def runner_from_args(args: argparse.Namespace) -> RayRunner:
    """The :class:`RayRunner` of ``kvbench run --executor ray``'s arguments.

    Raises :class:`~.connect.RayUnavailableError` at once (before any folder is made) without ray."""
    import_ray()
    return RayRunner(args)
