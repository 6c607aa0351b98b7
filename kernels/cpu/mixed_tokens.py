"""Code-domain keys and values of :class:`kvbench.methods.semkv.MixedTokenBlock` (``semkv``'s
two-width per-token codes): both planes through the core's per-token affine kernel, or one
native call.  Registered in :mod:`kvbench.kernels.cpu.codedomain`."""

from __future__ import annotations

import torch

from kvbench.cache.blocks import AffineBlock
from kvbench.kernels.cpu import native
from kvbench.kernels.cpu.affine import AffineBlockAttention, affine_terms, native_allowed, note_impl
from kvbench.kernels.cpu.native import code_layout
from kvbench.methods.semkv import MixedTokenBlock

_AFFINE = AffineBlockAttention()


class MixedTokenAttention:
    """Code-domain keys and values of :class:`MixedTokenBlock` (a block kernel).

    A token's code is ``c = low + 2^lb up`` (``up`` only for high tokens), so with per-token
    terms ``x = c * scale + zero`` over channel groups ``g``: keys ``q . x_t = sum_g scale_{t,g}
    (q_g . low_{t,g}) + sum_g zero_{t,g} sum(q_g) + sum_g 2^lb scale_{t,g} (q_g . up_{t,g})``
    and values ``sum_t p_t x_t`` likewise.  Both planes go through the core's per-token affine
    kernel (:class:`kvbench.kernels.cpu.affine.AffineBlockAttention`: native or eager): the
    low plane of every token as stored, and the upper plane as ``hb - lb``-bit codes of every
    token with terms ``(2^lb scale, 0)`` (``(0, 0)`` for low tokens), the high tokens' stored
    rows placed at their positions and zero codes for the low tokens (a transient of ``(hb -
    lb) / 8`` bytes per element, built once per read from the ``extra`` rows and the mask).
    With the native kernels both planes are read in one call instead (:meth:`_native`): the
    upper rows where they are stored, found through a per-token row index (:meth:`upper_rows`,
    int32, 4 bytes a token), added to the high tokens' low codes in the keys kernel and summed
    over the high tokens after the low plane for values.  No dequantized key or value is
    formed."""

    def key_reason(self, block: MixedTokenBlock, head_dim: int) -> str | None:
        return None if head_dim % block.scale.shape[-1] == 0 else "groups do not divide D"

    value_reason = key_reason

    @staticmethod
    def _low(block: MixedTokenBlock) -> AffineBlock:
        n = block.ntokens
        return AffineBlock(
            block.low, block.scale, block.zero, [1] * n, block.low_bits, block.head_dim
        )

    @staticmethod
    def _upper(block: MixedTokenBlock) -> AffineBlock:
        """The upper plane of every token: uint8 ``[B, H_kv, n, ceil(D (hb - lb) / 8)]`` (zero
        rows for low tokens), scale float32 ``2^lb scale`` for high tokens and 0 for low ones,
        zero 0.  (A low token's zero codes with its own, large low-bit scale would add exactly
        0 in exact arithmetic, but the centred kernels compute ``(0 - h) a + h a`` with ``h =
        (2^(hb - lb) - 1) / 2``: two large float32 terms whose rounding, at 1/8 bits, reached
        9e-5 of the output.)"""
        b, h, n, _ = block.low.shape
        nb = block.extra.shape[-1]
        rows = block.extra.new_zeros(n * b * h, nb)  # the extra rows' own [n, B, H] order
        high = block.high()
        at = high.permute(2, 0, 1).reshape(-1).nonzero().squeeze(1)
        rows.index_copy_(0, at, block.extra)
        dense = rows.view(n, b, h, nb).permute(1, 2, 0, 3)  # [B, H, n, nb], strided rows
        scale = block.scale.float() * (high[..., None] * float(1 << block.low_bits))
        bits = block.high_bits - block.low_bits
        return AffineBlock(dense, scale, torch.zeros_like(scale), [1] * n, bits, block.head_dim)

    @staticmethod
    def upper_rows(block: MixedTokenBlock) -> torch.Tensor:
        """Int32 ``[B, H_kv, n]``: each token's row of ``extra`` (its rank among the high
        flags in ``[n, B, H_kv]`` order), -1 for low tokens."""
        b, h, n, _ = block.low.shape
        flags = block.high().permute(2, 0, 1).reshape(-1).to(torch.int32)
        rows = flags.cumsum(0, dtype=torch.int32).mul_(flags).sub_(1)  # rank - 1, or -1
        return rows.view(n, b, h).permute(1, 2, 0).contiguous()

    def _native(self, block: MixedTokenBlock, x: torch.Tensor, values: bool) -> torch.Tensor | None:
        """Both planes in one native call (:class:`kvbench.kernels.cpu.native.Upper`: the low plane
        by the per-token group kernel, the high tokens' upper rows read where they are stored)
        where it applies, else ``None``.  ``x``: the query (keys) or probabilities (values)."""
        low, d, m = self._low(block), block.head_dim, x.shape[2]
        if not native_allowed() or not native.supports(low.codes, low.bits, d):
            return None
        a, z = affine_terms(low)
        group = d // a.shape[-1]
        if group % code_layout(low.bits)[1]:
            return None
        upper = None
        if block.extra.shape[0]:
            shift, ub = block.low_bits, block.high_bits - block.low_bits
            upper = native.Upper(block.extra, self.upper_rows(block), ub, shift)
            if not native.upper_fits(upper, low.bits, d, m, group, values):
                return None
        note_impl("native")
        if values:
            return native.values_groups(low.codes, x, a, z, low.bits, d, upper)
        return native.keys_groups(low.codes, x, a, z, low.bits, upper)

    def key_logits(self, block: MixedTokenBlock, q: torch.Tensor) -> torch.Tensor:
        if (out := self._native(block, q, values=False)) is not None:
            return out
        lg = _AFFINE.key_logits(self._low(block), q)  # [B, H, M, n]
        if not block.extra.shape[0]:
            return lg
        return lg + _AFFINE.key_logits(self._upper(block), q)

    def value_output(self, block: MixedTokenBlock, p: torch.Tensor) -> torch.Tensor:
        if (out := self._native(block, p, values=True)) is not None:
            return out
        out = _AFFINE.value_output(self._low(block), p)  # [B, H, M, D]
        if not block.extra.shape[0]:
            return out
        return out + _AFFINE.value_output(self._upper(block), p)
