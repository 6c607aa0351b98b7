"""Quantize-and-pack on flush: PyTorch reference, Triton kernels, host wrappers.

When a cache side flushes, full-precision tokens become packed codes plus per-group
(scale, zero).  These kernels produce exactly the tensors of the core codecs:

* keys, per channel (KIVI sense; :class:`kvbench.cache.blocks.PerChannelCodec` /
  :class:`kvbench.cache.mixed_channel.MixedChannelCodec`): one (scale, zero) per channel per page of ``G``
  tokens.  Uniform (one class, KIVI) or mixed precision (two classes, Kitty / PN-Mix): channels
  are taken in the class-sorted order of ``perm`` (the original channel at each sorted
  position; per page ``[B, H, NP, D]`` for Kitty's dynamic selection, fixed ``[B|1, H, 1, D]``
  for PN-Mix's prefill selection), each token's row holds the codes of class 0 then class 1 as
  one LSB-first bit stream (:mod:`.pack`), and scale/zero are stored in sorted order.  1-bit
  classes may use the midpoint reconstruction (PN-Mix Eq. 7 [RECON]);
* values, per token (:class:`kvbench.cache.blocks.PerTokenCodec`): one (scale, zero) per token per
  ``channel_group`` channels.

Arithmetic, identical to :func:`kvbench.cache.quant.quantize_groups` so that codes are bit-identical:
statistics in float32 over the group with non-finite inputs read as 0 (the group's scale and
zero become NaN); ``zero = fp16(min)`` rounded to nearest; ``scale = (max - zero) / (2^b - 1)``
with an IEEE division (``div_rn``, not Triton's approximate ``/``), then rounded *up* to the
storage dtype (one ulp step when the nearest value is below); ``code = rint((x - zero) /
scale)`` with round-half-to-even (libdevice ``rint`` on the GPU, never ``tl.math.round``: bug
case rounding ties: kernel vs reference (half-to-even): triton-lang/triton#2923 (+ #4449), docs/methods.md#rounding-ties-between-kernel-and-reference; an exact floor-based equivalent under the CPU interpreter, which has no libdevice)
clamped to ``[0, 2^b - 1]``, 0 for a zero scale; 1-bit midpoint: ``code = (x - zero >= scale /
2)``.  Dequantized values (``code * scale + zero`` in float32) then agree exactly, or within one
ulp where the GPU contracts the multiply-add.

Only torch and triton are imported (no kvbench core).
"""

from __future__ import annotations

import torch

from ._triton import check_device, is_interpreted, jit, libdevice, next_pow2, tl, triton
from .pack import pack_tile

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------


def _round_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    st = s.to(dtype)
    if dtype == torch.float32:
        return st
    low = (st.float() < s) & torch.isfinite(st.float())
    return torch.where(low, (st.view(torch.int16) + 1).view(dtype), st)


def affine_reference(groups: torch.Tensor, bits: int, midpoint: bool, scale_dtype: torch.dtype):
    """Min-max codes of each group (last dim of ``groups``): ``(codes int32, scale [..., 1],
    zero [..., 1])`` with the arithmetic described in the module docstring."""
    xf = groups.float()
    fin = torch.isfinite(xf)
    xs = torch.where(fin, xf, 0.0)
    qmax = (1 << bits) - 1
    mn_st = xs.amin(-1, keepdim=True).to(scale_dtype)
    mnf = mn_st.float()
    s_st = _round_up((xs.amax(-1, keepdim=True) - mnf).clamp_min(0) / qmax, scale_dtype)
    s = s_st.float()
    if midpoint:
        q = (((xs - mnf) >= 0.5 * s) & (s > 0)).float()
    else:
        q = torch.where(s > 0, torch.round((xs - mnf) / torch.where(s > 0, s, 1.0)), 0.0)
    ok = fin.all(-1, keepdim=True)
    nan = torch.tensor(float("nan"), dtype=scale_dtype, device=groups.device)
    return q.clamp(0, qmax).to(torch.int32), torch.where(ok, s_st, nan), torch.where(ok, mn_st, nan)


