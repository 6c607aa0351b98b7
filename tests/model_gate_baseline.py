"""The model-quality regression gate's baseline and tolerance (docs/mutation.md#model-quality-gate).

``suites/ci_gate_model.yaml`` runs every built-in method on the real default model at a short
length; the gated numbers are ``next_token_kl`` (KL(P_full || P_method), nats per position) and
``bytes_total``.  They are deterministic on one CPU at a fixed number of threads, but not across
thread counts or instruction sets (the matrix products reduce in another order; a calibrated
method such as KVQuant moves its levels and outlier thresholds with that round-off).  So the
baseline is committed together with the spread measured across eight configurations of this
machine -- 1 and 2 intra-op threads, each with ``ATEN_CPU_CAPABILITY=default`` (generic kernels)
and the native instruction set, 1 thread with ``ATEN_CPU_CAPABILITY=avx2``, with the eager
code-domain attention kernels (``KVBENCH_CPU_ATTENTION=eager``), and the suite's own
configuration (2 threads, ``auto`` kernels: the native C ones where a compiler exists) under
each of ``default``, ``avx2`` and the native instruction set.  CI machines differ (AVX2 on
some, AVX-512 on others), and the write-then-attend KL moves by up to ~30% between instruction
sets, so the suite's own configuration under each instruction set a CI machine may have is
measured; generate the baseline on an AVX-512 machine, where "native" is the third one (on an
AVX2 machine the ``avx2`` runs repeat the native ones and AVX-512 goes unmeasured, and a
baseline made so failed the gate on an AVX-512 CI machine; the generator warns) -- and each method's
tolerance is derived from its own spread:

    tol = max(SAFETY * spread, FLOOR_REL * |baseline|, FLOOR_ABS)     (per method and metric)

with ``spread = max - min`` over the eight configurations.  ``SAFETY`` covers a CPU whose spread
exceeds the one measured here (the generic-vs-native difference stands in for "another
instruction set"); the floors keep a method whose runs agreed exactly from failing on
another machine's round-off (relative) and ``full`` (KL exactly 0) from a zero tolerance.

Regenerate both files with one command (``make baseline-model``)::

    python tests/model_gate_baseline.py [--work DIR]

It writes the records of the suite's own configuration (its ``threads``, native instruction set)
into ``tests/baseline_model/`` and the measured values, spreads and tolerances into
``tests/baseline_model_tolerance.json``.  ``--work`` keeps the eight runs' records so that an
interrupted regeneration resumes (``kvbench run`` skips runs whose record exists).

``--methods LABEL ...`` runs only those entries of the suite (a ``methods:`` entry's ``label``,
else its name) in the eight configurations and adds their records and tolerances to the
committed ones, which stay as they are (a method added to the suite costs its own runs, not
the whole matrix's); the committed files must exist and name the same configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "suites" / "ci_gate_model.yaml"
BASELINE = ROOT / "tests" / "baseline_model"
TOLERANCE = ROOT / "tests" / "baseline_model_tolerance.json"

#: the gated metrics and their floors: (relative to the baseline value, absolute)
GATED = {"next_token_kl": (0.01, 1e-6), "bytes_total": (0.0, 0.0)}
SAFETY = 3.0
#: (intra-op threads, ATEN_CPU_CAPABILITY or None for the native instruction set,
#: KVBENCH_CPU_ATTENTION or None for auto): the last one is the suite's own configuration (the
#: baseline); the others run the eager code-domain kernels, the one choice every CPU has
CONFIGS = [
    (1, None, "eager"),
    (1, "default", "eager"),
    (1, "avx2", "eager"),
    (2, None, "eager"),
    (2, "default", "eager"),
    (2, "default", None),
    (2, "avx2", None),
    (2, None, None),
]


def label(threads: int, capability: str | None, attention: str | None = None) -> str:
    """``t2-native``, ``t1-default-eager``, ...: the configuration's name and its folder in
    ``--work``."""
    return f"t{threads}-{capability or 'native'}" + (f"-{attention}" if attention else "")


def tolerance(values: list[float], base: float, floor_rel: float, floor_abs: float) -> float:
    """``max(SAFETY * (max - min), floor_rel * |base|, floor_abs)`` (see the module docstring)."""
    return max(SAFETY * (max(values) - min(values)), floor_rel * abs(base), floor_abs)


def records(folder: Path) -> dict[str, dict]:
    """``run_id -> record`` of a result folder."""
    out = {}
    for p in sorted(folder.glob("*.json")):
        rec = json.loads(p.read_text())
        out[rec["run_id"]] = rec
    return out


def gate_failures(base: dict[str, dict], new: dict[str, dict], tol: dict) -> list[str]:
    """One line per gated metric of ``new`` that left the baseline's tolerance band, per run
    missing from ``new`` and per baseline run without a tolerance entry (empty: the gate
    passes)."""
    bad = []
    for run_id, rec in sorted(base.items(), key=lambda kv: kv[1]["method"]):
        name = run_name(rec)
        if run_id not in new:
            bad.append(f"{name}: no fresh record for run {run_id}")
            continue
        if run_id not in tol["runs"]:
            bad.append(f"{name}: no tolerance for run {run_id}; run `make baseline-model`")
            continue
        for metric in GATED:
            b, v = rec["metrics"][metric], new[run_id]["metrics"][metric]
            t = tol["runs"][run_id][metric]["tolerance"]
            if not abs(v - b) <= t:
                bad.append(f"{name}: {metric} {v:.6g} vs baseline {b:.6g} (|diff| > {t:.3g})")
    return bad


def run_name(rec: dict) -> str:
    """``kivi`` or ``kivi (write-then-attend)``: the method and, where the record has one, its
    workload's protocol (the gate runs each method under two)."""
    protocol = rec.get("workload", {}).get("protocol")
    return f"{rec['method']} ({protocol})" if protocol else rec["method"]


