"""The stored block of ``semkv``: per-token min-max codes at two widths, the high-width tokens'
upper bits stored apart.  ``methods/semkv.py`` (the codec) builds :class:`MixedTokenBlock`;
``kvbench.kernels.cpu.mixed_tokens`` reads it in the code domain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvbench.cache.blocks import own_storage
from kvbench.cache.quant import pack_bits, unpack_bits

_PER_TOKEN = ("low", "scale", "zero")  # MixedTokenBlock fields laid out [B, H_kv, n, ...]
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)])  # set bits of each byte


@dataclass
class MixedTokenBlock:
    """Per-token min-max codes at two widths.  low: uint8 ``[B, H_kv, n, ceil(D*lb/8)]``
    (``low_bits`` plane of every token); extra: uint8 ``[N_high, ceil(D*(hb-lb)/8)]`` (upper
    bits of high tokens, ``[n, B, H_kv]`` order); mask: uint8 ``[B, H_kv, ceil(n/8)]`` (1 bit
    per token: high); scale, zero: ``[B, H_kv, n, NG]`` (scale dtype)."""

    low: torch.Tensor
    extra: torch.Tensor
    mask: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    low_bits: int
    high_bits: int
    head_dim: int

    @property
    def ntokens(self) -> int:
        return self.scale.shape[2]

    def high(self) -> torch.Tensor:
        """Bool ``[B, H_kv, n]``: which tokens hold ``high_bits`` codes."""
        return unpack_bits(self.mask, 1, self.ntokens).bool()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        b, h, n, d = *self.low.shape[:3], self.head_dim
        codes = unpack_bits(self.low, self.low_bits, d).int().permute(2, 0, 1, 3)
        up = unpack_bits(self.extra, self.high_bits - self.low_bits, d).int()
        codes[self.high().permute(2, 0, 1)] += up << self.low_bits
        c = codes.permute(1, 2, 0, 3).float().reshape(b, h, n, self.scale.shape[-1], -1)
        x = c * self.scale.float()[..., None] + self.zero.float()[..., None]
        return x.reshape(b, h, n, d).to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        parts = ("codes", "low"), ("codes", "extra"), ("metadata", "mask"), ("scales", "scale")
        return [(cat, getattr(self, k)) for cat, k in (*parts, ("scales", "zero"))]

    def _with(self, high: torch.Tensor, extra: torch.Tensor, **kw) -> MixedTokenBlock:
        mask = pack_bits(high.to(torch.uint8), 1, check=False)  # 0/1 by construction
        return replace(self, mask=mask, extra=extra, **kw)

    def high_count(self) -> torch.Tensor:
        """Int64 ``[B, H_kv]``: high tokens per (row, KV head), from the mask's bytes (the
        bits past ``ntokens`` are zero)."""
        return _POPCOUNT.to(self.mask.device)[self.mask.long()].sum(-1)

    def cat(self, other: MixedTokenBlock) -> MixedTokenBlock:
        """Tokens of ``self`` then ``other``.  The masks' bit streams are joined at the tail
        of ``self``'s: only its last, partly filled byte is unpacked, so a one-token flush
        costs O(1) bit work (the per-token tensors are concatenated whole)."""
        n, whole = self.ntokens, self.ntokens // 8
        mask = self.mask[..., :whole]
        if n % 8:
            tail = unpack_bits(self.mask[..., whole:], 1, n - 8 * whole)
            bits = torch.cat([tail, unpack_bits(other.mask, 1, other.ntokens)], -1)
            mask = torch.cat([mask, pack_bits(bits, 1, check=False)], -1)
        else:
            mask = torch.cat([mask, other.mask], -1)
        cat2 = {k: torch.cat([getattr(self, k), getattr(other, k)], 2) for k in _PER_TOKEN}
        return replace(self, mask=mask, extra=torch.cat([self.extra, other.extra]), **cat2)

    def crop(self, n: int) -> MixedTokenBlock:
        high = self.high()[:, :, :n]
        kept = {k: own_storage(getattr(self, k)[:, :, :n]) for k in _PER_TOKEN}
        return self._with(high, own_storage(self.extra[: int(high.sum())]), **kept)

    def index_batch(self, idx: torch.Tensor) -> MixedTokenBlock:
        idx = idx.to(self.low.device).long()
        hi_t = self.high().permute(2, 0, 1)  # [n, B, H]
        rows = torch.full(hi_t.shape, -1, dtype=torch.long, device=hi_t.device)
        rows[hi_t] = torch.arange(int(hi_t.sum()), device=hi_t.device)
        extra = self.extra[rows[:, idx][hi_t[:, idx]]]
        sel = {k: getattr(self, k)[idx] for k in _PER_TOKEN}
        return self._with(self.high()[idx], extra, **sel)
