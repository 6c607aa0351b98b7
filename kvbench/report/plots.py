"""Matplotlib figures: Pareto frontiers (bits or bytes vs quality), latency and memory vs
context.  Each PNG is readable without the JSON: titled, labelled axes with units, a legend,
dominated points drawn hollow."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvbench.bench.records import Record
from kvbench.bench.workloads.metrics import HIGHER, direction
from kvbench.cache.registry import BASELINE
from kvbench.report.pareto import pareto_mask

#: quality metrics drawn as Pareto figures, each against nominal key bits, measured bits and
#: measured bytes when the records have them
QUALITY_FIGURES = ("attn_kl", "next_token_kl", "ppl_delta", "key_mse", "attn_out_rel_err")
#: x axes of the Pareto figures
X_AXES = ("nominal_key_bits", "effective_bits", "bytes_total")
#: (x metric, y metric) pairs drawn as Pareto plots when the records have both
PARETO = [(x, y) for y in QUALITY_FIGURES for x in X_AXES]
#: human names (with units) of metrics, used in axis labels and titles
NAMES = {
    "nominal_key_bits": "nominal key bits / element (formula, residual excluded)",
    "nominal_value_bits": "nominal value bits / element",
    "effective_bits": "measured bits / element, keys and values (8 x stored bytes / elements)",
    "effective_key_bits": "measured key bits / element",
    "bytes_total": "KV cache at rest (MiB)",
    "attn_kl": "attention KL vs full (nats)",
    "ppl_delta": "perplexity increase vs full",
    "ppl": "perplexity",
    "next_token_kl": "next-token KL vs full (nats)",
    "key_mse": "key MSE",
    "attn_out_rel_err": "attention output relative error",
}
TITLES = {
    "attn_kl": "Attention KL",
    "next_token_kl": "Next-token KL",
    "ppl_delta": "Perplexity increase",
    "key_mse": "Key MSE",
    "attn_out_rel_err": "Attention output error",
    "nominal_key_bits": "nominal key bits",
    "effective_bits": "measured bits",
    "bytes_total": "KV cache bytes",
}
#: figures with more points label only the Pareto frontier (the legend names the families)
MAX_LABELS = 20


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _metric(r: Record, name: str) -> float | None:
    """A record's metric; ``effective_bits`` from the key and value sides when only those are
    recorded (fidelity)."""
    m = r.metrics
    if name in m:
        return m[name]
    if name == "effective_bits" and "effective_key_bits" in m and "effective_value_bits" in m:
        return (m["effective_key_bits"] + m["effective_value_bits"]) / 2
    return None


def pareto_points(records: list[Record], x: str, y: str) -> dict[str, Any]:
    """The points of one Pareto figure: ``{"points": [(x, y, label, method)], "baseline":
    (x or None, y) | None, "context", "dtype"}``.

    ``x`` and ``y`` come from one record, except ``x == "bytes_total"`` for a quality ``y``
    that memory records lack: then each configuration's (model, method, config) quality is
    joined with the bytes of its memory record at the context most configurations have (the
    largest on ties), and ``context``/``dtype`` say which.  The ``full`` baseline is returned
    apart (drawn as a reference line, not a point)."""
    direct = [r for r in records if _metric(r, x) is not None and y in r.metrics]
    context = dtype = None
    rows: list[tuple[float, float, str, str]] = []
    if direct:
        rows = [(_metric(r, x), r.metrics[y], r.label, r.method) for r in direct]
        ws = {(r.workload.get("context"), r.workload.get("dtype")) for r in direct}
        if len(ws) == 1:
            context, dtype = next(iter(ws))
    elif x == "bytes_total":
        mem: dict[str, dict[Any, Record]] = {}
        for r in records:
            if r.workload_type == "memory" and x in r.metrics:
                mem.setdefault(r.config_key, {})[r.workload.get("context")] = r
        depths = [c for d in mem.values() for c in d]
        if depths:
            context = max(depths, key=lambda c: (depths.count(c), c or 0))
            for r in records:
                m = mem.get(r.config_key, {}).get(context)
                if m is not None and y in r.metrics:
                    rows.append((m.metrics[x], r.metrics[y], r.label, r.method))
                    dtype = m.workload.get("dtype")
    if x == "bytes_total":
        rows = [(a / 2**20, b, lab, meth) for a, b, lab, meth in rows]
    base = [row for row in rows if row[3] == BASELINE]
    points = [row for row in rows if row[3] != BASELINE]
    baseline = (base[0][0], base[0][1]) if base else None
    return {"points": points, "baseline": baseline, "context": context, "dtype": dtype}


def choose_scale(values: list[float], ratio: float = 30.0) -> tuple[str, float | None]:
    """``("linear" | "log" | "symlog", linthresh)`` for an axis holding ``values``: log when
    all are positive and span more than ``ratio``; symlog (linear below the smallest non-zero
    magnitude) when zeros or negatives sit beside positives spanning more than ``ratio``, so a
    zero baseline does not flatten the rest; else linear."""
    nonzero = [abs(v) for v in values if v != 0 and math.isfinite(v)]
    if len(nonzero) < 2 or max(nonzero) / min(nonzero) <= ratio:
        return "linear", None
    if all(v > 0 for v in values):
        return "log", None
    return "symlog", min(nonzero)


def _merge_coincident(points: list[tuple[float, float, str, str]]) -> list[tuple]:
    """One point per distinct (x, y) (to 1e-9 relative): labels joined with " = "."""
    merged: dict[tuple[float, float], list] = {}
    for xv, yv, lab, meth in points:
        key = (round(xv, 9), float(f"{yv:.9g}"))
        e = merged.setdefault(key, [xv, yv, [], meth])
        e[2].append(lab)
    return [(xv, yv, " = ".join(labs), meth) for xv, yv, labs, meth in merged.values()]


def _place_labels(
    ax: Any, texts: list[Any], tx: list[float], ty: list[float], xs: Any, ys: Any
) -> None:
    """Move labels (at their points ``tx, ty``) off each other and off every point ``xs, ys``
    with adjustText, leader lines to the points; without adjustText, labels stay beside their
    points, fanned out vertically."""
    try:
        from adjustText import adjust_text
    except ImportError:
        for i, t in enumerate(texts):
            t.set_va("bottom" if i % 2 else "top")
        return
    adjust_text(
        texts,
        x=list(xs),
        y=list(ys),
        target_x=list(tx),
        target_y=list(ty),
        ax=ax,
        arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.5},
        time_lim=2,
    )


def _apply_scale(ax: Any, axis: str, values: list[float]) -> None:
    scale, lin = choose_scale(values)
    setter = ax.set_yscale if axis == "y" else ax.set_xscale
    if scale == "symlog":
        setter("symlog", linthresh=lin)
    elif scale == "log":
        setter("log")


def pareto_figure(records: list[Record], x: str, y: str, title: str = "") -> Any:
    """The Pareto figure of quality ``y`` against cost ``x`` (see :func:`pareto_points`), or
    ``None`` with fewer than two points.  Colors by method family (legend), hollow markers for
    dominated points, the frontier as a line, every point labelled (coincident ones share a
    label), the ``full`` baseline as a dashed reference line; axis scales from
    :func:`choose_scale`."""
    data = pareto_points(records, x, y)
    pts = _merge_coincident(data["points"])
    if len(pts) < 2:
        return None
    plt = _figure()
    xs, ys, labels, methods = zip(*pts)
    keep = pareto_mask(list(xs), list(ys), direction(y) == HIGHER)
    families = sorted(set(methods))
    fig, ax = plt.subplots(figsize=(9, 6))
    for fi, fam in enumerate(families):
        color = _style(fi)["color"]
        for k in (True, False):
            sel = [(a, b) for a, b, m, kk in zip(xs, ys, methods, keep) if m == fam and kk == k]
            if sel:
                ax.scatter(
                    *zip(*sel),
                    s=42,
                    facecolors=color if k else "none",
                    edgecolors=color,
                    linewidths=1.2,
                    label=fam
                    if k or not any(kk for m, kk in zip(methods, keep) if m == fam)
                    else None,
                    zorder=3,
                    clip_on=False,
                )
    front = sorted((a, b) for a, b, k in zip(xs, ys, keep) if k)
    if len(front) > 1:
        ax.plot(*zip(*front), color="0.3", lw=1, zorder=2, label="Pareto frontier")
    ally = list(ys)
    if data["baseline"] is not None:
        bx, by = data["baseline"]
        ax.axhline(by, color="k", ls="--", lw=1, zorder=1, label=f"{BASELINE} (baseline)")
        if x == "bytes_total":
            ax.axvline(bx, color="k", ls=":", lw=1, zorder=1)
        ally.append(by)
    _apply_scale(ax, "y", ally)
    _apply_scale(ax, "x", list(xs))
    # dense figures: label the frontier, the legend's colors name the rest
    shown = [i for i in range(len(pts)) if keep[i] or len(pts) <= MAX_LABELS]
    texts = [ax.text(xs[i], ys[i], labels[i], fontsize=7, zorder=4) for i in shown]
    ax.margins(0.08)
    xlabel = NAMES.get(x, x)
    if x == "bytes_total":
        ctx = f"context {data['context']}" if data["context"] else "memory workload"
        xlabel = f"{xlabel}, {ctx}, baseline {data['dtype'] or 'model dtype'}"
    ax.set_xlabel(xlabel)
    ax.set_ylabel(NAMES.get(y, y) + (" (higher is better)" if direction(y) == HIGHER else ""))
    ax.set_title(
        title
        or f"{TITLES.get(y, y)} vs {TITLES.get(x, x)} "
        "(filled: Pareto-optimal, hollow: dominated; lower-left is better)",
        fontsize=10,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    _place_labels(ax, texts, [xs[i] for i in shown], [ys[i] for i in shown], xs, ys)
    return fig


def pareto_plot(records: list[Record], x: str, y: str, path: Path, title: str = "") -> Path | None:
    """Write :func:`pareto_figure` to ``path`` (PNG); ``None`` when it has too few points."""
    fig = pareto_figure(records, x, y, title)
    if fig is None:
        return None
    fig.savefig(path, dpi=130)
    _figure().close(fig)
    return path


def _style(i: int) -> dict[str, Any]:
    """Distinct color/marker/line per series (20 colors x 4 markers), readable with 25 lines."""
    import matplotlib

    colors = matplotlib.colormaps["tab20"].colors
    return {
        "color": colors[(2 * i) % 20 if i < 10 else (2 * (i - 10) + 1) % 20],
        "marker": "osD^v<>"[i // 10 % 7],
        "linestyle": ("-", "--", ":")[i // 20 % 3],
    }


def series_plot(
    records: list[Record],
    x_key: str,
    y: str,
    path: Path,
    ylabel: str,
    title: str,
    workload: str | None = None,
    logy: bool | None = None,
) -> Path | None:
    """One line per method label: ``y`` against workload parameter ``x_key`` (context depth),
    from records of workload type ``workload`` (all types when ``None``).  The context axis is
    log2 when it spans more than 4x; ``logy`` (default: when ``y`` spans more than 20x) makes
    the y axis logarithmic.  The legend sits outside the axes, sorted by the last point."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        w = r.workload
        if workload is not None and r.workload_type != workload:
            continue
        if y in r.metrics and x_key in w:
            series.setdefault(r.label, []).append((w[x_key], r.metrics[y]))
    if not series:
        return None
    if "bytes" in y:  # bytes read better in MiB
        series = {k: [(x, v / 2**20) for x, v in pts] for k, pts in series.items()}
        ylabel = f"{ylabel} (MiB)"
    plt = _figure()
    fig, ax = plt.subplots(figsize=(10, 5.5))
    last = {lab: sorted(pts)[-1][1] for lab, pts in series.items()}
    for i, lab in enumerate(sorted(series, key=lambda k: -last[k])):
        pts = sorted(series[lab])
        ax.plot(*zip(*pts), label=lab, lw=1.3, ms=4, **_style(i))
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [v for pts in series.values() for _, v in pts if v > 0]
    if min(xs) > 0 and max(xs) / min(xs) >= 4:
        ax.set_xscale("log", base=2)
        ticks = sorted(set(xs))
        ax.set_xticks(
            ticks, [f"{int(t) // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t) for t in ticks]
        )
    if logy is None:
        logy = bool(ys) and max(ys) / min(ys) > 20
    if logy:
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if y.endswith("_ratio"):
        ax.axhline(1.0, color="0.4", lw=1, ls="--", zorder=0)
    ax.set_xlabel(f"context depth ({x_key}, tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


#: quality metrics the three-way view can use, in order of preference
QUALITY = ("attn_kl", "next_token_kl", "ppl_delta", "key_mse")


def tradeoff_points(
    records: list[Record], quality: str | None = None, context: int | None = None
) -> tuple[list[tuple[float, float, float, str]], int | None, str | None, bool]:
    """Join the records of each method configuration (same model, method and config) across
    workloads for :func:`tradeoff_plot`.

    Returns ``(points, context, quality, ratio)``: one ``(bytes_total, quality, latency, label)``
    per configuration that has all three, where ``bytes_total`` comes from its ``memory`` record
    at context depth ``context`` (default: the depth most configurations have in both memory
    and latency records, the largest on ties), latency is ``decode_ms_p50_ratio`` (``ratio``
    True) or ``decode_ms_p50`` from its ``latency`` record at that depth, and ``quality``
    (default: the first of :data:`QUALITY` any record has) from its memory record at that depth
    or, failing that, from any other non-latency record (fidelity, perplexity).
    """
    by: dict[str, dict[str, Any]] = {}
    ratio = any("decode_ms_p50_ratio" in r.metrics for r in records)
    for r in records:
        e = by.setdefault(r.config_key, {"label": r.label, "mem": {}, "lat": {}, "q": {}})
        m, kind = r.metrics, r.workload_type
        c = r.workload.get("context")
        if kind == "memory" and "bytes_total" in m:
            e["mem"][c] = m["bytes_total"]
        if kind == "latency":
            lat = m.get("decode_ms_p50_ratio") if ratio else m.get("decode_ms_p50")
            if lat is not None:
                e["lat"][c] = lat
            continue
        for q in QUALITY:
            if q in m:  # memory records by depth; others (fidelity...) under None
                e["q"].setdefault(q, {})[c if kind == "memory" else None] = m[q]
    if context is None:
        common = [c for e in by.values() for c in set(e["mem"]) & set(e["lat"])]
        if not common:
            return [], None, quality, ratio
        context = max(common, key=lambda c: (common.count(c), c))
    if quality is None:
        quality = next((q for q in QUALITY if any(q in e["q"] for e in by.values())), None)
    pts = []
    for e in by.values():
        qv = e["q"].get(quality, {})
        y = qv.get(context, qv.get(None))
        if context in e["mem"] and context in e["lat"] and y is not None:
            pts.append((e["mem"][context], y, e["lat"][context], e["label"]))
    return pts, context, quality, ratio


def tradeoff_plot(
    records: list[Record],
    path: Path,
    quality: str | None = None,
    context: int | None = None,
) -> Path | None:
    """The three-way view: quality (y) vs bytes at rest (x, log) vs decode latency (color and
    marker size), one point per method configuration (:func:`tradeoff_points` joins them).
    Coincident points (``full`` and ``hf-dynamic``) share one marker; points dominated in bytes
    and quality are marked.  Returns ``None`` when fewer than two configurations have all three.
    """
    pts, context, quality, ratio = tradeoff_points(records, quality, context)
    if len(pts) < 2:
        return None
    merged: dict[tuple[float, float], list] = {}  # coincident points (full, hf-dynamic): one
    for x, y, lat, lab in pts:
        e = merged.setdefault((x, y), [x, y, [], []])
        e[2].append(lat)
        e[3].append(lab)
    pts = [
        (x / 2**20, y, sum(ls) / len(ls), " / ".join(labs))  # bytes -> MiB
        for x, y, ls, labs in merged.values()
    ]
    plt = _figure()
    xs, ys, lats, labels = zip(*pts)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    lo, hi = min(lats), max(lats)
    sizes = [40 + 260 * ((v - lo) / (hi - lo) if hi > lo else 0.5) for v in lats]
    sc = ax.scatter(xs, ys, c=lats, s=sizes, cmap="viridis_r", edgecolors="k", linewidths=0.5)
    sc.set_clip_on(False)  # a point at quality 0 (full) sits on the axis
    keep = pareto_mask(list(xs), list(ys))
    for xi, yi, lab, k in zip(xs, ys, labels, keep):
        ax.annotate(
            lab + ("" if k else " (dominated)"),
            (xi, yi),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    cb = fig.colorbar(sc, ax=ax)
    cb.set_label("decode step, median / interleaved full" if ratio else "decode step, median (ms)")
    ax.set_xscale("log")
    pos = [v for v in ys if v > 0]
    if pos and (len(pos) < len(ys) or max(pos) / min(pos) > 100):
        if len(pos) < len(ys):
            ax.set_yscale("symlog", linthresh=min(pos))
            ax.set_ylim(bottom=0, top=max(pos) * 3)
        else:
            ax.set_yscale("log")
    ax.margins(x=0.12, y=0.12)
    ax.set_xlabel(f"KV cache at rest, MiB (memory workload, context {context})")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
    ax.set_ylabel(NAMES.get(quality, quality))
    ax.set_title(
        f"quality vs memory vs decode latency at context {context}\n"
        "(color and size: latency; lower-left is better; dominated in bytes and quality marked)"
    )
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(records: list[Record], folder: str | Path) -> list[Path]:
    """Write every plot the records support into ``folder``; returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    family = sorted(  # lm-eval task metrics with a declared direction, each vs nominal bits
        {m for r in records for m in r.metrics if m.startswith("lm_eval.") and direction(m)}
        - {m for r in records for m in r.metrics if m.endswith("_ratio")}
    )
    for x, y in [*PARETO, *(("nominal_key_bits", m) for m in family)]:
        safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in y)
        p = pareto_plot(records, x, y, folder / f"pareto_{safe}_vs_{x}.png")
        if p:
            out.append(p)
    for y, label, kind in (
        ("decode_ms_p50", "decode step, median (ms)", "latency"),
        ("decode_ms_p50_ratio", "decode step, median / interleaved full", "latency"),
        ("tokens_per_s", "decode tokens / s", "latency"),
        ("bytes_total", "KV cache bytes at rest", "memory"),
        ("effective_bits", "effective bits / element (8 x bytes / elements)", "memory"),
        ("peak_step_bytes", "transient bytes of one decode step", "memory"),
    ):
        cpu = kind == "latency" and any(r.manifest.get("timing_note") for r in records)
        title = f"{label} vs context depth" + (
            " (CPU: framework overhead dominates)" if cpu else ""
        )
        p = series_plot(
            records,
            "context",
            y,
            folder / f"{y}_vs_context.png",
            label,
            title,
            workload=kind,
        )
        if p:
            out.append(p)
    p = tradeoff_plot(records, folder / "tradeoff_quality_bytes_latency.png")
    if p:
        out.append(p)
    return out
