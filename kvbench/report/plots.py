"""Matplotlib figures of result records (PNG, Agg backend): ``kvbench plot`` and ``kvbench report``.

:func:`figures` yields every figure (file name = key + ``.png``) or the reason it is not drawn.
The rules every figure follows:

- **Style per configuration** (:func:`style_table`, built once from all the records, so a label
  looks the same in every figure): a colour per method family (tab20, darker half first; ``full``
  black), a marker per configuration within its family, and a number (the key beside the axes
  reads ``<number> <label>``); no two labels share (colour, marker) up to 20 x 12 labels.
- **Names as the table's**: transformers peers (:func:`peer_labels`) are named ``<label>
  (peer)``, headline rows by the table's label (``(budget not reached ...)``); configurations
  at one position with equal intervals (one cache under several labels: the headline's merged
  rows) are one marker (:func:`merge_points`) named by all their labels joined by `` = ``.
- **Frontier**: :func:`kvbench.report.pareto.pareto_mask` over every drawn point (``full``
  included, transformers peers left out: never ranked, as in the table) at its drawn position;
  filled markers on the frontier, hollow ones dominated (and every peer), a line (gid
  ``frontier``) through exactly the frontier's points sorted by x.
- **Noise floor** (metrics that cannot be negative, :data:`NONNEG`): one per figure,
  :func:`noise_floor`, the headline table's rule and wording (a dotted line, gid ``floor``);
  values at or below it are drawn in a shaded band below that line (gid ``floor-band``), spread
  over lanes so that no marker hides another (:func:`spread_floor`); they rank as equal (the
  floor) in the frontier.
- **95% intervals**: an error bar (gid ``ci-y:<label>`` / ``ci-x:<label>``) wherever the record
  carries ``<metric>_ci_low`` / ``_ci_high``.
- **Titles** name the model, text, context and decode protocol of the records drawn.
- **Facets**: quality against nominal bits (:func:`pareto_figure`) draws configurations whose
  values stay at 16 bits (headline section (b); a peer by its nominal value bits) on their own
  axes, never beside those whose values are quantized; ``full`` is the reference in both.
- **Sections**: the headline figures draw section (a) or (b) with ``full``; the peers' own
  section of the table is not drawn there (its rows are in the nominal-bits figures).
- **Labels**: each point's name (at most :data:`MAX_NAMED` points per axes) or number, placed
  by :func:`place_labels` where it overlaps no marker, no other label (a leader line counted
  as part of its label), no segment of the frontier line and no interval bar, and stays inside
  the axes; its number where its name finds no room.
- **Close values**: a marker whose box would overlap another's is drawn a few pixels aside
  with its intervals (:func:`nudge_markers`; frontier and floor-band markers stay), its data
  still its value.  In the floor band no y tick is labelled (its markers sit in lanes, not at
  their values).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO, TypedDict

from kvbench.bench.metrics import HIGHER, direction
from kvbench.bench.records import Record, canonical, load_records
from kvbench.cache.registry import BASELINE
from kvbench.report import equal_bytes
from kvbench.report.headline import BASE_BITS, KL_FLOOR, SECTIONS, peer_record, row_label, rows
from kvbench.report.pareto import pareto_mask

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from kvbench.jsontypes import JSONValue

#: the decode-step cost of the headline figures: median steady step / interleaved ``full``
DECODE = "decode_ms_p50_ratio"
#: quality metrics drawn against nominal key bits (with every directed lm-eval task metric)
QUALITY = ("next_token_kl", "attn_kl", "key_mse", "attn_out_rel_err", "top1_agreement")
#: metrics that cannot be negative and are 0 for ``full``: drawn with the noise floor
NONNEG = ("next_token_kl", "attn_kl", "key_mse", "key_rel_mse", "attn_out_rel_err", "value_mse")
#: (workload type, metric) drawn against context depth
SWEEPS = [("latency", m) for m in ("decode_ms_p50", DECODE, "tokens_per_s")] + [
    ("memory", m) for m in ("bytes_total", "effective_bits", "peak_step_bytes")
]
#: an axis is logarithmic when its drawn values span more than this factor
LOG_SPAN = 20.0
#: axes with more points carry numbers, not names, beside their markers
MAX_NAMED = 10
#: axis text (with units) of each metric
NAMES = {
    "bytes_ratio": "bytes at rest / those of a 16-bit cache of the same tokens",
    "next_token_kl": "next-token KL vs full (nats)",
    "attn_kl": "attention KL vs full (nats)",
    "ppl_delta": "perplexity increase vs full",
    "key_mse": "key MSE vs full",
    "attn_out_rel_err": "attention output relative error vs full",
    "top1_agreement": "top-1 agreement with full (fraction, higher is better)",
    "nominal_key_bits": "nominal key bits / element (formula, residual excluded)",
    DECODE: "decode step, median / that of full interleaved in the same run",
    "decode_ms_p50": "decode step, median (ms)",
    "tokens_per_s": "decode tokens / s (higher is better)",
    "bytes_total": "KV cache at rest (MiB)",
    "effective_bits": "measured bits / element, K and V (8 x stored bytes / elements)",
    "peak_step_bytes": "transient bytes of one decode step (MiB)",
}
#: workload parameters named in axis labels, in this order, with their wording
PARAMS = {
    "text": "{}",
    "context": "{} tokens",
    "tokens": "{} tokens",
    "prefill": "prefill {}",
    "chunk": "chunks of {}",
    "dtype": "{} K/V",
    "batch_size": "batch {}",
    "batch": "batch {}",
    "layers": "layers {}",
}
#: family colours: tab20, its ten darker shades first
COLORS = (
    "#1f77b4 #ff7f0e #2ca02c #d62728 #9467bd #8c564b #e377c2 #7f7f7f #bcbd22 #17becf "
    "#aec7e8 #ffbb78 #98df8a #ff9896 #c5b0d5 #c49c94 #f7b6d2 #c7c7c7 #dbdb8d #9edae5"
).split()
#: configuration markers within a family
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "<", ">", "p", "h", "8")
#: marker size (points) of every point but the combined figure's
SIZE = 7.0
#: section (b) in the facet of :func:`pareto_figure`, (a) and unsectioned rows in the other
FACETS = {"a": "values quantized", "b": "values kept at 16 bits (keys only)"}


class Style(TypedDict):
    """How one configuration (label) is drawn: matplotlib colour and marker, and its number."""

    color: str
    marker: str
    number: int


def new_figure(**kwargs: object) -> Figure:
    """A matplotlib :class:`~matplotlib.figure.Figure` (``kwargs``: its constructor's, e.g.
    ``figsize`` in inches, ``layout``) on the Agg canvas, never registered with pyplot: nothing
    but its caller holds it, so it is freed with the caller's last reference and no figure is
    ever left open (pyplot keeps each figure it creates until ``plt.close``).  Every figure of
    this module is made here (:func:`kvbench.report.equal_bytes.figure` makes its own alike)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)  # type: ignore[arg-type]
    FigureCanvasAgg(fig)
    return fig


