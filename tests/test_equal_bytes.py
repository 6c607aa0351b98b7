"""Report section (c), eviction vs quantization at equal measured bytes
(kvbench.report.equal_bytes), on hand-made records whose values are chosen here: the binning by
measured bytes, the winners per budget and family, the tasks left out where ``full`` scores
below 50%, and the figure's frontier lines (through non-dominated points only)."""

from __future__ import annotations

import pytest

from kvbench.bench.records import Record
from kvbench.report import equal_bytes as eb

AGN, AWARE = "question-agnostic", "question-aware"
#: a 100-token cache of 1 layer x 1 KV head x 1 channel: its 16-bit cache is 400 bytes
GEOMETRY = {"num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 1, "id": "toy/model"}
BYTES16 = 400
FULL_KV = {"name": "full", "config": {"storage_dtype": "float16"}}
KIVI = {"name": "kivi", "config": {"bits": 4}}


def _rec(label: str, method: str, config: dict, wtype: str, metrics: dict, **kw) -> Record:
    workload = {"type": wtype, **kw.pop("workload", {})}
    return Record(
        run_id=f"{label}-{wtype}-{workload.get('protocol', '')}",
        method=method,
        config=config,
        metrics=metrics,
        model={"id": "toy/model"},
        workload=workload,
        per_layer=kw.pop("per_layer", None),
        manifest={"label": label, "model": GEOMETRY},
    )


def kl_rec(label: str, method: str, config: dict, ratio: float, kl: float) -> Record:
    m = {
        "bytes_total": ratio * BYTES16,
        "next_token_kl": kl,
        "next_token_kl_ci_low": kl * 0.9,
        "next_token_kl_ci_high": kl * 1.1,
    }
    return _rec(label, method, config, "perplexity", m, workload={"tokens": 101})


def ruler_rec(label: str, method: str, config: dict, protocol: str, scores: dict) -> Record:
    """A ruler11 record with two examples per task, scored ``scores[task]`` each."""
    examples = [{"task": t, "ruler11_score": s} for t, s in scores.items() for _ in range(2)]
    m = {f"ruler11_{t}": s for t, s in scores.items()}
    m["ruler11_avg"] = sum(scores.values()) / len(scores)
    return _rec(
        label,
        method,
        config,
        "ruler11",
        m,
        workload={"protocol": protocol, "tasks": list(scores)},
        per_layer={"examples": examples},
    )


def row(label: str, method: str, config: dict, ratio: float, kl: float, niah: float, cwe: float):
    return [
        kl_rec(label, method, config, ratio, kl),
        ruler_rec(label, method, config, AGN, {"niah": niah, "cwe": cwe}),
    ]


def records() -> list[Record]:
    """full (cwe: 0.25, below 50%); eviction, quantization and combined rows at the budgets."""
    ev = {"keep_ratio": 0.5, "quantizer": FULL_KV}
    comb = {"keep_ratio": 0.5, "quantizer": KIVI}
    out = row("full", "full", {}, 1.0, 0.0, 1.0, 0.25)
    out += row("snap 0.5", "snapkv", ev, 0.50, 0.20, 0.75, 0.0)
    out += row("knorm 0.5", "knorm", ev, 0.55, 0.10, 0.5, 1.0)  # wins only by cwe: left out
    out += row("h2o 0.25", "h2o", ev, 0.26, 0.30, 0.5, 0.0)
    out += row("h2o 0.125", "h2o", ev, 0.125, 0.50, 0.25, 0.0)
    out += row("tova 0.7", "tova", ev, 0.70, 0.01, 1.0, 0.0)  # outside every bin
    out += row("int8", "int8-block", {}, 0.53, 0.05, 1.0, 0.0)  # dominated by kivi4
    out += row("int4", "int4-block", {}, 0.28, 0.06, 0.75, 0.0)
    out += row("kivi2", "kivi", {"bits": 2}, 0.24, 0.08, 0.5, 0.0)
    out += row("turbo2", "turboquant-mse", {"bits": 2}, 0.14, 0.40, 0.25, 0.0)
    out += row("kivi4", "kivi", {"bits": 4}, 0.36, 0.03, 1.0, 0.0)  # dominated by nothing
    out += row("snap+kivi", "snapkv", comb, 0.13, 0.12, 0.75, 0.0)
    return out


@pytest.fixture(scope="module")
def rows() -> dict[str, eb.FamilyRow]:
    return {r["label"]: r for r in eb.family_rows(records())}


def test_families_come_from_method_and_quantizer(rows) -> None:
    fams = {lb: r["family"] for lb, r in rows.items()}
    assert fams["full"] == "full"
    assert fams["snap 0.5"] == fams["h2o 0.25"] == "eviction"
    assert fams["int8"] == fams["kivi2"] == "quantization"
    assert fams["snap+kivi"] == "combined"


@pytest.mark.parametrize(
    "ratio, budget",
    [
        (0.5, 0.5),
        (0.6, 0.5),
        (0.4, 0.5),
        (0.61, None),
        (0.39, None),
        (0.3, 0.25),
        (0.31, None),
        (0.36, None),
        (0.2, 0.25),
        (0.15, 0.125),
        (0.1, 0.125),
        (0.09, None),
        (None, None),
    ],
)
def test_binning_tolerance(ratio, budget) -> None:
    assert eb.budget_of(ratio) == budget


def test_rows_are_binned_by_measured_bytes(rows) -> None:
    assert rows["full"]["bytes_ratio"] == pytest.approx(1.0)
    got = {lb: r["budget"] for lb, r in rows.items()}
    assert got == {
        "full": None,
        "snap 0.5": 0.5,
        "knorm 0.5": 0.5,
        "h2o 0.25": 0.25,
        "h2o 0.125": 0.125,
        "tova 0.7": None,
        "int8": 0.5,
        "int4": 0.25,
        "kivi2": 0.25,
        "turbo2": 0.125,
        "kivi4": None,
        "snap+kivi": 0.125,
    }


def test_tasks_where_full_is_below_half_are_left_out(rows) -> None:
    assert eb.excluded_tasks(records()) == {AGN: {"cwe": 0.25}}
    # knorm's cwe 1.0 would lift it to 0.75; niah alone is 0.5
    assert rows["knorm 0.5"]["scores"][AGN]["value"] == pytest.approx(0.5)
    assert rows["snap 0.5"]["scores"][AGN]["value"] == pytest.approx(0.75)
    lo, hi = rows["snap 0.5"]["scores"][AGN]["low"], rows["snap 0.5"]["scores"][AGN]["high"]
    assert lo < 0.75 < hi
    # the per-task table keeps cwe
    assert rows["knorm 0.5"]["tasks"][AGN]["cwe"]["value"] == 1.0
    text = eb.section(records())
    assert "Left out of the frontier (question-agnostic): cwe, `full` scores 0.250 < 0.5" in text
    assert "cwe (left out)" in text


def test_winners_per_budget_and_family(rows) -> None:
    w = eb.winners(list(rows.values()))
    name = {
        b: {f: {k: (r["label"] if r else None) for k, r in c.items()} for f, c in fams.items()}
        for b, fams in w.items()
    }
    assert name[0.5]["eviction"] == {"kl": "knorm 0.5", AGN: "snap 0.5"}
    assert name[0.5]["quantization"] == {"kl": "int8", AGN: "int8"}
    assert name[0.5]["combined"] == {"kl": None, AGN: None}
    assert name[0.25]["eviction"] == {"kl": "h2o 0.25", AGN: "h2o 0.25"}
    assert name[0.25]["quantization"] == {"kl": "int4", AGN: "int4"}
    assert name[0.125]["eviction"] == {"kl": "h2o 0.125", AGN: "h2o 0.125"}
    assert name[0.125]["quantization"] == {"kl": "turbo2", AGN: "turbo2"}
    assert name[0.125]["combined"] == {"kl": "snap+kivi", AGN: "snap+kivi"}


def test_score_ties_go_to_fewer_bytes() -> None:
    ev = {"keep_ratio": 0.5, "quantizer": FULL_KV}
    recs = row("full", "full", {}, 1.0, 0.0, 1.0, 1.0)
    recs += row("a", "knorm", ev, 0.55, 0.1, 0.5, 0.5)
    recs += row("b", "knorm", ev, 0.45, 0.1, 0.5, 0.5)
    w = eb.winners(eb.family_rows(recs))
    assert w[0.5]["eviction"]["kl"]["label"] == "b"
    assert w[0.5]["eviction"][AGN]["label"] == "b"


def test_section_text_is_computed_from_the_records() -> None:
    text = eb.section(records())
    assert text.startswith("#### (c) Eviction vs quantization at equal measured bytes")
    assert f"|bytes / b - 1| <= {eb.TOLERANCE}" in text
    assert "| 0.5 | eviction | knorm 0.5: 0.100 [0.090, 0.110] (bytes 0.550) |" in text
    assert "| turbo2 | quantization | 0.140 | 0.125 |" in text
    assert eb.section([r for r in records() if r.method in ("full", "kivi")]) == ""


def _frontier_lines(fig) -> dict[tuple[int, str], list[tuple[float, float]]]:
    out = {}
    for i, ax in enumerate(fig.axes):
        for line in ax.get_lines():
            if line.get_label().startswith("frontier "):
                xy = list(zip(line.get_xdata(), line.get_ydata()))
                out[i, line.get_label().removeprefix("frontier ")] = [
                    (float(x), float(y)) for x, y in xy
                ]
    return out


def flat(points) -> list[float]:
    return [v for p in points for v in p]


def test_figure_lines_run_through_non_dominated_points_only() -> None:
    import matplotlib.pyplot as plt

    held = plt.get_fignums()
    fig = eb.figure(records())
    assert not isinstance(fig, str), fig
    assert plt.get_fignums() == held  # built outside pyplot (plots.new_figure): nothing to close
    lines = {k: flat(v) for k, v in _frontier_lines(fig).items()}
    assert set(lines) == {(i, f) for i in (0, 1) for f in eb.FAMILIES}
    # panel 0: task score (question-agnostic, cwe left out), higher better; knorm 0.5
    # (0.55, 0.5) is beaten by snap 0.5 (0.5, 0.75), int8 (0.53, 1.0) by kivi4 (0.36, 1.0)
    assert lines[0, "eviction"] == pytest.approx(
        flat([(0.125, 0.25), (0.26, 0.5), (0.5, 0.75), (0.7, 1.0)])
    )
    assert lines[0, "quantization"] == pytest.approx(
        flat([(0.14, 0.25), (0.24, 0.5), (0.28, 0.75), (0.36, 1.0)])
    )
    assert lines[0, "combined"] == pytest.approx([0.13, 0.75])
    # panel 1: KL, lower better: every eviction row is lower than those with fewer bytes;
    # int8 (0.53, 0.05) is beaten by kivi4 (0.36, 0.03)
    assert lines[1, "eviction"] == pytest.approx(
        flat([(0.125, 0.5), (0.26, 0.3), (0.5, 0.2), (0.55, 0.1), (0.7, 0.01)])
    )
    assert lines[1, "quantization"] == pytest.approx(
        flat([(0.14, 0.4), (0.24, 0.08), (0.28, 0.06), (0.36, 0.03)])
    )
    # a dominated point is drawn, not joined
    scattered = [tuple(map(float, p)) for c in fig.axes[1].collections for p in c.get_offsets()]
    assert any(p == pytest.approx((0.53, 0.05)) for p in scattered)


def test_figure_leaves_dominated_points_off_the_line() -> None:
    ev = {"keep_ratio": 0.5, "quantizer": FULL_KV}
    recs = row("full", "full", {}, 1.0, 0.0, 1.0, 1.0)
    recs += row("good", "knorm", ev, 0.25, 0.1, 1.0, 1.0)
    recs += row("bad", "knorm", ev, 0.5, 0.3, 0.5, 0.5)  # more bytes, worse: dominated
    fig = eb.figure(recs)
    assert not isinstance(fig, str), fig
    lines = {k: flat(v) for k, v in _frontier_lines(fig).items()}
    assert lines[0, "eviction"] == pytest.approx([0.25, 1.0])
    assert lines[1, "eviction"] == pytest.approx([0.25, 0.1])
    colours = {c.get_label(): c for c in fig.axes[0].collections}
    assert set(colours) == {"eviction", "full"}
    # the dominated row is drawn (0.5 bytes, KL 0.3), not joined
    scattered = [tuple(map(float, p)) for c in fig.axes[1].collections for p in c.get_offsets()]
    assert any(p == pytest.approx((0.5, 0.3)) for p in scattered)


def test_no_eviction_rows_no_figure() -> None:
    recs = [r for r in records() if r.method in ("full", "int8-block")]
    assert isinstance(eb.figure(recs), str)


def test_eviction_rows_leave_the_headline_tables_to_section_c() -> None:
    """The headline's (a)/(b) tables hold quantized caches only: eviction and combined rows
    (a ``quantizer`` in their config) are compared in section (c), quantized rows stay in (a)."""
    from kvbench.report.headline import headline_table, rows

    recs = records()
    sections = {r["label"]: r["section"] for r in rows(recs)}
    assert sections["snap 0.5"] == sections["h2o 0.25"] == "evict"
    assert sections["int4"] == sections["kivi2"] == "a" and sections["full"] == "base"
    table = headline_table(recs)
    assert "| int4 |" in table and "snap 0.5" not in table and "h2o 0.25" not in table
