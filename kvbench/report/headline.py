"""The headline table of ``make bench``: one row per method configuration, ranked on the Pareto
frontier of next-token KL vs measured bytes, in two sections.

**One cache state per row.**  A row's quality, bits and bytes come from one record, the
``perplexity`` record: ``next_token_kl`` (with its 95% interval ``next_token_kl_ci_low`` /
``_ci_high``), ``top1_agreement``, ``ppl`` / ``ppl_ref``, and the measured ``bytes_total`` (the
whole cache, every layer, after the last scored chunk) and ``effective_key_bits`` /
``effective_value_bits`` of the cache the scored tokens attended to.  A method whose width
depends on the length it holds (PM-KVQ's progressive budget) is therefore shown at the width its
KL was measured at, not at the width another workload's longer run left it at.  Two columns
need a workload of their own and say which (the note under the table names each column's
workload, context, protocol and dtype):

* ``step vs full``: ``decode_ms_p50_ratio`` of the ``latency`` record, the median steady-state
  decode step of the method's cache over that of ``full`` timed interleaved in the same run
  (the faster of ``full``'s storage dtypes, as the record names), with its 95% interval
  ``[decode_ms_p50_ratio_ci_low, _ci_high]`` (a paired bootstrap over the interleaved rounds,
  :func:`kvbench.bench.metrics.paired_ratio_ci`) where the record has one (older records: the
  ratio alone, :func:`step_cell`).  With latency records at several contexts
  (:func:`step_contexts`), one such column per context, its header naming the context
  (``step vs full, 1024 tok``), each from the row's record at exactly that context;
* ``peak vs full``: (``bytes_total`` + ``peak_step_bytes``) of the ``memory`` record (bytes at
  rest plus the transient of one decode step) over the same sum of ``full``'s memory record.

**Noise of the step ratios.**  Under the tables, one line per context of the step columns
(:func:`noise_block`): ``N tok: `full` vs itself: 1.00 [lo, hi] (n rounds, baseline D)``, the
latency pre-pass's two caches of the chosen baseline timed against each other (manifest
``baseline_self_ratio``, ``baseline_self_interval``, ``baseline_self_rounds``,
``baseline_storage_dtype``; :func:`self_checks`), one value per context: where the shown records
of a context disagree, the line lists each value with its record count after ``⚠ records
disagree``.  Where the interval reaches farther than :data:`NOISE_TARGET` from 1.00, the line
says how far (``noise +/-0.06 > 0.03: read ratios within 6% of 1.00 as no difference``).  A step
cell whose interval overlaps the agreed noise interval of its context is marked ``≈``
(:data:`NOISE_MARK`, :func:`within_noise`): the run cannot tell its step from ``full``'s.
Records written before the check existed carry none: then there is no such paragraph and no
mark.

Where several records of one workload type exist, the one at the headline context (the
perplexity workload's ``tokens``) is taken, else the closest context.

``bytes vs 16-bit`` = ``bytes_total`` / :func:`bytes16` of the same record: the number of K/V
elements the cache holds (tokens x layers x KV heads x head_dim x batch, from the record's
workload and model) x 2 sides x 2 bytes, the deployed 16-bit cache whatever dtype the model
computes in: ``full`` with ``storage_dtype: float16`` (docs/design.md#storage-dtype) shows
1.000, ``full`` storing a float32 model's K/V as computed shows 2.0.  The report's tables give
the same figure (``bytes_vs_16bit``, :func:`bytes_vs_16bit`).  The note names the dtype the rows
stored their full-precision parts in, and the KL reference (``full`` in the model's dtype).
A ``peak vs full`` cell is marked ``⚠`` (:func:`peak_below_rest`) where the memory record's
bytes at rest plus step peak, per 16-bit cache, fall below the row's ``bytes vs 16-bit``: the
two workloads then measured different caches, and the note says what differs, computed from the
two records (:func:`cache_differences`: bytes at rest, configuration, tokens, storage dtype,
fill).

Sections:

* **(a) deployed**: keys and values quantized (every configuration of kvbench's caches whose
  values are not kept at 16 bits);
* **(b) keys only**: configurations whose values are stored unquantized (>= 16 bits per
  element) while their keys are quantized (< 16 bits), the PN-Mix paper's b_V = 16 setting,
  from the measured bits of the perplexity record; from its nominal bits when it has no
  measured ones; from ``value_bits: 16`` in the configuration when it has neither (a method's
  ``value_bits`` field alone can mislead: SemKV keeps ``value_bits: 16`` but stores values at
  each token's mixed width);
* **Peers** (:data:`PEERS`): transformers' own caches (perplexity record's protocol
  :data:`PEER_PROTOCOL`, :func:`peer_record`), whatever their bits: never rows of (a) or (b),
  which hold kvbench's caches only; listed with ``full`` for reference, without a frontier
  column (never ranked, never marked).

Rows are sorted by bytes; ``frontier`` marks the configurations no other row of the section
beats on both bytes and KL (:func:`kvbench.report.pareto.pareto_mask`).  ``†`` marks a row whose
KL interval reaches ``full``'s noise floor (:func:`noise_floor`): its lower bound is at or below
it, so the run cannot tell the row from ``full``.

Beside the measured bits, ``nominal bits (K / V)`` shows ``nominal_key_bits`` /
``nominal_value_bits`` as the row's records carry them (the perplexity record's, else another
record's of the row; empty where none does).  Peer rows are labelled ``(peer, stored D)`` (D the
dtype their held tensors were read in, :func:`measured_dtype`; ``(peer)`` where the record does
not say).  Rows holding the same cache (equal :func:`same_cache`: bytes, KL
and interval) are merged into one row ``A = B`` (:func:`merge_groups`), named in the note.  A
budgeted row whose cache held fewer tokens than its configuration's ``budget_tokens``
(:func:`budget_miss`) says ``(budget not reached at N tokens: sized for M)`` after its label.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple, TypedDict

from kvbench.bench.records import Record
from kvbench.cache.registry import BASELINE
from kvbench.report.pareto import pareto_mask

if TYPE_CHECKING:
    from kvbench.jsontypes import JSONValue

#: the quality workload whose record gives a row's quality, bits and bytes
QUALITY = "perplexity"
#: the smallest KL the headline tells from ``full``'s exact 0 (float32 log-probs)
KL_FLOOR = 1e-6
#: bits per element of the deployed baseline cache
BASE_BITS = 16
#: the protocol records name for a transformers peer's own cache
#: (``kvbench.hf.cache.PEER_PROTOCOL``, not imported here: that module loads transformers)
PEER_PROTOCOL = "transformers-update"


class HeadlineRow(TypedDict):
    """One row of the headline (:func:`rows`): a label's quality, bits and bytes from its
    ``perplexity`` record, its step and peak ratios from its ``latency`` and ``memory`` records
    (``None``: not measured).  Ratios are unitless, ``bytes`` in bytes, bits per element, KL in
    nats; ``sources`` maps a workload type to the record its columns came from;
    ``step_records`` a context (tokens) to the row's latency record there (the first where
    several)."""

    label: str
    section: Literal["a", "b", "base", "peer", "evict"]
    bytes: float | None
    bytes_ratio: float | None
    key_bits: float | None
    value_bits: float | None
    nominal_key_bits: float | None
    nominal_value_bits: float | None
    next_token_kl: float | None
    kl_low: float | None
    kl_high: float | None
    top1: float | None
    ppl: float | None
    ppl_ratio: float | None
    step_ratio: float | None
    step_low: float | None
    step_high: float | None
    peak_ratio: float | None
    sources: dict[str, Record]
    step_records: dict[int, Record]


def _model(rec: Record) -> dict[str, JSONValue]:
    return rec.manifest.get("model") or {}


def cache_tokens(rec: Record) -> int | None:
    """Tokens per sequence the record's measured cache holds: ``perplexity`` ``tokens - 1``
    (the last token is only predicted, never fed), ``memory`` and ``latency`` ``context``;
    ``None`` for other workloads."""
    w = rec.workload
    if rec.workload_type == "perplexity" and "tokens" in w:
        return int(w["tokens"]) - 1
    if rec.workload_type in ("memory", "latency") and "context" in w:
        return int(w["context"])
    return None


def kv_elements(rec: Record) -> int | None:
    """K (or V) elements the record's ``bytes_total`` covers (the whole cache):
    :func:`cache_tokens` x layers x KV heads x head_dim x batch rows, from the record's workload
    and model (every layer of the model, also for a ``memory`` run that measured a subset or a
    shape model's one layer, whose ``bytes_total`` is still the whole cache; a synthetic one's
    own geometry).  ``None`` when the record does not say."""
    t, w, m = cache_tokens(rec), rec.workload, _model(rec)
    if t is None:
        return None
    if w.get("source") == "synthetic" and not m.get("random_weights"):
        geo = (w.get("num_layers"), w.get("num_kv_heads"), w.get("head_dim"))
    else:  # a shape model's memory run names the whole model's layers (a slice has fewer)
        layers = rec.manifest.get("num_hidden_layers") or m.get("num_hidden_layers")
        geo = (layers, m.get("num_key_value_heads"), m.get("head_dim"))
    if any(g is None for g in geo):
        return None
    batch = w.get("batch") or w.get("batch_size") or 1
    return t * geo[0] * geo[1] * geo[2] * int(batch)


def bytes16(rec: Record) -> int | None:
    """Bytes of a 16-bit K/V cache of the record's tokens: :func:`kv_elements` x 2 sides x 2
    bytes (``None`` when the element count is unknown)."""
    n = kv_elements(rec)
    return None if n is None else n * 2 * BASE_BITS // 8


def bytes_vs_16bit(rec: Record) -> float | None:
    """``bytes_total`` / :func:`bytes16` of one record (``None`` when either is unknown)."""
    b, n16 = rec.metrics.get("bytes_total"), bytes16(rec)
    return None if b is None or not n16 else b / n16


def _keys_only(rec: Record) -> bool:
    """Values stored unquantized (>= 16 bits), keys quantized (< 16 bits): measured bits, else
    nominal, else the configuration's ``value_bits == 16`` (module docstring)."""
    if rec.method == BASELINE:
        return False
    m = rec.metrics
    for kind in ("effective", "nominal"):
        kb, vb = m.get(f"{kind}_key_bits"), m.get(f"{kind}_value_bits")
        if kb is not None and vb is not None:
            return vb >= BASE_BITS - 1e-9 and kb < BASE_BITS - 1e-9
    return rec.config.get("value_bits") == 16