def style_table(records: list[Record]) -> dict[str, Style]:
    """``{label: Style}`` for every label of ``records``: families sorted (``full`` first, black
    ``*``), the i-th other family coloured ``COLORS[(i - 1) % 20]``; the labels of a family sorted,
    the j-th marked by the first of ``MARKERS`` from ``j`` on that no earlier label of the same
    colour has; numbered 1, 2, ... in that order.  Deterministic in the records' (family, label)
    pairs; (colour, marker) pairs repeat only past 20 x 12 labels."""
    family = {r.label: r.method for r in records}
    fams = sorted(set(family.values()), key=lambda f: (f != BASELINE, f))
    used: dict[str, set[str]] = {}
    out: dict[str, Style] = {}
    for i, fam in enumerate(fams):
        color = "#000000" if fam == BASELINE else COLORS[(i - (BASELINE in fams)) % len(COLORS)]
        for j, label in enumerate(sorted(lb for lb, f in family.items() if f == fam)):
            taken = used.setdefault(color, set())
            ring = [MARKERS[(j + k) % len(MARKERS)] for k in range(len(MARKERS))]
            free = [m for m in ring if m not in taken] or ring
            marker = "*" if fam == BASELINE and j == 0 else free[0]
            taken.add(marker)
            out[label] = {"color": color, "marker": marker, "number": len(out) + 1}
    return out


def _short(metric: str) -> str:
    short = {"bytes_ratio": "bytes", DECODE: "decode step"}
    return short.get(metric) or NAMES.get(metric, metric).split(" (")[0].split(" vs ")[0]


def _group(
    records: list[Record], metric: str, wtype: str | None = None, drop: tuple[str, ...] = ()
) -> list[Record]:
    """The records with ``metric`` (of type ``wtype``) from the one (type, model, workload
    parameters but ``drop``) that most labels have; the larger context on a tie."""
    groups: dict[str, dict[tuple[JSONValue, ...], Record]] = {}
    for r in records:
        if metric in r.metrics and wtype in (None, r.workload_type):
            w = {k: v for k, v in r.workload.items() if k not in drop}
            g = groups.setdefault(canonical({"model": r.model, "workload": w}), {})
            g[(r.label, *(r.workload.get(k) for k in drop))] = r  # one record per label (and x)

    # labels, then the largest context
    def cover(g: dict[tuple[JSONValue, ...], Record]) -> tuple[int, int]:
        return len({k[0] for k in g}), max(r.workload.get("context") or 0 for r in g.values())

    return list(max(groups.values(), key=cover).values()) if groups else []


def describe(rec: Record, drop: tuple[str, ...] = ()) -> str:
    """``"(memory workload: essays, 2048 tokens, float16 K/V, layers all)"`` from a record."""
    w = rec.workload
    parts = [fmt.format(w[k]) for k, fmt in PARAMS.items() if k in w and k not in drop]
    if rec.model.get("shape"):
        parts.append(f"shape {rec.model['shape']}, random weights")
    return f"({rec.workload_type} workload: {', '.join(parts)})" if parts else ""


def protocol(rec: Record) -> str:
    """The decode protocol the record ran: the one the run recorded (``manifest.protocol``,
    ``manifest.decode_attention.protocol``), else the workload's ``protocol`` parameter, else
    the fidelity workload's own (prefill, then one token at a time), else ``"not recorded"``."""
    dec = rec.manifest.get("decode_attention")
    for p in (rec.manifest.get("protocol"), isinstance(dec, dict) and dec.get("protocol")):
        if p:
            return str(p)
    w = rec.workload
    if w.get("protocol"):
        return str(w["protocol"])
    if rec.workload_type == "fidelity" and "prefill" in w:
        return f"prefill {w['prefill']}, then one token at a time"
    return "not recorded"


def context(rec: Record) -> int | None:
    """Tokens of context of the record's workload: ``context``, else ``tokens``."""
    c = rec.workload.get("context", rec.workload.get("tokens"))
    return None if c is None else int(c)


def setting(groups: dict[str, list[Record]], contexts: str = "") -> str:
    """The title line naming what ``groups`` (``{what: records}``, e.g. ``{"KL": [...]}``) were
    measured on: ``"model M (float32, cpu); text essays; context 1024 tokens; protocol P"``; a
    part that differs between groups names each group, a protocol that differs between
    families names the others; ``contexts`` replaces the context part."""
    recs = [r for rs in groups.values() for r in rs]

    def one(name: str, per: dict[str, set[str]]) -> str:
        vals = {v for vs in per.values() for v in vs}
        if len(vals) <= 1:
            return f"{name} {next(iter(vals), 'not recorded')}"
        return f"{name} " + ", ".join(f"{', '.join(sorted(v))} ({k})" for k, v in per.items())

    models = {
        f"{r.model.get('id') or r.model.get('shape') or 'none'} "
        f"({r.model.get('dtype', '?')}, {r.model.get('device', '?')})"
        for r in recs
    }
    texts = {
        g: {str(r.workload.get("text", "not recorded")) for r in rs} for g, rs in groups.items()
    }
    ctx = {g: {f"{context(r)} tokens" for r in rs} for g, rs in groups.items()}
    by = Counter(protocol(r) for r in recs)
    main = by.most_common(1)[0][0]
    others: dict[str, set[str]] = {}
    for r in recs:
        if protocol(r) != main:
            others.setdefault(protocol(r), set()).add(r.method)
    proto = f"protocol {main}" + "".join(
        f"; {', '.join(sorted(f))}: {p}" for p, f in sorted(others.items())
    )
    where = contexts or one("context", ctx)
    return "; ".join(["model " + ", ".join(sorted(models)), one("text", texts), where, proto])


def unquantized(rec: Record) -> bool:
    """A configuration that quantizes nothing: measured key and value bits >= 16, not ``full``
    (its metric against ``full`` is the run's float noise)."""
    m = rec.metrics
    bits = (m.get("effective_key_bits") or 0, m.get("effective_value_bits") or 0)
    return rec.method != BASELINE and min(bits) >= BASE_BITS


def noise_floor(metric: str, recs: list[Record]) -> float:
    """The headline table's noise floor of ``metric`` (:func:`kvbench.report.headline.noise_floor`
    for ``next_token_kl``): the largest ``|value|`` or interval bound of the :func:`unquantized`
    records, at least :data:`~kvbench.report.headline.KL_FLOOR`."""
    out = [KL_FLOOR]
    for r in recs:
        if unquantized(r):
            keys = (metric, f"{metric}_ci_low", f"{metric}_ci_high")
            out += [abs(r.metrics[k]) for k in keys if r.metrics.get(k) is not None]
    return max(out)


def floor_text(metric: str, floor: float) -> str:
    """The legend's statement of the floor, worded as the headline table's note."""
    what = "KL" if metric == "next_token_kl" else _short(metric)
    return (
        f"at or below full's noise floor ({floor:.0e}: the largest |{what}| of unquantized "
        f"rows, at least {KL_FLOOR:.0e}): drawn in the shaded band below it, spread so that "
        "none hides another"
    )


