"""A minimal kvbench plugin: ``example-sign``, symmetric per-token keys.

Shows the whole plugin path: a config dataclass, a ``Method`` subclass that supplies a key codec
and its bit terms, and one entry-point line in this package's ``pyproject.toml``::

    [project.entry-points."kvbench.methods"]
    example-sign = "kvbench_example_plugin:SignMagnitude"

After ``pip install`` of this folder, ``kvbench list`` shows it and
``kvbench.get_method("example-sign", bits=4)`` builds it; no fork of kvbench is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench import CacheConfig, Capabilities, Method
from kvbench.kv.blocks import PerTokenCodec
from kvbench.kv.quant import check_bits
from kvbench.kv.schedule import SlidingSchedule


@dataclass(frozen=True)
class SignMagnitudeConfig(CacheConfig):
    """``bits``: key code width (2..8); symmetric absmax per token and channel group."""

    bits: int = 4
    token_axis_keys: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bits(self.bits, "bits")
        if self.bits < 2:
            raise ValueError(f"bits={self.bits} must be >= 2 for symmetric codes")


class SignMagnitude(Method):
    """Symmetric (absmax) per-token key quantization with a sliding full-precision window."""

    Config = SignMagnitudeConfig
    description = "example plugin: symmetric absmax per-token keys"
    source = "kvbench plugin example"
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> PerTokenCodec:
        c = self.config
        return PerTokenCodec(
            c.bits, c.torch_scale_dtype, symmetric=True, channel_group=c.channel_group(head_dim)
        )

    def key_schedule(self) -> SlidingSchedule:
        return SlidingSchedule(self.config.residual_length)

    def key_bit_terms(self, head_dim: int) -> dict[str, float]:
        c = self.config
        # symmetric: one 16-bit scale per group, no zero
        return {
            "b_eff": c.bits,
            "m_q": c.pair_bits // 2,
            "group": c.channel_group(head_dim),
            "m_sal": 0,
        }
