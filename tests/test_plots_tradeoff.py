"""The three-way view (quality vs bytes vs decode latency) and the context series plots.

Right values: the join of hand-written records (which bytes, which latency, which quality go
together for each configuration at which context depth); the PNGs are checked to exist and to
be non-trivial images.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.report.plots import tradeoff_points, write_plots


def _rec(method, config, wtype, context, metrics, label=None):
    w = {"type": wtype}
    if context is not None:
        w["context"] = context
    return {
        "method": method,
        "config": config,
        "model": {"id": "m"},
        "workload": w,
        "metrics": metrics,
        "manifest": {
            "label": label or method,
            "timing_note": "cpu" if wtype == "latency" else None,
        },
    }


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
    mem = [r for r in RECORDS if r["workload"]["type"] != "latency"]
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
