"""Report section "(c) Eviction vs quantization at equal measured bytes" (issue 49;
docs/design.md#eviction-vs-quantization-at-equal-measured-bytes).  Every number is computed
from the records; none is typed.

**Families** (:func:`family`, from a record's method and configuration): ``eviction`` (an
eviction method whose ``quantizer`` is ``full``: fewer tokens, each stored at full precision),
``quantization`` (any other method but ``full``: every token, fewer bits) and ``combined`` (an
eviction method whose ``quantizer`` quantizes).  ``full`` is the reference row.

**Bytes** (:func:`family_rows`): a row's ``bytes vs 16-bit`` is that of its KL record (the
``perplexity`` record with the most tokens; :func:`kvbench.report.headline.bytes_vs_16bit`:
measured ``bytes_total`` over the 16-bit cache of every token *seen*, so an eviction that keeps
half the tokens at 16 bits shows 0.5).  A row is binned to the budget ``b`` of :data:`BUDGETS`
when ``|bytes / b - 1| <= TOLERANCE`` (:func:`budget_of`); other rows are shown and drawn but
in no bin.

**Task score** (per ``ruler11`` protocol): the mean ``ruler11_score`` over the examples of the
row's ruler11 record (``per_layer['examples']``) of the tasks on the frontier, with its 95%
Wilson interval (:func:`kvbench.bench.intervals.add_wilson_ci`).  A task where ``full`` scores
below :data:`MIN_FULL_SCORE` under that protocol (:func:`excluded_tasks`) is shown in the
per-task table but left out of the task score, the winners and the frontier, with the reason
printed: the model cannot do it even with the whole cache, so a compressed cache's score there
measures nothing.  **KL**: the KL record's ``next_token_kl`` with its 95% interval.  **Step**:
``decode_ms_p50_ratio`` (with its interval) of the row's ``latency`` record at the longest
context measured.

**Winners** (:func:`winners`): per budget and family, the binned row with the highest task
score (per protocol; ties: fewer bytes, then the label) and the one with the lowest KL.
**Figure** (:func:`figure`): task score (one panel per protocol) and KL against bytes vs 16-bit,
one colour and marker per family, each family's frontier a line through its non-dominated
points only (:func:`kvbench.report.pareto.pareto_mask`), ``full`` a black star.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypedDict

from kvbench.bench.intervals import add_wilson_ci
from kvbench.bench.records import Record
from kvbench.cache.registry import BASELINE
from kvbench.report.headline import QUALITY, bytes_vs_16bit, cache_tokens, evicting_record
from kvbench.report.pareto import pareto_mask

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: the measured byte budgets, fractions of the 16-bit cache of every token seen
BUDGETS = (0.5, 0.25, 0.125)
#: a row is binned to budget ``b`` when ``|bytes / b - 1| <= TOLERANCE``
TOLERANCE = 0.2
#: tasks where ``full`` scores below this share are left out of the frontier
MIN_FULL_SCORE = 0.5
Family = Literal["eviction", "quantization", "combined"]
FAMILIES: tuple[Family, ...] = ("eviction", "quantization", "combined")
#: (colour, marker) of each family in the figure; ``full``: black star
STYLE = {
    "eviction": ("#1f77b4", "o"),
    "quantization": ("#d62728", "s"),
    "combined": ("#2ca02c", "^"),
}
TASK = "ruler11"
STEP = "decode_ms_p50_ratio"


class Score(TypedDict):
    """A value with its 95% interval (``low``/``high`` ``None`` where the record has none)."""

    value: float
    low: float | None
    high: float | None


class FamilyRow(TypedDict):
    """One configuration (label) of section (c).  ``bytes_ratio``: bytes vs 16-bit of the KL
    record (``None``: no such record); ``budget``: its bin (:func:`budget_of`); ``kl``: next-
    token KL (nats); ``scores``: protocol -> task score over the frontier tasks; ``tasks``:
    protocol -> task -> score (every task); ``step``: step vs ``full`` at ``step_context``
    tokens; ``longer``: share of output_length prompts at least 1.5x longer than ``full``'s."""

    label: str
    family: Family | Literal["full"]
    bytes_ratio: float | None
    budget: float | None
    kl: Score | None
    scores: dict[str, Score]
    tasks: dict[str, dict[str, Score]]
    step: Score | None
    step_context: int | None
    longer: Score | None


