"""The fused Triton decode kernel (:mod:`kvbench.kernels.decode_attention`) as the CUDA
attention backend, registered as ``triton`` in the entry-point group ``kvbench.backends``: the
adapter that hands the core's blocks to the kernels' dispatch (:mod:`kvbench.kernels.dispatch`,
which imports only torch).

Layouts: :class:`kvbench.cache.blocks.AffineBlock` (per-channel key pages of a multiple of 16
tokens, per-token values) and :class:`kvbench.cache.mixed_channel.MixedChannelBlock` keys; one
query token per sequence; head_dim 64 or 128 (``kvbench.kernels.dispatch.fused_attend`` gives
the exact reason when a layout does not fit).  Declines without touching Triton when the switch
``KVBENCH_FUSED_ATTENTION=0`` is set or Triton is not installed, and for per-row ``lengths``
shorter than the cache (the kernel's ``seq_lens`` are not wired yet).  The kernel modules are
imported only when a CUDA query asks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.attention.backend import AttentionCache
from kvbench.cache.blocks import AffineBlock
from kvbench.cache.mixed_channel import MixedChannelBlock
from kvbench.kernels import HAS_TRITON, dispatch
from kvbench.kernels.dispatch import ENV_SWITCH, Layouts

NAME = "triton"


@dataclass(frozen=True)
class WholeCacheBackend:
    """A :class:`kvbench.attention.backend.Backend` that reads the whole cache in one kernel
    (the fused Triton kernel: :data:`BACKEND`).

    ``layouts``: the block types it reads (a side with no block always fits); ``check(cache,
    query, lengths) -> str | None``: its own further reasons; ``compute(cache, query, scaling,
    lengths) -> [B, H_q, n_q, D]``.  It declines a block type outside ``layouts`` and a cache
    that observes the attention probabilities (it cannot hand them out); its reasons are
    recorded as ``"<name>: <why>"``."""

    name: str
    device: str
    layouts: tuple[type, ...]
    check: Callable[[AttentionCache, torch.Tensor, torch.Tensor | None], str | None]
    compute: Callable[..., torch.Tensor]

    def devices_for(self, block_type: type) -> list[str]:
        return [self.device] if block_type in self.layouts else []

    def reason(
        self, cache: AttentionCache, query: torch.Tensor, lengths: torch.Tensor | None
    ) -> str | None:
        why = self._fits(cache) or self.check(cache, query, lengths)
        if why is None and getattr(cache, "observes_attention", False):
            why = "the cache observes the attention probabilities"
        return None if why is None else f"{self.name}: {why}"

    def _fits(self, cache: AttentionCache) -> str | None:
        for name, side in (("key", cache.k), ("value", cache.v)):
            if side.block is not None and type(side.block) not in self.layouts:
                return f"{name} block {type(side.block).__name__} has no {self.name} kernel"
        return None

    def run(
        self,
        cache: AttentionCache,
        query: torch.Tensor,
        scaling: float | None,
        lengths: torch.Tensor | None,
    ) -> tuple[torch.Tensor, str]:
        return self.compute(cache, query, scaling, lengths), self.name


def _pages_ok(group_len: list[int], g: int) -> bool:
    # token t of the block must lie in page t // g: all pages full but the last
    return bool(group_len) and all(x == g for x in group_len[:-1]) and 0 < group_len[-1] <= g


def affine_keys(block: AffineBlock, head_dim: int):
    """``QuantKeys`` of per-channel :class:`AffineBlock` key pages, or a reason string."""
    from kvbench.kernels.decode_attention import QuantKeys

    if block.symmetric or block.zero is None or block.batch_shared:
        return "symmetric or per-tensor keys"
    if block.bits not in range(1, 9) or block.scale.shape[-1] != head_dim:
        return f"keys are not per-channel 1..8-bit codes (bits={block.bits})"
    g = block.group_len[0]
    if not _pages_ok(block.group_len, g) or g < 16 or g % 16:
        return "key groups are not pages of a multiple of 16 tokens"
    mid = bool(block.midpoint and block.bits == 1)
    counts = (head_dim,)
    return QuantKeys(block.codes, block.scale, block.zero, g, (block.bits,), counts, None, mid)


def mixed_keys(block: MixedChannelBlock, head_dim: int):
    """``QuantKeys`` of :class:`MixedChannelBlock` key pages, or a reason string."""
    from kvbench.kernels.decode_attention import QuantKeys

    g = block.group_len[0]
    if not _pages_ok(block.group_len, g) or g < 16 or g % 16:
        return "key groups are not pages of a multiple of 16 tokens"
    return QuantKeys(
        block.codes,
        block.scale,
        block.zero,
        g,
        tuple(block.class_bits),
        tuple(block.class_counts),
        block.perm,
        bool(block.midpoint),
    )


def affine_values(block: AffineBlock):
    """``QuantValues`` of per-token :class:`AffineBlock` values, or a reason string."""
    from kvbench.kernels.decode_attention import QuantValues

    if block.symmetric or block.zero is None or block.batch_shared:
        return "symmetric or per-tensor values"
    if block.bits not in range(1, 9) or len(block.group_len) != block.ntokens:
        return "values are not per-token 1..8-bit codes"
    return QuantValues(block.codes, block.scale, block.zero, block.bits, bool(block.midpoint))


#: how the kernel reads each block type: ``key(block, head_dim) -> QuantKeys | reason``,
#: ``value(block) -> QuantValues | reason`` (also what ``benchmarks/triton_decode.py`` hands the
#: kernels' dispatch)
KEY_LAYOUTS = {AffineBlock: affine_keys, MixedChannelBlock: mixed_keys}
VALUE_LAYOUTS = {AffineBlock: affine_values}
#: the layouts as :mod:`kvbench.kernels.dispatch` takes them
LAYOUTS = Layouts(KEY_LAYOUTS, VALUE_LAYOUTS)


def _reason(layer_cache: Any, query: torch.Tensor, lengths: Any) -> str | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if HAS_TRITON:
        from kvbench.kernels import _triton  # imports Triton (HAS_TRITON says if it worked)
    if not HAS_TRITON or not _triton.HAS_TRITON:
        return "Triton is not installed"
    if lengths is not None and bool((torch.as_tensor(lengths) != layer_cache.seq_length).any()):
        return "per-row lengths are not supported by the fused kernel yet"
    return dispatch.unsupported(layer_cache, query, LAYOUTS)


def _run(layer_cache: Any, query: torch.Tensor, scaling: float | None, lengths: Any):
    return dispatch.fused_attend(layer_cache, query, scaling, layouts=LAYOUTS)


#: the CUDA backend (entry point ``triton`` of ``kvbench.backends``)
BACKEND = WholeCacheBackend(NAME, "cuda", tuple(KEY_LAYOUTS), _reason, _run)
