"""Matplotlib figures of result records (PNG, Agg backend): ``kvbench plot`` and ``kvbench report``.

:func:`figures` yields every figure (file name = key + ``.png``) or the reason it is not drawn;
which figures exist and the rules each follows (style per method family, one point per label,
frontier, noise floor of :data:`NONNEG`, log axes past :data:`LOG_SPAN`, label placement):
docs/design.md#plots.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kvbench.bench.metrics import HIGHER, direction
from kvbench.bench.records import Record, canonical, load_records
from kvbench.cache.registry import BASELINE, METHODS
from kvbench.report.headline import SECTIONS, rows
from kvbench.report.pareto import pareto_mask

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text

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
#: an axis is logarithmic when its values above the noise span more than this factor
LOG_SPAN = 20.0
#: a figure with more points labels only the frontier and ``full``
MAX_LABELS = 30
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
COLORS = "#1f77b4 #ff7f0e #2ca02c #d62728 #9467bd #8c564b #e377c2 #7f7f7f #bcbd22 #17becf".split()
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "<", ">")  # 9 and 10 coprime: 90 distinct pairs


def _short(metric: str) -> str:
    short = {"bytes_ratio": "bytes", DECODE: "decode step"}
    return short.get(metric) or NAMES.get(metric, metric).split(" (")[0].split(" vs ")[0]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def family_styles(names: Iterable[str] = ()) -> dict[str, dict[str, str]]:
    """``{family: {"color", "marker"}}`` for every registered method name and ``names``: the
    i-th of (built-ins sorted, plugins sorted, other ``names`` sorted; ``full`` left out) gets
    ``COLORS[i % 10]`` and ``MARKERS[i % 9]``; ``full`` black ``*``."""
    entries = METHODS.entries()
    order = sorted(entries, key=lambda n: (not entries[n].builtin, n))
    order += sorted(set(names) - set(order))
    order = [n for n in order if n != BASELINE]
    out = {n: {"color": COLORS[i % 10], "marker": MARKERS[i % 9]} for i, n in enumerate(order)}
    out[BASELINE] = {"color": "#000000", "marker": "*"}
    return out


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


def noise_floor(values: list[float], base: list[float]) -> tuple[float, float]:
    """``(noise, floor)`` of a metric that cannot be negative (docs/design.md#plots): ``noise``
    the largest of ``|base|`` (``full``'s own values) and ``|v|`` of negative ``values``; ``floor``
    max(noise, a tenth of the smallest value above the noise), ``noise`` when none is above."""
    noise = max([abs(v) for v in base] + [-v for v in values if v < 0] + [0.0])
    above = [v for v in values if v > noise]
    return noise, max(noise, min(above) / 10) if above else noise


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


def _finish(
    fig: Figure,
    ax: Axes,
    xlabel: str,
    ylabel: str,
    title: str,
    handles: list[Artist] | None = None,
) -> None:
    """Axis labels, title, grid, the legend right of the axes, tight layout."""
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    kw = {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "frameon": False}
    ax.legend(**kw) if handles is None else ax.legend(handles=handles, **kw)
    fig.tight_layout()


def scatter_figure(
    points: list[tuple[str, str, float, float]],
    x: str,
    y: str,
    text: tuple[str, str, str],
    styles: dict[str, dict[str, str]],
) -> Figure:
    """A Pareto figure of ``points`` = ``[(label, family, x value, y value)]`` (one per label)
    by the rules of docs/design.md#plots; ``x``/``y`` name the metrics (direction, noise
    floor), ``text`` is (x label, y label, title).  Each point is a ``Line2D`` whose gid is its
    label."""
    from matplotlib.lines import Line2D

    fig, ax = _plt().subplots(figsize=(10, 6.5))
    higher, ys = direction(y) == HIGHER, [p[3] for p in points]
    base = {i for i, p in enumerate(points) if p[1] == BASELINE}
    noise, floor = noise_floor(ys, [ys[i] for i in base]) if y in NONNEG else (None, None)
    low = {i for i, v in enumerate(ys) if noise is not None and v <= noise}
    drawn = [floor if i in low else v for i, v in enumerate(ys)]
    ranked = [i for i in range(len(points)) if i not in base]
    mask = pareto_mask([points[i][2] for i in ranked], [ys[i] for i in ranked], higher)
    front = {i for i, on in zip(ranked, mask) if on}
    dot = {"ls": "none", "mew": 1.3, "zorder": 3, "clip_on": False}
    for i, (label, fam, xv, _) in enumerate(points):
        c, fill = styles[fam]["color"], i in front | base
        ax.plot(
            [xv],
            [drawn[i]],
            mec=c,
            mfc=c if fill else "none",
            ms=9 if i in base else 7,
            marker=styles[fam]["marker"],
            gid=label,
            **dot,
        )
    handles = [
        Line2D([], [], ls="none", label=f, **styles[f]) for f in sorted({p[1] for p in points})
    ]
    if len(front) > 1:
        line = sorted((points[i][2], drawn[i]) for i in front)
        handles += ax.plot(
            *zip(*line),
            drawstyle="steps-post",
            color="0.35",
            lw=1,
            zorder=2,
            gid="frontier",
            label="Pareto frontier (filled markers)",
        )
    handles += [
        Line2D([], [], ls="none", marker="o", mfc="none", mec="0.4", label="hollow: dominated")
    ]
    if low:
        handles += ax.plot(
            [points[i][2] for i in sorted(low)],
            [floor] * len(low),
            color="k",
            ms=12,
            ls="none",
            marker=r"$\downarrow$",
            zorder=4,
            gid="noise",
            label=f"<= noise of full ({noise:.2g}): drawn at {floor:.2g}",
        )
    _log_axis(ax, "x", [p[2] for p in points])
    _log_axis(ax, "y", drawn)
    if ax.get_yscale() == "log" and low:
        ax.axhline(floor, color="0.5", ls=":", lw=1, zorder=1, gid="floor")
    # one label per drawn position (coincident points share it), the frontier's and full's first
    at: dict[tuple[float, float], list[str]] = {}
    for i in sorted(range(len(points)), key=lambda i: i not in front | base):
        if len(points) <= MAX_LABELS or i in front | base:  # else the legend names them
            name = points[i][0] + (" (<= noise)" if i in low else "")
            at.setdefault((points[i][2], drawn[i]), []).append(name)
    texts = [ax.text(*xy, " = ".join(labs), fontsize=7, zorder=5) for xy, labs in at.items()]
    ax.margins(0.08)
    rule = f"filled: Pareto frontier, hollow: dominated; {'upper' if higher else 'lower'}-left is better"
    _finish(fig, ax, text[0], text[1], f"{text[2]}\n({rule})", handles)
    hidden = _place(fig, ax, texts, [p[2] for p in points], drawn)
    if hidden:  # same two lines: the layout stands
        ax.set_title(f"{text[2]}\n({rule}; {hidden} overlapping label(s) left out)", fontsize=10)
    return fig


def _place(fig: Figure, ax: Axes, texts: list[Text], xs: list[float], ys: list[float]) -> int:
    """Move labels off each other and off the points ``xs, ys`` (adjustText, a fixed number
    of steps), leader lines to their points; then hide each label that still overlaps one
    before it in ``texts``.  Returns how many were hidden."""
    from adjustText import adjust_text

    arrows = adjust_text(
        texts,
        x=list(xs),
        y=list(ys),
        ax=ax,
        iter_lim=500,
        arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.5},
    )[1]
    renderer, kept, hidden = fig.canvas.get_renderer(), [], 0
    for t in texts:
        box = t.get_window_extent(renderer)
        if any(box.overlaps(k) for k in kept):
            hidden += 1
            # adjustText's arrows: FancyArrowPatch (patchA: its text) or, for transforms that
            # cannot take one, an Annotation, which has no patchA
            for a in [t] + [a for a in arrows if getattr(a, "patchA", None) is t]:
                a.set_visible(False)
        else:
            kept.append(box)
    return hidden


def section_figure(records: list[Record], section: str, x: str, y: str) -> Figure | str:
    """The Pareto figure of headline section ``section`` (``"a"``/``"b"``) with ``x``/``y`` in
    ``bytes_ratio``, ``next_token_kl``, :data:`DECODE`, or the reason it is not drawn (str)."""
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
    decode = {r.label: r.metrics[DECODE] for r in recs[DECODE]}
    method = {r.label: r.method for rs in recs.values() for r in rs}
    points = []
    for row in table:
        vals = {**row, DECODE: decode.get(row["label"])}
        if (
            row["section"] in (section, "base")
            and vals.get(x) is not None
            and vals.get(y) is not None
        ):
            points.append((row["label"], method[row["label"]], vals[x], vals[y]))
    if sum(p[1] != BASELINE for p in points) < 2:
        return f"fewer than two configurations of section ({section}) have {x} and {y}"
    label = {m: f"{NAMES[m]}\n{describe(recs[m][0])}" for m in (x, y)}
    title = f"{SECTIONS[section]}: {_short(y)} vs {_short(x)}"
    styles = family_styles(r.method for r in records)
    return scatter_figure(points, x, y, (label[x], label[y], title), styles)


def pareto_figure(records: list[Record], x: str, y: str, title: str = "") -> Figure | str:
    """The Pareto figure of metric ``y`` (from the one workload most labels have) against
    metric ``x`` (from the same record, else from another record of the label), one point per
    label, or the reason it is not drawn (str)."""
    ys = _group(records, y)
    xs = {r.label: r.metrics[x] for r in reversed(records) if x in r.metrics}
    xs.update({r.label: r.metrics[x] for r in ys if x in r.metrics})
    points = [(r.label, r.method, xs[r.label], r.metrics[y]) for r in ys if r.label in xs]
    if sum(p[1] != BASELINE for p in points) < 2:
        return f"fewer than two configurations have {x} and {y}"
    styles = family_styles(r.method for r in records)
    ylabel = f"{NAMES.get(y, y)}\n{describe(ys[0])}"
    title = title or f"{_short(y)} vs {_short(x)}, all configurations"
    return scatter_figure(points, x, y, (NAMES.get(x, x), ylabel, title), styles)


def sweep_figure(records: list[Record], wtype: str, y: str) -> Figure | str:
    """``y`` against context depth, one line per label (style by family, line style by label
    within it), from the ``wtype`` records of one workload but its context; a label measured
    at one context only is a marker without a line.  The reason (str) when the records hold
    fewer than two contexts."""
    recs = _group(records, y, wtype, drop=("context",))
    contexts = sorted({r.workload.get("context") for r in recs} - {None})
    if len(contexts) < 2:
        return f"{wtype} records of {y} at {len(contexts)} context(s) {contexts}: no sweep to draw"
    scale = 2**-20 if "bytes" in y else 1.0  # bytes read better in MiB
    series: dict[str, list[tuple[int, float]]] = {}
    for r in sorted(recs, key=lambda r: r.workload.get("context") or 0):
        series.setdefault(r.label, []).append((r.workload["context"], r.metrics[y] * scale))
    method, styles = {r.label: r.method for r in recs}, family_styles(r.method for r in records)
    fig, ax = _plt().subplots(figsize=(10, 5.5))
    rank: dict[str, int] = {}
    for label in sorted(series):
        k = rank[method[label]] = rank.get(method[label], -1) + 1  # line style within a family
        ls = ("-", "--", ":", "-.")[k % 4] if len(series[label]) > 1 else "none"
        ax.plot(
            *zip(*series[label]),
            ls=ls,
            ms=5,
            lw=1.3,
            label=label,
            gid=label,
            **styles[method[label]],
        )
    _log_axis(ax, "x", contexts)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    _log_axis(ax, "y", [v for pts in series.values() for _, v in pts])
    if y.endswith("_ratio"):
        ax.axhline(1.0, color="0.4", lw=1, ls="--", zorder=0)
    cpu = wtype == "latency" and any(r.manifest.get("timing_note") for r in recs)
    title = f"{NAMES.get(y, y)} vs context depth" + (" (CPU: framework overhead dominates)" * cpu)
    ylabel = f"{NAMES.get(y, y)}\n{describe(recs[0], drop=('context',))}"
    _finish(fig, ax, "context depth (tokens)", ylabel, title)
    return fig


def figures(records: list[Record]) -> Iterator[tuple[str, Figure | str]]:
    """``(name, figure or the reason it is not drawn)`` for every figure of
    docs/design.md#plots, one at a time (a caller closes each figure)."""
    pairs = {
        "kl_vs_bytes": ("bytes_ratio", "next_token_kl"),
        "kl_vs_decode": (DECODE, "next_token_kl"),
        "bytes_vs_decode": (DECODE, "bytes_ratio"),
    }
    for section in SECTIONS:
        for name, (x, y) in pairs.items():
            yield f"headline_{section}_{name}", section_figure(records, section, x, y)
    tasks = sorted(
        {m for r in records for m in r.metrics if m.startswith("lm_eval.") and direction(m)}
        - {m for r in records for m in r.metrics if m.endswith("_ratio")}
    )
    for y in (*QUALITY, *tasks):
        if any(y in r.metrics for r in records):
            safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in y)
            yield (
                f"pareto_{safe}_vs_nominal_key_bits",
                pareto_figure(records, "nominal_key_bits", y),
            )
    for wtype, y in SWEEPS:
        if any(r.workload_type == wtype and y in r.metrics for r in records):
            yield f"{y}_vs_context", sweep_figure(records, wtype, y)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=130)
    _plt().close(fig)
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
