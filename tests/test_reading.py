"""The reading under the headline table (:mod:`kvbench.report.reading`): every sentence worked
by hand from small records built here.

The model of the records: 2 layers x 1 KV head x head_dim 4.  The perplexity workload runs
``tokens = 11``, so its cache holds 10 tokens: 10 x 2 x 1 x 4 = 80 elements per side, and a
16-bit cache of them is 80 x 2 sides x 2 bytes = 320 bytes.  ``bytes vs 16-bit`` of a row is its
``bytes_total`` / 320: 32 -> 0.100, 64 -> 0.200, 80 -> 0.250 (exactly the middle budget),
150 -> 0.469, 400 -> 1.250, and ``full`` stored in float32, 640 -> 2.000.
"""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
from test_headline_export import PPL, rec

from kvbench.bench.records import write_record
from kvbench.report import export as ex
from kvbench.report.headline import PEER_PROTOCOL, rows
from kvbench.report.reading import (
    budget_lines,
    candidates,
    reading,
    step_sentence,
    storage_sentence,
)


def ppl(label, nbytes, kl, lo, hi, kb=4.0, vb=4.0, method="x", protocol="write-then-attend",
        dtype="float32", config=None):  # fmt: skip
    m = {"bytes_total": nbytes, "effective_key_bits": kb, "effective_value_bits": vb}
    m |= {"next_token_kl": kl, "next_token_kl_ci_low": lo, "next_token_kl_ci_high": hi}
    man = {"storage": {"dtype": dtype}, "decode_attention": {"protocol": protocol}}
    return rec(label, method, "perplexity", m, config, man, **PPL)


def lat(label, ratio, context=11, steps=4):
    m = {"decode_ms_p50": 2.0 * ratio, "decode_ms_p50_ratio": ratio}
    return rec(label, "x", "latency", m, context=context, steps=steps)


FULL = ppl("full", 640, 0.0, 0.0, 0.0, kb=32.0, vb=32.0, method="full")


def quality():
    """Section (a): A, B, C, D and D2 (the same cache as D) and a row U that quantizes
    nothing; section (b): E (keys only); the peers' section: a transformers peer P with the
    lowest KL of all."""
    return [
        FULL,
        ppl("A", 32, 0.30, 0.25, 0.35),  # 0.100
        ppl("B", 64, 0.10, 0.08, 0.12),  # 0.200
        ppl("C", 80, 0.05, 0.04, 0.09),  # 0.250: at the budget, so within it
        ppl("D", 150, 0.02, 0.015, 0.025),  # 0.469
        ppl("D2", 150, 0.02, 0.015, 0.025),  # D's cache under another name
        ppl("P", 100, 0.001, 0.0005, 0.0015, method="hf-quanto", protocol=PEER_PROTOCOL),
        ppl("U", 120, 0.0001, 0.00005, 0.00015, kb=16.0, vb=16.0),  # quantizes nothing
        ppl("E", 400, 0.01, 0.008, 0.012, kb=2.0, vb=32.0),  # keys only, 1.250
    ]


def test_peer_protocol_is_the_one_records_name():
    from kvbench.hf.cache import PEER_PROTOCOL as HF_PEER_PROTOCOL

    assert PEER_PROTOCOL == HF_PEER_PROTOCOL


def test_candidates_leave_out_full_peers_and_unquantized_rows_and_merge_one_cache():
    assert {r["label"]: r["section"] for r in rows(quality())}["P"] == "peer"
    groups = candidates(rows(quality()), "a")
    assert [[r["label"] for r in g] for g in groups] == [["D", "D2"], ["C"], ["B"], ["A"]]
    assert [[r["label"] for r in g] for g in candidates(rows(quality()), "b")] == [["E"]]


