"""Native (C) one-pass min-max quantizer for large CPU inputs: codes packed straight from the
input dtype, the same bytes, scales and zeros as the torch reference.

The torch path (:func:`kvbench.cache.quant.quantize_groups`, then
:func:`~kvbench.cache.quant.pack_bits`) makes several eager passes over float32 and int32 copies
of its input, which dominate a long prefill; ``kvbench/cache/csrc/affine.c`` reads the
float16/bfloat16/float32 input twice instead, once for every group's min and max and once for
the codes, written packed.  The stored terms in between come from the reference's own helpers
(:func:`~kvbench.cache.quant.affine_terms`, :func:`~kvbench.cache.quant.symmetric_terms`), so
scales, zeros and their overflow errors are the reference's; the codes use its float32 formulas,
IEEE division and round-half-to-even (tested equal, bit for bit, on random and adversarial
inputs: ties at .5, constant groups, float16 extremes and subnormals).

Groups are rectangles of ``token_group`` consecutive tokens x ``channel_group`` consecutive
channels of one (batch row, KV head): KIVI's per-channel groups (G x 1), per-token groups
(1 x channel group), per-head groups (the flush x D), optionally one set shared by all rows
(per-tensor), and the per-channel classes of a mixed-precision codec (one code per byte, packed
by :func:`kvbench.cache.mixed_channel.pack_mixed`; PN-Mix's 1-bit midpoint codes included).  Not served
(:func:`quantize_pack` returns ``None`` and the caller uses the torch path): a non-finite
element anywhere in the input (the reference's NaN/Inf policy, :mod:`kvbench.cache.finite`,
applies), 16-bit codes, non-CPU tensors,
float64, channels that are not contiguous, ``KVBENCH_NATIVE=0``, the library not built.

:func:`q4_0` is llama.cpp's ``q4_0`` rule (``int4-block``'s default codec,
:class:`kvbench.methods.int_block.LlamaCppQ4Codec`) in one C pass: its torch path is a score
of small operations, most of a decode step's one-token flush; the same codes and scales, bit
for bit (tested), under the same conditions (plus: finite input and no subnormal scale).

Build and loading (docs/design.md#two-attention-paths): ``setup.py`` compiles :data:`SOURCE`
with :data:`FLAGS` into :data:`LIBRARY`; :mod:`kvbench.clib` loads it and checks its ABI and
source digest.  Rows (batch row, KV head) are split across ``torch.get_num_threads()`` Python
threads (ctypes releases the GIL during the call).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvbench.cache.quant import affine_terms, packed_size, symmetric_terms
from kvbench.clib import NativeLibrary, load_checked

SOURCE = Path(__file__).with_name("csrc") / "affine.c"
#: the shared object setup.py builds from SOURCE with FLAGS
LIBRARY = Path(__file__).with_name("_affine.so")
FLAGS = (
    "-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared",
    "-std=gnu11",
)  # fmt: skip
ABI_VERSION = 4
DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
#: inputs with fewer elements per thread than this run on one thread
MIN_PER_THREAD = 1 << 20


class _In(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        *((f, ctypes.c_int64) for f in ("B", "H", "T", "D", "sb", "sh", "st", "Lt", "Lc")),
        ("r0", ctypes.c_int64),
        ("r1", ctypes.c_int64),
    ]


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` (a build of :data:`SOURCE`; :data:`LIBRARY` unless a test built
    a variant) with its functions' argument types set.  Raises ``FileNotFoundError`` when it
    was not built, ``RuntimeError`` when stale or of another ABI
    (:func:`kvbench.clib.load_checked`)."""
    lib = load_checked(path, SOURCE, "kq_abi_version", ABI_VERSION)
    lib.kq_minmax.argtypes = [ctypes.POINTER(_In), ctypes.c_void_p, ctypes.c_void_p]
    lib.kq_minmax.restype = ctypes.c_int
    lib.kq_codes.argtypes = [
        ctypes.POINTER(_In),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
    ]
    lib.kq_codes.restype = ctypes.c_int
    lib.kq_affine_terms.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.kq_affine_terms.restype = ctypes.c_int
    lib.kq_symmetric_terms.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.kq_symmetric_terms.restype = ctypes.c_int
    lib.kq_q4_0.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p,
    ]  # fmt: skip
    lib.kq_q4_0.restype = ctypes.c_int
    return lib


_NATIVE = NativeLibrary(lambda: load(LIBRARY), "native quantizer")


def _load() -> ctypes.CDLL | None:
    return _NATIVE.load()


