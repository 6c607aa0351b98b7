"""example-sign: symmetric (absmax) per-token keys with a sliding full-precision window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench import CacheConfig, Capabilities, Method
from kvbench.cache.blocks import PerTokenCodec
from kvbench.cache.quant import check_bits
from kvbench.cache.schedule import SlidingSchedule


@dataclass(frozen=True)
class SignMagnitudeConfig(CacheConfig):
    """bits: key code width, 2..8 (a symmetric code needs a sign bit and a magnitude)."""

    bits: int = 4
    #: per-token keys: no token-axis groups, so R need not be a multiple of G
    token_axis_keys: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()  # G, R, N_s, value_bits, value_group_size, scale_dtype
        check_bits(self.bits, "bits")  # the core's check: integers 1..8 or 16
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits={self.bits!r} is not supported; allowed: 2..8")


class SignMagnitude(Method):
    """Keys: one absmax scale per (token, channel group); codes in [-(2^(b-1)-1), 2^(b-1)-1]."""

    Config = SignMagnitudeConfig
    description = "example plugin: symmetric absmax per-token keys"
    source = "kvbench README, Adding a method"
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> PerTokenCodec:
        c = self.config
        group = c.channel_group(head_dim)  # value_group_size or min(G, D); must divide D
        return PerTokenCodec(c.bits, c.torch_scale_dtype, symmetric=True, channel_group=group)

    def key_schedule(self) -> SlidingSchedule:
        return SlidingSchedule(self.config.residual_length)  # quantize tokens leaving the window
