"""Workloads: what a run measures.  Each type is one module with a :class:`Workload` subclass.

A workload is validated from its suite mapping (:meth:`Workload.validate`: defaults filled,
unknown keys rejected), prepares what all methods share once per model (captured tensors,
reference logits), then runs once per method configuration and returns flat metrics.

Registry
--------
:data:`WORKLOADS` (a :class:`kvbench.registry.Registry`) maps each workload type to its class,
from the entry-point group ``kvbench.workloads`` or ``@WORKLOADS.register("name")`` (README,
"Adding a workload": ``METRICS`` directions, ``fnmatch`` keys).  A class without declarations,
with an unknown direction, or whose declaration contradicts another loaded workload's for the
same metric is an error when it is loaded or registered (:class:`WorkloadRegistrationError`,
wrapped in a :class:`kvbench.registry.RegistryError` naming the distribution for an entry
point); a metric returned by ``run`` that matches no declaration is an error at run time.
"""

from __future__ import annotations

import abc
import fnmatch
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import EllipsisType
from typing import TYPE_CHECKING, ClassVar, NoReturn

from kvbench import fields as kf
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue
from kvbench.registry import Registry, RegistryError

if TYPE_CHECKING:
    from kvbench.bench.context import Info, LayerKV, RunContext
    from kvbench.cache.method import Method

GROUP = "kvbench.workloads"
LOWER, HIGHER, NONE = "lower", "higher", "none"
ALLOWED_DIRECTIONS = (LOWER, HIGHER, NONE)
#: a metric name ending in one of these follows the direction of its base metric
DERIVED_SUFFIXES = ("_ratio", "_ci_low", "_ci_high")


class WorkloadRegistrationError(TypeError):
    """A workload class whose metric declarations are missing or inconsistent."""


