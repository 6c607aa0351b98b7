"""``full``: the unquantized baseline (docs/design.md#protocols).

Keys and values are stored in the model's dtype, exactly as transformers' ``DynamicCache``;
key MSE, attention KL and next-token KL against it are 0 by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.kv.layer import LayerCache
from kvbench.kv.layout import BlockLayout
from kvbench.kv.method import Capabilities, Method, MethodConfig


@dataclass(frozen=True)
class FullConfig(MethodConfig):
    """No fields: nothing is quantized."""


class FullPrecision(Method):
    """Full-precision KV cache: ``[B, H_kv, T, D]`` keys and values in the model dtype."""

    Config = FullConfig
    description = "unquantized baseline: K/V in the model's dtype"
    source = "docs/design.md#baseline"
    capabilities = Capabilities()

    def new_layer(
        self,
        layer_idx: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> LayerCache:
        return LayerCache(None, None, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def key_layout(self, head_dim: int) -> BlockLayout:
        return BlockLayout.full_precision(head_dim)

    def value_layout(self, head_dim: int) -> BlockLayout:
        return BlockLayout.full_precision(head_dim)
