"""Per-layer decode attention of the fused native call against the per-block path it replaces.

Command (1 thread; results are only comparable within one run)::

    .venv/bin/python benchmarks/fused_layer.py --tokens 4096 --head-dim 64 --rounds 40

One layer of the default model's shape (batch 1, 3 KV heads, 9 query heads: GQA 3), random
keys and values prefilled to ``--tokens`` tokens, per configuration: ``call`` (the native
:func:`kvbench.kernels.cpu.native.attend_fused` alone), ``parts``
(:func:`kvbench.kernels.cpu.codedomain.fused_parts`), ``new`` (``LayerCache.attend``: dispatch,
parts and call), ``old`` (the same with the fused path turned off: the per-block native kernels
and a torch softmax), timed alternately in ``--rounds`` rounds (3 untimed first); medians in
microseconds and ``new / old``; then ``append`` (one token appended and flushed).  The load
average is printed before and after (docs/results/decode-step.md, "Fused KIVI").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import kvbench
from kvbench.kernels.cpu import codedomain as cpu
from kvbench.kernels.cpu import native

CONFIGS = {
    "full": ("full", {}),
    "int4-block": ("int4-block", {}),
    "int8-block": ("int8-block", {}),
    "kivi": ("kivi", {}),
    "kivi-2": (
        "kivi",
        dict(bits=2, value_bits=2, group_size=128, residual_length=128, value_group_size=64),
    ),
}
HKV, HQ = 3, 9


def _rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median microseconds of each of ``fns``, called in turn ``rounds`` times (after 3)."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds + 3):
        for k, fn in fns.items():
            t0 = time.perf_counter_ns()
            fn()
            if r >= 3:
                ts[k].append((time.perf_counter_ns() - t0) / 1e3)
    return {k: statistics.median(v) for k, v in ts.items()}


def run(name: str, tokens: int, d: int, rounds: int, g: torch.Generator) -> str:
    """One configuration's line."""
    meth, cfg = CONFIGS[name]
    lc = kvbench.get_method(meth, **cfg).new_layer(0, HKV, d)
    k = torch.randn(1, HKV, tokens, d, generator=g)
    v = torch.randn(1, HKV, tokens, d, generator=g)
    lc.prefill(k[:, :, :-1], v[:, :, :-1])
    lc.append(k[:, :, -1:], v[:, :, -1:])
    lc.end_step()
    q = torch.randn(1, HQ, 1, d, generator=g)
    parts = cpu.fused_parts(lc, q)
    real = cpu.fused_parts
    fns: dict[str, Callable[[], object]] = {}
    if not isinstance(parts, str):
        qs = (q / d**0.5).reshape(1, HKV, HQ // HKV, d).contiguous()
        o = torch.empty_like(qs)
        fns["call"] = lambda: native.attend_fused(parts, qs, 1, o)
        fns["parts"] = lambda: real(lc, q)
        fns["new"] = lambda: lc.attend(q)

    def old() -> None:
        cpu.fused_parts = lambda *a: "turned off"
        try:
            lc.attend(q)
        finally:
            cpu.fused_parts = real

    fns["old"] = old
    med = _rounds(fns, rounds)
    lc.attend(q)
    path = lc.attend_path
    k1, v1 = torch.randn(1, HKV, 1, d, generator=g), torch.randn(1, HKV, 1, d, generator=g)
    med |= _rounds({"append": lambda: (lc.append(k1, v1), lc.end_step())}, min(rounds, 20))
    ratio = med.get("new", med["old"]) / med["old"]
    cols = " ".join(f"{k}={v:.0f}" for k, v in med.items())
    mib = lc.nbytes()["total"] / 2**20
    return f"{name:11s} {mib:6.2f} MiB  {path:17s} {cols} us  new/old={ratio:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64, choices=native.FUSED_HEAD_DIMS)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"tokens={args.tokens} head_dim={args.head_dim} rounds={args.rounds} threads=1 "
          f"isa={native.fused_isa()} load={os.getloadavg()}")  # fmt: skip
    for name in args.configs:
        print(run(name, args.tokens, args.head_dim, args.rounds, g), flush=True)
    print(f"load={os.getloadavg()}")


if __name__ == "__main__":
    main()