def peer_record(rec: Record) -> bool:
    """Whether the record ``rec`` ran a transformers peer's own cache (its
    ``decode_attention`` manifest entry's protocol is :data:`PEER_PROTOCOL`, as perplexity
    records name it)."""
    decode = rec.manifest.get("decode_attention") or {}
    return decode.get("protocol") == PEER_PROTOCOL


def evicting_record(rec: Record) -> bool:
    """Whether ``rec`` ran an eviction method (its configuration carries the ``quantizer`` it
    composes with, ``{name, config}``: docs/design.md#eviction); such rows are compared in the
    report's section (c), :mod:`kvbench.report.equal_bytes`, not in the headline's tables."""
    return isinstance(rec.config.get("quantizer"), dict)


def section_of(rec: Record) -> Literal["a", "b", "base", "peer", "evict"]:
    """The headline section of the row whose perplexity record is ``rec``: ``base`` for
    ``full``, ``peer`` for a transformers peer (:func:`peer_record`, whatever its bits),
    ``evict`` for an eviction method (:func:`evicting_record`: left to section (c)), ``b`` for
    keys only (:func:`_keys_only`), else ``a``."""
    if rec.method == BASELINE:
        return "base"
    if peer_record(rec):
        return "peer"
    if evicting_record(rec):
        return "evict"
    return "b" if _keys_only(rec) else "a"


def _context(rec: Record) -> int:
    return cache_tokens(rec) or 0


