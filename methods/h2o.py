"""``h2o``: keep the heavy hitters of accumulated attention and the newest tokens
(docs/design.md#eviction).

H2O (Zhang et al., arXiv 2306.14048).  At prefill, as kvpress's ``ObservedAttentionPress``: the
prompt's causal attention (eager: softmax in float32, cast back to the queries' dtype) summed
over its queries, divided by the number of queries that see each key (``P - j``), averaged over
the KV head's query heads; the lowest are dropped.  While decoding, a fixed budget as in the
paper: each token accumulates the attention it receives (summed over the steps' queries,
averaged over the KV head's query heads, starting from its prompt sum), the newest
``int(budget * recent_ratio)`` tokens are always kept, and the lowest accumulated scores are
dropped when the next step's tokens are stored.  Needs the prompt's queries and the decode
attention: ``QuantizedKVCache`` routes decode steps through ``LayerCache.attend``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbench import fields as kf
from kvbench.cache.eviction import (
    EvictionConfig,
    EvictionMethod,
    ObservingEvictor,
    attention_probs,
    kept_after,
)
from kvbench.cache.layer import LayerCache
from kvbench.cache.method import Capabilities


@dataclass(frozen=True)
class H2OConfig(EvictionConfig):
    """``recent_ratio``: share of the decode budget kept for the newest tokens (H2O's
    recent window; the paper splits the budget evenly)."""

    recent_ratio: float = kf.spec(0.5, float, low=0, high=1)


def attention_sums(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, P]`` float32: the prompt's causal attention summed over its queries and
    averaged over each KV head's query heads (one query head at a time)."""
    b, hkv, p, _ = keys.shape
    g = queries.shape[1] // hkv
    out = torch.zeros(b, hkv, p)
    for h in range(hkv):
        for j in range(h * g, (h + 1) * g):
            probs = attention_probs(keys[:, h : h + 1], queries[:, j : j + 1])
            out[:, h] += probs[:, 0].float().sum(1) / g
    return out


def h2o_prefill_scores(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, P]`` kvpress ObservedAttention scores (module docstring)."""
    b, hkv, p, _ = keys.shape
    g = queries.shape[1] // hkv
    out = torch.zeros(b, hkv, p)
    seen_by = torch.arange(p, 0, -1, dtype=torch.float32)
    for h in range(hkv):
        for j in range(h * g, (h + 1) * g):
            probs = attention_probs(keys[:, h : h + 1], queries[:, j : j + 1])
            out[:, h] += (probs[:, 0].sum(1) / seen_by.to(probs.dtype)).float() / g
    return out


class H2OEvictor(ObservingEvictor):
    """Observed attention at prefill, accumulated attention + a recent window while decoding."""

    def __init__(self, config: H2OConfig) -> None:
        super().__init__(config)
        self.acc: torch.Tensor | None = None  # [B, H_kv, T] accumulated attention, held tokens

    def prefill_scores(self, keys: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
        if queries is None:
            raise ValueError("h2o needs the prompt's post-RoPE queries (needs_queries)")
        return h2o_prefill_scores(keys, queries.to(keys.dtype))

    def at_prefill(self, layer: LayerCache, keys: torch.Tensor, queries: torch.Tensor | None):
        if queries is not None:
            self.acc = attention_sums(keys, queries.to(keys.dtype))
        drop = super().at_prefill(layer, keys, queries)
        if drop is not None and self.acc is not None:
            self.acc = kept_after(self.acc, drop)
        return drop

    def _grow(self, held: int) -> torch.Tensor:
        extra = held - self.acc.shape[2]
        if extra > 0:
            self.acc = torch.nn.functional.pad(self.acc, (0, extra))
        return self.acc

    def observe(self, layer: LayerCache, probs: torch.Tensor, lengths: torch.Tensor | None) -> None:
        super().observe(layer, probs, lengths)
        b, hq, _, t = probs.shape
        hkv = layer.kv_shape[1]
        add = probs.float().sum(2).reshape(b, hkv, hq // hkv, t).mean(2)
        self._grow(t)
        self.acc = self.acc + add.to(self.acc.device)

    def step_scores(self, layer: LayerCache) -> torch.Tensor:
        """The accumulated attention of the held tokens, ``inf`` for the newest
        ``int(budget * recent_ratio)``."""
        held = layer.seq_length
        self.observed("h2o")
        scores = self._grow(held).clone()
        recent = int(self.limit * self.config.recent_ratio)
        if recent:
            scores[..., held - recent :] = math.inf
        return scores

    def dropped(self, drop: torch.Tensor) -> None:
        self.acc = kept_after(self.acc, drop)

    def reset(self) -> None:
        super().reset()
        self.acc = None


class H2O(EvictionMethod):
    """H2O heavy-hitter eviction at prefill and while decoding; composes with any quantizer."""

    Config = H2OConfig
    description = "token eviction: heavy hitters of accumulated attention + recent (H2O)"
    source = "Zhang et al., H2O: Heavy-Hitter Oracle, arXiv 2306.14048"
    capabilities = Capabilities(needs_queries=True, padding=False, evicts=True)
    observes_attention = True

    def evictor(self, layer_idx: int) -> H2OEvictor:
        return H2OEvictor(self.config)
