"""``kvbench run SUITE --executor ray``: the same suite, records and resume on a Ray cluster.

Ray (the extra ``ray``: ``pip install -e '.[ray]'``) places the work; kvbench only says what each worker holds
and in which order runs may start.  The pieces (docs/cluster.md has the user's view):

* **Workers.**  One Ray actor (:class:`ModelWorker`) per model per device: its resources are the
  suite's ``resources:`` request (default ``num_cpus: 1``, and ``num_gpus: 1`` for a CUDA model),
  fixed when the actor is created.  It loads its model once and runs every (method config,
  workload) of that model it is handed, so runs sharing a model reuse the loaded model.  As many
  workers as the cluster fits (or ``max_parallel``) run at once; a model's workers are retired
  when its runs are handed out, freeing their slots for the next model.
* **Shared preparation.**  What the local runner computes once per model and workload
  (``workload.prepare``: captured Q/K/V, reference logits, tokenized windows) is computed by one
  worker (:meth:`ModelWorker.prepare`), returned into Ray's object store, and installed from
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
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvbench.bench.context import RunContext
from kvbench.bench.manifest import invocation
from kvbench.bench.records import SCHEMA_VERSION, Record, write_atomic
from kvbench.bench.runner import (
    PlannedRun,
    compute_record,
    ensure_model,
    finished_record,
    group_by_model,
    plan_runs,
    prepare_workload,
    skip_reason,
    write_run,
)
from kvbench.bench.suite import Suite
from kvbench.bench.workloads import WORKLOADS, Workload
from kvbench.cache.registry import get_method

INSTALL_HINT = (
    "pip install -e '.[ray]' in the kvbench clone (kvbench is not on the package index; make env "
    "installs it), or pip install 'ray>=2.40,<3' into kvbench's environment"
)
#: seconds to reach a cluster's head (``--address``) before giving up
CONNECT_TIMEOUT_S = 15.0
FAILED_DIR = "failed"
#: attempts of a run whose worker dies (the first try and one retry)
MAX_ATTEMPTS = 2
RAY_PORT, CLIENT_PORT = 6379, 10001


class RayUnavailableError(RuntimeError):
    """``--executor ray`` without Ray installed; names the extra to install."""


class ClusterConnectError(RuntimeError):
    """The Ray cluster at ``--address`` cannot be reached (nothing was run or written)."""


class ClusterAuthError(ClusterConnectError):
    """The Ray cluster at ``--address`` uses token authentication (``RAY_AUTH_MODE=token``) and
    this process has no valid token; the message says how to pass it."""


#: what Ray's token-authentication failures say: ``ray.exceptions.AuthenticationError`` (Ray
#: >= 2.50) and the gRPC status a head answers a request without a valid token with, which
#: ``ray.init`` wraps in a bare "Failed to connect to Ray cluster at ..."
AUTH_MARKERS = ("unauthenticated", "authentication token", "authenticationerror")


def import_ray() -> Any:
    """``import ray`` or :class:`RayUnavailableError` naming :data:`INSTALL_HINT`."""
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailableError(
            f"--executor ray needs Ray, which is not installed here ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from None
    return ray


def auth_cause(exc: BaseException) -> BaseException | None:
    """The token-authentication failure in ``exc``'s chain (``__cause__``/``__context__``):
    a ``ray.exceptions.AuthenticationError`` or an error whose text names the missing or
    invalid token (:data:`AUTH_MARKERS`); ``None`` when the failure is something else."""
    import ray.exceptions

    auth_type = getattr(ray.exceptions, "AuthenticationError", ())
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = f"{type(err).__name__} {getattr(err, 'message', '')} {err}".lower()
        if isinstance(err, auth_type) or any(m in text for m in AUTH_MARKERS):
            return err
        err = err.__cause__ or err.__context__
    return None


def auth_message(address: str | None, cause: BaseException) -> str:
    """The :class:`ClusterAuthError` text: the cluster needs a token, and the variables and
    file through which Ray reads it."""
    said = str(getattr(cause, "message", "") or cause).strip().splitlines()
    said = said[0][:200] if said else type(cause).__name__
    return (
        f"the Ray cluster at --address {address!r} requires token authentication "
        f"(RAY_AUTH_MODE=token, the default of recent Ray releases) and this process has no "
        f"valid token (Ray: {said}). Pass the cluster's token (print it on the head node with "
        "`ray get-auth-token`): export RAY_AUTH_MODE=token and either RAY_AUTH_TOKEN=<token> "
        "or the token in the file ~/.ray/auth_token (another file: RAY_AUTH_TOKEN_PATH=<file>) "
        "before `kvbench run`; docs/cluster.md#token-authentication"
    )


def failed_path(out_dir: str | Path, run_id: str) -> Path:
    """Where the failed record of ``run_id`` is written: ``OUT/failed/<run_id>.json``."""
    return Path(out_dir) / FAILED_DIR / f"{run_id}.json"


# ------------------------------------------------------------------ cluster: connect and size
def _host_port(address: str) -> tuple[str, int]:
    client = address.startswith("ray://")
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        host, port = rest, str(CLIENT_PORT if client else RAY_PORT)
    return host.strip("[]"), int(port)


def connect(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Connect this process to Ray; returns whether a local Ray instance was started here
    (which the caller shuts down).  An already initialized Ray (e.g. ``ray.init`` in a test or a
    notebook) is used as is.  ``address``: ``None`` (start a local instance on this machine),
    ``"auto"`` (the cluster started on this node with ``ray start``), ``HOST:PORT`` (the head's
    GCS port, 6379) or ``ray://HOST:PORT`` (Ray Client, 10001).

    Raises
    ------
    RayUnavailableError
        Ray is not installed.
    ClusterConnectError
        ``HOST:PORT`` not reachable within ``timeout_s`` seconds (a TCP probe of the head before
        Ray's own, longer retry loop), or Ray refusing the address (``auto`` with no cluster).
    ClusterAuthError
        The cluster uses token authentication and this process has no valid token
        (:func:`auth_cause` found it in Ray's error); the message names ``RAY_AUTH_MODE``,
        ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` and ``~/.ray/auth_token``.
    """
    ray = import_ray()
    if address not in (None, "auto", "local"):
        host, port = _host_port(address)
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            raise ClusterConnectError(
                f"cannot reach a Ray cluster at --address {address!r} ({host}:{port}) within "
                f"{timeout_s:g} s: {exc}; start its head with `ray start --head` and pass the "
                "address it prints (docs/cluster.md)"
            ) from None
    if ray.is_initialized():
        return False
    import logging

    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    except Exception as exc:  # Ray's AuthenticationError is none of the three below
        cause = auth_cause(exc)
        if cause is not None:
            raise ClusterAuthError(auth_message(address, cause)) from None
        if not isinstance(exc, (ConnectionError, RuntimeError, ValueError)):
            raise
        raise ClusterConnectError(
            f"cannot connect to Ray at --address {address!r}: {exc}"
        ) from None
    return address in (None, "local")


