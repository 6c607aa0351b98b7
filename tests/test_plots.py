"""The report's figures, read back from the matplotlib objects (not pixels).

Right values: a small record set written here, every expected point worked by hand (bytes over
``full``'s 16-bit bytes, the Pareto frontier by inspection, the noise floor from the headline
table's rule); each family's colour and each configuration's marker from the sorted labels,
computed here on their own.  tests/test_plots_figures.py checks every figure of the committed
default export against the same rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_hex  # noqa: E402

from kvbench.bench.records import Record, write_record  # noqa: E402
from kvbench.cli import main  # noqa: E402
from kvbench.report import headline, plots  # noqa: E402
from kvbench.report.export import make_export  # noqa: E402

MEMORY = {"type": "memory", "text": "essays", "context": 2048, "dtype": "float16", "layers": "all"}
PPL = {"type": "perplexity", "text": "essays", "tokens": 1536, "prefill": 1024, "chunk": 256}
#: one layer, one KV head, head_dim 1: a 16-bit cache of the perplexity run's 1535 cached tokens
#: holds 1535 x 2 sides x 2 bytes (kvbench.report.headline.bytes16)
GEOMETRY = {"num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 1}
PPL_BYTES16 = 1535 * 2 * 2


def _rec(label, method, workload, metrics):
    return Record(
        run_id=f"{label}-{json.dumps(workload, sort_keys=True)}",
        method=method,
        config={},
        model={"id": "m"},
        workload=workload,
        metrics=metrics,
        manifest={"label": label, "model": GEOMETRY},
    )


# label, family, bytes_total (of 1000 for the 16-bit full cache), measured key/value bits,
# next-token KL, decode-step ratio at context 2048 (and 1024 unless None)
CONFIGS = [
    ("full", "full", 1000, 16, 16, 0.0, 1.0, 1.0),
    ("hf-dynamic", "hf-dynamic", 1000, 16, 16, -8.8e-10, 1.6, 1.5),  # below the noise
    ("kivi K2V2", "kivi", 200, 2.5, 3.5, 0.3, 1.5, 1.4),
    ("pn-mix V2", "pn-mix", 210, 3.1, 3.5, 0.03, 1.8, 1.7),
    ("kitty V2", "kitty", 220, 3.3, 3.5, 0.1, 2.0, None),  # dominated; one latency context
    ("kivi K2 V16", "kivi", 580, 2.5, 16, 0.28, 1.4, 1.3),  # section (b): values at 16 bits
    ("pn-mix V16", "pn-mix", 600, 3.1, 16, 0.02, 1.7, 1.6),
]


def _records(latency: bool = True) -> list[Record]:
    out = []
    for label, fam, b, kb, vb, kl, r2048, r1024 in CONFIGS:
        mem = {"bytes_total": b, "effective_key_bits": kb, "effective_value_bits": vb}
        out.append(_rec(label, fam, MEMORY, mem))
        # the headline takes bytes and bits from the quality record (one cache state per row)
        ppl = {"next_token_kl": kl, "nominal_key_bits": kb, **mem}
        ppl["bytes_total"] = b * PPL_BYTES16 / 1000
        out.append(_rec(label, fam, PPL, ppl))
        for ctx, ratio in ((2048, r2048), (1024, r1024)):
            if latency and ratio is not None:
                w = {"type": "latency", "context": ctx, "batch_size": 1}
                out.append(_rec(label, fam, w, {"decode_ms_p50_ratio": ratio}))
    return out


RECORDS = _records()
#: the headline table's noise floor: the largest |KL| of unquantized rows (hf-dynamic's
#: |-8.8e-10|), at least KL_FLOOR = 1e-6; full and hf-dynamic are at or below it: drawn in the
#: band below the floor line (:func:`_banded`)
FLOOR = 1e-6
SECTION_A = {
    "full": (1.0, FLOOR),
    "hf-dynamic": (1.0, FLOOR),
    "kivi K2V2": (0.2, 0.3),
    "pn-mix V2": (0.21, 0.03),
    "kitty V2": (0.22, 0.1),
}
#: the labels of CONFIGS whose KL is at or below FLOOR
AT_FLOOR = {"full", "hf-dynamic"}


def _points(fig) -> dict[str, tuple[float, float]]:
    """gid (label) -> (x, y) of every one-point line: the figure's points."""
    ax = fig.axes[0]
    return {
        ln.get_gid(): (float(ln.get_xdata()[0]), float(ln.get_ydata()[0]))
        for ln in ax.lines
        if ln.get_gid() in {c[0] for c in CONFIGS}
    }


