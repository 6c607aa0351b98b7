"""Every figure of the committed default export (docs/results/default.json), read back from the
figure's own matplotlib objects (positions, colours, markers, text extents via the renderer),
never from pixels.

Right values: dominance, sections, noise floor and intervals are worked here from the records
(:func:`_non_dominated` on its own, the headline table's rows and note for sections and the
floor), not taken from :mod:`kvbench.report.plots`.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.path import Path as MplPath  # noqa: E402
from matplotlib.text import Annotation, Text  # noqa: E402

from kvbench.bench.records import Record  # noqa: E402
from kvbench.report import headline, plots  # noqa: E402

EXPORT = Path(__file__).resolve().parents[1] / "docs" / "results" / "default.json"
#: artists of a Pareto panel that are not a configuration's point
RULES = {"frontier", "floor"}
#: headline pair -> (x metric, y metric)
PAIRS = {
    "kl_vs_bytes": ("bytes_ratio", "next_token_kl"),
    "kl_vs_decode": (plots.DECODE, "next_token_kl"),
    "bytes_vs_decode": (plots.DECODE, "bytes_ratio"),
    "kl_vs_bytes_by_step": ("bytes_ratio", "next_token_kl"),
}


@pytest.fixture(scope="module")
def records() -> list[Record]:
    return plots.load([str(EXPORT)])


@pytest.fixture(scope="module")
def figs(records: list[Record]) -> dict[str, object]:
    """Every figure at once (none held by pyplot: :func:`kvbench.report.plots.new_figure`)."""
    out = dict(plots.figures(records))
    for fig in out.values():
        if not isinstance(fig, str):
            fig.canvas.draw()
    return out


def _drawn(figs: dict[str, object]) -> dict[str, object]:
    return {n: f for n, f in figs.items() if not isinstance(f, str)}


def _axes_metrics(name: str) -> tuple[str, str] | None:
    """(x, y) metric of a Pareto figure, from its file name; None for a context sweep."""
    m = re.fullmatch(r"headline_[ab]_(.+)", name)
    if m:
        return PAIRS[m.group(1)]
    m = re.fullmatch(r"pareto_(.+)_vs_nominal_key_bits", name)
    if m:
        return "nominal_key_bits", m.group(1)
    return None


def _points(ax) -> list:
    """The configuration lines of ``ax`` (gid = label)."""
    return [
        ln
        for ln in ax.lines
        if ln.get_gid() and ln.get_gid() not in RULES and not ln.get_gid().startswith("ci-")
    ]


def _line(ax, gid: str):
    found = [ln for ln in ax.lines if ln.get_gid() == gid]
    return found[0] if found else None


def _non_dominated(pts: list[tuple[float, float]], higher: bool) -> set[tuple[float, float]]:
    """Positions no other position beats: x lower is better, y by ``higher``."""

    def beats(a: tuple[float, float], b: tuple[float, float]) -> bool:
        ya, yb = (a[1], b[1]) if higher else (-a[1], -b[1])
        return a[0] <= b[0] and ya >= yb and (a[0] < b[0] or ya > yb)

    return {p for p in pts if not any(beats(q, p) for q in pts)}


def _floor_of(ax) -> float | None:
    """The y of the axes' noise-floor line (gid ``floor``), None without one."""
    line = _line(ax, "floor")
    return None if line is None else float(line.get_ydata()[0])


def _value_y(ax, y: float) -> float:
    """The value a marker drawn at ``y`` stands for in the ranking: a marker in the band below
    the floor line stands for a value at or below the floor, ranked as the floor."""
    floor = _floor_of(ax)
    return y if floor is None else max(y, floor)