def request_for(suite: Suite, model_spec: dict[str, Any] | None) -> dict[str, float]:
    """The Ray resource request of one worker of ``model_spec``: the suite's ``resources:``
    with defaults ``num_cpus: 1`` and ``num_gpus: 1`` for a ``cuda`` model (else 0), in Ray's
    names (``CPU``, ``GPU``, ``memory``, custom names).

    Raises ``ValueError`` for a CUDA model with ``num_gpus: 0`` (a Ray worker without a GPU
    request sees no GPU)."""
    res = dict(suite.resources or {})
    cuda = str((model_spec or {}).get("device", "cpu")).startswith("cuda")
    gpus = res.get("num_gpus", 1 if cuda else 0)
    if cuda and gpus == 0:
        raise ValueError(
            f"{suite.path}: model {model_spec['id']!r} runs on {model_spec['device']!r}, but "
            "resources.num_gpus is 0: a Ray worker sees only the GPUs it requests; "
            "set resources.num_gpus (e.g. 1)"
        )
    req = {"CPU": float(res.get("num_cpus", 1)), "GPU": float(gpus)}
    if "memory" in res:
        req["memory"] = float(res["memory"])
    req.update({k: float(v) for k, v in (res.get("custom") or {}).items()})
    return {k: v for k, v in req.items() if v > 0}


