"""``knorm``: drop the keys of largest L2 norm (docs/design.md#eviction).

KnormPress (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", arXiv 2406.11430; kvpress's ``KnormPress``): a key's score is ``-||k||_2``, and
each KV head keeps its lowest-norm keys at prefill.  No decode eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache.eviction import EvictionConfig, EvictionMethod, ScoreEvictor
from kvbench.cache.method import Capabilities


@dataclass(frozen=True)
class KnormConfig(EvictionConfig):
    """The budget and quantizer of :class:`~kvbench.cache.eviction.EvictionConfig`."""


class KnormEvictor(ScoreEvictor):
    """Score ``-||k||_2`` per key and head (in the keys' dtype, as kvpress)."""

    def prefill_scores(self, keys: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
        return -keys.norm(dim=-1)


class Knorm(EvictionMethod):
    """Key-norm eviction at prefill; composes with any quantizer (``quantizer``)."""

    Config = KnormConfig
    description = "token eviction at prefill: keep the keys of smallest L2 norm (KnormPress)"
    source = "Devoto et al., A Simple and Effective L2 Norm-Based Strategy, arXiv 2406.11430"
    capabilities = Capabilities(padding=False, evicts=True)

    def evictor(self, layer_idx: int) -> KnormEvictor:
        return KnormEvictor(self.config)
