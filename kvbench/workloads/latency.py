"""``latency``: prefill time and per-step decode latency at context depth d, interleaved with a
baseline in the same call (design.md §6).

Protocol.  Token ids of ``text`` (a fixed window) are fed to the real model with two caches: the
method's (``make_hf_cache(method, model)``: kvbench's ``QuantizedKVCache``, or a peer's
transformers cache) and the ``baseline``'s (default ``full``), built fresh for this run.

1. Prefill ``P = d - warmup - steps`` tokens into each cache (timed: ``prefill_ms``), so the last
   timed step attends to exactly ``context`` = d tokens (the model's maximum context is the
   largest allowed d).
2. ``warmup`` single-token steps (untimed), then ``steps`` timed single-token steps.  Inputs are
   the text's next tokens (teacher forcing), identical for both caches, so the two runs do the
   same work and neither depends on the other's outputs.
3. Interleaving: every round times one step of each cache, alternating which goes first
   (A B, B A, A B, ...), so drift of a busy machine hits both alike.

Metrics: ``prefill_ms``, ``decode_ms_p50``/``_p90``/``_p99`` (linear-interpolated percentiles of
the timed steps), ``decode_ms_mean``, ``tokens_per_s`` (1000 / mean step ms), each with a
``*_ratio`` against the interleaved baseline of this same call (the runner keeps these, it does
not replace them with ratios to a separately run ``full`` record), and ``bytes_total`` of the
method's cache at the end.  Raw step times are in ``per_layer`` (``decode_ms``,
``baseline_decode_ms``).

Timing.  CPU: ``time.perf_counter_ns`` around each ``model(...)`` call, at the thread count
``torch.get_num_threads()`` (recorded).  CUDA: CUDA events around each call after the warm-up,
synchronized, eager mode; ``cuda_graphs`` is recorded as false (no graph capture: a growing
cache changes shapes every step).  On CPU the numbers are dominated by framework overhead and
dequantization (Python, small kernels, unpacking), not by memory bandwidth; the manifest and the
report say so.  A flush that happens every R steps (KIVI's keys, quanto's re-quantization) is in
the timed window only if the window spans it: it shows in ``decode_ms_p99`` and the mean, not in
the median.

Attention path (recorded): kvbench methods run through the ``"kvbench"`` attention function,
which reads the dequantized K/V of ``keys_values()`` with sdpa (the reference path), or
``LayerCache.attend`` (``path: attend``, and ``auto`` for methods with a fused kernel or without
``keys_values``); peers run transformers' cache ``update`` then sdpa over the K/V it returns.

Parameters: ``context`` (d, 2048), ``steps`` (20), ``warmup`` (3), ``baseline`` (a method name,
``full``), ``path`` (``auto`` | ``reference`` | ``attend``), ``text`` (``essays``), ``window``
(0).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from kvbench.hf.cache import make_hf_cache
from kvbench.hf.peers import cache_nbytes
from kvbench.kv.method import Method

from . import Result, Workload

CPU_NOTE = (
    "CPU timing: dominated by framework overhead and dequantization (Python, small kernels, "
    "unpacking), not by memory bandwidth; do not read it as GPU decode speed"
)


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of ``xs`` (numpy's default)."""
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(ms: list[float]) -> dict[str, float]:
    """p50/p90/p99/mean of step times in ms, and tokens/s = 1000 / mean."""
    mean = sum(ms) / len(ms)
    return {
        "decode_ms_p50": percentile(ms, 50),
        "decode_ms_p90": percentile(ms, 90),
        "decode_ms_p99": percentile(ms, 99),
        "decode_ms_mean": mean,
        "tokens_per_s": 1000.0 / mean if mean > 0 else float("inf"),
    }