def _at_context(recs: list[Record], context: int | None) -> Record | None:
    """The record at ``context`` tokens, else the closest one (ties: the longer)."""
    if not recs:
        return None
    if context is None:
        return recs[0]
    return min(recs, key=lambda r: (abs(_context(r) - context), -_context(r)))


def _nominal(recs: list[Record]) -> tuple[float | None, float | None]:
    """The nominal (key, value) bits of the first of ``recs`` whose metrics carry both
    ``nominal_key_bits`` and ``nominal_value_bits``; ``(None, None)`` when none does."""
    for r in recs:
        kb, vb = r.metrics.get("nominal_key_bits"), r.metrics.get("nominal_value_bits")
        if kb is not None and vb is not None:
            return kb, vb
    return None, None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def rows(records: list[Record]) -> list[HeadlineRow]:
    """One dict per label that has a ``perplexity`` record: ``label``, ``section``
    (``a``/``b``/``base``/``peer``: :func:`section_of`), ``bytes``, ``bytes_ratio`` (vs
    16-bit), ``key_bits``, ``value_bits``, ``next_token_kl``, ``kl_low``, ``kl_high``, ``top1``, ``ppl``,
    ``ppl_ratio`` (``ppl`` / ``ppl_ref``, the ``full`` cache's perplexity under the same
    schedule), ``step_ratio`` with its interval ``step_low`` / ``step_high`` (``None``: the
    latency record has none) of the latency record at the headline context, ``peak_ratio``,
    ``sources`` (workload type -> the record each column group came from) and
    ``step_records`` (context -> latency record).  ValueError without a ``full`` perplexity
    record."""
    by: dict[str, dict[str, list[Record]]] = {}
    for r in records:
        by.setdefault(r.label, {}).setdefault(r.workload_type, []).append(r)
    full = next(
        (e for e in by.values() if any(r.method == BASELINE for r in e.get(QUALITY, []))), None
    )
    if full is None:
        raise ValueError(
            f"the headline table needs a 'full' {QUALITY} record (the reference of every row)"
        )
    context = cache_tokens(full[QUALITY][0])
    base_mem = _at_context(full.get("memory", []), context)
    out: list[HeadlineRow] = []
    for label, e in by.items():
        q = _at_context(e.get(QUALITY, []), context)
        if q is None:
            continue
        m = q.metrics
        lat = _at_context(e.get("latency", []), context)
        step_records: dict[int, Record] = {}
        for r in e.get("latency", []):
            step_records.setdefault(_context(r), r)
        mem = _at_context(e.get("memory", []), context)
        peak = base = None
        if mem is not None and base_mem is not None:
            mm, bm = mem.metrics, base_mem.metrics
            keys = ("bytes_total", "peak_step_bytes")
            if all(k in mm and k in bm for k in keys):
                peak, base = (sum(x[k] for k in keys) for x in (mm, bm))
        # nominal bits: the quality record's, else the first other record of the row that
        # carries them (the memory record at the context, then the rest by workload type)
        others = [r for t in sorted(e) for r in e[t] if r is not q and r is not mem]
        nominal = _nominal([q] + ([mem] if mem is not None else []) + others)
        out.append(
            {
                "label": label,
                "section": section_of(q),
                "bytes": m.get("bytes_total"),
                "bytes_ratio": bytes_vs_16bit(q),
                "key_bits": m.get("effective_key_bits"),
                "value_bits": m.get("effective_value_bits"),
                "nominal_key_bits": nominal[0],
                "nominal_value_bits": nominal[1],
                "next_token_kl": m.get("next_token_kl"),
                "kl_low": m.get("next_token_kl_ci_low"),
                "kl_high": m.get("next_token_kl_ci_high"),
                "top1": m.get("top1_agreement"),
                "ppl": m.get("ppl"),
                "ppl_ratio": _ratio(m.get("ppl"), m.get("ppl_ref")),
                "step_ratio": None if lat is None else lat.metrics.get("decode_ms_p50_ratio"),
                "step_low": None if lat is None else lat.metrics.get("decode_ms_p50_ratio_ci_low"),
                "step_high": (
                    None if lat is None else lat.metrics.get("decode_ms_p50_ratio_ci_high")
                ),
                "peak_ratio": _ratio(peak, base),
                "sources": {
                    k: r for k, r in ((QUALITY, q), ("latency", lat), ("memory", mem)) if r
                },
                "step_records": dict(sorted(step_records.items())),
            }
        )
    return out


def noise_floor(rs: list[HeadlineRow]) -> float:
    """The KL below which a row is not told from ``full`` (whose KL is exactly 0): the largest
    ``|KL|`` or interval bound of the rows that quantize nothing (measured key and value bits
    >= 16, ``full`` aside: their KL is the run's float noise), and at least :data:`KL_FLOOR`."""
    noise = [KL_FLOOR]
    for r in rs:
        if r["section"] != "base" and min(r["key_bits"] or 0, r["value_bits"] or 0) >= BASE_BITS:
            noise += [abs(r[k]) for k in ("next_token_kl", "kl_low", "kl_high") if r[k] is not None]
    return max(noise)


def _f(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "–"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}f}"


def _kl(v: float | None) -> str:
    """KL: three decimals, or two significant digits below 0.001 (a 1e-5 KL is not 0)."""
    if v is None:
        return "–"
    if v != 0 and abs(v) < 1e-3:
        return f"{v:.1e}"
    return _f(v)


def kl_cell(r: HeadlineRow, floor: float) -> str:
    """``KL [low, high]``, ``†`` when the lower bound is at or below ``floor``; ``KL [–]`` when
    the record has no interval (one bootstrap block: too few scored tokens for one)."""
    cell = _kl(r["next_token_kl"])
    if r["kl_low"] is None or r["kl_high"] is None:
        return f"{cell} [–]"
    dagger = " †" if r["kl_low"] <= floor and r["section"] != "base" else ""
    return f"{cell} [{_kl(r['kl_low'])}, {_kl(r['kl_high'])}]{dagger}"