def _same(got: dict, want: dict) -> None:
    """``got`` at ``want``'s positions; a point of :data:`AT_FLOOR` at its x, below the floor
    (in the band, :func:`_banded`)."""
    assert sorted(got) == sorted(want)
    for k, xy in want.items():
        if k in AT_FLOOR:
            assert got[k][0] == pytest.approx(xy[0], rel=1e-9) and got[k][1] < FLOOR, k
        else:
            assert got[k] == pytest.approx(xy, rel=1e-9), k


def _banded(fig, ax, labels: set[str]) -> dict[str, tuple[float, float]]:
    """The pixel centres of the markers of ``labels`` (values at or below the floor), after
    checking them drawn in the band below the floor line (gid ``floor-band``, from the axes'
    bottom to the floor), inside the axes, their boxes ((size + edge) / 2 points about the
    centre) apart from every other marker's."""
    fig.canvas.draw()
    (band,) = [p for p in ax.patches if p.get_gid() == "floor-band"]
    fy = ax.transData.transform((0, FLOOR))[1]
    frame = ax.get_window_extent()
    boxes, centres = {}, {}
    for ln in ax.lines:
        if ln.get_gid() in {c[0] for c in CONFIGS}:
            cx, cy = ax.transData.transform((ln.get_xdata()[0], ln.get_ydata()[0]))
            r = (ln.get_markersize() + ln.get_markeredgewidth()) / 2 * fig.dpi / 72
            boxes[ln.get_gid()] = (cx - r, cy - r, cx + r, cy + r)
            centres[ln.get_gid()] = (cx, cy)
    for lb in labels:
        x0, y0, x1, y1 = boxes[lb]
        assert y1 <= fy and y0 >= frame.y0, lb
        for other, b in boxes.items():
            if other != lb:
                assert x1 <= b[0] or b[2] <= x0 or y1 <= b[1] or b[3] <= y0, (lb, other)
    return {lb: centres[lb] for lb in labels}


def _line(fig, gid):
    return next(ln for ln in fig.axes[0].lines if ln.get_gid() == gid)


def _check_labels_apart(fig) -> None:
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in fig.axes[0].texts if t.get_visible() and t.get_text()]
    assert boxes
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)


def test_noise_floor_is_the_headline_tables() -> None:
    ppl = [r for r in RECORDS if r.workload_type == "perplexity"]
    assert plots.noise_floor("next_token_kl", ppl) == FLOOR
    assert headline.noise_floor(headline.rows(RECORDS)) == FLOOR
    loud = [*ppl, _rec("noisy", "hf-dynamic", PPL, {**ppl[1].metrics, "next_token_kl": -3e-4})]
    assert plots.noise_floor("next_token_kl", loud) == 3e-4
    assert headline.noise_floor(headline.rows(loud)) == 3e-4
    assert "full's noise floor (3e-04: the largest |KL| of unquantized rows, at least 1e-06)" in (
        plots.floor_text("next_token_kl", 3e-4)
    )


