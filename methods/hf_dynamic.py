"""``hf-dynamic``: transformers' ``DynamicCache``, the full-precision cache users get by default.

A peer, not a kvbench cache (``capabilities.layer_cache=False``, :mod:`kvbench.hf.peers`): the
latency workload runs the model with ``DynamicCache(config=model.config)`` and the memory workload
replays captured K/V into ``DynamicLayer``\\ s (``update`` concatenates the new tokens onto
``keys``/``values`` ``[B, H_kv, T, D]`` in the model dtype).  Its bytes equal ``full``'s; its
decode step is the reference every quantized cache is compared against.
Source: transformers ``cache_utils.py`` (``DynamicLayer``, ``DynamicCache``), docs/methods.md#transformers-peers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench.cache.layout import BlockLayout
from kvbench.cache.method import MethodConfig
from kvbench.hf.peers import HFPeer, text_config


@dataclass(frozen=True)
class HFDynamicConfig(MethodConfig):
    """No fields: nothing is quantized."""


class HFDynamic(HFPeer):
    """transformers ``DynamicCache``: K/V concatenated in the model dtype."""

    Config = HFDynamicConfig
    description = "peer: transformers DynamicCache (full precision, model dtype)"
    source = "transformers cache_utils.DynamicCache; docs/methods.md#transformers-peers"

    def new_hf_layer(self) -> Any:
        from transformers.cache_utils import DynamicLayer

        return DynamicLayer()

    def transformers_cache(self, model: Any, attend: bool = False) -> Any:
        """``DynamicCache(config=...)`` for ``model`` (a model or its config)."""
        from transformers import DynamicCache

        return DynamicCache(config=text_config(model))

    def key_layout(self, head_dim: int) -> BlockLayout:
        """16 bits per element: the model dtype, assumed 16-bit (fp16/bf16) as in the paper."""
        return BlockLayout.full_precision(head_dim)

    def value_layout(self, head_dim: int) -> BlockLayout:
        return self.key_layout(head_dim)
