"""Batched evaluation with left padding: GSM8K throughput and decode-step latency at batch 8 vs 1.

Command (on an idle machine; ratios are only comparable within one run; GSM8K from the local
data folder)::

    KVBENCH_DATA_DIR=<data folder> OMP_WAIT_POLICY=PASSIVE \\
        .venv/bin/python benchmarks/batched_eval.py --threads 2 --out results/batched_eval

writes ``results/batched_eval.json`` and ``.md`` (rewritten atomically after every measurement,
so an interrupted run keeps what it finished) and prints both tables.  Small arguments make a
smoke check (``--examples 2 --new-tokens 4 --context 96 --steps 3 --warmup 1``).

GSM8K throughput (the ``gsm8k`` workload, kvbench.bench.workloads.gsm8k: 8-shot prompts, greedy,
``--new-tokens`` budget, stop strings and EOS as the workload defines them): the first
``--examples`` (8) test problems on the default model (SmolLM2-135M-Instruct, float32, CPU,
``--threads`` 2), for ``full`` and ``kivi-2`` (KIVI 2-bit keys and values: per-channel keys in
groups of G = 128 tokens, per-token values in groups of 64 channels, R = 128, float16 scales;
arXiv:2402.02750 §3) at ``batch_size`` 1 and 8, each timed ``--repeats`` times in rotating order
(round i starts at configuration i mod 4).  ``examples/s`` = examples / median wall time of
``Workload.run``; the ratio batch 8 / batch 1 per method.  The per-example completions of the two
batch sizes are compared (``same completions``): left padding caches each row alone
(docs/design.md#padding), so they agree up to float32 noise.  Target: the batched run is not
slower (ratio >= 1) for both methods.

Decode-step latency (the ``latency`` workload, kvbench.bench.workloads.latency: interleaved with the
``full`` baseline, steady-state steps apart from flush steps): ``full``, ``kivi-2`` and
``pn-mix`` at ``--context`` (1024) for batch 1 and batch 8, unpadded (every row ``--context``
deep) and left-padded (rows of different lengths); ``decode_ms_p50`` per batch step, ms per
token (step / B), and the batch-8 step over the batch-1 step.  Reported, no target.
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

from kvbench.bench.context import RunContext

KIVI2 = dict(
    bits=2, value_bits=2, group_size=128, value_group_size=64, residual_length=128,
    scale_dtype="float16",
)  # fmt: skip
METHODS = {"full": ("full", {}), "kivi-2": ("kivi", KIVI2), "pn-mix": ("pn-mix", {})}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _method(label: str):
    from kvbench.cache.registry import get_method

    name, cfg = METHODS[label]
    m = get_method(name, **cfg)
    m.name = m.name or name
    return m


def gsm8k_throughput(ctx: RunContext, args: argparse.Namespace, out: list, save) -> None:
    from kvbench.bench.workloads import WORKLOADS

    cls = WORKLOADS.get("gsm8k")
    configs = [(m, bs) for m in ("full", "kivi-2") for bs in (1, 8)]
    work = {}
    for m, bs in configs:
        spec = cls.validate(
            {"type": "gsm8k", "max_examples": args.examples, "new_tokens": args.new_tokens,
             "batch_size": bs}
        )  # fmt: skip
        w = cls(spec)
        w.prepare(ctx)
        work[(m, bs)] = w
    secs: dict[tuple, list[float]] = {c: [] for c in configs}
    rows: dict[tuple, Any] = {}
    for r in range(args.repeats):
        for i in range(len(configs)):
            c = configs[(i + r) % len(configs)]
            t = time.perf_counter()
            res = work[c].run(ctx, _method(c[0]))
            secs[c].append(time.perf_counter() - t)
            rows[c] = res
    for m in ("full", "kivi-2"):
        one, eight = rows[(m, 1)], rows[(m, 8)]
        eps = {bs: args.examples / statistics.median(secs[(m, bs)]) for bs in (1, 8)}
        same = sum(
            a["completion"] == b["completion"]
            for a, b in zip(one.per_layer["examples"], eight.per_layer["examples"])
        )
        out.append(
            {
                "method": m,
                "examples": args.examples,
                "seconds_b1": secs[(m, 1)],
                "seconds_b8": secs[(m, 8)],
                "examples_per_s_b1": eps[1],
                "examples_per_s_b8": eps[8],
                "ratio_b8_b1": eps[8] / eps[1],
                "same_completions": f"{same}/{args.examples}",
                "accuracy_b1": one.metrics.get("task_score"),
                "accuracy_b8": eight.metrics.get("task_score"),
                "padding_b8": eight.info.get("padding"),
                "target_met": eps[8] >= eps[1],
            }
        )
        save()


def decode_latency(ctx: RunContext, args: argparse.Namespace, out: list, save) -> None:
    from kvbench.bench.workloads.latency import Latency

    for padding in ("none", "left"):
        for m in ("full", "kivi-2", "pn-mix"):
            step = {}
            for bs in (1, 8):
                if padding == "left" and bs == 1:
                    continue
                w = Latency(
                    Latency.validate(
                        {"type": "latency", "context": args.context, "steps": args.steps,
                         "warmup": args.warmup, "prefill_repeats": 1, "batch_size": bs,
                         "padding": padding}
                    )
                )  # fmt: skip
                w.prepare(ctx)
                res = w.run(ctx, _method(m))
                step[bs] = res
            prior = next((o for o in out if o["method"] == m and o["padding"] == "none"), None)
            p50_1 = step[1].metrics["decode_ms_p50"] if 1 in step else prior["step_ms_b1"]
            p50_8 = step[8].metrics["decode_ms_p50"]
            out.append(
                {
                    "method": m,
                    "padding": padding,
                    "context": args.context,
                    "step_ms_b1": p50_1,
                    "step_ms_b8": p50_8,
                    "ms_per_token_b8": p50_8 / 8,
                    "step_ratio_b8_b1": p50_8 / p50_1,
                    "step_ratio_to_full_b8": step[8].metrics.get("decode_ms_p50_ratio"),
                    "pad_tokens_b8": step[8].info["batch"]["pad_tokens"],
                    "pad_tokens_stored_b8": step[8].info["batch"]["pad_tokens_stored"],
                    "bytes_total_b8": step[8].metrics.get("bytes_total"),
                    "b1_from": "this run" if 1 in step else "the unpadded batch-1 run above",
                }
            )
            save()


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# Batched evaluation ({res['model']}, {res['threads']} threads, "
        f"load {res['load_before']} -> {res.get('load_after')})",
        "",
        "## GSM8K throughput (examples/s)",
        "",
        "| method | batch 1 | batch 8 | ratio | same completions | pad tokens (b8) | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res.get("gsm8k", []):
        pad = (r.get("padding_b8") or {}).get("pad_tokens")
        lines.append(
            f"| {r['method']} | {r['examples_per_s_b1']:.3f} | {r['examples_per_s_b8']:.3f} | "
            f"{r['ratio_b8_b1']:.2f} | {r['same_completions']} | {pad} | "
            f"{'met' if r['target_met'] else 'MISSED'} |"
        )
    lines += [
        "",
        f"## Decode step (p50 ms per batch step, context {res['args']['context']})",
        "",
        "| method | padding | batch 1 | batch 8 | ms/token b8 | b8/b1 | b8 / full | pads (stored) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res.get("latency", []):
        lines.append(
            f"| {r['method']} | {r['padding']} | {r['step_ms_b1']:.2f} | {r['step_ms_b8']:.2f} | "
            f"{r['ms_per_token_b8']:.2f} | {r['step_ratio_b8_b1']:.2f} | "
            f"{r['step_ratio_to_full_b8']:.2f} | {r['pad_tokens_b8']} "
            f"({r['pad_tokens_stored_b8']}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256, help="GSM8K generation budget")
    ap.add_argument("--repeats", type=int, default=1, help="timed GSM8K rounds per config")
    ap.add_argument("--context", type=int, default=1024, help="decode-latency context")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", choices=["gsm8k", "latency"], default=None)
    ap.add_argument("--out", type=Path, default=Path("results/batched_eval"))
    args = ap.parse_args(argv)

    from kvbench.hf.attention import register
    from kvbench.hf.models import load_model

    torch.set_num_threads(args.threads)
    model, tok, info = load_model(attn_implementation=register())
    ctx = RunContext(model=model, tokenizer=tok, model_info=info, seed=0)
    res: dict[str, Any] = {
        "model": info.get("model_id"),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")

    def save() -> None:
        _write(json_path, json.dumps(res, indent=1, default=str))
        _write(md_path, markdown(res))

    with torch.no_grad():
        if args.skip != "gsm8k":
            res["gsm8k"] = []
            gsm8k_throughput(ctx, args, res["gsm8k"], save)
        if args.skip != "latency":
            res["latency"] = []
            decode_latency(ctx, args, res["latency"], save)
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    save()
    print(markdown(res))
    print(f"wrote {json_path} and {md_path}")
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
