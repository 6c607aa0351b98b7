"""The reading under the headline table (:mod:`kvbench.report.headline`): a few sentences a user
can act on, every number and every method name computed from the records, none typed.

* **What the bytes are.**  ``bytes vs 16-bit`` is the measured bytes of the stored cache over 2
  bytes per K/V element (:func:`kvbench.report.headline.bytes_vs_16bit`), whatever dtype the
  full-precision parts (``full``'s K/V, residuals, sinks) were stored in.  The reading names
  that dtype (:func:`storage_dtype`: the dtype read from the held tensors, else the
  configuration's ``storage_dtype``, else the dtype the perplexity record's ``storage`` manifest
  entry names) and ``full``'s own ratio, so a float32
  store (``full`` at 2.000) is not read as a 16-bit deployment.
* **Lowest KL within a bytes budget** (:func:`budget_lines`): for each section of the table and
  each budget of :data:`BUDGETS`, the row with the lowest next-token KL among the candidates
  whose ``bytes vs 16-bit`` is at or below the budget, with its 95% interval, and whether that
  interval overlaps the runner-up's (each lower bound at or below the other's upper bound: then
  the two are not distinguishable).  Candidates (:func:`candidates`): rows of the section that
  quantize something (measured key or value bits below 16) and have a KL and bytes (the
  sections are (a) and (b): transformers peers, whose perplexity record's protocol is
  :data:`~kvbench.report.headline.PEER_PROTOCOL`, are rows of their own section, never
  candidates); rows that hold the same
  cache (equal ``bytes_total``, KL and interval, :func:`~kvbench.report.headline.merge_groups`)
  are one candidate named by all their labels.  Ties on KL go to fewer bytes, then to the label.
* **Step vs full by context** (:func:`step_sentence`): with latency records at one context,
  how many rows step at or below ``full`` there; with several, at which contexts each row's
  ``decode_ms_p50_ratio`` crosses 1.0 (a transformers peer named as its row, ``<label>
  (peer)``).
* **Links** to the other measured records (:data:`LINKS`), or their paths where the
  document's place in the repository is not known.
"""

from __future__ import annotations

from collections import Counter

from kvbench.bench.records import Record
from kvbench.cache.registry import BASELINE
from kvbench.report.headline import (
    BASE_BITS,
    QUALITY,
    SECTIONS,
    HeadlineRow,
    cache_tokens,
    is_peer,
    kl_cell,
    measured_dtype,
    merge_groups,
    noise_floor,
    rows,
)

#: bytes budgets, as fractions of the 16-bit cache of the same K/V elements
BUDGETS = (0.125, 0.25, 0.5)
#: the other measured records: (what they hold, path in the repository)
LINKS = (
    ("decode-step latency per method and context", "docs/results/decode-step.md"),
    ("memory at deployed model shapes", "docs/results/memory-shapes.md"),
    ("decode protocols, chunked vs exact", "docs/results/protocols.md"),
    ("llama.cpp's own q8_0/q4_0 error on this model", "docs/results/llama-cpp-crosscheck.md"),
    ("kvbench's evictors against kvpress's presses", "docs/results/kvpress-crosscheck.md"),
)


def storage_dtype(rec: Record) -> str:
    """The dtype a record's full-precision parts were stored in: the one read from the held
    tensors (:func:`~kvbench.report.headline.measured_dtype`), else the configuration's
    ``storage_dtype``, else the ``storage`` manifest entry's ``dtype`` (the compute dtype),
    else ``"not recorded"``."""
    storage = rec.manifest.get("storage") or {}
    return (
        measured_dtype(rec)
        or rec.config.get("storage_dtype")
        or storage.get("dtype")
        or "not recorded"
    )


def storage_sentence(allrows: list[HeadlineRow]) -> str:
    """What ``bytes vs 16-bit`` measures in these records: the storage dtypes of the rows
    (peers aside: they store K/V in their own dtypes) and ``full``'s own ratio."""
    dtypes = Counter(storage_dtype(r["sources"][QUALITY]) for r in allrows if not is_peer(r))
    if len(dtypes) == 1:
        where = next(iter(dtypes))
    else:
        where = ", ".join(
            f"{d} ({n} row{'s' if n > 1 else ''})" for d, n in sorted(dtypes.items(), key=_by_count)
        )
    base = next((r["bytes_ratio"] for r in allrows if r["section"] == "base"), None)
    text = (
        "Bytes vs 16-bit is the measured bytes of the stored cache over 2 bytes per K/V "
        f"element. These records store the full-precision parts (`full`'s K/V, residuals, "
        f"sinks) in {where}: "
    )
    if base is None:
        return text + "`full`'s bytes were not measured."
    text += f"`full` reads {base:.3f}, {base * BASE_BITS:g} bits per element"
    if base > 1:
        text += (
            f", so a row's full-precision parts count {base * 2:g} bytes per element where a "
            "16-bit store counts 2: the ratio of a row with a residual, sinks or unquantized "
            "values overstates its 16-bit deployment's bytes"
        )
    return text + "."


