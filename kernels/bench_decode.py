"""Device check: correctness at random sizes, then decode-attention timings (one GPU call).

Run from the source tree (no install; no ``datasets`` or network needed)::

    PYTHONPATH=. python kernels/bench_decode.py --out "$OUT"       # on a CUDA GPU
    PYTHONPATH=. python kernels/bench_decode.py --out DIR --interpret  # CPU, TRITON_INTERPRET=1

Phases (each row is appended to ``OUT/rows.jsonl`` as soon as it exists and ``OUT/RESULTS.md``
is rewritten after every row, so a timeout still returns what was measured):

1. correctness at random sizes: pack/unpack and quantize-and-pack bit-exact against the core
   (``kvbench.kv.quant``, ``kvbench.kv.blocks``, ``kvbench.kv.mixed``), round-half-to-even ties (KVQ-21),
   fused attention through ``LayerCache`` for KIVI / Kitty / PN-Mix keys with values at 16, 4
   and 2 bits, D 64 and 128, GQA, odd lengths, per-sequence lengths, the fp16 control, and
   head_dim 96 refused;
2. timings on Llama-3.1-8B attention shapes (H_q 32, H_kv 8, D 128, fp16) at each context and
   batch: fp16 SDPA (flash backend), the split-KV kernel on fp16 K/V (control), and the fused
   kernel for KIVI 2-bit, Kitty and PN-Mix (1) keys with values at 16 and 2 bits; achieved
   GB/s = bytes the kernel must read (the cache's stored bytes + query) / median time, against
   a measured device-to-device copy; then quantize-and-pack of one flushed page per method,
   amortized over G decode steps.

Timing: each measured call is captured in a CUDA graph (no host overhead; eager if capture
fails, marked in the table), L2 is flushed (a 256 MiB write) before every replay, CUDA events
bracket the replay only; warm-up first, median and p10/p90 reported.  Under ``--interpret`` the
sizes are tiny and times are host wall-clock of the CPU interpreter: they only exercise the
script.
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
    """The kernel modules, as ``kvbench.kernels.*`` (installed) or ``kernels.*`` (source tree)."""
    pkg = __package__ or "kernels"
    if pkg == "kernels" and str(Path(__file__).resolve().parents[1]) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    mods = {
        m: importlib.import_module(f"{pkg}.{m}")
        for m in ("pack", "quantize", "decode_attention", "dispatch")
    }
    return mods


def load_method(name: str, **config):
    """A kvbench method by registry name; without an installed kvbench (source tree on the GPU
    machine) the class is imported from ``methods/`` directly."""
    try:
        import kvbench

        return kvbench.get_method(name, **config)
    except Exception:  # noqa: BLE001 - entry points absent: import the module itself
        mod, cls = {
            "kivi": ("kivi", "KIVI"),
            "kitty": ("kitty", "Kitty"),
            "pn-mix": ("pn_mix", "PNMix"),
            "per-head": ("per_head", "PerHead"),
        }[name]
        for pkg in ("kvbench.methods", "methods"):
            try:
                return getattr(importlib.import_module(f"{pkg}.{mod}"), cls)(**config)
            except ModuleNotFoundError:
                continue
        raise


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


def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def render_markdown(env: dict, rows: list[dict]) -> str:
    """The results as Markdown: environment, correctness, step timings, flush timings, targets."""
    lines = ["# Fused decode attention over quantized KV pages: device results", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines.append("")
    corr = [r for r in rows if r["kind"] == "correctness"]
    if corr:
        npass = sum(r["ok"] for r in corr)
        lines += [
            f"## Correctness at random sizes ({npass}/{len(corr)} passed)",
            "",
            "| check | result | detail |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['name']} | {'pass' if r['ok'] else '**FAIL**'} | {r['detail']} |" for r in corr
        ]
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
            "| GB/s | % copy BW | vs SDPA | vs control | timing |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            lines.append(
                f"| {r['context']} | {r['batch']} | {r['method']} | {r['keys']} | {r['values']} "
                f"| {r['bytes'] / 1e6:.1f} | {_f(r['us'])} | {_f(r.get('p10'))}–{_f(r.get('p90'))} "
                f"| {_f(r.get('gbps'), '{:.0f}')} | {_f(r.get('pct_copy'), '{:.0f}')} "
                f"| {_f(r.get('vs_sdpa'), '{:.2f}x')} | {_f(r.get('vs_control'), '{:.2f}x')} "
                f"| {r['timing']} |"
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
    """CUDA: graph capture + L2 flush + events (eager if capture fails); CPU: perf_counter."""

    def __init__(self, device: torch.device, reps: int, warmup: int) -> None:
        self.device, self.reps, self.warmup = device, reps, warmup
        self.flush = None
        if device.type == "cuda":
            self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)

    def __call__(self, fn) -> tuple[float, float, float, str]:
        """Median, p10, p90 in microseconds, and the mode (``graph``/``eager``/``cpu``)."""
        if self.device.type != "cuda":
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            return (*_stats(ts), "cpu")
        mode, run = "graph", fn
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except Exception:  # noqa: BLE001 - not capturable: time it eagerly
            torch.cuda.synchronize()
            mode, run = "eager", fn
        for _ in range(self.warmup):
            self.flush.zero_()
            run()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            self.flush.zero_()
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        return (*_stats([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]), mode)


def _stats(ts: list[float]) -> tuple[float, float, float]:
    t = sorted(ts)
    q = lambda p: t[min(len(t) - 1, int(p * (len(t) - 1) + 0.5))]  # noqa: E731
    return q(0.5), q(0.1), q(0.9)


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us, *_ = timer(lambda: dst.copy_(src))
    return {"kind": "copy", "bytes": 2 * nbytes, "us": us, "gbps": 2 * nbytes / us / 1e3}


# --------------------------------------------------------------------------------------------
# correctness
# --------------------------------------------------------------------------------------------


def correctness(K: dict, device: torch.device, rec: Recorder, small: bool) -> None:
    """Every check adds one row (pass/fail and detail); an exception is a failed check."""
    gen = torch.Generator().manual_seed(1234)

    def check(name, fn):
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - record and go on
            ok, detail = False, f"{type(e).__name__}: {e}".replace("|", "/")[:300]
        rec.add({"kind": "correctness", "name": name, "ok": bool(ok), "detail": detail})

    def randn(*shape, dtype=torch.float16):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    from kvbench.kv.quant import pack_bits as core_pack

    def pack_check():
        bad = []
        for bits in (2, 3) if small else (1, 2, 3, 4, 8):
            n = int(torch.randint(1, 200, (1,), generator=gen))
            c = torch.randint(0, 2**bits, (3, n), generator=gen).to(device)
            p = K["pack"].pack_bits(c, bits)
            if not torch.equal(p, core_pack(c, bits)) or not torch.equal(
                K["pack"].unpack_bits(p, bits, n), c.int()
            ):
                bad.append(bits)
        return not bad, f"mismatching bits: {bad or 'none'}"

    check("pack/unpack bit-exact vs kvbench.kv.quant.pack_bits, random n", pack_check)

    def ties_check():  # KVQ-21: (x - min) / scale lands on .5 exactly
        col = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0] + [0.0] * 11, device=device)
        x = col.view(1, 1, 16, 1).expand(1, 1, 16, 8).contiguous().half()
        got = []
        for floor in (None, True):
            c, s, _ = K["quantize"].quantize_keys(x, 16, (2,), _exact_floor=floor)
            got.append(K["pack"].unpack_bits(c, 2, 8)[0, 0, :5, 0].tolist())
        ok = all(g == [0, 0, 2, 2, 3] for g in got)
        return ok, f"codes {got} (half-to-even [0, 0, 2, 2, 3]; half-up would give [0, 1, 2, 3, 3])"

    check("round-half-to-even ties (KVQ-21), rint and floor paths", ties_check)

    def quant_check():
        from kvbench.kv.blocks import PerChannelCodec, PerTokenCodec
        from kvbench.kv.mixed import MixedChannelCodec

        b, h, g, d = (1, 2, 16, 64) if small else (2, 3, 128, 128)
        x = randn(b, h, 2 * g, d) * torch.linspace(0.2, 3, d, device=device).half()
        bad = []
        for bits in (2,) if small else (1, 2, 3, 4, 8):
            blk = PerChannelCodec(bits, torch.float16, group_size=g).encode(x)
            out = K["quantize"].quantize_keys(x, g, (bits,))
            if not all(torch.equal(a, r) for a, r in zip(out, (blk.codes, blk.scale, blk.zero))):
                bad.append(f"keys{bits}")
            vb = PerTokenCodec(bits, torch.float16, channel_group=32).encode(x)
            out = K["quantize"].quantize_values(x, bits, 32)
            if not all(torch.equal(a, r) for a, r in zip(out, (vb.codes, vb.scale, vb.zero))):
                bad.append(f"values{bits}")
        kitty = load_method("kitty", group_size=g, residual_length=g).key_codec(0, d)
        blk = kitty.encode(x)
        out = K["quantize"].quantize_keys(x, g, blk.class_bits, blk.class_counts, blk.perm)
        if not all(torch.equal(a, r) for a, r in zip(out, (blk.codes, blk.scale, blk.zero))):
            bad.append("kitty")
        cls = torch.stack([torch.randperm(d, generator=gen) for _ in range(b * h)]).view(b, h, d)
        codec = MixedChannelCodec(
            [3, 1], None, group_size=g, midpoint=True, classes=(cls >= d // 2).long().to(device)
        )
        blk = codec.encode(x)
        out = K["quantize"].quantize_keys(
            x, g, blk.class_bits, blk.class_counts, blk.perm, midpoint=True
        )
        if not all(torch.equal(a, r) for a, r in zip(out, (blk.codes, blk.scale, blk.zero))):
            bad.append("pn-mix")
        return not bad, f"codes, scales, zeros bit-identical; mismatches: {bad or 'none'}"

    check("quantize-and-pack bit-exact vs core codecs (KIVI, values, Kitty, PN-Mix)", quant_check)

    da = K["decode_attention"]
    cases = [  # (method, config, D, H_q, H_kv, prefill, decode steps, batch)
        ("kivi", dict(value_bits=16), 128, 32, 8, 700, 5, 3),
        ("kivi", dict(value_bits=2), 128, 32, 8, 500, 3, 2),
        ("kivi", dict(value_bits=4, num_sink_tokens=7), 64, 9, 3, 420, 7, 2),
        ("kitty", dict(value_bits=16), 128, 32, 8, 650, 2, 2),
        ("kitty", dict(value_bits=2), 64, 8, 8, 390, 9, 3),
        ("pn-mix", dict(value_bits=16), 128, 32, 8, 600, 4, 2),
        ("pn-mix", dict(value_bits=2), 128, 16, 4, 333, 1, 3),
    ]
    if small:
        cases = [
            (
                "pn-mix",
                dict(value_bits=2, group_size=16, residual_length=16, num_sink_tokens=4),
                64,
                4,
                2,
                45,
                2,
                2,
            )
        ]
    for name, cfg, d, hq, hkv, p, steps, b in cases:

        def attn_check(name=name, cfg=cfg, d=d, hq=hq, hkv=hkv, p=p, steps=steps, b=b):
            m = load_method(name, **cfg)
            lc = m.new_layer(0, hkv, d, dtype=torch.float16, device=device)
            lc.prefill(
                randn(b, hkv, p, d),
                randn(b, hkv, p, d),
                randn(b, hq, p, d) if m.needs_queries else None,
            )
            for _ in range(steps):
                lc.append(randn(b, hkv, 1, d), randn(b, hkv, 1, d))
            q = randn(b, hq, 1, d)
            out = K["dispatch"].fused_attend(lc, q)
            kk, vv = lc.keys_values(q.dtype)
            ref = da.decode_attention_reference(q, kk, vv)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ok = err <= 1e-3 and bool(torch.isfinite(out).all())
            return (
                ok,
                f"rel. error {err:.2e} (<= 1e-3); quantized K/V tokens {lc.quantized_tokens()}",
            )

        check(f"fused attention {name} {cfg} D={d} GQA {hq}/{hkv} T={p + steps} B={b}", attn_check)

    def per_seq_check():
        b, h, hq, d, g = (3, 2, 8, 128, 128) if not small else (3, 1, 2, 64, 16)
        s, kq, kr, vq, vr = 5, 3 * g, 11, 3 * g - 20, 31
        x = randn(b, h, kq, d)
        kc, ks, kz = K["quantize"].quantize_keys(x, g, (2,))
        xv = randn(b, h, vq, d)
        vc, vs, vz = K["quantize"].quantize_values(xv, 4)
        kq_ = da.QuantKeys(kc, ks, kz, g, (2,), (d,))
        vq_ = da.QuantValues(vc, vs, vz, 4)
        sk, sv, rk, rv = (
            randn(b, h, s, d),
            randn(b, h, s, d),
            randn(b, h, kr, d),
            randn(b, h, vr, d),
        )
        # per sequence (S, KQ, KR, VQ, VR) with KQ + KR == VQ + VR, each within what is stored
        lens = torch.tensor(
            [[s, kq, kr, vq, vr], [2, g + 7, 0, g - 13, 20], [0, 2 * g, 5, 2 * g - 24, 29]],
            dtype=torch.int32,
        )
        q = randn(b, hq, 1, d)
        out = da.fused_decode_attention(
            q,
            k_sinks=sk,
            k_quant=kq_,
            k_residual=rk,
            v_sinks=sv,
            v_quant=vq_,
            v_residual=rv,
            lengths=lens.to(device),
        )
        kd, vd = (
            da.dequantize_keys_reference(kq_, q.dtype),
            da.dequantize_values_reference(vq_, q.dtype),
        )
        errs = []
        for i, (s_, kq__, kr_, vq__, vr_) in enumerate(lens.tolist()):
            kk = torch.cat([sk[i, :, :s_], kd[i, :, :kq__], rk[i, :, :kr_]], 1)[None]
            vv = torch.cat([sv[i, :, :s_], vd[i, :, :vq__], rv[i, :, :vr_]], 1)[None]
            ref = da.decode_attention_reference(q[i : i + 1], kk, vv)
            errs.append(((out[i : i + 1].double() - ref).norm() / ref.norm()).item())
        return max(errs) <= 1e-3, f"per-sequence rel. errors {[f'{e:.1e}' for e in errs]}"

    check("per-sequence lengths (sinks/quantized/residual differ per sequence)", per_seq_check)

    def control_check():
        b, t, hkv, hq, d = (3, 1000, HKV, HQ, D) if not small else (2, 40, 1, 2, 64)
        k, v, q = randn(b, hkv, t, d), randn(b, hkv, t, d), randn(b, hq, 1, d)
        lens = torch.tensor([t, t // 2 + 3, 17][:b], device=device)
        out = da.split_kv_attention(q, k, v, seq_lens=lens)
        ref = da.decode_attention_reference(q, k, v, seq_lens=lens)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        return err <= 1e-3, f"rel. error {err:.2e}"

    check("split-KV control on fp16 K/V, per-sequence lengths", control_check)

    def d96_check():
        q, k = randn(1, 4, 1, 96), randn(1, 4, 40, 96)
        try:
            da.split_kv_attention(q, k, k)
        except ValueError as e:
            return "head_dim=96" in str(e), f"ValueError: {e}"
        return False, "head_dim 96 was accepted"

    check("head_dim 96 refused (KVQ-25)", d96_check)

    if device.type == "cuda":

        def dispatch_check():
            m = load_method("pn-mix")
            lc = m.new_layer(0, HKV, D, dtype=torch.float16, device=device)
            lc.prefill(randn(1, HKV, 300, D), randn(1, HKV, 300, D), randn(1, HQ, 300, D))
            q = randn(1, HQ, 1, D)
            out = K["dispatch"].try_fused_attend(lc, q)
            ok = out is not None and lc.attend_path == "triton"
            detail = f"try_fused_attend: {lc.attend_path!r} {lc.attend_path_reason}"
            # LayerCache.attend reaches the kernel through kvbench.attend.cpu when
            # kvbench.kernels is importable (an install; a bare source tree has only kernels.*)
            ref = da.decode_attention_reference(q, *lc.keys_values(q.dtype))
            out2 = lc.attend(q)
            err = ((out2.double() - ref).norm() / ref.norm()).item()
            ok = ok and err <= 1e-3
            detail += (
                f"; LayerCache.attend: {lc.attend_path!r} ({lc.attend_path_reason}) err {err:.1e}"
            )
            return ok, detail.replace("|", "/")

        check("dispatch takes the triton path on CUDA", dispatch_check)


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


def _step_row(rec, timer, step_us, copy_gbps, ctx_len, b, method, keys, values, nbytes, fn):
    """Time ``fn`` (one decode-attention step) and add its row; returns the median in µs."""
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
    }
    if copy_gbps:
        r["pct_copy"] = 100 * r["gbps"] / copy_gbps
    base, ctrl = step_us.get((ctx_len, b, "sdpa")), step_us.get((ctx_len, b, "control"))
    r["vs_sdpa"] = base / us if base else None
    r["vs_control"] = ctrl / us if ctrl else None
    rec.add(r)
    return us


def _time_shape(K, device, rec, timer, step_us, copy_gbps, ctx_len, b, gen, out_of_time):
    """All rows of one (context, batch): the two baselines, then each method and value width."""
    da, dispatch, quant = K["decode_attention"], K["dispatch"], K["quantize"]
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
                us = _step_row(
                    *args, label, keys, vals, nbytes, lambda lc=lc: dispatch.fused_attend(lc, q)
                )
                step_us[(ctx_len, b, label, vb)] = us
                if vb == VALUE_BITS[0]:
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
        runs.append((f"{label} V{vb}", lambda lc=lc, **kw: dispatch.fused_attend(lc, q, **kw)))
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
    from kvbench.kv.mixed import perm_from_classes

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
    ap.add_argument("--skip-correctness", action="store_true")
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
    if not args.skip_correctness:
        correctness(K, device, rec, small=args.interpret)
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
    failed = [r for r in rec.rows if r["kind"] == "correctness" and not r["ok"]]
    print(render_markdown(env, rec.rows))
    print(f"done in {time.time() - t_start:.0f} s; {len(failed)} failed checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
