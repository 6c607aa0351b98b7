"""Quantizer primitives: min-max affine quantization of groups, and real bit-packing.

Every method composes these; none re-implements them (docs/design.md#quantizer-primitives).
Their conventions are docs/methods.md#common-conventions: the asymmetric min-max (KIVI) and
symmetric absmax formulas, round-half-to-even, float32 statistics with scale and min stored in
``scale_dtype`` (the scale rounded up, the codes computed from the stored values), zero-range
and non-finite groups (docs/methods.md#zero-range-groups), the 1-bit midpoint reconstruction
(PN-Mix Eq. 7 [RECON], docs/methods.md#one-bit-midpoint-reconstruction) and LSB-first packing
(docs/methods.md#bit-packing; 16-bit codes: int16 with an offset of 32768).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def check_bits(bits: int, field: str = "bits") -> int:
    """Return ``bits`` if supported, else raise ``ValueError`` naming ``field``."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{field}={bits!r} is not supported; allowed: 1..8 or 16")
    return bits


def resolve_scale_dtype(name: str | torch.dtype, field: str = "scale_dtype") -> torch.dtype:
    """Map ``'float16' | 'bfloat16' | 'float32'`` (or the torch dtype) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name in SCALE_DTYPES.values():
            return name
    elif name in SCALE_DTYPES:
        return SCALE_DTYPES[name]
    raise ValueError(f"{field}={name!r} is not supported; allowed: {sorted(SCALE_DTYPES)}")


# --------------------------------------------------------------------------------------------
# Bit packing
# --------------------------------------------------------------------------------------------


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy once packed (16-bit: 2 bytes each)."""
    return 2 * n if bits == 16 else (n * bits + 7) // 8


def check_codes(codes: torch.Tensor, bits: int) -> None:
    """Raise ``ValueError`` unless ``codes`` is an integer tensor with values in
    ``[0, 2^bits - 1]``; the message names the first offending value and the bit width."""
    if codes.dtype.is_floating_point or codes.dtype.is_complex:
        raise ValueError(f"codes must have an integer dtype to pack, got {codes.dtype}")
    if codes.numel() == 0 or codes.dtype == torch.bool:
        return
    qmax = (1 << bits) - 1
    lo, hi = torch.aminmax(codes)  # one reduction, no tensor-sized masks on the common path
    if int(lo) < 0 or int(hi) > qmax:
        bad = (codes < 0) | (codes > qmax)
        value = codes[bad].flatten()[0].item()
        raise ValueError(
            f"code {value} is outside [0, {qmax}] for bits={bits}; signed codes must be stored "
            f"in offset binary (add 2^(bits-1) = {1 << (bits - 1)} before packing)"
        )


