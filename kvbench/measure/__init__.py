"""Measurement: the one timing protocol of kvbench (:mod:`kvbench.measure.timer`) and the
flush-aware split of decode steps (:mod:`kvbench.measure.window`).

Imports only ``torch`` and the standard library, so ``kernels/`` and ``benchmarks/`` use it too.
"""

from kvbench.measure.timer import (
    PERCENTILE_RULE,
    Stats,
    Timer,
    contiguous_read,
    interleave,
    percentile,
    pin_threads,
    ratios,
    rotation,
    summarize,
    system_state,
)
from kvbench.measure.window import FlushSplit, flush_steps, split_steps

__all__ = [
    "PERCENTILE_RULE",
    "FlushSplit",
    "Stats",
    "Timer",
    "contiguous_read",
    "flush_steps",
    "interleave",
    "percentile",
    "pin_threads",
    "ratios",
    "rotation",
    "split_steps",
    "summarize",
    "system_state",
]
