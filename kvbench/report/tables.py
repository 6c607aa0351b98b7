"""``kvbench report DIR``: a Markdown table of the records and PNG plots beside them."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from kvbench.run.records import load_records

#: preferred column order; other metrics follow alphabetically when asked for
COLUMNS = [
    "nominal_key_bits",
    "nominal_value_bits",
    "effective_bits",
    "key_mse",
    "attn_kl",
    "attn_out_rel_err",
    "ppl",
    "ppl_delta",
    "next_token_kl",
    "top1_agreement",
    "gen_first_divergence",
    "gen_match_rate",
    "passkey_acc",
    "task_score",
    "bytes_total",
    "bytes_total_ratio",
    "bytes_codes",
    "bytes_scales",
    "bytes_residual",
    "peak_step_bytes",
    "prefill_ms",
    "decode_ms_p50",
    "decode_ms_p50_ratio",
    "decode_ms_p99",
    "tokens_per_s",
]


#: metric families shown beside the preferred columns when present (lm-eval task metrics,
#: without their stderr columns)
FAMILY_PREFIXES = ("lm_eval.", "kv_quantized_fraction")


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def label_of(rec: dict[str, Any]) -> str:
    return rec.get("manifest", {}).get("label") or rec["method"]


def workload_label(w: dict[str, Any]) -> str:
    keys = sorted(k for k in w if k != "type")
    return w.get("type", "?") + (
        " (" + ", ".join(f"{k}={w[k]}" for k in keys) + ")" if keys else ""
    )


def summary_table(
    records: list[dict[str, Any]], suite: Any = None, columns: list[str] | None = None
) -> str:
    """Markdown tables, one per workload, one row per run, the preferred metric columns that
    any run in the table has."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(workload_label(r.get("workload", {})), []).append(r)
    parts = []
    for wl, recs in groups.items():
        present = {k for r in recs for k in r["metrics"]}
        cols = [c for c in (columns or COLUMNS) if c in present]
        if columns is None:
            cols += sorted(
                c
                for c in present
                if c.startswith(FAMILY_PREFIXES) and not c.endswith("_ratio") and "_stderr" not in c
            )
        if not cols:  # a workload with none of the preferred metrics: show its own
            cols = sorted(c for c in present if not c.endswith("_ratio"))[:8]
        head = "| method | " + " | ".join(cols) + " |"
        sep = "|---|" + "---:|" * len(cols)
        rows = [
            f"| {label_of(r)} | " + " | ".join(_fmt(r["metrics"].get(c)) for c in cols) + " |"
            for r in recs
        ]
        notes = sorted({r.get("manifest", {}).get("timing_note") for r in recs} - {None})
        if any("_ratio" in c and c.startswith(("decode", "prefill")) for c in cols):
            base = sorted({r.get("manifest", {}).get("baseline") for r in recs} - {None})
            if base:
                notes.append(f"timing ratios: against {', '.join(base)} interleaved in each run")
        foot = "".join(f"\n\n> {n}" for n in notes)
        parts.append(f"### {wl}\n\n" + "\n".join([head, sep, *rows]) + foot)
    return "\n\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="result folder(s) or record files")
    p.add_argument("--plots", default=None, help="folder for PNGs (default: the first folder)")
    p.add_argument("--no-plots", action="store_true")


def main(args: argparse.Namespace) -> int:
    records = load_records(args.results)
    if not records:
        raise ValueError(f"no records in {args.results}")
    if any(r.get("workload", {}).get("type") == "memory" for r in records) and any(
        r["method"] == "full" for r in records
    ):
        from kvbench.report.headline import headline_table

        print("## Headline\n\n" + headline_table(records) + "\n\n## Every workload\n")
    print(summary_table(records))
    if not args.no_plots:
        from kvbench.report.plots import write_plots

        folder = Path(
            args.plots
            or (args.results[0] if Path(args.results[0]).is_dir() else Path(args.results[0]).parent)
        )
        for path in write_plots(records, folder):
            print(f"wrote {path}")
    return 0