def test_lowest_kl_within_each_budget():
    """0.125: A alone (0.100).  0.25: A, B and C (at 0.250 exactly); C's KL is lowest, and its
    interval [0.040, 0.090] reaches B's lower bound 0.080: overlap.  0.5: D (with D2) at 0.020
    [0.015, 0.025], runner-up C, whose lower bound 0.040 is above 0.025: apart.  P (a peer, KL
    0.001 at 0.3125) and U (16 bits, KL 1e-4 at 0.375) are never picked."""
    assert budget_lines(rows(quality()), "a") == [
        "- (a) Deployed, within 0.125 of the 16-bit cache: A at 0.100, KL 0.300 "
        "[0.250, 0.350], the only row within it.",
        "- (a) Deployed, within 0.25 of the 16-bit cache: C at 0.250, KL 0.050 [0.040, 0.090]; "
        "runner-up B at 0.200, KL 0.100 [0.080, 0.120]: the intervals overlap, so the two are "
        "not distinguishable.",
        "- (a) Deployed, within 0.5 of the 16-bit cache: D (same cache as D2) at 0.469, KL "
        "0.020 [0.015, 0.025]; runner-up C at 0.250, KL 0.050 [0.040, 0.090]: the intervals "
        "do not overlap.",
    ]
    assert budget_lines(rows(quality()), "b") == [
        "- (b) Keys only: no row within 0.5 of the 16-bit cache (the smallest is E at 1.250)."
    ]


def test_a_budget_no_row_fits_and_intervals_that_only_touch():
    """Without A nothing fits 0.125 (the smallest is B at 0.200); B's interval made to end at
    C's lower bound (0.040) still overlaps it; without an interval nothing is compared."""
    out = [r for r in quality() if r.label not in ("A", "B")]
    out.append(ppl("B", 64, 0.03, 0.02, 0.04))
    lines = budget_lines(rows(out), "a")
    assert lines[0] == (
        "- (a) Deployed, within 0.125 of the 16-bit cache: no row (the smallest is B at 0.200)."
    )
    assert lines[1].endswith(
        "B at 0.200, KL 0.030 [0.020, 0.040]; runner-up C at 0.250, KL 0.050 [0.040, 0.090]: "
        "the intervals overlap, so the two are not distinguishable."
    )
    out = [r for r in out if r.label != "C"]
    out.append(rec("C", "x", "perplexity", {"bytes_total": 80, "next_token_kl": 0.05}, **PPL))
    assert budget_lines(rows(out), "a")[1].endswith(
        "runner-up C at 0.250, KL 0.050 [–]: one of the two has no interval, so they are not "
        "compared."
    )


def test_storage_sentence_says_what_the_bytes_are_measured_in():
    text = storage_sentence(rows(quality()))
    assert text == (
        "Bytes vs 16-bit is the measured bytes of the stored cache over 2 bytes per K/V "
        "element. These records store the full-precision parts (`full`'s K/V, residuals, sinks) "
        "in float32: `full` reads 2.000, 32 bits per element, so a row's full-precision parts "
        "count 4 bytes per element where a 16-bit store counts 2: the ratio of a row with a "
        "residual, sinks or unquantized values overstates its 16-bit deployment's bytes."
    )
    # a 16-bit store: full at 1.000, no caveat; the configured storage_dtype wins over the
    # compute dtype, and mixed dtypes are counted (the peer's own dtype is not)
    out = [
        ppl("full", 320, 0.0, 0.0, 0.0, kb=16.0, vb=16.0, method="full", dtype="float16"),
        ppl("A", 32, 0.3, 0.2, 0.4, config={"storage_dtype": "float16"}),
        ppl("B", 64, 0.3, 0.2, 0.4, dtype="bfloat16"),
        ppl("P", 64, 0.3, 0.2, 0.4, protocol=PEER_PROTOCOL, dtype="float64"),
    ]
    assert storage_sentence(rows(out)).endswith(
        "in float16 (2 rows), bfloat16 (1 row): `full` reads 1.000, 16 bits per element."
    )


def test_step_ratio_at_one_context_only():
    """A 0.98 and B exactly 1.00 are at or below; P (a peer: a method with a step, named as
    its row, ``(peer)``) 0.9;
    C 1.2 and D 1.1 above: 3 of 5.  ``full`` against itself: 1.02."""
    out = quality() + [lat(lab, v) for lab, v in
                       (("full", 1.02), ("A", 0.98), ("B", 1.0), ("C", 1.2), ("D", 1.1),
                        ("P", 0.9))]  # fmt: skip
    assert step_sentence(out, rows(out)) == (
        "Step ratio vs full measured at 11 tokens only: 3 of 5 methods at or below 1.00: "
        "A (0.980), B (1.000), P (peer) (0.900). `full` timed against itself reads 1.020 at 11 "
        "tokens."
    )
    assert step_sentence(quality(), rows(quality())) is None


