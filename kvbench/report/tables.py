"""``kvbench report DIR``: Markdown tables of the records (stdout) and PNG plots beside them
(their paths on stderr, so ``kvbench report DIR > report.md`` holds only the report).

The report starts with the provenance of the records (:mod:`kvbench.report.provenance`:
command, date, wall time, load average, versions, model checksum, CPU, threads).  Tables: one
per workload (workloads in :data:`WORKLOAD_ORDER`, then by parameters; one per workload and
model, the model in the title, when the records cover several models), rows sorted by method
family (``full`` first, then the method name), nominal key bits, then label.  Every
table has the nominal and the measured (effective) key and value bits; a workload that does not
measure them borrows them from a record of the same model, method and config that does
(fidelity, memory), marked ``*``; where no record of the configuration carries nominal bits (the
``nominal_key_bits`` / ``nominal_value_bits`` metrics its workloads record), the cells stay empty
and a note under the table says so.  Runs the runner flagged (nothing quantized) are marked ``!``
and the flag is printed under the table.  ``bytes_vs_16bit`` is computed from each record as in
the headline (:func:`kvbench.report.headline.bytes_vs_16bit`: ``bytes_total`` over 2 bytes per
K/V element the record holds), so the two never disagree.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, TypedDict

from kvbench.bench.records import Record, canonical
from kvbench.cache.registry import BASELINE
from kvbench.report.equal_bytes import section as equal_bytes_section
from kvbench.report.headline import QUALITY, bytes_vs_16bit, headline_table
from kvbench.report.plots import load, write_listed
from kvbench.report.provenance import provenance_block, run_logs
from kvbench.report.reading import reading

if TYPE_CHECKING:
    from kvbench.bench.suite import Suite
    from kvbench.jsontypes import JSONValue

#: preferred column order; other metrics follow alphabetically when asked for
COLUMNS = [
    "nominal_key_bits",
    "nominal_value_bits",
    "effective_key_bits",
    "effective_value_bits",
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
    "bytes_vs_16bit",
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


#: columns every table carries (borrowed from the same configuration's records when absent)
BITS = ("nominal_key_bits", "nominal_value_bits", "effective_key_bits", "effective_value_bits")
#: the columns of :data:`BITS` shown in every table, empty (with a note) where no record has them
NOMINAL = ("nominal_key_bits", "nominal_value_bits")
#: table order of workload types; others follow alphabetically
WORKLOAD_ORDER = ["bits", "fidelity", "perplexity", "generation", "passkey", "memory", "latency"]


def row_order(r: Record) -> tuple:
    """Sort key of a row: method family (``full`` first, then the method name), nominal key
    bits, label."""
    bits = r.metrics.get("nominal_key_bits", math.inf)
    return (r.method != BASELINE, r.method, bits, r.label)


class TableRow(TypedDict):
    """One row of a report table: a record, its values per column (``borrowed``: the columns
    taken from another record of its configuration) and the runner's flags."""

    label: str
    run_id: str
    method: str
    values: dict[str, float]
    borrowed: list[str]
    flags: list[str]


class Table(TypedDict):
    """One report table: a workload (and model) title, its columns, rows and notes."""

    workload: str
    columns: list[str]
    rows: list[TableRow]
    notes: list[str]


def workload_order(w: dict[str, JSONValue]) -> tuple:
    t = w.get("type", "?")
    rank = WORKLOAD_ORDER.index(t) if t in WORKLOAD_ORDER else len(WORKLOAD_ORDER)
    return (rank, t, w.get("context", 0) or 0, workload_label(w))


def borrowed_bits(records: list[Record]) -> dict[str, dict[str, float]]:
    """Per configuration (:attr:`Record.config_key`), the :data:`BITS` metrics any of its records has
    (fidelity's over memory's over others': the first found in workload order).  Nominal bits
    come only from what the records carry, never from the method's formula (a report shows
    what its records say, also for methods gone since)."""
    out: dict[str, dict[str, float]] = {}
    for r in sorted(records, key=lambda r: workload_order(r.workload)):
        e = out.setdefault(r.config_key, {})
        for k in BITS:
            if k in r.metrics and k not in e:
                e[k] = r.metrics[k]
    return out


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def model_labels(records: list[Record]) -> dict[str, str]:
    """Canonical model spec -> the name tables give it: the id (``shape:<preset>`` for a shape
    model, with ``[layers N]`` for a slice; ``none`` model-free), and its dtype and device
    where two specs of the records would otherwise share a name."""
    specs = {canonical(r.model): r.model for r in records}

    def short(m: dict[str, JSONValue]) -> str:
        return (m.get("id") or "none") + (f" [layers {m['layers']}]" if m.get("layers") else "")

    shorts = [short(m) for m in specs.values()]
    return {
        k: short(m)
        + (f" ({m.get('dtype')}, {m.get('device')})" if shorts.count(short(m)) > 1 else "")
        for k, m in specs.items()
    }


def workload_label(w: dict[str, JSONValue]) -> str:
    keys = sorted(k for k in w if k != "type")
    return w.get("type", "?") + (
        " (" + ", ".join(f"{k}={w[k]}" for k in keys) + ")" if keys else ""
    )


