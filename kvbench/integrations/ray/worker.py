"""The worker: one Ray actor (:class:`ModelWorker`) per model per device, which loads its model
once, prepares workloads or installs another worker's preparation, and computes records."""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from kvbench.bench.context import RunContext
from kvbench.bench.records import Record
from kvbench.bench.runner import (
    PlannedRun,
    compute_record,
    ensure_model,
    prepare_workload,
)
from kvbench.bench.suite import Suite
from kvbench.bench.workloads import WORKLOADS, Workload

if TYPE_CHECKING:  # Ray is an optional extra: its types for annotations only
    from ray import ObjectRef

#: where a worker's prepared workload came from: its own ``workload.prepare``, or another
#: worker's through Ray's object store
Origin = Literal["here", "object store"]


class NodeInfo(TypedDict, total=False):
    """Where a worker runs (:func:`node_info`; empty when the worker never answered)."""

    hostname: str
    ip: str
    node_id: str
    pid: int
    gpu_ids: list[str]


class PrepareStatus(TypedDict, total=False):
    """What :meth:`ModelWorker.prepare` tells the driver: ``ok``, or the data is unavailable."""

    ok: bool
    unavailable: str


class PreparedState(TypedDict):
    """A prepared workload, as it travels through the object store (:meth:`ModelWorker.install`)."""

    workload: dict[str, object]  # the prepared workload's attributes
    shared: dict[str, object]  # the ctx.shared entries it added (Shared.added_since)


class RunOutput(TypedDict):
    """What :meth:`ModelWorker.run` returns to the driver."""

    record: Record
    setup_s: float  # model load and workload install before the run
    exec_s: float  # compute_record
    prepared: Origin


def node_info() -> NodeInfo:
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

    Made a Ray actor by :class:`~kvbench.integrations.ray.scheduler.RayExecutor`
    (``ray.remote(ModelWorker).options(num_cpus=..., num_gpus=...)``); usable as a plain object
    too.  ``threads``: torch threads (the suite's ``threads`` capped at the worker's
    ``num_cpus``)."""

    def __init__(
        self, suite: Suite, model_index: int, limit: int | None, threads: int | None
    ) -> None:
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        self.suite = suite
        self.ctx = RunContext(model_spec=suite.models[model_index], seed=suite.seed, limit=limit)
        self.workloads: dict[int, Workload] = {}
        self.origin: dict[int, Origin] = {}  # workload index -> where it was prepared

    def describe(self) -> NodeInfo:
        return node_info()

    def load(self) -> bool:
        """Load the model now (the driver calls it on creation, so loading overlaps other
        workers' preparation)."""
        ensure_model(self.ctx)
        return True

    def prepare(
        self, index: int, spec: dict[str, Any]
    ) -> tuple[PrepareStatus, PreparedState | None]:
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
        state: PreparedState = {
            "workload": dict(vars(workload)),
            "shared": self.ctx.shared.added_since(before),
        }
        return {"ok": True}, state

    def install(self, index: int, spec: dict[str, Any], state: PreparedState) -> None:
        """Take workload ``index`` as another worker prepared it (no recomputation)."""
        workload = WORKLOADS.get(spec["type"])(spec)
        vars(workload).update(state["workload"])
        self.ctx.shared.merge(state["shared"])
        self.workloads[index] = workload
        self.origin[index] = "object store"

    def run(
        self,
        run: PlannedRun,
        baseline: dict[str, float] | None,
        state_ref: list[ObjectRef[PreparedState]],
    ) -> RunOutput:
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