@dataclass
class Point:
    """One configuration in a figure: values and their 95% intervals (``None``: none
    recorded), marker size (points), the extra text of its key entry, the name it is shown
    under (``""``: its label; :func:`merge_points`, :func:`peer_labels`) and whether it takes
    part in the frontier (``False``: a transformers peer, never ranked)."""

    label: str
    x: float
    y: float
    x_ci: tuple[float, float] | None = None
    y_ci: tuple[float, float] | None = None
    size: float = SIZE
    note: str = ""
    name: str = ""
    ranked: bool = True

    @property
    def shown(self) -> str:
        """The name in the key and beside the marker: :attr:`name`, else the label."""
        return self.name or self.label


#: what follows a transformers peer's label wherever a figure names it (the table's mark)
PEER_MARK = " (peer)"


def peer_labels(records: list[Record]) -> set[str]:
    """The labels of transformers peers: those with a record of a peer's own cache
    (:func:`kvbench.report.headline.peer_record`)."""
    return {r.label for r in records if peer_record(r)}


def merge_points(points: list[Point], styles: dict[str, Style]) -> list[Point]:
    """One point per distinct (x, y, intervals): the points of several labels there (one cache
    under several labels, as the headline's merged rows, or equal values of one metric: ``full``
    and a 16-bit peer at top-1 1.0) become one, drawn as the lowest-numbered ranked one (its
    style, size and rank; the lowest-numbered where none is ranked), named by all their names
    in number order joined by `` = ``, their key notes joined by `` /`` where they differ; the
    others as they are.  Order: that of each group's first point."""
    groups: dict[tuple[object, ...], list[Point]] = {}
    for p in points:
        groups.setdefault((p.x, p.y, p.x_ci, p.y_ci), []).append(p)
    out = []
    for g in groups.values():
        g = sorted(g, key=lambda p: styles[p.label]["number"])
        if len(g) == 1:
            out.append(g[0])
            continue
        base = next((p for p in g if p.ranked), g[0])
        notes = list(dict.fromkeys(p.note for p in g))
        note = notes[0] if len(notes) == 1 else " /".join(notes)
        out.append(dataclasses.replace(base, name=" = ".join(p.shown for p in g), note=note))
    return out


def _ci(rec: Record, metric: str) -> tuple[float, float] | None:
    lo, hi = (rec.metrics.get(f"{metric}_ci_{k}") for k in ("low", "high"))
    return None if lo is None or hi is None else (lo, hi)


def frontier(points: list[tuple[float, float]], higher: bool) -> list[bool]:
    """:func:`kvbench.report.pareto.pareto_mask` of drawn ``(x, y)`` positions (x lower is
    better; y higher is better when ``higher``)."""
    return pareto_mask([p[0] for p in points], [p[1] for p in points], higher)