def step_cell(
    r: HeadlineRow, context: int | None = None, noise: dict[int, SelfCheck] | None = None
) -> str:
    """``ratio [low, high]`` (two decimals) when the latency record has the ratio's interval,
    else the ratio alone (records written before the interval existed) or ``–``: of the row's
    record at the headline context (``context=None``), else of its record at exactly
    ``context`` tokens.  `` ≈`` (:data:`NOISE_MARK`) after an interval that overlaps
    ``noise`` at the record's context (:func:`noise_at`, :func:`within_noise`)."""
    if context is None:
        ratio, low, high = r["step_ratio"], r["step_low"], r["step_high"]
        rec = r["sources"].get("latency")
    else:
        rec = r["step_records"].get(context)
        m = {} if rec is None else rec.metrics
        ratio = m.get("decode_ms_p50_ratio")
        low, high = m.get("decode_ms_p50_ratio_ci_low"), m.get("decode_ms_p50_ratio_ci_high")
    cell = _f(ratio, 2)
    if ratio is None or low is None or high is None:
        return cell
    cell = f"{cell} [{_f(low, 2)}, {_f(high, 2)}]"
    check = None if rec is None or noise is None else noise.get(_context(rec))
    return f"{cell} {NOISE_MARK}" if within_noise(low, high, check) else cell


#: how far from 1.00 ``full`` against itself may reach (the target: 1.00 within +/-0.03,
#: docs/design.md#latency) before the headline says that ratios that close to 1.00 are no
#: difference
NOISE_TARGET = 0.03
#: marks a step cell whose interval overlaps ``full`` against itself's at its context
NOISE_MARK = "≈"
#: :func:`self_check` of a latency record written before the noise check existed
NOT_RECORDED = "not recorded"
#: :func:`self_check` of a latency record with a single baseline candidate (no pre-pass)
NOT_MEASURED = "not measured (a single baseline candidate: no pre-pass)"


class SelfCheck(NamedTuple):
    """``full`` against itself at one context, as a latency record gives it (manifest
    ``baseline_self_ratio``, ``baseline_self_interval``, ``baseline_self_rounds``,
    ``baseline_storage_dtype``: the pre-pass's two caches of the chosen baseline, copy A over
    copy B, kvbench.bench.workloads.latency): the ratio (unitless), its 95% interval
    (``None``: the record has none), the timed rounds and the baseline's storage dtype."""

    ratio: float
    low: float | None
    high: float | None
    rounds: int | None
    dtype: str | None

    def reach(self) -> float | None:
        """How far the interval reaches from 1.00: ``max(1 - low, high - 1)`` (``None``
        without an interval)."""
        if self.low is None or self.high is None:
            return None
        return max(1.0 - self.low, self.high - 1.0)


def self_check(rec: Record) -> SelfCheck | str:
    """The latency record's ``full`` against itself (:class:`SelfCheck`), else
    :data:`NOT_RECORDED` (no ``baseline_self_ratio`` in its manifest) or :data:`NOT_MEASURED`
    (``baseline_self_ratio`` null)."""
    m = rec.manifest
    if "baseline_self_ratio" not in m:
        return NOT_RECORDED
    if m["baseline_self_ratio"] is None:
        return NOT_MEASURED
    iv = m.get("baseline_self_interval")
    low, high = (float(iv[0]), float(iv[1])) if iv else (None, None)
    rounds, dtype = m.get("baseline_self_rounds"), m.get("baseline_storage_dtype")
    return SelfCheck(
        float(m["baseline_self_ratio"]),
        low,
        high,
        None if rounds is None else int(rounds),
        None if dtype is None else str(dtype),
    )


def _shown_latency(allrows: list[HeadlineRow], contexts: list[int]) -> list[Record]:
    """The latency records the step columns show: each row's at the step ``contexts``, else
    its record at the headline context."""
    out: list[Record] = []
    for r in allrows:
        out += [r["step_records"][c] for c in contexts if c in r["step_records"]] or [
            r["sources"][k] for k in ("latency",) if k in r["sources"]
        ]
    return out


def self_checks(
    allrows: list[HeadlineRow], contexts: list[int]
) -> dict[int, list[tuple[SelfCheck | str, int]]]:
    """Context (tokens, ascending) -> the distinct :func:`self_check` values of the latency
    records the step columns show there (:func:`_shown_latency`), each with its record count,
    in the order first seen: one value when the records of the context agree.  Empty when no
    shown record carries the check (all written before it): the headline then says nothing of
    it."""
    recs = _shown_latency(allrows, contexts)
    if not any("baseline_self_ratio" in rec.manifest for rec in recs):
        return {}
    by: dict[int, dict[SelfCheck | str, int]] = {}
    for rec in recs:
        counts = by.setdefault(_context(rec), {})
        value = self_check(rec)
        counts[value] = counts.get(value, 0) + 1
    return {c: list(by[c].items()) for c in sorted(by)}


def noise_at(checks: dict[int, list[tuple[SelfCheck | str, int]]]) -> dict[int, SelfCheck]:
    """Context -> the noise of its step ratios: the one :class:`SelfCheck` with an interval
    that every shown record of the context gives (:func:`self_checks`); a context whose
    records disagree, lack the check or its interval has none."""
    out: dict[int, SelfCheck] = {}
    for c, values in checks.items():
        value = values[0][0]
        if len(values) == 1 and isinstance(value, SelfCheck) and value.low is not None:
            out[c] = value
    return out


def within_noise(low: float, high: float, noise: SelfCheck | None) -> bool:
    """Whether a step ratio's interval ``[low, high]`` overlaps ``noise``'s (``full`` against
    itself at its context): then the run cannot tell the row's step from ``full``'s.  False
    without a noise interval."""
    if noise is None or noise.low is None or noise.high is None:
        return False
    return low <= noise.high and high >= noise.low