def _by_count(item: tuple[str, int]) -> tuple[int, str]:
    return -item[1], item[0]


def candidates(allrows: list[HeadlineRow], section: str) -> list[list[HeadlineRow]]:
    """The rows of ``section`` a budget can pick (module docstring), grouped by cache (one
    group per distinct (``bytes``, KL, interval); labels in order), sorted by KL, then bytes
    vs 16-bit, then first label."""
    picked = [
        r
        for r in allrows
        if r["section"] == section
        and r["next_token_kl"] is not None
        and r["bytes_ratio"] is not None
        and min(r["key_bits"] or 0, r["value_bits"] or 0) < BASE_BITS  # quantizes something
    ]
    return sorted(
        merge_groups(picked),
        key=lambda g: (g[0]["next_token_kl"], g[0]["bytes_ratio"], g[0]["label"]),
    )


def _name(group: list[HeadlineRow]) -> str:
    first, *same = (r["label"] for r in group)
    return first + (f" (same cache as {', '.join(same)})" if same else "")


def _pick(group: list[HeadlineRow], floor: float) -> str:
    return f"{_name(group)} at {group[0]['bytes_ratio']:.3f}, KL {kl_cell(group[0], floor)}"


def overlap(a: HeadlineRow, b: HeadlineRow) -> bool | None:
    """Whether the KL intervals of two rows overlap (touching counts); ``None`` when either
    row has no interval."""
    lo_a, hi_a, lo_b, hi_b = a["kl_low"], a["kl_high"], b["kl_low"], b["kl_high"]
    if None in (lo_a, hi_a, lo_b, hi_b):
        return None
    return lo_a <= hi_b and lo_b <= hi_a


def budget_lines(allrows: list[HeadlineRow], section: str) -> list[str]:
    """One markdown bullet per budget of :data:`BUDGETS` for ``section`` (module docstring);
    one bullet in all when no candidate fits the largest budget; none without candidates."""
    groups = candidates(allrows, section)
    if not groups:
        return []
    floor = noise_floor(allrows)
    title = SECTIONS[section].split(":")[0]
    smallest = min(groups, key=lambda g: (g[0]["bytes_ratio"], g[0]["label"]))
    least = f"the smallest is {_name(smallest)} at {smallest[0]['bytes_ratio']:.3f}"
    if smallest[0]["bytes_ratio"] > max(BUDGETS):
        return [f"- {title}: no row within {max(BUDGETS):g} of the 16-bit cache ({least})."]
    out = []
    for budget in BUDGETS:
        within = [g for g in groups if g[0]["bytes_ratio"] <= budget]
        head = f"- {title}, within {budget:g} of the 16-bit cache: "
        if not within:
            out.append(head + f"no row ({least}).")
            continue
        best = _pick(within[0], floor)
        if len(within) == 1:
            out.append(head + f"{best}, the only row within it.")
            continue
        runner = within[1]
        over = overlap(within[0][0], runner[0])
        if over is None:
            verdict = "one of the two has no interval, so they are not compared"
        elif over:
            verdict = "the intervals overlap, so the two are not distinguishable"
        else:
            verdict = "the intervals do not overlap"
        out.append(head + f"{best}; runner-up {_pick(runner, floor)}: {verdict}.")
    return out


def _rest(rec: Record) -> tuple[tuple[str, str], ...]:
    """The latency workload apart from its context (records that differ only in context)."""
    return tuple(sorted((k, str(v)) for k, v in rec.workload.items() if k != "context"))


def step_ratios(records: list[Record], allrows: list[HeadlineRow]) -> dict[str, dict[int, float]]:
    """label -> context -> ``decode_ms_p50_ratio``, for each row with a step ratio, from its
    latency records that differ from the one the table shows only in context (``full``
    included: its ratio is ``full`` timed against itself)."""
    shown = {r["label"]: r["sources"]["latency"] for r in allrows if r["step_ratio"] is not None}
    out: dict[str, dict[int, float]] = {}
    for rec in records:
        ref = shown.get(rec.label)
        if rec.workload_type != "latency" or ref is None or _rest(rec) != _rest(ref):
            continue
        ratio, context = rec.metrics.get("decode_ms_p50_ratio"), cache_tokens(rec)
        if ratio is not None and context is not None:
            out.setdefault(rec.label, {}).setdefault(context, ratio)
    return out