def _log_axis(ax: Axes, axis: str, values: list[float]) -> None:
    """Logarithmic ``axis`` (with 1-2-5 ticks written plainly) when ``values`` (all > 0) span
    more than :data:`LOG_SPAN`."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if not values or min(values) <= 0 or max(values) / min(values) <= LOG_SPAN:
        return
    a = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    a.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    a.set_minor_formatter(NullFormatter())


def _panel(
    ax: Axes, points: list[Point], y: str, floor: float | None, styles: dict[str, Style]
) -> list[tuple[Point, float, bool]]:
    """Draw ``points`` on ``ax``: intervals, markers (hollow when dominated), the frontier
    line, the floor; returns each point with its drawn y (values at or below ``floor`` on it,
    until :func:`spread_floor` moves them into the band below it) and whether it is on the
    frontier."""
    higher = direction(y) == HIGHER

    def clamp(v: float) -> float:
        return v if floor is None else max(v, floor)

    drawn = [clamp(p.y) for p in points]
    ranked = [i for i, p in enumerate(points) if p.ranked]  # peers are never ranked
    mask = [False] * len(points)
    for i, on in zip(ranked, frontier([(points[i].x, drawn[i]) for i in ranked], higher)):
        mask[i] = on
    bar = {"lw": 0.9, "alpha": 0.55, "zorder": 2, "marker": "_", "ms": 5}
    for p, d, on in zip(points, drawn, mask):
        st = styles[p.label]
        if p.y_ci is not None:
            ax.plot(
                [p.x] * 2,
                [clamp(v) for v in p.y_ci],
                color=st["color"],
                gid=f"ci-y:{p.label}",
                **bar,
            )
        if p.x_ci is not None:
            ax.plot(list(p.x_ci), [d] * 2, color=st["color"], gid=f"ci-x:{p.label}", **bar)
        ax.plot(
            [p.x],
            [d],
            ls="none",
            marker=st["marker"],
            ms=p.size * (1.4 if st["marker"] == "*" else 1.0),
            mec=st["color"],
            mfc=st["color"] if on else "none",
            mew=1.4,
            zorder=4,
            gid=p.label,
        )
    front = sorted({(p.x, d) for p, d, on in zip(points, drawn, mask) if on})
    if front:
        ax.plot(*zip(*front), color="0.3", lw=1.1, zorder=3, gid="frontier")
    if floor is not None and any(p.y <= floor for p in points):
        ax.axhline(floor, color="0.45", ls=":", lw=1, zorder=1, gid="floor")
    _log_axis(ax, "x", [p.x for p in points])
    _log_axis(ax, "y", drawn + [clamp(v) for p in points if p.y_ci for v in p.y_ci])
    ax.grid(alpha=0.3, which="major")
    ax.margins(0.06)
    return list(zip(points, drawn, mask))


def _key(
    points: list[Point], styles: dict[str, Style], front_note: str, extra: list[Artist]
) -> list[Artist]:
    """Legend handles: one per configuration (``<number> <label>``), then the rules."""
    from matplotlib.lines import Line2D

    seen: dict[str, Point] = {}
    for p in points:  # a label in several panels: its longest name (merged there with others)
        if p.label not in seen or len(p.shown) > len(seen[p.label].shown):
            seen[p.label] = p
    out: list[Artist] = [
        Line2D(
            [],
            [],
            ls="none",
            marker=styles[lb]["marker"],
            color=styles[lb]["color"],
            ms=SIZE,
            label=f"{styles[lb]['number']:>2} {p.shown}{p.note}",
        )
        for lb, p in sorted(seen.items(), key=lambda kv: styles[kv[0]]["number"])
    ]
    hollow = "hollow: dominated"
    if not all(p.ranked for p in points):
        hollow += "; (peer): transformers' own cache, never ranked (hollow)"
    out += [
        Line2D([], [], color="0.3", lw=1.1, label=front_note),
        Line2D([], [], ls="none", marker="o", mfc="none", mec="0.3", label=hollow),
    ]
    if any(p.x_ci or p.y_ci for p in points):
        out.append(Line2D([], [], color="0.3", marker="_", lw=0.9, label="95% interval"))
    return out + extra


#: points between two markers in the floor band, and between the band and the floor line
BAND_GAP = 2.0


def marker_radius(fig: Figure, line: Line2D) -> float:
    """Half the drawn width (pixels) of the marker of the one-point line ``line``, its edge
    included: (marker size + edge width) / 2 points."""
    return (line.get_markersize() + line.get_markeredgewidth()) / 2 * fig.dpi / 72


def spread_floor(
    fig: Figure, ax: Axes, drawn: list[tuple[Point, float, bool]], floor: float | None
) -> list[tuple[Point, float, bool]]:
    """Move the markers of values at or below ``floor`` (drawn on the floor line by
    :func:`_panel`, where several would hide one another) into a shaded band (gid
    ``floor-band``) below the line, which holds exactly those values: lanes :data:`BAND_GAP`
    points apart, the first one marker's width below the line (no marker above the line
    touches it), each marker in the first lane (from the top) where it overlaps no other,
    left to right; the axes extend down to hold the lanes.  Intervals and the frontier line
    follow their markers (an interval bound at or below the floor sits at its marker).  Call
    after the layout is final (pixel positions); returns ``drawn`` with the new y."""
    low = [i for i, (p, _, _) in enumerate(drawn) if floor is not None and p.y <= floor]
    if floor is None or not low:
        return drawn
    lines = {ln.get_gid(): ln for ln in ax.lines}
    marks = {p.label: lines[p.label] for p, _, _ in drawn}
    rad = {p.label: marker_radius(fig, marks[p.label]) for p, _, _ in drawn}
    gap = BAND_GAP * fig.dpi / 72
    band = max(rad[drawn[i][0].label] for i in low)
    slot = 2 * band + gap
    xpx = {i: ax.transData.transform((drawn[i][0].x, floor))[0] for i in low}
    lanes: list[list[int]] = []
    lane_of: dict[int, int] = {}
    for i in sorted(low, key=lambda i: (xpx[i], i)):
        r = rad[drawn[i][0].label]
        for n, lane in enumerate(lanes + [[]]):
            if all(abs(xpx[i] - xpx[j]) >= r + rad[drawn[j][0].label] + gap for j in lane):
                if n == len(lanes):
                    lanes.append([])
                lanes[n].append(i)
                lane_of[i] = n
                break
    top = max(rad.values()) + band + gap  # pixels from the floor line to the first lane
    _room_below(ax, floor, top + slot * (len(lanes) - 1) + band + gap)
    lo = ax.get_ylim()[0]
    ax.axhspan(lo, floor, color="0.93", lw=0, zorder=0, gid="floor-band")
    fy = ax.transData.transform((0, floor))[1]
    inv = ax.transData.inverted()
    out = list(drawn)
    for i in low:
        p, _, on = drawn[i]
        px = ax.transData.transform((p.x, floor))[0]
        y = float(inv.transform((px, fy - top - slot * lane_of[i]))[1])
        out[i] = (p, y, on)
        marks[p.label].set_ydata([y])
        for gid, ys in ((f"ci-y:{p.label}", p.y_ci), (f"ci-x:{p.label}", None)):
            bar = lines.get(gid)
            if bar is not None:
                bar.set_ydata([y if v <= floor else v for v in ys] if ys else [y, y])
    front = lines.get("frontier")
    if front is not None:
        front.set_data(*zip(*sorted({(p.x, y) for p, y, on in out if on})))
    _no_ticks_below(ax, floor)
    return out


def _no_ticks_below(ax: Axes, floor: float) -> None:
    """Fix the y ticks of ``ax`` (its limits are final) and blank the label of each tick below
    ``floor``: the band below the floor line holds values at or below the floor, drawn in
    lanes, not at their values, so a scale there would misread them (a tick at the floor keeps
    its label)."""
    lo, hi = ax.get_ylim()
    ticks = [float(t) for t in ax.get_yticks() if lo <= t <= hi]
    fmt = ax.yaxis.get_major_formatter()
    texts = fmt.format_ticks(ticks)
    below = floor - abs(floor) * 1e-9
    ax.set_yticks(ticks, [t if v >= below else "" for v, t in zip(ticks, texts)])
    ax.set_ylim(lo, hi)


def _room_below(ax: Axes, floor: float, depth: float) -> None:
    """Lower the y limit of ``ax`` (linear or log) until ``depth`` pixels lie between it and
    ``floor``; the top limit and the axes' place stay."""
    import math

    lo, hi = ax.get_ylim()
    height = ax.get_window_extent().height
    if ax.get_yscale() == "log":
        f, inv = math.log10, (lambda v: 10.0**v)
    else:
        f, inv = (lambda v: v), (lambda v: v)
    depth = min(depth, 0.5 * height)  # never more than half the axes
    need = depth * (f(hi) - f(floor)) / (height - depth)
    if f(floor) - f(lo) < need:
        ax.set_ylim(inv(f(floor) - need), hi)


#: points between two markers that :func:`nudge_markers` moves apart
NUDGE_GAP = 0.5


def nudge_markers(
    fig: Figure, ax: Axes, drawn: list[tuple[Point, float, bool]], floor: float | None
) -> int:
    """Draw each marker of ``ax`` whose box would overlap the box of another (close values:
    e.g. two configurations a few thousandths apart in both metrics) a few pixels to the side,
    with its intervals.  Markers on the frontier (its line runs through them) and in the floor
    band (apart already) stay; the others, left to right, go to the smallest horizontal
    offset, alternately right and left in steps of half a pixel, where their box (marker size
    + edge) is :data:`NUDGE_GAP` points clear of every box placed before (two frontier markers
    that overlap stay so: their values are the frontier's).  The offset is a transform of
    the marker's line (:class:`matplotlib.transforms.ScaledTranslation`): its data stays the
    value.  Call after :func:`spread_floor`; returns how many markers moved."""
    from matplotlib.transforms import ScaledTranslation

    lines = {ln.get_gid(): ln for ln in ax.lines}
    gap = NUDGE_GAP * fig.dpi / 72
    todo = []  # (x, y, half-width in pixels, label)
    for p, y, _ in drawn:
        (cx, cy), r = ax.transData.transform((p.x, y)), marker_radius(fig, lines[p.label])
        todo.append((float(cx), float(cy), r, p.label))
    # markers in the band (apart already) and on the frontier (its line runs through them) stay
    fixed = {p.label for p, _, on in drawn if on or (floor is not None and p.y <= floor)}
    placed = [(cx, cy, r) for cx, cy, r, lb in todo if lb in fixed]

    def clear(cx: float, cy: float, r: float) -> bool:
        return all(abs(cx - x) >= r + q + gap or abs(cy - y) >= r + q + gap for x, y, q in placed)

    moved = 0
    for cx, cy, r, label in sorted(todo):
        if label in fixed:
            continue
        dx = 0.0
        step = 0
        while not clear(cx + dx, cy, r):
            step += 1
            dx = (step + 1) // 2 * (1 if step % 2 else -1) * 0.5
        placed.append((cx + dx, cy, r))
        if dx:
            moved += 1
            shift = ScaledTranslation(dx / fig.dpi, 0, fig.dpi_scale_trans)
            for gid in (label, f"ci-y:{label}", f"ci-x:{label}"):
                if gid in lines:
                    lines[gid].set_transform(ax.transData + shift)
    return moved


