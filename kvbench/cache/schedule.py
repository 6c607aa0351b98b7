"""Flush schedules: when full-precision residual tokens become quantized.

A schedule answers two questions about one cache side (keys or values), counting only tokens
after the sinks:

* ``prefill_count(n)``: of the ``n`` prompt tokens, how many (the oldest) are quantized at
  prefill;
* ``flush_count(r)``: when a decode step's flush runs (``LayerCache.end_step``: before the
  step's attention under ``write-then-attend``, after it under ``in-chunk-full``;
  docs/design.md#protocols), with ``r`` tokens in the residual, how many of the oldest are
  quantized now.

The count is always a multiple of the codec's ``token_group`` (checked by the layer cache).
docs/methods.md#flush-schedules and docs/methods.md#worked-example-16 give the reference schedules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockSchedule:
    """KIVI keys (docs/methods.md#kivi): quantize whole blocks of ``R`` tokens.

    Prefill: ``n - n mod R`` tokens (all of them when ``n % R == 0``, none when ``n < R``).
    Decode: when the residual reaches ``R`` it is quantized entirely, so it cycles 0..R-1.
    ``R == 0`` quantizes every token as soon as it arrives.
    """

    residual_length: int
    name: str = "kivi-block"

    def prefill_count(self, n: int) -> int:
        r = self.residual_length
        return n if r == 0 else (n // r) * r

    def flush_count(self, residual: int) -> int:
        return self.prefill_count(residual)


@dataclass(frozen=True)
class SlidingSchedule:
    """KIVI values (docs/methods.md#kivi): a sliding full-precision window of exactly ``R`` newest tokens.

    Prefill: ``max(n - R, 0)`` quantized; decode: the overflow beyond ``R`` (one token per step).
    """

    residual_length: int
    name: str = "kivi-sliding"

    def prefill_count(self, n: int) -> int:
        return max(n - self.residual_length, 0)

    def flush_count(self, residual: int) -> int:
        return max(residual - self.residual_length, 0)


@dataclass(frozen=True)
class AllButNewestSchedule:
    """Kitty keys (docs/methods.md#kitty, Kitty-sim ``kitty_simulate.py``): "all but the newest".

    Prefill: when ``n > R``, ``n - n mod G`` tokens are quantized in pages of ``G``.
    Decode: when the residual reaches ``R + 1``, its oldest ``R`` tokens are quantized, so the
    residual cycles 1..R (Example 16: flushes at steps 117 and 245 after a 300-token prompt).
    """

    residual_length: int
    group_size: int
    name: str = "kitty-all-but-newest"

    def prefill_count(self, n: int) -> int:
        if n <= self.residual_length:
            return 0
        return (n // self.group_size) * self.group_size

    def flush_count(self, residual: int) -> int:
        r = self.residual_length
        if residual <= r:
            return 0
        return ((residual - 1) // r) * r


@dataclass(frozen=True)
class NeverSchedule:
    """Nothing is ever quantized (the ``full`` baseline, or ``value_bits=16``)."""

    name: str = "never"

    def prefill_count(self, n: int) -> int:
        return 0

    def flush_count(self, residual: int) -> int:
        return 0
