"""``latency``: prefill time and per-step decode latency at context depth d, interleaved with a
baseline in the same call, timed by :mod:`kvbench.measure.timer`; protocol, clocks and the CPU
caveat: docs/design.md#latency.

Protocol.  Token ids of ``text`` (a fixed window) are fed to the real model with two caches: the
method's (``make_hf_cache(method, model)``: kvbench's ``QuantizedKVCache``, or a peer's
transformers cache) and the ``baseline``'s (default ``full``).

1. Prefill ``P = d - warmup - steps`` tokens, ``prefill_repeats`` times (default 3), each time
   into fresh caches of both, rotating which goes first (A B, B A, ...); ``prefill_ms`` is the
   median and ``prefill_ms_ratio`` the ratio of the two medians (not one sample).  The last
   round's caches decode, so the last timed step attends to exactly d tokens (the model's
   maximum context is the largest allowed d).
2. ``warmup`` single-token steps (untimed), then ``steps`` timed single-token steps, by
   :func:`kvbench.measure.timer.interleave`: every round times one step of each cache,
   alternating which goes first.  Inputs are the text's next tokens (teacher forcing),
   identical for both caches, so the two runs do the same work.
3. Flushes (:mod:`kvbench.measure.window`): a step after which the cache holds fewer bytes
   than before is a flush step (a bulk quantization of the residual, e.g. KIVI's keys every R
   steps); steady-state and flush steps are reported separately.

Metrics: ``prefill_ms``; ``decode_ms_p50``/``_p90``/``_p99``/``_mean`` over the steady-state
steps (percentiles by :data:`kvbench.measure.timer.PERCENTILE_RULE`); ``flush_steps`` (count in
the window), ``flush_ms_mean``/``flush_ms_max`` (when a flush was timed);
``decode_ms_amortized`` = steady mean + (flush mean - steady mean) / period, the cost per token
of a long decode, with the period (steps between flushes) from the tokens one flush quantized
(recorded with its source); ``tokens_per_s`` = B * 1000 / ``decode_ms_amortized`` (B rows).  Each has a
``*_ratio`` against the interleaved baseline of this same call (``tokens_per_s_ratio`` =
baseline ms / method ms; the runner keeps these).  ``decode_ms_p50_ratio`` has a 95% interval,
``decode_ms_p50_ratio_ci_low``/``_ci_high``: a paired percentile bootstrap over the timed rounds
(:func:`kvbench.bench.metrics.paired_ratio_ci`): each resample draws the rounds with
replacement, the same rounds for the method and the baseline (so drift of the machine from round
to round, which moves both steps of a round, cancels), and takes the ratio of the two medians
over the drawn steady-state steps; seeded with the suite's seed, so the record is reproducible
from its timings; absent with fewer than two steady steps a side (rule recorded in
``info.ratio_interval``).  ``bytes_total`` of the method's cache at the end.  Raw samples are
in ``per_layer`` (``decode_ms``, ``baseline_decode_ms``, ``prefill_ms``,
``baseline_prefill_ms``); ``info.flush_index`` lists the flush steps.

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
``baseline`` (a method name, ``full``), ``path`` (``auto`` | ``reference`` | ``attend``),
``text`` (``essays``), ``window`` (0), ``batch_size`` (1), ``padding`` (``none`` | ``left``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvbench.bench.batching import left_pad, pad_id, stored_pad_tokens
from kvbench.bench.context import RunContext
from kvbench.bench.metrics import RATIO_RESAMPLES, paired_ratio_ci
from kvbench.bench.workloads import HIGHER, LOWER, NONE
from kvbench.cache.method import Method, require_padding
from kvbench.cache.registry import BASELINE
from kvbench.fields import Field
from kvbench.hf.cache import QuantizedKVCache, cache_protocol, make_hf_cache
from kvbench.hf.peers import cache_nbytes
from kvbench.jsontypes import JSONValue
from kvbench.measure.timer import (
    PERCENTILE_RULE,
    Timer,
    interleave,
    rotation,
    summarize,
    system_state,
)
from kvbench.measure.window import flush_steps, split_steps

from . import Result, Workload, reject

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

CPU_NOTE = (
    "CPU timing: dominated by framework overhead and dequantization (Python, small kernels, "
    "unpacking), not by memory bandwidth; do not read it as GPU decode speed"
)


PADDINGS = ("none", "left")


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

STEADY_NOTE = (
    "steady-state steps and flush steps (held bytes fell) reported separately; "
    "decode_ms_amortized spreads the flush over its period"
)


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


def attention_path(method: Method, attend: bool) -> str:
    if not method.capabilities.layer_cache:
        return "transformers cache update + sdpa over the dequantized K/V it returns"
    if attend:
        return "kvbench attention fn -> LayerCache.attend (fast path where supported; see attend_path_ran)"
    return "kvbench attention fn -> sdpa over dequantized keys_values() (reference path)"


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
    }
    FIELDS = {
        "context": Field(int, low=2),
        "steps": Field(int, low=1),
        "warmup": Field(int, low=0),
        "prefill_repeats": Field(int, low=1),
        "path": Field(str, choices=("attend", "auto", "reference")),
        "batch_size": Field(int, low=1),
        "padding": Field(str, choices=PADDINGS),
        "baseline": Field(str, text="a registered method name"),
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
        if spec["padding"] == "left" and (d - n - w) // 2 < 1:
            why = "a prefill of at least 2 tokens"
            reject(pre, "context", d, f"integers >= {w + n + 2} with padding='left' ({why})")
        from kvbench.cache.registry import get_method_class

        get_method_class(spec["baseline"])  # unknown name: ValueError with "did you mean"

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

    def _attend(self, method: Method) -> bool:
        p = self.spec["path"]
        if p == "auto":  # LayerCache.attend takes the fastest path it supports (recorded)
            return method.capabilities.layer_cache
        return p == "attend"

    @torch.no_grad()
    def run(self, ctx: RunContext, method: Method) -> Result:
        from kvbench.cache.registry import get_method
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
        base = get_method(s["baseline"])
        why = base.unavailable_reason()
        if why:
            raise ValueError(f"latency baseline {s['baseline']!r} is unavailable: {why}")
        lens = row_prompt_lengths(p, bs, padding)
        mask = pos = None
        if padding == "left":
            for m in (method, base):
                require_padding(m)
            rows = [row[p - k :] for row, k in zip(ids, lens)]  # row 0 keeps all d tokens
            ids, mask, pos = left_pad(rows, pad_id(model, ctx.tokenizer), dev)
        methods = {"method": method, "baseline": base}
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

        # prefill: `prefill_repeats` rounds, each on fresh caches, rotating which goes first;
        # the last round's caches decode
        prefill: dict[str, list[float]] = {k: [] for k in names}
        for r in range(reps):
            for name in rotation(names, r):
                fresh(name)
                prefill[name].append(timer(lambda name=name: call(name, slice(0, p))))

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
        times = interleave({k: stepper(k) for k in names}, n, w, timer, after=observe)
        split, period, source = {}, {}, {}
        for k in names:
            hb = held[k]
            flushes = flush_steps(hb) if all(x is not None for x in hb) else []
            period[k], source[k] = flush_period(caches[k], quant[k], flushes)
            split[k] = split_steps(times[k], flushes, period[k])
        mine, ref = split["method"].metrics(), split["baseline"].metrics()
        pm, pb = summarize(prefill["method"]), summarize(prefill["baseline"])
        metrics: dict[str, float] = {"prefill_ms": pm.median, **mine}
        metrics["tokens_per_s"] = bs * 1000.0 / mine["decode_ms_amortized"]
        metrics["prefill_ms_ratio"] = pm.median / pb.median if pb.median else float("nan")
        for k in ("decode_ms_p50", "decode_ms_p90", "decode_ms_p99", "decode_ms_mean"):
            metrics[f"{k}_ratio"] = mine[k] / ref[k] if ref[k] else float("nan")
        am, ab = mine["decode_ms_amortized"], ref["decode_ms_amortized"]
        metrics["decode_ms_amortized_ratio"] = am / ab if ab else float("nan")
        metrics["tokens_per_s_ratio"] = ab / am if am else float("nan")
        ci = paired_ratio_ci(
            times["method"],
            times["baseline"],
            split["method"].flush_index,
            split["baseline"].flush_index,
            seed=ctx.seed,
        )
        if ci is not None:
            metrics["decode_ms_p50_ratio_ci_low"], metrics["decode_ms_p50_ratio_ci_high"] = ci
        mc = caches["method"]
        lcs = mc.layer_caches() if isinstance(mc, QuantizedKVCache) else []
        # a LayerCache gets ``attend_path`` from its first decode attention (none before)
        ran = sorted({str(getattr(lc, "attend_path", None)) for lc in lcs if lc is not None})
        nb = cache_nbytes(caches["method"])
        if nb:
            metrics["bytes_total"] = nb["total"]
        batch = {
            "batch_size": bs,
            "padding": padding,
            "row_prompt_tokens": lens,
            "pad_tokens": sum(p - k for k in lens),
            "pad_tokens_stored": stored_pad_tokens(caches["method"], lens, p),
            "row_context_tokens": [d - (p - k) for k in lens],
        }
        info = {
            **self.info,
            "batch": batch,
            **system_state(),
            "timing": timer.how,
            "percentiles": PERCENTILE_RULE,
            "attention_path": attention_path(method, attend["method"]),
            # the decode protocol (docs/design.md#protocols): the same work either way, a flush
            # before or after the step's attention; a peer runs its own update
            "protocol": cache_protocol(caches["method"]),
            "baseline_protocol": cache_protocol(caches["baseline"]),
            "attend_path_ran": ran if attend["method"] else None,
            "baseline": s["baseline"],
            "baseline_attention_path": attention_path(base, attend["baseline"]),
            "interleaving": "round i starts at configuration i mod 2 (A B, B A, ...)",
            "ratio_baseline": f"{s['baseline']} interleaved in this run",
            "ratio_interval": RATIO_INTERVAL,
            "prefill_tokens": p,
            "prefill_repeats": reps,
            "window": STEADY_NOTE,
            "flush_index": list(split["method"].flush_index),
            "flush_period": period["method"],
            "flush_period_source": source["method"],
            "baseline_flush_index": list(split["baseline"].flush_index),
            "cuda_graphs": False,
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "baseline_prefill_ms": pb.median,
            **{f"baseline_{k}": v for k, v in ref.items()},
        }
        if dev.type != "cuda":
            info["timing_note"] = CPU_NOTE
        per = {
            "decode_ms": times["method"],
            "baseline_decode_ms": times["baseline"],
            "prefill_ms": prefill["method"],
            "baseline_prefill_ms": prefill["baseline"],
        }
        return Result(metrics, per, info)