def bar_boxes(ax: Axes, renderer: object) -> list[tuple[float, float, float, float]]:
    """The pixel extents (x0, y0, x1, y1) of the interval bars of ``ax`` (gid ``ci-x:`` /
    ``ci-y:``: the segment and its end caps)."""
    out = []
    for ln in ax.lines:
        if str(ln.get_gid() or "").startswith("ci-"):
            b = ln.get_window_extent(renderer)
            out.append((b.x0, b.y0, b.x1, b.y1))
    return out


def frontier_segments(ax: Axes) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """The segments (pixels) of the frontier line (gid ``frontier``) of ``ax``."""
    out = []
    for ln in ax.lines:
        if ln.get_gid() == "frontier":
            pts = [tuple(map(float, v)) for v in ax.transData.transform(ln.get_xydata())]
            out += list(zip(pts[:-1], pts[1:]))
    return out


def crosses(
    seg: tuple[tuple[float, float], tuple[float, float]], box: tuple[float, float, float, float]
) -> bool:
    """Whether the segment ``seg`` = ((x0, y0), (x1, y1)) meets the box (x0, y0, x1, y1), its
    inside included (Liang-Barsky clipping)."""
    (ax_, ay), (bx, by) = seg
    dx, dy = bx - ax_, by - ay
    t0, t1 = 0.0, 1.0
    for p, q in ((-dx, ax_ - box[0]), (dx, box[2] - ax_), (-dy, ay - box[1]), (dy, box[3] - ay)):
        if p == 0:
            if q < 0:
                return False
            continue
        t = q / p
        if p < 0:
            t0 = max(t0, t)
        else:
            t1 = min(t1, t)
        if t0 > t1:
            return False
    return True


#: inches of a figure's key (7-point text): per entry, per wrapped line within an entry, and
#: the title and axis text above and below it
KEY_ENTRY, KEY_WRAP, KEY_TOP = 0.17, 0.12, 1.6
#: a label further than this many placement steps from its marker gets a leader line
LEADER_STEP = 2


def place_labels(fig: Figure, ax: Axes, items: list[tuple[Point, float, str, str]]) -> int:
    """Write ``text`` beside each ``(point, drawn y, text, short)`` on ``ax`` at the first of
    increasingly far offsets (8 directions) where its text overlaps no marker (where it is
    drawn: :func:`nudge_markers`), no segment of the frontier line (:func:`frontier_segments`)
    and no interval bar (:func:`bar_boxes`), it stays inside the axes, and its extent (text,
    with the leader line drawn to a far one: the box from the marker to the text) overlaps the
    extent of no label placed before; ``short`` (its number in the key) where ``text`` has no
    such place, and nothing where neither has.  When some find no place, a second try places
    those first and is kept if it misses fewer.  Call after the layout is final (and after
    :func:`spread_floor` and :func:`nudge_markers`).  Returns how many were not written."""
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    lines = {ln.get_gid(): ln for ln in ax.lines}
    # each marker where it is drawn (its line's transform: nudged ones aside)
    px = [lines[p.label].get_transform().transform((p.x, y)) for p, y, _, _ in items]
    marks = [(x, y, p.size * fig.dpi / 72 * 0.6 + 1) for (p, _, _, _), (x, y) in zip(items, px)]
    segments = frontier_segments(ax)
    bars = bar_boxes(ax, renderer)
    boxes: list[tuple[float, float, float, float]] = []

    def apart(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
        return a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]

    def free(b: tuple[float, float, float, float], extent: tuple[float, ...]) -> bool:
        x0, y0, x1, y1 = b
        if x0 < frame.x0 + 2 or y0 < frame.y0 + 2 or x1 > frame.x1 - 2 or y1 > frame.y1 - 2:
            return False
        if not all(apart(extent, c) for c in boxes):  # type: ignore[arg-type]
            return False
        if any(crosses(seg, b) for seg in segments):
            return False
        if not all(apart(b, c) for c in bars):
            return False
        return not any(
            x0 < mx + r and mx - r < x1 and y0 < my + r and my - r < y1 for mx, my, r in marks
        )

    def assign(order: list[int]) -> tuple[dict[int, tuple], list[int]]:
        """Place the labels in ``order``: index -> (text, x, y, step), and the indices missed."""
        boxes.clear()
        got: dict[int, tuple] = {}
        miss = []
        for i in order:
            (_, _, *texts), (cx, cy), (_, _, r) = items[i], px[i], marks[i]
            found = None
            for text in dict.fromkeys(texts):
                found = _spot(ax, renderer, text, (cx, cy, r), free)
                if found is not None:
                    break
            if found is None:
                miss.append(i)
                continue
            sx, sy, extent, step = found
            boxes.append(extent)
            got[i] = (text, sx, sy, step)
        return got, miss

    # a label that found no room goes first in a second try (an earlier label's leader may
    # have taken its only place); the try that misses fewer is drawn
    placed, miss = assign(list(range(len(items))))
    if miss:
        retry = assign(miss + [i for i in range(len(items)) if i not in miss])
        if len(retry[1]) < len(miss):
            placed, miss = retry
    k = 72 / fig.dpi  # pixels to points: the same place at any saved dpi
    for i, (text, sx, sy, step) in sorted(placed.items()):
        (p, y, *_), (cx, cy) = items[i], px[i]
        line = {"arrowstyle": "-", "color": "0.55", "lw": 0.5} if step > LEADER_STEP else None
        ax.annotate(
            text,
            (p.x, y),
            xycoords=lines[p.label].get_transform(),  # at the marker, nudged or not
            xytext=((sx - cx) * k, (sy - cy) * k),
            textcoords="offset points",
            ha="center",
            va="center",
            fontsize=7,
            zorder=5,
            arrowprops=line,
            annotation_clip=False,
        )
    return len(miss)


def _spot(
    ax: Axes,
    renderer: object,
    text: str,
    mark: tuple[float, float, float],
    free: Callable[[tuple[float, float, float, float], tuple[float, ...]], bool],
) -> tuple[float, float, tuple[float, float, float, float], int] | None:
    """The first place (pixels) for ``text`` beside the marker ``mark`` = (x, y, radius) that
    ``free(text box, extent)`` accepts: ``(x, y, extent, step)``, or None."""
    cx, cy, r = mark
    probe = ax.text(0, 0, text, fontsize=7)
    ext = probe.get_window_extent(renderer)
    probe.remove()
    w, h = ext.width + 2, ext.height + 2
    dirs = [(1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, 1), (1, -1), (-1, -1)]
    for step in range(12):
        gap = 1 + 5 * step
        for ux, uy in dirs:
            sx, sy = cx + ux * (r + gap + w / 2), cy + uy * (r + gap + h / 2)
            box = (sx - w / 2, sy - h / 2, sx + w / 2, sy + h / 2)
            extent = box
            if step > LEADER_STEP:  # the leader runs from the marker to the text
                extent = (min(box[0], cx), min(box[1], cy), max(box[2], cx), max(box[3], cy))
            if free(box, extent):
                return sx, sy, extent, step
    return None


