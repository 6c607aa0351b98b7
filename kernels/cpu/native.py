"""Native (C) CPU kernels of the code-domain decode attention: one read of each stored token.

:mod:`kvbench.kernels.cpu.codedomain` computes a decode step's attention on the stored codes.
This module calls ``kernels/cpu/csrc/codes.c``, compiled by the package's build (see Build
below), through :mod:`ctypes` (a few microseconds per call): per KV head, each token's codes are
decoded into a float buffer in L1 and used by all ``M`` query rows before the next token is read
(see the C file's header for the math).

Layouts served (exactly :func:`kvbench.cache.quant.dequantize_groups`'s affine terms, or a table):

* :func:`keys_rows`: keys with per-channel terms per row of ``L`` tokens (KIVI per-channel key
  pages, per-head pages; mixed-precision classes, one class at a time);
* :func:`keys_groups` / :func:`values_groups`: per-token terms over channel groups
  (per-token keys and values, llama.cpp-style blocks, PM-KVQ), optionally with an
  :class:`Upper` plane of some tokens' upper bits read where they are stored (SemKV);
* :func:`keys_lut` / :func:`values_lut`: codes looked up in a ``2^bits``-entry float table
  (fp8 bytes; codebooks);
* :func:`keys_lut_outliers`: a shared table with per-channel half-range and centre, sparse
  exact outliers, optionally read rotated by RoPE (KVQuant's pre-RoPE keys);
* :func:`keys_polar`: radius and angle codes of RoPE pairs with a per-page query table
  (PolarQuant).

Build: ``setup.py`` compiles :data:`SOURCE` with :data:`FLAGS` (plus ``$KVBENCH_NATIVE_CFLAGS``)
into :data:`LIBRARY`, next to this module, at ``pip install .`` / ``pip install -e .`` (about
145 CPU-s in six translation units compiled concurrently, the file's ``KV_UNIT`` guards);
:mod:`kvbench.clib` loads it and checks its ABI and source digest.  Not built (no
compiler at install, a source checkout never built), stale or failed: :func:`available` is
``False`` with the reason (:func:`unavailable_reason`), and the callers use the eager
kernels.  ``KVBENCH_NATIVE=0`` disables this module.

Shapes: ``codes`` uint8 ``[B, H_kv, T, nbytes]`` (any strides with contiguous rows; a view of a
byte slice of each row for a mixed class), ``q`` float32 ``[B, H_kv, M, D]`` (the logit scale
applied), ``p`` float32 ``[B, H_kv, M, T]``; ``D = nbytes * 8 / bits``, a multiple of the codes
per word (:func:`code_layout`), at most :data:`MAX_HEAD_DIM`.  Results are
float32; sums in float32 in token order per row (the reference matmul's precision).
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch

from kvbench.clib import NativeLibrary, load_checked

SOURCE = Path(__file__).with_name("csrc") / "codes.c"
#: the shared object setup.py builds from SOURCE with FLAGS (~2.4 CPU-min with GCC 12 at -O3:
#: the fused kernel is instantiated per (key, value) kind pair, once per instruction set)
LIBRARY = Path(__file__).with_name("_codes.so")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11")
ABI_VERSION = 12
# KVBENCH_NATIVE_TILES: "1" (default) the fastest kernel that applies; "0" the per-token loops
# (a check of the tiled and vectorised kernels); "tiled" the 8-token tiles for keys even where
# the vectorised keys apply (a check of the vectorised keys against the tiles)
_KERNEL_CHOICE = {"1": 0, "0": 1, "tiled": 2}
MAX_HEAD_DIM = 1024
MODE_AFFINE_ROWS, MODE_AFFINE_GROUPS, MODE_LUT, MODE_RAW, MODE_STREAM = 0, 1, 2, 3, 4


class _Args(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("cs_b", ctypes.c_int64),
        ("cs_h", ctypes.c_int64),
        ("cs_t", ctypes.c_int64),
        ("B", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("T", ctypes.c_int64),
        ("W", ctypes.c_int64),
        ("M", ctypes.c_int64),
        ("mode", ctypes.c_int),
        ("A", ctypes.c_void_p),
        ("Z", ctypes.c_void_p),
        ("as_b", ctypes.c_int64),
        ("as_h", ctypes.c_int64),
        ("as_r", ctypes.c_int64),
        ("L", ctypes.c_int64),
        ("WG", ctypes.c_int64),
        ("lut", ctypes.c_void_p),
        ("qp", ctypes.c_void_p),
        ("q_sm", ctypes.c_int64),
        ("q_sr", ctypes.c_int64),
        ("off", ctypes.c_void_p),
        ("wid", ctypes.c_void_p),
        ("nbytes", ctypes.c_int64),
        ("no_tiles", ctypes.c_int),
        ("out", ctypes.c_void_p),
        ("bit0", ctypes.c_int64),
        ("natural", ctypes.c_int),
        ("up", ctypes.c_void_p),
        ("up_row", ctypes.c_void_p),
        ("up_nb", ctypes.c_int64),
        ("up_bits", ctypes.c_int),
        ("up_shift", ctypes.c_int),
    ]


class _LutArgs(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("cs_b", ctypes.c_int64),
        ("cs_h", ctypes.c_int64),
        ("cs_t", ctypes.c_int64),
        ("B", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("T", ctypes.c_int64),
        ("M", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("lut", ctypes.c_void_p),
        ("hs", ctypes.c_void_p),
        ("hz", ctypes.c_void_p),
        ("out_idx", ctypes.c_void_p),
        ("out_val", ctypes.c_void_p),
        ("N", ctypes.c_int64),
        ("qp", ctypes.c_void_p),
        ("cosv", ctypes.c_void_p),
        ("sinv", ctypes.c_void_p),
        ("pi", ctypes.c_void_p),
        ("pj", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("scalar", ctypes.c_int),
    ]


class _PolarArgs(ctypes.Structure):
    _fields_ = [
        ("rc", ctypes.c_void_p),
        ("ac", ctypes.c_void_p),
        *((f, ctypes.c_int64) for f in ("rs_b", "rs_h", "rs_t", "as_b", "as_h", "as_t")),
        *((f, ctypes.c_int64) for f in ("B", "H", "T", "M", "P", "L", "NP")),
        ("ar", ctypes.c_void_p),
        ("br", ctypes.c_void_p),
        ("tab", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("scalar", ctypes.c_int),
    ]


class _FusedSide(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("bits", ctypes.c_int),
        ("sdt", ctypes.c_int),
        ("x", ctypes.c_void_p),
        ("xs", ctypes.c_int64 * 3),
        ("s", ctypes.c_void_p),
        ("z", ctypes.c_void_p),
        ("ss", ctypes.c_int64 * 3),
        ("zs", ctypes.c_int64 * 3),
        ("cg", ctypes.c_int64),
        ("G", ctypes.c_int64),
        ("phase", ctypes.c_int64),
    ]


class _FusedSeg(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("k", _FusedSide), ("v", _FusedSide)]


FUSED_MAX_SEGS = 6


class _FusedArgs(ctypes.Structure):
    _fields_ = [
        *((f, ctypes.c_int64) for f in ("B", "H", "M", "D", "nq")),
        ("q", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("nseg", ctypes.c_int64),
        ("seg", _FusedSeg * FUSED_MAX_SEGS),
        ("out", ctypes.c_void_p),
    ]


def _load_library() -> ctypes.CDLL:
    """The built :data:`LIBRARY` with its functions' argument types set.  Raises
    ``FileNotFoundError`` when it was not built, ``RuntimeError`` when stale or of another
    ABI (:func:`kvbench.clib.load_checked`)."""
    lib = load_checked(LIBRARY, SOURCE, "kv_abi_version", ABI_VERSION)
    for fn in (lib.kv_keys, lib.kv_values):
        fn.argtypes = [ctypes.POINTER(_Args), ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.kv_keys_lut_outliers.argtypes = [ctypes.POINTER(_LutArgs), ctypes.c_int]
    lib.kv_keys_lut_outliers.restype = ctypes.c_int
    lib.kv_keys_polar.argtypes = [ctypes.POINTER(_PolarArgs), ctypes.c_int, ctypes.c_int]
    lib.kv_keys_polar.restype = ctypes.c_int
    lib.kv_attend_fused.argtypes = [ctypes.POINTER(_FusedArgs), ctypes.c_int]
    lib.kv_attend_fused.restype = ctypes.c_int
    lib.kv_fused_isa.argtypes = [ctypes.c_int]
    lib.kv_fused_isa.restype = ctypes.c_int
    lib.kv_fused_pair.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.kv_fused_pair.restype = ctypes.c_int
    return lib


_NATIVE = NativeLibrary(lambda: _load_library(), "native kernels")


def _load() -> ctypes.CDLL | None:
    return _NATIVE.load()


available = _NATIVE.available  # whether built and loaded (loads on the first call)
unavailable_reason = _NATIVE.unavailable_reason  # None when available, else why not


# ------------------------------------------------------------------------------ helpers
def code_layout(bits: int) -> tuple[int, int]:
    """``(bytes_per_word, codes_per_word)`` of :func:`kvbench.cache.quant.pack_bits`'s LSB-first
    stream: the smallest run of whole bytes holding whole codes (2 bits: 1 byte, 4 codes;
    3 bits: 3 bytes, 8 codes); ``bits=0``, a bit stream of per-channel widths: ``(0, 1)``."""
    if bits == 0:  # a bit stream of per-channel widths: one "word" per channel
        return 0, 1
    g = math.gcd(bits, 8)
    return bits // g, 8 // g


def _sub(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` channel order -> float32 contiguous sub-code order (position ``i * W + w``
    holds channel ``w * cpw + i``)."""
    cpw = code_layout(bits)[1]
    x = x.float()
    return x.reshape(*x.shape[:-1], -1, cpw).transpose(-1, -2).reshape(x.shape).contiguous()


