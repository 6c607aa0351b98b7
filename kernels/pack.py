"""Bit packing of quantization codes: PyTorch reference, Triton kernels, host wrappers.

Layout (exactly :func:`kvbench.cache.quant.pack_bits`): along the last dimension, ``n`` codes of
``b`` bits form one LSB-first bit stream, code ``i`` occupying bits ``i*b .. i*b + b - 1``,
stored in ``ceil(n*b/8)`` bytes (uint8); the unused high bits of the last byte are zero.  The
mixed-precision key rows of :mod:`kvbench.cache.mixed_channel` are the same stream with classes of different
widths one after the other; the kernels here read and write one *class* at a time starting at
a byte offset, so every class must start on a byte boundary (``pack_mixed``'s fast path).

How the kernels move bits.  Eight consecutive ``b``-bit codes are exactly ``b`` bytes, so a
class of ``NP`` codes (``NP`` a multiple of 8) is ``NP/8`` chunks of ``b`` bytes.  Unpacking
loads a ``[rows, NP/8, b]`` byte tile (contiguous per row, so the loads vectorize), assembles
one ``8b``-bit word per chunk (int32 for ``b <= 4``, int64 above; bytes are disjoint bit
fields, so a sum is an OR), shifts the eight codes out of each word
(``(word >> b*s) & (2^b - 1)``, ``s`` static) and reshapes ``[rows, NP/8, 8] -> [rows, NP]``;
packing runs the same steps backwards.  No per-code gathers, no bit-serial loops.  8-bit codes
are plain bytes.

The ``@triton.jit`` helpers :func:`unpack_tile` and :func:`pack_tile` are shared by
:mod:`.quantize` and :mod:`.decode_attention`, so the layout lives in one place.

Only torch and triton are imported (no kvbench core): the device check runs these from the
source tree.
"""

from __future__ import annotations

import torch

from ._triton import check_device, jit, next_pow2, tl, triton

SUPPORTED_PACK_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


# --------------------------------------------------------------------------------------------
# PyTorch reference (bit by bit; slow and obviously right)
# --------------------------------------------------------------------------------------------


