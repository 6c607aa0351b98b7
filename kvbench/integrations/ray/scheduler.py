"""The driver: :class:`RayExecutor` plans a suite's runs, resumes finished ones, creates
workers (:class:`~kvbench.integrations.ray.worker.ModelWorker` actors) as the cluster's slots
allow, hands them preparations and runs in order, writes the records they return, retries a run
whose worker died, stops runs past ``--run-timeout`` and writes failed records
(:mod:`kvbench.integrations.ray.failed`)."""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal, TypedDict

from tqdm import tqdm

from kvbench.bench.manifest import invocation
from kvbench.bench.records import Record, load_record, write_atomic
from kvbench.bench.runner import (
    PlannedRun,
    finished_record,
    group_by_model,
    plan_runs,
    skip_reason,
    write_run,
)
from kvbench.bench.suite import Suite
from kvbench.bench.workloads import WORKLOADS, Workload
from kvbench.cache.registry import get_method
from kvbench.integrations.ray.connect import (
    CONNECT_TIMEOUT_S,
    actor_options,
    check_capacity,
    connect,
    worker_threads,
)
from kvbench.integrations.ray.failed import FailedRecord, failed_path, failed_record
from kvbench.integrations.ray.worker import (
    ModelWorker,
    NodeInfo,
    PreparedState,
    PrepareStatus,
    RunOutput,
)

if TYPE_CHECKING:  # Ray is an optional extra: its types for annotations only
    from ray import ObjectRef
    from ray.actor import ActorHandle

#: attempts of a run whose worker dies (the first try and one retry)
MAX_ATTEMPTS = 2

Key = tuple[int, int]  # (model index, workload index): one workload of one model


class Timing(TypedDict):
    """Driver-side timing of one run computed in this sweep (:attr:`RayExecutor.timings`)."""

    run_id: str
    title: str
    worker: str
    submit_s: float  # submitted (driver's clock)
    written_s: float  # its record written (driver's clock)
    setup_s: float  # in the worker: model load and workload install
    exec_s: float  # in the worker: compute_record
    overhead_s: float  # written_s - submit_s - exec_s


@dataclass
class _Worker:
    """The driver's view of one worker actor."""

    handle: ActorHandle
    model_index: int
    name: str
    info: NodeInfo = field(default_factory=NodeInfo)
    info_ref: ObjectRef[NodeInfo] | None = None  # describe(), submitted on creation
    load_ref: ObjectRef[bool] | None = None  # the model load, submitted on creation
    ready_at: float | None = None  # when the driver saw the load finish (runs timed from here)
    has: set[int] = field(default_factory=set)  # workload indices installed or prepared here
    busy: _Task | None = None  # the task in flight
    bar: tqdm | None = None  # its status line (--progress-workers)
    doing: str = "starting"
    created: float = field(default_factory=time.perf_counter)
    since: float = field(default_factory=time.perf_counter)

    def show(self, what: str | None = None) -> None:
        """Refresh the status line (``what``: it started doing that now)."""
        if what is not None:
            self.doing, self.since = what, time.perf_counter()
        if self.bar is not None:
            where = self.info.get("hostname", "?")
            gpus = self.info.get("gpu_ids")
            dev = f" gpu {','.join(gpus)}" if gpus else ""
            idle = "" if self.busy is not None else " (idle)"
            elapsed = time.perf_counter() - self.since
            self.bar.set_description_str(
                f"  {self.name} [{where}{dev}]: {self.doing}{idle} {elapsed:.0f}s", refresh=True
            )


@dataclass
class _Task:
    """A task in flight on a worker: a workload's preparation or a run."""

    kind: Literal["prepare", "run"]
    worker: _Worker
    key: Key
    run: PlannedRun  # prepare: the run that asked for the preparation
    attempt: int = 1
    submitted: float = 0.0
    state: ObjectRef[PreparedState] | None = None  # prepare: ref of the shared state

    def started(self) -> float | None:
        """When this run started counting against the timeout: its submission, or the end of
        its worker's model load if later (``None``: a preparation, or the model is still
        loading)."""
        ready = self.worker.ready_at
        if self.kind != "run" or ready is None:
            return None
        return max(self.submitted, ready)