def environment(threads: int, capability: str | None, attention: str | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for key, value in (("ATEN_CPU_CAPABILITY", capability), ("KVBENCH_CPU_ATTENTION", attention)):
        env.pop(key, None)
        if value:
            env[key] = value
    return env


def entry_label(entry: object) -> str:
    """A suite ``methods:`` entry's label: its ``label``, else its method name."""
    if isinstance(entry, str):
        return entry
    return str(entry.get("label") or entry["name"])  # type: ignore[union-attr]


def subset_suite(labels: list[str], folder: Path) -> Path:
    """A copy of :data:`SUITE` in ``folder`` with only the ``methods:`` entries labelled
    ``labels`` (in the suite's order).  Raises ``SystemExit`` naming labels the suite lacks."""
    import yaml

    suite = yaml.safe_load(SUITE.read_text())
    have = [entry_label(e) for e in suite["methods"]]
    unknown = sorted(set(labels) - set(have))
    if unknown:
        raise SystemExit(f"--methods: {unknown} not in {SUITE.name}; its entries: {have}")
    suite["methods"] = [e for e in suite["methods"] if entry_label(e) in labels]
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / SUITE.name
    out.write_text(yaml.safe_dump(suite, sort_keys=False))
    return out


def merge(summary: dict, old: dict) -> dict:
    """The committed tolerance file ``old`` with the runs of ``summary`` added (existing runs
    and every other field kept).  Raises ``SystemExit`` when the configurations differ."""
    if summary["configs"] != old["configs"] or summary["baseline_config"] != old["baseline_config"]:
        raise SystemExit(
            f"--methods: configurations {summary['configs']} differ from the committed "
            f"{old['configs']}; regenerate everything"
        )
    return {**old, "runs": {**old["runs"], **summary["runs"]}}


def _run(
    threads: int, capability: str | None, attention: str | None, out: Path, suite: Path = SUITE
) -> None:
    env = environment(threads, capability, attention)
    cmd = [sys.executable, "-m", "kvbench.cli", "run", str(suite), "--out", str(out)]
    cmd += ["--set", f"threads={threads}", "--quiet"]
    print(f"[{label(threads, capability, attention)}] {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, env=env)
    if done.returncode:  # kvbench run printed why (e.g. a missing asset); no traceback here
        raise SystemExit(done.returncode)


def summarize(runs: dict[str, dict[str, dict]], ref: str) -> dict:
    """The tolerance file's content from ``label -> records``; ``ref`` is the baseline's label."""
    out: dict = {"configs": list(runs), "baseline_config": ref, "safety": SAFETY}
    out["floors"] = {m: {"relative": r, "absolute": a} for m, (r, a) in GATED.items()}
    out["load_average"] = list(os.getloadavg())
    out["runs"] = {}
    for run_id, rec in sorted(runs[ref].items(), key=lambda kv: kv[1]["method"]):
        entry: dict = {"method": rec["method"], "protocol": rec["workload"]["protocol"]}
        for metric, (fr, fa) in GATED.items():
            vals = {lab: runs[lab][run_id]["metrics"][metric] for lab in runs}
            base = rec["metrics"][metric]
            spread = max(vals.values()) - min(vals.values())
            entry[metric] = {
                "values": vals,
                "spread": spread,
                "relative_spread": spread / abs(base) if base else None,
                "tolerance": tolerance(list(vals.values()), base, fr, fa),
            }
        out["runs"][run_id] = entry
    return out


def table(summary: dict) -> str:
    """Markdown: each method's next-token KL per configuration, its spread and tolerance."""
    labs = summary["configs"]
    lines = ["| method | protocol | " + " | ".join(labs) + " | relative spread | tolerance |"]
    lines.append("|---" * (len(labs) + 4) + "|")
    for e in sorted(summary["runs"].values(), key=lambda e: (e["protocol"], e["method"])):
        kl = e["next_token_kl"]
        rs = kl["relative_spread"]
        cells = [f"{kl['values'][lab]:.6g}" for lab in labs]
        rs_txt = f"{rs:.3%}" if rs is not None else "-"
        lines.append(
            f"| `{e['method']}` | {e['protocol']} | "
            + " | ".join(cells)
            + f" | {rs_txt} | {kl['tolerance']:.3g} |"
        )
    return "\n".join(lines)


def portable(text: str) -> str:
    """A record's text with this machine's data folder written as ``$KVBENCH_DATA_DIR``, so the
    committed baseline names no local path (the checksum identifies the file)."""
    root = os.environ.get("KVBENCH_DATA_DIR")
    if not root:
        return text
    return text.replace(str(Path(root).resolve()), "$KVBENCH_DATA_DIR").replace(
        root.rstrip("/"), "$KVBENCH_DATA_DIR"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="keep the runs here (resumable)")
    ap.add_argument(
        "--methods",
        nargs="+",
        metavar="LABEL",
        help="run only these suite entries and add them to the committed baseline (module "
        "docstring)",
    )
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvbench-model-gate-"))
    suite = subset_suite(args.methods, work / "suite") if args.methods else SUITE
    from kvbench.bench.suite import load_suite

    assert CONFIGS[-1] == (load_suite(SUITE).threads, None, None), "baseline config last"
    import torch

    native = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in native.upper():
        print(
            f"warning: this CPU's instruction set is {native}, not AVX-512: the spread will not "
            "cover an AVX-512 CI machine; generate the baseline on an AVX-512 machine",
            file=sys.stderr,
        )
    runs = {}
    for cfg in CONFIGS:
        folder = work / label(*cfg)
        _run(*cfg, folder, suite)
        runs[label(*cfg)] = records(folder)
    ref = label(*CONFIGS[-1])
    summary = summarize(runs, ref)
    if args.methods:
        summary = merge(summary, json.loads(TOLERANCE.read_text()))
    BASELINE.mkdir(exist_ok=True)
    for p in BASELINE.glob("*.json") if not args.methods else ():
        p.unlink()
    for p in (work / ref).glob("*.json"):
        (BASELINE / p.name).write_text(portable(p.read_text()))
    TOLERANCE.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
