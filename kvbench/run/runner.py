"""``kvbench run SUITE [--set key=value ...] [--out DIR]``: execute a suite.

One JSON record per (model, method config, workload) run, written atomically; a run whose
record exists is skipped, so an interrupted sweep resumes where it stopped.  The ``full``
baseline (if in the suite) runs first in each workload so every other run gets ``*_ratio``
metrics against it.  A summary table is printed at the end.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvbench.kv.registry import get_method
from kvbench.run.manifest import base_manifest
from kvbench.run.records import load_record, make_run_id, new_record, record_path, write_atomic
from kvbench.run.suite import MethodSpec, Suite
from kvbench.workloads import Result, Workload, workload_class

BASELINE = "full"


@dataclass
class RunContext:
    """What workloads share on one model: the model, tokenizer, info and a scratch cache."""

    model: Any = None
    tokenizer: Any = None
    model_spec: dict[str, Any] | None = None
    model_info: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    limit: int | None = None
    shared: dict[str, Any] = field(default_factory=dict)


def _load_model(spec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """Load with kvbench's registered attention function (sdpa numerics; it hands post-RoPE
    queries to methods that need them and refuses padded batches)."""
    from kvbench.hf.attention import register
    from kvbench.hf.models import load_model, model_info

    model, tokenizer, info = load_model(
        spec["id"], dtype=spec["dtype"], device=spec["device"], attn_implementation=register()
    )
    model.eval()
    return model, tokenizer, {**info, **model_info(model)}


def calibrate(ctx: RunContext, method: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Calibrate ``method`` on captured full-precision K/V of the calibration text (one window
    of ``spec['tokens']`` tokens of ``spec['text']``, captured once per model) and return the
    provenance recorded in the manifest."""
    from kvbench.data.loaders import load_text, token_windows
    from kvbench.hf.capture import capture_qkv

    key = ("calibration", spec["text"], spec["tokens"])
    if key not in ctx.shared:
        text, tinfo = load_text(spec["text"])
        ids, winfo = token_windows(ctx.tokenizer, text, spec["tokens"], 1)
        cap = capture_qkv(ctx.model, ids)
        keys = {lid: k for lid, k in zip(cap.layer_ids, cap.keys)}
        values = {lid: v for lid, v in zip(cap.layer_ids, cap.values)}
        ctx.shared[key] = (keys, values, {"dataset": tinfo, "windows": winfo})
    keys, values, info = ctx.shared[key]
    method.calibrate(keys, values, source=f"{spec['text']}[:{spec['tokens']} tokens]")
    return {"calibration": info}


def _ratios(metrics: dict[str, float], base: dict[str, float] | None) -> dict[str, float]:
    if not base:
        return {}
    out = {}
    for k, v in metrics.items():
        b = base.get(k)
        if b not in (None, 0) and not k.endswith("_ratio") and "_ci_" not in k:
            out[f"{k}_ratio"] = v / b
    return out


def skip_reason(method: Any, workload: Workload) -> str | None:
    """Why ``method`` cannot run in ``workload`` here (``None``: it can): a peer without kvbench
    layer caches in a workload that needs them, or a missing optional package."""
    if workload.layer_cache and not method.capabilities.layer_cache:
        return (
            f"workload {workload.type!r} runs kvbench LayerCaches and {method.name!r} wraps a "
            "transformers cache (capabilities.layer_cache=False)"
        )
    return method.unavailable_reason()


def _ordered(methods: list[MethodSpec]) -> list[MethodSpec]:
    return sorted(methods, key=lambda m: m.name != BASELINE)


def run_suite(
    suite: Suite,
    out_dir: str | Path,
    limit: int | None = None,
    force: bool = False,
    quiet: bool = False,
    skip_unavailable: bool = False,
) -> list[dict[str, Any]]:
    """Run every (model, workload, method) of ``suite``; returns the records (new and skipped).

    ``skip_unavailable``: a workload whose data cannot be loaded here (``FileNotFoundError``
    from its ``prepare``, e.g. a hub-only dataset offline) is skipped with a message on stderr
    instead of stopping the suite."""
    out_dir = Path(out_dir)
    torch.manual_seed(suite.seed)
    if suite.threads:
        torch.set_num_threads(int(suite.threads))
    records = []
    total = len(suite.models) * len(suite.workloads) * len(suite.methods)
    bar = tqdm(total=total, desc=suite.name, disable=quiet, file=sys.stderr)
    for model_spec in suite.models:
        ctx = RunContext(model_spec=model_spec, seed=suite.seed, limit=limit)
        for wspec in suite.workloads:
            workload: Workload = workload_class(wspec["type"])(wspec)
            wl_key = dict(wspec, limit=limit) if limit else wspec
            baseline: dict[str, float] | None = None
            prepared = False
            unavailable = None
            for mspec in _ordered(suite.methods):
                if unavailable is not None:
                    bar.update(1)
                    continue
                method = get_method(mspec.name, **mspec.config)
                config = method.config.to_dict()
                rid = make_run_id(model_spec or {}, mspec.name, config, wl_key)
                path = record_path(out_dir, rid)
                bar.set_postfix_str(f"{mspec.label} / {wspec['type']}")
                if path.exists() and not force:
                    rec = load_record(path)
                    records.append(rec)
                    if mspec.name == BASELINE:
                        baseline = rec["metrics"]
                    bar.update(1)
                    continue
                why = skip_reason(method, workload)
                if why:
                    if not quiet:
                        bar.write(f"skipped {mspec.label} / {wspec['type']}: {why}", sys.stderr)
                    bar.update(1)
                    continue
                if model_spec is not None and ctx.model is None:
                    ctx.model, ctx.tokenizer, ctx.model_info = _load_model(model_spec)
                if not prepared:
                    try:
                        workload.prepare(ctx)
                    except FileNotFoundError as exc:
                        if not skip_unavailable:
                            raise
                        unavailable = str(exc)
                        bar.write(f"skipped workload {wspec['type']}: {exc}", sys.stderr)
                        bar.update(1)
                        continue
                    prepared = True
                method = method.for_model(ctx.model_info)
                calib_info = {}
                if method.needs_calibration:
                    if ctx.model is None:
                        raise ValueError(
                            f"method {mspec.name!r} needs calibration on a model "
                            "(capability needs_calibration); the suite has none"
                        )
                    calib_info = calibrate(ctx, method, suite.calibration)
                t0 = time.perf_counter()
                result: Result = workload.run(ctx, method)
                wall = time.perf_counter() - t0
                metrics = dict(result.metrics)
                if mspec.name == BASELINE:
                    baseline = metrics
                else:  # ratios a workload measured itself (interleaved timing) take precedence
                    ratios = _ratios(metrics, baseline)
                    metrics.update({k: v for k, v in ratios.items() if k not in metrics})
                manifest = base_manifest(model_spec["device"] if model_spec else "cpu", suite.seed)
                manifest.update(
                    {
                        "model": ctx.model_info,
                        "suite": suite.path,
                        "label": mspec.label,
                        "wall_s": round(wall, 3),
                        **calib_info,
                        **result.info,
                    }
                )
                rec = new_record(
                    method=mspec.name,
                    config=method.config.to_dict(),
                    model=model_spec or {},
                    workload=wl_key,
                    metrics=metrics,
                    manifest=manifest,
                    per_layer=result.per_layer,
                )
                # the id is that of the configuration as the suite asked for it (before model-
                # dependent fields were filled), so a rerun finds it without loading the model
                rec["run_id"] = rid
                write_atomic(path, rec)
                records.append(rec)
                bar.update(1)
    bar.close()
    return records