def quantize_keys_reference(
    x: torch.Tensor,
    class_bits,
    class_counts,
    perm: torch.Tensor | None,
    group_size: int,
    scale_dtype: torch.dtype = torch.float16,
    midpoint: bool = False,
):
    """Reference of :func:`quantize_keys`: returns the class-sorted codes int32
    ``[B, H, n, D]`` (unpacked) and scale, zero ``[B, H, n/G, D]``."""
    b, h, n, d = x.shape
    g = group_size
    pages = x.reshape(b, h, n // g, g, d)
    if perm is not None:
        pages = pages.gather(-1, perm.long().unsqueeze(3).expand(b, h, n // g, g, d))
    codes, scales, zeros, off = [], [], [], 0
    for bits, cnt in zip(class_bits, class_counts):
        seg = pages[..., off : off + cnt].transpose(-1, -2)  # [B, H, NP, cnt, G]
        off += cnt
        c, s, z = affine_reference(seg, bits, midpoint and bits == 1, scale_dtype)
        codes.append(c.transpose(-1, -2).reshape(b, h, n, cnt))
        scales.append(s.squeeze(-1))
        zeros.append(z.squeeze(-1))
    return torch.cat(codes, -1), torch.cat(scales, -1), torch.cat(zeros, -1)


# --------------------------------------------------------------------------------------------
# Triton helpers
# --------------------------------------------------------------------------------------------


@jit
def round_half_even(x, USE_RINT: tl.constexpr):
    """Round float32 to the nearest integer, ties to even (torch.round)."""
    if USE_RINT:
        r = libdevice.rint(x)
    else:  # exact for |x| < 2^23: x - floor(x) is exact there
        f = tl.floor(x)
        d = x - f
        odd = f - 2.0 * tl.floor(f * 0.5)
        r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))
    return r


@jit
def round_up_to(s, SD: tl.constexpr):
    """Non-negative float32 ``s`` stored as ``SD``, rounded up (kvbench.cache.quant.round_up_to_dtype)."""
    st = s.to(SD)
    if SD != tl.float32:
        stf = st.to(tl.float32)
        low = (stf < s) & (tl.abs(stf) < float("inf"))
        bumped = (st.to(tl.int16, bitcast=True) + 1).to(SD, bitcast=True)
        st = tl.where(low, bumped, st)
    return st


@jit
def affine_codes(xs, mnf, sf, BITS: tl.constexpr, MID: tl.constexpr, USE_RINT: tl.constexpr):
    """Codes int32 of sanitized float32 ``xs`` given broadcastable stored min/scale (float32)."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    pos = sf > 0
    if MID:
        q = ((xs - mnf) >= 0.5 * sf) & pos
        q = q.to(tl.float32)
    else:
        safe = tl.where(pos, sf, 1.0)
        q = tl.where(pos, round_half_even(tl.math.div_rn(xs - mnf, safe), USE_RINT), 0.0)
    q = tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0)
    return q.to(tl.int32)


@jit
def _key_class(
    x_rows,
    tmask,
    perm_row,
    scale_row,
    zero_row,
    code_rows,
    RB,
    sx_d,
    POS0: tl.constexpr,
    BYTE0: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    GP: tl.constexpr,
    BITS: tl.constexpr,
    MID: tl.constexpr,
    HAS_PERM: tl.constexpr,
    SD: tl.constexpr,
    USE_RINT: tl.constexpr,
):
    # one class of a page: sorted positions POS0 .. POS0 + N - 1 (padded to NP), packed from
    # byte BYTE0 of each token's row
    i = tl.arange(0, NP)
    imask = i < N
    if HAS_PERM:
        ch = tl.load(perm_row + POS0 + i, mask=imask, other=0).to(tl.int32)
    else:
        ch = POS0 + i
    m2 = tmask[:, None] & imask[None, :]
    x = tl.load(x_rows[:, None] + ch[None, :] * sx_d, mask=m2, other=0.0).to(tl.float32)
    fin = tl.abs(x) < float("inf")
    xs = tl.where(fin, x, 0.0)
    gfin = tl.min(tl.where(m2, fin, True).to(tl.int32), axis=0) > 0  # [NP]
    mn = tl.min(tl.where(m2, xs, float("inf")), axis=0)
    mx = tl.max(tl.where(m2, xs, -float("inf")), axis=0)
    mn = tl.where(imask, mn, 0.0)
    mx = tl.where(imask, mx, 0.0)
    mn_st = mn.to(SD)
    mnf = mn_st.to(tl.float32)
    QMAX: tl.constexpr = (1 << BITS) - 1
    s_st = round_up_to(tl.math.div_rn(tl.maximum(mx - mnf, 0.0), QMAX * 1.0), SD)
    sf = s_st.to(tl.float32)
    codes = affine_codes(xs, mnf[None, :], sf[None, :], BITS, MID, USE_RINT)
    codes = tl.where(m2, codes, 0)
    nan = tl.full([NP], float("nan"), SD)
    tl.store(scale_row + POS0 + i, tl.where(gfin, s_st, nan), mask=imask)
    tl.store(zero_row + POS0 + i, tl.where(gfin, mn_st, nan), mask=imask)
    pack_tile(code_rows, tmask, BYTE0, RB, codes, GP, NP, BITS)


@jit
def _quantize_keys_kernel(
    x_ptr,
    perm_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    H,
    G,
    RB,
    sx_b,
    sx_h,
    sx_t,
    sx_d,
    sp_b,
    sp_h,
    sp_p,
    sc_b,
    sc_h,
    sc_t,
    ss_b,
    ss_h,
    ss_p,
    GP: tl.constexpr,
    NCLS: tl.constexpr,
    B0: tl.constexpr,
    N0: tl.constexpr,
    NP0: tl.constexpr,
    B1: tl.constexpr,
    N1: tl.constexpr,
    NP1: tl.constexpr,
    MID0: tl.constexpr,
    MID1: tl.constexpr,
    HAS_PERM: tl.constexpr,
    SD: tl.constexpr,
    USE_RINT: tl.constexpr,
):
    # grid: (B * H, pages); one program quantizes one page of one (batch row, KV head)
    pid = tl.program_id(0)
    page = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    t = tl.arange(0, GP)
    tmask = t < G
    tok = page.to(tl.int64) * G + t
    x_rows = x_ptr + b * sx_b + h * sx_h + tok * sx_t
    code_rows = codes_ptr + b * sc_b + h * sc_h + tok * sc_t
    perm_row = perm_ptr + b * sp_b + h * sp_h + page * sp_p
    scale_row = scale_ptr + b * ss_b + h * ss_h + page * ss_p
    zero_row = zero_ptr + b * ss_b + h * ss_h + page * ss_p
    _key_class(
        x_rows,
        tmask,
        perm_row,
        scale_row,
        zero_row,
        code_rows,
        RB,
        sx_d,
        0,
        0,
        N0,
        NP0,
        GP,
        B0,
        MID0,
        HAS_PERM,
        SD,
        USE_RINT,
    )
    if NCLS == 2:
        _key_class(
            x_rows,
            tmask,
            perm_row,
            scale_row,
            zero_row,
            code_rows,
            RB,
            sx_d,
            N0,
            N0 * B0 // 8,
            N1,
            NP1,
            GP,
            B1,
            MID1,
            HAS_PERM,
            SD,
            USE_RINT,
        )


@jit
def _quantize_values_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    H,
    n,
    RB,
    sx_b,
    sx_h,
    sx_t,
    sc_b,
    sc_h,
    sc_t,
    ss_b,
    ss_h,
    ss_t,
    D: tl.constexpr,
    CG: tl.constexpr,
    BT: tl.constexpr,
    BITS: tl.constexpr,
    SD: tl.constexpr,
    USE_RINT: tl.constexpr,
):
    # grid: (B * H, cdiv(n, BT)); one program quantizes BT tokens of one (batch row, KV head)
    NCG: tl.constexpr = D // CG
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    tmask = t < n
    t64 = t.to(tl.int64)
    j = tl.arange(0, D)
    x = tl.load(
        x_ptr + b * sx_b + h * sx_h + t64[:, None] * sx_t + j[None, :],
        mask=tmask[:, None],
        other=0.0,
    ).to(tl.float32)
    x3 = tl.reshape(x, (BT, NCG, CG))
    fin = tl.abs(x3) < float("inf")
    xs = tl.where(fin, x3, 0.0)
    gfin = tl.min(fin.to(tl.int32), axis=2) > 0  # [BT, NCG]
    mn_st = tl.min(xs, axis=2).to(SD)
    mnf = mn_st.to(tl.float32)
    QMAX: tl.constexpr = (1 << BITS) - 1
    s_st = round_up_to(tl.math.div_rn(tl.maximum(tl.max(xs, axis=2) - mnf, 0.0), QMAX * 1.0), SD)
    sf = s_st.to(tl.float32)
    codes3 = affine_codes(xs, mnf[:, :, None], sf[:, :, None], BITS, False, USE_RINT)
    codes = tl.reshape(codes3, (BT, D))
    code_rows = codes_ptr + b * sc_b + h * sc_h + t64 * sc_t
    pack_tile(code_rows, tmask, 0, RB, codes, BT, D, BITS)
    gi = tl.arange(0, NCG)
    s_off = b * ss_b + h * ss_h + t64[:, None] * ss_t + gi[None, :]
    nan = tl.full([BT, NCG], float("nan"), SD)
    tl.store(scale_ptr + s_off, tl.where(gfin, s_st, nan), mask=tmask[:, None])
    tl.store(zero_ptr + s_off, tl.where(gfin, mn_st, nan), mask=tmask[:, None])


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------

_TL_DTYPES = {}


def _tl_dtype(dt: torch.dtype):
    if not _TL_DTYPES:
        _TL_DTYPES.update(
            {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
        )
    return _TL_DTYPES[dt]


def _use_rint(kernel, exact_floor: bool | None) -> bool:
    if exact_floor is None:
        return not is_interpreted(kernel)
    return not exact_floor


def check_class_layout(class_bits, class_counts, head_dim: int) -> list[tuple[int, int, int]]:
    """Validate a channel-class layout for the kernels and return its live classes as
    ``(bits, count, first sorted position)``.

    Raises ``ValueError`` unless: one or two non-empty classes, bits in 1..8, counts summing to
    ``head_dim``, and every class starting on a byte boundary of the packed row."""
    if len(class_bits) != len(class_counts) or not class_bits:
        raise ValueError("class_bits and class_counts must be non-empty and of one length")
    if sum(class_counts) != head_dim:
        raise ValueError(f"class_counts {list(class_counts)} must sum to head_dim={head_dim}")
    live, pos = [], 0
    for bits, cnt in zip(class_bits, class_counts):
        if isinstance(bits, bool) or bits not in range(1, 9):
            raise ValueError(f"class bits {bits!r} not supported by the kernels; allowed: 1..8")
        if cnt:
            live.append((bits, cnt, pos))
        pos += cnt
    if not 1 <= len(live) <= 2:
        raise ValueError(f"the kernels support 1 or 2 non-empty channel classes, got {len(live)}")
    if len(live) == 2 and (live[0][0] * live[0][1]) % 8:
        raise ValueError(
            f"class 0 ({live[0][1]} channels x {live[0][0]} bits) does not end on a byte "
            "boundary; the kernels need byte-aligned classes (kvbench.cache.mixed_channel.pack_mixed fast path)"
        )
    return live


def _class_constexprs(live, midpoint: bool) -> dict:
    (b0, n0, _), *rest = live
    b1, n1 = (rest[0][0], rest[0][1]) if rest else (1, 0)
    return dict(
        NCLS=len(live),
        B0=b0,
        N0=n0,
        NP0=max(8, next_pow2(n0)),
        B1=b1,
        N1=n1,
        NP1=max(8, next_pow2(n1)),
        MID0=bool(midpoint and b0 == 1),
        MID1=bool(midpoint and b1 == 1 and n1 > 0),
    )


def quantize_keys(
    x: torch.Tensor,
    group_size: int,
    class_bits=(2,),
    class_counts=None,
    perm: torch.Tensor | None = None,
    *,
    scale_dtype: torch.dtype = torch.float16,
    midpoint: bool = False,
    check_overflow: bool = True,
    num_warps: int = 8,
    _exact_floor: bool | None = None,
):
    """Quantize and pack keys per channel in pages of ``group_size`` tokens.

    Parameters
    ----------
    x : ``[B, H_kv, n, D]`` float16/bfloat16/float32, ``n`` a multiple of ``group_size``, ``D``
        a power of two <= 256.
    group_size : G, tokens per page (<= 256).
    class_bits, class_counts : code width and channel count of each class, class 0 first (the
        :class:`kvbench.cache.mixed_channel.MixedChannelBlock` convention); default one class of D channels.
    perm : uint8/int16 ``[B|1, H_kv, n/G | 1, D]``: original channel at each class-sorted
        position (per page, or one for all pages); ``None`` = identity.
    scale_dtype : storage of scale and zero (float16, bfloat16, float32).
    midpoint : 1-bit classes use the midpoint reconstruction (PN-Mix Eq. 7 [RECON]).
    check_overflow : raise ``ValueError`` (as :func:`kvbench.cache.quant.quantize_groups` does) when
        a finite group's scale or min overflows ``scale_dtype``; costs one device sync.

    Returns
    -------
    ``(codes, scale, zero)``: uint8 ``[B, H_kv, n, ceil(sum n_c b_c / 8)]`` (the class-sorted
    bit stream of each token), and ``[B, H_kv, n/G, D]`` in ``scale_dtype`` (sorted order):
    the tensors of :class:`~kvbench.cache.blocks.AffineBlock` (one class, no perm) and
    :class:`~kvbench.cache.mixed_channel.MixedChannelBlock`.

    Raises
    ------
    ValueError
        Bad shapes/dtypes, an unsupported class layout (see :func:`check_class_layout`), tensors
        the kernel cannot read (device placement before a kernel launch (CPU tensor to Triton): jy-yuan/KIVI#24 and #13, docs/methods.md#device-placement-before-a-kernel-launch), or an overflowing scale/zero.
    """
    if x.dim() != 4:
        raise ValueError(f"keys must be [B, H_kv, n, D]; got {tuple(x.shape)}")
    b, h, n, d = x.shape
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"key dtype {x.dtype} not supported; allowed: {INPUT_DTYPES}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype {scale_dtype} not supported; allowed: {SCALE_DTYPES}")
    if d & (d - 1) or not 8 <= d <= 256:
        raise ValueError(f"head_dim={d} not supported by the kernel; allowed: powers of 2, 8..256")
    if not 1 <= group_size <= 256 or n % group_size:
        raise ValueError(f"n={n} must be a multiple of group_size={group_size} (1..256)")
    counts = tuple(class_counts) if class_counts is not None else (d,)
    live = check_class_layout(tuple(class_bits), counts, d)
    npages = n // group_size
    if perm is not None:
        ok = perm.dim() == 4 and perm.shape[1] == h and perm.shape[3] == d
        ok = ok and perm.shape[0] in (1, b) and perm.shape[2] in (1, npages)
        if not ok or perm.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
            raise ValueError(
                f"perm must be an integer [B|1, H_kv, n/G|1, D] = [{b}|1, {h}, {npages}|1, {d}]"
                f" tensor; got {perm.dtype} {tuple(perm.shape)}"
            )
    check_device(_quantize_keys_kernel, x, perm)
    rb = (sum(bb * c for bb, c, _ in live) + 7) // 8
    codes = torch.empty(b, h, n, rb, dtype=torch.uint8, device=x.device)
    scale = torch.empty(b, h, npages, d, dtype=scale_dtype, device=x.device)
    zero = torch.empty_like(scale)
    if perm is None:
        p, sp = x, (0, 0, 0)  # dummy pointer, never read
    else:
        p = perm
        sp = tuple(0 if perm.shape[i] == 1 else perm.stride(i) for i in range(3))
    if b * h * npages:
        _quantize_keys_kernel[(b * h, npages)](
            x,
            p,
            codes,
            scale,
            zero,
            h,
            group_size,
            rb,
            *x.stride(),
            *sp,
            *codes.stride()[:3],
            *scale.stride()[:3],
            GP=max(16, next_pow2(group_size)),
            HAS_PERM=perm is not None,
            SD=_tl_dtype(scale_dtype),
            USE_RINT=_use_rint(_quantize_keys_kernel, _exact_floor),
            num_warps=num_warps,
            **_class_constexprs(live, midpoint),
        )
    if check_overflow:
        _check_overflow(x, scale, zero, scale_dtype)
    return codes, scale, zero


def quantize_values(
    x: torch.Tensor,
    bits: int,
    channel_group: int | None = None,
    *,
    scale_dtype: torch.dtype = torch.float16,
    check_overflow: bool = True,
    block_t: int = 16,
    num_warps: int = 4,
    _exact_floor: bool | None = None,
):
    """Quantize and pack values per token in groups of ``channel_group`` channels.

    Parameters
    ----------
    x : ``[B, H_kv, n, D]`` float16/bfloat16/float32, ``D`` a power of two <= 256.
    bits : 1..8.
    channel_group : channels per group, a power of two dividing D (default D).

    Returns
    -------
    ``(codes, scale, zero)``: uint8 ``[B, H_kv, n, ceil(D*bits/8)]`` and
    ``[B, H_kv, n, D/channel_group]`` in ``scale_dtype``: the tensors of the
    :class:`~kvbench.cache.blocks.AffineBlock` that :class:`~kvbench.cache.blocks.PerTokenCodec` makes.

    Raises
    ------
    ValueError
        Bad shapes, dtypes or bits, or tensors the kernel cannot read (device placement before a kernel launch (CPU tensor to Triton): jy-yuan/KIVI#24 and #13, docs/methods.md#device-placement-before-a-kernel-launch).
    """
    if x.dim() != 4:
        raise ValueError(f"values must be [B, H_kv, n, D]; got {tuple(x.shape)}")
    b, h, n, d = x.shape
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"value dtype {x.dtype} not supported; allowed: {INPUT_DTYPES}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype {scale_dtype} not supported; allowed: {SCALE_DTYPES}")
    if isinstance(bits, bool) or bits not in range(1, 9):
        raise ValueError(f"bits={bits!r} not supported by the kernel; allowed: 1..8")
    if d & (d - 1) or not 8 <= d <= 256:
        raise ValueError(f"head_dim={d} not supported by the kernel; allowed: powers of 2, 8..256")
    cg = d if channel_group is None else channel_group
    if cg < 1 or cg & (cg - 1) or d % cg:
        raise ValueError(f"channel_group={cg} must be a power of two dividing head_dim={d}")
    check_device(_quantize_values_kernel, x)
    if x.stride(3) != 1:
        x = x.contiguous()
    rb = (d * bits + 7) // 8
    codes = torch.empty(b, h, n, rb, dtype=torch.uint8, device=x.device)
    scale = torch.empty(b, h, n, d // cg, dtype=scale_dtype, device=x.device)
    zero = torch.empty_like(scale)
    if b * h * n:
        _quantize_values_kernel[(b * h, triton.cdiv(n, block_t))](
            x,
            codes,
            scale,
            zero,
            h,
            n,
            rb,
            *x.stride()[:3],
            *codes.stride()[:3],
            *scale.stride()[:3],
            D=d,
            CG=cg,
            BT=block_t,
            BITS=bits,
            SD=_tl_dtype(scale_dtype),
            USE_RINT=_use_rint(_quantize_values_kernel, _exact_floor),
            num_warps=num_warps,
        )
    if check_overflow:
        _check_overflow(x, scale, zero, scale_dtype)
    return codes, scale, zero


def _check_overflow(x, scale, zero, scale_dtype) -> None:
    bad = (torch.isinf(scale) | torch.isinf(zero)).any()
    if bool(bad):
        raise ValueError(
            f"a group scale or min overflows scale_dtype={scale_dtype}; "
            "use scale_dtype=torch.float32 for inputs of this range"
        )