def _self_text(value: SelfCheck | str, digits: int = 2) -> str:
    if isinstance(value, str):
        return value
    lo, hi = value.low, value.high
    interval = "" if lo is None or hi is None else f" [{_f(lo, digits)}, {_f(hi, digits)}]"
    rounds = "?" if value.rounds is None else value.rounds
    return f"{_f(value.ratio, digits)}{interval} ({rounds} rounds, baseline {value.dtype or '?'})"


def noise_line(context: int, values: list[tuple[SelfCheck | str, int]]) -> str:
    """One context's line of :func:`noise_block`: ``N tok: `full` vs itself: 1.00 [lo, hi]
    (n rounds, baseline D)``; where the interval reaches farther than :data:`NOISE_TARGET`
    from 1.00, ``; noise +/-h > 0.03: read ratios within h% of 1.00 as no difference`` (h
    rounded up to the percent); where the records disagree (``values`` holds several), each
    value with its record count after ``⚠ records disagree``."""
    head = f"{context} tok: `full` vs itself: "
    if len(values) > 1:
        seen = [f"{_self_text(v, 3)} in {n} record{'s' if n > 1 else ''}" for v, n in values]
        return (
            head
            + f"{PEAK_FLAG} records disagree (not one pre-pass; no step cell of this context "
            + "is marked): "
            + "; ".join(seen)
        )
    value = values[0][0]
    line = head + _self_text(value)
    if not isinstance(value, SelfCheck):
        return line
    reach = value.reach()
    if reach is None:
        return line + " (no interval: fewer than two steady steps a side)"
    if reach > NOISE_TARGET:
        pct = math.ceil(round(reach * 100, 6))
        line += (
            f"; noise +/-{pct / 100:.2f} > {NOISE_TARGET:.2f}: read ratios within {pct}% of "
            "1.00 as no difference"
        )
    return line


def noise_block(allrows: list[HeadlineRow], contexts: list[int]) -> str:
    """The paragraph under the headline tables: one :func:`noise_line` per context of the step
    columns (:func:`self_checks`) and what :data:`NOISE_MARK` means; ``""`` when no shown
    latency record carries the check."""
    checks = self_checks(allrows, contexts)
    if not checks:
        return ""
    lines = "\n".join(f"- {noise_line(c, values)}" for c, values in checks.items())
    return (
        "Noise of the step ratios: `full` against itself at each context, two caches of the "
        "chosen baseline timed interleaved in the latency pre-pass (the records' "
        "`baseline_self_ratio` [`baseline_self_interval`], `baseline_self_rounds`, "
        "`baseline_storage_dtype`):\n\n"
        + lines
        + f"\n\n{NOISE_MARK} after a step ratio: its 95% interval overlaps `full` vs itself's "
        "at that context, so the run cannot tell its step from `full`'s (within noise)."
    )


def step_contexts(rs: list[HeadlineRow]) -> list[int]:
    """The contexts (tokens, ascending) of the step columns: every context some row has a
    latency record at, when there are two or more; else ``[]`` (one ``step vs full`` column
    from the record at the headline context, :func:`step_cell`)."""
    ctxs = sorted({c for r in rs for c in r["step_records"]})
    return ctxs if len(ctxs) > 1 else []


SECTIONS = {
    "a": "(a) Deployed: keys and values quantized",
    "b": "(b) Keys only: values kept at 16 bits (b_V = 16, the PN-Mix paper's setting)",
}
#: the title of the peers' section (rows of section ``peer``: transformers' own caches)
PEERS = "Peers: transformers' own caches, for reference (not ranked)"
HEAD = (
    "| method | key bits | value bits | nominal bits (K / V) | bytes vs 16-bit "
    "| next-token KL [95% CI] | top-1 | ppl ratio | step vs full | peak vs full | frontier |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"
)


def head(contexts: list[int]) -> str:
    """The table's header: :data:`HEAD`, its ``step vs full`` column one per context
    (``step vs full, N tok``) when ``contexts`` (:func:`step_contexts`) is not empty."""
    if not contexts:
        return HEAD
    names = " | ".join(f"step vs full, {c} tok" for c in contexts)
    top, rule = HEAD.split("\n")
    return (
        top.replace("step vs full", names)
        + "\n"
        + rule.replace("|---:|:---:|", "|---:" * len(contexts) + "|:---:|")
    )


def peer_head(contexts: list[int]) -> str:
    """The peers section's header: :func:`head` without its ``frontier`` column."""
    top, rule = head(contexts).split("\n")
    return top.removesuffix(" frontier |") + "\n" + rule.removesuffix(":---:|")


def is_peer(row: HeadlineRow) -> bool:
    """Whether the row is a transformers peer's own cache (:func:`peer_record` of its
    perplexity record)."""
    return peer_record(row["sources"][QUALITY])


def same_cache(row: HeadlineRow) -> tuple[float | None, ...]:
    """The key under which rows hold the same cache: (``bytes``, KL, interval low, high).
    Rows with equal keys (and a KL and bytes) are one cache under several labels."""
    return (row["bytes"], row["next_token_kl"], row["kl_low"], row["kl_high"])


def budget_miss(row: HeadlineRow) -> tuple[int, int] | None:
    """``(tokens held, budget_tokens)`` when the row's cache held fewer tokens than its
    configuration's ``budget_tokens``: a progressive budget (PM-KVQ, arXiv 2505.18610: codes
    halve until ``budget_bits`` x ``budget_tokens`` holds them) reaches ``budget_bits`` only
    once the cache holds ``budget_tokens``, so at fewer its codes are wider than the budget.
    ``None`` for a row without ``budget_bits``/``budget_tokens`` or at or past them.  Not read
    from the measured bits: those include the full-precision window and the scales, which a
    reached budget does not count (``budget_scope: codes``)."""
    q = row["sources"][QUALITY]
    budget, budget_tokens, held = (
        q.config.get("budget_bits"),
        q.config.get("budget_tokens"),
        cache_tokens(q),
    )
    if budget is None or not isinstance(budget_tokens, int) or held is None:
        return None
    return (held, budget_tokens) if held < budget_tokens else None


