"""Decode-step attention + cache work at a real model's shape, every method vs DynamicCache.

At the shapes users deploy (head_dim 128, 8 KV heads, GQA 4:1), a model sliced to a few layers
spends its decode step in the output projection over a 128K-token vocabulary, which no cache
method changes.  This benchmark times what a cache method does change: per layer, storing the
new token, reading or dequantizing the cache, and the attention of the step's 32 query heads
over it, with no weights at all (:mod:`kvbench.hf.shapes` supplies the geometry, RoPE included;
:mod:`kvbench.bench.synthetic_kv`, ``rope-outliers``: the post-RoPE Q/K/V, with outlier key channels).

Protocol, for each context ``d`` (default 4096 and 16384) and each method:

1. Q/K/V of ``--layers`` layers (default 2; the layers of a model share one shape) for
   ``d`` tokens, drawn once per context (seeded) in ``--dtype`` (default float32 on CPU).
2. Two fresh sets of caches, the method's and the baseline's (``hf-dynamic``: transformers
   ``DynamicLayer``), are prefilled with the first ``P = d - warmup - steps`` tokens, so the
   last timed step attends to exactly ``d`` tokens.
3. One decode step = for every layer: kvbench methods ``LayerCache.append`` ->
   ``LayerCache.attend(q)`` (the fastest path the method supports: the CPU code-domain fast path
   or the reference sdpa over ``keys_values()``; which ran is recorded as ``attend_path``) ->
   ``end_step`` (the deferred flush); peers (transformers caches) ``layer.update(k, v)`` ->
   ``scaled_dot_product_attention(q, K, V, enable_gqa=True)``.
4. ``--warmup`` untimed steps on both, then ``--steps`` rounds, each timing one step of the
   method and one of the baseline in alternating order (A B, B A, ...), so drift on a busy
   machine hits both alike.  Reported: median / p90 ms per step (all layers), the ratio of
   medians to the baseline of the same run, bytes at rest of the method's caches, and the
   relative error of the last step's attention output against the baseline's.

Timing: ``time.perf_counter_ns`` around each step on CPU, CUDA events (synchronized) on CUDA
(:func:`time_ms`, the one place to swap in another timer).  CPU numbers are dominated by
framework overhead and dequantization, not memory bandwidth; they are not GPU decode speed.

Run on an idle machine (2 threads; the records keep the thread count and load average)::

    .venv/bin/python benchmarks/shape_attention.py --shape llama-3.1-8b --layers 2 \\
        --contexts 4096 16384 --steps 20 --warmup 3 --threads 2 \\
        --json results/shape_attention/llama-3.1-8b.json

A tiny check: ``--shape smollm2-135m --layers 1 --contexts 256 --steps 2 --warmup 1
--methods full,kivi``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvbench.bench.synthetic_kv import rope_outlier_qkv, synthetic_calibration
from kvbench.cache.registry import get_method, list_methods
from kvbench.hf.info import parse_dtype
from kvbench.hf.shapes import build_shape_model

BASELINE = "hf-dynamic"
#: KIVI-2 (2-bit K and V), as in the memory and latency suites
KIVI2 = {
    "bits": 2,
    "value_bits": 2,
    "group_size": 128,
    "value_group_size": 64,
    "residual_length": 128,
    "scale_dtype": "float16",
}


def time_ms(fn: Any, device: torch.device) -> float:
    """Milliseconds of ``fn()``: CUDA events (synchronized) on CUDA, ``perf_counter_ns`` else.
    The seam where a shared timing front door would plug in."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end))
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e6


class Caches:
    """One method's caches for every timed layer, prefilled; :meth:`step` decodes one token."""

    def __init__(self, method, inputs, prefill: int, dtype, device) -> None:
        self.method, self.peer = method, not method.capabilities.layer_cache
        self.layers = []
        for i, (q, k, v) in enumerate(inputs):
            if self.peer:
                layer = method.new_hf_layer()
                layer.update(k[:, :, :prefill], v[:, :, :prefill])
            else:
                layer = method.new_layer(i, k.shape[1], k.shape[3], dtype, device)
                layer.prefill(k[:, :, :prefill], v[:, :, :prefill], queries=q[:, :, :prefill])
            self.layers.append(layer)
        self.inputs, self.pos, self.out = inputs, prefill, None

    def step(self) -> None:
        t = self.pos
        for layer, (q, k, v) in zip(self.layers, self.inputs):
            qt, kt, vt = q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]
            if self.peer:
                keys, values = layer.update(kt, vt)
                self.out = F.scaled_dot_product_attention(qt, keys, values, enable_gqa=True)
            else:
                layer.append(kt, vt)
                self.out = layer.attend(qt)
                layer.end_step()
        self.pos += 1

    def nbytes(self) -> int:
        if self.peer:
            from kvbench.hf.peers import hf_layer_tensors

            return sum(
                t.untyped_storage().nbytes() for la in self.layers for *_, t in hf_layer_tensors(la)
            )
        return sum(la.nbytes()["total"] for la in self.layers)

    def attend_path(self) -> str:
        if self.peer:
            return "transformers cache update + sdpa (enable_gqa)"
        return str(getattr(self.layers[0], "attend_path", "LayerCache.attend"))