class _Timer:
    """Milliseconds of one call: CUDA events on a CUDA device, ``perf_counter_ns`` otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    @property
    def how(self) -> str:
        return "cuda events (synchronized)" if self.cuda else "time.perf_counter_ns"

    def __call__(self, fn: Any) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return float(start.elapsed_time(end))
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e6


def attention_path(method: Method, attend: bool) -> str:
    if not method.capabilities.layer_cache:
        return "transformers cache update + sdpa over the dequantized K/V it returns"
    if attend:
        return "kvbench attention fn -> LayerCache.attend (fast path where supported; see attend_path_ran)"
    return "kvbench attention fn -> sdpa over dequantized keys_values() (reference path)"


class Latency(Workload):
    type = "latency"
    accepts_random_weights = True  # step time does not depend on the weights' values
    layer_cache = False  # peers run through their transformers_cache
    PARAMS = {
        "context": 2048,
        "steps": 20,
        "warmup": 3,
        "baseline": "full",
        "path": "auto",
        "text": "essays",
        "window": 0,
    }

    @classmethod
    def check(cls, spec: dict[str, Any], pre: str) -> None:
        d, n, w = spec["context"], spec["steps"], spec["warmup"]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (d, n, w)):
            raise ValueError(f"{pre}context, steps and warmup must be integers")
        if n < 1 or w < 0 or d <= n + w:
            raise ValueError(
                f"{pre}need steps >= 1, warmup >= 0 and context > warmup + steps (a prefill of "
                f"at least one token); got context={d}, warmup={w}, steps={n}"
            )
        if spec["path"] not in ("auto", "reference", "attend"):
            raise ValueError(
                f"{pre}path={spec['path']!r} is not allowed; allowed: "
                "['attend', 'auto', 'reference']"
            )
        if not isinstance(spec["baseline"], str):
            raise ValueError(f"{pre}baseline must be a registered method name")
        from kvbench.kv.registry import get_method_class

        get_method_class(spec["baseline"])  # unknown name: ValueError with "did you mean"

    def prepare(self, ctx: Any) -> None:
        from kvbench.data.loaders import load_text, token_windows

        s = self.spec
        max_pos = ctx.model_info.get("max_position_embeddings") or 1 << 30
        if s["context"] > max_pos:
            raise ValueError(
                f"context={s['context']} exceeds the model's maximum context {max_pos} "
                f"(max_position_embeddings of {ctx.model_info.get('model_id', 'the model')})"
            )
        key = ("latency-ids", s["text"], s["window"], s["context"])
        if key not in ctx.shared:
            text, tinfo = load_text(s["text"])
            ids, winfo = token_windows(ctx.tokenizer, text, s["context"], s["window"] + 1)
            ctx.shared[key] = (
                ids[s["window"] : s["window"] + 1],
                {"dataset": tinfo, "windows": winfo},
            )
        self.ids, self.info = ctx.shared[key]

    def _attend(self, method: Method) -> bool:
        p = self.spec["path"]
        if p == "auto":  # LayerCache.attend takes the fastest path it supports (recorded)
            return method.capabilities.layer_cache
        return p == "attend"

    @torch.no_grad()
    def run(self, ctx: Any, method: Method) -> Result:
        from kvbench.hf.cache import cache_kwarg
        from kvbench.kv.registry import get_method

        s = self.spec
        model = ctx.model
        dev = next(model.parameters()).device
        timer = _Timer(dev)
        ids = self.ids.to(dev)
        d, n, w = s["context"], s["steps"], s["warmup"]
        p = d - n - w
        base = get_method(s["baseline"])
        why = base.unavailable_reason()
        if why:
            raise ValueError(f"latency baseline {s['baseline']!r} is unavailable: {why}")
        attend = self._attend(method)
        caches = {
            "method": make_hf_cache(method, model, attend=attend),
            "baseline": make_hf_cache(base, model, attend=self._attend(base)),
        }
        kw = {name: cache_kwarg(c, model) for name, c in caches.items()}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            for k in kw.values():  # logits of the last position only, as in generate()
                k["logits_to_keep"] = 1

        def call(name: str, sl: slice) -> Any:
            return lambda: model(input_ids=ids[:, sl], use_cache=True, **kw[name])

        prefill = {name: timer(call(name, slice(0, p))) for name in ("method", "baseline")}
        times: dict[str, list[float]] = {"method": [], "baseline": []}
        for i in range(w + n):
            order = ("method", "baseline") if i % 2 == 0 else ("baseline", "method")
            for name in order:
                ms = timer(call(name, slice(p + i, p + i + 1)))
                if i >= w:
                    times[name].append(ms)
        mine, ref = summarize(times["method"]), summarize(times["baseline"])
        metrics = {"prefill_ms": prefill["method"], **mine}
        metrics["prefill_ms_ratio"] = prefill["method"] / prefill["baseline"]
        for k, v in mine.items():
            metrics[f"{k}_ratio"] = v / ref[k] if ref[k] else float("nan")
        lcs = getattr(caches["method"], "layer_caches", lambda: [])()
        ran = sorted({str(getattr(lc, "attend_path", None)) for lc in lcs if lc is not None})
        nb = cache_nbytes(caches["method"])
        if nb:
            metrics["bytes_total"] = nb["total"]
        info = {
            **self.info,
            "timing": timer.how,
            "threads": torch.get_num_threads(),
            "attention_path": attention_path(method, attend),
            "attend_path_ran": ran if attend else None,
            "baseline": s["baseline"],
            "baseline_attention_path": attention_path(base, self._attend(base)),
            "interleaving": "per round, one step of each cache, alternating which goes first",
            "ratio_baseline": f"{s['baseline']} interleaved in this run",
            "prefill_tokens": p,
            "cuda_graphs": False,
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "baseline_prefill_ms": prefill["baseline"],
            **{f"baseline_{k}": v for k, v in ref.items()},
        }
        if dev.type != "cuda":
            info["timing_note"] = CPU_NOTE
        per = {"decode_ms": times["method"], "baseline_decode_ms": times["baseline"]}
        return Result(metrics, per, info)