def measured_dtype(rec: Record) -> str | None:
    """The dtype the record's cache stored its full-precision parts in, as the perplexity
    workload read it from the held tensors (manifest ``storage.full_precision_dtype``, e.g.
    ``"float32"`` for a transformers peer, which ``storage_dtype`` cannot set); ``None`` when
    the record does not say (records written before it) or the cache held none."""
    got = (rec.manifest.get("storage") or {}).get("full_precision_dtype")
    return got if isinstance(got, str) and got and got != "none held" else None


def row_label(row: HeadlineRow) -> str:
    """The row's label as the table prints it: `` (peer, stored D)`` after a transformers
    peer's (:func:`is_peer`; D its :func:`measured_dtype`, `` (peer)`` when not recorded),
    `` (budget not reached at N tokens: sized for M)`` after a row of :func:`budget_miss`."""
    label = row["label"]
    if is_peer(row):
        stored = measured_dtype(row["sources"][QUALITY])
        label += f" (peer, stored {stored})" if stored else " (peer)"
    miss = budget_miss(row)
    if miss is None:
        return label
    return f"{label} (budget not reached at {miss[0]} tokens: sized for {miss[1]})"


def peak_below_rest(row: HeadlineRow) -> tuple[float, float] | None:
    """``(peak, rest)`` per 16-bit cache when the row's memory record's bytes at rest plus its
    step peak, over :func:`bytes16` of that record, fall below the ``bytes vs 16-bit`` of its
    perplexity record: a peak cannot be below the bytes the cache holds at rest, so the two
    workloads measured different caches (another storage dtype, or a flush between their
    contexts); ``None`` otherwise or when either is unknown."""
    mem, rest = row["sources"].get("memory"), row["bytes_ratio"]
    if mem is None or rest is None:
        return None
    m, n16 = mem.metrics, bytes16(mem)
    if not n16 or "bytes_total" not in m or "peak_step_bytes" not in m:
        return None
    peak = (m["bytes_total"] + m["peak_step_bytes"]) / n16
    return (peak, rest) if peak < rest - 1e-9 else None


def fill_schedule(rec: Record) -> str | None:
    """How the record's workload filled the cache it measured, from its parameters: a
    ``memory`` record ``"prefill P + A one-token steps"`` (P = ``context - appends``) or, under
    ``fill: chunks``, ``"prefill P + chunks of C (exact-chunked)"`` (the perplexity workload's
    fill, which that option replays), a ``perplexity`` record ``"prefill P + chunks of C
    (protocol)"``; ``None`` when the record does not say.  A cache whose flushes depend on its
    history (transformers' quanto cache quantizes the whole prompt, then its residual each time
    it reaches ``residual_length``) holds different tokens in full precision after different
    fills of the same length."""
    w = rec.workload
    if rec.workload_type == "memory" and w.get("fill") == "chunks":
        # the memory workload cuts a chunk as the exact-chunked protocol does
        return f"prefill {w['prefill']} + chunks of {w['chunk']} (exact-chunked)"
    if rec.workload_type == "memory" and "context" in w and "appends" in w:
        n = int(w["appends"])
        return f"prefill {int(w['context']) - n} + {n} one-token steps"
    if rec.workload_type == QUALITY and "prefill" in w and "chunk" in w:
        proto = f" ({w['protocol']})" if w.get("protocol") else ""
        return f"prefill {w['prefill']} + chunks of {w['chunk']}{proto}"
    return None


def stored_dtype(rec: Record) -> str | None:
    """The dtype the record's cache stored its full-precision parts in: the perplexity
    workload's :func:`measured_dtype`, else the configuration's ``storage_dtype``, else the dtype
    the K/V were handed in (a ``memory`` record's workload ``dtype``, else the model's);
    ``None`` when the record says none of these."""
    if rec.workload_type == QUALITY and measured_dtype(rec):
        return measured_dtype(rec)
    got = rec.config.get("storage_dtype") or rec.workload.get("dtype") or _model(rec).get("dtype")
    return str(got) if got else None


def cache_differences(row: HeadlineRow) -> tuple[list[str], list[str]] | None:
    """What differs and what agrees between the cache of the row's ``memory`` record and that
    of its perplexity record, each part computed from the two records: bytes at rest per 16-bit
    cache (:func:`bytes_vs_16bit`), configuration, tokens held (:func:`cache_tokens`),
    full-precision storage dtype (:func:`stored_dtype`) and fill (:func:`fill_schedule`).
    Returns ``(differs, same)``, e.g. ``(["bytes at rest 0.195 (memory) vs 0.413
    (perplexity)", "fill prefill 1019 + 4 one-token steps vs prefill 512 + chunks of 16
    (exact-chunked)"], ["configuration", "1023 tokens", "float32 storage"])`` (bytes as the
    table prints them, three decimals); ``None`` without a memory record."""
    mem, q = row["sources"].get("memory"), row["sources"][QUALITY]
    if mem is None:
        return None
    differs, same = [], []
    rest = _f(bytes_vs_16bit(mem)), _f(row["bytes_ratio"])  # as the table prints bytes
    if rest[0] != rest[1]:
        differs.append(f"bytes at rest {rest[0]} (memory) vs {rest[1]} ({QUALITY})")
    if mem.config == q.config:
        same.append("configuration")
    else:
        keys = sorted(k for k in {*mem.config, *q.config} if mem.config.get(k) != q.config.get(k))
        differs += [f"{k} {mem.config.get(k, '–')} vs {q.config.get(k, '–')}" for k in keys]
    parts = (
        ("tokens", cache_tokens(mem), cache_tokens(q), "{} tokens"),
        ("storage", stored_dtype(mem), stored_dtype(q), "{} storage"),
        ("fill", fill_schedule(mem), fill_schedule(q), "fill {}"),
    )
    for what, a, b, fmt in parts:
        if a is None or b is None:
            continue
        if a == b:
            same.append(fmt.format(a))
        else:
            differs.append(f"{what} {a} vs {b}")
    return differs, same


