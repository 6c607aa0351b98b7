"""``per-head``: one (scale, min) per (batch row, KV head) of each flushed block (docs/methods.md#per-head).

The textbook's ``PerChannelQuantizedCache`` (it calls per-head "per-channel"): scale and min over
all tokens x channels of a head.  On K/V whose heads have different ranges it beats per-tensor
(textbook INT4: MSE 0.027155 vs 0.034811).  Windows as :mod:`kvbench.methods.uniform`.
Defaults: 2 bits, R = 128, no sinks, ``value_bits=16``.
"""

from __future__ import annotations

from kvbench.cache.blocks import PerHeadCodec

from .uniform import Uniform


class PerHead(Uniform):
    """Per-head min-max quantization of each flushed block of keys and values."""

    codec_cls = PerHeadCodec
    description = "textbook per-head min-max K and V (one scale per head per flush)"
    source = "textbook cache quantization chapter [SEED]; docs/methods.md#per-head"