def _marker_boxes(fig, ax) -> dict[str, tuple[float, float, float, float]]:
    """gid -> the pixel box (x0, y0, x1, y1) of each configuration's marker: its centre from the
    line's data through the line's own transform (a marker drawn aside of close values: its
    offset), its half-width (marker size + edge width) / 2 points."""
    out = {}
    for ln in _points(ax):
        cx, cy = ln.get_transform().transform((ln.get_xdata()[0], ln.get_ydata()[0]))
        r = (ln.get_markersize() + ln.get_markeredgewidth()) / 2 * fig.dpi / 72
        out[ln.get_gid()] = (cx - r, cy - r, cx + r, cy + r)
    return out


def _legend(fig):
    return fig.legends[0] if fig.legends else fig.axes[-1].get_legend()


def _key(fig) -> list[str]:
    """The key's entries, one line each."""
    return [" ".join(t.get_text().split()) for t in _legend(fig).get_texts()]


def _entry(key: list[str], label: str) -> tuple[int, str]:
    """(index, number) of ``label``'s key entry ``"<number> <label>[ (note)]"`` (or
    ``"<number> <label> = <label> ..."``, a marker of several labels)."""
    label = " ".join(label.split())
    for i, entry in enumerate(key):
        number, _, rest = entry.partition(" ")
        if number.isdigit() and rest.startswith(label):
            if rest == label or rest[len(label) :].startswith((" (", " = ")):
                return i, number
    raise AssertionError(f"{label!r} not in the key {key}")


def _peers(records: list[Record]) -> set[str]:
    """Labels of transformers peers, from their perplexity records' protocol."""
    return {
        r.label
        for r in records
        if (r.manifest.get("decode_attention") or {}).get("protocol") == headline.PEER_PROTOCOL
    }


def _floor(records: list[Record]) -> float:
    return headline.noise_floor(headline.rows(records))


def test_every_figure_drawn_or_named_with_a_reason(figs) -> None:
    names = list(figs)
    assert len(names) == len(set(names))
    for section in ("a", "b"):
        for pair in PAIRS:
            assert not isinstance(figs[f"headline_{section}_{pair}"], str)
    for y in plots.QUALITY:
        assert not isinstance(figs[f"pareto_{y}_vs_nominal_key_bits"], str)
    # the export times latency at two contexts (drawn) and measures memory at one (not drawn)
    for kind, y in plots.SWEEPS:
        why = figs[f"{y}_vs_context"]
        if kind == "latency":
            assert not isinstance(why, str), (y, why)
        else:
            assert isinstance(why, str) and "1 context(s) [1023]" in why, (y, why)


def test_the_report_names_the_figures_it_does_not_draw(records, figs, tmp_path) -> None:
    skipped = [f"{n}: {f}" for n, f in figs.items() if isinstance(f, str)]
    assert len(skipped) == 3
    sweeps = [r for r in records if r.workload_type in ("latency", "memory")]
    text = io.StringIO()
    paths = plots.write_listed(sweeps, [str(tmp_path)], str(tmp_path), text)
    lines = text.getvalue().splitlines()
    assert [ln for ln in lines if ln.startswith("not drawn: ")][-3:] == [
        f"not drawn: {s}" for s in skipped
    ]
    assert all(f"wrote {p}" in lines for p in paths)


def test_one_style_per_configuration_equal_across_figures(figs) -> None:
    every: dict[str, tuple[str, str]] = {}
    for name, fig in _drawn(figs).items():
        here: dict[str, tuple[str, str]] = {}
        for ax in fig.axes:
            for ln in _points(ax):
                style = (to_hex(ln.get_markeredgecolor()), ln.get_marker())
                assert here.setdefault(ln.get_gid(), style) == style, (name, ln.get_gid())
        assert len(set(here.values())) == len(here), name  # unique within the figure
        for label, style in here.items():
            assert every.setdefault(label, style) == style, (name, label)  # equal across
        # the key shows each configuration in its style, numbered
        key, handles = _key(fig), _legend(fig).legend_handles
        keyed = {}
        for label in here:
            h = handles[_entry(key, label)[0]]
            keyed[label] = (to_hex(h.get_color()), h.get_marker())
        assert keyed == here, name
    # one colour per family: a family's configurations share one, families do not
    assert len(every) == 35


