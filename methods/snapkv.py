"""``snapkv``: keep the tokens the prompt's last queries attend to (docs/design.md#eviction).

SnapKV (Li et al., arXiv 2404.14469), as kvpress's ``SnapKVPress``: the last ``window_size``
post-RoPE queries of the prompt attend (causal softmax in float32, cast back to the queries'
dtype) to every prompt key; each key's score is its weight averaged over those queries, smoothed
by an average pool of ``kernel_size`` (zero padding, stride 1) along the tokens, then averaged
over the query heads of its KV head (GQA group).  The window itself always stays (its score is
the largest score of the batch).  Prefill only; needs the prompt's queries
(``capabilities.needs_queries``: kvbench's attention function hands them over).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench import fields as kf
from kvbench.cache.eviction import EvictionConfig, EvictionMethod, ScoreEvictor
from kvbench.cache.method import Capabilities


@dataclass(frozen=True)
class SnapKVConfig(EvictionConfig):
    """``window_size``: prompt queries that vote (and tokens always kept); ``kernel_size``:
    the pooling width (odd)."""

    window_size: int = kf.spec(64, int, low=1)
    kernel_size: int = kf.spec(5, int, low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel_size % 2 == 0:
            self.reject("kernel_size", "an odd integer (the pool keeps the token count)")


def snapkv_scores(keys: torch.Tensor, queries: torch.Tensor, window: int, kernel: int):
    """``[B, H_kv, P]`` SnapKV scores of keys ``[B, H_kv, P, D]`` from post-RoPE queries
    ``[B, H_q, P, D]`` (module docstring); needs ``P > window``."""
    b, hkv, p, d = keys.shape
    hq = queries.shape[1]
    q = queries[:, :, -window:]
    k = keys.repeat_interleave(hq // hkv, dim=1)
    logits = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
    mask = torch.triu(torch.full_like(logits, -math.inf), diagonal=p - window + 1)
    weights = torch.softmax(logits + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    scores = weights[..., :-window].mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(b, hkv, hq // hkv, p - window).mean(2)
    return F.pad(scores, (0, window), value=scores.max().item())


class SnapKVEvictor(ScoreEvictor):
    """SnapKV's observation-window scores at prefill."""

    needs_queries = True

    def check_prompt(self, tokens: int) -> None:
        """Also refuses a prompt not longer than ``window_size``."""
        super().check_prompt(tokens)
        if tokens <= self.config.window_size:
            self.config.reject(
                "window_size", f"fewer than the prompt's {tokens} tokens (the observation window)"
            )

    def prefill_scores(self, keys: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
        if queries is None:
            raise ValueError(
                "snapkv needs the prompt's post-RoPE queries (capabilities.needs_queries): run "
                "the model with attn_implementation='kvbench' or pass queries to prefill()"
            )
        c = self.config
        return snapkv_scores(keys, queries.to(keys.dtype), c.window_size, c.kernel_size)


class SnapKV(EvictionMethod):
    """SnapKV eviction at prefill; composes with any quantizer (``quantizer``)."""

    Config = SnapKVConfig
    description = "token eviction at prefill: the prompt's last queries vote (SnapKV)"
    source = "Li et al., SnapKV: LLM Knows What You are Looking for, arXiv 2404.14469"
    capabilities = Capabilities(needs_queries=True, padding=False, evicts=True)

    def evictor(self, layer_idx: int) -> SnapKVEvictor:
        return SnapKVEvictor(self.config)
