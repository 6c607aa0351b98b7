"""llama.cpp's own decode speed with a quantized KV cache against its f16 cache, beside kvbench's
step ratios for the caches that emulate it: the speed table of docs/results/llama-cpp-crosscheck.md.

Two outside figures, both from llama.cpp's own tools on this machine:

* ``llama-bench`` (``tools/llama-bench``): tokens per second of ``-n`` generated tokens after a
  prefill of ``-d`` tokens (``-p 0``), flash attention on (``-fa 1``: llama.cpp quantizes V only
  under it), cache types ``-ctk T -ctv T`` for T in f16, q8_0, q4_0.  The cache types run in
  interleaved rounds: round r runs every type once (rotating which goes first), one
  ``llama-bench -r REPS`` per (type, depth) with every thread count of ``--threads`` in that
  call (llama-bench prefills the depth once per call, with the first thread count, and restores
  that state before each repetition and for the later thread counts); repetition i of round r
  is sample ``r * REPS + i``, paired with f16's sample of the same number.  A step's
  time is ``1 / tg t/s``; the ratio quantized / f16 is the median over rounds of the
  quantized type's step over the median of f16's, with a paired percentile bootstrap 95%
  interval over the rounds (:func:`kvbench.bench.metrics.paired_ratio_ci`, the latency
  workload's own).
* ``test-backend-ops perf -o FLASH_ATTN_EXT``: llama.cpp's flash-attention op alone, at the
  shapes its test list holds; the rows whose K/V type is f16, q8_0 or q4_0 and whose other
  parameters match are set side by side (``--ops-params`` is the ``-p`` regex choosing the shapes).

kvbench's side comes from ``benchmarks/decode_step.py`` JSON outputs (``--kvbench FILE ...``,
one per thread count) with the configurations ``full-fp16``, ``int8-block-llama`` and
``int4-block-llama`` (q8_0 / q4_0 blocks as llama.cpp deploys them, K/V in float16 for the
16-bit row): the same paired median ratio over its interleaved rounds.

Command (paths to the built tools and the F32 GGUF that ``benchmarks/llama_cpp_kl.py
--write-f32-gguf`` writes; docs/results/llama-cpp-crosscheck.md builds them)::

    python benchmarks/llama_cpp_speed.py --bench build/bin/llama-bench \\
        --backend-ops build/bin/test-backend-ops --model SmolLM2-135M-Instruct.F32.gguf \\
        --depths 1024 4096 8192 --threads 2 1 --rounds 2 --reps 3 \\
        --kvbench results/decode_step_t1.json results/decode_step_t2.json \\
        --out results/llama_cpp_speed

writes ``--out``.json (every sample, the machine state, the commands) and ``--out``.md (the
tables), and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.bench.metrics import paired_ratio_ci

#: llama.cpp cache types, the 16-bit baseline first
CACHE_TYPES = ("f16", "q8_0", "q4_0")
#: kvbench's decode_step configuration for each llama.cpp cache type
KVBENCH_CONFIG = {"f16": "full-fp16", "q8_0": "int8-block-llama", "q4_0": "int4-block-llama"}


def bench_command(
    binary: str,
    model: str,
    ctype: str,
    depth: int,
    threads: Sequence[int],
    n_gen: int,
    reps: int = 1,
) -> list[str]:
    """The ``llama-bench`` command line of one (cache type, depth) call: ``reps`` timed
    generations, each from the same prefilled depth (llama-bench prefills once per call and
    restores that state before every repetition)."""
    return [
        binary, "-m", model, "-ctk", ctype, "-ctv", ctype, "-fa", "1", "-p", "0",
        "-n", str(n_gen), "-d", str(depth), "-t", ",".join(map(str, threads)), "-r", str(reps),
        "-o", "json",
    ]  # fmt: skip


def parse_bench(stdout: str) -> list[dict]:
    """``[{"threads", "depth", "type_k", "type_v", "n_gen", "rep", "tg_ts", "ns"}]`` of
    llama-bench's ``-o json`` output (a JSON list of test objects), one entry per repetition:
    ``samples_ts`` / ``samples_ns`` (tokens per second, the whole generation's ns) of each
    repetition where the object has them, else its ``avg_ts`` / ``avg_ns`` as repetition 0.
    ``ValueError`` when the output holds no JSON list."""
    start, end = stdout.find("["), stdout.rfind("]")
    if start < 0 or end < start:
        raise ValueError(f"llama-bench printed no JSON list: {stdout[:200]!r}")
    out = []
    for t in json.loads(stdout[start : end + 1]):
        ts = t.get("samples_ts") or [t["avg_ts"]]
        ns = t.get("samples_ns") or [t["avg_ns"]]
        if len(ts) != len(ns):
            raise ValueError(
                f"llama-bench samples_ts ({len(ts)}) and samples_ns ({len(ns)}) differ"
            )
        out += [
            {
                "threads": int(t["n_threads"]),
                "depth": int(t["n_depth"]),
                "type_k": t["type_k"],
                "type_v": t["type_v"],
                "n_gen": int(t["n_gen"]),
                "rep": i,
                "tg_ts": float(a),
                "ns": int(b),
            }
            for i, (a, b) in enumerate(zip(ts, ns, strict=True))
        ]
    return out


def ratio_row(method_ms: Sequence[float], base_ms: Sequence[float], seed: int = 0) -> dict:
    """``{"ratio", "ci_low", "ci_high", "rounds"}``: median(method) / median(base) over paired
    rounds, with :func:`paired_ratio_ci`'s interval (``None`` bounds for one round)."""
    if len(method_ms) != len(base_ms):
        raise ValueError(f"unpaired rounds: {len(method_ms)} against {len(base_ms)}")
    ratio = statistics.median(method_ms) / statistics.median(base_ms)
    ci = paired_ratio_ci(method_ms, base_ms, seed=seed)
    return {
        "ratio": ratio,
        "ci_low": None if ci is None else ci[0],
        "ci_high": None if ci is None else ci[1],
        "rounds": len(method_ms),
    }


def llama_ratios(samples: list[dict]) -> dict[tuple[int, int, str], dict]:
    """``(depth, threads, type) -> ratio_row`` of each quantized type's step (``1e3 / tg_ts``
    ms per token) against f16's, paired by round (``samples`` carry ``round``)."""
    steps: dict[tuple[int, int, str], dict[int, float]] = {}
    for s in samples:
        steps.setdefault((s["depth"], s["threads"], s["type_k"]), {})[s["round"]] = 1e3 / s["tg_ts"]
    out = {}
    for (depth, threads, ctype), by_round in sorted(steps.items()):
        base = steps.get((depth, threads, "f16"), {})
        rounds = sorted(set(by_round) & set(base))
        if ctype == "f16" or not rounds:
            continue
        out[(depth, threads, ctype)] = ratio_row(
            [by_round[r] for r in rounds], [base[r] for r in rounds]
        ) | {"ms": statistics.median(by_round[r] for r in rounds),
             "base_ms": statistics.median(base[r] for r in rounds)}  # fmt: skip
    return out


def kvbench_ratios(doc: dict) -> dict[tuple[int, int, str], dict]:
    """``(context, threads, llama.cpp type) -> ratio_row`` from one decode_step.py JSON: the
    per-round step times (``step_ms``, interleaved rounds) of the configuration emulating each
    quantized type against ``full-fp16``'s."""
    threads = int(doc["env"]["threads"])
    rows = {(r["context"], r["config"]): r for r in doc["rows"] if r.get("step_ms")}
    out = {}
    for ctype in CACHE_TYPES[1:]:
        for context in doc["contexts"]:
            q, b = rows.get((context, KVBENCH_CONFIG[ctype])), rows.get((context, "full-fp16"))
            if q is None or b is None:
                continue
            n = min(len(q["step_ms"]), len(b["step_ms"]))
            out[(context, threads, ctype)] = ratio_row(q["step_ms"][:n], b["step_ms"][:n]) | {
                "ms": q["median_ms"],
                "base_ms": b["median_ms"],
            }
    return out


#: one row of ``test-backend-ops perf`` output, e.g. ``FLASH_ATTN_EXT(hsk=64,hsv=64,nh=8,
#: nr23=[8,1],kv=7680,...,type_K=q4_0,type_V=q4_0,...):   1234 runs -    12.34 us/run - ...``
PERF_LINE = re.compile(r"^\s*FLASH_ATTN_EXT\((?P<params>.*)\):\s+(?P<runs>\d+) runs -\s+"
                       r"(?P<us>[0-9.]+) us/run")  # fmt: skip
#: one ``name=value`` of a test's parameters (a value may be a bracketed list with commas)
PARAM = re.compile(r"(\w+)=(\[[^\]]*\]|[^,]*)")
#: the FLASH_ATTN_EXT cases of ``test-backend-ops perf`` that exist for f16, q8_0 and q4_0 alike
#: (a decode step: one query row per head, GQA 8, 7680 keys of 64 channels)
OPS_PARAMS = r"^hsk=64,hsv=64,nh=8,nr23=\[8,1\],kv=7680,nb=1,"


def parse_backend_ops(stdout: str) -> list[dict]:
    """``[{"params": {name: value}, "us": float, "runs": int}]`` of the FLASH_ATTN_EXT rows of
    ``test-backend-ops perf`` (a row printed "not supported" has no time and is left out)."""
    out = []
    for line in stdout.splitlines():
        m = PERF_LINE.match(line)
        if m:
            params = dict(PARAM.findall(m["params"]))
            out.append({"params": params, "us": float(m["us"]), "runs": int(m["runs"])})
    return out


def op_ratios(rows: list[dict]) -> list[dict]:
    """Each row whose K and V types are both q8_0 or both q4_0 beside the f16 row whose other
    parameters are equal: ``[{"shape": str, "type": str, "us", "f16_us", "ratio": float}]``."""

    def key(p: dict) -> tuple:
        return tuple(sorted((k, v) for k, v in p.items() if k not in ("type_K", "type_V")))

    def kv_type(p: dict) -> str | None:
        return p.get("type_K") if p.get("type_K") == p.get("type_V") else None

    f16 = {key(r["params"]): r["us"] for r in rows if kv_type(r["params"]) == "f16"}
    out = []
    for r in rows:
        t = kv_type(r["params"])
        if t in CACHE_TYPES[1:] and key(r["params"]) in f16:
            base = f16[key(r["params"])]
            p = r["params"]
            shape = f"hsk={p.get('hsk')} nh={p.get('nh')} nr23={p.get('nr23')} kv={p.get('kv')} nb={p.get('nb')}"
            out.append({"shape": shape, "type": t, "us": r["us"], "f16_us": base,
                        "ratio": r["us"] / base})  # fmt: skip
    return out


def fmt(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["ci_low"] is None:
        return f"{r['ratio']:.2f}"
    return f"{r['ratio']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def markdown(doc: dict) -> str:
    """The speed tables of docs/results/llama-cpp-crosscheck.md from this tool's JSON."""
    llama = {tuple(json.loads(k)): v for k, v in doc["llama_ratios"].items()}
    kvb = {tuple(json.loads(k)): v for k, v in doc["kvbench_ratios"].items()}
    lines = [
        "| depth | threads | llama.cpp f16 ms/token | llama.cpp q8_0 / f16 | kvbench int8-block "
        "(as llama.cpp) / full fp16 | llama.cpp q4_0 / f16 | kvbench int4-block (as llama.cpp) "
        "/ full fp16 | at or below llama.cpp |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({k[:2] for k in llama} | {k[:2] for k in kvb})
    for depth, threads in keys:
        lq8, lq4 = llama.get((depth, threads, "q8_0")), llama.get((depth, threads, "q4_0"))
        kq8, kq4 = kvb.get((depth, threads, "q8_0")), kvb.get((depth, threads, "q4_0"))
        base = lq8 or lq4
        base_ms = "-" if base is None else f"{base['base_ms']:.2f}"
        verdict = []
        for name, k, ll in (("q8_0", kq8, lq8), ("q4_0", kq4, lq4)):
            if k is not None and ll is not None:
                verdict.append(f"{name} {'yes' if k['ratio'] <= ll['ratio'] else 'no'}")
        lines.append(
            f"| {depth} | {threads} | {base_ms} "
            f"| {fmt(lq8)} | {fmt(kq8)} | {fmt(lq4)} | {fmt(kq4)} | {', '.join(verdict) or '-'} |"
        )
    out = "\n".join(lines) + "\n"
    if doc.get("op_ratios"):
        out += "\n| FLASH_ATTN_EXT shape | K/V type | us/run | f16 us/run | ratio |\n"
        out += "|---|---|---|---|---|\n"
        for r in doc["op_ratios"]:
            out += f"| {r['shape']} | {r['type']} | {r['us']:.2f} | {r['f16_us']:.2f} | {r['ratio']:.2f} |\n"  # noqa: E501
    return out


def machine_state() -> dict:
    from kvbench.measure.timer import system_state

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(sys.argv),
        "platform": platform.platform(),
        **system_state(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", help="llama-bench binary")
    ap.add_argument("--backend-ops", help="test-backend-ops binary (the op table)")
    ap.add_argument("--ops-params", default=OPS_PARAMS, help="test-backend-ops -p regex")
    ap.add_argument("--model", help="GGUF (the F32 copy of the default model)")
    ap.add_argument("--depths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--reps",
        type=int,
        default=1,
        help="timed generations per llama-bench call (one prefill per call); samples of round r, "
        "repetition i pair as round r * reps + i",
    )
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--kvbench", nargs="*", default=[], help="decode_step.py JSON outputs")
    ap.add_argument(
        "--samples-from",
        help="this tool's JSON of an earlier run: tabulate its llama.cpp samples and op rows "
        "(and its machine state) beside --kvbench instead of running llama.cpp again",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    state = machine_state()
    samples: list[dict] = []
    commands: list[list[str]] = []
    ops: list[dict] = []
    if args.samples_from:
        if args.bench or args.backend_ops:
            ap.error(
                "--samples-from tabulates an earlier run: give it without --bench/--backend-ops"
            )
        prev = json.loads(Path(args.samples_from).read_text())
        samples, commands, ops, state = (
            prev["samples"],
            prev["commands"],
            prev["op_rows"],
            prev["env"],
        )
    if args.bench:
        if not args.model:
            ap.error("--bench needs --model")
        for rnd in range(args.rounds):
            order = CACHE_TYPES[rnd % 3 :] + CACHE_TYPES[: rnd % 3]
            for ctype in order:
                for depth in args.depths:
                    cmd = bench_command(args.bench, args.model, ctype, depth, args.threads,
                                        args.n_gen, args.reps)  # fmt: skip
                    commands.append(cmd)
                    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    for s in parse_bench(r.stdout):
                        samples.append(s | {"round": rnd * args.reps + s["rep"],
                                            "loadavg": os.getloadavg()})  # fmt: skip
                    print(f"round {rnd} {ctype} d={depth}: "
                          + ", ".join(f"t{s['threads']} {s['tg_ts']:.1f} t/s"
                                      for s in parse_bench(r.stdout)), flush=True)  # fmt: skip
    if args.backend_ops:
        cmd = [args.backend_ops, "perf", "-b", "CPU", "-o", "FLASH_ATTN_EXT", "-p", args.ops_params]
        commands.append(cmd)
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        ops = parse_backend_ops(r.stdout)
    kvb: dict = {}
    kvb_env = []
    for path in args.kvbench:
        d = json.loads(Path(path).read_text())
        kvb_env.append(d["env"])
        kvb.update(kvbench_ratios(d))
    doc = {
        "env": state if args.samples_from else state | {"state_after": machine_state()},
        "commands": commands,
        "samples": samples,
        "llama_ratios": {json.dumps(list(k)): v for k, v in llama_ratios(samples).items()},
        "op_rows": ops,
        "op_ratios": op_ratios(ops),
        "kvbench_env": kvb_env,
        "kvbench_ratios": {json.dumps(list(k)): v for k, v in kvb.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out.with_suffix(".json"))
    md = markdown(doc)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