def test_section_a_quality_vs_bytes() -> None:
    fig = plots.section_figure(RECORDS, "a", "bytes_ratio", "next_token_kl")
    ax = fig.axes[0]
    _same(_points(fig), SECTION_A)
    # frontier over every drawn point: kitty is hollow (pn-mix has fewer bytes and a lower
    # KL); full and hf-dynamic share a place on the floor and dominate neither each other
    filled = {g for g in SECTION_A if _line(fig, g).get_markerfacecolor() != "none"}
    assert filled == {"full", "hf-dynamic", "kivi K2V2", "pn-mix V2"}
    # full and hf-dynamic, both at x = 1.0 and at or below the floor: one above the other in
    # the band (full, the first, nearer the floor line), the frontier through both
    centres = _banded(fig, ax, AT_FLOOR)
    assert centres["full"][0] == pytest.approx(centres["hf-dynamic"][0])
    assert centres["full"][1] > centres["hf-dynamic"][1]
    ys = {g: float(_line(fig, g).get_ydata()[0]) for g in AT_FLOOR}
    front = _line(fig, "frontier")
    assert list(front.get_xdata()) == pytest.approx([0.2, 0.21, 1.0, 1.0])
    assert list(front.get_ydata()) == pytest.approx([0.3, 0.03, ys["hf-dynamic"], ys["full"]])
    assert list(_line(fig, "floor").get_ydata()) == [FLOOR] * 2
    key = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "noise floor (1e-06" in key and " 3 kitty V2" in key
    assert "drawn in the shaded band below it" in " ".join(key.split())
    # five points: named beside their markers
    assert {t.get_text() for t in ax.texts} == set(SECTION_A)
    assert ax.get_yscale() == "log" and ax.get_xscale() == "linear"  # 0.2..1: 5x, linear
    assert ax.get_xlabel() == (
        "bytes at rest / those of a 16-bit cache of the same tokens\n"
        "(perplexity workload: essays, 1536 tokens, prefill 1024, chunks of 256)"
    )
    assert ax.get_ylabel() == (
        "next-token KL vs full (nats)\n"
        "(perplexity workload: essays, 1536 tokens, prefill 1024, chunks of 256)"
    )
    assert fig.get_suptitle().startswith("(a) Deployed")
    assert "model m (?, ?); text essays; context 1536 tokens" in fig.get_suptitle()
    _check_labels_apart(fig)


def test_section_b_and_decode_axes() -> None:
    fig = plots.section_figure(RECORDS, "b", "bytes_ratio", "next_token_kl")
    _same(
        _points(fig), {"full": (1.0, FLOOR), "kivi K2 V16": (0.58, 0.28), "pn-mix V16": (0.6, 0.02)}
    )
    fig = plots.section_figure(RECORDS, "a", plots.DECODE, "next_token_kl")
    # the decode ratio of the context most labels have: 2048 (kitty has no 1024 record);
    # full (1.0, on the floor) dominates every other point: the frontier is one point
    pts = _points(fig)
    assert {g: x for g, (x, _) in pts.items()} == pytest.approx(
        {"full": 1.0, "hf-dynamic": 1.6, "kivi K2V2": 1.5, "pn-mix V2": 1.8, "kitty V2": 2.0}
    )
    filled = {g for g in pts if _line(fig, g).get_markerfacecolor() != "none"}
    assert filled == {"full"}
    assert fig.axes[0].get_xlabel() == (
        "decode step, median / that of full interleaved in the same run\n"
        "(latency workload: 2048 tokens, batch 1)"
    )
    fig = plots.section_figure(RECORDS, "a", plots.DECODE, "bytes_ratio")
    assert _points(fig)["kitty V2"] == pytest.approx((2.0, 0.22))  # bytes: no noise floor
    assert not any(ln.get_gid() == "floor" for ln in fig.axes[0].lines)


def test_one_colour_per_family_one_marker_per_configuration() -> None:
    styles = plots.style_table(RECORDS)
    # families sorted, full first in black; the labels of a family sorted, markers in order
    assert styles["full"] == {"color": "#000000", "marker": "*", "number": 1}
    fams = ["hf-dynamic", "kitty", "kivi", "pn-mix"]
    for label, fam, marker in (
        ("hf-dynamic", "hf-dynamic", "o"),
        ("kitty V2", "kitty", "o"),
        ("kivi K2 V16", "kivi", "o"),
        ("kivi K2V2", "kivi", "s"),
        ("pn-mix V16", "pn-mix", "o"),
        ("pn-mix V2", "pn-mix", "s"),
    ):
        assert styles[label]["color"] == plots.COLORS[fams.index(fam)]
        assert styles[label]["marker"] == marker
    pairs = [(s["color"], s["marker"]) for s in styles.values()]
    assert len(set(pairs)) == len(pairs)
    # the same configuration in every figure: its style of the table
    figs = [
        plots.section_figure(RECORDS, "a", "bytes_ratio", "next_token_kl"),
        plots.section_figure(RECORDS, "b", "bytes_ratio", "next_token_kl"),
        plots.pareto_figure(RECORDS, "nominal_key_bits", "next_token_kl"),
        plots.sweep_figure(RECORDS, "latency", plots.DECODE),
    ]
    for label in ("kivi K2V2", "kivi K2 V16", "pn-mix V16"):
        for fig in figs:
            for ax in fig.axes:
                for ln in (ln for ln in ax.lines if ln.get_gid() == label):
                    st = styles[label]
                    assert (ln.get_markeredgecolor(), ln.get_marker()) == (
                        st["color"],
                        st["marker"],
                    )
    legend = {t.get_text() for t in figs[0].axes[0].get_legend().get_texts()}
    assert {" 1 full", " 2 hf-dynamic", " 3 kitty V2", " 5 kivi K2V2", " 7 pn-mix V2"} <= legend


