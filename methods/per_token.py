"""``per-token``: uniform per-token quantization of keys and values (KIVI's sense).

One (scale, min) per token per ``value_group_size`` channels (statistics reduced over channels),
for keys as for values; what KIVI uses for values only (docs/methods.md#kivi) and what transformers'
``QuantizedCache`` calls "per-channel" with ``axis=0`` (docs/methods.md#per-channel-and-per-token).  Both sides
keep a sliding full-precision window of R tokens (per-token groups make 1-token flushes valid).
Defaults: 2 bits, R = 128, no sinks, ``value_bits=16``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.blocks import Codec, PerTokenCodec
from kvbench.cache.method import Capabilities, Method
from kvbench.cache.schedule import SlidingSchedule

from .kivi import KIVIConfig


@dataclass(frozen=True)
class PerTokenConfig(KIVIConfig):
    """As :class:`KIVIConfig`; R need not be a multiple of G (groups run along channels)."""

    token_axis_keys: ClassVar[bool] = False


class PerToken(Method):
    """Per-token keys and values, groups of ``value_group_size`` channels."""

    Config = PerTokenConfig
    description = "uniform per-token K and V (channel groups), sliding fp residual R"
    source = "KIVI §3 (values); docs/methods.md#per-token"
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> Codec:
        c = self.config
        return PerTokenCodec(c.bits, c.torch_scale_dtype, channel_group=c.channel_group(head_dim))

    def key_schedule(self) -> object:
        return SlidingSchedule(self.config.residual_length)
