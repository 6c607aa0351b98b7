"""Paper reproductions: a suite's ``paper:`` block and the side-by-side comparison table.

A suite that reproduces a published table carries the paper's numbers beside its runs::

    paper:
      title: "PN-Mix Table 10: average key-cache bits"
      source: "Song & Yoo, arXiv 2610.19605, Table 10"
      status: run            # or unrun: needs the paper's model / data / a GPU (see note)
      paper_model: "(formula)"
      note: "free text"
      columns:
        - {name: K bits, metric: nominal_key_bits, workload: bits, digits: 2}
        - {name: "KL (R1-Qwen-7B)"}                  # paper only (no metric)
        - {name: AIME24, metric: aime24_acc, workload: math, where: {dataset: aime24},
           scale: 100}
      rows:
        - {label: kivi, name: KIVI, paper: {K bits: 2.25}}
      claims:                 # directions the paper claims, checked on kvbench's numbers
        - {text: "PN-Mix below KIVI in KL", column: KL, order: [pn-mix, kivi]}
      figure: {x: nominal_key_bits, y: [next_token_kl]}

A row matches the records whose manifest ``label`` equals its ``label`` (the suite method's
label) and, when the row names a ``model``, whose model id equals it; a column with ``metric``
reads that metric from the matched record of its ``workload`` type (and ``where`` workload
parameters), times ``scale``.  Records whose label no row names get rows of their own
(kvbench's value alone); rows with no record show the paper's value alone.  ``order`` in a
claim lists row labels whose kvbench values should be strictly increasing.

``kvbench run SUITE`` prints :func:`comparison_table` after its summary when the suite has a
``paper:`` block and writes :func:`write_figures` PNGs into the result folder.

:mod:`.pair_analysis` holds the PN-Mix pair studies behind its Tables 1 and 11 (the
``score_agreement`` and ``selection_stability`` workloads, entry points of
``kvbench.workloads`` like the core's own).
"""

from __future__ import annotations

import math
from pathlib import Path

from kvbench.bench.records import Record
from kvbench.bench.validate import check_entry
from kvbench.jsontypes import JSONValue

PAPER_KEYS = {
    "title",
    "source",
    "status",
    "paper_model",
    "note",
    "columns",
    "rows",
    "claims",
    "figure",
}
COLUMN_KEYS = {"name", "metric", "workload", "where", "scale", "digits"}
ROW_KEYS = {"label", "name", "model", "paper"}
CLAIM_KEYS = {"text", "column", "order"}
STATUSES = ("run", "unrun")


def validate(paper: object, where: str = "paper") -> dict[str, JSONValue]:
    """Check a ``paper:`` block (as loaded from the suite's YAML); returns it.  ``ValueError`` names the bad key and what is
    allowed."""
    check_entry(paper, where, PAPER_KEYS, shape="'paper' must be a mapping")
    if paper.get("status", "run") not in STATUSES:
        raise ValueError(f"{where}: status must be one of {list(STATUSES)}")
    cols = paper.get("columns") or []
    if not isinstance(cols, list) or not cols:
        raise ValueError(f"{where}: 'columns' must be a non-empty list")
    names = []
    for i, c in enumerate(cols):
        check_entry(c, f"{where}: columns[{i}]", COLUMN_KEYS, "name")
        if "where" in c and not isinstance(c["where"], dict):
            raise ValueError(f"{where}: columns[{i}].where must be a mapping")
        names.append(str(c["name"]))
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: column names must be unique, got {names}")
    labels = []
    for i, r in enumerate(paper.get("rows") or []):
        check_entry(r, f"{where}: rows[{i}]", ROW_KEYS, "label")
        unknown = set(r.get("paper") or {}) - set(names)
        if unknown:
            raise ValueError(
                f"{where}: rows[{i}] ({r['label']}): paper values for unknown "
                f"column(s) {sorted(unknown)}; columns: {names}"
            )
        labels.append(r["label"])
    for i, c in enumerate(paper.get("claims") or []):
        if not isinstance(c, dict) or set(c) - CLAIM_KEYS or "order" not in c:
            raise ValueError(f"{where}: claims[{i}] must be a mapping of {sorted(CLAIM_KEYS)}")
        if c.get("column") not in names:
            raise ValueError(f"{where}: claims[{i}].column {c.get('column')!r} is not a column")
        missing = [x for x in c["order"] if x not in labels]
        if missing or len(c["order"]) < 2:
            raise ValueError(
                f"{where}: claims[{i}].order needs >= 2 row labels; unknown: {missing}"
            )
    fig = paper.get("figure")
    if fig is not None and not (isinstance(fig, dict) and "x" in fig and "y" in fig):
        raise ValueError(f"{where}: figure must be a mapping with 'x' and 'y'")
    return paper


def _label(rec: Record) -> str:
    return rec.label


def _model_id(rec: Record) -> str | None:
    return rec.model.get("id")


def _matches(rec: Record, col: dict[str, JSONValue]) -> bool:
    wl = rec.workload
    if col.get("workload") and wl.get("type") != col["workload"]:
        return False
    return all(wl.get(k) == v for k, v in (col.get("where") or {}).items())