def tables(records: list[Record], columns: list[str] | None = None) -> list[Table]:
    """The report's tables as data: ``[{"workload", "columns", "rows": [{"label", "run_id",
    "method", "values": {column: value}, "borrowed": [columns], "flags": [...]}], "notes"}]``
    in report order (see the module docstring)."""
    groups: dict[str, list[Record]] = {}
    order: dict[str, tuple] = {}
    # records of several models: one table per workload and model, the model in its title
    names = model_labels(records)
    several = len(set(names.values())) > 1
    for r in records:
        w, m = r.workload, names[canonical(r.model)]
        key = workload_label(w) + (f" on {m}" if several else "")
        groups.setdefault(key, []).append(r)
        order[key] = (*workload_order(w), m)
    bits = borrowed_bits(records)
    # columns computed from one record: the headline's bytes_vs_16bit, where it is known
    ratios = {r.run_id: bytes_vs_16bit(r) for r in records}
    derived = {k: {} if v is None else {"bytes_vs_16bit": v} for k, v in ratios.items()}
    out: list[Table] = []
    for wl in sorted(groups, key=lambda k: order[k]):
        recs = sorted(groups[wl], key=row_order)
        present = {k for r in recs for k in (*r.metrics, *derived[r.run_id])}
        cols = [c for c in (columns or COLUMNS) if c in present and c not in BITS]
        if columns is None:
            cols += sorted(
                c
                for c in present
                if c.startswith(FAMILY_PREFIXES) and not c.endswith("_ratio") and "_stderr" not in c
            )
        if not cols:  # a workload with none of the preferred metrics: show its own
            cols = sorted(c for c in present if not c.endswith("_ratio") and c not in BITS)[:8]
        have_bits = [
            c
            for c in BITS
            if c in NOMINAL or c in present or any(c in bits[r.config_key] for r in recs)
        ]
        cols = have_bits + cols
        rows: list[TableRow] = []
        for r in recs:
            values: dict[str, float] = {}
            borrowed: list[str] = []
            for c in cols:
                if c in r.metrics or c in derived[r.run_id]:
                    values[c] = r.metrics.get(c, derived[r.run_id].get(c))
                elif c in bits[r.config_key]:
                    values[c] = bits[r.config_key][c]
                    borrowed.append(c)
            rows.append(
                {
                    "label": r.label,
                    "run_id": r.run_id,
                    "method": r.method,
                    "values": values,
                    "borrowed": borrowed,
                    "flags": r.flags,
                }
            )
        notes = sorted({r.manifest.get("timing_note") for r in recs} - {None})
        if any("_ratio" in c and c.startswith(("decode", "prefill")) for c in cols):
            base = sorted({r.manifest.get("baseline") for r in recs} - {None})
            if base:
                notes.append(f"timing ratios: against {', '.join(base)} interleaved in each run")
        if any(row["borrowed"] for row in rows):
            notes.append("*: bits measured by another workload's run of the same configuration")
        unknown = [row["label"] for row in rows if any(c not in row["values"] for c in NOMINAL)]
        if unknown:
            notes.append(
                f"nominal bits empty for {', '.join(unknown)}: no record of the configuration "
                "carries nominal_key_bits / nominal_value_bits (a bits, fidelity, perplexity, "
                "memory or lm_eval run records them); the report does not recompute them"
            )
        for row in rows:
            notes += [f"! {row['label']}: {f}" for f in row["flags"]]
        out.append({"workload": wl, "columns": cols, "rows": rows, "notes": notes})
    return out


def summary_table(
    records: list[Record], suite: Suite | None = None, columns: list[str] | None = None
) -> str:
    """Markdown tables, one per workload (see the module docstring for order and columns)."""
    parts = []
    for t in tables(records, columns):
        cols = t["columns"]
        head = "| method | " + " | ".join(cols) + " |"
        sep = "|---|" + "---:|" * len(cols)
        rows = []
        for row in t["rows"]:
            cells = [
                _fmt(row["values"].get(c)) + ("*" if c in row["borrowed"] else "") for c in cols
            ]
            mark = " !" if row["flags"] else ""
            rows.append(f"| {row['label']}{mark} | " + " | ".join(cells) + " |")
        foot = "".join(f"\n\n> {n}" for n in t["notes"])
        parts.append(f"### {t['workload']}\n\n" + "\n".join([head, sep, *rows]) + foot)
    return "\n\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="result folder(s), record files or export files")
    p.add_argument("--plots", default=None, help="folder for PNGs (default: the first folder)")
    p.add_argument(
        "--no-plots", action="store_true", help="print the tables only; write no PNG files"
    )
    p.add_argument("--json", action="store_true", help="the tables and plot paths as one JSON")


def main(args: argparse.Namespace) -> int:
    records = load(args.results)
    if not records:
        raise ValueError(f"no records in {args.results}")
    paths = [] if args.no_plots else write_listed(records, args.results, args.plots, sys.stderr)
    block = provenance_block(records, run_logs(args.results))
    if args.json:
        print(
            json.dumps(
                {
                    "provenance": block.splitlines(),
                    "tables": tables(records),
                    "plots": [str(p) for p in paths],
                }
            )
        )
        return 0
    print("## Provenance\n\n" + block + "\n")
    if any(r.workload_type == QUALITY and r.method == BASELINE for r in records):
        extra = equal_bytes_section(records)  # (c), with eviction records only
        headline = headline_table(records) + "\n\n" + reading(records)
        headline += f"\n\n{extra}" if extra else ""
        print("## Headline\n\n" + headline + "\n\n## Every workload\n")
    print(summary_table(records))
    return 0
