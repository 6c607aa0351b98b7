"""``streamingllm``: attention sinks plus a window of the newest tokens (docs/design.md#eviction).

StreamingLLM (Xiao et al., arXiv 2309.17453) keeps the first ``n_sink`` tokens and the most
recent ones and drops the rest, at prefill (kvpress's ``StreamingLLMPress``: the oldest tokens
after the sinks go first) and after every decode step (a fixed token budget).  Every KV head
drops the same tokens.  ``n_sink`` is the evictor's: tokens that are never dropped, stored by
the quantizer like any other (its own ``num_sink_tokens`` keeps tokens in full precision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbench import fields as kf
from kvbench.cache.eviction import DecodeEvictor, EvictionConfig, EvictionMethod
from kvbench.cache.layer import LayerCache
from kvbench.cache.method import Capabilities


@dataclass(frozen=True)
class StreamingLLMConfig(EvictionConfig):
    """``n_sink``: the first tokens, never dropped (kvpress's default 4)."""

    n_sink: int = kf.spec(4, int, low=0)


def window_scores(shape: tuple[int, int, int], n_sink: int, device: torch.device) -> torch.Tensor:
    """``[B, H_kv, T]`` float32 scores: a token's index (newer = kept first), ``inf`` for the
    first ``n_sink``."""
    b, h, t = shape
    s = torch.arange(t, dtype=torch.float32, device=device).expand(b, h, t).clone()
    s[..., :n_sink] = math.inf
    return s


class StreamingEvictor(DecodeEvictor):
    """Drops the oldest tokens after the first ``n_sink``, at prefill and while decoding."""

    def check_prompt(self, tokens: int) -> None:
        """Also refuses a budget that cannot hold the sinks and one recent token."""
        super().check_prompt(tokens)
        c = self.config
        keep = c.budget_tokens if c.budget_tokens is not None else c.kept(tokens)
        if keep <= c.n_sink and tokens > keep:
            field = "budget_tokens" if c.budget_tokens is not None else "keep_ratio"
            c.reject(
                field,
                f"a budget above n_sink={c.n_sink} tokens (a prompt of {tokens} tokens keeps "
                f"{keep})",
            )

    def prefill_scores(self, keys: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
        return window_scores(keys.shape[:3], self.config.n_sink, keys.device)

    def step_scores(self, layer: LayerCache) -> torch.Tensor:
        b, h, _ = layer.kv_shape
        return window_scores((b, h, layer.seq_length), self.config.n_sink, torch.device("cpu"))


class StreamingLLM(EvictionMethod):
    """Attention sinks + recent window; composes with any quantizer (``quantizer``)."""

    Config = StreamingLLMConfig
    description = "token eviction: n_sink first tokens + the newest (StreamingLLM)"
    source = (
        "Xiao et al., Efficient Streaming Language Models with Attention Sinks, arXiv 2309.17453"
    )
    capabilities = Capabilities(padding=False, evicts=True)

    def evictor(self, layer_idx: int) -> StreamingEvictor:
        return StreamingEvictor(self.config)
