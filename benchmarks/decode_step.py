"""Decode-step latency at a long context on the CPU, every cache interleaved in one run.

Caches (names for ``--caches``):

* ``dynamic``: transformers ``DynamicCache`` (full precision; the baseline of the ratios);
* ``quanto2`` / ``quanto4``: transformers ``QuantizedCache(backend="quanto", nbits=2|4)``
  (needs ``optimum-quanto``; skipped with a note otherwise);
* ``kivi-reference``: kvbench KIVI through ``QuantizedKVCache(attend=False)``: ``update``
  returns the dequantized cache and sdpa attends to it (the fidelity path);
* ``kivi-eager``: ``attend=True``, code-domain attention without compilation
  (``KVBENCH_CPU_ATTENTION=eager``);
* ``kivi-fast``: ``attend=True``, code-domain attention with the ``torch.compile`` kernels
  (``compiled``).

KIVI settings: 2-bit keys per channel in groups of G = 128 tokens, 2-bit values per token in
groups of 64 channels, residual R = 128, float16 scales (``--bits`` changes both widths).

Protocol (design.md §6): one model (default SmolLM2-135M, float32, ``attn_implementation=
"kvbench"``, which is plain sdpa for caches other than kvbench's), ``--threads`` CPU threads
(default 2); each cache is prefilled with the same ``--context`` random tokens (seeded), runs
``--warmup`` decode steps (compilation happens there), then ``--steps`` rounds in which every
cache decodes one greedy token, in a rotating order; each step is timed with
``time.perf_counter_ns`` around the model call and the argmax.  Reported: median / p90 per
cache, ratios of medians to ``dynamic`` and ``quanto2``, bytes at rest, the load average
before and after.  ``--profile NAMES`` adds ``torch.profiler`` tables of 5 steps of those caches.

On a busy machine, 2 threads that spin-wait at OpenMP barriers turn every step into scheduling
noise (seconds per step); ``OMP_WAIT_POLICY=PASSIVE`` (recorded in the results) keeps the
numbers sane there, at some cost on an idle machine.

Run: ``.venv/bin/python benchmarks/decode_step.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

CACHES = ("dynamic", "quanto2", "quanto4", "kivi-reference", "kivi-eager", "kivi-fast")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_cache(name: str, model, bits: int):
    """``(cache, cpu_attention_mode or None)`` for cache ``name`` (``None`` when unavailable)."""
    from transformers import DynamicCache, QuantizedCache

    from kvbench.hf.cache import QuantizedKVCache

    if name == "dynamic":
        return DynamicCache(config=model.config), None
    if name.startswith("quanto"):
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            return None, None
        return QuantizedCache(backend="quanto", config=model.config, nbits=int(name[-1])), None
    cfg = dict(bits=bits, value_bits=bits, group_size=128, residual_length=128)
    cfg |= dict(value_group_size=64, scale_dtype="float16")
    mode = {"kivi-reference": None, "kivi-eager": "eager", "kivi-fast": "compiled"}[name]
    return QuantizedKVCache("kivi", model, method_config=cfg, attend=mode is not None), mode


def cache_bytes(cache) -> int | None:
    """Bytes at rest: kvbench's ``nbytes()``; K/V tensors of a ``DynamicCache``."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes().get("total")
    total = 0
    for layer in getattr(cache, "layers", []):
        if type(layer).__name__ != "DynamicLayer":
            return None
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
    return total


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model spec (default: kvbench's default)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--caches", default="dynamic,quanto2,kivi-reference,kivi-eager,kivi-fast")
    ap.add_argument("--profile", default=None, help="caches (comma-separated) to profile")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    from kvbench.attend import cpu as fastpath
    from kvbench.hf.attention import use_kvbench_attention
    from kvbench.hf.cache import cache_kwarg
    from kvbench.hf.models import DEFAULT_MODEL, load_model

    model, _, info = load_model(args.model or DEFAULT_MODEL)
    use_kvbench_attention(model)
    kw = lambda c: cache_kwarg(c, model)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(100, vocab, (1, args.context), generator=gen)
    load_before = _load()
    print(f"model {info['model_id']}, threads {args.threads}, context {args.context}, "
          f"load {load_before}", flush=True)  # fmt: skip

    state = {}
    with torch.inference_mode():
        for name in args.caches.split(","):
            cache, mode = make_cache(name, model, args.bits)
            if cache is None:
                print(f"{name}: skipped (optimum-quanto is not installed)")
                continue
            t0 = time.perf_counter()
            out = model(input_ids=prompt, logits_to_keep=1, **kw(cache))
            nxt = out.logits[:, -1:].argmax(-1)
            print(f"{name}: prefill {time.perf_counter() - t0:.1f} s", flush=True)
            state[name] = {"cache": cache, "mode": mode, "next": nxt, "times": []}

        def step(name: str) -> int:
            s = state[name]
            ctx = fastpath.cpu_attention_mode(s["mode"] or "reference")
            with ctx:
                t0 = time.perf_counter_ns()
                out = model(input_ids=s["next"], logits_to_keep=1, **kw(s["cache"]))
                s["next"] = out.logits[:, -1:].argmax(-1)
                return time.perf_counter_ns() - t0

        names = list(state)
        for name in names:
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                step(name)
            print(f"{name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        for i in range(args.steps):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                state[name]["times"].append(step(name) / 1e6)

        for name in (args.profile or "").split(","):
            if name not in state:
                continue
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step(name)
            print(f"profile of 5 steps of {name}:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    load_after = _load()
    res = {"model": info["model_id"], "threads": args.threads, "context": args.context,
           "steps": args.steps, "bits": args.bits, "load_before": load_before,
           "load_after": load_after, "torch": torch.__version__,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "caches": {}}  # fmt: skip
    for name, s in state.items():
        t = sorted(s["times"])
        lc = getattr(s["cache"], "layer_caches", lambda: [])()
        res["caches"][name] = {
            "median_ms": statistics.median(t),
            "p90_ms": t[min(len(t) - 1, int(0.9 * len(t)))],
            "min_ms": t[0],
            "bytes": cache_bytes(s["cache"]),
            "attend_path": getattr(lc[0], "attend_path", None) if lc else None,
        }
    for base in ("dynamic", "quanto2"):
        if base in res["caches"]:
            b = res["caches"][base]["median_ms"]
            for c in res["caches"].values():
                c[f"ratio_to_{base}"] = c["median_ms"] / b
    print(f"load before {load_before}, after {load_after}")
    print(f"{'cache':16} {'median ms':>10} {'p90 ms':>8} {'/dynamic':>9} {'/quanto2':>9} "
          f"{'MB':>7}  path")  # fmt: skip
    for name, c in res["caches"].items():
        mb = "-" if c["bytes"] is None else f"{c['bytes'] / 2**20:.1f}"
        print(f"{name:16} {c['median_ms']:10.1f} {c['p90_ms']:8.1f} "
              f"{c.get('ratio_to_dynamic', float('nan')):9.2f} "
              f"{c.get('ratio_to_quanto2', float('nan')):9.2f} {mb:>7}  {c['attend_path']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
