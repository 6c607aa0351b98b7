"""``full``: the unquantized baseline (docs/design.md#protocols).

Keys and values are stored in the model's dtype, exactly as transformers' ``DynamicCache``;
key MSE, attention KL and next-token KL against it are 0 by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.cache.layout import BlockLayout
from kvbench.cache.method import Capabilities, Method, MethodConfig


@dataclass(frozen=True)
class FullConfig(MethodConfig):
    """No fields: nothing is quantized."""


class FullPrecision(Method):
    """Full-precision KV cache: ``[B, H_kv, T, D]`` keys and values in the model dtype."""

    Config = FullConfig
    description = "unquantized baseline: K/V in the model's dtype"
    source = "docs/design.md#baseline"
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> None:
        """No codec: every key stays in the residual, in the model's dtype."""
        return None

    value_codec = key_codec

    def key_schedule(self) -> None:
        """Nothing is ever flushed (the layer cache's default never-schedule)."""
        return None

    value_schedule = key_schedule

    def key_layout(self, head_dim: int) -> BlockLayout:
        return BlockLayout.full_precision(head_dim)

    def value_layout(self, head_dim: int) -> BlockLayout:
        return BlockLayout.full_precision(head_dim)