def supports(codes: torch.Tensor, bits: int, head_dim: int) -> bool:
    """Whether the native kernels take ``codes`` (uint8 rows, contiguous last dim, on the
    CPU) of ``bits``-bit codes for ``head_dim`` channels."""
    if (
        not (1 <= bits <= 8 or bits == 16)
        or codes.dtype != torch.uint8
        or codes.device.type != "cpu"
    ):
        return False
    _, cpw = code_layout(bits)
    return (
        head_dim % cpw == 0
        and head_dim <= MAX_HEAD_DIM
        and codes.shape[-1] * 8 >= head_dim * bits
        and (codes.shape[-1] == 1 or codes.stride(-1) == 1)
        and available()
    )


def _args(codes, bits, d, m, qp, out, mode, a=None, z=None, length=1, wg=1, lut=None, rows=0):
    b, h, t, _ = codes.shape
    w = d // code_layout(bits)[1]
    args = _Args()
    args.codes = codes.data_ptr()
    args.cs_b, args.cs_h, args.cs_t = _row_strides(codes)
    args.B, args.H, args.T, args.W, args.M = b, h, t, w, m
    args.mode = mode
    if a is not None:
        args.A, args.Z = a.data_ptr(), z.data_ptr()
        args.as_b = a.stride(0) if a.shape[0] > 1 else 0
        args.as_h = a.stride(1) if a.shape[1] > 1 else 0
        args.as_r = a.stride(2)
    args.L, args.WG = length, wg
    if lut is not None:
        args.lut = lut.data_ptr()
    args.qp, args.out = qp.data_ptr(), out.data_ptr()
    args.q_sm, args.q_sr = (rows * d, d) if rows else (d, 0)
    args.no_tiles = _KERNEL_CHOICE.get(os.environ.get("KVBENCH_NATIVE_TILES", "1"), 0)
    args.keep = (codes, qp, out, a, z, lut)  # the raw pointers' owners live as long as args
    return args