def declared_metrics(cls: type[Workload]) -> dict[str, str]:
    """``METRICS`` of ``cls`` merged over its bases (a subclass's entry wins)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        out.update(vars(klass).get("METRICS", {}))
    return out


def _checked_workload(kind: str, cls: object) -> type[Workload]:
    """The ``check`` of :data:`WORKLOADS`: ``cls`` as a workload class registered as ``kind``.

    Raises
    ------
    WorkloadRegistrationError
        Not a :class:`Workload` subclass, no ``METRICS``, a direction other than
        ``'lower'``/``'higher'``/``'none'``, or a metric declared by another loaded workload
        with a different direction.
    """
    if not (isinstance(cls, type) and issubclass(cls, Workload)):
        raise WorkloadRegistrationError(
            f"{cls!r} is not a kvbench.bench.workloads.Workload subclass"
        )
    decl = declared_metrics(cls)
    if not decl:
        raise WorkloadRegistrationError(
            f"workload {kind!r} ({cls.__qualname__}) declares no METRICS; every metric needs a "
            f"direction, one of {ALLOWED_DIRECTIONS}"
        )
    bad = {m: d for m, d in decl.items() if d not in ALLOWED_DIRECTIONS}
    if bad:
        raise WorkloadRegistrationError(
            f"workload {kind!r}: unknown direction(s) {bad}; allowed: {ALLOWED_DIRECTIONS}"
        )
    for other_kind, other in WORKLOADS.loaded().items():
        if other_kind == kind:
            continue
        theirs = declared_metrics(other)
        clash = {m: (d, theirs[m]) for m, d in decl.items() if m in theirs and theirs[m] != d}
        if clash:
            raise WorkloadRegistrationError(
                f"workload {kind!r} and {other_kind!r} declare different directions for "
                f"{clash} (theirs second)"
            )
    return cls


#: every workload type (a suite's ``type``) -> its :class:`Workload` subclass, from the
#: entry-point group ``kvbench.workloads``; ``@WORKLOADS.register("name")`` adds one in code
WORKLOADS: Registry[type[Workload]] = Registry("workload type", GROUP, _checked_workload)


def check_random_weights(
    types: list[str], model: dict[str, JSONValue] | None, where: str = ""
) -> None:
    """Refuse a shape-only model (``model['shape']``) for workload types whose class has
    ``accepts_random_weights = False``: ``ValueError`` naming them and the ones that accept it.
    Called when a suite is parsed and again before a model loads."""
    if not model or "shape" not in model:
        return
    bad = sorted({t for t in types if not WORKLOADS.get(t).accepts_random_weights})
    if bad:
        ok = [t for t in WORKLOADS.names() if WORKLOADS.get(t).accepts_random_weights]
        pre = f"{where}: " if where else ""
        raise ValueError(
            f"{pre}model shape {model['shape']!r} has random weights: accuracy is meaningless, "
            f"so workload(s) {bad} refuse it; shape models run {ok}"
        )


def _lookup(metric: str, decl: dict[str, str]) -> str | None:
    if metric in decl:
        return decl[metric]
    pats = sorted((p for p in decl if any(c in p for c in "*?[")), key=len, reverse=True)
    for p in pats:  # the most specific (longest) pattern first
        if fnmatch.fnmatchcase(metric, p):
            return decl[p]
    return None


def metric_direction(metric: str, cls: type[Workload] | None = None) -> str | None:
    """``'lower'``, ``'higher'`` or ``'none'`` for ``metric`` as declared by ``cls`` (default:
    any registered workload; all are loaded); ``None`` when undeclared.  ``*_ratio``,
    ``*_ci_low`` and ``*_ci_high`` follow their base metric."""
    names = [metric]
    for suffix in DERIVED_SUFFIXES:
        if metric.endswith(suffix):
            names.append(metric[: -len(suffix)])
    if cls is not None:
        decls = [declared_metrics(cls)]
    else:
        for kind in WORKLOADS.names():
            try:
                WORKLOADS.get(kind)
            except RegistryError:  # a broken plugin does not hide the others' metrics
                continue
        decls = [declared_metrics(c) for c in WORKLOADS.loaded().values()]
    for name in names:
        for decl in decls:
            d = _lookup(name, decl)
            if d is not None:
                return d
    return None


def check_metrics(cls: type[Workload], metrics: Mapping[str, float]) -> None:
    """``ValueError`` naming every metric in ``metrics`` that ``cls`` does not declare."""
    missing = sorted(m for m in metrics if metric_direction(m, cls) is None)
    if missing:
        raise ValueError(
            f"workload {cls.type!r} reported metric(s) {missing} without a declared direction; "
            f"add them to {cls.__qualname__}.METRICS"
        )


def reject(pre: str, name: str, value: object, allowed: str) -> NoReturn:
    """:func:`kvbench.fields.reject` from a :meth:`Workload.check`: ``pre`` is its
    ``"<where>: "`` prefix (or ``""``)."""
    kf.reject(pre.removesuffix(": "), name, value, allowed)


@dataclass
class Result:
    """What one run of a workload returns."""

    metrics: dict[str, float]
    per_layer: dict[str, JSONValue] | None = None
    info: dict[str, JSONValue] = field(default_factory=dict)  # goes to the manifest
    #: files written beside the record as ``<run_id>.<name>`` (JSON Lines: name -> rows)
    files: dict[str, list[dict[str, JSONValue]]] = field(default_factory=dict)


@dataclass(frozen=True)
class PendingRun:
    """A run the runner will compute in a workload (:meth:`Workload.plan`): no record yet, not
    skipped.  ``label`` is its suite label; ``method()`` returns the method exactly as
    ``run(ctx, method)`` will receive it (fitted to the model, calibrated if it needs it), built
    on the first call and then the same object on every call (so a workload tells its runs
    apart by identity); it raises what building the method raises (``ValueError``, ...).  Call
    it only inside ``run`` (the model is loaded by then)."""

    label: str
    method: Callable[[], Method]


#: :attr:`Workload.SOURCE_PARAMS` of the workloads that capture K/V from a model's forward over
#: a text (``source: model``) or draw them of a given geometry (``source: synthetic``)
KV_SOURCE_PARAMS: dict[str, frozenset[str]] = {
    "synthetic": frozenset({"num_layers", "num_heads", "num_kv_heads", "head_dim"}),
    "model": frozenset({"text", "window"}),
}


def check_kv_heads(spec: dict[str, JSONValue], pre: str) -> None:
    """The drawn geometry of a K/V-source workload: ``num_heads`` a multiple of
    ``num_kv_heads`` (GQA); else :func:`reject` naming both."""
    if spec["num_heads"] % spec["num_kv_heads"]:
        reject(
            pre, "num_heads", spec["num_heads"], f"multiples of num_kv_heads={spec['num_kv_heads']}"
        )


def _rule_of_default(default: object) -> Field | None:
    """The rule a parameter without a declared :class:`~kvbench.fields.Field` gets from its
    default: a bool wants true or false, an int an integer >= 0, a float a number, a str a
    string, each or ``None``; other defaults (``None``, ``...``, lists) give no rule."""
    if isinstance(default, bool):
        return Field(bool, optional=True)
    if isinstance(default, int):
        return Field(int, low=0, optional=True)
    if isinstance(default, float):
        return Field(float, optional=True)
    if isinstance(default, str):
        return Field(str, optional=True)
    return None


@functools.cache
def param_fields(cls: type[Workload]) -> dict[str, Field]:
    """Parameter -> rule of ``cls``: its ``FIELDS`` merged over its bases (a subclass's entry
    wins), else the rule of the parameter's default (:func:`_rule_of_default`; not for
    ``LIST_PARAMS``)."""
    declared: dict[str, Field] = {}
    for klass in reversed(cls.__mro__):
        declared.update(vars(klass).get("FIELDS", {}))
    out: dict[str, Field] = {}
    for name, default in cls.PARAMS.items():
        rule = declared.get(name)
        if rule is None and name not in cls.LIST_PARAMS:
            rule = _rule_of_default(default)
        if rule is not None:
            out[name] = rule
    return out


#: ``layers:`` of the workloads that capture K/V per layer
LAYERS = Field(int, shape="list", low=0, extra=("all",))
#: ``source:`` of the workloads with :data:`KV_SOURCE_PARAMS`
SOURCES = Field(str, choices=tuple(sorted(KV_SOURCE_PARAMS)))


class Workload(abc.ABC):
    """Base class.  ``PARAMS`` maps each parameter to its default (``...`` = required);
    ``FIELDS`` maps a parameter to its :class:`~kvbench.fields.Field` (type, range, allowed
    values), else the default's type gives the rule (:func:`param_fields`).

    The runner calls ``prepare(ctx)`` once per model (from a fresh seed), then
    ``run(ctx, method)`` once per method configuration, then :func:`check_metrics` on the
    result; ``ctx`` is the model's :class:`~kvbench.bench.context.RunContext`."""

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
    #: with a shape model it still reads its datasets (a prompt text to run a forward on);
    #: False: it draws K/V of the shape instead, and the asset pre-flight asks for none
    shape_reads_data: ClassVar[bool] = True
    #: builds the method's caches; False (a formula of the config alone, e.g. ``bits``): the
    #: runner does not calibrate methods with ``needs_calibration`` for it
    builds_caches: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, JSONValue | EllipsisType]] = {}
    #: parameter -> what it allows, checked by :meth:`validate` before :meth:`check`
    FIELDS: ClassVar[dict[str, Field]] = {}
    #: metric (or fnmatch pattern) -> ``'lower' | 'higher' | 'none'``; merged over the bases
    METRICS: ClassVar[dict[str, str]] = {}
    #: parameters whose value is a list by nature (not expanded into a sweep)
    LIST_PARAMS: ClassVar[frozenset[str]] = frozenset()
    #: ``source`` value -> parameters that apply only with it (e.g. ``synthetic``: the drawn
    #: geometry; ``model``: the captured text).  With any other ``source`` they leave the
    #: filled spec (so neither the record, nor its run id, nor the asset pre-flight carries a
    #: setting the run does not read); given explicitly there, :meth:`validate` raises.
    SOURCE_PARAMS: ClassVar[dict[str, frozenset[str]]] = {}

    @classmethod
    def validate(cls, spec: dict[str, JSONValue], where: str = "") -> dict[str, JSONValue]:
        """Fill defaults; reject unknown or missing parameters and values their
        :func:`param_fields` rule refuses, then run :meth:`check` (``ValueError``)."""
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
        unused = cls._unused_by_source(out, params, pre)
        kf.validate(out, where, param_fields(cls))
        cls.check(out, pre)
        for k in unused:
            del out[k]
        return out

    @classmethod
    def _unused_by_source(
        cls, spec: dict[str, JSONValue], given: dict[str, JSONValue], pre: str
    ) -> list[str]:
        """Parameters of :data:`SOURCE_PARAMS` that ``spec['source']`` does not read;
        ``ValueError`` naming them when ``given`` sets any explicitly."""
        src = spec.get("source")
        unused = []
        for needs, names in cls.SOURCE_PARAMS.items():
            if src == needs:
                continue
            wrong = sorted(names & set(given))
            if wrong:
                raise ValueError(
                    f"{pre}{', '.join(wrong)} apply only to source: {needs} "
                    f"(workload {cls.type!r} has source: {src}); remove them or set "
                    f"source: {needs}"
                )
            unused += sorted(names)
        return unused

    @classmethod
    def check(cls, spec: dict[str, JSONValue], pre: str) -> None:
        """Rules relating several parameters of a filled spec whose fields passed
        :func:`param_fields`; raise through :func:`reject`.  Default: no such rules."""
        return None

    def __init__(self, spec: dict[str, JSONValue]) -> None:
        self.spec = spec

    def check_context(self, ctx: RunContext, name: str) -> None:
        """``ValueError`` naming the model when parameter ``name`` (tokens) exceeds its longest
        context (:attr:`~kvbench.bench.context.RunContext.max_positions`)."""
        if self.spec[name] > ctx.max_positions:
            raise ValueError(
                f"{name}={self.spec[name]} exceeds the model's maximum context "
                f"{ctx.max_positions} (max_position_embeddings of "
                f"{ctx.model_info.get('model_id', 'the model')})"
            )

    def prepare(self, ctx: RunContext) -> None:
        """Work shared by every method on one model (called once before the runs); what other
        workloads on the model may reuse goes to ``ctx.shared``.  Default: nothing shared."""
        return None

    def plan(self, pending: list[PendingRun]) -> None:
        """The runs the runner is about to compute in this workload, in the order it will call
        ``run``: called once before the first ``run`` (possibly before ``prepare`` and before
        the model loads); runs with a record and skipped ones are left out.  A workload may
        then measure several together (the latency workload's ``group``); ``run`` must still
        accept any method alone (an executor that never calls ``plan``, a rerun of one record).
        Default: nothing."""
        return None

    def calibration_kv(self, seed: int, tokens: int) -> tuple[LayerKV, LayerKV, Info] | None:
        """Calibration K/V for a model-free run (``model: none``): ``({layer: k [1, H_kv,
        tokens, D]}, {layer: v}, info)`` float32 from the workload's own synthetic generator,
        disjoint from the tokens it measures, or ``None`` (the default: such a workload needs a
        model to calibrate on).  Called by the runner for methods with ``needs_calibration``."""
        return None

    @abc.abstractmethod
    def run(self, ctx: RunContext, method: Method) -> Result:
        """Measure ``method`` in the prepared workload.  Every metric of the result must match
        a ``METRICS`` declaration: the runner checks it (:func:`check_metrics`) after the run.
        Abstract: a workload class without ``run`` cannot be instantiated (``TypeError``)."""