class RayExecutor:
    """Run a suite on Ray.  After :meth:`run`: ``records`` (new and resumed, plan order),
    ``failed`` (failed records written), ``timings`` (per run computed here: ``submit_s`` to
    ``written_s`` on the driver's clock, ``exec_s`` inside the worker, ``overhead_s`` = the
    difference minus ``exec_s``), ``startup_s`` (connecting or starting Ray), ``spawn_s`` (per
    worker: creation until it answers, i.e. process start and imports; the model loads after).
    ``run_timeout_s``: stop a run that takes longer (:meth:`_expire`); ``None``: no limit.

    Raises ``ValueError`` for ``max_parallel < 1`` or ``run_timeout_s <= 0``."""

    def __init__(
        self,
        suite: Suite,
        out_dir: str | Path,
        *,
        address: str | None = None,
        max_parallel: int | None = None,
        limit: int | None = None,
        force: bool = False,
        quiet: bool = False,
        skip_unavailable: bool = False,
        progress_workers: bool = False,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        worker_cls: type[ModelWorker] = ModelWorker,
        run_timeout_s: float | None = None,
    ) -> None:
        if max_parallel is not None and max_parallel < 1:
            raise ValueError(f"--max-parallel must be >= 1, got {max_parallel}")
        if run_timeout_s is not None and not run_timeout_s > 0:
            raise ValueError(f"--run-timeout must be > 0 seconds, got {run_timeout_s}")
        self.run_timeout_s = run_timeout_s
        self.suite, self.out_dir = suite, Path(out_dir)
        self.address, self.max_parallel, self.limit = address, max_parallel, limit
        self.force, self.quiet, self.skip_unavailable = force, quiet, skip_unavailable
        self.progress_workers, self.connect_timeout_s = progress_workers, connect_timeout_s
        self.worker_cls = worker_cls
        self.records: list[Record] = []
        self.failed: list[FailedRecord] = []
        self.timings: list[Timing] = []
        self.startup_s = 0.0
        self.handles: list[ActorHandle] = []  # every worker created (all killed when run() returns)
        self.spawn_s: list[float] = []  # per worker: creation to first answer (process start)

    # -- small helpers
    def _note(self, msg: str) -> None:
        if not self.quiet:
            tqdm.write(msg, file=sys.stderr)

    def run(self) -> list[Record]:
        """Plan, resume, submit, collect; returns the records (:mod:`kvbench.integrations.ray`)."""
        runs = plan_runs(self.suite, self.out_dir, self.limit)  # config errors before Ray
        if not self.force and all(r.path.exists() for r in runs):  # nothing to do: no Ray
            self.records = [load_record(r.path) for r in runs]
            return self.records
        t0 = time.perf_counter()
        started = connect(self.address, self.connect_timeout_s)
        self.startup_s = time.perf_counter() - t0
        import ray

        self.ray: ModuleType = ray
        try:
            return self._run(runs)
        finally:
            if started:
                ray.shutdown()

    def _run(self, runs: list[PlannedRun]) -> list[Record]:
        groups = group_by_model(runs)
        self.capacity = check_capacity(self.ray, self.suite, groups)
        done = self._queue(groups)
        self.order = [g[0].model_index for g in groups]
        self.workers: list[_Worker] = []
        self.inflight: dict[ObjectRef, _Task] = {}
        self.attempts: dict[str, int] = {}  # run_id -> attempt of its next submission
        self.prep_attempts: dict[Key, int] = {}
        self.n_failed, self.n_workers = 0, 0
        self.remote_cls = self.ray.remote(self.worker_cls)
        self.bar = tqdm(
            total=len(runs),
            initial=done,
            desc=f"{self.suite.name} [ray]",
            disable=self.quiet,
            file=sys.stderr,
        )
        try:
            self._loop()
        finally:  # also on Ctrl-C: killing the workers cancels their tasks; records on disk
            for w in list(self.workers):  # are complete (written atomically by this process)
                self._retire(w)
            self.bar.close()
        self.records = [self.results[r.run_id] for r in runs if r.run_id in self.results]
        return self.records

    def _queue(self, groups: list[list[PlannedRun]]) -> int:
        """Resume the finished runs of ``groups`` (their records), skip those whose method
        cannot run the workload, queue the rest per model; returns how many need nothing more."""
        self.results: dict[str, Record] = {}
        self.pending: dict[int, deque[PlannedRun]] = {}
        self.baseline: dict[Key, dict[str, float] | Literal["pending", "failed"]] = {}
        self.prepared: dict[Key, ObjectRef[PreparedState] | Literal["running", "skip"]] = {}
        workloads: dict[int, Workload] = {}
        done = 0
        for group in groups:
            mi = group[0].model_index
            queue: deque[PlannedRun] = deque()
            for run in group:
                key = (mi, run.workload_index)
                rec = finished_record(run, self.force)
                if rec is not None:
                    self.results[run.run_id] = rec
                    if run.is_baseline:
                        self.baseline[key] = rec.metrics
                    done += 1
                    continue
                wl = workloads.setdefault(
                    run.workload_index, WORKLOADS.get(run.workload_spec["type"])(run.workload_spec)
                )
                why = skip_reason(get_method(run.method.name, **run.method.config), wl)
                if why:
                    self._note(f"skipped {run.title}: {why}")
                    done += 1
                    continue
                if run.is_baseline:
                    self.baseline[key] = "pending"
                queue.append(run)
            if queue:
                self.pending[mi] = queue
        return done

    # -- workers
    def _limit(self) -> int:
        return self.max_parallel or max(n for _, n in self.capacity.values())

    def _spawn(self) -> None:
        """Create workers for models with undistributed runs, in suite order, while slots
        remain: a model gets at most one worker per run it has left (and per cluster slot)."""
        for mi in self.order:
            queue = self.pending.get(mi)
            if not queue:
                continue
            req, n_slots = self.capacity[mi]
            mine = sum(w.model_index == mi for w in self.workers)
            want = min(len(queue), n_slots, self.max_parallel or n_slots)
            while mine < want and len(self.workers) < self._limit():
                self._new_worker(mi, req)
                mine += 1
            if len(self.workers) >= self._limit():
                return

    def _new_worker(self, mi: int, req: dict[str, float]) -> None:
        threads = worker_threads(self.suite.threads, req.get("CPU", 0.0))
        actor = self.remote_cls.options(max_restarts=0, **actor_options(req))
        handle = actor.remote(self.suite, mi, self.limit, threads)
        self.handles.append(handle)
        self.n_workers += 1
        w = _Worker(handle, mi, f"w{self.n_workers - 1}")
        w.info_ref = handle.describe.remote()  # answers once the process runs
        w.load_ref = handle.load.remote()  # the model loads while other workers prepare
        if self.progress_workers and not self.quiet:
            w.bar = tqdm(
                total=0,
                bar_format="{desc}",
                position=self.n_workers,
                desc=f"  {w.name}: starting",
                file=sys.stderr,
                leave=False,
            )
        self.workers.append(w)

    def _retire(self, w: _Worker) -> None:
        if w in self.workers:
            self.workers.remove(w)
        self.ray.kill(w.handle, no_restart=True)  # harmless on a dead actor
        if w.bar is not None:
            w.bar.close()

    # -- dispatch
    def _eligible(self, mi: int, w: _Worker) -> PlannedRun | None:
        """The next run of model ``mi`` that may start on ``w``, submitting a preparation
        instead when one is due (returns ``None`` then, ``w`` busy)."""
        queue = self.pending.get(mi) or deque()
        for run in list(queue):
            key = (mi, run.workload_index)
            prep = self.prepared.get(key)
            if prep is None:
                self._submit_prepare(w, key, run)
                return None
            if prep == "running":
                continue
            if not run.is_baseline and self.baseline.get(key) == "pending":
                continue
            queue.remove(run)
            return run
        return None

    def _submit_prepare(self, w: _Worker, key: Key, run: PlannedRun) -> None:
        status: ObjectRef[PrepareStatus]
        state: ObjectRef[PreparedState]
        status, state = w.handle.prepare.options(num_returns=2).remote(
            run.workload_index, run.workload_spec
        )
        attempt = self.prep_attempts.get(key, 0) + 1
        task = _Task("prepare", w, key, run, attempt, submitted=time.perf_counter(), state=state)
        self.prepared[key] = "running"
        self.inflight[status] = task
        w.busy = task
        w.show(f"preparing {run.workload_spec['type']}")

    def _submit_run(self, w: _Worker, run: PlannedRun, attempt: int = 1) -> None:
        key = (run.model_index, run.workload_index)
        base = self.baseline.get(key)
        base = base if isinstance(base, dict) and not run.is_baseline else None
        ref: ObjectRef[RunOutput] = w.handle.run.remote(run, base, [self.prepared[key]])
        task = _Task("run", w, key, run, attempt, submitted=time.perf_counter())
        self.inflight[ref] = task
        w.busy = task
        w.show(run.title)

    def _dispatch(self) -> None:
        for w in list(self.workers):
            if w.busy is not None:
                continue
            run = self._eligible(w.model_index, w)
            if run is not None:
                self._submit_run(w, run, self.attempts.get(run.run_id, 1))
            elif w.busy is None and not self.pending.get(w.model_index):
                self._retire(w)  # its model has nothing left to hand out: free the slot

    def _update_bar(self) -> None:
        running = sum(t.kind == "run" for t in self.inflight.values())
        self.bar.set_postfix_str(
            f"running={running} failed={self.n_failed} workers={len(self.workers)}"
        )

    def _loop(self) -> None:
        ray = self.ray
        while any(self.pending.values()) or self.inflight:
            self._spawn()
            self._dispatch()
            self._update_bar()
            if not self.inflight:
                if any(self.pending.values()):  # cannot happen: every wait has a task in flight
                    raise RuntimeError("internal: runs pending with no Ray task in flight")
                continue
            ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=self._wait_s())
            for w in self.workers:
                if w.load_ref is not None and ray.wait([w.load_ref], timeout=0)[0]:
                    w.load_ref, w.ready_at = None, time.perf_counter()  # loaded (or failed)
                if w.info_ref is not None:
                    got, _ = ray.wait([w.info_ref], timeout=0)
                    if got:
                        try:
                            w.info = ray.get(w.info_ref)
                        except ray.exceptions.RayError:
                            w.info = {}
                        w.info_ref = None
                        self.spawn_s.append(time.perf_counter() - w.created)
            for ref in ready:
                self._collect(ref, self.inflight.pop(ref))
            self._expire()
            for w in self.workers:  # refresh per-worker lines (elapsed)
                w.show()

    # -- per-run timeout (--run-timeout)
    def _wait_s(self) -> float:
        """How long the loop may block in ``ray.wait``: 1 s, less when a run's time is up
        sooner."""
        wait = 1.0
        if self.run_timeout_s is not None:
            now = time.perf_counter()
            for task in self.inflight.values():
                start = task.started()
                if start is not None:
                    wait = min(wait, max(0.0, start + self.run_timeout_s - now))
        return wait

    def _expire(self) -> None:
        """Stop every run past ``--run-timeout``: kill its worker (``ray.kill``; Ray refuses
        ``ray.cancel(force=True)`` for an actor's task, and a hung run may not return to
        Python for a soft cancel) and write a failed record saying it timed out, without a
        retry in this sweep (a rerun retries it).  The model's remaining runs go to a fresh
        worker."""
        if self.run_timeout_s is None:
            return
        now = time.perf_counter()
        for ref, task in list(self.inflight.items()):
            start = task.started()
            if start is None or now - start < self.run_timeout_s:
                continue
            del self.inflight[ref]
            task.worker.busy = None
            self._retire(task.worker)  # kills the process, which cancels the task
            limit = self.run_timeout_s
            msg = (
                f"timed out: still running after --run-timeout {limit:g} s (ran "
                f"{now - start:.1f} s); its worker was stopped and a rerun retries it"
            )
            self._fail(task.run, msg, task.attempt, task.worker, timeout_s=limit)

    # -- results
    def _collect(self, ref: ObjectRef, task: _Task) -> None:
        ray = self.ray
        w = task.worker
        w.busy = None
        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the worker process died
            self._retire(w)
            self._died(task, exc)
            return
        except ray.exceptions.RayError as exc:  # the task raised
            self._task_failed(task, exc)
            return
        if task.kind == "prepare":
            self._prepared(task, out)
        else:
            self._write(task, out)

    def _prepared(self, task: _Task, status: PrepareStatus) -> None:
        """A preparation finished: its state's ref is there for the model's workers, or its
        workload's data are unavailable (:meth:`_unavailable`)."""
        if "unavailable" in status:
            self._unavailable(task.key, status["unavailable"])
        else:
            assert task.state is not None  # a preparation's task holds its state's ref
            self.prepared[task.key] = task.state
            task.worker.has.add(task.key[1])

    def _write(self, task: _Task, out: RunOutput) -> None:
        """Write the record a worker returned (removing a failed record of an earlier sweep)."""
        w = task.worker
        w.has.add(task.key[1])
        run = task.run
        rec = out["record"]
        rec.manifest.update(invocation())  # the driver's command line, not the worker's
        rec.manifest["ray"] = {
            "worker": w.name,
            "attempt": task.attempt,
            "resources": self.capacity[run.model_index][0],
            "prepared": out["prepared"],  # workload.prepare ran "here" or came via the store
        }
        write_run(run.path, rec)
        failed = failed_path(self.out_dir, run.run_id)
        failed.unlink(missing_ok=True)
        written = time.perf_counter()
        self.results[run.run_id] = rec
        if run.is_baseline:
            self.baseline[task.key] = rec.metrics
        self.timings.append(
            {
                "run_id": run.run_id,
                "title": run.title,
                "worker": w.name,
                "submit_s": task.submitted,
                "written_s": written,
                "setup_s": out["setup_s"],
                "exec_s": out["exec_s"],
                "overhead_s": written - task.submitted - out["exec_s"],
            }
        )
        self.bar.update(1)

    # -- failures
    def _died(self, task: _Task, exc: Exception) -> None:
        msg = f"worker died: {type(exc).__name__}: {exc}"
        if task.kind == "prepare":
            n = self.prep_attempts[task.key] = self.prep_attempts.get(task.key, 0) + 1
            if n < MAX_ATTEMPTS:
                self._note(f"retrying preparation of {task.run.workload_spec['type']}: {msg}")
                del self.prepared[task.key]
            else:
                self._fail_group(task.key, msg, n)
            return
        if task.attempt < MAX_ATTEMPTS:
            self._note(f"retrying {task.run.title} (attempt {task.attempt + 1}): {msg}")
            self.attempts[task.run.run_id] = task.attempt + 1
            self.pending.setdefault(task.run.model_index, deque()).appendleft(task.run)
        else:
            self._fail(task.run, msg, task.attempt, task.worker)

    def _task_failed(self, task: _Task, exc: Exception) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        if task.kind == "prepare":
            self._fail_group(task.key, f"workload preparation failed: {msg}", task.attempt)
        else:
            self._fail(task.run, msg, task.attempt, task.worker)

    def _unavailable(self, key: Key, message: str) -> None:
        queue = self.pending.get(key[0]) or deque()
        runs = [r for r in queue if r.workload_index == key[1]]
        if not self.skip_unavailable:
            self._fail_group(key, f"FileNotFoundError: {message} (--skip-unavailable skips it)", 1)
            return
        self.prepared[key] = "skip"
        self._note(f"skipped workload {runs[0].workload_spec['type'] if runs else key}: {message}")
        for r in runs:
            queue.remove(r)
            self.bar.update(1)
        self._drop_baseline(key)

    def _drop_baseline(self, key: Key) -> None:
        if self.baseline.get(key) == "pending":
            self.baseline[key] = "failed"

    def _fail_group(self, key: Key, message: str, attempts: int) -> None:
        self.prepared[key] = "skip"
        queue = self.pending.get(key[0]) or deque()
        runs = [r for r in queue if r.workload_index == key[1]]
        for r in runs:  # all out of the queue first: a failed baseline would fail them again
            queue.remove(r)
        for r in runs:
            self._fail(r, message, attempts, None)

    def _fail(
        self,
        run: PlannedRun,
        message: str,
        attempts: int,
        w: _Worker | None,
        timeout_s: float | None = None,
    ) -> None:
        """Write the failed record of ``run`` (``timeout_s``: stopped by ``--run-timeout``);
        a failed baseline fails the rest of its workload's runs."""
        key = (run.model_index, run.workload_index)
        node = w.info if w else NodeInfo()
        rec = failed_record(run, message, attempts, node, self.suite.path, timeout_s)
        write_atomic(failed_path(self.out_dir, run.run_id), rec)
        self.failed.append(rec)
        self.n_failed += 1
        self._note(f"FAILED {run.title}: {message}")
        self.bar.update(1)
        if run.is_baseline:  # the workload's other runs cannot get their *_ratio metrics
            self.baseline[key] = "failed"
            queue = self.pending.get(run.model_index) or deque()
            for r in [r for r in queue if r.workload_index == run.workload_index]:
                queue.remove(r)
                self._fail(r, f"baseline {run.method.label!r} failed: {message}", 0, None)