def run_pair(method, base, inputs, d, steps, warmup, dtype, device) -> dict[str, Any]:
    """Interleaved timing of ``method`` and ``base`` (see the module docstring)."""
    p = d - warmup - steps
    a, b = Caches(method, inputs, p, dtype, device), Caches(base, inputs, p, dtype, device)
    with torch.no_grad():
        for _ in range(warmup):
            a.step()
            b.step()
        ta, tb = [], []
        for r in range(steps):
            first, second = ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta))
            for c, ts in (first, second):
                ts.append(time_ms(c.step, device))
    assert a.pos == b.pos == d
    err = float((a.out.float() - b.out.float()).norm() / b.out.float().norm().clamp_min(1e-30))
    med_a, med_b = statistics.median(ta), statistics.median(tb)
    return {
        "decode_ms_p50": med_a,
        "decode_ms_p90": statistics.quantiles(ta, n=10)[-1] if len(ta) > 1 else ta[0],
        "baseline_decode_ms_p50": med_b,
        "ratio_to_dynamic": med_a / med_b,
        "bytes_total": a.nbytes(),
        "attend_path": a.attend_path(),
        "rel_err_vs_dynamic": err,
        "decode_ms": ta,
        "baseline_decode_ms": tb,
    }


def method_specs(names: str | None) -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, name, config)`` for ``--methods`` (default: every registered method, plus
    KIVI-2 as ``kivi-2bit``)."""
    if names:
        out = []
        for n in names.split(","):
            out.append(("kivi-2bit", "kivi", KIVI2) if n == "kivi-2bit" else (n, n, {}))
        return out
    regs = [m["name"] for m in list_methods() if m["name"] != BASELINE]
    out = [(n, n, {}) for n in regs]
    out.insert(regs.index("kivi") + 1, ("kivi-2bit", "kivi", KIVI2))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", help="preset or hub id (kvbench.hf.shapes)")
    ap.add_argument("--layers", type=int, default=2, help="layers timed per decode step")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--methods", default=None, help="comma-separated (default: all + kivi-2bit)")
    ap.add_argument("--skip", default="", help="comma-separated labels to leave out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model, _, info = build_shape_model(args.shape, args.layers, materialize=False)
    cfg = model.config
    if max(args.contexts) > (info["max_position_embeddings"] or 1 << 30):
        ap.error(f"--contexts above {args.shape}'s maximum {info['max_position_embeddings']}")
    if min(args.contexts) <= args.steps + args.warmup:
        ap.error("every context must exceed steps + warmup")
    skip = set(filter(None, args.skip.split(",")))
    specs = [s for s in method_specs(args.methods) if s[0] not in skip]
    base = get_method(BASELINE).for_model(info)
    calib = None
    result: dict[str, Any] = {
        "benchmark": "shape_attention",
        "shape": args.shape,
        "model": {k: info[k] for k in info if k.startswith(("shape", "num_", "head_dim", "rope"))},
        "random_weights": True,
        "layers_timed": args.layers,
        "batch": args.batch,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "timer": "cuda events" if device.type == "cuda" else "time.perf_counter_ns",
        "torch": torch.__version__,
        "loadavg_before": os.getloadavg(),
        "runs": [],
    }
    for d in args.contexts:
        inputs = [
            rope_outlier_qkv(cfg, d, args.batch, args.seed, i, dtype, device)
            for i in range(args.layers)
        ]
        print(f"\n{args.shape} x {args.layers} layers, context {d}, batch {args.batch}, "
              f"{result['dtype']} on {device}, {result['threads']} threads")  # fmt: skip
        print(f"{'method':<22}{'ms p50':>10}{'dyn ms':>10}{'ratio':>8}{'MiB':>9}  path")
        for label, name, config in specs:
            method = get_method(name, **config)
            why = method.unavailable_reason()
            if why:
                print(f"{label:<22} skipped: {why}")
                continue
            method = method.for_model(info)
            if method.needs_calibration:
                if calib is None:
                    calib = synthetic_calibration(cfg, 2048, args.seed, range(args.layers))
                method.calibrate(calib[0], calib[1], source="synthetic K/V of the shape")
            r = run_pair(method, base, inputs, d, args.steps, args.warmup, dtype, device)
            r.update({"label": label, "method": name, "config": config, "context": d})
            result["runs"].append(r)
            print(
                f"{label:<22}{r['decode_ms_p50']:>10.3f}{r['baseline_decode_ms_p50']:>10.3f}"
                f"{r['ratio_to_dynamic']:>8.2f}{r['bytes_total'] / 2**20:>9.1f}  {r['attend_path']}"
            )
            sys.stdout.flush()
        del inputs
    result["loadavg_after"] = os.getloadavg()
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
    return result


if __name__ == "__main__":
    main()