def test_step_ratio_crossing_one_by_context():
    """At 11 and 64 tokens: A 0.98 -> 1.10 crosses, C 1.2 -> 0.9 crosses, B 0.95 -> 1.00 (exactly) stays
    at or below, D (11 only) 1.1 above.  A latency record of another workload (steps=8) is
    not one of these contexts."""
    out = quality() + [
        lat(lab, v) for lab, v in (("full", 1.02), ("A", 0.98), ("B", 0.95), ("C", 1.2), ("D", 1.1))
    ]
    out += [
        lat(lab, v, context=64) for lab, v in (("full", 1.01), ("A", 1.10), ("B", 1.0), ("C", 0.9))
    ]
    out += [lat("D", 0.5, context=256, steps=8)]  # fmt: skip
    assert step_sentence(out, rows(out)) == (
        "Step ratio vs full by context (11, 64 tokens), of 4 methods: 1 at or below 1.00 at "
        "every context they were measured at, 1 above 1.00 at every one; crossing 1.00: A "
        "between 11 and 64 tokens (0.980 to 1.100); C between 11 and 64 tokens (1.200 to "
        "0.900). `full` timed against itself reads 1.020 at 11, 1.010 at 64 tokens."
    )


def test_reading_in_the_readme_block_and_the_report(tmp_path, capsys):
    """The export's README block holds the reading with links from the repository's root;
    ``kvbench report`` prints it with the paths in backticks (its output's place is unknown)."""
    from kvbench.report.tables import main as report_main

    out = quality() + [lat("full", 1.02), lat("A", 0.98)]
    text = reading(out, root="")
    assert text.startswith("#### Reading\n\nBytes vs 16-bit is")
    assert "[decode-step latency per method and context](docs/results/decode-step.md)" in text
    assert "(docs/results/llama-cpp-crosscheck.md), " in text
    assert (
        "[kvbench's evictors against kvpress's presses](docs/results/kvpress-crosscheck.md)."
        in text
    )
    path = tmp_path / "x.json"
    path.write_text(json.dumps(ex.make_export(out, "make bench", "box", 1.0)))
    block = ex.readme_block(path, "x.json")
    assert block.endswith(f"\n\n{text}\n{ex.END}")
    for r in out:
        write_record(tmp_path / "res" / f"{r.run_id}.json", r)
    args = Namespace(results=[str(tmp_path / "res")], plots=None, no_plots=True, json=False)
    assert report_main(args) == 0
    printed = capsys.readouterr().out
    assert reading(out) in printed and "(`docs/results/protocols.md`)" in printed


def test_reading_needs_full():
    with pytest.raises(ValueError, match="'full' perplexity record"):
        reading([r for r in quality() if r.label != "full"])


def test_step_sentence_names_the_chosen_baseline_of_full():
    """The pre-pass chose ``full`` in float16 (``baseline_storage_dtype``): a float32 ``full``
    (the model's dtype, no ``storage_dtype`` in its config) is timed against it, not against
    itself; where the chosen dtype is its own (float32) it is itself."""

    def with_choice(label, ratio, chosen):
        r = lat(label, ratio)
        r.manifest |= {"baseline_storage_dtype": chosen, "model_dtype": "float32"}
        return r

    for chosen, against in (("float16", "`full` stored in float16"), ("float32", "itself")):
        out = quality() + [with_choice("full", 1.05, chosen), with_choice("A", 0.98, chosen)]
        assert step_sentence(out, rows(out)).endswith(
            f"`full` timed against {against} reads 1.050 at 11 tokens."
        )


def test_storage_sentence_takes_the_dtype_read_from_the_held_tensors():
    """The dtype the perplexity workload read from the held tensors (manifest
    ``storage.full_precision_dtype``) wins over the configuration and the compute dtype; a
    cache that held none falls back to them."""
    full = ppl("full", 320, 1e-7, 0.0, 2e-7, kb=16.0, vb=16.0, method="full")
    full.manifest["storage"]["full_precision_dtype"] = "float16"
    a = ppl("A", 32, 0.3, 0.2, 0.4, config={"storage_dtype": "float16"})
    a.manifest["storage"]["full_precision_dtype"] = "none held"
    assert storage_sentence(rows([full, a])).endswith(
        "in float16: `full` reads 1.000, 16 bits per element."
    )
