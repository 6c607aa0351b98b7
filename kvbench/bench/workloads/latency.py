"""``latency``: prefill time and per-step decode latency at context depth d, interleaved with a
baseline in the same call, timed by :mod:`kvbench.measure.timer`; protocol, clocks and the CPU
caveat: docs/design.md#latency.

Protocol.  Token ids of ``text`` (a fixed window) are fed to the real model with the method's
cache (``make_hf_cache(method, model)``: kvbench's ``QuantizedKVCache``, or a peer's
transformers cache) and the baseline's: the ``baseline`` method (default ``full``) with one of
``baseline_storage_dtypes`` (default ``["model", "float16"]``: its full-precision K/V stored in
the model's dtype, float32 on the default CPU model, or in float16; ``model`` passes
``storage_dtype: None``).

0. Pre-pass (:meth:`Latency.choose_baseline`, with two or more candidates): two caches of
   each candidate (copies A and B: distinct objects of the same state, interleaved as
   ``float32 A, float32 B, float16 A, float16 B``) alone, run through steps 1, 2 and 4 below
   for the same rounds; the candidate with the smallest steady-state median step over both
   copies' steady steps (ties: the first listed) is the baseline of every configuration of
   the suite run at this context and step threads (kept in ``ctx.shared.latency_baselines``,
   keyed by the context, ``threads``, the baseline spec and the rest of the protocol), so no
   method is flattered by a slow baseline, and each configuration times two caches, not one
   per candidate.  ``info.baseline_storage_dtype`` names the choice (``float32``,
   ``float16``, ...), ``info.baseline_candidates`` each candidate's pre-pass median (ms, over
   both copies; ``None`` with a single candidate, no pre-pass).  The noise check, at every
   context with a pre-pass whatever dtype wins: the chosen candidate's copy A against its
   copy B, ``info.baseline_self_ratio`` (steady median of A / of B),
   ``info.baseline_self_interval`` (``[low, high]``, its 95% paired interval as the step
   ratio's below; ``None`` with fewer than two steady steps a side) over
   ``info.baseline_self_rounds`` timed rounds (all three ``None`` with a single candidate).
   Cost: the second copy doubles the pre-pass, ``2 x candidates x (warmup + steps)`` baseline
   steps per context instead of half as many.
1. Prefill ``P = d - warmup - steps`` tokens into fresh caches of both.  ``prefill: timed``
   (default): ``prefill_repeats`` times (default 3), alternating which goes first (A B, B A,
   ...); ``prefill_ms`` is the median and ``prefill_ms_ratio`` the ratio to the baseline's
   median (not one sample).  ``prefill: shared``: untimed, the prompt's
   full-precision K/V captured once per (text, window, P, batch) and shared by every run of
   the model (:func:`kvbench.hf.capture.capture_prompt`, as the perplexity workload shares its
   prompt), each kvbench cache whose method has ``prefill_attention: full`` prefilled from it
   (``QuantizedKVCache.prefill_from``: the state its own prefill leaves), a transformers
   peer's cache by replaying the capture through its ``update`` where that is its prefill
   (:func:`replay_prefill`: ``DynamicCache``, quanto, HQQ), any other cache by the model (a
   peer that is no replay; ``prefill_attention: stored``, whose prompt then attends to its
   stored K/V by sdpa over ``keys_values()``, :func:`stored_prompt`); no ``prefill_ms``.  The last round's
   caches decode, so the last timed step attends to exactly d tokens (the model's maximum
   context is the largest allowed d).  The prefill runs at the suite's ``threads``.
2. ``warmup`` single-token steps (untimed), then ``steps`` timed single-token steps, by
   :func:`kvbench.measure.timer.interleave` at the workload's ``threads`` (default 1: on a
   2-core machine 2 threads share the cores with the OS; recorded as ``step_threads``): every
   round times one step of each cache, alternating which goes first; the warm-up rounds step
   both caches before the first timed round.  Inputs are the text's next tokens (teacher
   forcing), identical for every cache, so the runs do the same work.  A kvbench cache's first
   decode step copies a full-precision residual of 256+ tokens (``full``'s prompt K/V) once
   into an allocation with room, and every later step writes its token into that room
   (:meth:`kvbench.cache.layer.Side.add_residual`, docs/design.md#memory: no per-step copy of
   the cache, as a deployed engine preallocates), so with ``warmup >= 1`` that one copy stays
   out of the timed rounds and the room lasts a quarter of the context (no regrowth while
   timing unless ``steps`` exceeds that).  The ``full`` row against the chosen ``full``
   baseline times two distinct caches, each prefilled from the shared capture (neither ever
   writes into it or into the other).
3. Every ratio is against the chosen baseline's steps timed in this call, interleaved with the
   method's (not the pre-pass's).  A configuration equal to the chosen baseline (``full``
   with its storage dtype) times ``full`` against itself: its ratio is noise too, as is the
   pre-pass's ``baseline_self_ratio``, which every record of the context carries.
4. Flushes (:mod:`kvbench.measure.window`): a step after which the cache holds fewer bytes
   than before is a flush step (a bulk quantization of the residual, e.g. KIVI's keys every R
   steps); steady-state and flush steps are reported separately.
5. Groups (``group`` g > 1, :meth:`Latency.plan`): the runs the runner has still to compute in
   this workload are timed g at a time in one interleaved run with ONE cache of the chosen
   baseline (every round steps the baseline once and each configuration of the group once, the
   order rotated per round: g + 1 forwards a round instead of 2g); each record pairs its own
   steps with the same rounds' baseline steps (ratio, interval, flush split as in steps 3 and 4)
   and names the others (``info.group_size``, ``info.timed_with``).  The g caches and the
   baseline's are held at once; the group's timing counts in the wall time of the run that
   started it.  A configuration whose cache cannot be built or prefilled
   leaves the group and its own run times it alone (raising its own error); a run the plan
   does not hold (another executor, a rerun of one record) is timed alone.  ``group: 1``
   (default): each configuration alone, no group fields.

Metrics: ``prefill_ms``; ``decode_ms_p50``/``_p90``/``_p99``/``_mean`` over the steady-state
steps (percentiles by :data:`kvbench.measure.timer.PERCENTILE_RULE`); ``flush_steps`` (count in
the window), ``flush_ms_mean``/``flush_ms_max`` (when a flush was timed);
``decode_ms_amortized`` = steady mean + (flush mean - steady mean) / period, the cost per token
of a long decode, with the period (steps between flushes) from the tokens one flush quantized
(recorded with its source); ``tokens_per_s`` = B * 1000 / ``decode_ms_amortized`` (B rows).  Each has a
``*_ratio`` against the interleaved baseline of this same call (``tokens_per_s_ratio`` =
baseline ms / method ms; the runner keeps these).  ``decode_ms_p50_ratio`` has a 95% interval
against the chosen baseline, ``decode_ms_p50_ratio_ci_low``/``_ci_high``: a paired percentile bootstrap over the timed rounds
(:func:`kvbench.bench.metrics.paired_ratio_ci`): each resample draws the rounds with
replacement, the same rounds for the method and the baseline (so drift of the machine from round
to round, which moves both steps of a round, cancels), and takes the ratio of the two medians
over the drawn steady-state steps; seeded with the suite's seed, so the record is reproducible
from its timings; absent with fewer than two steady steps a side (rule recorded in
``info.ratio_interval``).  ``bytes_total`` of the method's cache at the end.  Raw samples are
in ``per_layer`` (``decode_ms``, ``baseline_decode_ms`` of the chosen baseline in this call,
``prepass_decode_ms_<dtype>`` and ``prepass_decode_ms_<dtype>_b`` of each candidate's copies
A and B in the pre-pass, ``prefill_ms``, ``baseline_prefill_ms``);
``info.flush_index`` lists the flush steps.

Recorded with each run: the ``protocol`` (kvbench caches: ``write-then-attend``,
docs/design.md#protocols; peers: their own ``update``) and the attention path (kvbench methods:
the ``"kvbench"`` attention function over ``keys_values()`` with sdpa, or ``LayerCache.attend``
for ``path: attend``, and ``auto`` for methods with a fused kernel or without ``keys_values``;
peers: transformers' cache ``update`` then sdpa).

Batches (``batch_size`` B, ``padding``: ``none`` or ``left``): row b reads text window
``window + b``; rows, masks and positions as docs/design.md#padding (its latency paragraph);
``decode_ms_*`` are per batch step; ``info.batch`` records B, the padding, each row's prompt
tokens, the pad tokens and the pad tokens the cache stored (measured).

Parameters: ``context`` (d, 2048), ``steps`` (20), ``warmup`` (3), ``prefill_repeats`` (3),
``prefill`` (``timed`` | ``shared``), ``threads`` (1), ``baseline`` (a method name, ``full``),
``baseline_storage_dtypes`` (``model`` | ``float16`` | ``bfloat16``, a list, default
``["model", "float16"]``), ``path`` (``auto`` | ``reference`` | ``attend``), ``text``
(``essays``), ``window`` (0), ``batch_size`` (1), ``padding`` (``none`` | ``left``),
``group`` (1: configurations timed together against one baseline, an integer >= 1; memory:
g + 1 caches held at once, e.g. a ``full`` float16 cache of the default model is ~190 MB at
8192 tokens).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvbench.bench.batching import left_pad, pad_id, stored_pad_tokens
from kvbench.bench.context import BaselineChoice, RunContext
from kvbench.bench.metrics import RATIO_RESAMPLES, paired_ratio_ci
from kvbench.bench.workloads import HIGHER, LOWER, NONE
from kvbench.cache.method import Method, require_padding
from kvbench.cache.registry import BASELINE
from kvbench.fields import Field
from kvbench.hf.cache import QuantizedKVCache, cache_protocol, make_hf_cache, prefill_attention
from kvbench.hf.peers import cache_nbytes
from kvbench.jsontypes import JSONValue
from kvbench.measure.timer import (
    PERCENTILE_RULE,
    Timer,
    interleave,
    pin_threads,
    rotation,
    summarize,
    system_state,
)
from kvbench.measure.window import FlushSplit, flush_steps, split_steps

from . import PendingRun, Result, Workload, reject

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from kvbench.hf.capture import CapturedQKV, PromptState

CPU_NOTE = (
    "CPU timing: dominated by framework overhead and dequantization (Python, small kernels, "
    "unpacking), not by memory bandwidth; do not read it as GPU decode speed"
)


PADDINGS = ("none", "left")
#: ``prefill``: ``timed`` (each cache runs the prompt, ``prefill_repeats`` times) or ``shared``
PREFILLS = ("timed", "shared")
#: ``baseline_storage_dtypes`` entries: ``model`` (``storage_dtype: None``, the model's dtype)
#: or a :data:`kvbench.cache.method.STORAGE_DTYPES` name
BASELINE_STORAGE = ("model", "float16", "bfloat16")


def row_prompt_lengths(prompt: int, batch: int, padding: str) -> list[int]:
    """Real prompt tokens of each row: all ``prompt`` for ``padding="none"``; for ``"left"``
    row b keeps ``prompt - (b * (prompt // 2)) // (batch - 1)`` (row 0 all, the last about half)."""
    if padding == "none" or batch == 1:
        return [prompt] * batch
    return [prompt - (b * (prompt // 2)) // (batch - 1) for b in range(batch)]


RATIO_INTERVAL = (
    "95% paired percentile bootstrap over the interleaved timed rounds "
    f"(decode_ms_p50_ratio_ci_low/_ci_high), {RATIO_RESAMPLES} resamples of the rounds with "
    "replacement, the same rounds for method and baseline (round-to-round drift cancels); "
    "statistic: median of the method's "
    "drawn steady-state steps / median of the baseline's; torch generator seeded with the "
    "suite's seed; none with fewer than two steady-state steps a side"
)

PREFILL_NOTE = {
    "timed": "timed: each cache runs the prompt through the model, prefill_repeats rounds",
    "shared": "shared, untimed: the prompt's full-precision K/V captured once "
    "(kvbench.hf.capture.capture_prompt) prefill every kvbench cache with prefill_attention "
    "full, and every transformers peer whose prefill update hands attention the K/V it was "
    "given (DynamicCache, quanto, HQQ: replayed layer by layer) (prefill_from_capture: true); "
    "the others run the prompt through the model (prefill_attention stored: attending to its "
    "stored K/V by sdpa over keys_values(), the decode steps on the workload's path)",
}

STEADY_NOTE = (
    "steady-state steps and flush steps (held bytes fell) reported separately; "
    "decode_ms_amortized spreads the flush over its period"
)


def replay_prefill(cache: Cache, captured: CapturedQKV) -> bool:
    """Prefill a transformers peer's (empty) ``cache`` from a prompt's captured K/V
    (:func:`kvbench.hf.capture.capture_prompt`): ``cache.update(keys, values, layer)`` for each
    layer in order, the calls the model's own prefill makes with the same tensors.  That is its
    prefill only when every update hands attention the K/V it was given (``DynamicCache``;
    quanto and HQQ, which quantize after the prompt attended): then each layer's input, and so
    the next layer's K/V, is what the capture saw.  A cache that hands back another form (fp8
    stores first: its prompt attends to fp8 K/V) is not: returns ``False``, and the caller
    runs the prompt through the model on a fresh cache.  ``True``: ``cache`` holds the state
    its own prefill leaves.

    Raises ``ValueError`` when the capture is not of layers ``0 .. L-1`` in order."""
    if captured.layer_ids != list(range(len(captured.layer_ids))):
        raise ValueError(f"the capture holds layers {captured.layer_ids}, not 0..L-1 in order")
    for i, k, v in zip(captured.layer_ids, captured.keys, captured.values):
        got_k, got_v = cache.update(k, v, i)
        if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
            return False
    return True


def stored_prompt(cache: QuantizedKVCache, run: Callable[[], object]) -> None:
    """Run ``run`` (the prompt's model call into ``cache``, a method with ``prefill_attention:
    stored``) with its prompt attending on the reference route: sdpa over the dequantized
    ``keys_values()`` of what the cache stored, instead of ``LayerCache.attend``'s code-domain
    kernels, which are decode kernels (8166 queries at the 8192-token context cost them ~95 s
    on 2 cores, sdpa about what the model's own prefill costs).  The same attention up to float
    rounding; the decode steps after it run on the cache's route as before (``cache.attend``
    is restored).  A cache forced onto the attend route (no ``keys_values``, an evictor that
    observes attention) runs ``run`` unchanged."""
    method = cache.method
    if not cache.attend or not method.capabilities.keys_values:
        run()
        return
    if method.observes_attention:
        run()
        return
    cache.attend = False
    try:
        run()
    finally:
        cache.attend = True


def held_bytes(cache: Cache) -> int | None:
    """Bytes the cache holds now (``None`` when it cannot say)."""
    try:
        nb = cache_nbytes(cache)
    except (AttributeError, TypeError, ValueError):
        return None
    return nb.get("total") if nb else None


def quantized_tokens_of(cache: Cache) -> tuple[int, int] | None:
    """(keys, values) tokens held quantized by layer 0 of a kvbench cache, else ``None``."""
    return cache.quantized_tokens() if isinstance(cache, QuantizedKVCache) else None


def flush_period(
    cache: Cache, quantized: list[tuple[int, int] | None], flushes: list[int]
) -> tuple[float | None, str]:
    """Steps between flushes in steady state, and where the figure comes from: the tokens one
    flush quantized (kvbench caches: the jump of ``quantized_tokens()``, one token per step);
    else the transformers layers' ``residual_length``; else the spacing of the flushes seen."""
    jumps = [
        max(b - a for a, b in zip(quantized[i], quantized[i + 1]))
        for i in flushes
        if quantized[i] is not None and quantized[i + 1] is not None
    ]
    if jumps and max(jumps) > 0:
        return float(max(jumps)), "tokens quantized by one flush (quantized_tokens)"
    for layer in cache.layers:  # only some transformers layer types have a residual window
        r = getattr(layer, "residual_length", None)
        if isinstance(r, int) and r > 0:
            return float(r), "transformers cache layer residual_length"
    if len(flushes) >= 2:
        gaps = [b - a for a, b in zip(flushes, flushes[1:])]
        return float(sum(gaps) / len(gaps)), "spacing of the flushes in the timed window"
    return None, "unknown (amortized mean spreads the flush over the timed window)"


@dataclass
class Timed:
    """One interleaved timing of named caches (:meth:`Latency._time`): the caches after the
    last step, whether each used the ``LayerCache.attend`` path, prefill times (ms; empty lists
    under ``prefill: shared``), which caches were prefilled from the shared capture, the timed
    steps (ms, round order), their steady/flush split, flush period and its source, each row's
    prompt tokens, the step and prefill threads and the timer's description."""

    caches: dict[str, Cache]
    attend: dict[str, bool]
    prefill: dict[str, list[float]]
    shared_prefill: dict[str, bool]
    times: dict[str, list[float]]
    split: dict[str, FlushSplit]
    period: dict[str, float | None]
    source: dict[str, str]
    lens: list[int]
    step_threads: int
    prefill_threads: int
    timing: str


def prepass_copies(dtype: str) -> tuple[str, str]:
    """The pre-pass's names of the two caches (copies A and B) of the candidate stored in
    ``dtype``: ``("<dtype> A", "<dtype> B")``."""
    return f"{dtype} A", f"{dtype} B"


def prepass_names(dtypes: list[str]) -> dict[str, str]:
    """The pre-pass's caches in interleaving order, name -> candidate dtype: each candidate's
    copies A and B (:func:`prepass_copies`), candidates in ``dtypes`` order
    (``float32 A, float32 B, float16 A, float16 B``)."""
    return {name: dt for dt in dtypes for name in prepass_copies(dt)}


def steady_steps(timed: Timed, name: str) -> list[float]:
    """The timed steps (ms, round order) of cache ``name`` of ``timed`` without its flush
    steps."""
    skip = set(timed.split[name].flush_index)
    return [x for i, x in enumerate(timed.times[name]) if i not in skip]


def attention_path(method: Method, attend: bool) -> str:
    if not method.capabilities.layer_cache:
        return "transformers cache update + sdpa over the dequantized K/V it returns"
    if attend:
        return "kvbench attention fn -> LayerCache.attend (fast path where supported; see attend_path_ran)"
    return "kvbench attention fn -> sdpa over dequantized keys_values() (reference path)"


def built_method(pending: PendingRun) -> Method | None:
    """``pending.method()``, or ``None`` when building it raises (its own run raises it)."""
    try:
        return pending.method()
    except Exception:  # the run of that configuration reports it (runner.execute_run)
        return None


def group_methods(grp: LatencyGroup) -> list[Method | None]:
    """The methods of ``grp``'s pending configurations (:func:`built_method`), built once."""
    if grp.methods is None:
        grp.methods = [built_method(pr) for pr in grp.pending]
    return grp.methods


def interleaving(order: list[str]) -> str:
    """The manifest's ``interleaving``: configurations in ``order`` (the baseline last)."""
    text = (
        f"round i starts at configuration i mod {len(order)} ({', '.join(order)} rotated left by i)"
    )
    if len(order) <= 2:
        return text
    return (
        f"{text}; one run for the group: each round steps the baseline once and each of the "
        f"{len(order) - 1} configurations once, each ratio pairing a configuration's steps "
        "with the same rounds' baseline steps"
    )


@dataclass
class LatencyGroup:
    """Configurations timed in one interleaved run against one baseline (``group`` > 1,
    :meth:`Latency.plan`).  ``tried``: the timing ran (or was given up); ``timed``: its result
    while some member has not collected it; ``members``: key in ``timed`` -> method of the
    members timed and not yet collected; ``labels``: key -> label of every member timed."""

    pending: list[PendingRun]
    #: each pending configuration's method (``None``: building it raised), built on first need
    methods: list[Method | None] | None = None
    tried: bool = False
    timed: Timed | None = None
    members: dict[str, Method] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


class Latency(Workload):
    type = "latency"
    METRICS = {
        "prefill_ms": LOWER,
        "decode_ms_*": LOWER,
        "flush_ms_*": LOWER,
        "flush_steps": NONE,
        "tokens_per_s": HIGHER,
        "bytes_total": LOWER,
    }
    accepts_random_weights = True  # step time does not depend on the weights' values
    #: the prompt's captured K/V under ``prefill: shared`` (``prepare``); ``None``: timed
    prompt: PromptState | None = None
    layer_cache = False  # peers run through their transformers_cache
    PARAMS = {
        "context": 2048,
        "steps": 20,
        "warmup": 3,
        "baseline": BASELINE,
        "path": "auto",
        "text": "essays",
        "window": 0,
        "prefill_repeats": 3,
        "batch_size": 1,
        "padding": "none",
        "threads": 1,
        "prefill": "timed",
        "baseline_storage_dtypes": ["model", "float16"],
        "group": 1,
    }
    LIST_PARAMS = frozenset({"baseline_storage_dtypes"})
    FIELDS = {
        "context": Field(int, low=2),
        "steps": Field(int, low=1),
        "warmup": Field(int, low=0),
        "prefill_repeats": Field(int, low=1),
        "path": Field(str, choices=("attend", "auto", "reference")),
        "batch_size": Field(int, low=1),
        "padding": Field(str, choices=PADDINGS),
        "baseline": Field(str, text="a registered method name"),
        "threads": Field(int, low=1),
        "prefill": Field(str, choices=PREFILLS),
        "baseline_storage_dtypes": Field(str, shape="list", choices=BASELINE_STORAGE),
        "group": Field(int, low=1),
    }

    @classmethod
    def check(cls, spec: dict[str, JSONValue], pre: str) -> None:
        d, n, w = spec["context"], spec["steps"], spec["warmup"]
        if d <= n + w:
            why = "a prefill of at least one token"
            reject(pre, "context", d, f"integers > warmup + steps = {w + n} ({why})")
        if spec["padding"] == "left" and spec["batch_size"] < 2:
            why = "'left' needs batch_size >= 2 (rows of different lengths)"
            reject(pre, "padding", "left", f"'none' with batch_size={spec['batch_size']}; {why}")
        if spec["prefill"] == "shared" and spec["prefill_repeats"] != 1:
            why = "prefill: shared times no prefill"
            reject(pre, "prefill_repeats", spec["prefill_repeats"], f"1 ({why})")
        if spec["prefill"] == "shared" and spec["padding"] == "left":
            why = "a shared prefill captures unpadded rows"
            reject(pre, "prefill", "shared", f"'timed' with padding='left' ({why})")
        if spec["padding"] == "left" and (d - n - w) // 2 < 1:
            why = "a prefill of at least 2 tokens"
            reject(pre, "context", d, f"integers >= {w + n + 2} with padding='left' ({why})")
        from kvbench.cache.registry import get_method, get_method_class

        get_method_class(spec["baseline"])  # unknown name: ValueError with "did you mean"
        for dt in spec["baseline_storage_dtypes"]:
            if dt == "model":
                continue
            try:  # a peer baseline stores K/V in its own dtypes: refused before any work
                get_method(spec["baseline"], storage_dtype=dt)
            except ValueError as exc:
                why = f"['model'] for baseline {spec['baseline']!r} ({exc})"
                reject(pre, "baseline_storage_dtypes", spec["baseline_storage_dtypes"], why)

    def prepare(self, ctx: RunContext) -> None:
        from kvbench.data.loaders import load_text, token_windows

        s = self.spec
        self.check_context(ctx, "context")
        bs = s["batch_size"]
        key = ("latency-ids", s["text"], s["window"], s["context"], bs)
        if key not in ctx.shared.token_ids:
            text, tinfo = load_text(s["text"])
            ids, winfo = token_windows(ctx.tokenizer, text, s["context"], s["window"] + bs)
            ctx.shared.token_ids[key] = (
                ids[s["window"] : s["window"] + bs],
                {"dataset": tinfo, "windows": winfo},
            )
        self.ids, self.info = ctx.shared.token_ids[key]
        self.prompt = None
        if s["prefill"] == "shared":  # the prompt's K/V, captured once for every cache
            from kvbench.hf.capture import capture_prompt

            p = s["context"] - s["steps"] - s["warmup"]
            pkey = ("latency-prompt", s["text"], s["window"], s["context"], bs, p)
            if pkey not in ctx.shared.prompts:
                dev = next(ctx.model.parameters()).device
                ctx.shared.prompts[pkey] = capture_prompt(ctx.model, self.ids[:, :p].to(dev))
            self.prompt = ctx.shared.prompts[pkey]
        self.choose_baseline(ctx)  # the pre-pass, once per key, outside the runs' wall time

    def _attend(self, method: Method) -> bool:
        p = self.spec["path"]
        if p == "auto":  # LayerCache.attend takes the fastest path it supports (recorded)
            return method.capabilities.layer_cache
        return p == "attend"

    def baselines(self, model_dtype: torch.dtype) -> dict[str, Method]:
        """The baseline candidates: the storage dtype each stores its full-precision K/V in
        (``float32``, ``float16``, ...; ``model`` resolved to ``model_dtype``) -> the
        ``baseline`` method with that ``storage_dtype``, in ``baseline_storage_dtypes`` order
        (a dtype named twice once).  ``ValueError`` when the baseline is unavailable or refuses
        the storage dtype."""
        from kvbench.cache.registry import get_method

        s = self.spec
        out: dict[str, Method] = {}
        for name in s["baseline_storage_dtypes"]:
            dtype = str(model_dtype).removeprefix("torch.") if name == "model" else name
            if dtype in out:
                continue
            base = get_method(s["baseline"], storage_dtype=None if name == "model" else name)
            why = base.unavailable_reason()
            if why:
                raise ValueError(f"latency baseline {s['baseline']!r} is unavailable: {why}")
            out[dtype] = base
        return out

    def _pass_key(self) -> tuple[Hashable, ...]:
        """What the pre-pass's choice depends on: the context, the step threads, the baseline
        spec and the rest of the timing protocol (text, rounds, batch, prefill)."""
        s = self.spec
        return (
            "latency-baseline",
            s["context"],
            s["threads"],
            s["baseline"],
            tuple(s["baseline_storage_dtypes"]),
            s["text"],
            s["window"],
            s["steps"],
            s["warmup"],
            s["batch_size"],
            s["padding"],
            s["path"],
            s["prefill"],
            s["prefill_repeats"],
        )

    @torch.no_grad()
    def choose_baseline(self, ctx: RunContext) -> BaselineChoice | None:
        """The pre-pass (docs/design.md#latency): two caches, copies A and B (distinct objects
        of the same state), of each baseline candidate (:meth:`baselines`) interleaved with
        each other, no method, for the workload's ``warmup`` + ``steps`` rounds (names
        :func:`prepass_names`, candidates in order, A before B); the candidate with the smallest
        steady median step over both copies' steady steps (ties: the first listed) is the
        baseline of every configuration of this context and step threads.  The same rounds
        give the noise check: the chosen candidate's copy A against its copy B, the ratio of
        their steady medians (``self_ratio``) with its 95% paired interval
        (:func:`~kvbench.bench.metrics.paired_ratio_ci` over the timed rounds, each copy's
        flush steps left out, seeded with ``ctx.seed``).  Run once per :meth:`_pass_key` and
        kept in ``ctx.shared.latency_baselines``; ``None`` (nothing timed) with a single
        candidate.  ``ValueError`` as :meth:`baselines`."""
        model_dtype = next(ctx.model.parameters()).dtype
        candidates = self.baselines(model_dtype)
        if len(candidates) == 1:
            return None
        key = self._pass_key()
        if key not in ctx.shared.latency_baselines:
            names = prepass_names(list(candidates))
            timed = self._time(ctx, {name: candidates[dt] for name, dt in names.items()})
            steady = {
                dt: summarize(
                    [x for name in prepass_copies(dt) for x in steady_steps(timed, name)]
                ).median
                for dt in candidates
            }
            chosen = min(candidates, key=lambda dt: steady[dt])
            a, b = prepass_copies(chosen)
            sa, sb = timed.split[a], timed.split[b]
            ci = paired_ratio_ci(
                timed.times[a], timed.times[b], sa.flush_index, sb.flush_index, seed=ctx.seed
            )
            ctx.shared.latency_baselines[key] = BaselineChoice(
                chosen,
                steady,
                {dt: timed.times[prepass_copies(dt)[0]] for dt in candidates},
                {dt: timed.times[prepass_copies(dt)[1]] for dt in candidates},
                sa.steady.median / sb.steady.median,
                ci,
                len(timed.times[a]),
            )
        return ctx.shared.latency_baselines[key]

    def _time(
        self,
        ctx: RunContext,
        methods: dict[str, Method],
        dropped: dict[str, Exception] | None = None,
    ) -> Timed:
        """Prefill fresh caches of ``methods`` (name -> method) and time their decode steps
        interleaved (protocol steps 1, 2 and 4 of the module docstring).  ``dropped`` (a
        group, :meth:`_time_group`): a name whose cache cannot be built or prefilled is left out
        of the timing and its exception kept there, not raised; ``None``: it raises."""
        from kvbench.hf.cache import cache_kwarg

        s = self.spec
        model = ctx.model
        dev = next(model.parameters()).device
        timer = Timer(dev)
        ids = self.ids.to(dev)
        d, n, w, reps = s["context"], s["steps"], s["warmup"], s["prefill_repeats"]
        p = d - n - w
        bs, padding = s["batch_size"], s["padding"]
        if ids.shape[0] != bs:
            raise ValueError(f"latency: {ids.shape[0]} text windows for batch_size={bs}")
        lens = row_prompt_lengths(p, bs, padding)
        mask = pos = None
        if padding == "left":
            for m in methods.values():
                require_padding(m)
            rows = [row[p - k :] for row, k in zip(ids, lens)]  # row 0 keeps all d tokens
            ids, mask, pos = left_pad(rows, pad_id(model, ctx.tokenizer), dev)
        attend = {k: self._attend(m) for k, m in methods.items()}
        names = list(methods)
        caches: dict[str, Cache] = {}
        kw: dict[str, dict[str, object]] = {}

        def fresh(name: str) -> None:
            caches[name] = make_hf_cache(methods[name], model, attend=attend[name])
            kw[name] = cache_kwarg(caches[name], model)
            if "logits_to_keep" in inspect.signature(model.forward).parameters:
                kw[name]["logits_to_keep"] = 1  # logits of the last position only, as generate()

        def call(name: str, sl: slice) -> object:  # the model's output (timed, not read)
            if mask is None:
                return model(input_ids=ids[:, sl], use_cache=True, **kw[name])
            return model(
                input_ids=ids[:, sl],
                attention_mask=mask[:, : sl.stop],
                position_ids=pos[:, sl],
                use_cache=True,
                **kw[name],
            )

        prefill: dict[str, list[float]] = {k: [] for k in names}
        shared_prefill: dict[str, bool] = {}

        def timed_prefill(name: str) -> None:  # one round of `prefill: timed`, a fresh cache
            fresh(name)
            prefill[name].append(timer(lambda: call(name, slice(0, p))))

        def untimed_prefill(name: str) -> None:  # from the shared capture, else the model
            fresh(name)
            c = caches[name]
            shared_prefill[name] = (
                isinstance(c, QuantizedKVCache) and prefill_attention(methods[name]) == "full"
            )
            if shared_prefill[name]:
                c.prefill_from(self.prompt.captured)
            elif not isinstance(c, QuantizedKVCache):  # a peer: replay, else the model
                shared_prefill[name] = replay_prefill(c, self.prompt.captured)
                if not shared_prefill[name]:
                    fresh(name)
                    call(name, slice(0, p))
            else:  # prefill_attention: stored
                stored_prompt(c, lambda: call(name, slice(0, p)))

        def attempt(fn: Callable[[str], None], name: str) -> None:
            if dropped is None:
                fn(name)
                return
            if name in dropped:
                return
            try:
                fn(name)
            except Exception as exc:  # a group member: left out; its own run raises it alone
                dropped[name] = exc
                caches.pop(name, None)

        if self.prompt is None:
            # `prefill_repeats` timed rounds, each on fresh caches, rotating which goes first;
            # the last round's caches decode
            for r in range(reps):
                for name in rotation(names, r):
                    attempt(timed_prefill, name)
        else:
            for name in names:
                attempt(untimed_prefill, name)
        if dropped:
            names = [k for k in names if k not in dropped]
            prefill = {k: prefill[k] for k in names}
            attend = {k: attend[k] for k in names}

        held: dict[str, list[int | None]] = {k: [] for k in names}
        quant: dict[str, list[tuple[int, int] | None]] = {k: [] for k in names}

        def observe(name: str, i: int, ms: float | None) -> None:
            if i >= w - 1:  # the state before the first timed step, then after each one
                held[name].append(held_bytes(caches[name]))
                quant[name].append(quantized_tokens_of(caches[name]))

        done = dict.fromkeys(names, 0)  # decode steps each cache has run

        def stepper(k: str) -> Callable[[], None]:
            def fn() -> None:
                call(k, slice(p + done[k], p + done[k] + 1))
                done[k] += 1

            return fn

        if w == 0:  # the state before the first timed step
            for k in names:
                observe(k, w - 1, None)
        prefill_threads = torch.get_num_threads()
        with pin_threads(s["threads"]) as step_threads:
            times = interleave({k: stepper(k) for k in names}, n, w, timer, after=observe)
        split, period, source = {}, {}, {}
        for k in names:
            hb = held[k]
            flushes = flush_steps(hb) if all(x is not None for x in hb) else []
            period[k], source[k] = flush_period(caches[k], quant[k], flushes)
            split[k] = split_steps(times[k], flushes, period[k])
        return Timed(
            caches,
            attend,
            prefill,
            shared_prefill,
            times,
            split,
            period,
            source,
            lens,
            step_threads,
            prefill_threads,
            timer.how,
        )

    def __init__(self, spec: dict[str, JSONValue]) -> None:
        super().__init__(spec)
        #: groups of pending configurations timed together (:meth:`plan`; none: each alone)
        self.groups: list[LatencyGroup] = []

    def plan(self, pending: list[PendingRun]) -> None:
        """Split the pending configurations, in order, into groups of ``group`` (the last may
        be smaller); each group of two or more is timed together against one baseline on the
        first ``run`` of one of its members (:meth:`_time_group`).  ``group: 1`` groups none."""
        g = self.spec["group"]
        chunks = [pending[i : i + g] for i in range(0, len(pending), g)] if g > 1 else []
        self.groups = [LatencyGroup(c) for c in chunks if len(c) > 1]

    def _time_group(self, ctx: RunContext, grp: LatencyGroup, base: Method) -> None:
        """Time the configurations of ``grp`` and ``base`` (the chosen baseline) interleaved
        in one run (:meth:`_time`: every round steps each cache once, the order rotated per
        round) and keep the result in ``grp`` until each member's ``run`` collects it.  A
        member whose method cannot be built, refuses the padding, or whose cache cannot be
        built or prefilled is left out (its own ``run`` then times it alone and raises its own
        error); if the timing itself fails, or fewer than two members are left, none is kept
        and each ``run`` times its configuration alone."""
        grp.tried = True
        methods: dict[str, Method] = {}
        labels: dict[str, str] = {}
        for j, (pr, m) in enumerate(zip(grp.pending, group_methods(grp))):
            if m is None:
                continue
            if self.spec["padding"] == "left":
                try:
                    require_padding(m)
                except ValueError:
                    continue
            methods[f"m{j}"], labels[f"m{j}"] = m, pr.label
        if len(methods) < 2:
            return
        dropped: dict[str, Exception] = {}
        try:
            timed = self._time(ctx, {**methods, "baseline": base}, dropped)
        except Exception:  # each member times alone; the failing one raises its own error
            return
        kept = [k for k in methods if k not in dropped]
        if "baseline" in dropped or len(kept) < 2:
            return
        grp.timed = timed
        grp.members = {k: methods[k] for k in kept}
        grp.labels = {k: labels[k] for k in kept}

    def _grouped(
        self, ctx: RunContext, method: Method, base: Method
    ) -> tuple[Timed, str, list[str], list[str]] | None:
        """``method``'s share of its group's timing (:meth:`plan`, :meth:`_time_group`, timed
        on the first call for one of its members): the group's :class:`Timed`, ``method``'s
        key in it, the labels of the others timed with it, and the labels in interleaving order
        (``baseline`` last); ``None`` when ``method`` is in no group or was left out of its
        group's timing (then it is timed alone)."""
        for grp in self.groups:
            if not any(m is method for m in group_methods(grp)):
                continue
            if not grp.tried:
                self._time_group(ctx, grp, base)
            key = next((k for k, m in grp.members.items() if m is method), None)
            if key is None or grp.timed is None:
                return None
            timed = grp.timed
            order = [grp.labels[k] for k in timed.times if k != "baseline"] + ["baseline"]
            others = [grp.labels[k] for k in timed.times if k not in (key, "baseline")]
            del grp.members[key]  # collected: the group lets go of it after this run
            if not grp.members:
                grp.timed = None
            return timed, key, others, order
        return None

    @torch.no_grad()
    def run(self, ctx: RunContext, method: Method) -> Result:
        s = self.spec
        d, n, w, reps = s["context"], s["steps"], s["warmup"], s["prefill_repeats"]
        p = d - n - w
        bs, padding = s["batch_size"], s["padding"]
        dev = next(ctx.model.parameters()).device
        model_dtype = next(ctx.model.parameters()).dtype
        candidates = self.baselines(model_dtype)
        choice = self.choose_baseline(ctx)  # the pre-pass (once per key; None: one candidate)
        chosen = next(iter(candidates)) if choice is None else choice.storage_dtype
        base = candidates[chosen]
        grouped = self._grouped(ctx, method, base)
        if grouped is None:
            # two caches, the method's and the chosen baseline's, interleaved round by round
            key, others = "method", []
            names = order = ["method", "baseline"]
            timed = self._time(ctx, {"method": method, "baseline": base})
        else:  # timed in one run with the other configurations of its group
            timed, key, others, order = grouped
            names = [key, "baseline"]
        caches, attend, split, times = timed.caches, timed.attend, timed.split, timed.times
        prefill, lens = timed.prefill, timed.lens
        mine, ref = split[key].metrics(), split["baseline"].metrics()
        metrics: dict[str, float] = {}
        if self.prompt is None:
            pm, pb = summarize(prefill[key]), summarize(prefill["baseline"])
            metrics["prefill_ms"] = pm.median
        metrics.update(mine)
        metrics["tokens_per_s"] = bs * 1000.0 / mine["decode_ms_amortized"]
        if self.prompt is None:
            metrics["prefill_ms_ratio"] = pm.median / pb.median if pb.median else float("nan")
        for k in ("decode_ms_p50", "decode_ms_p90", "decode_ms_p99", "decode_ms_mean"):
            metrics[f"{k}_ratio"] = mine[k] / ref[k] if ref[k] else float("nan")
        am, ab = mine["decode_ms_amortized"], ref["decode_ms_amortized"]
        metrics["decode_ms_amortized_ratio"] = am / ab if ab else float("nan")
        metrics["tokens_per_s_ratio"] = ab / am if am else float("nan")
        ci = paired_ratio_ci(
            times[key],
            times["baseline"],
            split[key].flush_index,
            split["baseline"].flush_index,
            seed=ctx.seed,
        )
        if ci is not None:
            metrics["decode_ms_p50_ratio_ci_low"], metrics["decode_ms_p50_ratio_ci_high"] = ci
        mc = caches[key]
        lcs = mc.layer_caches() if isinstance(mc, QuantizedKVCache) else []
        # a LayerCache gets ``attend_path`` from its first decode attention (none before)
        ran = sorted({str(getattr(lc, "attend_path", None)) for lc in lcs if lc is not None})
        nb = cache_nbytes(caches[key])
        if nb:
            metrics["bytes_total"] = nb["total"]
        batch = {
            "batch_size": bs,
            "padding": padding,
            "row_prompt_tokens": lens,
            "pad_tokens": sum(p - k for k in lens),
            "pad_tokens_stored": stored_pad_tokens(caches[key], lens, p),
            "row_context_tokens": [d - (p - k) for k in lens],
        }
        self_iv = None if choice is None else choice.self_interval
        if choice is None:
            how = f"the only candidate of its storage dtypes: {chosen}"
        else:
            how = (
                f"the faster (smallest steady median step) of its storage dtypes "
                f"{', '.join(candidates)}, chosen by a pre-pass that timed two caches of each "
                f"interleaved for the same rounds, once per context and step threads: {chosen}"
            )
        info = {
            **self.info,
            "batch": batch,
            **system_state(),
            "step_threads": timed.step_threads,
            "prefill_threads": timed.prefill_threads,
            "timing": timed.timing,
            "percentiles": PERCENTILE_RULE,
            "attention_path": attention_path(method, attend[key]),
            # the decode protocol (docs/design.md#protocols): the same work either way, a flush
            # before or after the step's attention; a peer runs its own update
            "protocol": cache_protocol(caches[key]),
            "baseline_protocol": cache_protocol(caches["baseline"]),
            "attend_path_ran": ran if attend[key] else None,
            "baseline": s["baseline"],
            "baseline_storage_dtype": chosen,
            "baseline_candidates": None if choice is None else dict(choice.medians),
            # the noise check: the chosen baseline's two pre-pass caches, A vs B (None: no
            # pre-pass with one candidate)
            "baseline_self_ratio": None if choice is None else choice.self_ratio,
            "baseline_self_interval": None if self_iv is None else list(self_iv),
            "baseline_self_rounds": None if choice is None else choice.self_rounds,
            "baseline_attention_path": attention_path(base, attend["baseline"]),
            "interleaving": interleaving(order),
            "ratio_baseline": f"{s['baseline']} interleaved in this run, {how}",
            "ratio_interval": RATIO_INTERVAL,
            "prefill": PREFILL_NOTE[s["prefill"]],
            "prefill_tokens": p,
            "prefill_repeats": reps if self.prompt is None else 0,
            "window": STEADY_NOTE,
            "flush_index": list(split[key].flush_index),
            "flush_period": timed.period[key],
            "flush_period_source": timed.source[key],
            "baseline_flush_index": list(split["baseline"].flush_index),
            "cuda_graphs": False,
            "model_dtype": str(model_dtype).removeprefix("torch."),
            **{f"baseline_{k}": v for k, v in ref.items()},
        }
        if others:  # timed in one run with its group (docs/design.md#latency)
            info["group_size"] = len(others) + 1
            info["timed_with"] = others
        if self.prompt is None:
            info["baseline_prefill_ms"] = pb.median
        else:
            info["prefill_from_capture"] = {
                k: timed.shared_prefill[name] for k, name in zip(("method", "baseline"), names)
            }
        if dev.type != "cuda":
            info["timing_note"] = CPU_NOTE
        per: dict[str, list[float]] = {
            "decode_ms": times[key],
            "baseline_decode_ms": times["baseline"],
        }
        if choice is not None:  # the pre-pass's steps, shared by every record of its key
            per.update({f"prepass_decode_ms_{dt}": v for dt, v in choice.steps_ms.items()})
            per.update({f"prepass_decode_ms_{dt}_b": v for dt, v in choice.steps_ms_b.items()})
        if self.prompt is None:
            per["prefill_ms"] = prefill[key]
            per["baseline_prefill_ms"] = prefill["baseline"]
        if grouped is not None:  # the group lets go of this configuration's cache
            del timed.caches[key]
        return Result(metrics, per, info)