def pack_bits(codes: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Pack integer codes along the last dimension into bytes.

    Parameters
    ----------
    codes : Tensor ``[..., n]``, integer dtype, values in ``[0, 2^bits - 1]``.
    bits : 1..8 or 16.
    check : verify the code range (default); ``False`` only for codes in range by
        construction (:func:`quantize_groups` clamps them), saving a reduction and a host
        sync per call on the decode path.

    Returns
    -------
    Tensor ``[..., ceil(n*bits/8)]`` uint8 (LSB-first bit stream; code ``i`` occupies bits
    ``i*b .. i*b+b-1``), or ``[..., n]`` int16 for 16-bit codes (value - 32768).

    Raises
    ------
    ValueError
        Unsupported ``bits``, a non-integer dtype, or a code outside ``[0, 2^bits - 1]`` (the
        message names the offending value and the width): an out-of-range code would otherwise
        spill into its neighbour's bits.  Signed codes are stored in offset binary: add
        ``2^(bits-1)`` before packing (as the symmetric quantizer does) and subtract it after
        unpacking.
    """
    check_bits(bits)
    if check:
        check_codes(codes, bits)
    if bits == 16:
        return (codes.to(torch.int32) - 32768).to(torch.int16)
    if bits == 8:
        return codes.to(torch.uint8)
    *lead, n = codes.shape
    if codes.numel() == 0:  # e.g. no rows: reshape(..., -1, ...) below would be ambiguous
        return torch.zeros(*lead, packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    c = codes.to(torch.uint8)
    if bits in (1, 2, 4):  # fast path, same layout: 8/b codes per byte, LSB first
        per = 8 // bits
        if n % per:
            c = torch.nn.functional.pad(c, (0, (-n) % per))
        c = c.reshape(*lead, -1, per)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
        return (c << shifts).sum(-1, dtype=torch.uint8)
    n_pad = (-n) % 8
    if n_pad:
        c = torch.nn.functional.pad(c, (0, n_pad))
    c = c.reshape(*lead, -1, 8)  # [..., n8, 8 codes] -> 8*bits bits = bits bytes
    shifts = torch.arange(bits, dtype=torch.uint8, device=c.device)
    bitplanes = (c.unsqueeze(-1) >> shifts) & 1  # [..., n8, 8, bits]
    stream = bitplanes.reshape(*lead, -1, bits, 8)  # [..., n8, bits bytes, 8 bits]
    weights = (1 << torch.arange(8, dtype=torch.int32, device=c.device)).to(torch.uint8)
    packed = (stream * weights).sum(-1, dtype=torch.int32).to(torch.uint8)
    packed = packed.reshape(*lead, -1)
    return packed[..., : packed_size(n, bits)].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[..., bytes]`` -> ``[..., n]`` codes (uint8, or int32 for 16)."""
    check_bits(bits)
    if bits == 16:
        return packed.to(torch.int32) + 32768
    if bits == 8:
        return packed[..., :n]
    *lead, nbytes = packed.shape
    if packed.numel() == 0:  # e.g. no rows: reshape(..., -1) below would be ambiguous
        return torch.zeros(*lead, n, dtype=torch.uint8, device=packed.device)
    if bits in (1, 2, 4):  # fast path of the same layout
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*lead, -1)[..., :n]
    full = (n + 7) // 8 * bits  # bytes covering whole 8-code blocks
    p = packed
    if full > nbytes:
        p = torch.nn.functional.pad(p, (0, full - nbytes))
    p = p.reshape(*lead, -1, bits, 1)
    shifts = torch.arange(8, dtype=torch.uint8, device=p.device)
    stream = (p >> shifts) & 1  # [..., n8, bits, 8]
    stream = stream.reshape(*lead, -1, 8, bits)
    weights = (1 << torch.arange(bits, dtype=torch.int32, device=p.device)).to(torch.uint8)
    codes = (stream * weights).sum(-1, dtype=torch.int32).to(torch.uint8)
    return codes.reshape(*lead, -1)[..., :n]


#: most boundaries :func:`bucket_index` compares one by one (a 4-bit codebook's 15 midpoints)
BUCKET_PASSES = 15