def difference_text(row: HeadlineRow) -> str:
    """:func:`cache_differences` as one line of the note: ``"<label>: <what differs, memory vs
    perplexity, comma-separated>; same <what agrees>"``."""
    got = cache_differences(row)
    if got is None:
        return f"{row['label']}: no memory record"
    differs, same = got
    text = f"{row['label']}: " + (", ".join(differs) or "no recorded difference")
    return text + (f"; same {', '.join(same)}" if same else "")


#: marks a ``peak vs full`` cell of :func:`peak_below_rest`
PEAK_FLAG = "⚠"


def _peak_cell(r: HeadlineRow) -> str:
    cell = _f(r["peak_ratio"])
    return f"{cell} {PEAK_FLAG}" if r["peak_ratio"] is not None and peak_below_rest(r) else cell


def _nominal_cell(r: HeadlineRow) -> str:
    kb, vb = r["nominal_key_bits"], r["nominal_value_bits"]
    return "" if kb is None or vb is None else f"{_f(kb, 2)} / {_f(vb, 2)}"


def _cells(
    r: HeadlineRow, floor: float, contexts: list[int], noise: dict[int, SelfCheck]
) -> list[str]:
    """The cells of one row between its label and its frontier mark (``contexts``: the step
    columns', :func:`step_contexts`; ``noise``: :func:`noise_at`)."""
    steps = [step_cell(r, c, noise) for c in contexts] if contexts else [step_cell(r, None, noise)]
    return [
        _f(r["key_bits"], 2),
        _f(r["value_bits"], 2),
        _nominal_cell(r),
        _f(r["bytes_ratio"]),
        kl_cell(r, floor),
        _f(r["top1"]),
        _f(r["ppl_ratio"]),
        *steps,
        _peak_cell(r),
    ]


def merge_groups(rs: list[HeadlineRow]) -> list[list[HeadlineRow]]:
    """``rs`` grouped by cache: rows that are not transformers peers, have a KL and bytes and
    share :func:`same_cache` form one group (labels in order); every other row is a group of
    its own.  Groups keep the order of their first row in ``rs``."""
    groups: dict[object, list[HeadlineRow]] = {}
    for r in rs:
        merge = not is_peer(r) and r["next_token_kl"] is not None and r["bytes"] is not None
        groups.setdefault(same_cache(r) if merge else id(r), []).append(r)
    return [sorted(g, key=lambda r: r["label"]) for g in groups.values()]


def _line(
    group: list[HeadlineRow],
    floor: float,
    star: bool | None,
    contexts: list[int],
    noise: dict[int, SelfCheck],
) -> str:
    """One table line for a group of rows holding the same cache: labels joined by `` = ``,
    each cell once where the rows agree, else their cells in label order joined by `` / ``;
    the frontier cell last (``★`` when ``star``), none when ``star`` is ``None`` (peers)."""
    cols = zip(*(_cells(r, floor, contexts, noise) for r in group))
    cells = [c[0] if len(set(c)) == 1 else " / ".join(c) for c in cols]
    label = " = ".join(row_label(r) for r in group)
    mark = "" if star is None else f" {'★' if star else ''} |"
    return f"| {label} | " + " | ".join(cells) + " |" + mark


def _spec(rec: Record) -> str:
    w = {k: v for k, v in rec.workload.items() if k != "type"}
    return f"`{rec.workload_type}` (" + ", ".join(f"{k}={w[k]}" for k in sorted(w)) + ")"


def _used(allrows: list[HeadlineRow], kind: str, contexts: list[int] | None = None) -> list[Record]:
    """One record per distinct workload spec of ``kind`` the rows took a column from (for
    ``latency`` with step ``contexts``: the records at those contexts)."""
    seen: dict[str, Record] = {}
    for r in allrows:
        if kind == "latency" and contexts:
            recs = [r["step_records"][c] for c in contexts if c in r["step_records"]]
        else:
            recs = [r["sources"][kind]] if kind in r["sources"] else []
        for rec in recs:
            seen.setdefault(_spec(rec), rec)
    return list(seen.values())


def _baselines(allrows: list[HeadlineRow], contexts: list[int]) -> str:
    """``; baseline storage: float16 in N records, float32 in M`` over the latency records
    shown that name theirs (``baseline_storage_dtype``), else ``""``."""
    count: dict[str, int] = {}
    for rec in _shown_latency(allrows, contexts):
        dt = rec.manifest.get("baseline_storage_dtype")
        if dt is not None:
            count[str(dt)] = count.get(str(dt), 0) + 1
    if not count:
        return ""
    parts = [f"{dt} in {n} record{'s' if n > 1 else ''}" for dt, n in sorted(count.items())]
    return (
        "; the baseline is the faster (smallest steady median step) of `full` with its K/V "
        "stored in each dtype, chosen once per context by a pre-pass that times them "
        "interleaved, then timed interleaved with each configuration (the record's "
        "`baseline_storage_dtype`): " + ", ".join(parts)
    )


def _stored_in(allrows: list[HeadlineRow]) -> str:
    """The dtypes the rows stored their full-precision parts in (peers aside): each row's
    ``storage_dtype``, else its :func:`measured_dtype`, else the model's dtype, with row
    counts when they differ."""
    seen: dict[str, int] = {}
    for r in allrows:
        if is_peer(r):
            continue
        q = r["sources"][QUALITY]
        dt = q.config.get("storage_dtype") or measured_dtype(q) or _model(q).get("dtype", "?")
        seen[str(dt)] = seen.get(str(dt), 0) + 1
    if len(seen) == 1:
        return next(iter(seen))
    return ", ".join(f"{d} ({n} rows)" for d, n in sorted(seen.items(), key=lambda x: -x[1]))


