"""``uniform``: the textbook per-tensor min-max cache (docs/methods.md#uniform).

One (scale, min) for the whole flushed tensor (all batch rows, heads, tokens and channels of one
flush), for keys and values.  The textbook quantizes the whole stored tensor at once with no
residual; here the generic window fields apply so every method runs with the same windows: the
cache quantizes blocks of R tokens (docs/methods.md#flush-schedules; ``residual_length=0`` quantizes each
arriving chunk immediately, the textbook behaviour).  Source: M. Brenndoerfer, *Language AI
Handbook*, "KV Cache Compression: Cache Quantization" (2026) [SEED].  Defaults: 2 bits, R = 128,
no sinks, ``value_bits=16``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.blocks import Codec, PerTensorCodec
from kvbench.cache.method import Capabilities, Method
from kvbench.cache.schedule import BlockSchedule, NeverSchedule

from .kivi import KIVIConfig


@dataclass(frozen=True)
class WholeFlushConfig(KIVIConfig):
    """As :class:`KIVIConfig`; groups are whole flushes, so any R >= 0 is allowed.

    ``group_size`` is unused by the key groups (kept so suites can set it uniformly)."""

    token_axis_keys: ClassVar[bool] = False


class Uniform(Method):
    """Per-tensor min-max quantization of each flushed block of keys and values."""

    Config = WholeFlushConfig
    codec_cls: ClassVar[type] = PerTensorCodec
    description = "textbook per-tensor min-max K and V (one scale per flush)"
    source = "textbook cache quantization chapter [SEED]; docs/methods.md#uniform"
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> Codec:
        c = self.config
        return self.codec_cls(c.bits, c.torch_scale_dtype)

    def value_codec(self, layer_idx: int, head_dim: int) -> Codec | None:
        c = self.config
        return None if c.value_bits == 16 else self.codec_cls(c.value_bits, c.torch_scale_dtype)

    def value_schedule(self) -> object:
        c = self.config
        return NeverSchedule() if c.value_bits == 16 else BlockSchedule(c.residual_length)