def kvbench_value(
    records: list[Record], label: str, col: dict[str, JSONValue], model: str | None = None
) -> float | None:
    """The column's metric from the first record of ``label`` (and ``model``) that matches the
    column's workload filter, scaled; ``None`` when there is none."""
    if not col.get("metric"):
        return None
    for rec in records:
        if _label(rec) != label or (model is not None and _model_id(rec) != model):
            continue
        if not _matches(rec, col):
            continue
        v = rec.metrics.get(col["metric"])
        if isinstance(v, (int, float)):
            return float(v) * float(col.get("scale", 1))
    return None


def _fmt(v: float | str | None, digits: int) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if v != 0 and abs(v) < 10 ** (-digits):
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def _rows(paper: dict[str, JSONValue], records: list[Record]) -> list[dict[str, JSONValue]]:
    rows = [dict(r) for r in paper.get("rows") or []]
    named = {r["label"] for r in rows}
    models = {_model_id(r) for r in records}
    for rec in records:  # runs the paper block does not name get rows of their own
        lab = _label(rec)
        if lab not in named:
            named.add(lab)
            rows.append({"label": lab, "name": lab, "paper": {}})
    if len(models) > 1:  # one row per (row, model) when several models ran
        out = []
        for r in rows:
            if r.get("model"):
                out.append(r)
                continue
            for m in sorted(x for x in models if x):
                if any(_label(x) == r["label"] and _model_id(x) == m for x in records):
                    out.append({**r, "model": m, "name": f"{r.get('name', r['label'])} ({m})"})
            if not any(_label(x) == r["label"] for x in records):
                out.append(r)
        rows = out
    return rows


def comparison_table(paper: dict[str, JSONValue], records: list[Record]) -> str:
    """Markdown: the paper's values and kvbench's side by side (see the module docstring),
    then the claims checked on kvbench's values."""
    validate(paper)
    cols = paper["columns"]
    with_paper = [
        any(c["name"] in (r.get("paper") or {}) for r in paper.get("rows") or []) for c in cols
    ]
    header, align = ["method"], ["---"]
    for c, has_paper in zip(cols, with_paper):
        for side, present in (("paper", has_paper), ("kvbench", bool(c.get("metric")))):
            if present:
                header.append(f"{c['name']} ({side})")
                align.append("---:")
    lines = [f"## Paper comparison: {paper.get('title', '')}".rstrip()]
    if paper.get("source"):
        lines.append(f"source: {paper['source']}")
    models = sorted({m for m in (_model_id(r) for r in records) if m}) or ["(none)"]
    lines.append(
        f"paper model(s): {paper.get('paper_model', 'see source')}; "
        f"kvbench model(s): {', '.join(models)}"
    )
    if paper.get("status", "run") == "unrun":
        lines.append(
            "status: UNRUN at the paper's setting here (needs the paper's model/data "
            "or a GPU); kvbench values below come from whatever this run used"
        )
    if paper.get("note"):
        lines.append(f"note: {str(paper['note']).strip()}")
    lines += ["", "| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    rows = _rows(paper, records)
    for r in rows:
        cells = [str(r.get("name", r["label"]))]
        for c, has_paper in zip(cols, with_paper):
            digits = int(c.get("digits", 3))
            if has_paper:  # as written in the suite unless the column sets its digits
                pv = (r.get("paper") or {}).get(c["name"])
                cells.append(_fmt(pv, digits) if "digits" in c or pv is None else str(pv))
            if c.get("metric"):
                cells.append(_fmt(kvbench_value(records, r["label"], c, r.get("model")), digits))
        lines.append("| " + " | ".join(cells) + " |")
    claims = check_claims(paper, records)
    if claims:
        lines += ["", "Claims of the paper, checked on kvbench's values:"]
        for c in claims:
            vals = " < ".join(_fmt(v, 4) if v is not None else "n/a" for v in c["values"])
            lines.append(f"- {c['text']}: {c['verdict']} ({vals})")
    return "\n".join(lines)


def check_claims(paper: dict[str, JSONValue], records: list[Record]) -> list[dict[str, JSONValue]]:
    """Each claim with kvbench's values in its order and a verdict: ``holds``,
    ``does not hold`` or ``not measured``."""
    cols = {c["name"]: c for c in paper.get("columns") or []}
    out = []
    for c in paper.get("claims") or []:
        col = cols[c["column"]]
        vals = [kvbench_value(records, lab, col) for lab in c["order"]]
        if any(v is None or math.isnan(v) for v in vals):
            verdict = "not measured"
        elif all(a < b for a, b in zip(vals, vals[1:])):
            verdict = "holds"
        else:
            verdict = "does not hold"
        out.append(
            {
                "text": c.get("text", " < ".join(c["order"])),
                "values": vals,
                "verdict": verdict,
                "order": c["order"],
                "column": c["column"],
            }
        )
    return out


def write_figures(
    paper: dict[str, JSONValue], records: list[Record], folder: str | Path
) -> list[Path]:
    """PNG Pareto plots of ``figure: {x, y}`` (``y`` one metric or a list) with
    :func:`kvbench.report.plots.pareto_plot`; returns the written paths."""
    fig = paper.get("figure")
    if not fig:
        return []
    from kvbench.report.plots import pareto_plot

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ys = fig["y"] if isinstance(fig["y"], list) else [fig["y"]]
    out = []
    for y in ys:
        short = str(paper.get("title", "")).split(":")[0]
        title = f"{short}: {y} vs {fig['x']} (hollow: dominated)"
        p = pareto_plot(records, fig["x"], y, folder / f"paper_{y}_vs_{fig['x']}.png", title)
        if p:
            out.append(p)
    return out