def slots(nodes: list[dict[str, float]], req: dict[str, float]) -> int:
    """How many workers of request ``req`` the nodes' total resources hold at once."""
    total = 0
    for res in nodes:
        fit = [int(res.get(k, 0.0) // v + 1e-9) for k, v in req.items() if v > 0]
        total += min(fit) if fit else 1
    return total


def check_capacity(
    ray: Any, suite: Suite, groups: list[list[PlannedRun]]
) -> dict[int, tuple[dict[str, float], int]]:
    """Per model index: (request, slots on the cluster).  Raises ``ValueError`` naming the
    first run and the request when no node of the cluster can hold one worker of a model
    (before anything is submitted)."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    out = {}
    for group in groups:
        spec = group[0].model_spec
        req = request_for(suite, spec)
        n = slots(nodes, req)
        if n == 0:
            largest = {k: max((r.get(k, 0.0) for r in nodes), default=0.0) for k in req}
            raise ValueError(
                f"{suite.path}: run {group[0].title!r} (model "
                f"{(spec or {}).get('id', 'none')!r}) requests {req} per worker, more than any "
                f"node of the Ray cluster has (largest per resource: {largest}); lower "
                "'resources' in the suite or add a node that has them"
            )
        out[group[0].model_index] = (req, n)
    return out


# ------------------------------------------------------------------ the worker (a Ray actor)
def node_info() -> dict[str, Any]:
    """Where this process runs: host name, IP, Ray node id, pid, and Ray's GPU ids."""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "hostname": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "node_id": ctx.get_node_id(),
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
    }


class ModelWorker:
    """One model on one device: a :class:`~kvbench.bench.runner.RunContext` kept across runs.

    Made a Ray actor by :class:`RayExecutor` (``ray.remote(ModelWorker).options(num_cpus=...,
    num_gpus=...)``); usable as a plain object too.  ``threads``: torch threads (the suite's
    ``threads`` capped at the worker's ``num_cpus``)."""

    def __init__(
        self, suite: Suite, model_index: int, limit: int | None, threads: int | None
    ) -> None:
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        self.suite = suite
        self.ctx = RunContext(model_spec=suite.models[model_index], seed=suite.seed, limit=limit)
        self.workloads: dict[int, Workload] = {}
        self.origin: dict[int, str] = {}  # workload index -> "here" | "object store"

    def describe(self) -> dict[str, Any]:
        return node_info()

    def load(self) -> bool:
        """Load the model now (the driver calls it on creation, so loading overlaps other
        workers' preparation)."""
        ensure_model(self.ctx)
        return True

    def prepare(self, index: int, spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """``workload.prepare`` of workload ``index``; returns (status, shared state).  The
        state (the prepared workload's attributes and the ``ctx.shared`` entries it added,
        :meth:`~kvbench.bench.context.Shared.added_since`) goes
        to the object store for the model's other workers (:meth:`install`).  A
        ``FileNotFoundError`` (data not available here) is returned as
        ``{"unavailable": message}``, any other error raised."""
        ensure_model(self.ctx)
        workload = WORKLOADS.get(spec["type"])(spec)
        before = self.ctx.shared.snapshot()
        try:
            prepare_workload(self.ctx, workload, self.suite.seed)
        except FileNotFoundError as exc:
            return {"unavailable": str(exc)}, None
        self.workloads[index] = workload
        self.origin[index] = "here"
        state = {
            "workload": dict(vars(workload)),
            "shared": self.ctx.shared.added_since(before),
        }
        return {"ok": True}, state

    def install(self, index: int, spec: dict[str, Any], state: dict[str, Any]) -> None:
        """Take workload ``index`` as another worker prepared it (no recomputation)."""
        workload = WORKLOADS.get(spec["type"])(spec)
        vars(workload).update(state["workload"])
        self.ctx.shared.merge(state["shared"])
        self.workloads[index] = workload
        self.origin[index] = "object store"

    def run(
        self, run: PlannedRun, baseline: dict[str, float] | None, state_ref: list[Any]
    ) -> dict[str, Any]:
        """Compute the record of ``run`` (:func:`kvbench.bench.runner.compute_record`) with the
        node and device in its manifest.  ``state_ref``: ``[ObjectRef]`` of the prepared state
        (nested in a list so Ray fetches it only when this worker lacks the workload)."""
        import ray

        t0 = time.perf_counter()
        ensure_model(self.ctx)
        if run.workload_index not in self.workloads:
            self.install(run.workload_index, run.workload_spec, ray.get(state_ref[0]))
        t1 = time.perf_counter()
        rec = compute_record(
            self.suite, self.ctx, self.workloads[run.workload_index], run, baseline
        )
        t2 = time.perf_counter()
        rec.manifest["executor"] = "ray"
        rec.manifest["node"] = node_info()
        prepared = self.origin[run.workload_index]
        return {"record": rec, "setup_s": t1 - t0, "exec_s": t2 - t1, "prepared": prepared}


# ------------------------------------------------------------------ the driver
@dataclass
class _Worker:
    handle: Any
    model_index: int
    name: str
    info: dict[str, Any] = field(default_factory=dict)
    info_ref: Any = None
    load_ref: Any = None  # the model load, submitted on creation
    ready_at: float | None = None  # when the driver saw the load finish (runs timed from here)
    has: set[int] = field(default_factory=set)  # workload indices installed or prepared here
    busy: Any = None  # the _Task in flight
    bar: Any = None
    doing: str = "starting"
    created: float = field(default_factory=time.perf_counter)
    since: float = field(default_factory=time.perf_counter)


@dataclass
class _Task:
    kind: str  # "prepare" | "run"
    worker: _Worker
    key: tuple[int, int]
    run: PlannedRun | None = None
    attempt: int = 1
    submitted: float = 0.0
    state: Any = None  # prepare: ref of the shared state


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
        worker_cls: type = ModelWorker,
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
        self.failed: list[dict[str, Any]] = []
        self.timings: list[dict[str, Any]] = []
        self.startup_s = 0.0
        self.handles: list[Any] = []  # every worker created (all killed when run() returns)
        self.spawn_s: list[float] = []  # per worker: creation to first answer (process start)

    # -- small helpers
    def _note(self, msg: str) -> None:
        if not self.quiet:
            tqdm.write(msg, file=sys.stderr)

    def run(self) -> list[Record]:
        """Plan, resume, submit, collect; returns the records.  See the module docstring."""
        runs = plan_runs(self.suite, self.out_dir, self.limit)  # config errors before Ray
        if not self.force and all(r.path.exists() for r in runs):  # nothing to do: no Ray
            self.records = [finished_record(r) for r in runs]
            return self.records
        t0 = time.perf_counter()
        started = connect(self.address, self.connect_timeout_s)
        self.startup_s = time.perf_counter() - t0
        import ray

        self.ray = ray
        try:
            return self._run(runs)
        finally:
            if started:
                ray.shutdown()

    def _run(self, runs: list[PlannedRun]) -> list[Record]:
        ray = self.ray
        groups = group_by_model(runs)
        self.capacity = check_capacity(ray, self.suite, groups)
        self.results: dict[str, Record] = {}
        self.pending: dict[int, deque[PlannedRun]] = {}
        self.baseline: dict[tuple[int, int], Any] = {}  # metrics | "pending" | "failed"
        self.prepared: dict[tuple[int, int], Any] = {}  # key -> ref | "running" | "skip"
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
        self.order = [g[0].model_index for g in groups]
        self.workers: list[_Worker] = []
        self.inflight: dict[Any, _Task] = {}
        self.attempts: dict[str, int] = {}  # run_id -> attempt of its next submission
        self.prep_attempts: dict[tuple[int, int], int] = {}
        self.n_failed, self.n_workers = 0, 0
        self.remote_cls = ray.remote(self.worker_cls)
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
        cpus = req.get("CPU", 0.0)
        threads = self.suite.threads
        if threads and cpus >= 1:
            threads = min(int(threads), int(cpus))
        elif not threads and cpus >= 1:
            threads = int(cpus)
        custom = {k: v for k, v in req.items() if k not in ("CPU", "GPU", "memory")}
        opts: dict[str, Any] = {"num_cpus": cpus, "num_gpus": req.get("GPU", 0.0)}
        if "memory" in req:
            opts["memory"] = req["memory"]
        if custom:
            opts["resources"] = custom
        actor = self.remote_cls.options(max_restarts=0, **opts)
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

    def _submit_prepare(self, w: _Worker, key: tuple[int, int], run: PlannedRun) -> None:
        status, state = w.handle.prepare.options(num_returns=2).remote(
            run.workload_index, run.workload_spec
        )
        task = _Task("prepare", w, key, run=run, submitted=time.perf_counter(), state=state)
        task.attempt = self.prep_attempts.get(key, 0) + 1
        self.prepared[key] = "running"
        self.inflight[status] = task
        w.busy = task
        self._show(w, f"preparing {run.workload_spec['type']}")

    def _submit_run(self, w: _Worker, run: PlannedRun, attempt: int = 1) -> None:
        key = (run.model_index, run.workload_index)
        base = self.baseline.get(key)
        base = base if isinstance(base, dict) and not run.is_baseline else None
        ref = w.handle.run.remote(run, base, [self.prepared[key]])
        task = _Task("run", w, key, run=run, attempt=attempt, submitted=time.perf_counter())
        self.inflight[ref] = task
        w.busy = task
        self._show(w, run.title)

    def _show(self, w: _Worker, what: str | None = None) -> None:
        if what is not None:
            w.doing, w.since = what, time.perf_counter()
        if w.bar is not None:
            where = w.info.get("hostname", "?")
            gpus = w.info.get("gpu_ids")
            dev = f" gpu {','.join(gpus)}" if gpus else ""
            idle = "" if w.busy is not None else " (idle)"
            elapsed = time.perf_counter() - w.since
            w.bar.set_description_str(
                f"  {w.name} [{where}{dev}]: {w.doing}{idle} {elapsed:.0f}s", refresh=True
            )

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
                self._show(w)

    # -- per-run timeout (--run-timeout)
    def _started(self, task: _Task) -> float | None:
        """When ``task`` (a run) started counting against the timeout: its submission, or the
        end of its worker's model load if later (``None``: the model is still loading)."""
        ready = task.worker.ready_at
        return None if ready is None else max(task.submitted, ready)

    def _wait_s(self) -> float:
        """How long the loop may block in ``ray.wait``: 1 s, less when a run's time is up
        sooner."""
        wait = 1.0
        if self.run_timeout_s is not None:
            now = time.perf_counter()
            for task in self.inflight.values():
                start = self._started(task) if task.kind == "run" else None
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
            start = self._started(task) if task.kind == "run" else None
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
            extra = {"timed_out": True, "timeout_s": limit}
            self._fail(task.run, msg, task.attempt, task.worker, extra)

    def _collect(self, ref: Any, task: _Task) -> None:
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
            if "unavailable" in out:
                self._unavailable(task.key, out["unavailable"])
            else:
                self.prepared[task.key] = task.state
                w.has.add(task.key[1])
            return
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

    def _unavailable(self, key: tuple[int, int], message: str) -> None:
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

    def _drop_baseline(self, key: tuple[int, int]) -> None:
        if self.baseline.get(key) == "pending":
            self.baseline[key] = "failed"

    def _fail_group(self, key: tuple[int, int], message: str, attempts: int) -> None:
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
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Write the failed record of ``run`` (``extra``: more fields, e.g. ``timed_out``)."""
        key = (run.model_index, run.workload_index)
        rec = {
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
            **(extra or {}),
            "manifest": {
                "executor": "ray",
                "node": (w.info if w else {}),
                "suite": self.suite.path,
            },
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
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


def run_suite_ray(suite: Suite, out_dir: str | Path, **kwargs: Any) -> RayExecutor:
    """Run ``suite`` on Ray (keyword arguments: those of :class:`RayExecutor`); returns the
    executor, whose ``records``, ``failed`` and ``timings`` describe the sweep."""
    ex = RayExecutor(suite, out_dir, **kwargs)
    ex.run()
    return ex


def runner_from_args(args: argparse.Namespace) -> Any:
    """A ``run_suite``-compatible callable for ``kvbench run --executor ray`` (the CLI's
    ``--address``, ``--max-parallel``, ``--progress-workers``, ``--run-timeout``); after the call its ``failed``
    attribute lists the failed records and ``executor`` is the :class:`RayExecutor`.

    Raises :class:`RayUnavailableError` at once (before any folder is made) without ray."""
    import_ray()

    def runner(suite: Suite, out_dir: str | Path, **kwargs: Any) -> list[Record]:
        ex = RayExecutor(
            suite,
            out_dir,
            address=args.address,
            max_parallel=args.max_parallel,
            progress_workers=args.progress_workers,
            run_timeout_s=args.run_timeout,
            **kwargs,
        )
        runner.executor = ex
        ex.run()
        runner.failed = ex.failed
        return ex.records

    runner.failed = []
    return runner
