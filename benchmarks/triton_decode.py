"""Device check: decode-attention timings of the Triton kernels (one GPU call).

Run from the source tree (kvbench installed editable, ``pip install --no-deps -e .``, so the
method registry's entry points and ``kvbench.kernels`` resolve; no ``datasets`` or network
needed; ``benchmarks/device_check.sh`` wraps it, installing kvbench first when needed)::

    PYTHONPATH=. python benchmarks/triton_decode.py --out "$OUT"       # on a CUDA GPU
    PYTHONPATH=. python benchmarks/triton_decode.py --out DIR --interpret  # CPU, TRITON_INTERPRET=1

Correctness is the test suite's job (``tests/kernels``: pack/unpack and quantize-and-pack
bit-exact against the core codecs, round-half-to-even ties, fused attention against a float64
reference at random sizes, per-sequence lengths, the control, refused layouts); this script
keeps one guard per timed configuration: before a kernel is timed, its output on the timed
cache is compared with the reference attention of the same cache (``err`` column; a row whose
error exceeds 1e-3 is marked and not counted towards a target).

Timings (each row is appended to ``OUT/rows.jsonl`` as soon as it exists and ``OUT/RESULTS.md``
is rewritten after every row, so a timeout still returns what was measured): Llama-3.1-8B
attention shapes (H_q 32, H_kv 8, D 128, fp16) at each context and batch: fp16 SDPA (flash
backend), the split-KV kernel on fp16 K/V (control), and the fused kernel for KIVI 2-bit, Kitty
and PN-Mix (1) keys with values at 16 and 2 bits; achieved GB/s = bytes the kernel must read
(the cache's stored bytes + query) / median time, against a measured device-to-device copy;
then quantize-and-pack of one flushed page per method, amortized over G decode steps.

Timing protocol: :mod:`kvbench.measure.timer` (the one shared by the latency workload and
``benchmarks/``): each call captured in a CUDA graph (``Timer.graph``; eager if capture fails,
marked in the table), synchronized CUDA events around each replay, L2 flushed (a 256 MiB write)
between replays outside the timed region, warm-up first; median and p10/p90 by the module's
percentile rule.  Under ``--interpret`` the sizes are tiny and times are host wall-clock of the
CPU interpreter: they only exercise the script.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B attention
METHODS = [  # (label, registry name, config)
    ("KIVI-2", "kivi", dict(bits=2, group_size=128, residual_length=128)),
    ("Kitty", "kitty", dict()),
    ("PN-Mix (1)", "pn-mix", dict()),
]
VALUE_BITS = (16, 2)
GUARD = 1e-3  # largest relative error of a timed kernel against the reference
TUNE_BLOCK_N, TUNE_WARPS = (32, 64), (4, 8)
TARGETS = [  # (context, batch, method label, value bits, against, minimum speed-up)
    (32768, 8, "PN-Mix (1)", 16, "sdpa", 1.3),
    (32768, 8, "PN-Mix (1)", 16, "control", 1.0),
    (32768, 8, "KIVI-2", 2, "sdpa", 2.5),
]


# --------------------------------------------------------------------------------------------
# plumbing
# --------------------------------------------------------------------------------------------


def _kernels():
    """The kernel modules ``kvbench.kernels.*`` by name, imported on first use (after
    ``--interpret`` has set ``TRITON_INTERPRET``: Triton reads it when a kernel is decorated)."""
    return {
        m: importlib.import_module(f"kvbench.kernels.{m}")
        for m in ("pack", "quantize", "decode_attention", "dispatch")
    }


def load_method(name: str, **config):
    """A kvbench method from the method registry (entry points of the installed kvbench).

    The fused kernel is reached through ``dispatch.fused_attend`` (the kernels' dispatch) with
    the block converters of :func:`fused_layouts`."""
    from kvbench.cache.registry import get_method

    return get_method(name, **config)


def fused_layouts(dispatch):
    """``dispatch.Layouts`` of the core's block types, from the CUDA attention backend's
    adapter (``kvbench.kernels.triton_backend``; the kernel modules never import the core)."""
    from kvbench.kernels.triton_backend import KEY_LAYOUTS, VALUE_LAYOUTS

    return dispatch.Layouts(KEY_LAYOUTS, VALUE_LAYOUTS)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


class Recorder:
    """Appends rows to ``rows.jsonl`` and rewrites ``RESULTS.md`` after each one."""

    def __init__(self, out: Path, env: dict) -> None:
        self.out = out
        self.env = env
        self.rows: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        (out / "env.json").write_text(json.dumps(env, indent=1))
        self.rows_path = out / "rows.jsonl"
        self.rows_path.write_text("")

    def add(self, row: dict) -> None:
        self.rows.append(row)
        brief = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(brief), flush=True)
        with self.rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.write_markdown()

    def write_markdown(self) -> None:
        (self.out / "RESULTS.md").write_text(render_markdown(self.env, self.rows))


def _err(e) -> str:
    if e is None:
        return "–"
    return f"{e:.1e}" if e <= GUARD else f"**{e:.1e} FAIL**"


def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def render_markdown(env: dict, rows: list[dict]) -> str:
    """The results as Markdown: environment, step timings, flush timings, targets."""
    lines = ["# Fused decode attention over quantized KV pages: device results", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines.append("")
    copy = [r for r in rows if r["kind"] == "copy"]
    if copy:
        lines += [
            f"Device-to-device copy: {copy[-1]['gbps']:.0f} GB/s (read + write of "
            f"{copy[-1]['bytes'] / 2**20:.0f} MiB)",
            "",
        ]
    steps = [r for r in rows if r["kind"] == "step"]
    if steps:
        lines += [
            "## Decode attention step (H_q 32, H_kv 8, D 128, fp16)",
            "",
            "| context | batch | method | keys | values | MB read | median µs | p10–p90 µs "
            "| GB/s | % copy BW | vs SDPA | vs control | timing | rel. err |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            lines.append(
                f"| {r['context']} | {r['batch']} | {r['method']} | {r['keys']} | {r['values']} "
                f"| {r['bytes'] / 1e6:.1f} | {_f(r['us'])} | {_f(r.get('p10'))}–{_f(r.get('p90'))} "
                f"| {_f(r.get('gbps'), '{:.0f}')} | {_f(r.get('pct_copy'), '{:.0f}')} "
                f"| {_f(r.get('vs_sdpa'), '{:.2f}x')} | {_f(r.get('vs_control'), '{:.2f}x')} "
                f"| {r['timing']} | {_err(r.get('err'))} |"
            )
        lines.append("")
    flush = [r for r in rows if r["kind"] == "flush"]
    if flush:
        lines += [
            "## Quantize-and-pack on flush (one page of G keys + one value token per step)",
            "",
            "| context | batch | method | page keys µs | of which selection µs "
            "| value token µs | per step µs (keys/G + value) | % of fused step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in flush:
            lines.append(
                f"| {r['context']} | {r['batch']} | {r['method']} | {_f(r['keys_us'])} "
                f"| {_f(r.get('select_us'))} | {_f(r.get('value_us'))} | {_f(r['per_step_us'], '{:.2f}')} "
                f"| {_f(r.get('pct_step'), '{:.2f}')} |"
            )
        lines.append("")
    tg = [r for r in rows if r["kind"] == "target"]
    if tg:
        lines += [
            "## Targets (measured here, not claimed elsewhere)",
            "",
            "| target | measured | met |",
            "|---|---|---|",
        ]
        lines += [f"| {r['name']} | {r['measured']} | {'yes' if r['ok'] else 'no'} |" for r in tg]
        lines.append("")
    tn = [r for r in rows if r["kind"] == "tune"]
    if tn:
        lines += [
            "## Tuning (opt-in `--tune`)",
            "",
            "| context | batch | method | block_n | num_warps | num_splits | median µs |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['context']} | {r['batch']} | {r['method']} | {r['block_n']} "
            f"| {r['num_warps']} | {r['num_splits']} | {_f(r['us'])} |"
            for r in tn
        ]
        lines.append("")
    errs = [r for r in rows if r["kind"] == "error"]
    if errs:
        lines += ["## Errors", ""] + [f"- {r['where']}: `{r['error']}`" for r in errs] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


class Timer:
    """The :mod:`kvbench.measure.timer` protocol with an L2 flush between CUDA replays."""

    def __init__(self, device: torch.device, reps: int, warmup: int) -> None:
        from kvbench.measure.timer import Timer as MeasureTimer

        self.device, self.reps, self.warmup = device, reps, warmup
        self.timer = MeasureTimer(device, cuda_graphs=device.type == "cuda")
        self.flush = None
        if device.type == "cuda":
            self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)

    def __call__(self, fn) -> tuple[float, float, float, str]:
        """Median, p10, p90 in microseconds, and the mode (``graph``/``eager``/``cpu``)."""
        from kvbench.measure.timer import interleave, percentile

        run = self.timer.graph(fn)
        mode = "cpu" if self.flush is None else ("graph" if run is not fn else "eager")

        def flush_l2(*_) -> None:  # between calls, outside the timed region
            if self.flush is not None:
                self.flush.zero_()

        flush_l2()
        ms = interleave({"fn": run}, self.reps, self.warmup, self.timer, after=flush_l2)["fn"]
        us = [m * 1e3 for m in ms]
        return percentile(us, 50), percentile(us, 10), percentile(us, 90), mode


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us, *_ = timer(lambda: dst.copy_(src))
    return {"kind": "copy", "bytes": 2 * nbytes, "us": us, "gbps": 2 * nbytes / us / 1e3}


# --------------------------------------------------------------------------------------------
# timings
# --------------------------------------------------------------------------------------------


def sdpa_fn(q, k, v):
    """fp16 SDPA with the flash backend (GQA natively if supported, else repeated K/V)."""
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
    except ImportError:  # pragma: no cover
        import contextlib

        ctx = contextlib.nullcontext
    if q.device.type != "cuda":
        ctx = __import__("contextlib").nullcontext
    try:
        with ctx():
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def fn():
            with ctx():
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return fn, "flash, GQA" if q.device.type == "cuda" else "cpu"
    except (RuntimeError, TypeError):
        rep = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

        def fn():
            with ctx():
                return F.scaled_dot_product_attention(q, kr, vr)

        return fn, "flash, K/V repeated"


def guard_error(lc, q: torch.Tensor, out: torch.Tensor) -> float:
    """Relative error (float64 norm) of a timed kernel's output against the reference attention
    of the same cache (:func:`kvbench.attention.reference.reference_attention`)."""
    from kvbench.attention.reference import reference_attention

    kk, vv = lc.keys_values(torch.float64)
    ref = reference_attention(q.double(), kk, vv)
    return ((out.double() - ref).norm() / ref.norm()).item()


def _step_row(
    rec, timer, step_us, copy_gbps, ctx_len, b, method, keys, values, nbytes, fn, err=None
):
    """Time ``fn`` (one decode-attention step) and add its row; returns the median in µs, or
    ``None`` when the guard failed (``err`` > :data:`GUARD`: the row is kept, marked)."""
    us, p10, p90, mode = timer(fn)
    r = {
        "kind": "step",
        "context": ctx_len,
        "batch": b,
        "method": method,
        "keys": keys,
        "values": values,
        "bytes": nbytes,
        "us": us,
        "p10": p10,
        "p90": p90,
        "gbps": nbytes / us / 1e3,
        "timing": mode,
        "err": err,
    }
    if copy_gbps:
        r["pct_copy"] = 100 * r["gbps"] / copy_gbps
    base, ctrl = step_us.get((ctx_len, b, "sdpa")), step_us.get((ctx_len, b, "control"))
    r["vs_sdpa"] = base / us if base else None
    r["vs_control"] = ctrl / us if ctrl else None
    rec.add(r)
    return us if err is None or err <= GUARD else None


def _time_shape(K, device, rec, timer, step_us, copy_gbps, ctx_len, b, gen, out_of_time):
    """All rows of one (context, batch): the two baselines, then each method and value width."""
    da, dispatch, quant = K["decode_attention"], K["dispatch"], K["quantize"]
    layouts = fused_layouts(dispatch)
    k = torch.randn(b, HKV, ctx_len, D, generator=gen).to(device, torch.float16)
    v = torch.randn(b, HKV, ctx_len, D, generator=gen).to(device, torch.float16)
    q = torch.randn(b, HQ, 1, D, generator=gen).to(device, torch.float16)
    fp_bytes = k.nbytes + v.nbytes + 2 * q.nbytes
    args = (rec, timer, step_us, copy_gbps, ctx_len, b)
    try:
        fn, how = sdpa_fn(q, k, v)
        step_us[(ctx_len, b, "sdpa")] = _step_row(
            *args, f"SDPA ({how})", "fp16", "fp16", fp_bytes, fn
        )
        step_us[(ctx_len, b, "control")] = _step_row(
            *args,
            "split-KV Triton (control)",
            "fp16",
            "fp16",
            fp_bytes,
            lambda: da.split_kv_attention(q, k, v),
        )
    except Exception as e:  # noqa: BLE001 - record and go on with the methods
        rec.add({"kind": "error", "where": f"baselines T={ctx_len} B={b}", "error": repr(e)[:300]})
        traceback.print_exc()
    for label, name, cfg in METHODS:
        for vb in VALUE_BITS:
            if out_of_time():
                return
            try:
                m = load_method(name, **cfg, value_bits=vb)
                lc = m.new_layer(0, HKV, D, dtype=torch.float16, device=device)
                qs = None
                if m.needs_queries:  # post-RoPE prefill queries for the pair scores
                    qs = torch.randn(b, HQ, ctx_len, D, generator=gen).to(device, torch.float16)
                lc.prefill(k, v, qs)
                qs = None
                nbytes = lc.nbytes()["total"] + 2 * q.nbytes
                keys = f"{m.average_bits(D, ctx_len)['key_bits']:.2f} b"
                vals = "fp16" if vb == 16 else f"{vb}-bit"
                err = guard_error(lc, q, dispatch.fused_attend(lc, q, layouts=layouts))
                us = _step_row(
                    *args,
                    label,
                    keys,
                    vals,
                    nbytes,
                    lambda lc=lc: dispatch.fused_attend(lc, q, layouts=layouts),
                    err=err,
                )
                step_us[(ctx_len, b, label, vb)] = us
                if vb == VALUE_BITS[0] and us:
                    flush_row(rec, quant, lc, m, ctx_len, b, label, us, timer, gen, device)
            except Exception as e:  # noqa: BLE001
                rec.add(
                    {
                        "kind": "error",
                        "where": f"{label} V{vb} T={ctx_len} B={b}",
                        "error": repr(e)[:300],
                    }
                )
                traceback.print_exc()


def timings(K, device, rec: Recorder, shapes, timer: Timer, budget_s: float, t_start: float):
    """Step and flush rows for every shape (in order) until the time budget is spent, then the
    target rows."""
    gen = torch.Generator().manual_seed(7)
    copy = [r for r in rec.rows if r["kind"] == "copy"]
    copy_gbps = copy[-1]["gbps"] if copy else None
    step_us: dict = {}

    def out_of_time() -> bool:
        return time.time() - t_start > budget_s

    for ctx_len, b in shapes:
        if out_of_time():
            rec.add(
                {"kind": "error", "where": f"T={ctx_len} B={b}", "error": "skipped: time budget"}
            )
            continue
        try:
            _time_shape(K, device, rec, timer, step_us, copy_gbps, ctx_len, b, gen, out_of_time)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory building the K/V
            rec.add({"kind": "error", "where": f"T={ctx_len} B={b}", "error": repr(e)[:300]})
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for ctx_len, b, label, vb, against, need in TARGETS:
        us = step_us.get((ctx_len, b, label, vb))
        base = step_us.get((ctx_len, b, against))
        if us and base:
            rec.add(
                {
                    "kind": "target",
                    "name": f"T={ctx_len} B={b} {label} keys, V{vb}: >= {need}x vs {against}",
                    "measured": f"{base / us:.2f}x",
                    "ok": base / us >= need,
                }
            )


def tune(K, device, rec: Recorder, timer: Timer, ctx_len: int, b: int) -> None:
    """Opt-in sweep at one shape: tile size and warps (each pair a compile), then the number
    of splits (no compile), for the control and the target configurations."""
    da, dispatch = K["decode_attention"], K["dispatch"]
    layouts = fused_layouts(dispatch)
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(b, HKV, ctx_len, D, generator=gen).to(device, torch.float16)
    v = torch.randn(b, HKV, ctx_len, D, generator=gen).to(device, torch.float16)
    q = torch.randn(b, HQ, 1, D, generator=gen).to(device, torch.float16)
    runs = [("control", lambda **kw: da.split_kv_attention(q, k, v, **kw))]
    for label, name, cfg, vb in (("PN-Mix (1)", "pn-mix", {}, 16), ("KIVI-2", "kivi", {}, 2)):
        m = load_method(name, **cfg, value_bits=vb)
        lc = m.new_layer(0, HKV, D, dtype=torch.float16, device=device)
        qs = torch.randn(b, HQ, ctx_len, D, generator=gen).to(device, torch.float16)
        lc.prefill(k, v, qs if m.needs_queries else None)
        runs.append(
            (
                f"{label} V{vb}",
                lambda lc=lc, **kw: dispatch.fused_attend(lc, q, layouts=layouts, **kw),
            )
        )
    tiles = ctx_len // 64
    auto = da.auto_num_splits(q, b * HKV, tiles)
    for label, fn in runs:
        best = None
        for bn in TUNE_BLOCK_N:
            for nw in TUNE_WARPS:
                us = timer(lambda fn=fn, bn=bn, nw=nw: fn(block_n=bn, num_warps=nw))[0]
                rec.add(
                    {
                        "kind": "tune",
                        "context": ctx_len,
                        "batch": b,
                        "method": label,
                        "block_n": bn,
                        "num_warps": nw,
                        "num_splits": auto,
                        "us": us,
                    }
                )
                best = min(best or (us, bn, nw), (us, bn, nw))
        _, bn, nw = best
        for sp in sorted({max(1, auto // 2), 2 * auto, 4 * auto} - {auto}):
            us = timer(
                lambda fn=fn, sp=sp, bn=bn, nw=nw: fn(block_n=bn, num_warps=nw, num_splits=sp)
            )[0]
            rec.add(
                {
                    "kind": "tune",
                    "context": ctx_len,
                    "batch": b,
                    "method": label,
                    "block_n": bn,
                    "num_warps": nw,
                    "num_splits": sp,
                    "us": us,
                }
            )


def flush_row(rec, quant, lc, m, ctx_len, b, label, step_us, timer, gen, device):
    """Time quantize-and-pack of one flushed page (G keys) and one value token."""
    c = m.config
    g = c.group_size
    x = torch.randn(b, HKV, g, D, generator=gen).to(device, torch.float16)
    xv = torch.randn(b, HKV, 1, D, generator=gen).to(device, torch.float16)
    codec = lc.k.codec
    sel_us = None
    if getattr(codec, "per_page", False):  # Kitty: per-page selection (torch) + kernel

        def keys_fn():
            blk_perm, counts = _kitty_perm(codec, x)
            return quant.quantize_keys(
                x, g, codec.class_bits, counts, blk_perm, check_overflow=False
            )

        sel_us = timer(lambda: _kitty_perm(codec, x))[0]
    elif hasattr(codec, "class_bits"):  # PN-Mix: fixed perm from the prefill
        perm, counts = codec.perm, codec.class_counts

        def keys_fn():
            return quant.quantize_keys(
                x, g, codec.class_bits, counts, perm, midpoint=codec.midpoint, check_overflow=False
            )
    else:

        def keys_fn():
            return quant.quantize_keys(x, g, (codec.bits,), check_overflow=False)

    keys_us = timer(keys_fn)[0]
    value_us = timer(lambda: quant.quantize_values(xv, 2, check_overflow=False))[0]
    per_step = keys_us / g + value_us
    rec.add(
        {
            "kind": "flush",
            "context": ctx_len,
            "batch": b,
            "method": label,
            "keys_us": keys_us,
            "select_us": sel_us,
            "value_us": value_us,
            "per_step_us": per_step,
            "pct_step": 100 * per_step / step_us,
        }
    )


def _kitty_perm(codec, x):
    from kvbench.cache.mixed_channel import perm_from_classes

    b, h, n, d = x.shape
    pages = x.reshape(b, h, n // codec.group_size, codec.group_size, d)
    perm, counts = perm_from_classes(codec.selector(pages, None), len(codec.class_bits))
    return perm.to(torch.uint8), counts


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def parse_shapes(contexts: str, batches: str) -> list[tuple[int, int]]:
    """Shapes in measuring order: the 32K rows (the targets) first, then the rest."""
    cs = [int(c) for c in contexts.split(",") if c]
    bs = [int(b) for b in batches.split(",") if b]
    shapes = [(c, b) for c in cs for b in sorted(bs, reverse=True)]
    return sorted(shapes, key=lambda s: (s[0] != 32768, s[0] > 32768, s[0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="CPU, TRITON_INTERPRET=1, tiny sizes: tests the script, times nothing",
    )
    ap.add_argument("--contexts", default="4096,16384,32768,65536")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=230.0,
        help="seconds after which no new shape is started",
    )
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--tune",
        default="",
        metavar="T,B",
        help="before the timings, sweep block_n/num_warps/num_splits at context T, "
        "batch B (e.g. 32768,8); each block_n/num_warps pair compiles anew",
    )
    args = ap.parse_args(argv)
    t_start = time.time()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules import triton
    K = _kernels()
    if args.interpret:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("no CUDA device: use --interpret for the CPU dry run", file=sys.stderr)
        return 2
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "CPU (Triton interpreter)",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "mode": "interpret (timings meaningless)" if args.interpret else "cuda",
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["SMs"] = p.multi_processor_count
        env["memory"] = f"{p.total_memory / 2**30:.0f} GiB"
    rec = Recorder(args.out, env)
    timer = Timer(
        device, reps=1 if args.interpret else args.reps, warmup=1 if args.interpret else 5
    )
    try:
        rec.add(copy_bandwidth(device, timer, 2**20 if args.interpret else 2**30))
    except Exception as e:  # noqa: BLE001
        rec.add({"kind": "error", "where": "copy bandwidth", "error": repr(e)[:300]})
    if args.interpret:  # tiny: one context, KIVI and PN-Mix keys with 2-bit values
        global HQ, HKV, D, METHODS, VALUE_BITS
        HQ, HKV, D = 4, 2, 64
        small = dict(group_size=16, residual_length=16)
        METHODS = [(lbl, n, dict(cfg, **small)) for lbl, n, cfg in METHODS if n != "kitty"]
        VALUE_BITS = (2,)
        shapes = [(48, 1)]
    else:
        shapes = parse_shapes(args.contexts, args.batches)
    if args.tune:
        t_ctx, t_b = (int(x) for x in args.tune.split(","))
        try:
            tune(K, device, rec, timer, t_ctx, t_b)
        except Exception as e:  # noqa: BLE001
            rec.add({"kind": "error", "where": "tune", "error": repr(e)[:300]})
            traceback.print_exc()
    timings(K, device, rec, shapes, timer, args.time_budget, t_start)
    rec.write_markdown()
    failed = [r for r in rec.rows if r["kind"] == "step" and (r.get("err") or 0) > GUARD]
    print(render_markdown(env, rec.rows))
    print(f"done in {time.time() - t_start:.0f} s; {len(failed)} timed kernels failed the guard")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