def _figure(
    panels: list[tuple[str, list[Point]]],
    axes: tuple[str, str],
    labels: tuple[str, str],
    title: list[str],
    styles: dict[str, Style],
    floor: float | None,
    extra: list[Artist] | None = None,
) -> Figure:
    """A figure of one Pareto panel per ``(subtitle, points)``, sharing the key at the right;
    ``axes`` = (x, y) metrics, ``labels`` their axis text, ``title`` its lines."""
    from matplotlib.lines import Line2D

    panels = [(sub, merge_points(ps, styles)) for sub, ps in panels]
    pts = [p for _, ps in panels for p in ps]
    n = len({p.label for p in pts})
    fig = new_figure(
        figsize=(6.5 * len(panels) + 4.2, max(6.5, 2.4 + 0.16 * n)), layout="constrained"
    )
    drawn = []
    for ax, (sub, ps) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        drawn.append((ax, _panel(ax, ps, axes[1], floor, styles)))
        ax.set_xlabel(labels[0], fontsize=8)
        ax.set_ylabel(labels[1], fontsize=8)
        ax.set_title(sub, fontsize=9)
    fronts = [sum(on for _, _, on in d) for _, d in drawn]
    note = "Pareto frontier (line through the filled markers)"
    if max(fronts) == 1:
        note = "Pareto frontier: one point, it dominates every other (no line)"
    extra = list(extra or [])
    if floor is not None and any(p.y <= floor for p in pts):
        extra.append(Line2D([], [], color="0.45", ls=":", label=floor_text(axes[1], floor)))
    handles = _key(pts, styles, note, extra)
    for h in handles:  # the key stays narrow: long entries wrap
        h.set_label(textwrap.fill(h.get_label(), 52, subsequent_indent="   "))
    ncols = 2 if len(handles) > 48 else 1
    # the key hangs from the axes' top: the figure is tall enough for its wrapped entries
    wraps = sum(h.get_label().count("\n") for h in handles)
    need = KEY_TOP + (KEY_ENTRY * len(handles) + KEY_WRAP * wraps) / ncols
    fig.set_figheight(max(fig.get_figheight(), need))
    drawn[-1][0].legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        fontsize=7,
        frameon=False,
        ncols=ncols,
        handlelength=1.6,
    )
    better = f"{'upper' if direction(axes[1]) == HIGHER else 'lower'}-left is better"
    lines = [*title[:1], f"filled: Pareto frontier, hollow: dominated; {better}", *title[1:]]
    fig.suptitle(
        "\n".join(textwrap.fill(t, 150, break_on_hyphens=False) for t in lines), fontsize=9
    )
    fig.canvas.draw()  # the layout, then freeze it: labels go where the axes now are
    fig.set_layout_engine("none")
    for ax, d in drawn:
        d = spread_floor(fig, ax, d, floor)
        nudge_markers(fig, ax, d, floor)
        named = len(d) <= MAX_NAMED
        items = [
            (
                p,
                y,
                p.shown if named else str(styles[p.label]["number"]),
                str(styles[p.label]["number"]),
            )
            for p, y, _ in d
        ]
        order = sorted(range(len(items)), key=lambda i: (items[i][0].label != d[0][0].label, i))
        missed = place_labels(fig, ax, [items[i] for i in order])
        if missed:
            ax.set_title(
                f"{ax.get_title()} ({missed} label(s) without room: see the key)", fontsize=9
            )
    return fig


def _sections(records: list[Record]) -> dict[str, str]:
    """Label -> headline section (``a``/``b``/``base``/``peer``): that of its headline row, else
    ``base`` for ``full``, ``b`` for nominal value bits >= 16, else ``a``."""
    try:
        out = {r["label"]: r["section"] for r in rows(records)}
    except ValueError:
        out = {}
    for r in records:
        if r.label not in out:
            vb = r.metrics.get("nominal_value_bits", 0)
            out[r.label] = "base" if r.method == BASELINE else ("b" if vb >= BASE_BITS else "a")
    return out


def section_figure(records: list[Record], section: str, x: str, y: str) -> Figure | str:
    """The Pareto figure of headline section ``section`` (``"a"``/``"b"``) with ``x``/``y`` in
    ``bytes_ratio``, ``next_token_kl``, :data:`DECODE` (each with its 95% interval where the
    record has one: the perplexity record's KL, the latency record's step), or the reason it
    is not drawn (str); the title names the records of the rows drawn."""
    recs = {
        # bytes of the very cache the quality was scored in (one cache state per row)
        "bytes_ratio": _group(records, "bytes_total", "perplexity"),
        "next_token_kl": _group(records, "next_token_kl", "perplexity"),
        DECODE: _group(records, DECODE, "latency"),
    }
    for m in (x, y):
        if not recs[m]:
            what = "latency" if m == DECODE else "perplexity"
            return f"no {what} records with {'bytes_total' if m == 'bytes_ratio' else m}"
    try:
        table = rows(recs["next_token_kl"])
    except ValueError as exc:
        return str(exc)
    decode = {r.label: r for r in recs[DECODE]}
    points = []
    for row in table:
        q = row["sources"]["perplexity"]
        vals = {
            **row,
            DECODE: decode[row["label"]].metrics[DECODE] if row["label"] in decode else None,
        }
        if row["section"] in (section, "base") and vals[x] is not None and vals[y] is not None:
            lat = decode.get(row["label"])
            ci = {"next_token_kl": _ci(q, "next_token_kl"), DECODE: lat and _ci(lat, DECODE)}
            name = row_label(row)  # the table's: "(budget not reached ...)" where it says so
            points.append(Point(row["label"], vals[x], vals[y], ci.get(x), ci.get(y), name=name))
    if sum(p.label not in _base(records) for p in points) < 2:
        return f"fewer than two configurations of section ({section}) have {x} and {y}"
    drawn = {p.label for p in points}  # the title names what is drawn (no peer: not a row here)
    used = {m: [r for r in recs[m] if r.label in drawn] for m in (x, y)}
    floor = noise_floor(y, recs[y]) if y in NONNEG else None
    what = {DECODE: "step", "next_token_kl": "KL", "bytes_ratio": "bytes"}
    title = [
        f"{SECTIONS[section]}: {_short(y)} vs {_short(x)}",
        setting({what[m]: rs for m, rs in used.items()}),
    ]
    label = tuple(f"{NAMES[m]}\n{describe(recs[m][0])}" for m in (x, y))
    return _figure([("", points)], (x, y), label, title, style_table(records), floor)


