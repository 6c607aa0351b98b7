"""Decode-step latency of every built-in cache side by side, at several contexts, in one run.

Command (on an idle machine; results are only comparable within one run)::

    .venv/bin/python benchmarks/decode_step.py --contexts 1024 4096 8192 --threads 1 \\
        --out results/decode_step

writes ``results/decode_step.json`` and ``results/decode_step.md`` (rewritten atomically after
every context, so an interrupted run keeps the contexts it finished) and prints one table per
context.  ``--quick`` is a smoke check (one short context, 4 steps, a few configurations);
``--tiny`` swaps in a random 2-layer Llama (no model files needed; for tests).

Configurations
--------------
* ``dynamic``: transformers ``DynamicCache`` (full precision): the ``/dynamic`` baseline;
* ``quanto2``: transformers ``QuantizedCache(backend="quanto", nbits=2)`` (needs
  ``optimum-quanto``; skipped with a note otherwise): the ``/quanto2`` baseline;
* every built-in kvbench method (``kvbench list``, distribution ``kvbench``, with a layer cache)
  at its default configuration, and ``kivi-2`` (KIVI 2-bit keys and values: per-channel keys in
  groups of G = 128 tokens, per-token values in groups of 64 channels, R = 128, float16
  scales; arXiv:2402.02750 §3), each through ``QuantizedKVCache(attend=True)``: decode attention
  runs ``LayerCache.attend`` (the path the latency suite runs; ``attend path`` says which
  backend each layer took).  Methods that need calibration are calibrated on the prompt's K/V
  (speed only; their accuracy is measured elsewhere).

Protocol (:mod:`kvbench.measure.timer`)
---------------------------------------
The default model (SmolLM2-135M-Instruct), float32, ``attn_implementation="kvbench"`` (plain
sdpa for transformers' caches).  Per context T: every configuration is prefilled with the same
P = T - warmup - steps seeded random token ids (``--prefill-threads`` threads, untimed), so the
last timed step attends to exactly T tokens; then threads are pinned to ``--threads``,
``--warmup`` untimed rounds and ``--steps`` timed rounds follow, one decode step
of every configuration per round in rotating order (round i starts at configuration i mod n).
Inputs are teacher-forced (the same seeded next token for every cache), so all do the same
work.  Step time: ``time.perf_counter_ns`` around ``model(...)`` (logits of the last position).
Flush steps (the cache held fewer bytes after the step: a bulk quantization such as KIVI's keys
every R steps) are split off (:mod:`kvbench.measure.window`): median / p90 / p99 are over
steady-state steps; the flush count and the amortized mean (flush cost spread over its period)
are reported beside them.

Columns
-------
``median/p90/p99 ms`` (steady-state step), ``flush`` (flush steps timed / amortized ms),
``/dynamic`` and ``/quanto2`` (ratio of medians, same run), ``attn ms`` (median over steady
steps of the time inside the registered attention function, summed over layers: for kvbench
caches ``LayerCache.attend`` (the step's flush runs in ``update`` before it, outside this
clock: ``write-then-attend``, docs/design.md#protocols; runs before 2026-12-06 flushed after
the attention, inside it); for transformers caches sdpa over
the K/V ``update`` returned, whose dequantization and concatenation run in ``update`` outside
this clock), ``MiB read`` (bytes the step's attention reads, all layers: kvbench caches every
stored tensor (codes, scales and other terms, metadata, residual, sinks; ``LayerCache.nbytes``)
before the step; transformers caches the full-precision K/V sdpa reads), ``GB/s`` (MiB read /
attn ms), ``ref GB/s`` (:func:`kvbench.measure.timer.contiguous_read` of a buffer of the same
size, same threads, right after the context's timed rounds), ``% ref``.  The header gives the
load average (``os.getloadavg``) before and after and the thread count.

Targets (evaluated on the run, printed, written; on the CPU, default model, float32, 1 thread):
at 4096 every built-in method at most 1.25x ``dynamic`` and ``pn-mix``, ``kitty`` at most
1.10x; ``kivi-2`` at 8192 at most 0.90x ``dynamic`` and below ``quanto2`` at every context;
the attention of every kvbench configuration reads at least 40% of ``ref GB/s``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvbench.measure.timer import (
    PERCENTILE_RULE,
    Timer,
    contiguous_read,
    interleave,
    percentile,
    pin_threads,
    system_state,
)
from kvbench.measure.window import flush_steps, split_steps

KIVI2 = dict(
    bits=2,
    value_bits=2,
    group_size=128,
    value_group_size=64,
    residual_length=128,
    scale_dtype="float16",
)
#: llama.cpp's q4_0 / q8_0 KV caches as deployed (docs/results/llama-cpp-crosscheck.md): the
#: 64-channel Hadamard rotation of Q/K/V and key blocks in GGUF channel order; with ``full-fp16``
#: (K/V stored in float16, as llama.cpp's f16 cache) they are the configurations the speed table
#: of that page sets beside ``llama-bench``.
AS_LLAMA_CPP = dict(rotation="hadamard", rotation_block=64, channel_order="gguf")
EXTRA = {
    "full-fp16": ("full", dict(storage_dtype="float16")),
    "int4-block-llama": ("int4-block", AS_LLAMA_CPP),
    "int8-block-llama": ("int8-block", AS_LLAMA_CPP),
}
PEERS = ("dynamic", "quanto2")
QUICK = ("dynamic", "quanto2", "full", "kivi-2", "kitty", "pn-mix")
TARGET_ALL = (4096, 1.25)  # (context, max ratio to dynamic) for every built-in method
TARGET_MIXED = (4096, 1.10, ("pn-mix", "kitty"))
TARGET_KIVI2 = (8192, 0.90)
TARGET_BANDWIDTH = 0.40


# ------------------------------------------------------------------------------- configurations
def builtin_methods() -> list[str]:
    """Registered built-in kvbench methods with a layer cache (sorted)."""
    import kvbench

    return sorted(
        r["name"]
        for r in kvbench.list_methods()
        if r["distribution"] == "kvbench"
        and r["error"] is None
        and r["capabilities"].get("layer_cache", True)
    )


def configurations(names: list[str] | None) -> dict[str, tuple[str, dict]]:
    """``label -> (kind or method name, config)`` in measuring order."""
    out: dict[str, tuple[str, dict]] = {"dynamic": ("dynamic", {}), "quanto2": ("quanto2", {})}
    for name in builtin_methods():
        out[name] = (name, {})
        if name == "kivi":
            out["kivi-2"] = ("kivi", KIVI2)
    out.update(EXTRA)
    if names:
        unknown = sorted(set(names) - set(out))
        if unknown:
            raise SystemExit(f"unknown configuration(s) {unknown}; allowed: {list(out)}")
        out = {k: v for k, v in out.items() if k in names}
    return out


def make_cache(label: str, spec: tuple[str, dict], model, prompt, info: dict):
    """``(cache, note)``; ``cache`` is ``None`` when unavailable (``note`` says why)."""
    from transformers import DynamicCache, QuantizedCache

    from kvbench.hf.cache import QuantizedKVCache

    kind, cfg = spec
    if kind == "dynamic":
        return DynamicCache(config=model.config), "transformers DynamicCache"
    if kind == "quanto2":
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            return None, "skipped: optimum-quanto is not installed (pip install '.[peers]')"
        return QuantizedCache(backend="quanto", config=model.config, nbits=2), "quanto 2-bit"
    import kvbench

    method = kvbench.get_method(kind, **cfg).for_model(info)
    if method.needs_calibration:
        from kvbench.hf.capture import capture_qkv

        cap = capture_qkv(model, prompt[:, : min(512, prompt.shape[1])])
        method.calibrate(
            dict(zip(cap.layer_ids, cap.keys)),
            dict(zip(cap.layer_ids, cap.values)),
            source="the benchmark prompt (speed only)",
        )
    return QuantizedKVCache(method, model, attend=True), "kvbench LayerCache.attend"


# ------------------------------------------------------------------------------- attention clock
@contextlib.contextmanager
def attention_clock():
    """While active, the ``"kvbench"`` attention function adds its wall time (ms) to the
    yielded one-element list (synchronized on CUDA)."""
    from transformers import AttentionInterface

    from kvbench.hf import attention as kva

    acc = [0.0]

    def timed(module, query, *args, **kwargs):
        cuda = query.is_cuda
        if cuda:
            torch.cuda.synchronize(query.device)
        t0 = time.perf_counter_ns()
        out = kva.kvbench_attention_forward(module, query, *args, **kwargs)
        if cuda:
            torch.cuda.synchronize(query.device)
        acc[0] += (time.perf_counter_ns() - t0) / 1e6
        return out

    AttentionInterface.register(kva.ATTN_IMPLEMENTATION, timed)
    try:
        yield acc
    finally:
        AttentionInterface.register(kva.ATTN_IMPLEMENTATION, kva.kvbench_attention_forward)


def read_bytes(cache, model, tokens: int) -> int:
    """Bytes the attention of one decode step reads over all layers (see the module doc)."""
    if hasattr(cache, "layer_caches"):
        return int(cache.nbytes().get("total", 0))
    from kvbench.hf.info import model_info

    mi = model_info(model)
    elt = next(model.parameters()).element_size()
    d = mi["head_dim"]
    return 2 * mi["num_hidden_layers"] * mi["num_key_value_heads"] * tokens * d * elt


# ------------------------------------------------------------------------------- one context
def run_context(model, info, labels, ctx_len, args, log) -> list[dict]:
    """Rows of one context: every configuration prefilled, then interleaved decode rounds."""
    from kvbench.bench.workloads.latency import held_bytes, quantized_tokens_of
    from kvbench.hf.cache import cache_kwarg

    gen = torch.Generator().manual_seed(ctx_len)
    vocab = model.config.vocab_size
    lo = min(100, vocab - 1)
    ids = torch.randint(lo, vocab, (1, ctx_len), generator=gen)
    p = ctx_len - args.warmup - args.steps  # the last timed step attends to ctx_len tokens
    prompt = ids[:, :p]
    state: dict[str, dict] = {}
    notes: dict[str, str] = {}
    with pin_threads(args.prefill_threads), torch.inference_mode():
        for label, spec in labels.items():
            cache, note = make_cache(label, spec, model, prompt, info)
            notes[label] = note
            if cache is None:
                log(f"  {label}: {note}")
                continue
            kw = cache_kwarg(cache, model)
            t0 = time.perf_counter()
            model(input_ids=prompt, logits_to_keep=1, **kw)
            log(f"  {label}: prefill {time.perf_counter() - t0:.1f} s")
            state[label] = dict(cache=cache, kw=kw, model=model, done=0, attn=[], held=[], q=[])

    def stepper(label: str):
        s = state[label]

        def fn() -> None:
            t = p + s["done"]
            model(input_ids=ids[:, t : t + 1], logits_to_keep=1, **s["kw"])
            s["done"] += 1

        return fn

    names = list(state)
    timer = Timer("cpu")
    with pin_threads(args.threads), torch.inference_mode(), attention_clock() as clock:
        load_before = system_state()["loadavg"]

        def after(label: str, i: int, ms: float | None) -> None:
            s = state[label]
            if i >= args.warmup:
                s["attn"].append(clock[0])
            if i >= args.warmup - 1:
                s["held"].append(held_bytes(s["cache"]))
                s["q"].append(quantized_tokens_of(s["cache"]))
            clock[0] = 0.0

        for label in names if args.warmup == 0 else []:
            after(label, -1, None)
        clock[0] = 0.0
        t0 = time.perf_counter()
        times = interleave({k: stepper(k) for k in names}, args.steps, args.warmup, timer, after)
        log(f"  {len(names)} configurations x {args.steps} steps: {time.perf_counter() - t0:.0f} s")
        rows = []
        for label in names:
            first = p + args.warmup + 1  # tokens the first timed step attends to
            rows.append(_row(label, labels[label], state[label], times[label], ctx_len, first))
            rows[-1]["note"] = notes[label]
        for r in rows:  # the same-size contiguous read, same threads, right after the rounds
            if r["bytes_read"]:
                ref = contiguous_read(r["bytes_read"], reps=args.ref_reps, timer=timer)
                r["ref_gbps"] = ref["gbps"]
                if r.get("gbps"):
                    r["pct_ref"] = 100 * r["gbps"] / ref["gbps"]
        load_after = system_state()["loadavg"]
        threads = torch.get_num_threads()
    for r in rows:
        r.update(loadavg_before=load_before, loadavg_after=load_after, threads=threads)
    med = {r["config"]: r["median_ms"] for r in rows}
    for r in rows:
        for base in PEERS:
            r[f"ratio_{base}"] = r["median_ms"] / med[base] if med.get(base) else None
    for label, note in notes.items():
        if label not in state:
            rows.append({"context": ctx_len, "config": label, "note": note, "skipped": True})
    for s in state.values():
        s.clear()
    return rows


def _row(label, spec, s, ms, ctx_len, first) -> dict:
    from kvbench.bench.workloads.latency import flush_period, held_bytes

    hb = s["held"]
    flushes = flush_steps(hb) if all(x is not None for x in hb) else []
    period, source = flush_period(s["cache"], s["q"], flushes)
    split = split_steps(ms, flushes, period)
    steady = [i for i in range(len(ms)) if i not in set(flushes)]
    attn = [s["attn"][i] for i in steady]
    model = s["model"]
    if hasattr(s["cache"], "layer_caches"):  # every stored tensor, held before the step
        nbytes = [int(hb[i] or 0) for i in steady]
    else:  # the full-precision K/V sdpa reads
        nbytes = [read_bytes(s["cache"], model, first + i) for i in steady]
    b_med = percentile(nbytes, 50) if nbytes else 0
    a_med = percentile(attn, 50) if attn else float("nan")
    lcs = getattr(s["cache"], "layer_caches", lambda: [])()
    paths = sorted({str(getattr(lc, "attend_path", None)) for lc in lcs if lc is not None})
    return {
        "context": ctx_len,
        "config": label,
        "method": spec[0],
        "method_config": spec[1],
        "kind": "kvbench" if lcs else "transformers",
        "attend_path": paths or None,
        "steps": len(ms),
        "steady_steps": len(steady),
        "median_ms": split.steady.median,
        "p90_ms": split.steady.p90,
        "p99_ms": split.steady.p99,
        "mean_ms": split.steady.mean,
        "flush_steps": len(flushes),
        "flush_ms_mean": split.flush.mean if split.flush else None,
        "amortized_ms": split.amortized_mean,
        "flush_period": period,
        "flush_period_source": source,
        "attn_ms": a_med,
        "bytes_read": int(b_med),
        "gbps": b_med / (a_med / 1e3) / 1e9 if a_med and math.isfinite(a_med) else None,
        "bytes_at_rest": held_bytes(s["cache"]),
        "step_ms": list(ms),
        "attn_step_ms": list(s["attn"]),
    }


# ------------------------------------------------------------------------------- targets, output
def evaluate_targets(rows: list[dict]) -> list[dict]:
    """Target rows ``{name, measured, ok}`` for the contexts and configurations present."""
    out = []
    got = {(r["context"], r["config"]): r for r in rows if not r.get("skipped")}

    def add(name: str, value: float | None, ok: bool | None, fmt: str = "{:.2f}x") -> None:
        measured = "-" if value is None else fmt.format(value)
        out.append({"name": name, "measured": measured, "ok": ok})

    ctx, lim = TARGET_ALL
    for (c, label), r in sorted(got.items()):
        if c == ctx and r["kind"] == "kvbench" and r.get("ratio_dynamic") is not None:
            add(f"T={c} {label} <= {lim}x dynamic", r["ratio_dynamic"], r["ratio_dynamic"] <= lim)
    ctx, lim, which = TARGET_MIXED
    for label in which:
        r = got.get((ctx, label))
        if r and r.get("ratio_dynamic") is not None:
            add(f"T={ctx} {label} <= {lim}x dynamic", r["ratio_dynamic"], r["ratio_dynamic"] <= lim)
    ctx, lim = TARGET_KIVI2
    r = got.get((ctx, "kivi-2"))
    if r and r.get("ratio_dynamic") is not None:
        add(f"T={ctx} kivi-2 <= {lim}x dynamic", r["ratio_dynamic"], r["ratio_dynamic"] <= lim)
    for (c, label), r in sorted(got.items()):
        if label == "kivi-2" and r.get("ratio_quanto2") is not None:
            add(f"T={c} kivi-2 < quanto2", r["ratio_quanto2"], r["ratio_quanto2"] < 1.0)
    for (c, label), r in sorted(got.items()):
        if r["kind"] == "kvbench" and r.get("pct_ref") is not None:
            pct = TARGET_BANDWIDTH * 100
            add(
                f"T={c} {label} attention read >= {pct:.0f}% of contiguous read",
                r["pct_ref"],
                r["pct_ref"] >= pct,
                "{:.1f}%",
            )
    return out


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return fmt.format(x)


HEADER = (
    "| config | attend path | median ms | p90 ms | p99 ms | flush n / amortized ms "
    "| /dynamic | /quanto2 | attn ms | MiB read | GB/s | ref GB/s | % ref |"
)


def table(rows: list[dict]) -> list[str]:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['config']} | {r['note']} |" + " |" * 11)
            continue
        path = ",".join(r["attend_path"]) if r["attend_path"] else "sdpa"
        lines.append(
            f"| {r['config']} | {path} | {_f(r['median_ms'])} | {_f(r['p90_ms'])} "
            f"| {_f(r['p99_ms'])} | {r['flush_steps']} / {_f(r['amortized_ms'])} "
            f"| {_f(r.get('ratio_dynamic'))} | {_f(r.get('ratio_quanto2'))} | {_f(r['attn_ms'])} "
            f"| {_f(r['bytes_read'] / 2**20, '{:.1f}')} | {_f(r.get('gbps'), '{:.1f}')} "
            f"| {_f(r.get('ref_gbps'), '{:.1f}')} | {_f(r.get('pct_ref'), '{:.0f}')} |"
        )
    return lines


def render_markdown(res: dict) -> str:
    lines = ["# Decode step, every cache side by side", ""]
    lines += [f"- {k}: {v}" for k, v in res["env"].items()]
    lines.append("")
    for ctx in res["contexts"]:
        rows = [r for r in res["rows"] if r["context"] == ctx]
        if not rows:
            continue
        r0 = next((r for r in rows if not r.get("skipped")), {})
        lines += [
            f"## Context {ctx}",
            "",
            f"threads {r0.get('threads')}, load average before {r0.get('loadavg_before')}, "
            f"after {r0.get('loadavg_after')}",
            "",
            *table(rows),
            "",
        ]
    if res["targets"]:
        lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        for t in res["targets"]:
            met = "yes" if t["ok"] else "**no**"
            lines.append(f"| {t['name']} | {t['measured']} | {met} |")
        lines.append("")
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def tiny_model():
    """A random 2-layer Llama (hidden 128, 4 query / 2 KV heads of 64) for smoke tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=256,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(cfg).eval(), {"model_id": "tiny random Llama (2 layers)"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--steps", type=int, default=24, help="timed rounds (>= 20 for results)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads of the timed decode steps")
    ap.add_argument(
        "--prefill-threads", type=int, default=os.cpu_count(), help="threads of the prefills"
    )
    ap.add_argument("--ref-reps", type=int, default=20, help="samples of each contiguous read")
    ap.add_argument("--configs", nargs="+", default=None, help="configurations (default: all)")
    ap.add_argument("--model", default=None, help="model spec (default: kvbench's default)")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer Llama (smoke tests)")
    ap.add_argument("--quick", action="store_true", help="smoke check: T=160, 4 steps, 6 configs")
    ap.add_argument(
        "--cpu-attention",
        default=None,
        help="kvbench CPU attention mode (kvbench.kernels.cpu.codedomain.MODES; default: its own, "
        "$KVBENCH_CPU_ATTENTION or auto; --tiny: eager)",
    )
    ap.add_argument("--out", type=Path, default=Path("results/decode_step"))
    args = ap.parse_args(argv)
    if args.tiny and args.cpu_attention is None:
        args.cpu_attention = "eager"
    if args.quick:
        args.contexts, args.steps, args.warmup, args.ref_reps = [160], 4, 1, 3
        args.configs = args.configs or list(QUICK)
    if args.steps < 1 or args.warmup < 0 or min(args.contexts) <= args.steps + args.warmup:
        raise SystemExit("need --steps >= 1, --warmup >= 0 and every context > warmup + steps")
    labels = configurations(args.configs)

    from kvbench.hf.attention import use_kvbench_attention
    from kvbench.hf.info import model_info
    from kvbench.hf.models import DEFAULT_MODEL, load_model

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.tiny:
        model, info = tiny_model()
    else:
        model, _, info = load_model(args.model or DEFAULT_MODEL, dtype="float32")
    info = {**info, **model_info(model)}
    use_kvbench_attention(model)
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["benchmarks/decode_step.py", *(argv or sys.argv[1:])]),
        "model": info.get("model_id"),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": args.threads,
        "prefill_threads": args.prefill_threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "timing": Timer("cpu").how + ", interleaved rounds in rotating order",
        "percentiles": PERCENTILE_RULE,
        **{k: v for k, v in system_state().items() if k != "threads"},
    }
    res: dict[str, Any] = {"env": env, "contexts": args.contexts, "rows": [], "targets": []}
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    from kvbench.kernels.cpu import codedomain as cpu_attention

    env["cpu_attention"] = args.cpu_attention or cpu_attention.cpu_mode()
    mode = (
        cpu_attention.cpu_attention_mode(args.cpu_attention)
        if args.cpu_attention
        else contextlib.nullcontext()
    )
    for ctx_len in args.contexts:
        log(f"context {ctx_len}:")
        with mode:
            rows = run_context(model, info, labels, ctx_len, args, log)
        res["rows"] += rows
        res["targets"] = evaluate_targets(res["rows"])
        _write(json_path, json.dumps(res, indent=1))
        _write(md_path, render_markdown(res))
        print(f"\ncontext {ctx_len}, threads {rows[0].get('threads')}, load average "
              f"{rows[0].get('loadavg_before')} -> {rows[0].get('loadavg_after')}")  # fmt: skip
        print("\n".join(table(rows)), flush=True)
    if res["targets"]:
        print("\ntargets:")
        for t in res["targets"]:
            print(f"  {'ok  ' if t['ok'] else 'MISS'} {t['name']}: {t['measured']}")
    print(f"\nwrote {json_path} and {md_path}")
    return res


if __name__ == "__main__":
    main()