def test_labels_apart_and_inside(figs) -> None:
    for name, fig in _drawn(figs).items():
        renderer = fig.canvas.get_renderer()
        frame = fig.bbox
        inside = [fig._suptitle, *fig.legends] + [
            t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)
        ]
        inside += [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        for artist in inside:
            if artist is None or not artist.get_visible():
                continue
            if hasattr(artist, "get_text") and not artist.get_text():
                continue
            b = artist.get_window_extent(renderer)
            assert frame.x0 - 1 <= b.x0 and b.x1 <= frame.x1 + 1, (name, artist)
            assert frame.y0 - 1 <= b.y0 and b.y1 <= frame.y1 + 1, (name, artist)
        key = _key(fig)
        for ax in fig.axes:
            if _axes_metrics(name) is None:
                continue
            box = ax.get_window_extent(renderer)
            notes = [t for t in ax.texts if isinstance(t, Annotation) and t.get_text()]
            boxes = [t.get_window_extent(renderer) for t in notes]
            for t, b in zip(notes, boxes):
                assert box.x0 <= b.x0 and b.x1 <= box.x1, (name, t.get_text())
                assert box.y0 <= b.y0 and b.y1 <= box.y1, (name, t.get_text())
            for i, a in enumerate(boxes):
                for j in range(i + 1, len(boxes)):
                    assert not a.overlaps(boxes[j]), (
                        name,
                        notes[i].get_text(),
                        notes[j].get_text(),
                    )
            # no label box is crossed by the frontier line (pixels, segment by segment)
            front = _line(ax, "frontier")
            if front is not None:
                path = MplPath(ax.transData.transform(front.get_xydata()))
                for t, b in zip(notes, boxes):
                    assert not path.intersects_bbox(b, filled=False), (name, t.get_text())
            # nor does any label's text sit on an interval bar (its segment and end caps: the
            # line's extent), its own or another's (a leader line ends at its marker, on the
            # marker's own bar: the text's extent, without the leader)
            bars = [ln for ln in ax.lines if (ln.get_gid() or "").startswith("ci-")]
            texts = [Text.get_window_extent(t, renderer) for t in notes]
            for ln in bars:
                e = ln.get_window_extent(renderer)
                for t, b in zip(notes, texts):
                    assert not b.overlaps(e), (name, t.get_text(), ln.get_gid())
            # every point is named beside its marker: its name (its label first), or its
            # number in the key (where its name finds no room)
            texts = sorted(t.get_text() for t in notes)
            names = [ln.get_gid() for ln in _points(ax)]
            assert len(texts) == len(names), (name, ax.get_title())
            for gid in names:
                named = any(" ".join(t.split()).startswith(gid) for t in texts)
                assert named or _entry(key, gid)[1] in texts, (name, gid)


def test_frontier_is_exactly_the_non_dominated_points(records, figs) -> None:
    """The frontier of the configurations a figure ranks: transformers peers are never ranked
    (the table's rule) and are drawn hollow."""
    peers = _peers(records)
    assert peers == {"hf-dynamic", "hf-quanto K2V2", "hf-quanto K4V4"}
    for name, fig in _drawn(figs).items():
        xy = _axes_metrics(name)
        if xy is None:
            assert all(_line(ax, "frontier") is None for ax in fig.axes), name
            continue
        higher = xy[1] == "top1_agreement"
        for ax in fig.axes:
            pts = {
                ln.get_gid(): (float(ln.get_xdata()[0]), float(ln.get_ydata()[0]))
                for ln in _points(ax)
            }
            # ranked by value: a marker in the floor band stands for the floor
            vals = {gid: (x, _value_y(ax, y)) for gid, (x, y) in pts.items()}
            want = _non_dominated([v for gid, v in vals.items() if gid not in peers], higher)
            on = {gid for gid, v in vals.items() if v in want and gid not in peers}
            front = _line(ax, "frontier")
            got = list(zip(map(float, front.get_xdata()), map(float, front.get_ydata())))
            # the line runs through exactly the markers of the non-dominated configurations
            assert sorted(got) == sorted({pts[gid] for gid in on}), name
            assert [x for x, _ in got] == sorted(x for x, _ in got), name
            for ln in _points(ax):  # filled on the frontier, hollow where dominated or a peer
                filled = ln.get_markerfacecolor() != "none"
                assert filled == (ln.get_gid() in on), (name, ln.get_gid())


def test_markers_at_the_floor_apart_in_its_band(figs) -> None:
    """No marker hides another at the noise floor: values at or below it (the committed run's
    full and hf-dynamic at 16 nominal key bits, the two pm-kvq rows at one step ratio in (a)'s
    KL vs decode) are drawn in the shaded band (gid ``floor-band``) below the floor line,
    inside the axes, and the pixel box of such a marker overlaps no other marker's; a value
    above the floor stays above the line (markers above it apart:
    :func:`test_no_marker_overlaps_another`)."""
    banded = set()
    for name, fig in _drawn(figs).items():
        if _axes_metrics(name) is None:
            continue
        for ax in fig.axes:
            boxes = _marker_boxes(fig, ax)
            floor_y = _floor_of(ax)
            band = [pt for pt in ax.patches if pt.get_gid() == "floor-band"]
            below = {
                g for g in boxes if floor_y is not None and _line(ax, g).get_ydata()[0] < floor_y
            }
            if not below:
                assert not band, name
                continue
            banded |= {(name, g) for g in below}
            assert len(band) == 1, name
            frame = ax.get_window_extent()
            fy = ax.transData.transform((0, floor_y))[1]
            for a in sorted(below):
                p = boxes[a]
                assert p[3] <= fy and p[1] >= frame.y0 - 0.5, (name, a)  # in the band
                for b, q in boxes.items():
                    apart = p[2] <= q[0] or q[2] <= p[0] or p[3] <= q[1] or q[3] <= p[1]
                    assert b == a or apart, (name, ax.get_title(), a, b)
            for g, (_, y0, _, y1) in boxes.items():
                if g not in below:  # a value above the floor: above the line
                    assert (y0 + y1) / 2 >= fy - 1e-6, (name, g)
    assert {
        ("headline_a_kl_vs_decode", "pm-kvq K2V2 (budget 2 bits)"),
        ("headline_a_kl_vs_decode", "pm-kvq K4V4 (budget 4 bits)"),
        ("pareto_key_mse_vs_nominal_key_bits", "full"),
        ("pareto_key_mse_vs_nominal_key_bits", "hf-dynamic"),
    } <= banded


def test_points_at_their_records_values_and_the_tables_floor(records, figs) -> None:
    rows = {r["label"]: r for r in headline.rows(records)}
    floor = _floor(records)
    by_label: dict[str, list[Record]] = {}
    for r in records:
        by_label.setdefault(r.label, []).append(r)
    for name, fig in _drawn(figs).items():
        xy = _axes_metrics(name)
        if xy is None:
            continue
        x, y = xy
        floors = {
            float(ln.get_ydata()[0])
            for ax in fig.axes
            for ln in ax.lines
            if ln.get_gid() == "floor"
        }
        assert len(floors) <= 1, name  # one floor per figure
        for ax in fig.axes:
            for ln in _points(ax):
                gid, px, py = ln.get_gid(), float(ln.get_xdata()[0]), float(ln.get_ydata()[0])
                bottom = ax.get_ylim()[0]
                if name.startswith("headline_"):
                    row = rows[gid]
                    want_y = row[y] if y != plots.DECODE else None
                    if y == "next_token_kl" and row[y] <= floor:
                        # at or below the floor: in the band between the axes' bottom and it
                        assert bottom <= py < floor, (name, gid, py)
                    elif want_y is not None:
                        assert py == pytest.approx(want_y, rel=1e-12), (name, gid)
                    if x == "bytes_ratio":
                        assert px == pytest.approx(row["bytes_ratio"], rel=1e-12), (name, gid)
                else:
                    vals = [r.metrics[y] for r in by_label[gid] if y in r.metrics]
                    band = [v for v in vals if floors and v <= min(floors)]
                    if band:
                        assert bottom <= py < min(floors), (name, gid, py)
                    else:
                        assert any(py == pytest.approx(v) for v in vals), (name, gid)
                    assert any(r.metrics.get(x) == px for r in by_label[gid]), (name, gid)
        if y == "next_token_kl":
            # the figure's floor is the headline table's, worded as its note words it
            assert floors == {floor}, name
            stated = (
                f"full's noise floor ({floor:.0e}: the largest |KL| of unquantized rows, "
                f"at least {headline.KL_FLOOR:.0e})"
            )
            assert stated in headline.headline_table(records)
            assert stated in " ".join(_key(fig)), name


def test_error_bars_where_records_carry_intervals(records, figs) -> None:
    """Every axis whose record carries a 95% interval shows it: the perplexity record's KL, the
    latency record's step (at the longest context, the one the step axis names)."""
    rows = {r["label"]: r for r in headline.rows(records)}
    longest: dict[str, Record] = {}
    for r in records:
        if r.workload_type == "latency" and plots.DECODE in r.metrics:
            if r.label not in longest or plots.context(r) > plots.context(longest[r.label]):
                longest[r.label] = r
    floor = _floor(records)
    for name, fig in _drawn(figs).items():
        xy = _axes_metrics(name)
        if xy is None:
            continue
        x, y = xy
        n = 0
        for ax in fig.axes:
            for ln in _points(ax):
                gid = ln.get_gid()
                if name.startswith("headline_"):
                    src = rows[gid]["sources"]["perplexity"]
                else:
                    src = next(
                        r for r in records if r.label == gid and y in r.metrics
                    )  # one record per label and metric in this export
                for axis, metric in (("x", x), ("y", y)):
                    # the step axis: the latency record it names
                    rec = longest[gid] if metric == plots.DECODE else src
                    lo = rec.metrics.get(f"{metric}_ci_low")
                    hi = rec.metrics.get(f"{metric}_ci_high")
                    bar = _line(ax, f"ci-{axis}:{gid}")
                    if lo is None or hi is None:
                        assert bar is None, (name, gid, axis)
                        continue
                    n += 1
                    assert bar is not None, (name, gid, axis)
                    data = bar.get_ydata() if axis == "y" else bar.get_xdata()
                    # a bound at or below the floor sits on it, or at its marker where the
                    # marker is in the band below the floor
                    mark = float(ln.get_ydata()[0])
                    low = metric == "next_token_kl"
                    want = [min(mark, floor) if low and v <= floor else v for v in (lo, hi)]
                    assert list(map(float, data)) == pytest.approx(want, rel=1e-12), (name, gid)
        if y in ("next_token_kl", "top1_agreement") or x == plots.DECODE:
            assert n >= 5, name  # the perplexity and latency records carry intervals


def test_titles_name_model_text_context_and_protocol(records, figs) -> None:
    models = {str(r.model["id"]) for r in records}
    texts = {str(r.workload["text"]) for r in records if "text" in r.workload}
    contexts = {plots.context(r) for r in records} - {None}
    protocols = {plots.protocol(r) for r in records}
    for name, fig in _drawn(figs).items():
        title = " ".join(fig.get_suptitle().split())
        assert any(f"model {m}" in title for m in models), name
        assert any(f"text {t}" in title for t in texts), name
        assert re.search(r"context (\d+(, )?)+ tokens", title), name
        assert any(f"context {c} tokens" in title or f" {c}" in title for c in contexts), name
        assert any(f"protocol {p}" in title for p in protocols), name
        # a headline figure draws no transformers peer: its title names no peer's protocol
        if name.startswith("headline_"):
            assert headline.PEER_PROTOCOL not in title, name


def test_values_at_16_bits_never_share_a_nominal_bits_axis(records, figs) -> None:
    """Every configuration of an axes but ``full`` keeps its values at 16 bits (nominal value
    bits, as its records carry them) or none does: peers too (hf-dynamic keeps them)."""
    v16 = {
        r.label: r.metrics["nominal_value_bits"] >= 16
        for r in records
        if "nominal_value_bits" in r.metrics and r.method != "full"
    }
    assert v16["hf-dynamic"] and not v16["hf-quanto K2V2"] and v16["kivi K2 V16"]
    for name, fig in _drawn(figs).items():
        if not name.endswith("_vs_nominal_key_bits"):
            continue
        seen = []
        for ax in fig.axes:
            kinds = {v16[ln.get_gid()] for ln in _points(ax) if ln.get_gid() != "full"}
            assert len(kinds) == 1, (name, ax.get_title(), kinds)
            seen += kinds
        assert sorted(seen) == [False, True], name
        # a configuration storing more bits than its formula says: the key says so
        assert re.search(r"pm-kvq K2V2 \(budget 2 bits\) \(stores \d", " ".join(_key(fig))), name


def test_combined_figure_sizes_follow_the_step_ratio(records, figs) -> None:
    # the marker size follows the step ratio at each row's longest latency context
    longest: dict[str, Record] = {}
    for r in records:
        if r.workload_type == "latency" and plots.DECODE in r.metrics:
            if r.label not in longest or plots.context(r) > plots.context(longest[r.label]):
                longest[r.label] = r
    step = {label: r.metrics[plots.DECODE] for label, r in longest.items()}
    for section in ("a", "b"):
        fig = figs[f"headline_{section}_kl_vs_bytes_by_step"]
        size = {}
        for ln in _points(fig.axes[0]):
            ms = ln.get_markersize() / (1.4 if ln.get_marker() == "*" else 1.0)
            size[ln.get_gid()] = ms
        labels = sorted(size, key=lambda lb: step[lb])
        assert [size[lb] for lb in labels] == sorted(size[lb] for lb in labels)
        assert size[labels[0]] < size[labels[-1]]


def test_names_as_the_table_peers_and_merged_rows(records, figs) -> None:
    """The figures name configurations as the headline table does: a peer ``<label> (peer)``
    wherever it is drawn and never in a headline section figure (the table gives peers their
    own section); configurations holding one cache (the table's merged rows, equal values and
    intervals) are one marker whose key entry names every label, ``A = B``."""
    peers = _peers(records)
    table = headline.headline_table(records)
    merged = [
        " = ".join(r["label"] for r in g)
        for g in headline.merge_groups([r for r in headline.rows(records) if r["section"] == "b"])
        if len(g) > 1
    ]
    assert merged == ["kivi K2 V16 = per-channel K2 V16"] and all(
        f"| {m} |" in table for m in merged
    )
    drew_peer = 0
    for name, fig in _drawn(figs).items():
        key = _key(fig)
        gids = {ln.get_gid() for ax in fig.axes for ln in _points(ax)}
        for label in peers & gids:
            i, _ = _entry(key, label)
            assert key[i].split(" ", 1)[1].startswith(f"{label} (peer)"), (name, key[i])
            drew_peer += 1
        if name.startswith("headline_"):
            assert not peers & gids, name
        floors = {float(ln.get_ydata()[0]) for ax in fig.axes for ln in _points(ax)}
        floors &= {
            float(ln.get_ydata()[0])
            for ax in fig.axes
            for ln in ax.lines
            if ln.get_gid() == "floor"
        }
        for ax in fig.axes:  # one marker per position and intervals (off the floor, where
            seen = {}  # values at or below it are drawn by rule)
            for ln in _points(ax):
                gid = ln.get_gid()
                if float(ln.get_ydata()[0]) in floors:
                    continue
                bars = tuple(
                    tuple(map(float, b.get_xydata().ravel()))
                    for b in (_line(ax, f"ci-x:{gid}"), _line(ax, f"ci-y:{gid}"))
                    if b is not None
                )
                at = (float(ln.get_xdata()[0]), float(ln.get_ydata()[0]), bars)
                assert at not in seen, (name, gid, seen.get(at))
                seen[at] = gid
    assert drew_peer >= 3
    for section, pair in (("b", "kl_vs_bytes"), ("b", "kl_vs_bytes_by_step")):
        key = _key(figs[f"headline_{section}_{pair}"])
        for m in merged:
            assert any(e.split(" ", 1)[1].startswith(m) for e in key), (pair, key)
    # every configuration drawn is named in the key, also one merged into another's marker in
    # one panel only (hf-dynamic with full at top-1 1.0, beside full alone in the other panel)
    for name, fig in _drawn(figs).items():
        m = re.fullmatch(r"pareto_(.+)_vs_nominal_key_bits", name)
        if m:
            text = " ".join(_key(fig))
            for label in {r.label for r in records if m.group(1) in r.metrics}:
                assert label in text, (name, label)
    nominal = _key(figs["pareto_key_mse_vs_nominal_key_bits"])
    assert any(e.split(" ", 1)[1].startswith(merged[0]) for e in nominal), nominal


def test_no_marker_overlaps_another(figs) -> None:
    """Close values above the floor too (the committed run's per-channel and per-token K2V2,
    a few hundredths apart in bytes and KL): the pixel boxes of the markers of a Pareto panel
    (where each is drawn: a marker set aside carries its offset in its transform) overlap
    pairwise nowhere, and a marker set aside keeps its value in its data (checked against the
    records by :func:`test_points_at_their_records_values_and_the_tables_floor`) and its
    interval bars move with it."""
    moved = 0
    for name, fig in _drawn(figs).items():
        if _axes_metrics(name) is None:
            continue
        for ax in fig.axes:
            boxes = sorted(_marker_boxes(fig, ax).items())
            for i, (a, p) in enumerate(boxes):
                for b, q in boxes[i + 1 :]:
                    apart = p[2] <= q[0] or q[2] <= p[0] or p[3] <= q[1] or q[3] <= p[1]
                    assert apart, (name, ax.get_title(), a, b)
            for ln in _points(ax):
                shift = ln.get_transform().transform((0, 0)) - ax.transData.transform((0, 0))
                if abs(shift[0]) > 1e-9:
                    moved += 1
                    assert abs(shift[1]) < 1e-9, (name, ln.get_gid())  # sideways only
                for axis in ("x", "y"):
                    bar = _line(ax, f"ci-{axis}:{ln.get_gid()}")
                    if bar is not None:
                        got = bar.get_transform().transform((0, 0)) - ax.transData.transform((0, 0))
                        assert got == pytest.approx(shift), (name, bar.get_gid())
    assert moved  # the committed run has close values


def test_no_tick_label_inside_the_floor_band(figs) -> None:
    """The band below the floor line draws values at or below the floor in lanes, not at their
    values: no y tick label there (a tick at the floor keeps its label)."""
    seen = 0
    for name, fig in _drawn(figs).items():
        for ax in fig.axes:
            floor = _floor_of(ax)
            if floor is None or not [p for p in ax.patches if p.get_gid() == "floor-band"]:
                continue
            lo, hi = ax.get_ylim()
            for tick in ax.yaxis.get_major_ticks() + ax.yaxis.get_minor_ticks():
                v, label = tick.get_loc(), tick.label1
                if not (lo <= v <= hi) or not label.get_visible() or not label.get_text():
                    continue
                seen += 1
                assert v >= floor * (1 - 1e-9), (name, label.get_text(), v, floor)
    assert seen