def _base(records: list[Record]) -> set[str]:
    return {r.label for r in records if r.method == BASELINE}


def combined_figure(records: list[Record], section: str) -> Figure | str:
    """Section ``section``'s next-token KL against bytes vs 16-bit, marker size by the decode
    step ratio at the longest latency context (a marker of the smallest size and ``step -`` in
    the key where not measured), or the reason it is not drawn."""
    from matplotlib.lines import Line2D

    quality = _group(records, "next_token_kl", "perplexity")
    try:
        table = rows(quality)
    except ValueError as exc:
        return str(exc)
    chosen = [
        r
        for r in table
        if r["section"] in (section, "base")
        and r["bytes_ratio"] is not None
        and r["next_token_kl"] is not None
    ]
    if sum(r["section"] != "base" for r in chosen) < 2:
        return f"fewer than two configurations of section ({section}) have bytes_ratio and next_token_kl"
    longest: dict[str, Record] = {}
    for r in _group(records, DECODE, "latency", drop=("context",)):
        if r.label not in longest or (context(r) or 0) > (context(longest[r.label]) or 0):
            longest[r.label] = r
    step = {lb: r.metrics[DECODE] for lb, r in longest.items()}
    known = [step[r["label"]] for r in chosen if r["label"] in step] or [1.0]
    lo, hi = min(known), max(known)

    def size(v: float) -> float:
        return 5.0 + (10.0 * (v - lo) / (hi - lo) if hi > lo else 4.0)

    points = [
        Point(
            r["label"],
            r["bytes_ratio"],
            r["next_token_kl"],
            y_ci=_ci(r["sources"]["perplexity"], "next_token_kl"),
            size=size(step[r["label"]]) if r["label"] in step else 5.0,
            note=f"  (step {step[r['label']]:.2f})" if r["label"] in step else "  (step -)",
            name=row_label(r),
        )
        for r in chosen
    ]
    ctxs = sorted({context(r) for r in longest.values() if context(r)})
    sizes = [
        Line2D(
            [],
            [],
            ls="none",
            marker="o",
            mfc="none",
            mec="0.3",
            ms=size(v),
            label=f"step {v:.2f}x full",
        )
        for v in sorted({lo, (lo + hi) / 2, hi})
    ]
    quality = [r["sources"]["perplexity"] for r in chosen]
    title = [
        f"{SECTIONS[section]}: next-token KL vs bytes, marker size: decode step vs full at "
        f"{'/'.join(map(str, ctxs[-1:])) or '-'} tokens (the longest latency context)",
        setting(
            {
                "KL, bytes": quality,
                "step": [r for r in longest.values() if r.label in {p.label for p in points}],
            }
        ),
    ]
    q = quality[0]
    labels = (f"{NAMES['bytes_ratio']}\n{describe(q)}", f"{NAMES['next_token_kl']}\n{describe(q)}")
    floor = noise_floor("next_token_kl", quality)
    return _figure(
        [("", points)],
        ("bytes_ratio", "next_token_kl"),
        labels,
        title,
        style_table(records),
        floor,
        sizes,
    )


def pareto_figure(records: list[Record], x: str, y: str, title: str = "") -> Figure | str:
    """The Pareto figure of metric ``y`` (from the one workload most labels have) against
    metric ``x`` (from the same record, else from another record of the label), one point per
    label, configurations whose values stay at 16 bits on their own axes (:data:`FACETS`), or
    the reason it is not drawn (str).  Against a ``nominal_*`` x, a key entry names the
    measured (``effective_*``) bits of the same record where they differ by more than 0.5."""
    ys = _group(records, y)
    xs = {r.label: r.metrics[x] for r in reversed(records) if x in r.metrics}
    xs.update({r.label: r.metrics[x] for r in ys if x in r.metrics})
    section, base, peers = _sections(records), _base(records), peer_labels(records)
    vbits = {
        r.label: r.metrics["nominal_value_bits"]
        for r in reversed(records)
        if "nominal_value_bits" in r.metrics
    }
    facets: dict[str, list[Point]] = {"a": [], "b": []}
    measured = x.replace("nominal_", "effective_") if x.startswith("nominal_") else None
    for r in ys:
        if r.label not in xs:
            continue
        eff = r.metrics.get(measured) if measured else None
        note = f"  (stores {eff:.1f})" if eff is not None and abs(eff - xs[r.label]) > 0.5 else ""
        peer = r.label in peers
        p = Point(
            r.label,
            xs[r.label],
            r.metrics[y],
            _ci(r, x),
            _ci(r, y),
            note=note,
            name=r.label + PEER_MARK if peer else "",
            ranked=not peer,
        )
        if r.label in base:
            where = ["a", "b"]
        elif peer:  # a peer by its values: kept at 16 bits or not
            where = ["b" if vbits.get(r.label, 0) >= BASE_BITS else "a"]
        else:
            where = ["b" if section[r.label] == "b" else "a"]
        for f in where:
            facets[f].append(p)
    panels = [(FACETS[f], ps) for f, ps in facets.items() if any(p.label not in base for p in ps)]
    if sum(p.label not in base for _, ps in panels for p in ps) < 2:
        return f"fewer than two configurations have {x} and {y}"
    if len(panels) == 1:
        panels = [("", panels[0][1])]
    head = title or f"{_short(y)} vs {_short(x)}, all configurations"
    lines = [head, setting({_short(y): ys})]
    labels = (
        NAMES.get(x, x)
        + ("\n(stores: measured bits of the same record, in the key)" if measured else ""),
        f"{NAMES.get(y, y)}\n{describe(ys[0])}",
    )
    floor = noise_floor(y, ys) if y in NONNEG else None
    return _figure(panels, (x, y), labels, lines, style_table(records), floor)


def threads_text(recs: list[Record]) -> str:
    """``"threads 1"``: the intra-op threads the records' timed steps ran at (manifest
    ``step_threads``, else ``threads``), each distinct count once; ``"threads not recorded"``."""
    got = sorted(
        {
            str(r.manifest.get("step_threads", r.manifest.get("threads")))
            for r in recs
            if r.manifest.get("step_threads", r.manifest.get("threads")) is not None
        }
    )
    return f"threads {', '.join(got)}" if got else "threads not recorded"


