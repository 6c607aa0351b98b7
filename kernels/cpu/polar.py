"""Code-domain keys of :class:`kvbench.methods.polarquant.PolarBlock` (``polarquant``'s blocks): a
per-page table of the query's projections on the angle levels, read at the angle codes.
Registered in :mod:`kvbench.kernels.cpu.codedomain`."""

from __future__ import annotations

import torch

from kvbench.cache.quant import unpack_bits
from kvbench.kernels.cpu import native
from kvbench.kernels.cpu.affine import (
    EAGER_CHUNK_TOKENS,
    affine_terms,
    native_allowed,
    note_impl,
)
from kvbench.methods.polarquant import PolarBlock, split_pairs


class PolarAttention:
    """Code-domain keys of :class:`PolarBlock` (a block kernel).

    For pair ``j`` of token ``t`` in page ``P``, ``q . k = r_tj (qa_j cos θ_tj + qb_j sin θ_tj)``
    with ``r = c^r a^r_P + b^r_P`` and ``θ`` one of the page's ``2^angle_bits`` levels, so the
    step builds the table ``T_P[j, l] = qa_j cos θ_l + qb_j sin θ_l`` per page (once per query)
    and reads it at the angle codes (PolarQuant's table lookup, Wu et al. §3): native where
    allowed (:func:`kvbench.kernels.cpu.native.keys_polar`, one pass over the codes), else eager in
    chunks of pages.  Keys only."""

    def key_reason(self, block: PolarBlock, head_dim: int) -> str | None:
        lens = block.radius.group_len
        if not lens or any(x != lens[0] for x in lens[:-1]) or lens[-1] > lens[0]:
            return "polar key pages are not of one length"
        if block.radius.group_len != block.angle.group_len:
            return "radius and angle pages differ"
        return None

    def value_reason(self, block: PolarBlock, head_dim: int) -> str | None:
        return "PolarQuant is a key layout"

    def key_logits(self, block: PolarBlock, q: torch.Tensor) -> torch.Tensor:
        rad, ang = block.radius, block.angle
        bsz, h, m, d = q.shape
        d2, length, n = d // 2, rad.group_len[0], rad.ntokens
        qa, qb = split_pairs(q, block.pairing)  # [B, H, M, D/2]
        ar, br = affine_terms(rad)
        at, bt = affine_terms(ang)
        lv = torch.arange(1 << ang.bits, device=q.device, dtype=torch.float32)
        if (
            native_allowed()
            and rad.codes.device.type == "cpu"
            and max(rad.bits, ang.bits) <= 8
            and native.available()
        ):  # the page tables for every query row, then one pass over the codes
            theta = at[..., None] * lv + bt[..., None]  # [B, H, NP, D/2, K]
            tab = qa[:, :, None, :, :, None] * torch.cos(theta).unsqueeze(3) + qb[
                :, :, None, :, :, None
            ] * torch.sin(theta).unsqueeze(3)  # [B, H, NP, M, D/2, K]
            tab = tab.expand(bsz, h, *tab.shape[2:])
            npg = tab.shape[2]
            ar, br = (x.expand(bsz, h, npg, d2) for x in (ar, br))
            note_impl("native")
            return native.keys_polar(rad.codes, ang.codes, ar, br, tab, length, rad.bits, ang.bits)
        step = max(1, EAGER_CHUNK_TOKENS // length)
        outs = []
        for p0 in range(0, len(rad.group_len), step):
            p1 = min(p0 + step, len(rad.group_len))
            t0, t1 = p0 * length, min(p1 * length, n)
            npg = p1 - p0
            pad = npg * length - (t1 - t0)  # a shorter last page: pad its codes
            cr = unpack_bits(rad.codes[:, :, t0:t1], rad.bits, d2).float()
            ct = unpack_bits(ang.codes[:, :, t0:t1], ang.bits, d2).long()
            if pad:
                cr = torch.nn.functional.pad(cr, (0, 0, 0, pad))
                ct = torch.nn.functional.pad(ct, (0, 0, 0, pad))
            cr = cr.reshape(bsz, h, npg, length, d2)
            ct = ct.reshape(bsz, h, npg, length, d2)
            theta = at[:, :, p0:p1, :, None] * lv + bt[:, :, p0:p1, :, None]  # [B, H, np, D/2, K]
            tab = qa[:, :, :, None, :, None] * torch.cos(theta).unsqueeze(2) + qb[
                :, :, :, None, :, None
            ] * torch.sin(theta).unsqueeze(2)  # [B, H, M, np, D/2, K]
            tab = tab.expand(bsz, h, m, npg, d2, tab.shape[-1])
            idx = ct.unsqueeze(2).expand(bsz, h, m, npg, length, d2)
            sel = tab.unsqueeze(4).expand(bsz, h, m, npg, length, d2, tab.shape[-1])
            sel = sel.gather(-1, idx.unsqueeze(-1)).squeeze(-1)  # [B, H, M, np, L, D/2]
            r = cr * ar[:, :, p0:p1].unsqueeze(3) + br[:, :, p0:p1].unsqueeze(3)
            lg = (sel * r.unsqueeze(2)).sum(-1).reshape(bsz, h, m, npg * length)
            outs.append(lg[..., : t1 - t0])
        return torch.cat(outs, -1) if len(outs) > 1 else outs[0]

    def value_output(self, block: PolarBlock, p: torch.Tensor) -> torch.Tensor:
        raise ValueError(self.value_reason(block, 0))