def note(allrows: list[HeadlineRow], floor: float, merged: list[str] | None = None) -> str:
    """The note under the tables: each column's workload, context, protocol and dtype, the
    nominal bits' source, and the labels merged into one row (``merged``: each row's printed
    ``A = B`` label, :func:`merge_groups`)."""
    contexts = step_contexts(allrows)
    parts = []
    for rec in _used(allrows, QUALITY):
        model = _model(rec)
        how = rec.manifest.get("intervals", "interval rule not recorded")
        parts.append(
            f"key/value bits, bytes vs 16-bit, next-token KL, top-1, ppl ratio: one record per "
            f"row, {_spec(rec)}, model computed in {model.get('dtype', '?')}; bits and bytes "
            f"measured on the stored tensors of the whole cache (every layer) after the last "
            f"scored chunk ({cache_tokens(rec)} tokens), the cache the scored tokens attended "
            f"to; bytes vs 16-bit: those bytes over K/V elements x 2 bytes (the deployed 16-bit "
            f"cache, whatever dtype the model computes in); full-precision parts (`full`'s K/V, "
            f"residuals, sinks) stored in {_stored_in(allrows)}; KL(full || method) and top-1 "
            f"agreement against `full` stored in {model.get('dtype', '?')} (the model's dtype) "
            f"under the same schedule, ppl ratio = ppl / that `full`'s; KL interval: {how}"
        )
    for rec in _used(allrows, "latency", contexts):
        how = rec.manifest.get("ratio_interval")  # absent from records before the interval
        interval = f"; step interval [low, high]: {how}" if how else ""
        threads = rec.manifest.get("step_threads", rec.manifest.get("threads", "?"))
        parts.append(
            f"step vs full: decode_ms_p50 (median steady-state decode step, flush steps "
            f"apart) over `{rec.manifest.get('baseline', BASELINE)}`'s timed interleaved in the "
            f"same run, {_spec(rec)}, threads={threads} on "
            f"{rec.manifest.get('device', '?')}{interval}"
        )
    base = _baselines(allrows, contexts)
    if base:
        parts[-1] += base
    for rec in _used(allrows, "memory"):
        parts.append(
            f"peak vs full: (bytes at rest + transient peak of one decode step) over `full`'s, "
            f"{_spec(rec)} ({cache_tokens(rec)} tokens), K/V handed to the cache in "
            f"{rec.workload.get('dtype', '?')}, full-precision parts stored in the row's "
            f"`storage_dtype` where set, else in that dtype"
        )
    flagged = sorted(
        (r for r in allrows if r["peak_ratio"] is not None and peak_below_rest(r)),
        key=lambda r: r["label"],
    )
    if flagged:
        parts.append(
            f"{PEAK_FLAG} (peak vs full): the memory record's bytes at rest + step peak, per "
            "16-bit cache, are below the row's bytes vs 16-bit: the two workloads measured "
            "different caches, so the peak is not that row's cache; what differs, from the "
            "records (memory vs perplexity), one flagged row a line:"
        )
        parts += [f"{PEAK_FLAG} {difference_text(r)}" for r in flagged]
    parts.append(
        "nominal bits (K / V): the method's own nominal key and value bits per element as its "
        "records carry them (`nominal_key_bits` / `nominal_value_bits` of the quality record, "
        "else of the row's other records); empty where no record of the row carries them"
    )
    if merged:
        parts.append(
            "merged rows (equal bytes, next-token KL and KL interval: one cache under several "
            "labels; where their other cells differ, those cells are given in label order, "
            "separated by /): " + "; ".join(merged)
        )
    parts.append(
        f"†: the KL interval's lower bound is at or below full's noise floor ({floor:.0e}: the "
        f"largest |KL| of unquantized rows, at least {KL_FLOOR:.0e}), so the run cannot tell "
        "the row from full. ★: on the Pareto frontier of next-token KL vs bytes within the "
        "section; transformers' own caches (peer) are rows of their own section, never ranked "
        "or marked. (budget not "
        "reached at N tokens: sized for M): a progressive budget reaches its `budget_bits` "
        "only once the cache holds its `budget_tokens` M; at N < M its codes are wider. "
        "–: not measured."
    )
    return "\n>\n".join(f"> {p}" for p in parts)


def headline_table(records: list[Record]) -> str:
    """Markdown: one table per section ((a), (b), then the peers' own, :data:`PEERS`, without a
    frontier column), rows sorted by bytes after ``full``, rows holding the same cache merged
    (:func:`merge_groups`), the Pareto frontier of (a) and (b) marked, step cells within noise
    marked, the noise of the step ratios per context (:func:`noise_block`, where the records
    carry it), a note naming each column's source and the merged labels (see the module
    docstring).  Rows without a KL or bytes are listed but not ranked."""
    allrows = rows(records)
    floor = noise_floor(allrows)
    contexts = step_contexts(allrows)
    noise = noise_at(self_checks(allrows, contexts))
    base = [r for r in allrows if r["section"] == "base"]
    parts, merged = [], []
    for sec, title in SECTIONS.items():
        rs = sorted(
            (r for r in allrows if r["section"] == sec),
            key=lambda r: (r["bytes_ratio"] is None, r["bytes_ratio"] or 0, r["label"]),
        )
        if not rs:
            continue
        ranked = [
            r
            for r in rs
            if r["next_token_kl"] is not None and r["bytes_ratio"] is not None and not is_peer(r)
        ]
        mask = pareto_mask([r["bytes_ratio"] for r in ranked], [r["next_token_kl"] for r in ranked])
        front = {id(r) for r, on in zip(ranked, mask) if on}
        groups = [[r] for r in base] + merge_groups(rs)
        merged += [" = ".join(row_label(r) for r in g) for g in groups if len(g) > 1]
        lines = [_line(g, floor, any(id(r) in front for r in g), contexts, noise) for g in groups]
        parts.append(f"#### {title}\n\n{head(contexts)}\n" + "\n".join(lines))
    peers = sorted(
        (r for r in allrows if r["section"] == "peer"),
        key=lambda r: (r["bytes_ratio"] is None, r["bytes_ratio"] or 0, r["label"]),
    )
    if peers:
        lines = [_line([r], floor, None, contexts, noise) for r in base + peers]
        parts.append(f"#### {PEERS}\n\n{peer_head(contexts)}\n" + "\n".join(lines))
    block = noise_block(allrows, contexts)
    return "\n\n".join(parts + ([block] if block else []) + [note(allrows, floor, merged)])
