"""Report tables and compare as a reader meets them: rows by method family, bits, label;
nominal and effective bits in every table (borrowed from the same configuration's fidelity
record, marked); flags shown; compare lists only metrics that moved, by label."""

from __future__ import annotations

import copy
import json
from argparse import Namespace

from kvbench.bench.records import new_record, write_record
from kvbench.report.compare import changes, compare
from kvbench.report.compare import main as compare_main
from kvbench.report.tables import main as report_main
from kvbench.report.tables import summary_table, tables

FID = {"type": "fidelity", "tokens": 512, "prefill": 256}
GEN = {"type": "generation", "new_tokens": 8}


def rec(method, config, workload, metrics, label=None, flags=None):
    manifest = {"label": label or method, "model": {"head_dim": 64}}
    if flags:
        manifest["flags"] = flags
    return new_record(
        method=method,
        config=config,
        model={"id": "m"},
        workload=workload,
        metrics=metrics,
        manifest=manifest,
    )


RECORDS = [
    rec(
        "kivi",
        {"bits": 4},
        FID,
        {
            "nominal_key_bits": 4.25,
            "effective_key_bits": 5.1,
            "nominal_value_bits": 16,
            "effective_value_bits": 16.0,
            "attn_kl": 0.01,
        },
        "kivi[bits=4]",
    ),
    rec(
        "per-channel",
        {"bits": 2},
        FID,
        {
            "nominal_key_bits": 2.25,
            "effective_key_bits": 3.0,
            "nominal_value_bits": 16,
            "effective_value_bits": 16.0,
            "attn_kl": 0.2,
        },
        "pc2",
    ),
    rec(
        "kivi",
        {"bits": 2},
        FID,
        {
            "nominal_key_bits": 2.25,
            "effective_key_bits": 32.0,
            "nominal_value_bits": 16,
            "effective_value_bits": 16.0,
            "attn_kl": 0.0,
        },
        "kivi[bits=2]",
        flags=["nothing quantized (< 25% of the key tokens)"],
    ),
    rec(
        "full",
        {},
        FID,
        {
            "nominal_key_bits": 16,
            "effective_key_bits": 32.0,
            "nominal_value_bits": 16,
            "effective_value_bits": 32.0,
            "attn_kl": 0.0,
        },
    ),
    rec("kivi", {"bits": 2}, GEN, {"gen_match_rate": 0.5}, "kivi[bits=2]"),
    rec("per-token", {"bits": 2}, GEN, {"gen_match_rate": 0.3}, "per-token[bits=2]"),
    rec("full", {}, GEN, {"gen_match_rate": 1.0}),
]


def test_rows_sorted_by_family_bits_label_and_workloads_by_type() -> None:
    t = tables(list(reversed(RECORDS)))
    assert [x["workload"].split(" ")[0] for x in t] == ["fidelity", "generation"]
    assert [r["label"] for r in t[0]["rows"]] == ["full", "kivi[bits=2]", "kivi[bits=4]", "pc2"]
    assert [r["label"] for r in t[1]["rows"]] == ["full", "kivi[bits=2]", "per-token[bits=2]"]


def test_every_table_has_nominal_and_effective_bits() -> None:
    t = tables(RECORDS)
    for table in t:
        assert table["columns"][:4] == [
            "nominal_key_bits",
            "nominal_value_bits",
            "effective_key_bits",
            "effective_value_bits",
        ]
    gen = {r["label"]: r for r in t[1]["rows"]}
    # borrowed from kivi[bits=2]'s fidelity record, marked
    assert gen["kivi[bits=2]"]["values"]["effective_key_bits"] == 32.0
    assert "effective_key_bits" in gen["kivi[bits=2]"]["borrowed"]
    # per-token has no record with bits: its cells stay empty (never recomputed from the
    # method's formula) and a note says why
    assert not {"nominal_key_bits", "effective_key_bits"} & set(gen["per-token[bits=2]"]["values"])
    assert gen["kivi[bits=2]"]["values"]["nominal_key_bits"] == 2.25
    (why,) = [n for n in t[1]["notes"] if n.startswith("nominal bits empty")]
    assert why.startswith("nominal bits empty for per-token[bits=2]: no record")
    assert not any(n.startswith("nominal bits empty") for n in t[0]["notes"])
    md = summary_table(RECORDS)
    assert "| per-token[bits=2] |  |  |  |  |" in md
    assert "| kivi[bits=2] ! |" in md and "> ! kivi[bits=2]: nothing quantized" in md
    assert "| 32.0000* |" in md.split("### generation")[1]


def test_report_text_on_stdout_plot_paths_on_stderr(tmp_path, capsys) -> None:
    for r in RECORDS:
        write_record(tmp_path / f"{r.run_id}.json", r)
    args = Namespace(results=[str(tmp_path)], plots=None, no_plots=False, json=False)
    assert report_main(args) == 0
    out, err = capsys.readouterr()
    assert "wrote" not in out and "### fidelity" in out
    assert "wrote" in err
    report_main(Namespace(results=[str(tmp_path)], plots=None, no_plots=True, json=True))
    data = json.loads(capsys.readouterr().out)
    assert [t["workload"].split()[0] for t in data["tables"]] == ["fidelity", "generation"]


