"""``tova``: drop the token the newest query attends to least (docs/design.md#eviction).

TOVA (Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104).  At prefill, as
kvpress's ``TOVAPress``: the prompt's last post-RoPE query attends (causal softmax in float32,
cast back to the queries' dtype) to every prompt key; a key's score is that weight averaged
over all query heads of the layer, so every KV head keeps the same tokens; the last token is
always kept.  While decoding, a fixed budget: the attention each step reads
(``observe_attention``, its last query, averaged over all heads) scores the held tokens, and
the lowest-scored ones are dropped when the next step's tokens are stored (tokens stored since
the last observation are kept).  Needs the prompt's queries and the decode attention:
``QuantizedKVCache`` routes decode steps through ``LayerCache.attend``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.cache.eviction import (
    EvictionConfig,
    EvictionMethod,
    ObservingEvictor,
    attention_probs,
    kept_after,
    pad_new,
)
from kvbench.cache.layer import LayerCache
from kvbench.cache.method import Capabilities


@dataclass(frozen=True)
class TOVAConfig(EvictionConfig):
    """The budget and quantizer of :class:`~kvbench.cache.eviction.EvictionConfig`."""


def tova_scores(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, P]`` TOVA prefill scores of keys ``[B, H_kv, P, D]`` from post-RoPE
    ``queries [B, H_q, P, D]`` (module docstring)."""
    probs = attention_probs(keys, queries[:, :, -1:])[:, :, 0, :-1]  # [B, H_q, P - 1]
    scores = probs.mean(1, keepdim=True).repeat(1, keys.shape[1], 1)
    return F.pad(scores, (0, 1), value=scores.max().item())


class TOVAEvictor(ObservingEvictor):
    """TOVA's scores: the newest query's attention, averaged over heads."""

    def __init__(self, config: EvictionConfig) -> None:
        super().__init__(config)
        self.last: torch.Tensor | None = None  # [B, H_kv, T] scores of the held tokens

    def check_prompt(self, tokens: int) -> None:
        super().check_prompt(tokens)
        if tokens < 2:
            self.config.reject("keep_ratio", "a prompt of at least 2 tokens (TOVA scores the rest)")

    def prefill_scores(self, keys: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
        if queries is None:
            raise ValueError("tova needs the prompt's post-RoPE queries (needs_queries)")
        return tova_scores(keys, queries.to(keys.dtype))

    def at_prefill(self, layer: LayerCache, keys: torch.Tensor, queries: torch.Tensor | None):
        self.last = self.prefill_scores(keys, queries).float()
        drop = super().at_prefill(layer, keys, queries)
        if drop is not None:
            self.last = kept_after(self.last, drop)
        return drop

    def observe(self, layer: LayerCache, probs: torch.Tensor, lengths: torch.Tensor | None) -> None:
        super().observe(layer, probs, lengths)
        hkv = layer.kv_shape[1]
        self.last = probs[:, :, -1].float().mean(1, keepdim=True).repeat(1, hkv, 1)

    def step_scores(self, layer: LayerCache) -> torch.Tensor:
        """The last observed scores, ``inf`` for the tokens stored since."""
        self.observed("tova")
        self.last = pad_new(self.last, layer.seq_length)
        return self.last

    def dropped(self, drop: torch.Tensor) -> None:
        self.last = kept_after(self.last, drop)

    def reset(self) -> None:
        super().reset()
        self.last = None


class TOVA(EvictionMethod):
    """TOVA eviction at prefill and while decoding; composes with any quantizer."""

    Config = TOVAConfig
    description = "token eviction: drop what the newest query attends to least (TOVA)"
    source = "Oren et al., Transformers are Multi-State RNNs, arXiv 2401.06104"
    capabilities = Capabilities(needs_queries=True, padding=False, evicts=True)
    observes_attention = True

    def evictor(self, layer_idx: int) -> TOVAEvictor:
        return TOVAEvictor(self.config)