def test_pareto_against_nominal_bits_one_point_per_label() -> None:
    fig = plots.pareto_figure(RECORDS, "nominal_key_bits", "next_token_kl")
    # values kept at 16 bits (section b) on their own axes, full the reference in both
    a, b = (
        {
            ln.get_gid(): ln
            for ln in ax.lines
            if ln.get_gid() in dict(SECTION_A) or ln.get_gid() in ("kivi K2 V16", "pn-mix V16")
        }
        for ax in fig.axes
    )
    assert sorted(a) == sorted(SECTION_A)
    assert sorted(b) == ["full", "kivi K2 V16", "pn-mix V16"]
    assert (b["kivi K2 V16"].get_xdata()[0], b["kivi K2 V16"].get_ydata()[0]) == (2.5, 0.28)
    # full and hf-dynamic share x = 16 at or below the floor: both in the band, apart
    assert a["hf-dynamic"].get_xdata()[0] == 16 and a["hf-dynamic"].get_ydata()[0] < FLOOR
    _banded(fig, fig.axes[0], AT_FLOOR)
    _check_labels_apart(fig)


def test_context_sweep_lines_and_single_context() -> None:
    fig = plots.sweep_figure(RECORDS, "latency", plots.DECODE)
    kivi, kivi16, kitty = (_line(fig, g) for g in ("kivi K2V2", "kivi K2 V16", "kitty V2"))
    assert list(kivi.get_xdata()) == [1024, 2048] and list(kivi.get_ydata()) == [1.4, 1.5]
    assert (kivi.get_marker(), kivi16.get_marker()) == ("s", "o")  # one family, two markers
    assert kivi.get_color() == kivi16.get_color()
    assert kitty.get_linestyle() == "None" and list(kitty.get_xdata()) == [2048]  # a marker only
    assert fig.axes[0].get_xlabel() == "context depth (tokens)"
    # memory at one context only: no figure, a reason
    reason = plots.sweep_figure(RECORDS, "memory", "bytes_total")
    assert isinstance(reason, str) and "1 context(s) [2048]" in reason


def test_step_ratio_vs_context_with_intervals() -> None:
    """The figure of ``make bench-latency`` from fake records: latency at 1K..16K for three
    methods with the step ratio's 95% interval, steps at 1 thread.  One line per method at its
    contexts, its colour and marker of the style table (the same as in every other figure),
    an error bar at each point spanning exactly [low, high], a dashed line at 1.0, and a title
    naming the model and the threads."""
    ctxs = [1024, 2048, 4096, 8192, 16384]
    ratios = {"full": [1.0] * 5, "kivi K2V2": [1.3, 1.1, 0.9, 0.7, 0.5]}
    ratios["int4-block"] = [1.2, 1.1, 1.0, 0.9, 0.8]
    fams = {"full": "full", "kivi K2V2": "kivi", "int4-block": "int4-block"}
    recs = []
    for label, rs in ratios.items():
        for ctx, r in zip(ctxs, rs):
            w = {"type": "latency", "context": ctx, "steps": 40}
            m = {plots.DECODE: r, f"{plots.DECODE}_ci_low": r - 0.02}
            m[f"{plots.DECODE}_ci_high"] = r + 0.03
            rec = _rec(label, fams[label], w, m)
            rec.manifest |= {"threads": 2, "step_threads": 1, "timing_note": "cpu"}
            recs.append(rec)
    fig = plots.sweep_figure(recs, "latency", plots.DECODE)
    ax = fig.axes[0]
    styles = plots.style_table(recs)
    lines = {ln.get_gid(): ln for ln in ax.lines if ln.get_gid() in ratios}
    assert sorted(lines) == sorted(ratios)  # one line per method
    for label, ln in lines.items():
        assert list(ln.get_xdata()) == ctxs and list(ln.get_ydata()) == ratios[label]
        assert (ln.get_color(), ln.get_marker()) == (
            styles[label]["color"],
            styles[label]["marker"],
        )
        (bar,) = [c for c in ax.collections if c.get_gid() == f"ci-y:{label}"]
        segs = bar.get_segments()
        assert [tuple(s[:, 0]) for s in segs] == [(c, c) for c in ctxs]  # vertical, at x
        for seg, r in zip(segs, ratios[label]):
            assert sorted(seg[:, 1]) == pytest.approx([r - 0.02, r + 0.03])
        assert to_hex(bar.get_colors()[0]) == styles[label]["color"]
    assert any(ln.get_linestyle() == "--" and list(ln.get_ydata()) == [1.0, 1.0] for ln in ax.lines)
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(c) for c in ctxs]
    title = fig._suptitle.get_text()
    assert "model m" in title and "threads 1" in title
    assert "context 1024, 2048, 4096, 8192, 16384 tokens" in title.replace("\n", " ")


