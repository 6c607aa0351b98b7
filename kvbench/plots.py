"""Matplotlib figures: Pareto frontiers (bits or bytes vs quality), latency and memory vs
context.  Each PNG is readable without the JSON: titled, labelled axes with units, a legend,
dominated points drawn hollow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .metrics import HIGHER, direction
from .report import label_of

#: (x metric, y metric) pairs drawn as Pareto plots when the records have both
PARETO = [
    ("nominal_key_bits", "attn_kl"),
    ("nominal_key_bits", "ppl_delta"),
    ("nominal_key_bits", "next_token_kl"),
    ("effective_bits", "attn_kl"),
    ("bytes_total", "next_token_kl"),
]
UNITS = {
    "nominal_key_bits": "bits / key element (nominal, spec §12)",
    "effective_bits": "bits / element (measured bytes)",
    "bytes_total": "bytes at rest",
    "attn_kl": "attention KL (lower is better)",
    "ppl_delta": "perplexity increase vs full",
    "next_token_kl": "next-token KL vs full (lower is better)",
}


def pareto_mask(xs: list[float], ys: list[float], y_higher_better: bool = False) -> list[bool]:
    """True where a point is not dominated (lower x is better; y by its direction)."""
    out = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        dominated = False
        for j, (x2, y2) in enumerate(zip(xs, ys)):
            if i == j:
                continue
            better_y = y2 >= y if y_higher_better else y2 <= y
            strictly = x2 < x or (y2 > y if y_higher_better else y2 < y)
            if x2 <= x and better_y and strictly:
                dominated = True
                break
        out.append(not dominated)
    return out


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_plot(
    records: list[dict[str, Any]], x: str, y: str, path: Path, title: str = ""
) -> Path | None:
    pts = [
        (r["metrics"][x], r["metrics"][y], label_of(r))
        for r in records
        if x in r["metrics"] and y in r["metrics"] and r["method"] != "full"
    ]
    if len(pts) < 2:
        return None
    plt = _figure()
    xs, ys, labels = zip(*pts)
    keep = pareto_mask(list(xs), list(ys), direction(y) == HIGHER)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for xi, yi, lab, k in zip(xs, ys, labels, keep):
        ax.scatter([xi], [yi], facecolors="C0" if k else "none", edgecolors="C0", s=40)
        ax.annotate(lab, (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = sorted((xi, yi) for xi, yi, k in zip(xs, ys, keep) if k)
    if len(front) > 1:
        ax.plot(*zip(*front), "C0-", lw=1, label="Pareto frontier")
    ax.set_xlabel(UNITS.get(x, x))
    ax.set_ylabel(UNITS.get(y, y))
    if all(v > 0 for v in ys) and max(ys) / max(min(ys), 1e-30) > 100:
        ax.set_yscale("log")
    ax.set_title(title or f"{y} vs {x} (hollow: dominated)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def series_plot(
    records: list[dict[str, Any]], x_key: str, y: str, path: Path, ylabel: str, title: str
) -> Path | None:
    """One line per method label: ``y`` against workload parameter ``x_key`` (context depth)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if y in r["metrics"] and x_key in r.get("workload", {}):
            series.setdefault(label_of(r), []).append((r["workload"][x_key], r["metrics"][y]))
    if not series:
        return None
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for lab, pts in sorted(series.items()):
        pts.sort()
        ax.plot(*zip(*pts), marker="o", label=lab)
    ax.set_xlabel(f"context depth ({x_key}, tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(records: list[dict[str, Any]], folder: str | Path) -> list[Path]:
    """Write every plot the records support into ``folder``; returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for x, y in PARETO:
        p = pareto_plot(records, x, y, folder / f"pareto_{y}_vs_{x}.png")
        if p:
            out.append(p)
    for y, label in (
        ("decode_ms_p50", "decode step, median (ms)"),
        ("bytes_total", "KV cache bytes at rest"),
    ):
        p = series_plot(
            records,
            "context",
            y,
            folder / f"{y}_vs_context.png",
            label,
            f"{label} vs context depth",
        )
        if p:
            out.append(p)
    return out
