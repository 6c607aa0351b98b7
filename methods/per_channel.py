"""``per-channel``: uniform per-channel quantization of keys *and* values, KIVI's sense.

One (scale, min) per channel per ``group_size`` tokens for both sides (statistics reduced over
tokens).  This is the "Per-Channel" baseline of PN-Mix Table 9 (uniform per-channel asymmetric,
G = 128, at 3 or 2 bits) and docs/methods.md#per-channel.  Both sides flush in blocks of R tokens (docs/methods.md#kivi's key
rule), since a per-channel group needs G tokens.  Defaults: 2 bits, G = R = 128, no sinks,
``value_bits=16``.
"""

from __future__ import annotations

from kvbench.cache.blocks import Codec, PerChannelCodec
from kvbench.cache.method import Capabilities, Method
from kvbench.cache.schedule import BlockSchedule, NeverSchedule

from .kivi import KIVIConfig


class PerChannel(Method):
    """Per-channel keys and values over G-token groups (PN-Mix Table 9 "Per-Channel")."""

    Config = KIVIConfig
    description = "uniform per-channel K and V (G-token groups), PN-Mix Table 9 baseline"
    source = "PN-Mix Table 9 caption; docs/methods.md#per-channel"
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> Codec:
        c = self.config
        return PerChannelCodec(c.bits, c.torch_scale_dtype, group_size=c.group_size)

    def value_codec(self, layer_idx: int, head_dim: int) -> Codec | None:
        c = self.config
        if c.value_bits == 16:
            return None
        return PerChannelCodec(c.value_bits, c.torch_scale_dtype, group_size=c.group_size)

    def value_schedule(self) -> object:
        c = self.config
        return NeverSchedule() if c.value_bits == 16 else BlockSchedule(c.residual_length)
