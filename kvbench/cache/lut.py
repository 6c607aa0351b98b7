"""The stored key block of ``kvquant``: level indices into a small table, per-channel centre and
half range, and exact sparse outliers, optionally pre-RoPE (Hooper et al., arXiv 2401.18079,
§3).  ``methods/kvquant.py`` (the codec) builds :class:`LUTBlock`;
``kvbench.kernels.cpu.lut`` reads it in the code domain."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvbench.cache.blocks import own_storage
from kvbench.cache.quant import unpack_bits
from kvbench.cache.rope import Rotary, rope


@dataclass
class LUTBlock:
    """Pre-RoPE keys as level indices plus exact outliers.  codes: uint8 ``[B, H_kv, n,
    ceil(D*bits/8)]``; center, half: static ``[H_kv, D]`` (scale dtype); lut: ``[2^bits]`` sorted
    levels; out_idx: int32 ``[N]`` flat indices into ``[n, B, H_kv, D]``, ascending; out_val: fp16
    ``[N]``.
    rotary: ``None`` for codes read as stored (``pre_rope=False``); else the :class:`Rotary`
    that reads add (pre-RoPE codes re-rotated at their positions): :meth:`dequantize` returns
    the post-RoPE keys, and the code-domain kernel rotates the query instead."""

    codes: torch.Tensor
    center: torch.Tensor
    half: torch.Tensor
    lut: torch.Tensor
    out_idx: torch.Tensor
    out_val: torch.Tensor
    bits: int
    head_dim: int
    rotary: Rotary | None = None

    @property
    def ntokens(self) -> int:
        return self.codes.shape[2]

    def _row(self) -> int:  # elements of one token over B and H_kv
        return self.codes.shape[0] * self.codes.shape[1] * self.head_dim

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        b, h, n, _ = self.codes.shape
        codes = unpack_bits(self.codes, self.bits, self.head_dim).long()
        u = self.lut.float()[codes]
        x = u * self.half.float()[:, None, :] + self.center.float()[:, None, :]
        xt = x.permute(2, 0, 1, 3).reshape(-1).clone()
        xt[self.out_idx.long()] = self.out_val.float()
        x = xt.reshape(n, b, h, self.head_dim).permute(1, 2, 0, 3)
        if self.rotary is not None:
            r = self.rotary
            x = rope(x, r.start, r.theta, r.layout)
        return x.to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        meta = [("metadata", t) for t in (self.lut, self.out_idx, self.out_val)]
        return [("codes", self.codes), ("scales", self.center), ("scales", self.half), *meta]

    def cat(self, other: LUTBlock) -> LUTBlock:
        r, o = self.rotary, other.rotary
        if (r is None) != (o is None) or (
            r is not None
            and (o.theta, o.layout, o.start) != (r.theta, r.layout, r.start + self.ntokens)
        ):
            raise ValueError("cannot concatenate LUT blocks of different RoPE positions/settings")
        idx = torch.cat([self.out_idx, other.out_idx + self._row() * self.ntokens])
        codes = torch.cat([self.codes, other.codes], 2)
        val = torch.cat([self.out_val, other.out_val])
        return replace(self, codes=codes, out_idx=idx, out_val=val)

    @staticmethod
    def join(parts: list[LUTBlock]) -> LUTBlock:
        """One block of ``parts`` (consecutive runs of tokens with one set of thresholds and
        one ``rotary``, e.g. the chunks of one encode) in one concatenation: the outlier
        indices of each part offset by the tokens before it."""
        if len(parts) == 1:
            return parts[0]
        offs, n = [], 0
        for p in parts:
            offs.append(n)
            n += p.ntokens
        row = parts[0]._row()
        idx = torch.cat([p.out_idx + row * o for p, o in zip(parts, offs)])
        codes = torch.cat([p.codes for p in parts], 2)
        val = torch.cat([p.out_val for p in parts])
        return replace(parts[0], codes=codes, out_idx=idx, out_val=val)

    def crop(self, n: int) -> LUTBlock:
        keep, codes = self.out_idx < self._row() * n, own_storage(self.codes[:, :, :n])
        return replace(self, codes=codes, out_idx=self.out_idx[keep], out_val=self.out_val[keep])

    def index_batch(self, idx: torch.Tensor) -> LUTBlock:
        idx = idx.to(self.codes.device).long()
        row, hd = self._row(), self._row() // self.codes.shape[0]
        t, rem = self.out_idx.long() // row, self.out_idx.long() % row
        i, j = (rem[:, None] // hd == idx[None, :]).nonzero(as_tuple=True)
        new_idx, codes = (t[i] * (len(idx) * hd) + j * hd + rem[i] % hd).int(), self.codes[idx]
        order = torch.argsort(new_idx)  # kept ascending (the native kernel walks them in order)
        return replace(self, codes=codes, out_idx=new_idx[order], out_val=self.out_val[i][order])