def _loaded() -> ctypes.CDLL:
    """The loaded kernels; ``RuntimeError`` with the reason when they are unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(_NATIVE.reason)
    return lib


def _row_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """Element strides of ``x``'s batch, head and token dims (0 where a dim has size 1)."""
    return tuple(x.stride(i) if x.shape[i] > 1 else 0 for i in range(3))


def _call(fn_name: str, args: _Args, bits: int) -> None:
    rc = getattr(_loaded(), fn_name)(ctypes.byref(args), bits)
    if rc == -3:
        raise RuntimeError(f"{fn_name}: natural channel order given where the kernel needs "
                           "sub-code order")  # fmt: skip
    if rc == -4:
        raise ValueError(f"{fn_name}: an upper plane the kernels do not take (upper_fits)")
    if rc != 0:
        raise ValueError(f"{fn_name}: head_dim above {MAX_HEAD_DIM}")


def _vectorised_keys(bits: int, d: int, m: int, wg: int | None = None) -> bool:
    """Whether the vectorised keys take codes of ``bits`` bits, ``d`` channels and ``m``
    query rows (the C side's ``keys_vec_ok``, codes starting on a byte): their query and row
    terms are then passed in natural channel order, without the sub-code reorder.  ``wg``:
    words per channel group of per-token keys."""
    if _KERNEL_CHOICE.get(os.environ.get("KVBENCH_NATIVE_TILES", "1"), 0) or m > 16:
        return False
    if not (1 <= bits <= 4 or bits == 8) or d % 8:
        return False
    cpw = code_layout(bits)[1]
    return wg is None or ((wg * cpw) % 8 == 0 and (d // cpw) % wg == 0)


def _keys_order(x: torch.Tensor, bits: int, natural: bool) -> torch.Tensor:
    """``x [..., D]`` float32 contiguous in natural order, or in sub-code order (:func:`_sub`)."""
    return x.float().contiguous() if natural else _sub(x, bits)


def _check_terms(a: torch.Tensor, z: torch.Tensor, codes: torch.Tensor) -> None:
    for name, x in (("A", a), ("Z", z)):
        if (
            x.dim() != 4
            or x.shape[0] not in (1, codes.shape[0])
            or x.shape[1]
            not in (
                1,
                codes.shape[1],
            )
        ):
            raise ValueError(f"affine term {name} of shape {tuple(x.shape)} does not fit codes "
                             f"{tuple(codes.shape)}")  # fmt: skip


# ------------------------------------------------------------------------------ kernels
def keys_rows(codes, q, a, z, length: int, bits: int) -> torch.Tensor:
    """Key logits ``[B, H, M, T]``: ``q . (c_t * a_r + z_r)`` with ``r = t // length``.

    ``a, z``: float ``[B|1, H|1, R, D]`` per channel per row (``R >= ceil(T / length)``)."""
    _check_terms(a, z, codes)
    bsz, h, t, _ = codes.shape
    m, d = q.shape[2], q.shape[3]
    nat = _vectorised_keys(bits, d, m)
    qs, a_s, z_s = (_keys_order(x, bits, nat) for x in (q, a, z))
    out = torch.empty(bsz, h, m, t, dtype=torch.float32)
    args = _args(codes, bits, d, m, qs, out, MODE_AFFINE_ROWS, a_s, z_s, length=length)
    args.natural = int(nat)
    _call("kv_keys", args, bits)
    return out


def _group_terms(a, z, codes, bits, d):
    _check_terms(a, z, codes)
    cpw = code_layout(bits)[1]
    cg = d // a.shape[-1]
    if cg % cpw:
        raise ValueError(f"channel groups of {cg} do not hold whole words of {cpw} codes")
    return a.float().contiguous(), z.float().contiguous(), cg // cpw


class Upper(NamedTuple):
    """An upper plane of some tokens for :func:`keys_groups` / :func:`values_groups`: token
    ``t`` of (row ``b``, head ``h``) has code ``c + 2^shift u`` where ``r = row[b, h, t] >= 0``,
    ``u`` the ``bits``-bit codes of row ``r`` of ``codes`` (uint8 ``[N, nb]``, pack_bits order;
    ``row`` int32 ``[B, H, T]``, -1: no upper codes).  SemKV's high tokens
    (``methods/semkv.py``)."""

    codes: torch.Tensor
    row: torch.Tensor
    bits: int
    shift: int


def upper_fits(upper: Upper, bits: int, d: int, m: int, group: int, values: bool) -> bool:
    """Whether the native kernels take ``upper`` beside ``bits``-bit low codes of ``d``
    channels in groups of ``group`` channels for ``m`` query rows (the C side's ``upper_ok``:
    the vectorised natural-order kernels for keys, ``upper.bits`` 1..4, ``upper.shift`` 0..23,
    groups of whole vectors of 8 channels)."""
    wg = group // code_layout(bits)[1] if group % code_layout(bits)[1] == 0 else 0
    return (
        1 <= upper.bits <= 4
        and 0 <= upper.shift <= 23
        and upper.codes.dim() == 2
        and group % 8 == 0
        and d % 8 == 0
        and upper.codes.dtype == torch.uint8
        and upper.codes.shape[-1] * 8 >= d * upper.bits
        and (values or wg > 0 and _vectorised_keys(bits, d, m, wg))
    )


def _set_upper(args: _Args, upper: Upper | None, shape: tuple[int, int, int]) -> None:
    if upper is None:
        return
    codes, row = upper.codes.contiguous(), upper.row.to(torch.int32).contiguous()
    if tuple(row.shape) != shape:
        raise ValueError(f"upper rows of shape {tuple(row.shape)} do not fit {shape}")
    lo, hi = (int(x) for x in torch.aminmax(row)) if row.numel() else (-1, -1)
    if codes.dim() != 2 or not -1 <= lo <= hi < len(codes):
        raise ValueError(f"upper rows must index the {tuple(codes.shape)} upper codes (or be -1)")
    if not 0 <= upper.shift <= 23:
        raise ValueError(f"upper shift {upper.shift} is not supported; allowed: 0..23")
    args.up, args.up_row, args.up_nb = codes.data_ptr(), row.data_ptr(), codes.shape[-1]
    args.up_bits, args.up_shift = upper.bits, upper.shift
    args.keep = (*args.keep, codes, row)


def keys_groups(codes, q, a, z, bits: int, upper: Upper | None = None) -> torch.Tensor:
    """Key logits ``[B, H, M, T]`` of per-token groups: ``a, z`` float ``[B|1, H|1, T, Dg]``
    (``x = c * a_{t,g} + z_{t,g}``, ``D / Dg`` channels per group, whole words); ``upper``
    (:class:`Upper`, where :func:`upper_fits`): some tokens' codes have upper bits."""
    bsz, h, t, _ = codes.shape
    m, d = q.shape[2], q.shape[3]
    a, z, wg = _group_terms(a, z, codes, bits, d)
    nat = _vectorised_keys(bits, d, m, wg)
    out = torch.empty(bsz, h, m, t, dtype=torch.float32)
    args = _args(codes, bits, d, m, _keys_order(q, bits, nat), out, MODE_AFFINE_GROUPS, a, z, wg=wg)
    args.natural = int(nat)
    _set_upper(args, upper, (bsz, h, t))
    _call("kv_keys", args, bits)
    return out


def values_groups(codes, p, a, z, bits: int, d: int, upper: Upper | None = None) -> torch.Tensor:
    """``sum_t p_t (c_t * a_t + z_t)`` ``[B, H, M, D]`` over per-token groups (see
    :func:`keys_groups`, ``upper`` likewise); ``p`` float ``[B, H, M, T]``."""
    bsz, h, t, _ = codes.shape
    m = p.shape[2]
    a, z, wg = _group_terms(a, z, codes, bits, d)
    p = p.float().contiguous()
    out = torch.empty(bsz, h, m, d, dtype=torch.float32)
    args = _args(codes, bits, d, m, p, out, MODE_AFFINE_GROUPS, a, z, wg=wg)
    args.natural = 1  # written in natural channel order
    _set_upper(args, upper, (bsz, h, t))
    _call("kv_values", args, bits)
    return out


def keys_raw_rows(codes, qs, length: int, bits: int, bit0: int = 0) -> torch.Tensor:
    """Key logits ``[B, H, M, T]``: ``qs_r . c_t`` with ``r = t // length`` (raw codes; the
    caller folded the scales into ``qs`` float ``[B, H, M, R, D]``, one query per row, and adds
    the zero-point terms).  ``bit0`` (0..7): the codes start at that bit of each row of
    ``codes`` (a class of a bit stream, :func:`kvbench.cache.mixed_channel.pack_mixed`); bits past the
    row's bytes read as 0, so channels beyond the class with a zero query add nothing."""
    bsz, h, t, nbytes = codes.shape
    m, rows, d = qs.shape[2], qs.shape[3], qs.shape[4]
    if rows * length < t:
        raise ValueError(f"{rows} query rows of {length} tokens do not cover {t} tokens")
    if not 0 <= bit0 < 8:
        raise ValueError(f"bit0={bit0} must be in 0..7 (a bit within the first byte)")
    nat = bit0 == 0 and _vectorised_keys(bits, d, m)
    out = torch.empty(bsz, h, m, t, dtype=torch.float32)
    args = _args(codes, bits, d, m, _keys_order(qs, bits, nat), out, MODE_RAW, length=length,
                 rows=rows)  # fmt: skip
    args.bit0, args.nbytes, args.natural = bit0, nbytes, int(nat)
    _call("kv_keys", args, bits)
    return out


def keys_stream_rows(codes, qs, widths, length: int, offsets=None) -> torch.Tensor:
    """Key logits ``[B, H, M, T]``: ``qs_r . c_t`` (``r = t // length``) with the codes of a
    row read as one LSB-first bit stream of per-channel ``widths`` (1..8 bits each, in stored
    order: :func:`kvbench.cache.mixed_channel.pack_mixed`); ``qs`` float ``[B, H, M, R, D]`` in the same
    channel order, the scales folded in (the caller adds the zero-point terms)."""
    bsz, h, t, nbytes = codes.shape
    m, rows, d = qs.shape[2], qs.shape[3], qs.shape[4]
    wid = torch.as_tensor(widths, dtype=torch.uint8)
    if wid.numel() != d or int(wid.min()) < 1 or int(wid.max()) > 8:
        raise ValueError(f"widths must be {d} values in 1..8, got {wid.tolist()}")
    if offsets is None:  # consecutive channels of the stream
        off = torch.cumsum(wid.to(torch.int32), 0, dtype=torch.int32) - wid.to(torch.int32)
    else:  # a subset: each channel's first bit
        off = torch.as_tensor(offsets, dtype=torch.int32)
        if off.numel() != d or int(off.min()) < 0:
            raise ValueError(f"offsets must be {d} bit positions >= 0, got {off.tolist()}")
    if int((off + wid.to(torch.int32)).max()) > nbytes * 8:
        raise ValueError(f"{int(wid.sum())} bits of codes do not fit rows of {nbytes} bytes")
    if rows * length < t:
        raise ValueError(f"{rows} query rows of {length} tokens do not cover {t} tokens")
    if not (codes.dtype == torch.uint8 and (nbytes == 1 or codes.stride(-1) == 1)):
        raise ValueError("codes must be uint8 rows with a contiguous last dimension")
    qs = qs.float().contiguous()
    out = torch.empty(bsz, h, m, t, dtype=torch.float32)
    args = _args(codes, 0, d, m, qs, out, MODE_STREAM, length=length, rows=rows)
    args.off, args.wid, args.nbytes = off.data_ptr(), wid.data_ptr(), nbytes
    args.keep = (*args.keep, off, wid)
    _call("kv_keys", args, 0)
    return out


def keys_lut(codes, q, lut, bits: int) -> torch.Tensor:
    """Key logits ``[B, H, M, T]``: ``q . lut[c_t]`` (``lut`` float ``[2^bits]``)."""
    bsz, h, t, _ = codes.shape
    m, d = q.shape[2], q.shape[3]
    lut = lut.float().contiguous()
    nat = _vectorised_keys(bits, d, m)
    out = torch.empty(bsz, h, m, t, dtype=torch.float32)
    args = _args(codes, bits, d, m, _keys_order(q, bits, nat), out, MODE_LUT, lut=lut)
    args.natural = int(nat)
    _call("kv_keys", args, bits)
    return out


def values_lut(codes, p, lut, bits: int, d: int) -> torch.Tensor:
    """``sum_t p_t lut[c_t]`` ``[B, H, M, D]``."""
    bsz, h, t, _ = codes.shape
    m = p.shape[2]
    lut = lut.float().contiguous()
    p = p.float().contiguous()
    out = torch.empty(bsz, h, m, d, dtype=torch.float32)
    args = _args(codes, bits, d, m, p, out, MODE_LUT, lut=lut)
    args.natural = 1  # written in natural channel order
    _call("kv_values", args, bits)
    return out


def keys_lut_outliers(codes, q, lut, half, center, out_idx, out_val, bits: int, rope=None):
    """Key logits ``[B, H, M, T]`` of codes looked up in a shared table, with per-channel
    half-range and centre and sparse exact outliers (KVQuant, Hooper et al., arXiv 2401.18079
    §3.1, §3.4): ``x_d = lut[c_d] * half[h, d] + center[h, d]``, except ``out_val[k]`` at the flat
    position ``out_idx[k]`` of ``[T, B, H, D]``; logits ``q . x``.  ``rope = (cos, sin, first,
    second)`` (float32 ``[T, D/2]`` each token's angles, int ``[D/2]`` the pairs' channels): the
    key is read rotated by RoPE at its position, ``x_i C - x_j S, x_j C + x_i S`` per pair.

    ``codes`` uint8 ``[B, H, T, ceil(D bits / 8)]`` (:func:`kvbench.cache.quant.pack_bits` order);
    ``q`` float ``[B, H, M, D]``; ``half``, ``center`` float ``[H, D]``; ``out_idx`` int
    ``[N]``, ascending (a block's outliers are kept in that order).  Raises ``ValueError`` for
    shapes that do not fit, pair indices outside ``[0, D)``, or outliers not ascending."""
    bsz, h, t, nbytes = codes.shape
    m, d = q.shape[2], q.shape[3]
    bad = (
        not 1 <= bits <= 8
        or d > MAX_HEAD_DIM
        or tuple(q.shape) != (bsz, h, m, d)
        or nbytes * 8 < d * bits
        or codes.dtype != torch.uint8
        or (nbytes > 1 and codes.stride(-1) != 1)
        or tuple(half.shape) != (h, d)
        or tuple(center.shape) != (h, d)
        or out_idx.shape != out_val.shape
    )
    qp = q.float()
    keep = [lut.float().contiguous(), half.float().contiguous(), center.float().contiguous()]
    keep += [out_idx.to(torch.int64).contiguous(), out_val.float().contiguous()]
    if rope is not None:
        cos, sin, first, second = rope
        p = d // 2
        bad = bad or (
            d % 2
            or tuple(cos.shape) != (t, p)
            or tuple(sin.shape) != (t, p)
            or tuple(first.shape) != (p,)
            or tuple(second.shape) != (p,)
            or not 0 <= min(int(first.min()), int(second.min()))
            or max(int(first.max()), int(second.max())) >= d
        )
        if not bad:
            qp = torch.cat([qp[..., first], qp[..., second]], -1)  # pair order
            keep += [cos.float().contiguous(), sin.float().contiguous()]
            keep += [first.to(torch.int32).contiguous(), second.to(torch.int32).contiguous()]
    if bad:
        raise ValueError(
            f"keys_lut_outliers: codes {tuple(codes.shape)}, q {tuple(q.shape)}, half "
            f"{tuple(half.shape)}, bits {bits} do not fit (head_dim <= {MAX_HEAD_DIM})"
        )
    keep.append(qp.contiguous())
    args = _LutArgs()
    args.codes = codes.data_ptr()
    args.cs_b, args.cs_h, args.cs_t = _row_strides(codes)
    args.B, args.H, args.T, args.M, args.D = bsz, h, t, m, d
    args.lut, args.hs, args.hz, args.out_idx, args.out_val = (x.data_ptr() for x in keep[:5])
    args.N = out_idx.numel()
    args.qp = keep[-1].data_ptr()
    if rope is not None:
        args.cosv, args.sinv, args.pi, args.pj = (x.data_ptr() for x in keep[5:9])
    out = torch.empty(bsz, h, m, t, dtype=torch.float32)
    args.out = out.data_ptr()
    args.scalar = int(_KERNEL_CHOICE.get(os.environ.get("KVBENCH_NATIVE_TILES", "1"), 0) == 1)
    lib = _loaded()
    rc = lib.kv_keys_lut_outliers(ctypes.byref(args), bits)
    if rc == -2:
        raise ValueError("keys_lut_outliers: out_idx must be ascending")
    if rc != 0:
        raise ValueError(f"keys_lut_outliers: head_dim {d} or bits {bits} not supported")
    return out


def keys_polar(rcodes, acodes, ar, br, tab, length: int, rbits: int, abits: int) -> torch.Tensor:
    """Key logits ``[B, H, M, T]`` of polar codes (PolarQuant, Wu et al., arXiv 2502.00527 §3):
    ``sum_j (cr_tj ar[P, j] + br[P, j]) tab[P, m, j, ca_tj]`` for token ``t`` in page ``P = t //
    length``.  ``rcodes`` / ``acodes``: uint8 ``[B, H, T, *]`` radius and angle codes of the
    ``D/2`` pairs (:func:`kvbench.cache.quant.pack_bits` order); ``ar, br`` float ``[B, H, NP,
    D/2]``; ``tab`` float ``[B, H, NP, M, D/2, 2^abits]`` (the query's table per page).

    Raises ``ValueError`` for shapes that do not fit."""
    bsz, h, t, _ = rcodes.shape
    np_, m, p, k = tab.shape[2:]
    ok = (
        1 <= rbits <= 8
        and 1 <= abits <= 8
        and k == 1 << abits
        and tab.shape[:2] == (bsz, h)
        and acodes.shape[:3] == (bsz, h, t)
        and tuple(ar.shape) == (bsz, h, np_, p)
        and tuple(br.shape) == (bsz, h, np_, p)
        and rcodes.shape[-1] * 8 >= p * rbits
        and acodes.shape[-1] * 8 >= p * abits
        and rcodes.dtype == acodes.dtype == torch.uint8
        and all(c.shape[-1] == 1 or c.stride(-1) == 1 for c in (rcodes, acodes))
        and length >= 1
        and -(-t // length) <= np_
        and p <= MAX_HEAD_DIM // 2
    )
    if not ok:
        raise ValueError(
            f"keys_polar: codes {tuple(rcodes.shape)} / {tuple(acodes.shape)}, table "
            f"{tuple(tab.shape)}, page length {length}, bits {rbits}/{abits} do not fit"
        )
    # the table as [B, H, NP, M, 2^abits, D/2]: one level's entries of 8 pairs are one vector
    keep = [x.float().contiguous() for x in (ar, br, tab.transpose(-1, -2))]
    args = _PolarArgs()
    args.rc, args.ac = rcodes.data_ptr(), acodes.data_ptr()
    args.rs_b, args.rs_h, args.rs_t = _row_strides(rcodes)
    args.as_b, args.as_h, args.as_t = _row_strides(acodes)
    args.B, args.H, args.T, args.M, args.P, args.L, args.NP = bsz, h, t, m, p, length, np_
    args.ar, args.br, args.tab = (x.data_ptr() for x in keep)
    out = torch.empty(bsz, h, m, t, dtype=torch.float32)
    args.out = out.data_ptr()
    args.scalar = int(_KERNEL_CHOICE.get(os.environ.get("KVBENCH_NATIVE_TILES", "1"), 0) == 1)
    lib = _loaded()
    if lib.kv_keys_polar(ctypes.byref(args), rbits, abits) != 0:
        raise ValueError("keys_polar: shapes not supported")
    return out


# ------------------------------------------------------------------ fused decode attention
#: ``KVBENCH_NATIVE_ISA``: the instruction set of :func:`attend_fused` (``auto``: the widest
#: the CPU has; ``base``: the build's own target; ``avx2``; ``avx512``), the C side's ``isa``
FUSED_ISAS = {"auto": 0, "base": 1, "avx2": 2, "avx512": 3}
ENV_ISA = "KVBENCH_NATIVE_ISA"
#: head dims :func:`attend_fused` takes
FUSED_HEAD_DIMS = (32, 64, 128)
#: the kinds of :class:`FusedSide` (the C side's ``FZ_*``) and the code widths of each
FUSED_KINDS = {"float": 0, "block": 1, "token": 2, "channel": 3}
FUSED_KIND_BITS = {"float": (0,), "block": (4, 8), "token": (2, 4), "channel": (2, 4)}
#: scale / zero dtypes of the coded sides (the C side's ``sdt``; ``block``: float16 only)
FUSED_TERM_DTYPES = {torch.float16: 0, torch.float32: 1, torch.bfloat16: 2}


class FusedSide(NamedTuple):
    """One side (keys or values) of a run of ``n`` tokens for :func:`attend_fused`.

    ``kind``:

    * ``"float"``: ``x`` float32 ``[B, H, n, D]`` rows;
    * ``"block"``: ``x`` uint8 ``[B, H, n, D * bits / 8]`` symmetric codes
      (:func:`kvbench.cache.quant.pack_bits` order; ``bits`` 4 or 8; llama.cpp ``q4_0`` /
      ``q8_0``): ``(c - 2^(bits-1)) scale``, ``scale`` float16 ``[B|1, H|1, n, D / cg]``;
    * ``"token"``: affine codes of ``bits`` 2 or 4 (KIVI's per-token values): ``c scale +
      zero``, ``scale`` / ``zero`` ``[B|1, H|1, n, D / cg]`` (groups of ``cg`` channels, a
      multiple of 16);
    * ``"channel"``: affine codes of ``bits`` 2 or 4 (KIVI's per-channel keys): ``c scale +
      zero``, ``scale`` / ``zero`` ``[B|1, H|1, R, D]`` per row of ``tokens`` tokens, token
      ``t`` in row ``(phase + t) // tokens``.

    Scales and zeros float16, float32 or bfloat16; any strides with a contiguous last dim."""

    x: torch.Tensor
    kind: str = "float"
    bits: int = 0
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    tokens: int = 1
    phase: int = 0

    @property
    def ntokens(self) -> int:
        return self.x.shape[2]


class FusedPart(NamedTuple):
    """One run of tokens of a layer's keys and values for :func:`attend_fused` (both sides
    hold the same tokens)."""

    k: FusedSide
    v: FusedSide


def fused_pair(k: FusedSide, v: FusedSide) -> bool:
    """Whether :func:`attend_fused` reads a part of keys ``k`` and values ``v`` (the C side's
    list of (key, value) kinds and widths, ``FZ_PAIRS``); ``False`` when the library is
    unavailable."""
    codes = []
    for side in (k, v):
        if side.kind not in FUSED_KINDS or side.bits not in FUSED_KIND_BITS[side.kind]:
            return False
        codes.append(FUSED_KINDS[side.kind] * 16 + side.bits)
    lib = _load()
    return lib is not None and bool(lib.kv_fused_pair(*codes))


def fused_isa(isa: str | None = None) -> str:
    """The instruction set :func:`attend_fused` runs for ``isa`` (default ``$KVBENCH_NATIVE_ISA``,
    else ``auto``): ``"base"``, ``"avx2"`` or ``"avx512"``.  Raises ``ValueError`` for a name not in
    :data:`FUSED_ISAS` and ``RuntimeError`` when the CPU lacks the one asked for or the native
    library is unavailable."""
    isa = isa or os.environ.get(ENV_ISA, "auto")
    if isa not in FUSED_ISAS:
        raise ValueError(f"{ENV_ISA}={isa!r} is not supported; allowed: {list(FUSED_ISAS)}")
    got = _loaded().kv_fused_isa(FUSED_ISAS[isa])
    if got < 0:
        raise RuntimeError(f"{ENV_ISA}={isa!r}: this CPU does not have it")
    return {v: k for k, v in FUSED_ISAS.items()}[got]


def _strides_bytes(x: torch.Tensor) -> tuple[int, int, int]:
    """Byte strides of ``x``'s batch, head and token dims (0 where a dim has size 1)."""
    es = x.element_size()
    return tuple(x.stride(i) * es if x.shape[i] > 1 else 0 for i in range(3))


def _terms_fit(t: torch.Tensor | None, bsz: int, h: int, rows: int, groups: int) -> bool:
    return (
        t is not None
        and t.dtype in FUSED_TERM_DTYPES
        and t.dim() == 4
        and t.shape[0] in (1, bsz)
        and t.shape[1] in (1, h)
        and t.shape[2] >= rows
        and t.shape[3] == groups
        and (t.stride(-1) == 1 or t.shape[-1] == 1)
    )


def _side_reason(side: FusedSide, bsz: int, h: int, n: int, d: int) -> str | None:
    """Why :func:`attend_fused` does not read ``side`` of ``n`` tokens (``None``: it does)."""
    x, kind = side.x, side.kind
    if kind == "float":
        ok = x.dtype == torch.float32 and tuple(x.shape) == (bsz, h, n, d) and x.stride(-1) == 1
        return None if ok and side.scale is None else "float rows other than float32 [B, H, n, D]"
    if kind not in FUSED_KINDS or side.bits not in FUSED_KIND_BITS[kind]:
        return f"{kind} codes of {side.bits} bits"
    if not (
        x.dtype == torch.uint8
        and tuple(x.shape) == (bsz, h, n, d * side.bits // 8)
        and (x.stride(-1) == 1 or x.shape[-1] == 1)
    ):
        return f"{kind} codes of shape {tuple(x.shape)}"
    if kind == "channel":
        rows = -(-(side.phase + n) // side.tokens) if side.tokens >= 1 and side.phase >= 0 else -1
        ok = rows >= 0 and all(_terms_fit(t, bsz, h, rows, d) for t in (side.scale, side.zero))
        return None if ok and side.scale.dtype == side.zero.dtype else "per-channel terms"
    sc = side.scale
    groups = sc.shape[-1] if sc is not None and sc.dim() == 4 and sc.shape[-1] else 0
    if not (groups and d % groups == 0 and (d // groups) % 16 == 0):
        return f"{kind} scale groups other than whole vectors of 16 channels"
    terms = (sc,) if kind == "block" else (sc, side.zero)
    if not all(_terms_fit(t, bsz, h, n, groups) for t in terms):
        return f"{kind} terms"
    if kind == "block" and sc.dtype != torch.float16:
        return "block scales other than float16"
    if kind == "token" and sc.dtype != side.zero.dtype:
        return "token scale and zero of different dtypes"
    return None


def fused_reason(parts: list[FusedPart], bsz: int, h: int, d: int) -> str | None:
    """Why :func:`attend_fused` does not take ``parts`` (``None``: it does): head_dim not in
    :data:`FUSED_HEAD_DIMS`, more than ``FUSED_MAX_SEGS`` parts, sides that do not fit
    (:class:`FusedSide`), a pair of key and value kinds the kernel does not read
    (:func:`fused_pair`), or the library unavailable."""
    if d not in FUSED_HEAD_DIMS:
        return f"head_dim {d} (fused: {FUSED_HEAD_DIMS})"
    if not 1 <= len(parts) <= FUSED_MAX_SEGS:
        return f"{len(parts)} parts (fused: 1..{FUSED_MAX_SEGS})"
    if not available():
        return unavailable_reason()
    for p in parts:
        n = p.k.ntokens
        if p.v.ntokens != n:
            return "keys and values of a part differ in length"
        for name, side in (("keys", p.k), ("values", p.v)):
            why = _side_reason(side, bsz, h, n, d)
            if why:
                return f"{name}: {why}"
        if not fused_pair(p.k, p.v):
            return f"{p.k.kind}-{p.k.bits} keys with {p.v.kind}-{p.v.bits} values"
    return None


def _set_side(c: _FusedSide, side: FusedSide, d: int) -> None:
    c.kind, c.bits = FUSED_KINDS[side.kind], side.bits
    c.x, c.xs[:] = side.x.data_ptr(), _strides_bytes(side.x)
    if side.kind == "float":
        return
    c.sdt = FUSED_TERM_DTYPES[side.scale.dtype]
    c.s, c.ss[:] = side.scale.data_ptr(), _strides_bytes(side.scale)
    if side.zero is not None:
        c.z, c.zs[:] = side.zero.data_ptr(), _strides_bytes(side.zero)
    if side.kind == "channel":
        c.G, c.phase = side.tokens, side.phase
    else:
        c.cg = d // side.scale.shape[-1]


def attend_fused(
    parts: list[FusedPart],
    q: torch.Tensor,
    nq: int,
    out: torch.Tensor,
    lengths: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """A decode step's attention over ``parts`` (the cache's tokens in order) in one native
    call: ``out[b, h, m] = sum_t softmax_t(q[b, h, m] . k_t) v_t`` over the tokens row ``m``
    sees (``lengths`` int64 ``[B]`` valid tokens per batch row, else all; the ``nq`` queries
    of a row are its last positions, causal among them; row ``m``'s query is ``m % nq``).
    ``q`` float32 ``[B, H, M, D]`` contiguous (the logit scale applied; ``M = (H_q / H) nq``
    rows per KV head), ``out`` float32 ``[B, H, M, D]`` contiguous, written and returned.
    Float32 sums over the exactly dequantized values, an online softmax (the C file).  ``isa``:
    see :func:`fused_isa`.  Raises ``ValueError`` where :func:`fused_reason` is not ``None``
    or ``q``/``out``/``lengths`` do not fit."""
    bsz, h, m, d = q.shape
    why = fused_reason(parts, bsz, h, d)
    if why:
        raise ValueError(f"attend_fused: {why}")
    if not (
        q.dtype == out.dtype == torch.float32
        and q.is_contiguous()
        and out.is_contiguous()
        and tuple(out.shape) == (bsz, h, m, d)
        and nq >= 1
        and m % nq == 0
    ):
        raise ValueError(f"attend_fused: q {tuple(q.shape)} / out {tuple(out.shape)} do not fit")
    args = _FusedArgs()
    args.B, args.H, args.M, args.D, args.nq = bsz, h, m, d, nq
    keep = [q, out]
    for i, p in enumerate(parts):
        seg = args.seg[i]
        seg.n = p.k.ntokens
        _set_side(seg.k, p.k, d)
        _set_side(seg.v, p.v, d)
        keep.append(p)
    args.nseg = len(parts)
    if lengths is not None:
        lengths = lengths.to(torch.int64).contiguous()
        if tuple(lengths.shape) != (bsz,) or bool(
            ((lengths < nq) | (lengths > sum(p.k.ntokens for p in parts))).any()
        ):
            raise ValueError(f"attend_fused: lengths {lengths.tolist()} outside [nq, T]")
        args.lengths = lengths.data_ptr()
        keep.append(lengths)
    args.q, args.out = q.data_ptr(), out.data_ptr()
    isa = isa or os.environ.get(ENV_ISA, "auto")
    if isa not in FUSED_ISAS:
        raise ValueError(f"{ENV_ISA}={isa!r} is not supported; allowed: {list(FUSED_ISAS)}")
    rc = _loaded().kv_attend_fused(ctypes.byref(args), FUSED_ISAS[isa])
    if rc == -2:
        raise RuntimeError(f"attend_fused: this CPU does not have {isa!r}")
    if rc != 0:
        raise ValueError("attend_fused: shapes the kernel does not take")
    return out
