"""example-sign: symmetric (absmax) per-token keys with a sliding full-precision window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench import CacheConfig, Capabilities, Method
from kvbench.cache.blocks import PerTokenCodec
from kvbench.cache.schedule import SlidingSchedule
from kvbench.fields import spec


@dataclass(frozen=True)
class SignMagnitudeConfig(CacheConfig):
    """bits: key code width, 2..8 (a symmetric code needs a sign bit and a magnitude)."""

    #: checked by CacheConfig.__post_init__ with G, R, N_s, value_bits, ...: an error says
    #: "field 'bits': 9 is not allowed; allowed: integers 2..8"
    bits: int = spec(4, int, low=2, high=8)
    #: per-token keys: no token-axis groups, so R need not be a multiple of G
    token_axis_keys: ClassVar[bool] = False


class SignMagnitude(Method):
    """Keys: one absmax scale per (token, channel group); codes in [-(2^(b-1)-1), 2^(b-1)-1]."""

    Config = SignMagnitudeConfig
    description = "example plugin: symmetric absmax per-token keys"
    source = "kvbench docs/plugins.md, A complete plugin"
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> PerTokenCodec:
        c = self.config
        group = c.channel_group(head_dim)  # value_group_size or min(G, D); must divide D
        return PerTokenCodec(c.bits, c.torch_scale_dtype, symmetric=True, channel_group=group)

    def key_schedule(self) -> SlidingSchedule:
        return SlidingSchedule(self.config.residual_length)  # quantize tokens leaving the window
