"""Fused decode attention over mixed-precision quantized pages (flash-decoding split-KV).

One query token per sequence attends to everything its layer cache holds, read in place:

* sinks: the first ``S`` tokens, full precision (K and V);
* quantized keys: pages of ``G`` tokens stored per channel (KIVI sense) as packed codes with
  one (scale, zero) per channel per page; uniform (KIVI) or two channel classes at different
  widths in a class-sorted order given by ``perm`` (Kitty: one perm per page; PN-Mix: one for
  all pages), 1-bit classes optionally with the midpoint reconstruction (PN-Mix Eq. 7 [RECON]);
* quantized values: per token (KIVI values), packed codes with one (scale, zero) per token per
  channel group; or no quantized values (``value_bits=16``);
* full-precision residuals of keys and values (their lengths differ: KIVI's key residual
  cycles 0..R-1 while the value residual is a sliding window of R).

Storage is exactly that of :class:`kvbench.cache.blocks.AffineBlock` and
:class:`kvbench.cache.mixed_channel.MixedChannelBlock`; :mod:`.dispatch` passes a LayerCache's tensors
straight in.  Codes are dequantized in registers (``code * scale + zero`` in float32, cast to
the query dtype as the reference path's ``keys_values(query.dtype)`` does) and never written
back.  Query heads share their KV head's pages (GQA: query head ``h`` reads KV head
``h // (H_q / H_kv)``): one program handles all query heads of a KV head (padded to 16 rows
for ``tl.dot``), so each page is read once per KV head, not once per query head.

Split-KV.  Token tiles of ``BLOCK_N`` (a divisor of G, so a tile lies in one page and its
per-channel scales broadcast over the tile's tokens) are dealt to ``num_splits`` programs per
(sequence, KV head) in contiguous runs of equal *cost*: a full-precision tile counts ``W``
quantized tiles (``W`` = bytes ratio), so the programs that get the sinks or the residual do
not become the stragglers.  Each program keeps a running max ``m``, sum ``l`` and output
``acc`` (exp2 softmax, the logit scale pre-multiplied by log2 e) and writes
``(acc / l, m + log2 l)``; a merge kernel combines the splits (``w_i = 2^(lse_i - max lse)``,
``out = sum w_i o_i / sum w_i``); :func:`merge_reference` is the same merge in torch.

The control (:func:`split_kv_attention`) is this kernel with no quantized parts: fp16 K/V,
same tiling, same merge.  Sequences of a batch may have their own lengths (``lengths``).
Only head_dim 64 and 128 are compiled; other head dims raise ``ValueError`` (kernel hard-codes head_dim / block size: triton-lang/triton#621, docs/methods.md#kernel-hard-codes-the-head-dimension:
never silently truncate).

Only torch and triton are imported (no kvbench core).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._triton import check_device, jit, next_pow2, tl, triton
from .pack import unpack_tile
from .quantize import check_class_layout

SUPPORTED_HEAD_DIMS = (64, 128)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634
MAX_SPLITS = 128  # the merge kernel holds every split of a head in registers


# --------------------------------------------------------------------------------------------
# Storage descriptions (the core's layouts, as plain tensors)
# --------------------------------------------------------------------------------------------


@dataclass
class QuantKeys:
    """Per-channel quantized key pages (KIVI / Kitty / PN-Mix layout).

    Attributes
    ----------
    codes : uint8 ``[B, H_kv, n, RB]``: each token's class-sorted LSB-first bit stream.
    scale, zero : ``[B|1, H_kv, NP, D]`` float16/bfloat16/float32, class-sorted channel order,
        one per channel per page of ``group_size`` tokens (page ``t // group_size``).
    group_size : G.
    class_bits, class_counts : width and channel count of each class (one or two non-empty).
    perm : integer ``[B|1, H_kv, NP|1, D]``: original channel at each sorted position, per page
        or fixed; ``None`` = identity.
    midpoint : 1-bit classes use the midpoint reconstruction.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    class_bits: tuple[int, ...]
    class_counts: tuple[int, ...]
    perm: torch.Tensor | None = None
    midpoint: bool = False


@dataclass
class QuantValues:
    """Per-token quantized values (KIVI layout).

    Attributes
    ----------
    codes : uint8 ``[B, H_kv, n, ceil(D*bits/8)]``.
    scale, zero : ``[B, H_kv, n, D / channel_group]``.
    bits : 1..8.
    midpoint : 1-bit midpoint reconstruction.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    midpoint: bool = False


# --------------------------------------------------------------------------------------------
# PyTorch references
# --------------------------------------------------------------------------------------------


def _unpack_ref(packed: torch.Tensor, bits: int, n: int, start_bit: int = 0) -> torch.Tensor:
    stream = ((packed.long().unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1).flatten(
        -2
    )
    seg = stream[..., start_bit : start_bit + n * bits].reshape(*packed.shape[:-1], n, bits)
    return (seg << torch.arange(bits, device=packed.device)).sum(-1)


def dequantize_keys_reference(k: QuantKeys, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Keys ``[B, H_kv, n, D]`` in the original channel order (float32 math, cast to ``dtype``)."""
    b, h, n, _ = k.codes.shape
    d = sum(k.class_counts)
    parts, start, pos = [], 0, 0
    s = k.scale.float().repeat_interleave(k.group_size, dim=2)[:, :, :n]
    z = k.zero.float().repeat_interleave(k.group_size, dim=2)[:, :, :n]
    for bits, cnt in zip(k.class_bits, k.class_counts):
        if cnt:
            c = _unpack_ref(k.codes, bits, cnt, start).float()
            sl = slice(pos, pos + cnt)
            if k.midpoint and bits == 1:
                parts.append(c * (s[..., sl] * 0.5) + (z[..., sl] + s[..., sl] * 0.25))
            else:
                parts.append(c * s[..., sl] + z[..., sl])
        start += bits * cnt
        pos += cnt
    x = torch.cat(parts, -1).expand(b, h, n, d)
    if k.perm is not None:
        p = k.perm.long()
        p = p.repeat_interleave(k.group_size, dim=2)[:, :, :n] if p.shape[2] > 1 else p
        x = torch.empty_like(x).scatter_(-1, p.expand(b, h, n, d), x)
    return x.to(dtype)


def dequantize_values_reference(
    v: QuantValues, dtype: torch.dtype = torch.float32, head_dim: int | None = None
) -> torch.Tensor:
    """Values ``[B, H_kv, n, D]`` (float32 math, cast to ``dtype``); ``head_dim`` defaults to
    the largest multiple of 8 whose codes fill the rows."""
    b, h, n, rb = v.codes.shape
    ncg = v.scale.shape[-1]
    d = head_dim or rb * 8 // v.bits // 8 * 8
    c = _unpack_ref(v.codes, v.bits, d).float().reshape(b, h, n, ncg, d // ncg)
    s, z = v.scale.float().unsqueeze(-1), v.zero.float().unsqueeze(-1)
    x = c * (s * 0.5) + (z + s * 0.25) if v.midpoint and v.bits == 1 else c * s + z
    return x.reshape(b, h, n, d).to(dtype)


def decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
    seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 attention of one query per sequence: ``query [B, H_q, 1, D]`` over ``keys,
    values [B, H_kv, T, D]`` (GQA by ``h // (H_q/H_kv)``); ``seq_lens [B]`` masks keys beyond
    each sequence's length.  Returns ``[B, H_q, 1, D]`` float64."""
    b, hq, _, d = query.shape
    rep = hq // keys.shape[1]
    k = keys.double().repeat_interleave(rep, 1)
    v = values.double().repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(d) if scaling is None else scaling
    logits = query.double() @ k.transpose(-1, -2) * scale
    if seq_lens is not None:
        t = torch.arange(keys.shape[2], device=keys.device)
        logits = logits.masked_fill(t >= seq_lens.view(b, 1, 1, 1).to(keys.device), -math.inf)
    return torch.softmax(logits, -1) @ v


def merge_reference(part_o: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """Merge split partials: ``part_o [B, H_q, S, D]`` (each normalized by its own sum) and
    ``part_lse [B, H_q, S]`` (base-2 log-sum-exp of the scaled logits; -inf for an empty
    split) -> ``[B, H_q, 1, D]`` float32."""
    m = part_lse.amax(-1, keepdim=True)
    w = torch.exp2(part_lse - m)
    return ((w.unsqueeze(-1) * part_o).sum(2) / w.sum(-1, keepdim=True)).unsqueeze(2)


# --------------------------------------------------------------------------------------------
# Triton helpers
# --------------------------------------------------------------------------------------------


@jit
def _online_softmax(qk, tmask, v, m_i, l_i, acc, qk_scale, DOT_IEEE: tl.constexpr):
    # qk: [BLOCK_H, BN] fp32 raw logits; v: [BN, D] in the query dtype
    s = tl.where(tmask[None, :], qk * qk_scale, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@jit
def _qk(q, k, DOT_IEEE: tl.constexpr):
    # q: [BLOCK_H, C], k: [BN, C] -> [BLOCK_H, BN] fp32
    if DOT_IEEE:
        r = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        r = tl.dot(q, tl.trans(k))
    return r


@jit
def _query_class(
    q_rows,
    hmask,
    perm_row,
    POS0: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    HAS_PERM: tl.constexpr,
):
    # query channels at sorted positions POS0 .. POS0+N-1 (zero-padded to NP): [BLOCK_H, NP]
    i = tl.arange(0, NP)
    im = i < N
    if HAS_PERM:
        ch = tl.load(perm_row + POS0 + i, mask=im, other=0).to(tl.int32)
    else:
        ch = POS0 + i
    return tl.load(q_rows[:, None] + ch[None, :], mask=hmask[:, None] & im[None, :], other=0.0)


@jit
def _key_class(
    rows,
    tmask,
    scale_row,
    zero_row,
    RB,
    POS0: tl.constexpr,
    BYTE0: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    BITS: tl.constexpr,
    MID: tl.constexpr,
    BN: tl.constexpr,
    OUT: tl.constexpr,
):
    # dequantized keys of one class, sorted order, [BN, NP] (padding channels are 0)
    codes = unpack_tile(rows, tmask, BYTE0, RB, BN, NP, BITS)
    i = tl.arange(0, NP)
    im = i < N
    s = tl.load(scale_row + POS0 + i, mask=im, other=0.0).to(tl.float32)
    z = tl.load(zero_row + POS0 + i, mask=im, other=0.0).to(tl.float32)
    if MID:  # kvbench.cache.quant.dequantize_groups: c * (s/2) + (z + s/4)
        z = z + s * 0.25
        s = s * 0.5
    return (codes.to(tl.float32) * s[None, :] + z[None, :]).to(OUT)


@jit
def _dequant_values(
    rows,
    tmask,
    scale_rows,
    zero_rows,
    RB,
    D: tl.constexpr,
    BN: tl.constexpr,
    BITS: tl.constexpr,
    CG: tl.constexpr,
    MID: tl.constexpr,
    OUT: tl.constexpr,
):
    # per-token values [BN, D]; scale_rows/zero_rows: [BN] pointers to each token's groups
    codes = unpack_tile(rows, tmask, 0, RB, BN, D, BITS).to(tl.float32)
    NCG: tl.constexpr = D // CG
    if NCG == 1:
        s = tl.load(scale_rows, mask=tmask, other=0.0).to(tl.float32)[:, None]
        z = tl.load(zero_rows, mask=tmask, other=0.0).to(tl.float32)[:, None]
    else:
        g = tl.arange(0, NCG)
        s2 = tl.load(scale_rows[:, None] + g[None, :], mask=tmask[:, None], other=0.0)
        z2 = tl.load(zero_rows[:, None] + g[None, :], mask=tmask[:, None], other=0.0)
        s = tl.reshape(tl.broadcast_to(s2.to(tl.float32)[:, :, None], (BN, NCG, CG)), (BN, D))
        z = tl.reshape(tl.broadcast_to(z2.to(tl.float32)[:, :, None], (BN, NCG, CG)), (BN, D))
    if MID:
        z = z + s * 0.25
        s = s * 0.5
    return (codes * s + z).to(OUT)


@jit
def _load_fp(base, idx, mask, stride_t, D: tl.constexpr, OUT: tl.constexpr):
    d = tl.arange(0, D)
    x = tl.load(
        base + idx.to(tl.int64)[:, None] * stride_t + d[None, :], mask=mask[:, None], other=0.0
    )
    return x.to(OUT)


@jit
def _load_values(
    u0,
    u,
    umask,
    VQ,
    vr_base,
    svr_t,
    vc_base,
    svc_t,
    vq_base,
    vz_base,
    svq_t,
    RBV,
    D: tl.constexpr,
    BN: tl.constexpr,
    V_QUANT: tl.constexpr,
    VBITS: tl.constexpr,
    VCG: tl.constexpr,
    V_MID: tl.constexpr,
    OUT: tl.constexpr,
):
    # values of the tokens u (counted from the first token after the sinks): quantized for
    # u < VQ, else the value residual at u - VQ; u0 = the tile's first u
    if V_QUANT:
        u64 = u.to(tl.int64)
        if u0 + BN <= VQ:
            v = _dequant_values(
                vc_base + u64 * svc_t,
                umask,
                vq_base + u64 * svq_t,
                vz_base + u64 * svq_t,
                RBV,
                D,
                BN,
                VBITS,
                VCG,
                V_MID,
                OUT,
            )
        elif u0 >= VQ:
            v = _load_fp(vr_base, u - VQ, umask, svr_t, D, OUT)
        else:
            inq = u < VQ
            vq = _dequant_values(
                vc_base + u64 * svc_t,
                umask & inq,
                vq_base + u64 * svq_t,
                vz_base + u64 * svq_t,
                RBV,
                D,
                BN,
                VBITS,
                VCG,
                V_MID,
                OUT,
            )
            vf = _load_fp(vr_base, u - VQ, umask & (u >= VQ), svr_t, D, OUT)
            v = tl.where(inq[:, None], vq, vf)
    else:
        v = _load_fp(vr_base, u, umask, svr_t, D, OUT)
    return v


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@jit
def _decode_kernel(
    q_ptr,
    po_ptr,
    pl_ptr,
    lens_ptr,
    ks_ptr,
    kr_ptr,
    kc_ptr,
    kq_ptr,
    kz_ptr,
    kp_ptr,
    vs_ptr,
    vr_ptr,
    vc_ptr,
    vq_ptr,
    vz_ptr,
    S_u,
    KQ_u,
    KR_u,
    VQ_u,
    VR_u,
    H_KV,
    N_REP,
    NUM_SPLITS,
    W,
    qk_scale,
    G,
    RBK,
    RBV,
    sq_b,
    sq_h,
    so_b,
    so_h,
    so_s,
    sl_b,
    sl_h,
    sks_b,
    sks_h,
    sks_t,
    skr_b,
    skr_h,
    skr_t,
    skc_b,
    skc_h,
    skc_t,
    skq_b,
    skq_h,
    skq_p,
    skp_b,
    skp_h,
    skp_p,
    svs_b,
    svs_h,
    svs_t,
    svr_b,
    svr_h,
    svr_t,
    svc_b,
    svc_h,
    svc_t,
    svq_b,
    svq_h,
    svq_t,
    D: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PER_SEQ: tl.constexpr,
    K_QUANT: tl.constexpr,
    NCLS: tl.constexpr,
    B0: tl.constexpr,
    N0: tl.constexpr,
    NP0: tl.constexpr,
    B1: tl.constexpr,
    N1: tl.constexpr,
    NP1: tl.constexpr,
    MID0: tl.constexpr,
    MID1: tl.constexpr,
    PERM_MODE: tl.constexpr,
    V_QUANT: tl.constexpr,
    VBITS: tl.constexpr,
    VCG: tl.constexpr,
    V_MID: tl.constexpr,
    DOT_IEEE: tl.constexpr,
):
    # grid: (B * H_kv, NUM_SPLITS); program = (sequence b, KV head hk, split)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H_KV).to(tl.int64)
    hk = (pid % H_KV).to(tl.int64)
    OUT = q_ptr.dtype.element_ty
    if PER_SEQ:  # lengths [B, 5]: sinks, key quantized, key residual, value quant., value res.
        S = tl.load(lens_ptr + b * 5 + 0)
        KQ = tl.load(lens_ptr + b * 5 + 1)
        KR = tl.load(lens_ptr + b * 5 + 2)
        VQ = tl.load(lens_ptr + b * 5 + 3)
    else:
        S = S_u
        KQ = KQ_u
        KR = KR_u
        VQ = VQ_u

    # ---- this split's tiles: cost-weighted contiguous ranges over [sinks | quant | residual]
    n_s = tl.cdiv(S, BN)
    n_q = tl.cdiv(KQ, BN)
    n_r = tl.cdiv(KR, BN)
    total = n_s * W + n_q + n_r * W
    per = tl.cdiv(total, NUM_SPLITS)
    c0 = split * per
    c1 = tl.minimum(c0 + per, total)
    s_lo = tl.minimum(tl.cdiv(c0, W), n_s)
    s_hi = tl.minimum(tl.cdiv(c1, W), n_s)
    q_lo = tl.minimum(tl.maximum(c0 - n_s * W, 0), n_q)
    q_hi = tl.minimum(tl.maximum(c1 - n_s * W, 0), n_q)
    base = n_s * W + n_q
    r_lo = tl.minimum(tl.cdiv(tl.maximum(c0 - base, 0), W), n_r)
    r_hi = tl.minimum(tl.cdiv(tl.maximum(c1 - base, 0), W), n_r)

    # ---- queries of this KV head's group: [BLOCK_H, D]
    r = tl.arange(0, BLOCK_H)
    hmask = r < N_REP
    hq = hk * N_REP + r
    q_rows = q_ptr + b * sq_b + hq * sq_h
    d = tl.arange(0, D)
    q_full = tl.load(q_rows[:, None] + d[None, :], mask=hmask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    n_idx = tl.arange(0, BN)

    vr_base = vr_ptr + b * svr_b + hk * svr_h
    vc_base = vc_ptr + b * svc_b + hk * svc_h
    vq_base = vq_ptr + b * svq_b + hk * svq_h
    vz_base = vz_ptr + b * svq_b + hk * svq_h

    # ---- sinks: full-precision K and V
    ks_base = ks_ptr + b * sks_b + hk * sks_h
    vs_base = vs_ptr + b * svs_b + hk * svs_h
    for j in range(s_lo, s_hi):
        t = j * BN + n_idx
        tm = t < S
        k = _load_fp(ks_base, t, tm, sks_t, D, OUT)
        v = _load_fp(vs_base, t, tm, svs_t, D, OUT)
        m_i, l_i, acc = _online_softmax(
            _qk(q_full, k, DOT_IEEE), tm, v, m_i, l_i, acc, qk_scale, DOT_IEEE
        )

    # ---- quantized key pages
    if K_QUANT:
        kc_base = kc_ptr + b * skc_b + hk * skc_h
        kq_base = kq_ptr + b * skq_b + hk * skq_h
        kz_base = kz_ptr + b * skq_b + hk * skq_h
        kp_base = kp_ptr + b * skp_b + hk * skp_h
        if PERM_MODE == 0:
            q0 = q_full
        else:
            q0 = _query_class(q_rows, hmask, kp_base, 0, N0, NP0, True)
            if NCLS == 2:
                q1 = _query_class(q_rows, hmask, kp_base, N0, N1, NP1, True)
        for j in range(q_lo, q_hi):
            u = j * BN + n_idx
            tm = u < KQ
            page = (j * BN) // G
            if PERM_MODE == 2:  # a selection per page (Kitty)
                p_row = kp_base + page * skp_p
                q0 = _query_class(q_rows, hmask, p_row, 0, N0, NP0, True)
                if NCLS == 2:
                    q1 = _query_class(q_rows, hmask, p_row, N0, N1, NP1, True)
            rows = kc_base + u.to(tl.int64) * skc_t
            s_row = kq_base + page * skq_p
            z_row = kz_base + page * skq_p
            k0 = _key_class(rows, tm, s_row, z_row, RBK, 0, 0, N0, NP0, B0, MID0, BN, OUT)
            qk = _qk(q0, k0, DOT_IEEE)
            if NCLS == 2:
                k1 = _key_class(
                    rows, tm, s_row, z_row, RBK, N0, N0 * B0 // 8, N1, NP1, B1, MID1, BN, OUT
                )
                qk += _qk(q1, k1, DOT_IEEE)
            v = _load_values(
                j * BN,
                u,
                tm,
                VQ,
                vr_base,
                svr_t,
                vc_base,
                svc_t,
                vq_base,
                vz_base,
                svq_t,
                RBV,
                D,
                BN,
                V_QUANT,
                VBITS,
                VCG,
                V_MID,
                OUT,
            )
            m_i, l_i, acc = _online_softmax(qk, tm, v, m_i, l_i, acc, qk_scale, DOT_IEEE)

    # ---- key residual: full-precision K, values quantized or residual
    kr_base = kr_ptr + b * skr_b + hk * skr_h
    for j in range(r_lo, r_hi):
        w = j * BN + n_idx
        tm = w < KR
        k = _load_fp(kr_base, w, tm, skr_t, D, OUT)
        v = _load_values(
            KQ + j * BN,
            KQ + w,
            tm,
            VQ,
            vr_base,
            svr_t,
            vc_base,
            svc_t,
            vq_base,
            vz_base,
            svq_t,
            RBV,
            D,
            BN,
            V_QUANT,
            VBITS,
            VCG,
            V_MID,
            OUT,
        )
        m_i, l_i, acc = _online_softmax(
            _qk(q_full, k, DOT_IEEE), tm, v, m_i, l_i, acc, qk_scale, DOT_IEEE
        )

    # ---- partial result of this split
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf"))
    tl.store(
        po_ptr + b * so_b + hq[:, None] * so_h + split * so_s + d[None, :], o, mask=hmask[:, None]
    )
    tl.store(pl_ptr + b * sl_b + hq * sl_h + split, lse, mask=hmask)


@jit
def _merge_kernel(
    po_ptr,
    pl_ptr,
    out_ptr,
    H_Q,
    NUM_SPLITS,
    so_b,
    so_h,
    so_s,
    sl_b,
    sl_h,
    sout_b,
    sout_h,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # grid: (B * H_q,); combines the NUM_SPLITS partials of one (sequence, query head)
    pid = tl.program_id(0)
    b = (pid // H_Q).to(tl.int64)
    h = (pid % H_Q).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    sm = s < NUM_SPLITS
    d = tl.arange(0, D)
    lse = tl.load(pl_ptr + b * sl_b + h * sl_h + s, mask=sm, other=-float("inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - m)
    o = tl.load(
        po_ptr + b * so_b + h * so_h + s[:, None] * so_s + d[None, :], mask=sm[:, None], other=0.0
    )
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * sout_b + h * sout_h + d, out.to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------


def _strides(t: torch.Tensor | None, dims: int = 3) -> tuple[int, ...]:
    """Strides of the first ``dims`` dims; 0 where the tensor broadcasts (size 1) or is absent."""
    if t is None:
        return (0,) * dims
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in range(dims))


def _len(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.shape[2]


def _fp_side(t: torch.Tensor | None, b: int, h: int, d: int, name: str) -> torch.Tensor | None:
    if t is None or t.shape[2] == 0:
        return None
    if t.dim() != 4 or t.shape[0] != b or t.shape[1] != h or t.shape[3] != d:
        raise ValueError(
            f"{name} must be [B, H_kv, n, D] = [{b}, {h}, n, {d}]; got {tuple(t.shape)}"
        )
    if t.dtype not in QUERY_DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} not supported; allowed: {QUERY_DTYPES}")
    return t if t.stride(3) == 1 else t.contiguous()


def _block_n(group_size: int | None, block_n: int | None, largest: int = 64) -> int:
    if block_n is not None:
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"block_n={block_n} must be a power of two >= 16")
        if group_size and group_size % block_n:
            raise ValueError(f"block_n={block_n} must divide group_size={group_size}")
        return block_n
    if not group_size:
        return largest
    bn = largest
    while bn >= 16 and group_size % bn:
        bn //= 2
    if bn < 16:
        raise ValueError(
            f"group_size={group_size} is not a multiple of 16; the fused kernel needs page "
            "tiles of 16, 32 or 64 tokens"
        )
    return bn


def auto_num_splits(query: torch.Tensor, programs: int, tiles: int) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU about twice (every SM
    busy at batch 1), at most one per tile; 2 under the CPU interpreter."""
    if query.device.type != "cuda":
        return max(1, min(2, tiles))
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, max(programs, 1)), max(tiles, 1), 64))


def fused_decode_attention(
    query: torch.Tensor,
    *,
    k_sinks: torch.Tensor | None = None,
    k_quant: QuantKeys | None = None,
    k_residual: torch.Tensor | None = None,
    v_sinks: torch.Tensor | None = None,
    v_quant: QuantValues | None = None,
    v_residual: torch.Tensor | None = None,
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    return_partials: bool = False,
):
    """Attention of one decode query per sequence over sinks + quantized pages + residual.

    Parameters
    ----------
    query : ``[B, H_q, 1, D]`` float16/bfloat16/float32 (post-RoPE), ``D`` in {64, 128}.
    k_sinks, v_sinks : ``[B, H_kv, S, D]`` full-precision sinks (or ``None``).
    k_quant : :class:`QuantKeys` of the ``KQ`` tokens after the sinks (or ``None``).
    k_residual : ``[B, H_kv, KR, D]`` full-precision keys after the quantized ones.
    v_quant : :class:`QuantValues` of the ``VQ`` value tokens after the sinks (or ``None``).
    v_residual : ``[B, H_kv, VR, D]`` full-precision values after them.  Key and value token
        counts must agree: ``S + KQ + KR == S + VQ + VR``.
    scaling : logit scale, default ``1/sqrt(D)``.
    lengths : optional int32 ``[B, 5]``: per-sequence ``(S, KQ, KR, VQ, VR)`` (each at most
        the stored count; the tensors are padded to the longest sequence).  Default: the
        stored counts for every sequence; checked when given on the CPU (on the GPU it is
        the caller's promise: no check without a device sync).  A sequence of length 0 gives
        NaN.
    num_splits : programs per (sequence, KV head); default :func:`auto_num_splits`.
    block_n : tokens per tile (power of two >= 16 dividing G); default up to 64.
    num_warps, num_stages : Triton launch options of the attention kernel (default 4 warps, 8
        for float32 queries).
    return_partials : also return the split partials ``(o [B, H_q, S, D], lse [B, H_q, S])``.

    Returns
    -------
    ``[B, H_q, 1, D]`` in the query dtype (and the partials if asked).

    Raises
    ------
    ValueError
        ``D`` not 64/128 (kernel hard-codes head_dim / block size: triton-lang/triton#621, docs/methods.md#kernel-hard-codes-the-head-dimension), more than one query token, mismatched shapes, dtypes or
        token counts, an unsupported class layout, or tensors the kernel cannot read (device placement before a kernel launch (CPU tensor to Triton): jy-yuan/KIVI#24 and #13, docs/methods.md#device-placement-before-a-kernel-launch).
    """
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(
            f"query must be [B, H_q, 1, D] (one decode token); got {tuple(query.shape)}"
        )
    bsz, hq, _, d = query.shape
    if bsz == 0:
        return query.clone()
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim={d} is not supported by the fused decode kernel; allowed: "
            f"{list(SUPPORTED_HEAD_DIMS)} (other head dims take the reference path)"
        )
    if query.dtype not in QUERY_DTYPES:
        raise ValueError(f"query dtype {query.dtype} not supported; allowed: {QUERY_DTYPES}")
    present = [t for t in (k_sinks, k_residual, v_sinks, v_residual) if t is not None]
    present += [x.codes for x in (k_quant, v_quant) if x is not None]
    if not present:
        raise ValueError("the cache is empty: give sinks, quantized pages or a residual")
    hkv = present[0].shape[1]
    if hq % hkv:
        raise ValueError(f"H_q={hq} is not a multiple of H_kv={hkv}")
    ks = _fp_side(k_sinks, bsz, hkv, d, "k_sinks")
    vs = _fp_side(v_sinks, bsz, hkv, d, "v_sinks")
    kr = _fp_side(k_residual, bsz, hkv, d, "k_residual")
    vr = _fp_side(v_residual, bsz, hkv, d, "v_residual")
    if _len(ks) != _len(vs):
        raise ValueError(f"key and value sinks differ in length: {_len(ks)} vs {_len(vs)}")
    q = query if query.stride(3) == 1 else query.contiguous()

    kq_n = 0 if k_quant is None else k_quant.codes.shape[2]
    vq_n = 0 if v_quant is None else v_quant.codes.shape[2]
    if kq_n + _len(kr) != vq_n + _len(vr):
        raise ValueError(
            f"keys hold {kq_n} quantized + {_len(kr)} residual tokens but values "
            f"{vq_n} + {_len(vr)}; the counts after the sinks must agree"
        )
    cx = dict(
        K_QUANT=False,
        NCLS=1,
        B0=1,
        N0=0,
        NP0=16,
        B1=1,
        N1=0,
        NP1=16,
        MID0=False,
        MID1=False,
        PERM_MODE=0,
        V_QUANT=False,
        VBITS=1,
        VCG=d,
        V_MID=False,
    )
    group, rbk, rbv = 0, 0, 0
    kc = kqs = kqz = kp = vc = vqs = vqz = None
    if k_quant is not None and kq_n:
        kc, kqs, kqz, kp = k_quant.codes, k_quant.scale, k_quant.zero, k_quant.perm
        group = k_quant.group_size
        live = check_class_layout(k_quant.class_bits, k_quant.class_counts, d)
        if kc.dtype != torch.uint8 or kc.shape[:2] != (bsz, hkv):
            raise ValueError(
                f"key codes must be uint8 [B, H_kv, n, RB]; got {kc.dtype} {tuple(kc.shape)}"
            )
        rbk = kc.shape[3]
        if rbk != (sum(b_ * n_ for b_, n_, _ in live) + 7) // 8:
            raise ValueError(f"key rows of {rbk} bytes do not fit the class layout {live}")
        npg = triton.cdiv(kq_n, group)
        for name, t in (("scale", kqs), ("zero", kqz)):
            if t.dim() != 4 or t.shape[1] != hkv or t.shape[2] < npg or t.shape[3] != d:
                raise ValueError(
                    f"key {name} must be [B|1, H_kv, >= {npg}, D]; got {tuple(t.shape)}"
                )
        if _strides(kqs) != _strides(kqz):
            kqs, kqz = kqs.contiguous(), kqz.contiguous()
        (b0, n0, _), *rest = live
        b1, n1 = (rest[0][0], rest[0][1]) if rest else (1, 0)
        perm_mode = 0 if kp is None else (2 if kp.shape[2] > 1 else 1)
        if kp is not None and (kp.dim() != 4 or kp.shape[1] != hkv or kp.shape[3] != d):
            raise ValueError(f"perm must be [B|1, H_kv, NP|1, D]; got {tuple(kp.shape)}")
        if perm_mode == 0 and len(live) != 1:
            raise ValueError("two channel classes need a perm")
        cx.update(
            K_QUANT=True,
            NCLS=len(live),
            B0=b0,
            N0=n0,
            NP0=max(16, next_pow2(n0)),
            B1=b1,
            N1=n1,
            NP1=max(16, next_pow2(n1)),
            MID0=bool(k_quant.midpoint and b0 == 1),
            MID1=bool(k_quant.midpoint and b1 == 1 and n1 > 0),
            PERM_MODE=perm_mode,
        )
    if v_quant is not None and vq_n:
        vc, vqs, vqz = v_quant.codes, v_quant.scale, v_quant.zero
        vb = v_quant.bits
        if isinstance(vb, bool) or vb not in range(1, 9):
            raise ValueError(f"value bits {vb!r} not supported by the kernel; allowed: 1..8")
        rbv = vc.shape[3]
        ncg = vqs.shape[3]
        if rbv != (d * vb + 7) // 8 or vc.shape[:2] != (bsz, hkv) or vc.dtype != torch.uint8:
            raise ValueError(f"value codes must be uint8 [B, H_kv, n, {(d * vb + 7) // 8}]")
        if vqs.shape[:3] != vc.shape[:3] or d % ncg or (d // ncg) & (d // ncg - 1):
            raise ValueError(
                f"value scale {tuple(vqs.shape)} must be [B, H_kv, n, D/cg] with cg a power of 2"
            )
        if _strides(vqs) != _strides(vqz):
            vqs, vqz = vqs.contiguous(), vqz.contiguous()
        cx.update(V_QUANT=True, VBITS=vb, VCG=d // ncg, V_MID=bool(v_quant.midpoint and vb == 1))
    for t in (kqs, vqs):
        if t is not None and t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"scale dtype {t.dtype} not supported; allowed: float16/bfloat16/float32"
            )

    per_seq = lengths is not None
    if per_seq:
        if lengths.shape != (bsz, 5):
            raise ValueError(f"lengths must be int [B, 5] = [{bsz}, 5]; got {tuple(lengths.shape)}")
        if lengths.device.type == "cpu":  # checkable without a device sync
            _check_lengths(lengths, (_len(ks), kq_n, _len(kr), vq_n, _len(vr)))
        lengths = lengths.to(device=q.device, dtype=torch.int32).contiguous()
    check_device(_decode_kernel, q, ks, vs, kr, vr, kc, kqs, kp, vc, vqs, lengths)

    # float32 tiles are twice the registers: smaller default tiles (no spills)
    bn = _block_n(group if cx["K_QUANT"] else None, block_n, 32 if q.dtype == torch.float32 else 64)
    s_n, kr_n, vr_n = _len(ks), _len(kr), _len(vr)
    # cost of a full-precision tile in quantized tiles (bytes per token ratio)
    fp_bytes = 2 * d * q.element_size()
    qbytes = (rbk + (rbv if cx["V_QUANT"] else d * q.element_size())) or fp_bytes
    w_cost = max(1, min(16, round(fp_bytes / qbytes))) if cx["K_QUANT"] else 1
    tiles = (triton.cdiv(s_n, bn) + triton.cdiv(kr_n, bn)) * w_cost + triton.cdiv(kq_n, bn)
    splits = num_splits or auto_num_splits(q, bsz * hkv, tiles)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={splits} must be in 1..{MAX_SPLITS}")
    n_rep = hq // hkv
    block_h = max(16, next_pow2(n_rep))

    part_o = torch.empty(bsz, hq, splits, d, dtype=torch.float32, device=q.device)
    part_l = torch.empty(bsz, hq, splits, dtype=torch.float32, device=q.device)
    dummy = q
    scale = (1.0 / math.sqrt(d) if scaling is None else float(scaling)) * LOG2E
    _decode_kernel[(bsz * hkv, splits)](
        q,
        part_o,
        part_l,
        lengths if per_seq else dummy,
        ks if ks is not None else dummy,
        kr if kr is not None else dummy,
        kc if kc is not None else dummy,
        kqs if kqs is not None else dummy,
        kqz if kqz is not None else dummy,
        kp if kp is not None else dummy,
        vs if vs is not None else dummy,
        vr if vr is not None else dummy,
        vc if vc is not None else dummy,
        vqs if vqs is not None else dummy,
        vqz if vqz is not None else dummy,
        s_n,
        kq_n,
        kr_n,
        vq_n,
        vr_n,
        hkv,
        n_rep,
        splits,
        w_cost,
        scale,
        max(group, 1),
        rbk,
        rbv,
        q.stride(0),
        q.stride(1),
        *part_o.stride()[:3],
        *part_l.stride()[:2],
        *_strides(ks),
        *_strides(kr),
        *_strides(kc),
        *_strides(kqs),
        *_strides(kp),
        *_strides(vs),
        *_strides(vr),
        *_strides(vc),
        *_strides(vqs),
        D=d,
        BN=bn,
        BLOCK_H=block_h,
        PER_SEQ=per_seq,
        DOT_IEEE=q.dtype == torch.float32,
        num_warps=num_warps or (8 if q.dtype == torch.float32 else 4),
        **({} if num_stages is None else {"num_stages": num_stages}),
        **cx,
    )
    out = torch.empty(bsz, hq, 1, d, dtype=q.dtype, device=q.device)
    _merge_kernel[(bsz * hq,)](
        part_o,
        part_l,
        out,
        hq,
        splits,
        *part_o.stride()[:3],
        *part_l.stride()[:2],
        out.stride(0),
        out.stride(1),
        D=d,
        BLOCK_S=max(2, next_pow2(splits)),
        num_warps=4,
    )
    return (out, (part_o, part_l)) if return_partials else out


def _check_lengths(lengths: torch.Tensor, stored: tuple[int, ...]) -> None:
    """Per-sequence ``(S, KQ, KR, VQ, VR)`` within what is stored, keys and values agreeing."""
    lens = lengths.long()
    cap = torch.tensor(stored)
    if bool((lens < 0).any() or (lens > cap).any()):
        raise ValueError(f"lengths {lens.tolist()} exceed the stored counts {list(stored)}")
    if not torch.equal(lens[:, 1] + lens[:, 2], lens[:, 3] + lens[:, 4]):
        raise ValueError("per-sequence lengths need KQ + KR == VQ + VR")


def split_kv_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
    seq_lens: torch.Tensor | None = None,
    **kwargs,
):
    """The control: the same split-KV kernel over full-precision ``keys, values
    [B, H_kv, T, D]`` (``seq_lens [B]``: per-sequence lengths).  Same arguments and errors as
    :func:`fused_decode_attention`."""
    lengths = None
    if seq_lens is not None:
        z = torch.zeros_like(seq_lens)
        lengths = torch.stack([z, z, seq_lens, z, seq_lens], dim=1)
    return fused_decode_attention(
        query, k_residual=keys, v_residual=values, scaling=scaling, lengths=lengths, **kwargs
    )