def test_report_reads_an_export_and_names_the_figures_it_cannot_draw(tmp_path, capsys) -> None:
    """``kvbench report docs/results/default.json`` (the committed export, as a reader first
    tries it) prints the headline of its records, and every figure :func:`figures` cannot draw
    is named on stderr, as ``kvbench plot`` names it."""
    from pathlib import Path

    from kvbench.report.export import load_export
    from kvbench.report.plots import figures, load

    committed = Path(__file__).resolve().parents[1] / "docs" / "results" / "default.json"
    data = json.loads(committed.read_text())  # three methods of it keep the plotting quick
    keep = {"full", "kivi K2V2", "int4-block q4_0 K+V"}
    data["records"] = [
        r for r in data["records"] if r["manifest"].get("label", r["method"]) in keep
    ]
    export = tmp_path / "export.json"
    export.write_text(json.dumps(data))
    args = Namespace(results=[str(export)], plots=str(tmp_path), no_plots=False, json=False)
    assert report_main(args) == 0
    out, err = capsys.readouterr()
    n = len(load_export(export)["records"])
    assert n >= 9 and len(load([str(export)])) == n
    assert "## Headline" in out and "| kivi K2V2 |" in out
    want = [
        f"not drawn: {name}: {why}"
        for name, why in figures(load([str(export)]))
        if isinstance(why, str)
    ]
    assert want and [ln for ln in err.splitlines() if ln.startswith("not drawn")] == want


def test_compare_lists_only_moved_metrics_by_label(tmp_path, capsys) -> None:
    new = copy.deepcopy(RECORDS)
    new[0].metrics["attn_kl"] = 0.01 * (1 + 1e-7)  # float noise: not listed
    new[1].metrics["attn_kl"] = 0.3  # moved +50%
    new[2].metrics["attn_kl"] = 1e-9  # from exactly 0: listed
    found, failures = changes(RECORDS, new, [])
    assert failures == []
    assert [(c["run"].split(" / ")[0], c["metric"]) for c in found] == [
        ("pc2", "attn_kl"),
        ("kivi[bits=2]", "attn_kl"),
    ]
    assert abs(found[0]["relative"] - 0.5) < 1e-12 and found[1]["relative"] is None
    lines, _ = compare(RECORDS, new, [])
    assert lines[0].startswith("pc2 / fidelity (prefill=256, tokens=512) attn_kl: 0.2 -> 0.3")
    for name, rs in (("base", RECORDS), ("new", new)):
        (tmp_path / name).mkdir()
        for r in rs:
            write_record(tmp_path / name / f"{r.run_id}.json", r)
    args = Namespace(
        base=str(tmp_path / "base"),
        new=str(tmp_path / "new"),
        fail_on=["attn_kl:10%"],
        min_change=1e-4,
        json=True,
    )
    assert compare_main(args) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["matched"] == 7 and len(data["changes"]) == 2 and len(data["failures"]) == 2


def test_records_of_several_models_get_one_table_per_model() -> None:
    """Two shape models (and a float32 copy of one) in one set: every table names its model,
    no two rows of a table are the same method on different models."""

    def on(model, method):
        r = rec(method, {}, {"type": "memory", "context": 64}, {"bytes_total": 1.0})
        r.model = model
        return r

    qwen = {"id": "shape:qwen3-8b", "dtype": "float16", "device": "cpu"}
    llama = {"id": "shape:llama-3.1-8b", "dtype": "float16", "device": "cpu"}
    llama32 = {**llama, "dtype": "float32"}
    t = tables([on(m, x) for m in (qwen, llama) for x in ("full", "kivi")])
    assert [x["workload"] for x in t] == [
        "memory (context=64) on shape:llama-3.1-8b",
        "memory (context=64) on shape:qwen3-8b",
    ]
    assert all([r["label"] for r in x["rows"]] == ["full", "kivi"] for x in t)
    t = tables([on(m, "full") for m in (qwen, llama, llama32)])
    assert [x["workload"].split(" on ")[1] for x in t] == [
        "shape:llama-3.1-8b (float16, cpu)",
        "shape:llama-3.1-8b (float32, cpu)",
        "shape:qwen3-8b",
    ]
    assert "### memory (context=64) on shape:qwen3-8b" in summary_table(
        [on(qwen, "full"), on(llama, "full")]
    )
    # one model: the title is the workload's alone, as before
    assert [x["workload"] for x in tables([on(qwen, "full")])] == ["memory (context=64)"]


def test_bytes_vs_16bit_column_is_the_headlines_definition():
    """A perplexity record of a float32 model (2 layers x 1 KV head x head_dim 4, tokens 9: 8
    cached tokens): 16-bit cache = 8 x 2 x 1 x 4 x 2 sides x 2 bytes = 256 bytes, so 512 bytes
    of float32 K/V are 2.0 and 64 bytes 0.25, in the perplexity table and in the headline."""
    from kvbench.report.headline import rows

    geo = {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 4}
    wl = {"type": "perplexity", "tokens": 9, "prefill": 4}
    recs = [
        new_record(
            method=m,
            config={},
            model={"id": "m"},
            workload=wl,
            metrics={"bytes_total": b, "next_token_kl": kl},
            manifest={"label": m, "model": geo},
        )
        for m, b, kl in (("full", 512, 0.0), ("kivi", 64, 0.1))
    ]
    (t,) = tables(recs)
    got = {row["label"]: row["values"]["bytes_vs_16bit"] for row in t["rows"]}
    assert got == {"full": 2.0, "kivi": 0.25}
    assert {r["label"]: r["bytes_ratio"] for r in rows(recs)} == got


def test_kl_cell_marks_a_missing_interval() -> None:
    """A record without an interval (one bootstrap block) shows ``[–]`` under the column that
    promises one, not a bare value that reads as if it had none to give."""
    from kvbench.report.headline import kl_cell

    row = {"next_token_kl": 0.107, "kl_low": None, "kl_high": None, "section": "a"}
    assert kl_cell(row, 1e-6) == "0.107 [–]"
    row.update(kl_low=0.09, kl_high=0.12)
    assert kl_cell(row, 1e-6) == "0.107 [0.090, 0.120]"
    assert kl_cell({**row, "kl_low": 0.0}, 1e-6).endswith(" †")