def sweep_figure(records: list[Record], wtype: str, y: str) -> Figure | str:
    """``y`` against context depth, one line per label (its style of :func:`style_table`), from
    the ``wtype`` records of one workload but its context; a label measured at one context only
    is a marker without a line.  A point whose record carries ``<y>_ci_low`` / ``_ci_high`` has
    its 95% interval as an error bar (a collection per label, gid ``ci-y:<label>``: e.g. the
    step ratio vs ``full`` of ``make bench-latency``); a latency figure's title names the
    steps' threads (:func:`threads_text`).  The reason (str) when the records hold fewer than
    two contexts."""
    recs = _group(records, y, wtype, drop=("context",))
    contexts = sorted({r.workload.get("context") for r in recs} - {None})
    if not recs:
        return f"no {wtype} records with {y}"
    if len(contexts) < 2:
        return f"{wtype} records of {y} at {len(contexts)} context(s) {contexts}: no sweep to draw"
    scale = 2**-20 if "bytes" in y else 1.0  # bytes read better in MiB
    series: dict[str, list[tuple[int, float]]] = {}
    bars: dict[str, list[tuple[int, float, float, float]]] = {}  # (x, y, low, high)
    for r in sorted(recs, key=lambda r: r.workload.get("context") or 0):
        x, v = r.workload["context"], r.metrics[y] * scale
        series.setdefault(r.label, []).append((x, v))
        lo, hi = r.metrics.get(f"{y}_ci_low"), r.metrics.get(f"{y}_ci_high")
        if lo is not None and hi is not None:
            bars.setdefault(r.label, []).append((x, v, lo * scale, hi * scale))
    styles, peers = style_table(records), peer_labels(records)
    n = len(series)
    fig = new_figure(figsize=(10.5, max(5.5, 2.4 + 0.16 * n)), layout="constrained")
    ax = fig.subplots()
    for label in sorted(series, key=lambda lb: styles[lb]["number"]):
        st = styles[label]
        ax.plot(
            *zip(*series[label]),
            ls="-" if len(series[label]) > 1 else "none",
            marker=st["marker"],
            color=st["color"],
            ms=5,
            lw=1.2,
            label=f"{st['number']:>2} {label}{PEER_MARK * (label in peers)}",
            gid=label,
        )
        if label in bars:
            xs, vs, los, his = zip(*bars[label])
            err = [[v - lo for v, lo in zip(vs, los)], [hi - v for v, hi in zip(vs, his)]]
            eb = ax.errorbar(xs, vs, yerr=err, fmt="none", ecolor=st["color"], elinewidth=0.9)
            eb.lines[2][0].set_gid(f"ci-y:{label}")
            eb.set_label(None)
    _log_axis(ax, "x", contexts)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    bounds = [b for pts in bars.values() for _, _, lo, hi in pts for b in (lo, hi)]
    _log_axis(ax, "y", [v for pts in series.values() for _, v in pts] + bounds)
    if y.endswith("_ratio"):
        ax.axhline(1.0, color="0.4", lw=1, ls="--", zorder=0)
    ax.grid(alpha=0.3)
    cpu = wtype == "latency" and any(r.manifest.get("timing_note") for r in recs)
    head = f"{NAMES.get(y, y)} vs context depth" + (" (CPU: framework overhead dominates)" * cpu)
    line = setting({wtype: recs}, f"context {', '.join(map(str, contexts))} tokens")
    if wtype == "latency":
        line += f"; {threads_text(recs)}"
    ax.set(
        xlabel="context depth (tokens)",
        ylabel=f"{NAMES.get(y, y)}\n{describe(recs[0], drop=('context',))}",
    )
    fig.suptitle(
        textwrap.fill(head, 150, break_on_hyphens=False)
        + "\n"
        + textwrap.fill(line, 150, break_on_hyphens=False),
        fontsize=9,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False)
    return fig


def figures(records: list[Record]) -> Iterator[tuple[str, Figure | str]]:
    """``(name, figure or the reason it is not drawn)`` for every figure: per headline section
    the three Pareto pairs and the combined figure, quality (and directed lm-eval task metrics
    present) against nominal key bits, and latency / memory sweeps over context, one at a time
    (:func:`new_figure`: held by no one but the caller, nothing to close)."""
    pairs = {
        "kl_vs_bytes": ("bytes_ratio", "next_token_kl"),
        "kl_vs_decode": (DECODE, "next_token_kl"),
        "bytes_vs_decode": (DECODE, "bytes_ratio"),
    }
    for section in SECTIONS:
        for name, (x, y) in pairs.items():
            yield f"headline_{section}_{name}", section_figure(records, section, x, y)
        yield f"headline_{section}_kl_vs_bytes_by_step", combined_figure(records, section)
    tasks = sorted(
        {m for r in records for m in r.metrics if m.startswith("lm_eval.") and direction(m)}
        - {m for r in records for m in r.metrics if m.endswith("_ratio")}
    )
    for y in (*QUALITY, *tasks):
        safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in y)
        name = f"pareto_{safe}_vs_nominal_key_bits"
        if any(y in r.metrics for r in records):
            yield name, pareto_figure(records, "nominal_key_bits", y)
        else:
            yield name, f"no records with {y}"
    for wtype, y in SWEEPS:
        yield f"{y}_vs_context", sweep_figure(records, wtype, y)
    if equal_bytes.has_families(records):  # section (c) of the report
        yield "eviction_vs_quantization", equal_bytes.figure(records)


def _save(fig: Figure, path: Path, dpi: int = 130) -> Path:
    fig.savefig(path, dpi=dpi)
    return path


def write_plots(
    records: list[Record], folder: str | Path, skipped: list[str] | None = None
) -> list[Path]:
    """Write every figure of :func:`figures` into ``folder`` as PNG; returns the paths.  The
    ones not drawn are appended to ``skipped`` as ``"<name>: <reason>"``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, fig in figures(records):
        if isinstance(fig, str):
            if skipped is not None:
                skipped.append(f"{name}: {fig}")
        else:
            out.append(_save(fig, folder / f"{name}.png"))
    return out


def write_listed(
    records: list[Record], results: list[str], out: str | None, file: TextIO | None = None
) -> list[Path]:
    """:func:`write_plots` into ``out`` (default: the first of ``results``, or the folder of that
    file), printing ``wrote <path>`` and ``not drawn: <name>: <reason>`` lines to ``file``
    (default stdout); returns the paths."""
    first, skipped = Path(results[0]), []
    paths = write_plots(records, out or (first if first.is_dir() else first.parent), skipped)
    for line in [f"wrote {p}" for p in paths] + [f"not drawn: {s}" for s in skipped]:
        print(line, file=file)
    return paths


def pareto_plot(records: list[Record], x: str, y: str, path: Path, title: str = "") -> Path | None:
    """Write :func:`pareto_figure` to ``path`` (PNG); ``None`` when it is not drawn."""
    fig = pareto_figure(records, x, y, title)
    return None if isinstance(fig, str) else _save(fig, Path(path))


def load(paths: list[str]) -> list[Record]:
    """Records of result folders, record files and export files (``kvbench export``)."""
    from kvbench.report.export import load_export

    out = []
    for p in paths:
        if Path(p).is_file() and "export_version" in json.loads(Path(p).read_text()):
            out += [Record.from_json(r) for r in load_export(p)["records"]]
        else:
            out += load_records(p)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="result folder(s), record files or export files")
    p.add_argument(
        "--out", default=None, help="folder for the PNG files (default: the first results folder)"
    )


def main(args: argparse.Namespace) -> int:
    records = load(args.results)
    if not records:
        raise ValueError(f"no records in {args.results}")
    write_listed(records, args.results, args.out)
    return 0