def _against(records: list[Record], label: str) -> str:
    """What the base row ``label``'s step ratios time it against: ``itself`` where its records
    store K/V in the baseline's chosen dtype (``baseline_storage_dtype``; ``config``'s
    ``storage_dtype``, else the model's dtype) or name none, else ``full`` stored in the
    chosen dtypes (a float32 ``full`` against the float16 one the pre-pass chose)."""
    other = set()
    for rec in records:
        chosen = rec.manifest.get("baseline_storage_dtype")
        if rec.workload_type != "latency" or rec.label != label or chosen is None:
            continue
        own = rec.config.get("storage_dtype") or rec.manifest.get("model_dtype")
        if own != chosen:
            other.add(str(chosen))
    if not other:
        return "itself"
    return f"`{BASELINE}` stored in " + "/".join(sorted(other))


def step_sentence(records: list[Record], allrows: list[HeadlineRow]) -> str | None:
    """Where the step ratio vs full crosses 1.0 by context (module docstring); ``None``
    without latency records."""
    ratios = step_ratios(records, allrows)
    base = {r["label"] for r in allrows if r["section"] == "base"}
    own = "".join(
        f" `{lab}` timed against {_against(records, lab)} reads "
        + ", ".join(f"{v:.3f} at {c}" for c, v in sorted(ratios[lab].items()))
        + " tokens."
        for lab in sorted(base & ratios.keys())
    )
    # a transformers peer is named as its table row names it: "<label> (peer)"
    peers = {r["label"] for r in allrows if r["section"] == "peer"}
    methods = {
        lab + " (peer)" * (lab in peers): by
        for lab, by in sorted(ratios.items())
        if lab not in base
    }
    if not methods:
        return None
    contexts = sorted({c for by in methods.values() for c in by})
    if len(contexts) == 1:
        at = {lab: by[contexts[0]] for lab, by in methods.items()}
        low = ", ".join(f"{lab} ({v:.3f})" for lab, v in at.items() if v <= 1.0)
        n = sum(v <= 1.0 for v in at.values())
        return (
            f"Step ratio vs full measured at {contexts[0]} tokens only: {n} of {len(at)} "
            f"methods at or below 1.00" + (f": {low}." if low else ".") + own
        )
    cross, below, above = [], 0, 0
    for lab, by in methods.items():
        pts = sorted(by.items())
        for (c0, r0), (c1, r1) in zip(pts, pts[1:]):
            if (r0 <= 1.0) != (r1 <= 1.0):
                cross.append(f"{lab} between {c0} and {c1} tokens ({r0:.3f} to {r1:.3f})")
        below += all(r <= 1.0 for _, r in pts)
        above += all(r > 1.0 for _, r in pts)
    where = "; ".join(cross) if cross else "no method crosses 1.00"
    return (
        f"Step ratio vs full by context ({', '.join(map(str, contexts))} tokens), of "
        f"{len(methods)} methods: {below} at or below 1.00 at every context they were measured "
        f"at, {above} above 1.00 at every one; crossing 1.00: {where}.{own}"
    )


def reading(records: list[Record], root: str | None = None) -> str:
    """Markdown: a ``#### Reading`` heading, the bytes paragraph, the budget bullets of each
    section under their lead sentence, the step paragraph and the links (module docstring).
    ``root``: the path from the document to the repository's root (``""`` for the README),
    the prefix of the links; ``None`` (a document whose place is not known, as ``kvbench
    report``'s output): the repository paths in backticks instead of links.  ValueError without
    a ``full`` perplexity record (:func:`kvbench.report.headline.rows`)."""
    allrows = rows(records)
    parts = ["#### Reading", storage_sentence(allrows)]
    bullets = [line for section in SECTIONS for line in budget_lines(allrows, section)]
    if bullets:
        parts.append(
            "Lowest next-token KL [95% CI] within each bytes budget (bytes vs 16-bit at or "
            "below it; `full` and rows that quantize nothing left out; transformers peers are "
            "in their own section, not ranked):\n\n" + "\n".join(bullets)
        )
    step = step_sentence(records, allrows)
    if step is not None:
        parts.append(step)
    if root is None:
        links = ", ".join(f"{what} (`{path}`)" for what, path in LINKS)
    else:
        links = ", ".join(f"[{what}]({root}{path})" for what, path in LINKS)
    parts.append(f"Other measured records: {links}.")
    return "\n\n".join(parts)
