"""Code-domain keys of :class:`kvbench.methods.kvquant.LUTBlock` (``kvquant``'s blocks): dense
table lookups plus sparse outlier corrections, with the query turned instead of the keys for
pre-RoPE codes.  Registered in :mod:`kvbench.kernels.cpu.codedomain`."""

from __future__ import annotations

import torch

from kvbench.cache.quant import unpack_bits
from kvbench.cache.rope import rope_angles, rope_pairs
from kvbench.kernels.cpu import native
from kvbench.kernels.cpu.affine import EAGER_CHUNK_TOKENS, native_allowed, note_impl
from kvbench.methods.kvquant import LUTBlock


def _dense_eager(block: LUTBlock, qk: torch.Tensor, lut: torch.Tensor, rot) -> torch.Tensor:
    """The dense logits of :class:`LUTAttention` in torch, in chunks of tokens: ``qk [B, H, M,
    D]`` (``q * half``) against ``lut[c_t]``, or with ``rot = (cos, sin, first, second)`` ``qk
    [B, H, M, 2D]`` against ``[u_i C, u_j C, u_i S, u_j S]``."""
    d, n, chunk = block.head_dim, block.ntokens, EAGER_CHUNK_TOKENS
    outs = []
    for t0 in range(0, n, chunk):
        c = unpack_bits(block.codes[:, :, t0 : t0 + chunk], block.bits, d)
        u = lut[c.long()]  # [B, H, n_c, D]
        if rot is not None:
            cos, sin, i1, i2 = rot
            cs, sn = cos[t0 : t0 + chunk], sin[t0 : t0 + chunk]
            u1, u2 = u[..., i1], u[..., i2]
            u = torch.cat([u1 * cs, u2 * cs, u1 * sn, u2 * sn], -1)
        outs.append(torch.matmul(qk, u.transpose(-1, -2)))
    return torch.cat(outs, -1) if len(outs) > 1 else outs[0]


class LUTAttention:
    """Code-domain keys of :class:`LUTBlock` (a block kernel).

    Codes read as stored (``pre_rope=False``): ``q . k_t = (q * half) . lut[c_t] + q .
    center`` for the dense part, plus, for each sparse outlier ``(t, d)``, ``q_d (value -
    dense_{t,d})`` (KVQuant's dense-and-sparse split, Hooper et al., arXiv 2401.18079 §3.4).

    Pre-RoPE codes (``block.rotary``, KVQuant §3.1): ``q . R(p_t) k~_t = (R(-p_t) q) . k~_t``,
    with RoPE pairs ``(a, b) = (k~_i, k~_j)`` of the pre-RoPE key ``k~ = lut[c] * half +
    center`` and ``C, S = cos, sin`` of the angle of pair ``i`` at ``p_t``: the dense part is
    one product of the query-side ``[h_i q_i, h_j q_j, h_i q_j, -h_j q_i]`` with the key-side
    ``[u_i C, u_j C, u_i S, u_j S]`` (``u = lut[c]``), the centre part ``[c_i q_i + c_j q_j,
    c_i q_j - c_j q_i] . [C, S]``, and an outlier at channel ``d`` adds ``(value - dense)
    (R(-p_t) q)_d``: no rotated key is formed.  Eager: unpack + a ``2^bits``-entry lookup +
    matmul in chunks of tokens (the angle tables are cached, :func:`rope_angles`).  Native
    where allowed (:func:`kvbench.kernels.cpu.native.keys_lut_outliers`): each token's key is
    dequantized in registers (table, half, centre, its outliers placed), turned by its cos/sin
    row and dotted with the query rows; nothing is written back."""

    def key_reason(self, block: LUTBlock, head_dim: int) -> str | None:
        return None

    def value_reason(self, block: LUTBlock, head_dim: int) -> str | None:
        return "KVQuant's LUT codes are a key layout"

    def key_logits(self, block: LUTBlock, q: torch.Tensor) -> torch.Tensor:
        b, h, n, _ = block.codes.shape
        d, rot, dev = block.head_dim, block.rotary, q.device
        lut = block.lut.float().to(dev)
        if rot is not None:
            i1, i2 = (i.to(dev) for i in rope_pairs(d, rot.layout))
            cos, sin = (t.to(dev) for t in rope_angles(rot.start, n, d, rot.theta, dev))
        if native_allowed() and native.supports(block.codes, block.bits, d):
            note_impl("native")
            return native.keys_lut_outliers(
                block.codes, q, lut, block.half, block.center, block.out_idx, block.out_val,
                block.bits, None if rot is None else (cos, sin, i1, i2),
            )  # fmt: skip
        half = block.half.float().to(dev)[None, :, None, :]  # [1, H, 1, D]
        center = block.center.float().to(dev)[None, :, None, :]
        if rot is not None:
            q1, q2, h1, h2 = q[..., i1], q[..., i2], half[..., i1], half[..., i2]
            c1, c2 = center[..., i1], center[..., i2]
            qk = torch.cat([h1 * q1, h2 * q2, h1 * q2, -(h2 * q1)], -1)  # [B, H, M, 2D]
            qc = torch.cat([c1 * q1 + c2 * q2, c1 * q2 - c2 * q1], -1)  # [B, H, M, D]
        else:
            qk = q * half
        lg = _dense_eager(block, qk, lut, None if rot is None else (cos, sin, i1, i2))
        if rot is not None:
            lg = lg + torch.matmul(qc, torch.cat([cos, sin], -1).transpose(0, 1))
        else:
            lg = lg + (q * center).sum(-1, keepdim=True)
        if block.out_idx.numel():
            idx = block.out_idx.long().to(dev)
            t, rem = idx // (b * h * d), idx % (b * h * d)
            bi, hi, di = rem // (h * d), (rem // d) % h, rem % d
            bit0 = di * block.bits
            code = torch.zeros_like(di)
            for k in range(block.bits):  # the outlier's dense code, bit by bit (LSB first)
                pos = bit0 + k
                byte = block.codes[bi, hi, t, pos // 8].long()
                code |= ((byte >> (pos % 8)) & 1) << k
            dense = lut[code] * half[0, hi, 0, di] + center[0, hi, 0, di]
            delta = block.out_val.float().to(dev) - dense  # [N]
            qd = q[bi, hi, :, di]  # [N, M]
            if rot is not None:  # (R(-p_t) q)_d: pair i of d, its partner and sign
                first = torch.zeros(d, dtype=torch.bool, device=dev)
                first[i1] = True
                pair = torch.empty(d, dtype=torch.long, device=dev)
                pair[i1] = pair[i2] = torch.arange(d // 2, device=dev)
                partner = torch.empty(d, dtype=torch.long, device=dev)
                partner[i1], partner[i2] = i2, i1
                pi, sgn = pair[di], torch.where(first[di], 1.0, -1.0)
                qp = q[bi, hi, :, partner[di]]
                qd = qd * cos[t, pi][:, None] + (sgn * sin[t, pi])[:, None] * qp
            contrib = qd * delta[:, None]  # [N, M]
            flat = lg.permute(0, 1, 3, 2).reshape(-1, lg.shape[2])  # rows (b, h, t)
            flat.index_add_(0, (bi * h + hi) * n + t, contrib)
            lg = flat.reshape(b, h, n, -1).permute(0, 1, 3, 2)
        return lg

    def value_output(self, block: LUTBlock, p: torch.Tensor) -> torch.Tensor:
        raise ValueError(self.value_reason(block, 0))
