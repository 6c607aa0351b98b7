"""Flush-aware decode timing: steady-state steps and flush steps, reported separately.

Many caches keep recent tokens in full precision and quantize them in bulk every so many steps
(KIVI's keys: a residual of R tokens becomes one quantized page every R steps, arXiv:2402.02750
Algorithm 1; transformers' ``QuantizedCache`` re-quantizes every ``residual_length`` steps).  A
short timed window holds 0 or 1 such step depending only on where it starts, so its mean, p99
and tokens/s say more about the window's position than about the method.  kvbench therefore
**splits** the timed steps instead of lengthening the window to whole flush periods (which at
R = 128 would be 128+ model steps per configuration and context):

* a **flush step** is one after which the cache holds fewer bytes than before it (a bulk
  quantization replaces full-precision tokens by codes; an ordinary step only adds a token, and
  a sliding per-token flush such as KIVI's values adds its codes and keeps the size growing), a
  rule that reads measured bytes and knows no method by name (:func:`flush_steps`);
* the **steady-state** statistics (median, p90, p99, mean) are over the other steps;
* flush steps get their own count and mean, and the **amortized** mean per token is
  ``steady_mean + (flush_mean - steady_mean) / period`` with ``period`` the number of steps
  between flushes in steady state (tokens quantized by one flush / tokens added per step), the
  cost per token a long decode sees.  Without a flush in the window it equals the steady mean
  and ``flush_ms_mean`` is absent (unknown, not zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbench.measure.timer import Stats, summarize


def flush_steps(held_bytes: Sequence[int]) -> list[int]:
    """Indices ``i`` of the steps after which the cache held fewer bytes than before.

    ``held_bytes[0]`` is the size before the first step, ``held_bytes[i + 1]`` after step
    ``i`` (so ``len(held_bytes)`` = steps + 1).
    """
    return [i for i in range(len(held_bytes) - 1) if held_bytes[i + 1] < held_bytes[i]]


@dataclass(frozen=True)
class FlushSplit:
    """Steady-state and flush steps of one timed window (ms)."""

    steady: Stats
    flush: Stats | None
    flush_index: tuple[int, ...]
    period: float | None
    amortized_mean: float

    def metrics(self, prefix: str = "decode_ms") -> dict[str, float]:
        """``{prefix}_p50/_p90/_p99/_mean`` (steady state), ``{prefix}_amortized``,
        ``flush_steps`` and, if any, ``flush_ms_mean``/``flush_ms_max``."""
        s = self.steady
        out = {
            f"{prefix}_p50": s.median,
            f"{prefix}_p90": s.p90,
            f"{prefix}_p99": s.p99,
            f"{prefix}_mean": s.mean,
            f"{prefix}_amortized": self.amortized_mean,
            "flush_steps": float(len(self.flush_index)),
        }
        if self.flush is not None:
            out["flush_ms_mean"] = self.flush.mean
            out["flush_ms_max"] = self.flush.max
        return out


def split_steps(
    ms: Sequence[float], flush_index: Sequence[int], period: float | None = None
) -> FlushSplit:
    """Split step times ``ms`` at ``flush_index`` (from :func:`flush_steps`).

    ``period``: steps between flushes in steady state (``None``: unknown; then the amortized
    mean is the steady mean plus the flush excess spread over the window, a lower bound only if
    the window spans at least one period).  ``ValueError`` if every step is a flush step or an
    index is out of range.
    """
    idx = sorted(set(flush_index))
    if idx and (idx[0] < 0 or idx[-1] >= len(ms)):
        raise ValueError(f"flush index {idx} out of range for {len(ms)} steps")
    steady = [x for i, x in enumerate(ms) if i not in set(idx)]
    if not steady:
        raise ValueError("every timed step flushed: no steady-state steps to report")
    st = summarize(steady)
    fl = summarize([ms[i] for i in idx]) if idx else None
    if fl is None:
        amortized = st.mean
    else:
        p = period if period and period > 0 else len(ms) / len(idx)
        amortized = st.mean + (fl.mean - st.mean) / p
    return FlushSplit(st, fl, tuple(idx), period, amortized)