available = _NATIVE.available  # whether built and loaded (loads on the first call)
unavailable_reason = _NATIVE.unavailable_reason  # None when available, else why not


def _split(rows: int, per_row: int) -> list[tuple[int, int]]:
    n = max(1, min(torch.get_num_threads(), rows, rows * per_row // MIN_PER_THREAD))
    edges = [rows * i // n for i in range(n + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _run(fn: Callable[..., int], base: _In, parts: list[tuple[int, int]], *args: int) -> list[int]:
    """``fn(&rows, *args)`` (a C function of the library) over each row range of ``parts``,
    one thread per range; their return codes."""

    def one(part: tuple[int, int]) -> int:
        a = _In.from_buffer_copy(base)
        a.r0, a.r1 = part
        return fn(ctypes.byref(a), *args)

    if len(parts) == 1:
        return [one(parts[0])]
    with ThreadPoolExecutor(len(parts)) as pool:
        return list(pool.map(one, parts))


#: up to this many groups, the terms come from C (``kq_affine_terms``, ``kq_symmetric_terms``:
#: the torch helper's dozen small operations cost more than a decode step's one-token flush)
SMALL_TERMS = 4096
_TERM_DTYPES = {torch.float16: (0, torch.int16), torch.float32: (2, torch.float32)}


def _c_affine_terms(lib, mn: torch.Tensor, mx: torch.Tensor, bits: int, scale_dtype):
    """:func:`kvbench.cache.quant.affine_terms` of float32 ``mn``/``mx`` in C, bit for bit (tested):
    ``(scale, zero, scale_f32, zero_f32)``, or ``None`` where it does not serve (another scale
    dtype, no float16 in the compiler, an overflow: the torch helper then raises its error)."""
    if scale_dtype not in _TERM_DTYPES:
        return None
    sdt, store = _TERM_DTYPES[scale_dtype]
    mn, mx = mn.contiguous(), mx.contiguous()
    sc, ze = torch.empty(mn.shape, dtype=store), torch.empty(mn.shape, dtype=store)
    s, z = torch.empty(mn.shape), torch.empty(mn.shape)
    ptrs = (t.data_ptr() for t in (sc, ze, s, z))
    if lib.kq_affine_terms(mn.data_ptr(), mx.data_ptr(), mn.numel(), bits, sdt, *ptrs) != 0:
        return None
    return sc.view(scale_dtype), ze.view(scale_dtype), s, z


def _c_symmetric_terms(lib, mn: torch.Tensor, mx: torch.Tensor, bits: int, scale_dtype):
    """:func:`kvbench.cache.quant.symmetric_terms` of float32 ``mn``/``mx`` in C, bit for bit
    (tested): ``(scale, scale_f32)``, or ``None`` where it does not serve (another scale dtype,
    no float16 in the compiler, an overflow: the torch helper then raises its error)."""
    if scale_dtype not in _TERM_DTYPES:
        return None
    sdt, store = _TERM_DTYPES[scale_dtype]
    mn, mx = mn.contiguous(), mx.contiguous()
    sc, s = torch.empty(mn.shape, dtype=store), torch.empty(mn.shape)
    if lib.kq_symmetric_terms(mn.data_ptr(), mx.data_ptr(), mn.numel(), bits, sdt,
                              sc.data_ptr(), s.data_ptr()) != 0:  # fmt: skip
        return None
    return sc.view(scale_dtype), s


def quantize_pack(
    x: torch.Tensor,
    bits: int,
    token_group: int,
    channel_group: int,
    *,
    symmetric: bool = False,
    midpoint: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    shared: bool = False,
    packed: bool = True,
    lib: ctypes.CDLL | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Min-max quantize ``x [B, H_kv, T, D]`` in groups of ``token_group`` tokens x
    ``channel_group`` channels and pack the codes per token, or ``None`` where not served
    (see the module docstring; the caller then runs the torch path).

    Returns ``(codes, scale, zero)``: ``codes`` uint8 ``[B, H_kv, T, ceil(D * bits / 8)]``
    (:func:`~kvbench.cache.quant.pack_bits` order; ``packed=False``: ``[B, H_kv, T, D]``, one
    code per byte), ``scale``/``zero`` ``[B, H_kv, T / token_group,
    D / channel_group]`` in ``scale_dtype`` (``[1, 1, ...]`` when ``shared``: one set of groups
    over all rows, KV heads too), ``zero`` ``None`` when ``symmetric``: equal to
    ``quantize_groups`` on the same groups (``midpoint``: its 1-bit midpoint codes, PN-Mix
    Eq. 7).  ``lib``: a loaded build (default: the installed one, :data:`LIBRARY`).  Raises
    ``ValueError`` when a scale or zero overflows ``scale_dtype`` (as the reference does) or the
    group sizes do not divide ``T`` and ``D``."""
    if (
        x.device.type != "cpu"
        or x.dtype not in DTYPES
        or x.dim() != 4
        or not 1 <= bits <= 8
        or (symmetric and bits < 2)
        or (midpoint and (bits != 1 or symmetric))
        or x.numel() == 0
        or (x.stride(3) != 1 and x.shape[3] > 1)
    ):
        return None
    lib = lib or _load()
    if lib is None:
        return None
    b, h, t, d = x.shape
    if t % token_group or d % channel_group:
        raise ValueError(
            f"groups of {token_group} tokens x {channel_group} channels do not tile "
            f"[T, D] = [{t}, {d}]"
        )
    nt, nc = t // token_group, d // channel_group
    base = _In(x.data_ptr(), DTYPES[x.dtype], b, h, t, d, *x.stride()[:3], token_group,
               channel_group, 0, b * h)  # fmt: skip
    parts = _split(b * h, t * d)
    mn = torch.empty(b, h, nt, nc, dtype=torch.float32)
    mx = torch.empty(b, h, nt, nc, dtype=torch.float32)
    rc = _run(lib.kq_minmax, base, parts, mn.data_ptr(), mx.data_ptr())
    if any(r < 0 for r in rc):
        raise MemoryError("native quantizer: out of memory for a row buffer")
    if any(rc):  # a non-finite element: the reference's policy applies
        return None
    if shared:
        mn, mx = mn.amin(dim=(0, 1), keepdim=True), mx.amax(dim=(0, 1), keepdim=True)
    if symmetric:
        got = (
            _c_symmetric_terms(lib, mn, mx, bits, scale_dtype)
            if mn.numel() <= SMALL_TERMS
            else None
        )
        scale_st, s = got or symmetric_terms(mn, mx, bits, scale_dtype)
        zero_st, z = None, s  # z unused by the kernel when symmetric
    else:
        got = _c_affine_terms(lib, mn, mx, bits, scale_dtype) if mn.numel() <= SMALL_TERMS else None
        scale_st, zero_st, s, z = got or affine_terms(mn, mx, bits, scale_dtype)
    s, z = s.contiguous(), z.contiguous()
    nbytes = packed_size(d, bits) if packed else d
    codes = torch.empty(b, h, t, nbytes, dtype=torch.uint8)
    ssb, ssh = (0, 0) if shared else (h * nt * nc, nt * nc)
    rc = _run(lib.kq_codes, base, parts, s.data_ptr(), z.data_ptr(), ssb, ssh, bits,
              int(symmetric), int(midpoint), int(packed), codes.data_ptr(), nbytes)  # fmt: skip
    if any(rc):
        raise MemoryError("native quantizer: out of memory for a row buffer")
    return codes, scale_st, zero_st


def q4_0(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """llama.cpp's ``q4_0`` codes and scales of ``x [B, H_kv, n, D]`` (float16/bfloat16/float32,
    CPU) in blocks of ``block_size`` channels (dividing D, even), as the torch path of
    :class:`kvbench.methods.int_block.LlamaCppQ4Codec` computes them: packed uint8 codes
    ``[B, H_kv, n, D / 2]`` and signed float16 scales ``[B, H_kv, n, D / block_size]``, or
    ``None`` where not served (the caller runs the torch path, which also raises its errors):
    a non-finite element, a subnormal or float16-overflowing scale, another device or dtype, an
    odd ``block_size``, no float16 in the compiler, ``KVBENCH_NATIVE=0``, the library not built
    (``kq_q4_0`` in ``csrc/affine.c``)."""
    b, h, n, d = x.shape
    if (
        x.device.type != "cpu"
        or x.dtype not in DTYPES
        or x.numel() == 0
        or block_size % 2
        or d % block_size
    ):
        return None
    lib = _load()
    if lib is None:
        return None
    xf = x.float().contiguous()
    codes = torch.empty(b, h, n, d // 2, dtype=torch.uint8)
    scale = torch.empty(b, h, n, d // block_size, dtype=torch.float16)
    rc = lib.kq_q4_0(xf.data_ptr(), b * h * n, d, block_size, codes.data_ptr(), scale.data_ptr())
    return (codes, scale) if rc == 0 else None