def bucket_index(x: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """``torch.bucketize(x, boundaries)`` (``right=False``: the number of ``boundaries``
    strictly below each element) for a codebook's sorted 1-D ``boundaries``, as uint8 codes
    ``x.shape`` from one comparison pass per boundary (for the 1..15 midpoints of a 1..4-bit
    codebook, faster than bucketize's binary search and without its int64 output).  Falls back
    to ``torch.bucketize`` (int64) for more than :data:`BUCKET_PASSES` boundaries or a
    non-finite ``x``."""
    from kvbench.cache.finite import all_finite

    n = boundaries.numel()
    if n == 0 or n > BUCKET_PASSES or not all_finite(x):
        return torch.bucketize(x, boundaries)
    b = boundaries.to(x.device, x.dtype)
    out = (x > b[0]).to(torch.uint8)
    for i in range(1, n):
        out.add_(x > b[i])
    return out


# --------------------------------------------------------------------------------------------
# Affine quantization of groups
# --------------------------------------------------------------------------------------------


@dataclass
class GroupQuant:
    """Result of :func:`quantize_groups` (codes unpacked).

    Attributes
    ----------
    codes : Tensor ``[..., n]`` int32 in ``[0, 2^bits - 1]``.
    scale : Tensor ``[..., 1]`` in ``scale_dtype``.
    zero : Tensor ``[..., 1]`` in ``scale_dtype`` (the group min), or ``None`` when symmetric.
    bits, symmetric, midpoint : the quantizer's settings.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    symmetric: bool = False
    midpoint: bool = False


def round_up_to_dtype(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast non-negative float32 ``s`` to ``dtype``, rounding up so the result is >= ``s``."""
    st = s.to(dtype)
    if dtype == torch.float32:
        return st
    # 2-byte (float16/bfloat16) or 1-byte (float8) storage: step to the next code upwards
    # (an infinite or NaN ``st`` never compares below ``s >= 0``: no finiteness mask needed)
    itype = torch.int16 if dtype.itemsize == 2 else torch.int8
    low = st.float() < s
    if bool(low.any()):
        bumped = (st.view(itype) + 1).view(dtype)
        st = torch.where(low, bumped, st)
    return st


def affine_terms(
    mn: torch.Tensor,
    mx: torch.Tensor,
    bits: int,
    scale_dtype: torch.dtype,
    finite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored terms of asymmetric min-max groups from their float32 ``mn``/``mx`` (any shape):
    ``(scale, zero, scale_f32, zero_f32)``, ``zero`` = the min cast to ``scale_dtype``,
    ``scale`` = ``(mx - zero) / (2^bits - 1)`` rounded *up* to ``scale_dtype`` (the range is
    measured from the stored min so that the max stays covered).  ``finite``: bool mask of the
    groups held finite (``None``: all).  Raises ``ValueError`` when a finite group's zero or
    scale overflows ``scale_dtype``.  :func:`quantize_groups` and the native quantizer
    (:mod:`kvbench.cache.native_quant`) both take their terms from here."""
    qmax = (1 << bits) - 1
    mn_st = mn.to(scale_dtype)
    mnf = mn_st.float()
    scale_st = round_up_to_dtype((mx - mnf).clamp_min(0) / qmax, scale_dtype)
    s = scale_st.float()
    # one host sync for both overflow checks; the error names the first that fails
    bad_mn = _unstorable(mnf, finite, scale_dtype, exact=mn)
    if bool((bad_mn | _unstorable(s, finite, scale_dtype)).any()):
        _check_storable(mn_st, finite, "zero (group min)", scale_dtype, exact=mn)
        _check_storable(scale_st, finite, "scale", scale_dtype)
    return scale_st, mn_st, s, mnf


def symmetric_terms(
    mn: torch.Tensor,
    mx: torch.Tensor,
    bits: int,
    scale_dtype: torch.dtype,
    finite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored scale of absmax groups from their float32 ``mn``/``mx``: ``(scale, scale_f32)``,
    ``max |x| / (2^(bits-1) - 1)`` rounded up to ``scale_dtype``.  Raises ``ValueError`` when a
    finite group's scale overflows ``scale_dtype``."""
    # max |x| of the group from its min and max (exact; abs() maps -0.0 to 0.0 as
    # xs.abs().amax() does), without a tensor-sized abs() temporary
    amax = torch.maximum(mx, -mn).abs()
    scale_st = round_up_to_dtype(amax / ((1 << (bits - 1)) - 1), scale_dtype)
    _check_storable(scale_st, finite, "scale", scale_dtype)
    return scale_st, scale_st.float()


def quantize_groups(
    x: torch.Tensor,
    bits: int,
    *,
    symmetric: bool = False,
    midpoint: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> GroupQuant:
    """Quantize each group (the last dimension of ``x``) with one (scale, zero).

    Parameters
    ----------
    x : Tensor ``[..., n]`` float16/bfloat16/float32/float64; each row of ``n`` elements is a group.
    bits : 1..8 or 16.
    symmetric : absmax quantization (needs ``bits >= 2``); asymmetric min-max otherwise.
    midpoint : 1-bit midpoint reconstruction (PN-Mix Eq. 7 [RECON]); only with ``bits == 1``.
    scale_dtype : storage dtype of scale and zero.

    Raises
    ------
    ValueError
        Unsupported bits or dtype, symmetric 1-bit, midpoint with bits != 1, or a finite group
        whose scale or min overflows ``scale_dtype`` (use ``scale_dtype='float32'``).
    """
    check_bits(bits)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"input dtype {x.dtype} is not supported; allowed: {FLOAT_DTYPES}")
    if symmetric and bits < 2:
        raise ValueError("symmetric quantization needs bits >= 2 (got bits=1)")
    if midpoint and bits != 1:
        raise ValueError(f"midpoint reconstruction applies to 1-bit groups only (got bits={bits})")
    xf = x.float()
    # the group min and max first: a NaN or an infinity in a group makes its min or max
    # non-finite (NaN propagates through both; +-inf is the max or the min), so the common
    # all-finite case needs no tensor-sized isfinite mask (kvbench.cache.finite.all_finite)
    mn, mx = torch.aminmax(xf, dim=-1, keepdim=True)
    if bool((torch.isfinite(mn) & torch.isfinite(mx)).all()):  # no masking, no NaN restored
        finite, xs = None, xf
    else:
        isfin = torch.isfinite(xf)
        finite = isfin.all(dim=-1, keepdim=True)
        xs = torch.where(isfin, xf, torch.zeros((), dtype=xf.dtype, device=xf.device))
        mn, mx = torch.aminmax(xs, dim=-1, keepdim=True)
    # xs is this call's own float32 working copy unless x was float32 (x.float() is x)
    own = xs.data_ptr() != x.data_ptr() or xs.numel() == 0
    if symmetric:
        half = 1 << (bits - 1)
        qmax_s = half - 1
        scale_st, s = symmetric_terms(mn, mx, bits, scale_dtype, finite)
        pos = s > 0
        safe = torch.where(pos, s, torch.ones((), device=x.device))
        q = (xs.div_(safe) if own else xs / safe).round_()  # in place on the working copy
        if not bool(pos.all()):
            q.masked_fill_(~pos, 0.0)
        codes = q.clamp_(-qmax_s, qmax_s).add_(half).to(torch.int32)
        return GroupQuant(codes, _restore_nan(scale_st, finite), None, bits, symmetric=True)
    qmax = (1 << bits) - 1
    scale_st, mn_st, s, mnf = affine_terms(mn, mx, bits, scale_dtype, finite)
    pos = s > 0
    if midpoint:  # Eq. 7 [RECON]: q = 1[x - mn >= (mx - mn) / 2]
        q = ((xs - mnf) >= 0.5 * s) & pos
        q = q.float()
    else:  # in place on one float32 working buffer (the inputs can be GBs)
        safe = torch.where(pos, s, torch.ones((), device=x.device))
        q = (xs.sub_(mnf) if own else xs - mnf).div_(safe).round_()
        if not bool(pos.all()):
            q.masked_fill_(~pos, 0.0)
    codes = q.clamp_(0, qmax).to(torch.int32)
    scale_st, mn_st = _restore_nan(scale_st, finite), _restore_nan(mn_st, finite)
    return GroupQuant(codes, scale_st, mn_st, bits, midpoint=midpoint)


def _restore_nan(v: torch.Tensor, finite: torch.Tensor | None) -> torch.Tensor:
    """``v`` with NaN where its group held a non-finite value (``finite=None``: none did)."""
    if finite is None:
        return v
    return torch.where(finite, v, torch.full((), float("nan"), device=v.device).to(v.dtype))


def _unstorable(
    vf: torch.Tensor,
    finite: torch.Tensor | None,
    dtype: torch.dtype,
    exact: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool mask of the groups of finite input (``finite``; ``None``: every group) whose
    stored value (``vf``: its float32 form) is not finite, i.e. overflowed ``dtype``."""
    bad = ~torch.isfinite(vf)  # float8 has no isfinite of its own
    if exact is not None and dtype.itemsize == 1:  # float8 casts saturate instead of overflowing
        bad = bad | (exact.abs() > torch.finfo(dtype).max)
    return bad if finite is None else finite & bad


def _check_storable(
    v: torch.Tensor,
    finite: torch.Tensor | None,
    what: str,
    dtype: torch.dtype,
    exact: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` when :func:`_unstorable` flags a group of ``v``."""
    if bool(_unstorable(v.float(), finite, dtype, exact).any()):
        raise ValueError(
            f"the group {what} overflows scale_dtype={dtype}; "
            "use scale_dtype='float32' for inputs of this range"
        )


def dequantize_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    *,
    symmetric: bool = False,
    midpoint: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize codes with broadcastable ``scale``/``zero``: ``code * scale + zero``.

    Computed in float32 and returned as ``dtype``.  Symmetric: ``(code - 2^(b-1)) * scale``;
    1-bit midpoint: ``zero + scale/4 + code * scale/2``.
    """
    c = codes.float()
    s = scale.float()
    if symmetric:
        return ((c - (1 << (bits - 1))) * s).to(dtype)
    z = zero.float()
    if midpoint:
        return (c * (s * 0.5) + (z + s * 0.25)).to(dtype)
    return (c * s + z).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    bits: int,
    *,
    symmetric: bool = False,
    midpoint: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """Quantize then dequantize groups (last dim) of ``x``; returns ``x``'s dtype and shape."""
    g = quantize_groups(x, bits, symmetric=symmetric, midpoint=midpoint, scale_dtype=scale_dtype)
    return dequantize_groups(
        g.codes, g.scale, g.zero, bits, symmetric=symmetric, midpoint=midpoint, dtype=x.dtype
    )