def pack_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., n]`` (values in ``[0, 2^bits)``) into uint8
    ``[..., ceil(n*bits/8)]``, LSB-first, one bit at a time."""
    *lead, n = codes.shape
    c = codes.to(torch.int64)
    nbytes = (n * bits + 7) // 8
    out = torch.zeros(*lead, nbytes, dtype=torch.int64, device=codes.device)
    for i in range(n):
        for k in range(bits):
            g = i * bits + k
            out[..., g // 8] |= ((c[..., i] >> k) & 1) << (g % 8)
    return out.to(torch.uint8)


def unpack_reference(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_reference`: uint8 ``[..., bytes]`` -> int32 ``[..., n]``."""
    p = packed.to(torch.int64)
    out = torch.zeros(*packed.shape[:-1], n, dtype=torch.int64, device=packed.device)
    for i in range(n):
        for k in range(bits):
            g = i * bits + k
            out[..., i] |= ((p[..., g // 8] >> (g % 8)) & 1) << k
    return out.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Triton helpers (shared with quantize.py and decode_attention.py)
# --------------------------------------------------------------------------------------------


@jit
def unpack_tile(
    row_ptr,
    row_mask,
    byte0,
    limit,
    R: tl.constexpr,
    NP: tl.constexpr,
    BITS: tl.constexpr,
):
    """Codes int32 ``[R, NP]``: ``NP`` consecutive ``BITS``-bit codes of each row.

    ``row_ptr``: ``[R]`` uint8 pointers to the rows' first byte; ``row_mask``: ``[R]`` rows to
    read (others give 0); ``byte0``: byte offset of the first code; ``limit``: bytes at or
    beyond it are not read (codes there are 0).  ``NP``: a multiple of 8.
    """
    if BITS == 8:
        j = tl.arange(0, NP)
        idx = byte0 + j
        m = row_mask[:, None] & (idx < limit)[None, :]
        b = tl.load(row_ptr[:, None] + idx[None, :], mask=m, other=0)
        codes = b.to(tl.int32)
    else:
        NCH: tl.constexpr = NP // 8
        BP: tl.constexpr = 1 if BITS == 1 else (2 if BITS == 2 else (4 if BITS <= 4 else 8))
        c = tl.arange(0, NCH)
        p = tl.arange(0, BP)
        idx = byte0 + c[:, None] * BITS + p[None, :]  # [NCH, BP]
        m = (p[None, :] < BITS) & (idx < limit)
        b = tl.load(
            row_ptr[:, None, None] + idx[None, :, :],
            mask=row_mask[:, None, None] & m[None, :, :],
            other=0,
        )  # [R, NCH, BP] uint8
        s = tl.arange(0, 8) * BITS
        if BITS <= 4:
            word = tl.sum(b.to(tl.int32) << (8 * p)[None, None, :], axis=2)  # [R, NCH]
            c3 = (word[:, :, None] >> s[None, None, :]) & ((1 << BITS) - 1)
        else:
            word = tl.sum(b.to(tl.int64) << (8 * p).to(tl.int64)[None, None, :], axis=2)
            c3 = (word[:, :, None] >> s.to(tl.int64)[None, None, :]) & ((1 << BITS) - 1)
        codes = tl.reshape(c3, (R, NP)).to(tl.int32)
    return codes


@jit
def pack_tile(
    row_ptr,
    row_mask,
    byte0,
    limit,
    codes,
    R: tl.constexpr,
    NP: tl.constexpr,
    BITS: tl.constexpr,
):
    """Store int32 codes ``[R, NP]`` (values in ``[0, 2^BITS)``; padding codes must be 0) as
    ``BITS``-bit codes from byte ``byte0`` of each row; bytes at or beyond ``limit`` are not
    written.  Inverse of :func:`unpack_tile`."""
    if BITS == 8:
        j = tl.arange(0, NP)
        idx = byte0 + j
        m = row_mask[:, None] & (idx < limit)[None, :]
        tl.store(row_ptr[:, None] + idx[None, :], codes.to(tl.uint8), mask=m)
    else:
        NCH: tl.constexpr = NP // 8
        BP: tl.constexpr = 1 if BITS == 1 else (2 if BITS == 2 else (4 if BITS <= 4 else 8))
        c = tl.arange(0, NCH)
        p = tl.arange(0, BP)
        s = tl.arange(0, 8) * BITS
        c3 = tl.reshape(codes, (R, NCH, 8))
        if BITS <= 4:
            word = tl.sum(c3 << s[None, None, :], axis=2)  # disjoint bit fields: sum == OR
            b = (word[:, :, None] >> (8 * p)[None, None, :]) & 255
        else:
            word = tl.sum(c3.to(tl.int64) << s.to(tl.int64)[None, None, :], axis=2)
            b = (word[:, :, None] >> (8 * p).to(tl.int64)[None, None, :]) & 255
        idx = byte0 + c[:, None] * BITS + p[None, :]
        m = (p[None, :] < BITS) & (idx < limit)
        tl.store(
            row_ptr[:, None, None] + idx[None, :, :],
            b.to(tl.uint8),
            mask=row_mask[:, None, None] & m[None, :, :],
        )


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@jit
def _pack_kernel(
    codes_ptr,
    out_ptr,
    M,
    n,
    nbytes,
    stride_cm,
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NP: tl.constexpr,
):
    # one program: BLOCK_M rows x NP codes (NP*BITS/8 bytes)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = pid_n * NP + tl.arange(0, NP)
    cmask = cols < n
    c = tl.load(
        codes_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        mask=rmask[:, None] & cmask[None, :],
        other=0,
    ).to(tl.int32)
    c = c & ((1 << BITS) - 1)
    out_rows = out_ptr + rows.to(tl.int64) * stride_om
    pack_tile(out_rows, rmask, pid_n * (NP * BITS // 8), nbytes, c, BLOCK_M, NP, BITS)


@jit
def _unpack_kernel(
    packed_ptr,
    out_ptr,
    M,
    n,
    nbytes,
    stride_pm,
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    in_rows = packed_ptr + rows.to(tl.int64) * stride_pm
    c = unpack_tile(in_rows, rmask, pid_n * (NP * BITS // 8), nbytes, BLOCK_M, NP, BITS)
    cols = pid_n * NP + tl.arange(0, NP)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        c,
        mask=rmask[:, None] & (cols < n)[None, :],
    )


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_PACK_BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {list(SUPPORTED_PACK_BITS)}")


def _tiles(n: int) -> int:
    return min(128, max(8, next_pow2(n)))


def pack_bits(codes: torch.Tensor, bits: int, block_m: int = 16) -> torch.Tensor:
    """Pack codes ``[..., n]`` (any integer dtype, values in ``[0, 2^bits)``) along the last
    dimension: uint8 ``[..., ceil(n*bits/8)]``, bit-identical to
    :func:`kvbench.cache.quant.pack_bits`.

    Raises ``ValueError`` for bits outside 1..8, a non-integer dtype, or tensors the kernel
    cannot read (CPU tensors outside the interpreter, device placement before a kernel launch (CPU tensor to Triton): jy-yuan/KIVI#24 and #13, docs/methods.md#device-placement-before-a-kernel-launch).
    """
    _check_bits(bits)
    if codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"codes must have an integer dtype, got {codes.dtype}")
    check_device(_pack_kernel, codes)
    *lead, n = codes.shape
    nbytes = (n * bits + 7) // 8
    c2 = codes.reshape(-1, n).contiguous() if n else codes.reshape(-1, 0)
    m = c2.shape[0]
    out = torch.empty(m, nbytes, dtype=torch.uint8, device=codes.device)
    if m and n:
        np_ = _tiles(n)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, np_))
        _pack_kernel[grid](
            c2, out, m, n, nbytes, c2.stride(0), out.stride(0), BITS=bits, BLOCK_M=block_m, NP=np_
        )
    return out.reshape(*lead, nbytes)


def unpack_bits(packed: torch.Tensor, bits: int, n: int, block_m: int = 16) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., bytes]`` -> int32 ``[..., n]``.

    Raises ``ValueError`` for bits outside 1..8, a non-uint8 input, fewer than
    ``ceil(n*bits/8)`` bytes, or tensors the kernel cannot read.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    *lead, nbytes = packed.shape
    if nbytes < (n * bits + 7) // 8:
        raise ValueError(f"{nbytes} bytes cannot hold {n} codes of {bits} bits")
    check_device(_unpack_kernel, packed)
    p2 = packed.reshape(-1, nbytes).contiguous()
    m = p2.shape[0]
    out = torch.empty(m, n, dtype=torch.int32, device=packed.device)
    if m and n:
        np_ = _tiles(n)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, np_))
        _unpack_kernel[grid](
            p2, out, m, n, nbytes, p2.stride(0), out.stride(0), BITS=bits, BLOCK_M=block_m, NP=np_
        )
    return out.reshape(*lead, n)
