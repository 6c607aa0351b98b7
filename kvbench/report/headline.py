"""The headline table of ``make bench``: one row per method configuration, ranked on the Pareto
frontier of next-token KL vs measured bytes, in two sections.

Rows join a configuration's records by label: ``memory`` (bytes at rest of every layer's cache,
``bytes_total``, and the measured bits per key and value element), ``perplexity``
(``next_token_kl``, ``ppl``) and ``fidelity`` (``attn_kl``). Sections:

* **(a) deployed**: keys and values quantized (every configuration whose values are not kept at
  16 bits);
* **(b) keys only**: configurations whose values are stored unquantized while their keys are
  quantized (the PN-Mix paper's b_V = 16 setting), decided from the measured bits per element of
  the memory record (a method's ``value_bits`` field alone can mislead: SemKV keeps
  ``value_bits: 16`` but stores values at each token's mixed width); from ``value_bits: 16`` in
  the configuration only when the record has no measured bits.

``bytes vs 16-bit`` = ``bytes_total`` / the bytes of a 16-bit cache of the same tokens: the
``full`` configuration's ``bytes_total`` scaled to 16 bits per element from the dtype its memory
workload stored K/V in (float16 in ``suites/default.yaml``, so the ratio is against ``full``
itself). Rows are sorted by bytes; ``frontier`` marks the configurations no other row of the
section beats on both bytes and KL (:func:`kvbench.report.pareto.pareto_mask`).
"""

from __future__ import annotations

from typing import Any

from kvbench.bench.records import Record
from kvbench.cache.registry import BASELINE
from kvbench.report.pareto import pareto_mask

DTYPE_BITS = {"float16": 16, "bfloat16": 16, "float32": 32}


def _keys_only(rec: Record, e: dict[str, Any]) -> bool:
    """Values stored at the full width of the memory workload's dtype, keys below it (measured);
    the configuration's ``value_bits == 16`` when nothing was measured."""
    if rec.method == BASELINE:
        return False
    full, kb, vb = e.get("dtype_bits", 16), e.get("key_bits"), e.get("value_bits")
    if kb is not None and vb is not None:
        return vb >= full - 1e-9 and kb < full - 1e-9
    return rec.config.get("value_bits") == 16


def rows(records: list[Record]) -> list[dict[str, Any]]:
    """One dict per label with ``label``, ``section`` (``a``/``b``/``base``), ``bytes``,
    ``bytes_ratio``, ``key_bits``, ``value_bits``, ``next_token_kl``, ``ppl``, ``attn_kl``.
    Configurations without a memory record are left out. ValueError without a ``full`` memory
    record (the 16-bit baseline)."""
    by: dict[str, dict[str, Any]] = {}
    for r in records:
        e = by.setdefault(r.label, {"label": r.label, "rec": r})
        wtype, m = r.workload_type, r.metrics
        if wtype == "memory":
            dtype = r.workload.get("dtype", "float16")
            e.update(
                bytes=m.get("bytes_total"),
                key_bits=m.get("effective_key_bits"),
                value_bits=m.get("effective_value_bits"),
                dtype_bits=DTYPE_BITS.get(dtype, 16),
            )
        elif wtype == "perplexity":
            e.update(next_token_kl=m.get("next_token_kl"), ppl=m.get("ppl"))
        elif wtype == "fidelity":
            e.update(attn_kl=m.get("attn_kl"))
    base = next((e for e in by.values() if e["rec"].method == BASELINE and "bytes" in e), None)
    if base is None:
        raise ValueError("the headline table needs a 'full' memory record (the 16-bit baseline)")
    bytes16 = base["bytes"] * 16 / base["dtype_bits"]
    out = []
    for e in by.values():
        if e.get("bytes") is None:
            continue
        rec = e.pop("rec")
        e["section"] = "base" if rec.method == BASELINE else ("b" if _keys_only(rec, e) else "a")
        e["bytes_ratio"] = e["bytes"] / bytes16
        out.append(e)
    return out


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}f}"


SECTIONS = {
    "a": "(a) Deployed: keys and values quantized",
    "b": "(b) Keys only: values kept at 16 bits (b_V = 16, the PN-Mix paper's setting)",
}


def headline_table(records: list[Record]) -> str:
    """Markdown: one table per section, rows sorted by bytes, Pareto frontier marked (see the
    module docstring). Configurations without a next-token KL are listed but not ranked."""
    allrows = rows(records)
    base = [r for r in allrows if r["section"] == "base"]
    parts = []
    for sec, title in SECTIONS.items():
        rs = sorted((r for r in allrows if r["section"] == sec), key=lambda r: r["bytes"])
        if not rs:
            continue
        ranked = [r for r in rs if r.get("next_token_kl") is not None]
        mask = pareto_mask([r["bytes"] for r in ranked], [r["next_token_kl"] for r in ranked])
        front = {id(r) for r, on in zip(ranked, mask) if on}
        head = (
            "| method | key bits | value bits | bytes vs 16-bit | next-token KL | ppl | attn KL "
            "| frontier |\n|---|---:|---:|---:|---:|---:|---:|:---:|"
        )
        lines = [
            f"| {r['label']} | {_f(r.get('key_bits'), 2)} | {_f(r.get('value_bits'), 2)} | "
            f"{_f(r['bytes_ratio'])} | {_f(r.get('next_token_kl'))} | {_f(r.get('ppl'), 2)} | "
            f"{_f(r.get('attn_kl'))} | {'★' if id(r) in front else ''} |"
            for r in base + rs
        ]
        parts.append(f"#### {title}\n\n{head}\n" + "\n".join(lines))
    note = (
        "> key/value bits: measured bits per stored element (memory workload: codes, scales, "
        "metadata, full-precision residual and sinks). bytes vs 16-bit: measured bytes at rest "
        "over those of a 16-bit cache of the same tokens (the deployed baseline), whatever dtype "
        "the CPU model computes in. ★: on the Pareto frontier of next-token KL vs bytes within "
        "the section."
    )
    return "\n\n".join(parts + [note])
