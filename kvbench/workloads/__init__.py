"""Workloads: what a run measures.  Each type is one module with a :class:`Workload` subclass.

A workload is validated from its suite mapping (:meth:`Workload.validate`: defaults filled,
unknown keys rejected), prepares what all methods share once per model (captured tensors,
reference logits), then runs once per method configuration and returns flat metrics.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: workload type -> "module:Class"
WORKLOADS = {
    "bits": "kvbench.workloads.bits:Bits",
    "fidelity": "kvbench.workloads.fidelity:Fidelity",
    "perplexity": "kvbench.workloads.perplexity:Perplexity",
    "generation": "kvbench.workloads.generation:Generation",
    "passkey": "kvbench.workloads.passkey:Passkey",
    "memory": "kvbench.workloads.memory:Memory",
    "latency": "kvbench.workloads.latency:Latency",
    "gsm8k": "kvbench.workloads.gsm8k:GSM8K",
    "mgsm": "kvbench.workloads.mgsm:MGSM",
    "math": "kvbench.workloads.math_task:MathTask",
    "humaneval": "kvbench.workloads.humaneval:HumanEval",
    "ruler": "kvbench.workloads.ruler:Ruler",
    "gpqa": "kvbench.workloads.hub_tasks:GPQA",
    "infinitebench": "kvbench.workloads.hub_tasks:InfiniteBench",
    "score_agreement": "kvbench.workloads.pair_analysis:ScoreAgreement",
    "selection_stability": "kvbench.workloads.pair_analysis:SelectionStability",
}


def check_random_weights(types: list[str], model: dict[str, Any] | None, where: str = "") -> None:
    """Refuse a shape-only model (``model['shape']``) for workload types whose class has
    ``accepts_random_weights = False``: ``ValueError`` naming them and the ones that accept it.
    Called when a suite is parsed and again before a model loads."""
    if not model or "shape" not in model:
        return
    bad = sorted({t for t in types if not workload_class(t).accepts_random_weights})
    if bad:
        ok = sorted(t for t in WORKLOADS if workload_class(t).accepts_random_weights)
        pre = f"{where}: " if where else ""
        raise ValueError(
            f"{pre}model shape {model['shape']!r} has random weights: accuracy is meaningless, "
            f"so workload(s) {bad} refuse it; shape models run {ok}"
        )


def workload_class(kind: str, where: str = "") -> type[Workload]:
    """The class for workload type ``kind``; ``ValueError`` naming the allowed types."""
    if kind not in WORKLOADS:
        pre = f"{where}: " if where else ""
        raise ValueError(f"{pre}unknown workload type {kind!r}; allowed: {sorted(WORKLOADS)}")
    module, attr = WORKLOADS[kind].split(":")
    return getattr(importlib.import_module(module), attr)


@dataclass
class Result:
    """What one run of a workload returns."""

    metrics: dict[str, float]
    per_layer: dict[str, Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # goes to the manifest


class Workload:
    """Base class.  ``PARAMS`` maps each parameter to its default (``...`` = required)."""

    type: ClassVar[str] = ""
    needs_model: ClassVar[bool] = True
    #: runs methods through kvbench LayerCaches (``Method.new_layer``, ``QuantizedKVCache``);
    #: the runner skips methods without them (``capabilities.layer_cache=False``: peers)
    layer_cache: ClassVar[bool] = True
    #: its numbers do not depend on the weights' values (bytes at rest, peaks, latency), so a
    #: shape model (``model: {shape: ...}``, :mod:`kvbench.hf.shapes`, seeded random weights)
    #: may run it; False (accuracy, fidelity): such a model is refused before anything loads
    accepts_random_weights: ClassVar[bool] = False
    #: with a shape model: True runs a forward (the model is materialized with seeded random
    #: weights on the target device), False reads only the config (built on the meta device)
    shape_forward: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, Any]] = {}
    #: parameters whose value is a list by nature (not expanded into a sweep)
    LIST_PARAMS: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def validate(cls, spec: dict[str, Any], where: str = "") -> dict[str, Any]:
        """Fill defaults and reject unknown or missing parameters (``ValueError``)."""
        pre = f"{where}: " if where else ""
        params = {k: v for k, v in spec.items() if k != "type"}
        unknown = sorted(set(params) - set(cls.PARAMS))
        if unknown:
            raise ValueError(
                f"{pre}unknown parameter(s) {unknown} for workload {cls.type!r}; "
                f"allowed: {sorted(cls.PARAMS)}"
            )
        out = {"type": cls.type}
        for k, default in cls.PARAMS.items():
            if k not in params and default is ...:
                raise ValueError(f"{pre}workload {cls.type!r} needs parameter {k!r}")
            out[k] = params.get(k, default)
        cls.check(out, pre)
        return out

    @classmethod
    def check(cls, spec: dict[str, Any], pre: str) -> None:
        """Extra validation of a filled spec; raise ``ValueError`` starting with ``pre``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def prepare(self, ctx: Any) -> None:
        """Work shared by every method on one model (called once before the runs)."""

    def run(self, ctx: Any, method: Any) -> Result:
        raise NotImplementedError
