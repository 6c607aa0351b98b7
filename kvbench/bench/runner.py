"""``kvbench run SUITE [--set key=value ...] [--out DIR]``: execute a suite.

One JSON record per (model, method config, workload) run, written atomically; a run whose
record exists is skipped, so an interrupted sweep resumes where it stopped.  The ``full``
baseline (if in the suite) runs first in each workload so every other run gets ``*_ratio``
metrics against it.  A summary table is printed at the end.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from kvbench.bench import validate
from kvbench.bench.context import Info, RunContext
from kvbench.bench.manifest import base_manifest, loadavg
from kvbench.bench.preflight import check_contexts, check_token_limits
from kvbench.bench.records import (
    Record,
    load_record,
    make_run_id,
    new_record,
    record_path,
    sidecar_path,
    write_jsonl_atomic,
    write_record,
)
from kvbench.bench.suite import MethodSpec, Suite
from kvbench.bench.workloads import (
    WORKLOADS,
    PendingRun,
    Result,
    Workload,
    check_metrics,
    check_random_weights,
)
from kvbench.cache.method import Method
from kvbench.cache.registry import BASELINE, get_method
from kvbench.jsontypes import JSONValue
from kvbench.measure import memstat

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvbench.bench.context import Tokenizer


def _load_model(
    spec: dict[str, JSONValue], seed: int = 0, materialize: bool = True
) -> tuple[PreTrainedModel, Tokenizer, dict[str, JSONValue]]:
    """Load with kvbench's registered attention function (sdpa numerics; it hands post-RoPE
    queries to methods that need them and gives left-padded batches per-row lengths).  A shape model
    (``spec['shape']``) is built by :func:`kvbench.hf.shapes.build_shape_model` with weight seed
    ``seed``, on the meta device unless ``materialize``."""
    from kvbench.hf.attention import register
    from kvbench.hf.info import model_info
    from kvbench.hf.models import load_model

    if "shape" in spec:
        from kvbench.hf.shapes import build_shape_model

        return build_shape_model(
            spec["shape"], spec.get("layers"), seed, spec["dtype"], spec["device"],
            materialize=materialize, attn_implementation=register(),
        )  # fmt: skip
    model, tokenizer, info = load_model(
        spec["id"], dtype=spec["dtype"], device=spec["device"], attn_implementation=register()
    )
    model.eval()
    return model, tokenizer, {**info, **model_info(model)}


def calibrate(ctx: RunContext, method: Method, spec: dict[str, JSONValue]) -> Info:
    """Calibrate ``method`` on captured full-precision K/V of the calibration text (one window
    of ``spec['tokens']`` tokens of ``spec['text']``, captured once per model) and return the
    provenance recorded in the manifest."""
    from kvbench.data.loaders import load_text, token_windows
    from kvbench.hf.capture import capture_qkv

    key = ("calibration", spec["text"], spec["tokens"])
    what = spec["text"]
    if ctx.model_info.get("random_weights"):  # shape model: K/V of its shape, measured layers
        what = "synthetic K/V of the shape"
        from kvbench.bench.synthetic_kv import synthetic_calibration

        layers = ctx.shared.shape_layers_measured
        key = (*key, layers)
        if key not in ctx.shared.calibration_kv:
            ctx.shared.calibration_kv[key] = synthetic_calibration(
                ctx.model.config, spec["tokens"], ctx.seed, layers
            )
    if key not in ctx.shared.calibration_kv:
        text, tinfo = load_text(spec["text"])
        ids, winfo = token_windows(ctx.tokenizer, text, spec["tokens"], 1)
        cap = capture_qkv(ctx.model, ids)
        keys = {lid: k for lid, k in zip(cap.layer_ids, cap.keys)}
        values = {lid: v for lid, v in zip(cap.layer_ids, cap.values)}
        ctx.shared.calibration_kv[key] = (keys, values, {"dataset": tinfo, "windows": winfo})
    keys, values, info = ctx.shared.calibration_kv[key]
    method.calibrate(keys, values, source=f"{what}[:{spec['tokens']} tokens]")
    return {"calibration": info}


def calibrate_model_free(
    ctx: RunContext,
    workload: Workload,
    method: Method,
    spec: dict[str, JSONValue],
    run: PlannedRun,
) -> Info:
    """Calibrate ``method`` in a model-free suite on the workload's own synthetic K/V
    (:meth:`Workload.calibration_kv`: ``spec['tokens']`` tokens disjoint from the measured
    ones); ``ValueError`` when the workload has none (it needs a model to calibrate on)."""
    key = ("calibration", "model-free", repr(sorted(workload.spec.items())), spec["tokens"])
    if key not in ctx.shared.calibration_kv:
        got = workload.calibration_kv(ctx.seed, spec["tokens"])
        if got is None:
            raise ValueError(
                f"method {run.method.name!r} needs calibration on a model "
                f"(capability needs_calibration); the suite has none and workload "
                f"{workload.type!r} draws no synthetic calibration K/V (source: synthetic does)"
            )
        ctx.shared.calibration_kv[key] = got
    keys, values, info = ctx.shared.calibration_kv[key]
    method.calibrate(keys, values, source=f"synthetic[:{spec['tokens']} tokens]")
    return {"calibration": info}


def calibrated(
    ctx: RunContext, method: Method, run: PlannedRun, spec: dict[str, JSONValue]
) -> tuple[Method, Info]:
    """``method`` calibrated on the suite's calibration text (:func:`calibrate`) and the
    manifest provenance.  Calibration depends only on the configuration and the text, so a
    configuration calibrated for an earlier workload on this model is reused (a deep copy of
    the calibrated method; ``calibration_reused: true``, ``calibration_cpu_s`` 0) instead of
    being fitted again per workload."""
    import copy

    from kvbench.bench.records import canonical

    key = ("calibrated", run.method.name, canonical(method.config.to_dict()), canonical(spec))
    if key in ctx.shared.calibrated:
        fitted, info = ctx.shared.calibrated[key]
        return copy.deepcopy(fitted), {**info, "calibration_reused": True, "calibration_cpu_s": 0.0}
    c0 = time.process_time()
    info = calibrate(ctx, method, spec)
    info["calibration_cpu_s"] = round(time.process_time() - c0, 3)
    ctx.shared.calibrated[key] = (copy.deepcopy(method), info)
    return method, {**info, "calibration_reused": False}


def _ratios(metrics: dict[str, float], base: dict[str, float] | None) -> dict[str, float]:
    base = base or {}
    return {
        f"{k}_ratio": v / base[k]
        for k, v in metrics.items()
        if base.get(k) not in (None, 0) and not k.endswith("_ratio") and "_ci_" not in k
    }


def skip_reason(method: Method, workload: Workload) -> str | None:
    """Why ``method`` cannot run in ``workload`` here (``None``: it can): a peer without kvbench
    layer caches in a workload that needs them, or a missing optional package."""
    if workload.layer_cache and not method.capabilities.layer_cache:
        return (
            f"workload {workload.type!r} runs kvbench LayerCaches and {method.name!r} wraps a "
            "transformers cache (capabilities.layer_cache=False)"
        )
    return method.unavailable_reason()


@dataclass(frozen=True)
class PlannedRun:
    """One (model, workload, method config) run of a suite, known before any model loads.

    ``run_id`` is that of the configuration as the suite asked for it (before model-dependent
    fields are filled by :meth:`Method.for_model`), so a rerun finds the record without loading
    the model; ``path`` is where its record is written.
    """

    model_index: int
    workload_index: int
    model_spec: dict[str, JSONValue] | None
    workload_spec: dict[str, JSONValue]
    workload_key: dict[str, JSONValue]
    method: MethodSpec
    run_id: str
    path: Path

    @property
    def is_baseline(self) -> bool:
        return self.method.name == BASELINE

    @property
    def title(self) -> str:
        return f"{self.method.label} / {self.workload_spec['type']}"


def plan_runs(suite: Suite, out_dir: str | Path, limit: int | None = None) -> list[PlannedRun]:
    """Every run of ``suite`` in execution order: models, then workloads, then methods with the
    ``full`` baseline first (so later runs get ``*_ratio`` metrics against it).  Builds each
    method config (validation errors surface here, before any model loads); loads nothing."""
    out_dir = Path(out_dir)
    runs = []
    for mi, model_spec in enumerate(suite.models):
        for wi, wspec in enumerate(suite.workloads):
            wl_key = dict(wspec, limit=limit) if limit else wspec
            for mspec in sorted(suite.methods, key=lambda m: m.name != BASELINE):
                config = get_method(mspec.name, **mspec.config).config.to_dict()
                rid = make_run_id(model_spec or {}, mspec.name, config, wl_key)
                path = record_path(out_dir, rid)
                runs.append(PlannedRun(mi, wi, model_spec, wspec, wl_key, mspec, rid, path))
    return runs


def finished_record_exists(run: PlannedRun, force: bool = False) -> bool:
    """Whether :func:`finished_record` would return a record (without reading it)."""
    return not force and run.path.exists()


def finished_record(run: PlannedRun, force: bool = False) -> Record | None:
    """The record a previous sweep wrote for ``run`` (resume), or ``None`` to compute it."""
    if not finished_record_exists(run, force):
        return None
    return load_record(run.path)


def ensure_model(ctx: RunContext, materialize: bool = True) -> None:
    """Load the context's model on first need (a sweep of only finished runs loads nothing).
    ``materialize``: a shape model gets seeded random weights (else the meta device)."""
    if ctx.model_spec is not None and ctx.model is None:
        ctx.model, ctx.tokenizer, ctx.model_info = _load_model(
            ctx.model_spec, ctx.seed, materialize
        )


class BuiltMethod:
    """The method of one planned run as :func:`execute_run` hands it to the workload: built,
    fitted to the model (``for_model``), calibrated if it needs it (with its manifest
    provenance).  Built on the first :meth:`get` (the model must be loaded) and kept, so the
    workload's :class:`~kvbench.bench.workloads.PendingRun` and the run itself get the same
    object; a build that raises is not kept (the next call raises again)."""

    def __init__(
        self,
        ctx: RunContext,
        workload: Workload,
        run: PlannedRun,
        calibration: dict[str, JSONValue],
    ) -> None:
        self.ctx, self.workload, self.run, self.calibration = ctx, workload, run, calibration
        self._built: tuple[Method, Info] | None = None

    def get(self) -> tuple[Method, Info]:
        """(method, calibration provenance for the manifest; ``{}`` without calibration)."""
        if self._built is None:
            ctx, run = self.ctx, self.run
            method = get_method(run.method.name, **run.method.config).for_model(ctx.model_info)
            calib_info: Info = {}
            if method.needs_calibration and self.workload.builds_caches:
                if ctx.model is None:
                    calib_info = calibrate_model_free(
                        ctx, self.workload, method, self.calibration, run
                    )
                else:
                    method, calib_info = calibrated(ctx, method, run, self.calibration)
                    torch.manual_seed(ctx.seed)  # the run starts from the same RNG state
            self._built = (method, calib_info)
        return self._built

    def __call__(self) -> Method:
        return self.get()[0]


def execute_run(
    ctx: RunContext,
    workload: Workload,
    run: PlannedRun,
    calibration: dict[str, JSONValue],
    baseline: dict[str, float] | None,
    built: BuiltMethod | None = None,
) -> tuple[dict[str, float], Info, Result, Method]:
    """Run one method configuration in a prepared workload: build the method, fill its model-
    dependent fields, calibrate it if it needs it (``built``: the run's :class:`BuiltMethod`
    when the workload was given it by :meth:`~kvbench.bench.workloads.Workload.plan`; else
    built here), run the workload, check that it declares every metric it reported
    (:func:`~kvbench.bench.workloads.check_metrics`, ``ValueError``) and add ``*_ratio``
    metrics against ``baseline``.  Returns (metrics, manifest extras, result, method)."""
    built = built or BuiltMethod(ctx, workload, run, calibration)
    method, calib_info = built.get()
    per_run = memstat.reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    result = workload.run(ctx, method)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    check_metrics(type(workload), result.metrics)
    memory = memstat.peak(per_run)
    metrics = dict(result.metrics)
    if not run.is_baseline:  # ratios a workload measured itself (interleaved timing) win
        ratios = _ratios(metrics, baseline)
        metrics.update({k: v for k, v in ratios.items() if k not in metrics})
    extras = {
        "label": run.method.label,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "memory": memory,
        **calib_info,
        **result.info,
    }
    return metrics, extras, result, method


def group_by_model(runs: list[PlannedRun]) -> list[list[PlannedRun]]:
    """``runs`` (in :func:`plan_runs` order) split into one list per model: the unit that shares
    a loaded model (one :class:`RunContext` locally, one worker per device on a cluster)."""
    return [list(g) for _, g in itertools.groupby(runs, key=lambda r: r.model_index)]


def plan_workload(
    ctx: RunContext, suite: Suite, workload: Workload, group: list[PlannedRun], force: bool
) -> dict[int, BuiltMethod]:
    """Give ``workload`` (:meth:`~kvbench.bench.workloads.Workload.plan`) the runs of ``group``
    (its planned runs, in order) still to compute: no record (or ``force``) and not skipped
    (:func:`skip_reason`).  Returns their :class:`BuiltMethod` by index in ``group``, for
    :func:`compute_record`.  Builds no method yet (each is built when first needed)."""
    built: dict[int, BuiltMethod] = {}
    for i, run in enumerate(group):
        if finished_record_exists(run, force):
            continue
        try:
            skipped = skip_reason(get_method(run.method.name, **run.method.config), workload)
        except ValueError:  # a bad configuration: its own run raises it, as before any plan
            skipped = None
        if skipped:
            continue
        built[i] = BuiltMethod(ctx, workload, run, suite.calibration)
    workload.plan([PendingRun(group[i].method.label, b) for i, b in built.items()])
    return built


def prepare_workload(ctx: RunContext, workload: Workload, seed: int) -> None:
    """``workload.prepare(ctx)`` from a fresh ``torch.manual_seed(seed)``, so what it prepares
    does not depend on which runs came before it (the same on every executor)."""
    torch.manual_seed(seed)
    workload.prepare(ctx)


def compute_record(
    suite: Suite,
    ctx: RunContext,
    workload: Workload,
    run: PlannedRun,
    baseline: dict[str, float] | None,
    threads: int | None = None,
    built: BuiltMethod | None = None,
) -> Record:
    """One run in a prepared workload, from a fresh ``torch.manual_seed(suite.seed)``:
    :func:`execute_run`, then its JSON record (config, metrics, manifest, per-layer data).  The
    record depends on the run alone, not on its position in the sweep, so a resumed or
    distributed sweep gives the same records.  A ``ValueError`` of the run is re-raised naming
    the suite entry and workload; a run whose method quantized (almost) nothing carries a flag
    (:func:`quantized_flag`).  The manifest gets the load average just before and after the run
    (``loadavg_start``, ``loadavg_end``: 1, 5 and 15 minutes), so a reader sees what else the
    machine was doing."""
    torch.manual_seed(suite.seed)
    load_start = loadavg()
    try:
        metrics, extras, result, method = execute_run(
            ctx, workload, run, suite.calibration, baseline, built
        )
    except ValueError as exc:  # name the entry and workload that failed
        raise ValueError(
            f"{suite.path}: {run.method.where or 'methods'} ({run.method.label}) "
            f"in workloads[{run.workload_index}] ({run.workload_spec['type']}): {exc}"
        ) from exc
    extras.update(loadavg_start=load_start, loadavg_end=loadavg())
    if threads is not None:
        extras["threads"] = threads
    flag = quantized_flag(run, metrics)
    if flag:
        extras["flags"] = [flag]
    manifest = base_manifest(run.model_spec["device"] if run.model_spec else "cpu", suite.seed)
    manifest.update({"model": ctx.model_info, "suite": suite.path, **extras})
    rec = new_record(
        method=run.method.name,
        config=method.config.to_dict(),
        model=run.model_spec or {},
        workload=run.workload_key,
        metrics=metrics,
        manifest=manifest,
        per_layer=result.per_layer,
    )
    rec.run_id = run.run_id
    rec.files = dict(result.files)  # per-sample logs, written beside the record by write_run
    return rec


def write_run(path: Path, rec: Record) -> None:
    """Write a computed run: its sidecar files first (``<run_id>.<name>``, :attr:`Record.files`),
    then the record atomically, so that an existing record always means a complete run."""
    for name, rows in rec.files.items():
        write_jsonl_atomic(sidecar_path(path, name), rows)
    write_record(path, rec)


#: a run whose method quantized fewer than this fraction of the key tokens it read is flagged
MIN_QUANTIZED_FRACTION = 0.25


def quantized_flag(run: PlannedRun, metrics: dict[str, float]) -> str | None:
    """A warning for a run whose numbers mean little: its method stored (almost) every key
    token in full precision, so its fidelity and bits describe the residual window and sinks,
    not the quantizer.  Reads ``quantized_key_fraction`` (measured by the workload from the
    layer caches: quantized key tokens / tokens held); the ``full`` baseline and methods whose
    nominal key bits are 16 or more are never flagged."""
    frac = metrics.get("quantized_key_fraction")
    if run.is_baseline or frac is None or metrics.get("nominal_key_bits", 0) >= 16:
        return None
    if frac >= MIN_QUANTIZED_FRACTION:
        return None
    what = "nothing quantized" if frac == 0 else f"only {frac:.1%} of key tokens quantized"
    cfg = run.method.config
    knobs = ", ".join(
        f"{k}={cfg[k]}" for k in ("group_size", "residual_length", "num_sink_tokens") if k in cfg
    )
    return (
        f"{what} (< {MIN_QUANTIZED_FRACTION:.0%} of the key tokens; the rest stay in full "
        f"precision in the residual window and sinks{': ' + knobs if knobs else ''}); "
        "use a longer context or a smaller residual/group"
    )


def set_threads(requested: int | None) -> int:
    """Set torch's intra-op threads: the suite's ``threads``, or when unset the CPUs that are
    free here (:func:`kvbench.bench.validate.free_cpus`: affinity minus load, at least 1), so a
    shared machine is not oversubscribed.  Returns the number used (recorded per run)."""
    n = int(requested) if requested else validate.free_cpus()
    torch.set_num_threads(n)
    return n


class Eta:
    """Remaining-time estimate that knows runs differ: the mean wall time of finished runs of
    the same workload entry (type and parameters), else of the same workload type, else of any
    run.  Resumed runs cost nothing."""

    def __init__(self, runs: list[PlannedRun]) -> None:
        self.left = list(runs)
        #: wall times by workload entry ``(model_index, workload_index)``, by workload type,
        #: and of every run (key ``None``)
        self.times: dict[tuple[int, int] | str | None, list[float]] = {}

    @staticmethod
    def _keys(run: PlannedRun) -> tuple[tuple[int, int], str]:
        return (run.model_index, run.workload_index), run.workload_spec["type"]

    def done(self, run: PlannedRun, seconds: float | None) -> None:
        self.left.remove(run)
        if seconds is not None:
            for k in (*self._keys(run), None):
                self.times.setdefault(k, []).append(seconds)

    def seconds(self) -> float | None:
        """Estimated seconds for the runs not yet done (``None`` before any run finished)."""
        if None not in self.times:
            return None
        total = 0.0
        for run in self.left:
            ts = next(self.times[k] for k in (*self._keys(run), None) if k in self.times)
            total += sum(ts) / len(ts)
        return total

    def text(self) -> str:
        s = self.seconds()
        if s is None:
            return ""
        h, rem = divmod(int(s), 3600)
        return f"ETA ~{h}:{rem // 60:02d}:{rem % 60:02d}, "


def run_suite(
    suite: Suite,
    out_dir: str | Path,
    limit: int | None = None,
    force: bool = False,
    quiet: bool = False,
    skip_unavailable: bool = False,
) -> list[Record]:
    """Run every (model, workload, method) of ``suite``; returns the records (new and resumed).

    The steps: :func:`plan_runs` (ids and paths, no model), then per model and workload:
    :func:`plan_workload` (the workload learns the runs it will compute),
    :func:`finished_record` (resume), :func:`ensure_model`, ``workload.prepare`` once,
    :func:`compute_record` and :func:`write_run`.

    ``skip_unavailable``: a workload whose data cannot be loaded here (``FileNotFoundError``
    from its ``prepare``, e.g. a hub-only dataset offline) is skipped with a message on stderr
    instead of stopping the suite."""
    problems = validate.Problems(suite.path)  # both checks' errors in one refusal
    # before check_output makes the folder
    for check in (validate.check_devices, check_contexts, check_token_limits):
        with problems.catch():
            check(suite)
    problems.raise_if_any()
    validate.check_output(out_dir)
    torch.manual_seed(suite.seed)
    threads = set_threads(suite.threads)
    types = [w["type"] for w in suite.workloads]
    for model_spec in suite.models:  # shape models: refuse accuracy workloads before any load
        check_random_weights(types, model_spec, suite.path)
    # a shape model is materialized only if some workload runs a forward on it
    materialize = any(WORKLOADS.get(t).shape_forward for t in types)

    runs = plan_runs(suite, out_dir, limit)
    records: list[Record] = []
    eta = Eta(runs)
    bar = tqdm(
        total=len(runs),
        desc=suite.name,
        disable=quiet,
        file=sys.stderr,
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
    )

    def note(msg: str) -> None:
        if not quiet:
            bar.write(msg, sys.stderr)

    try:  # memstat.release() freezes what survives each run; thawed however the sweep ends
        for model_runs in group_by_model(runs):
            ctx = RunContext(model_spec=model_runs[0].model_spec, seed=suite.seed, limit=limit)
            for _, group in itertools.groupby(model_runs, key=lambda r: r.workload_index):
                group = list(group)
                workload: Workload = WORKLOADS.get(group[0].workload_spec["type"])(
                    group[0].workload_spec
                )
                baseline: dict[str, float] | None = None
                prepared = False
                built = plan_workload(ctx, suite, workload, group, force)
                for i, run in enumerate(group):
                    bar.set_postfix_str(f"{eta.text()}{run.title}")
                    rec = finished_record(run, force)
                    if rec is None:
                        why = skip_reason(
                            get_method(run.method.name, **run.method.config), workload
                        )
                        if why:
                            note(f"skipped {run.title}: {why}")
                            eta.done(run, None)
                            bar.update(1)
                            continue
                        if ctx.model is None and ctx.model_spec is not None:
                            ensure_model(ctx, materialize)
                            validate.check_methods_for_model(
                                suite.methods, ctx.model_info, suite.path
                            )

                        if not prepared:
                            try:
                                prepare_workload(ctx, workload, suite.seed)
                            except FileNotFoundError as exc:
                                if not skip_unavailable:
                                    raise
                                note(f"skipped workload {run.workload_spec['type']}: {exc}")
                                for r in group[i:]:
                                    eta.done(r, None)
                                bar.update(len(group) - i)
                                break
                            prepared = True
                        t0 = time.perf_counter()
                        rec = compute_record(
                            suite, ctx, workload, run, baseline, threads, built.get(i)
                        )
                        for flag in rec.flags:
                            note(f"warning: {run.title}: {flag}")
                        write_run(run.path, rec)
                        memstat.release()
                        eta.done(run, time.perf_counter() - t0)
                    else:
                        eta.done(run, None)
                    records.append(rec)
                    if run.is_baseline:
                        baseline = rec.metrics
                    bar.update(1)
                del workload  # its prepared tensors (captures, reference logits) go before the next
                memstat.release()
    finally:
        memstat.unfreeze()
    bar.close()
    return records