def family(rec: Record) -> Family | Literal["full"]:
    """The family of a record's configuration (module docstring): an eviction method's config
    carries ``quantizer`` (``{name, config}``)."""
    if rec.method == BASELINE:
        return "full"
    if evicting_record(rec):
        return "eviction" if rec.config["quantizer"].get("name") == BASELINE else "combined"
    return "quantization"


def budget_of(ratio: float | None) -> float | None:
    """The budget of :data:`BUDGETS` whose bin holds ``ratio`` (bytes vs 16-bit), or ``None``."""
    if ratio is None:
        return None
    for b in BUDGETS:
        if abs(ratio / b - 1) <= TOLERANCE + 1e-12:
            return b
    return None


def _score(m: dict[str, float], name: str) -> Score | None:
    if m.get(name) is None:
        return None
    return {"value": m[name], "low": m.get(f"{name}_ci_low"), "high": m.get(f"{name}_ci_high")}


def protocol(rec: Record) -> str:
    """A ruler11 record's protocol (its workload spec)."""
    return str(rec.workload.get("protocol", "?"))


def _tasks(rec: Record) -> list[str]:
    return [str(t) for t in rec.workload.get("tasks") or []]


def excluded_tasks(records: list[Record]) -> dict[str, dict[str, float]]:
    """protocol -> task -> ``full``'s score, for the tasks where ``full``'s ruler11 record of
    that protocol scores below :data:`MIN_FULL_SCORE`."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r.workload_type == TASK and r.method == BASELINE:
            for t in _tasks(r):
                v = r.metrics.get(f"ruler11_{t}")
                if v is not None and v < MIN_FULL_SCORE:
                    out.setdefault(protocol(r), {})[t] = v
    return out


def task_score(rec: Record, keep: list[str]) -> Score | None:
    """The mean ``ruler11_score`` over the record's examples of the tasks ``keep``, with its 95%
    Wilson interval; ``None`` without examples of those tasks (or without ``per_layer``)."""
    rows = (rec.per_layer or {}).get("examples") or []
    vals = [float(x["ruler11_score"]) for x in rows if x.get("task") in keep]
    m: dict[str, float] = {}
    add_wilson_ci(m, "s", vals)
    return _score(m, "s")


def _kl_record(recs: list[Record]) -> Record | None:
    kl = [r for r in recs if r.workload_type == QUALITY]
    return max(kl, key=lambda r: cache_tokens(r) or 0, default=None)


def family_rows(records: list[Record]) -> list[FamilyRow]:
    """One :class:`FamilyRow` per label of ``records``, sorted by family, bytes, label."""
    by: dict[str, list[Record]] = {}
    for r in records:
        by.setdefault(r.label, []).append(r)
    skip = excluded_tasks(records)
    out: list[FamilyRow] = []
    for label, recs in by.items():
        kl_rec = _kl_record(recs)
        ratio = None if kl_rec is None else bytes_vs_16bit(kl_rec)
        scores: dict[str, Score] = {}
        tasks: dict[str, dict[str, Score]] = {}
        for r in recs:
            if r.workload_type != TASK:
                continue
            p = protocol(r)
            per = {t: _score(r.metrics, f"ruler11_{t}") for t in _tasks(r)}
            tasks[p] = {t: s for t, s in per.items() if s is not None}
            s = task_score(r, [t for t in _tasks(r) if t not in skip.get(p, {})])
            if s is not None:
                scores[p] = s
        lat = [r for r in recs if r.workload_type == "latency" and STEP in r.metrics]
        long = max(lat, key=lambda r: cache_tokens(r) or 0, default=None)
        outlen = next((r for r in recs if r.workload_type == "output_length"), None)
        out.append(
            {
                "label": label,
                "family": family(recs[0]),
                "bytes_ratio": ratio,
                "budget": budget_of(ratio),
                "kl": None if kl_rec is None else _score(kl_rec.metrics, "next_token_kl"),
                "scores": scores,
                "tasks": tasks,
                "step": None if long is None else _score(long.metrics, STEP),
                "step_context": None if long is None else cache_tokens(long),
                "longer": None if outlen is None else _score(outlen.metrics, "outlen_longer_share"),
            }
        )
    order = {"full": 0, **{f: i + 1 for i, f in enumerate(FAMILIES)}}
    return sorted(
        out,
        key=lambda r: (order[r["family"]], -(r["bytes_ratio"] or 0), r["label"]),
    )


def protocols(rows: list[FamilyRow]) -> list[str]:
    """The ruler11 protocols any row was scored under, sorted."""
    return sorted({p for r in rows for p in r["scores"]} | {p for r in rows for p in r["tasks"]})


Winners = dict[float, dict[Family, dict[str, FamilyRow | None]]]


def winners(rows: list[FamilyRow]) -> Winners:
    """budget -> family -> criterion -> the binned row that wins it (``None``: no binned row of
    the family has the criterion).  Criteria: ``kl`` (lowest KL) and each protocol of
    :func:`protocols` (highest task score); ties go to fewer bytes, then the label."""
    out: Winners = {}
    for b in BUDGETS:
        out[b] = {}
        for fam in FAMILIES:
            binned = [r for r in rows if r["family"] == fam and r["budget"] == b]
            best: dict[str, FamilyRow | None] = {}
            have = [r for r in binned if r["kl"] is not None]
            best["kl"] = min(
                have,
                key=lambda r: (r["kl"]["value"], r["bytes_ratio"], r["label"]),
                default=None,
            )
            for p in protocols(rows):
                have = [r for r in binned if p in r["scores"]]
                best[p] = min(
                    have,
                    key=lambda r, p=p: (-r["scores"][p]["value"], r["bytes_ratio"], r["label"]),
                    default=None,
                )
            out[b][fam] = best
    return out


def _num(v: float | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _cell(s: Score | None, digits: int = 3) -> str:
    if s is None:
        return "–"
    if s["low"] is None or s["high"] is None:
        return _num(s["value"], digits)
    return f"{s['value']:.{digits}f} [{s['low']:.{digits}f}, {s['high']:.{digits}f}]"


def _kl_digits(rows: list[FamilyRow]) -> int:
    small = [r for r in rows if r["family"] != "full" and r["kl"] and abs(r["kl"]["value"]) < 0.01]
    return 4 if small else 3


def _winner_cell(r: FamilyRow | None, s: Score | None, digits: int) -> str:
    if r is None:
        return "–"
    return f"{r['label']}: {_cell(s, digits)} (bytes {_num(r['bytes_ratio'])})"


def has_families(records: list[Record]) -> bool:
    """Whether ``records`` hold an eviction or combined configuration (section (c) applies)."""
    return any(family(r) in ("eviction", "combined") for r in records)


def _kl_source(records: list[Record]) -> str:
    full = _kl_record([r for r in records if r.method == BASELINE])
    if full is None:
        return "the perplexity record (none here)"
    w = full.workload
    return (
        f"the perplexity record ({w.get('text', '?')}, {w.get('tokens', '?')} tokens, prefill "
        f"{w.get('prefill', '?')}, chunk {w.get('chunk', '?')})"
    )


def section(records: list[Record]) -> str:
    """Markdown of section (c) (module docstring); ``""`` when :func:`has_families` is false."""
    if not has_families(records):
        return ""
    rows = family_rows(records)
    prots = protocols(rows)
    skip = excluded_tasks(records)
    model = next((str(r.model.get("id")) for r in records if r.model.get("id")), "the model")
    kd = _kl_digits(rows)
    lines = [
        "#### (c) Eviction vs quantization at equal measured bytes",
        "",
        f"> Bytes vs 16-bit: each row's measured `bytes_total` over the 16-bit cache of every "
        f"token seen, from {_kl_source(records)}. A row is binned to a budget b of "
        f"{', '.join(str(b) for b in BUDGETS)} when |bytes / b - 1| <= {TOLERANCE} (rows "
        "outside every bin are listed and drawn, in no bin). Task score: ruler11, mean score over "
        "the examples of the frontier tasks, 95% Wilson interval; KL: next-token KL (nats), 95% "
        "interval; step: decode step vs `full` at the longest latency context measured.",
    ]
    for p in prots:
        for t, v in sorted(skip.get(p, {}).items()):
            lines.append(
                f">\n> Left out of the frontier ({p}): {t}, `full` scores {v:.3f} < "
                f"{MIN_FULL_SCORE} on {model} (shown in the per-task table)."
            )
    # winners per budget and family
    crit = [("kl", "lowest KL")] + [(p, f"best task score ({p})") for p in prots]
    lines += ["", "| budget | family | " + " | ".join(c[1] for c in crit) + " |"]
    lines.append("|---|---|" + "---|" * len(crit))
    for b, fams in winners(rows).items():
        for fam, best in fams.items():
            cells = []
            for key, _ in crit:
                r = best[key]
                s = None if r is None else (r["kl"] if key == "kl" else r["scores"].get(key))
                cells.append(_winner_cell(r, s, kd if key == "kl" else 3))
            lines.append(f"| {b} | {fam} | " + " | ".join(cells) + " |")
    # every row
    step_ctx = sorted({r["step_context"] for r in rows if r["step_context"] is not None})
    step_head = f"step vs full, {step_ctx[-1]} tok" if step_ctx else "step vs full"
    head = ["row", "family", "bytes vs 16-bit", "budget", "KL"]
    head += [f"task score ({p})" for p in prots] + [step_head, "outputs >= 1.5x longer"]
    lines += ["", "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        cells = [
            r["label"],
            r["family"],
            _num(r["bytes_ratio"]),
            _num(r["budget"]) if r["budget"] is not None else "–",
            _cell(r["kl"], kd),
            *(_cell(r["scores"].get(p)) for p in prots),
            _cell(r["step"]),
            _cell(r["longer"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    # per task, per protocol: an average hides collapses
    for p in prots:
        tasks = sorted({t for r in rows for t in r["tasks"].get(p, {})})
        if not tasks:
            continue
        names = [t + (" (left out)" if t in skip.get(p, {}) else "") for t in tasks]
        lines += [
            "",
            f"Per task ({p}; score [95% Wilson]):",
            "",
            "| row | bytes vs 16-bit | " + " | ".join(names) + " |",
            "|---|---:|" + "---:|" * len(tasks),
        ]
        for r in rows:
            if p not in r["tasks"]:
                continue
            cells = [_cell(r["tasks"][p].get(t)) for t in tasks]
            lines.append(f"| {r['label']} | {_num(r['bytes_ratio'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontier_points(
    rows: list[FamilyRow], fam: str, y: str, higher: bool
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """``(points, frontier)`` of family ``fam`` on the panel of ``y`` (``"kl"`` or a protocol):
    every ``(bytes vs 16-bit, value)`` and the non-dominated ones sorted by bytes (fewer bytes
    better; a value is better lower, or higher with ``higher``)."""
    pts = []
    for r in rows:
        s = r["kl"] if y == "kl" else r["scores"].get(y)
        if r["family"] == fam and s is not None and r["bytes_ratio"] is not None:
            pts.append((r["bytes_ratio"], s["value"]))
    mask = pareto_mask([p[0] for p in pts], [p[1] for p in pts], y_higher_better=higher)
    front = sorted({p for p, on in zip(pts, mask) if on})
    return pts, front


def figure(records: list[Record]) -> Figure | str:
    """The figure of section (c): one panel per ruler11 protocol (task score vs bytes vs
    16-bit) and one of KL vs bytes vs 16-bit; per family its points (``STYLE``) and a line
    through its non-dominated points (artist label ``frontier <family>``), ``full`` a black
    star; the budgets as dotted vertical lines.  Returns the reason (str) when there is nothing
    to compare."""
    if not has_families(records):
        return "no eviction or combined configuration in the records"
    rows = family_rows(records)
    panels = [(p, f"task score ({p})", True) for p in protocols(rows)]
    panels.append(("kl", "next-token KL (nats)", False))
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # not through pyplot, which would hold the figure until closed (as plots.new_figure)
    fig = Figure(figsize=(5.2 * len(panels), 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (y, title, higher) in zip(axes[0], panels):
        for fam in FAMILIES:
            color, marker = STYLE[fam]
            pts, front = frontier_points(rows, fam, y, higher)
            if pts:
                ax.scatter(*zip(*pts), color=color, marker=marker, label=fam, zorder=3)
            if front:
                ax.plot(*zip(*front), color=color, label=f"frontier {fam}", zorder=2)
        for r in rows:
            s = r["kl"] if y == "kl" else r["scores"].get(y)
            if r["family"] == "full" and s is not None and r["bytes_ratio"] is not None:
                ax.scatter([r["bytes_ratio"]], [s["value"]], color="#000000", marker="*",
                           s=90, label="full", zorder=4)  # fmt: skip
        for b in BUDGETS:
            ax.axvline(b, color="#999999", linestyle=":", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes vs 16-bit cache of all tokens seen")
        ax.set_ylabel(title)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle("(c) Eviction vs quantization at equal measured bytes", fontsize=10)
    fig.tight_layout()
    return fig