def test_write_plots_and_reasons(tmp_path: Path) -> None:
    skipped: list[str] = []
    task = "lm_eval.t.acc,none"  # an lm-eval task metric with a direction (higher)
    tasks = [
        _rec(label, fam, {"type": "lm_eval"}, {task: acc, "nominal_key_bits": b})
        for label, fam, acc, b in (
            ("full", "full", 0.5, 16),
            ("kivi K2V2", "kivi", 0.4, 2.5),
            ("pn-mix V2", "pn-mix", 0.45, 3.1),
        )
    ]
    records = _records(latency=False) + tasks
    names = {p.name for p in plots.write_plots(records, tmp_path, skipped)}
    assert names == {
        "headline_a_kl_vs_bytes.png",
        "headline_b_kl_vs_bytes.png",
        "headline_a_kl_vs_bytes_by_step.png",
        "headline_b_kl_vs_bytes_by_step.png",
        "pareto_next_token_kl_vs_nominal_key_bits.png",
        "pareto_lm_eval.t.acc_none_vs_nominal_key_bits.png",
    }
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert "headline_a_kl_vs_decode: no latency records with decode_ms_p50_ratio" in skipped
    assert any(s.startswith("bytes_total_vs_context: ") for s in skipped)


def test_plot_command_reads_a_folder_and_an_export(tmp_path: Path, capsys) -> None:
    for r in RECORDS:
        write_record(tmp_path / f"{abs(hash(r.run_id))}.json", r)
    export = tmp_path / "export" / "x.json"
    export.parent.mkdir()
    export.write_text(json.dumps(make_export(RECORDS, "make bench", "test", None)))
    assert len(plots.load([str(export)])) == len(RECORDS)
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'png' / 'headline_a_kl_vs_decode.png'}" in out
    assert "not drawn: bytes_total_vs_context:" in out
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    assert "export files" in capsys.readouterr().out


def test_each_metric_from_the_workload_most_labels_have() -> None:
    lat = [r for r in RECORDS if r.workload_type == "latency" and r.label != "kitty V2"]
    # 6 labels at 1024 and at 2048: a tie, the larger context wins
    for recs in (lat, lat[::-1]):  # whichever comes first
        assert {r.workload["context"] for r in plots._group(recs, plots.DECODE)} == {2048}
    extra = _rec("x", "kivi", {"type": "latency", "context": 1024, "batch_size": 1}, {})
    extra.metrics[plots.DECODE] = 1.0
    got = plots._group(lat + [extra], plots.DECODE)
    assert {r.workload["context"] for r in got} == {1024} and len(got) == 7


def test_no_figure_is_left_open(tmp_path: Path) -> None:
    """Figures are not held by pyplot (which keeps each of its figures until ``plt.close``, and
    warns past 20): a caller that drops a figure, or only reads the reasons of
    :func:`plots.figures`, leaves none open, whatever it draws."""
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    reasons = [f for _, f in plots.figures(RECORDS) if isinstance(f, str)]
    drawn = [
        plots.section_figure(RECORDS, "a", "bytes_ratio", "next_token_kl"),
        plots.combined_figure(RECORDS, "a"),
        plots.pareto_figure(RECORDS, "nominal_key_bits", "next_token_kl"),
        plots.sweep_figure(RECORDS, "latency", plots.DECODE),
    ]
    plots.write_plots(RECORDS, tmp_path)
    assert reasons and all(not isinstance(f, str) for f in drawn)
    assert plt.get_fignums() == before
