"""The three-way view (quality vs bytes vs decode latency) and the context series plots.

Right values: the join of hand-written records (which bytes, which latency, which quality go
together for each configuration at which context depth); the PNGs are checked to exist and to
be non-trivial images.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.bench.records import Record
from kvbench.report.plots import tradeoff_points, write_plots


def _rec(method, config, wtype, context, metrics, label=None):
    w = {"type": wtype}
    if context is not None:
        w["context"] = context
    return Record(
        run_id=f"{label or method}-{wtype}-{context}",
        method=method,
        config=config,
        model={"id": "m"},
        workload=w,
        metrics=metrics,
        manifest={
            "label": label or method,
            "timing_note": "cpu" if wtype == "latency" else None,
        },
    )


RECORDS = [
    # memory: bytes and key_mse per depth
    _rec("full", {}, "memory", 512, {"bytes_total": 1000, "key_mse": 0.0}),
    _rec("full", {}, "memory", 1024, {"bytes_total": 2000, "key_mse": 0.0}),
    _rec("kivi", {"bits": 2}, "memory", 512, {"bytes_total": 150, "key_mse": 0.3}),
    _rec("kivi", {"bits": 2}, "memory", 1024, {"bytes_total": 250, "key_mse": 0.2}),
    _rec("kivi", {"bits": 4}, "memory", 1024, {"bytes_total": 550, "key_mse": 0.01}),
    # latency: interleaved ratios per depth (kivi 4-bit has no 1024 latency record)
    _rec("full", {}, "latency", 512, {"decode_ms_p50": 10.0, "decode_ms_p50_ratio": 1.0}),
    _rec("full", {}, "latency", 1024, {"decode_ms_p50": 12.0, "decode_ms_p50_ratio": 1.01}),
    _rec("kivi", {"bits": 2}, "latency", 512, {"decode_ms_p50": 15.0, "decode_ms_p50_ratio": 1.4}),
    _rec("kivi", {"bits": 2}, "latency", 1024, {"decode_ms_p50": 20.0, "decode_ms_p50_ratio": 1.6}),
    _rec("kivi", {"bits": 4}, "latency", 512, {"decode_ms_p50": 14.0, "decode_ms_p50_ratio": 1.3}),
    # a fidelity record: quality of another kind, no context
    _rec("kivi", {"bits": 2}, "fidelity", None, {"attn_kl": 0.05}),
    _rec("full", {}, "fidelity", None, {"attn_kl": 0.0}),
]


def test_join_defaults_to_the_best_covered_depth() -> None:
    pts, context, quality, ratio = tradeoff_points(RECORDS)
    # memory and latency at 512: full, kivi-2 (kivi-4 has no memory record there); at 1024:
    # full, kivi-2 (kivi-4 has no latency record there): a tie, so the larger depth
    assert context == 1024 and quality == "attn_kl" and ratio
    assert sorted(pts) == [(250, 0.05, 1.6, "kivi"), (2000, 0.0, 1.01, "full")]


def test_join_memory_quality_follows_the_depth() -> None:
    pts, context, quality, _ = tradeoff_points(RECORDS, quality="key_mse", context=512)
    assert context == 512
    assert sorted(pts) == [(150, 0.3, 1.4, "kivi"), (1000, 0.0, 1.0, "full")]


def test_join_without_latency_gives_nothing() -> None:
    mem = [r for r in RECORDS if r.workload["type"] != "latency"]
    pts, context, _, _ = tradeoff_points(mem)
    assert pts == [] and context is None


def test_write_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = {p.name: p for p in write_plots(RECORDS, tmp_path)}
    for name in (
        "tradeoff_quality_bytes_latency.png",
        "decode_ms_p50_vs_context.png",
        "decode_ms_p50_ratio_vs_context.png",
        "bytes_total_vs_context.png",
    ):
        assert name in paths
        data = paths[name].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# ------------------------------------------------------------------ Pareto figures, by content


def _q(method, bits, kl, label, mib=None):
    cfg = {"bits": bits} if bits else {}
    out = [
        _rec(
            method,
            cfg,
            "fidelity",
            None,
            {
                "attn_kl": kl,
                "nominal_key_bits": bits + 0.25 if bits else 16,
                "effective_key_bits": bits + 0.5 if bits else 16,
                "effective_value_bits": 16,
            },
            label,
        ),
    ]
    if mib is not None:
        r = _rec(method, cfg, "memory", 2048, {"bytes_total": mib * 2**20}, label)
        r.workload["dtype"] = "float16"
        out.append(r)
    return out


FIG_RECORDS = [
    *_q("full", 0, 0.0, "full", 96),
    *_q("kivi", 2, 2e-2, "kivi[bits=2]", 12),
    *_q("per-channel", 2, 2e-2, "per-channel[bits=2]", 12),  # coincides with kivi
    *_q("kivi", 4, 3e-4, "kivi[bits=4]", 20),
    *_q("uniform", 2, 9e-2, "uniform[bits=2]", 12.5),  # dominated
    *_q("kvquant", 4, 5e-5, "kvquant[bits=4]", 21),
]


def _axes(fig):
    return fig.axes[0]


def test_choose_scale_from_the_data() -> None:
    from kvbench.report.plots import choose_scale

    assert choose_scale([0.0, 1e-4, 2e-3, 0.1]) == ("symlog", 1e-4)
    assert choose_scale([1e-4, 2e-3, 0.1]) == ("log", None)
    assert choose_scale([0.0, 1.0, 2.0, 5.0]) == ("linear", None)
    assert choose_scale([-0.01, 0.0, 5.0]) == ("symlog", 0.01)


def test_pareto_figure_content_nominal_bits() -> None:
    pytest.importorskip("matplotlib")
    from kvbench.report.plots import pareto_figure

    fig = pareto_figure(FIG_RECORDS, "nominal_key_bits", "attn_kl")
    ax = _axes(fig)
    # the zero baseline next to values spanning 400x: symlog, not a flattened linear axis
    assert ax.get_yscale() == "symlog"
    pts = sorted((round(float(x), 6), float(y)) for c in ax.collections for x, y in c.get_offsets())
    # 4 distinct points (kivi and per-channel coincide); full is not a point but a line at 0
    assert pts == [(2.25, 2e-2), (2.25, 9e-2), (4.25, 5e-5), (4.25, 3e-4)]
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == sorted(
        ["kivi[bits=2] = per-channel[bits=2]", "uniform[bits=2]", "kivi[bits=4]", "kvquant[bits=4]"]
    )
    base = [ln for ln in ax.lines if ln.get_label() == "full (baseline)"]
    assert len(base) == 1 and list(base[0].get_ydata()) == [0.0, 0.0]
    assert "nominal key bits" in ax.get_xlabel() and "attention KL" in ax.get_ylabel()
    assert ax.get_title().startswith("Attention KL vs nominal key bits")
    # labels do not overlap each other
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.texts]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)


def test_pareto_figure_bytes_axis_in_mib_with_context_and_dtype() -> None:
    pytest.importorskip("matplotlib")
    from kvbench.report.plots import pareto_figure

    ax = _axes(pareto_figure(FIG_RECORDS, "bytes_total", "attn_kl"))
    xs = sorted({round(float(x), 6) for c in ax.collections for x, _ in c.get_offsets()})
    assert xs == [12.0, 12.5, 20.0, 21.0]  # MiB, joined from the memory records
    assert ax.get_xlabel() == "KV cache at rest (MiB), context 2048, baseline float16"
    assert any(ln.get_label() == "full (baseline)" for ln in ax.lines)
    assert any(list(ln.get_xdata()) == [96.0, 96.0] for ln in ax.lines)  # full's bytes


def test_write_plots_one_figure_per_quality_metric_and_cost(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    names = {p.name for p in write_plots(FIG_RECORDS, tmp_path)}
    assert {
        "pareto_attn_kl_vs_nominal_key_bits.png",
        "pareto_attn_kl_vs_effective_bits.png",
        "pareto_attn_kl_vs_bytes_total.png",
    } <= names
