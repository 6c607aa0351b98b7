"""CPU code-domain decode attention: attention computed on the stored codes, never
dequantizing the cache.

This is the *code-domain* backend of :mod:`kvbench.attention.dispatch` (which decides when it runs
and records ``attend_path`` / ``attend_path_reason``): sinks and the full-precision residual as
matmuls, each quantized block through the :class:`~kvbench.attention.block_kernels.BlockKernel`
registered for its type (this module holds :class:`kvbench.cache.blocks.AffineBlock`'s;
:mod:`kvbench.attention.mixed_channel` the mixed-precision channel classes'; all are registered
in :mod:`kvbench.attention.dispatch`).  Paths recorded: :data:`NATIVE_PATH`, :data:`EAGER_PATH`.

Math (one KV head, ``M = (H_q / H_kv) * n_q`` query rows ``q`` already multiplied by the logit
scale; a block stores codes ``c`` with per-group affine terms ``x = c * a + b``, where
``a, b`` = ``(scale, zero)``, ``(scale/2, zero + scale/4)`` for 1-bit midpoint codes and
``(scale, -2^(b-1) scale)`` for symmetric codes):

* keys with per-token terms over channel groups of ``cg`` channels (per-token, int-block,
  llama.cpp ``q4_0`` keys): ``logit[t] = sum_g a_{t,g} (q_g . c_{t,g}) + sum_g b_{t,g} sum(q_g)``;
* keys in pages of ``L`` tokens with per-page, per-channel-group terms (KIVI per-channel keys,
  ``L = G``; per-head keys, one page): ``logit[t] = (q * a_P) . c_t + q . b_P`` for token ``t``
  of page ``P`` -- one ``q * a_P`` per page, then a dot product with the codes;
* values with per-token terms over channel groups of ``cg`` channels (KIVI values):
  ``out[d] = sum_t (p_t a_{t,g(d)}) c_{t,d} + sum_t p_t b_{t,g(d)}``;
* sinks and the full-precision residual as plain matmuls (cast to float32 chunk by chunk along
  T: :func:`dense_logits`, :func:`dense_output`); one float32 softmax over
  sinks + block + residual of the keys, split along the values' own partition (keys and values
  flush on different schedules).

Two implementations of the block terms, equal up to float rounding:

* *native* (:data:`NATIVE_PATH`): the C kernels of :mod:`kvbench.attention.native`, where
  built and where they take the block;
* *eager* (:data:`EAGER_PATH`): ``unpack_bits`` + matmul in chunks of
  :data:`EAGER_CHUNK_TOKENS` tokens (bounded temporaries), for every other block and machines
  without a C compiler.

Mode (environment ``KVBENCH_CPU_ATTENTION`` or :func:`cpu_attention_mode`): ``auto`` (default)
and ``native``: native where a block supports it, else eager; ``eager``; ``reference``.

The core's :class:`kvbench.cache.blocks.AffineBlock` kernel covers per-channel/per-head pages and
per-token groups for keys, per-token groups for values, 1..8 bits, any channel group dividing
``D``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from kvbench.attention import native
from kvbench.attention.backend import AttentionCache, common_reason
from kvbench.attention.block_kernels import block_kernel
from kvbench.attention.reference import length_mask
from kvbench.cache.blocks import AffineBlock
from kvbench.cache.chunks import token_chunks
from kvbench.cache.quant import unpack_bits

ENV_MODE = "KVBENCH_CPU_ATTENTION"
MODES = ("auto", "native", "eager", "reference")
NATIVE_PATH, EAGER_PATH, REFERENCE_PATH = "cpu-native", "cpu-eager", "reference"
#: the backend's name in :data:`kvbench.attention.dispatch.BACKENDS`
NAME = "code-domain"
#: tokens per chunk of the eager path (bounds its temporary unpacked codes)
EAGER_CHUNK_TOKENS = 1024
#: bytes of the float32 scratch a full-precision part (residual, sinks, ``full``'s whole cache)
#: is cast into, chunk by chunk along T, by :func:`dense_logits` and :func:`dense_output`
DENSE_CHUNK_BYTES = 8 << 20

_mode_override: str | None = None


class _StepState:
    """What the running :func:`_registry_run` allows (``native``) and which implementation
    each quantized block used (``used``, for the recorded path)."""

    native = False
    used: list[str] = []


_state = _StepState()


KERNEL_KINDS = ("native", "eager")


def path_kinds(path: str) -> set[str]:
    """The kernel kinds a recorded code-domain path names: ``"cpu-native+eager"`` ->
    ``{"native", "eager"}``; ``ValueError`` for a path that is not a ``cpu-`` path of
    :data:`KERNEL_KINDS`."""
    kinds = set(path.removeprefix("cpu-").split("+")) if path.startswith("cpu-") else set()
    if not kinds or not kinds <= set(KERNEL_KINDS):
        raise ValueError(f"{path!r} is not a CPU code-domain path (cpu-<kinds of {KERNEL_KINDS}>)")
    return kinds


def native_allowed() -> bool:
    """Whether a block kernel may use :mod:`kvbench.attention.native` in the running step."""
    return _state.native


def note_impl(impl: str) -> None:
    """A block kernel reports the implementation it ran (``"native"``): the recorded path
    names it (``cpu-native``; ``cpu-native+eager`` when another block did not report)."""
    _state.used.append(impl)


def cpu_mode() -> str:
    """The active CPU mode (override, else ``$KVBENCH_CPU_ATTENTION``, else ``auto``).

    Raises ``ValueError`` for a value not in :data:`MODES`."""
    mode = _mode_override or os.environ.get(ENV_MODE, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r} is not supported; allowed: {list(MODES)}")
    return mode


@contextlib.contextmanager
def cpu_attention_mode(mode: str) -> Iterator[None]:
    """Use CPU ``mode`` (one of :data:`MODES`) inside the ``with`` block; ``ValueError``
    otherwise."""
    global _mode_override
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; allowed: {list(MODES)}")
    old, _mode_override = _mode_override, mode
    try:
        yield
    finally:
        _mode_override = old


# ------------------------------------------------------------------------------ code layout
def code_layout(bits: int) -> tuple[int, int]:
    """``(bytes_per_word, codes_per_word)`` of :func:`kvbench.cache.quant.pack_bits`'s LSB-first
    stream: the smallest run of whole bytes holding whole codes (2 bits: 1 byte, 4 codes;
    3 bits: 3 bytes, 8 codes)."""
    g = math.gcd(bits, 8)
    return bits // g, 8 // g


def affine_terms(block: AffineBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(a, b)`` ``[B|1, H|1, NG, Dg]`` with ``x = code * a + b`` for ``block``
    (exactly :func:`kvbench.cache.quant.dequantize_groups`'s three cases)."""
    s = block.scale.float()
    if block.symmetric:
        return s, s * -float(1 << (block.bits - 1))
    z = block.zero.float()
    if block.midpoint:
        return s * 0.5, z + s * 0.25
    return s, z


def _per_channel(t: torch.Tensor, d: int) -> torch.Tensor:
    """``[..., Dg]`` group terms -> ``[..., D]`` (each repeated over its ``D / Dg`` channels)."""
    return t if t.shape[-1] == d else t.repeat_interleave(d // t.shape[-1], dim=-1)


# ------------------------------------------------------------------------------ kernels
def key_pages_eager(
    packed: torch.Tensor, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int
) -> torch.Tensor:
    """Key logits ``[B, H, M, NP * L]`` of whole pages: ``q . (c * a + b)`` for every token,
    by ``unpack_bits`` + matmul in chunks of about :data:`EAGER_CHUNK_TOKENS` tokens (any
    ``D``).  ``packed`` uint8 ``[B, H, NP, L, nbytes]``, the codes of ``NP`` pages of ``L``
    tokens; ``q`` float32 ``[B, H, M, D]``; ``a, b`` float32 ``[B|1, H|1, NP, D]`` per channel."""
    bsz, h, npg, length, _ = packed.shape
    d = q.shape[-1]
    step = max(1, EAGER_CHUNK_TOKENS // length)
    outs = []
    for p0 in range(0, npg, step):
        pk = packed[:, :, p0 : p0 + step]
        c = unpack_bits(pk, bits, d).float()  # [B, H, np, L, D]
        ap, bp = a[:, :, p0 : p0 + step], b[:, :, p0 : p0 + step]
        qs = q.unsqueeze(2) * ap.unsqueeze(3)  # [B, H, np, M, D]
        lg = torch.matmul(qs, c.transpose(-1, -2))  # [B, H, np, M, L]
        lg = lg + (q.unsqueeze(2) * bp.unsqueeze(3)).sum(-1, keepdim=True)
        outs.append(lg.permute(0, 1, 3, 2, 4).reshape(bsz, h, q.shape[2], -1))
    return torch.cat(outs, -1) if len(outs) > 1 else outs[0]


def value_tokens_eager(
    packed: torch.Tensor, p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int, d: int
) -> torch.Tensor:
    """``sum_t p_t (c_t * a_t + b_t)`` ``[B, H, M, D]`` over per-token quantized values
    (``packed`` uint8 ``[B, H, n, nbytes]``, ``p`` float32 ``[B, H, M, n]``, ``a, b`` float32
    ``[B|1, H|1, n, Dg]``) by ``unpack_bits`` + matmul in chunks (any ``D``, given as ``d``)."""
    bsz, h, n, _ = packed.shape
    m, dg = p.shape[2], a.shape[-1]
    cg = d // dg
    out = torch.zeros(bsz, h, m, dg, cg, device=p.device)
    for t0 in range(0, n, EAGER_CHUNK_TOKENS):
        sl = slice(t0, t0 + EAGER_CHUNK_TOKENS)
        c = unpack_bits(packed[:, :, sl], bits, d).float()
        c = c.reshape(bsz, h, -1, dg, cg).transpose(2, 3)  # [B, H, Dg, n, cg]
        ps = (p[..., sl].unsqueeze(-1) * a[:, :, sl].unsqueeze(2)).permute(0, 1, 4, 2, 3)
        out += torch.matmul(ps, c).transpose(2, 3)  # [B, H, M, Dg, cg]
    pb = (p.unsqueeze(-1) * b.unsqueeze(2)).sum(3)  # [B, H, M, Dg]
    return (out + pb.unsqueeze(-1)).reshape(bsz, h, m, d)


def key_tokens(
    packed: torch.Tensor,
    q: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    """Logits ``[B, H, M, n]`` of per-token quantized keys (codes ``packed [B, H, n, nbytes]``,
    terms ``a, b`` float32 ``[B|1, H|1, n, Dg]``) for query rows ``q [B, H, M, D]``."""
    bsz, h, m, d = q.shape
    dg = a.shape[-1]
    cg = d // dg
    qsum = q.reshape(bsz, h, m, dg, cg).sum(-1)  # [B, H, M, Dg]
    bias = torch.matmul(qsum, b.transpose(-1, -2))  # [B, H, M, n]
    n = packed.shape[2]
    qg = q.reshape(bsz, h, m, dg, cg).transpose(2, 3)  # [B, H, Dg, M, cg]
    outs = []
    for t0 in range(0, n, EAGER_CHUNK_TOKENS):
        sl = slice(t0, t0 + EAGER_CHUNK_TOKENS)
        c = unpack_bits(packed[:, :, sl], bits, d).float()
        c = c.reshape(bsz, h, -1, dg, cg).permute(0, 1, 3, 4, 2)  # [B, H, Dg, cg, n]
        part = torch.matmul(qg, c)  # [B, H, Dg, M, n]
        outs.append((part * a[:, :, sl].permute(0, 1, 3, 2).unsqueeze(3)).sum(2))
    out = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
    return out + bias


def _group_slices(group_len: list[int]) -> list[tuple[int, slice]]:
    """``(group index, token slice)`` of each group, split into runs of at most
    :data:`EAGER_CHUNK_TOKENS` tokens."""
    out, t0 = [], 0
    for gi, n in enumerate(group_len):
        for c0 in range(0, n, EAGER_CHUNK_TOKENS):
            out.append((gi, slice(t0 + c0, t0 + min(n, c0 + EAGER_CHUNK_TOKENS))))
        t0 += n
    return out


def key_groups_eager(packed, q, a, b, group_len, bits) -> torch.Tensor:
    """Logits ``[B, H, M, n]`` of keys in token groups of any lengths (per-head / per-tensor
    flushes): ``(q * a_g) . c_t + q . b_g`` per group, by unpack + matmul; ``a, b`` float32
    ``[B|1, H|1, NG, D]`` per channel."""
    d = q.shape[-1]
    outs = []
    for gi, sl in _group_slices(group_len):
        c = unpack_bits(packed[:, :, sl], bits, d).float()  # [B, H, n_g, D]
        qa = q * a[:, :, gi : gi + 1]
        qb = (q * b[:, :, gi : gi + 1]).sum(-1, keepdim=True)
        outs.append(torch.matmul(qa, c.transpose(-1, -2)) + qb)
    return torch.cat(outs, -1) if len(outs) > 1 else outs[0]


def value_groups_eager(packed, p, a, b, group_len, bits, d) -> torch.Tensor:
    """``sum_t p_t (c_t * a_g + b_g)`` ``[B, H, M, D]`` over values in token groups of any
    lengths; ``a, b`` float32 ``[B|1, H|1, NG, D]`` per channel."""
    out = 0
    for gi, sl in _group_slices(group_len):
        c = unpack_bits(packed[:, :, sl], bits, d).float()
        pg = p[..., sl]
        out = out + torch.matmul(pg, c) * a[:, :, gi : gi + 1]
        out = out + pg.sum(-1, keepdim=True) * b[:, :, gi : gi + 1]
    return out


# ------------------------------------------------------------------------------ affine blocks
class AffineBlockAttention:
    """:class:`~kvbench.attention.block_kernels.BlockKernel` of :class:`kvbench.cache.blocks.AffineBlock` (see module docstring).

    Keys and values: per-token groups (per-token, int8/int4-block and llama.cpp ``q4_0``),
    pages of ``L >= 2`` tokens (all equal but a shorter last one, e.g. after ``crop``; keys), or
    token groups of any lengths (per-head / per-tensor flushes; eager).  Bits 1..8, and 16
    (int16 codes, e.g. PM-KVQ before its first shrink; native, else eager)."""

    @staticmethod
    def _common(block: AffineBlock, head_dim: int) -> str | None:
        if block.bits not in (*range(1, 9), 16):
            return f"{block.bits}-bit codes"
        if head_dim % block.scale.shape[-1]:
            return "channel groups do not divide head_dim"
        return None

    def key_reason(self, block: AffineBlock, head_dim: int) -> str | None:
        return self._common(block, head_dim)

    value_reason = key_reason

    @staticmethod
    def _pages(block: AffineBlock) -> bool:
        lens = block.group_len
        return (
            bool(lens)
            and lens[0] >= 2
            and all(x == lens[0] for x in lens[:-1])
            and (lens[-1] <= lens[0])
        )

    @staticmethod
    def _native_codes(block: AffineBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes as uint8 rows, a, b)`` for the native kernels: 16-bit codes are int16
        ``c - 32768`` (:func:`kvbench.cache.quant.pack_bits`), read signed, so ``b`` takes the
        offset (``c a + b = (c - 32768) a + (b + 32768 a)``, terms in float32)."""
        a, b = affine_terms(block)
        if block.bits != 16:
            return block.codes, a, b
        return block.codes.view(torch.uint8), a, b + 32768.0 * a

    def _native_keys(self, block: AffineBlock, q: torch.Tensor) -> torch.Tensor | None:
        d, bits = q.shape[-1], block.bits
        if not native_allowed():
            return None
        codes, a, b = self._native_codes(block)
        if not native.supports(codes, bits, d):
            return None
        if len(block.group_len) == block.ntokens:
            if (d // a.shape[-1]) % code_layout(bits)[1]:
                return None
            return native.keys_groups(codes, q, a, b, bits)
        if not self._pages(block):
            return None
        a, b = _per_channel(a, d), _per_channel(b, d)
        return native.keys_rows(codes, q, a, b, block.group_len[0], bits)

    def key_logits(self, block: AffineBlock, q: torch.Tensor) -> torch.Tensor:
        out = self._native_keys(block, q)
        if out is not None:
            note_impl("native")
            return out
        if len(block.group_len) == block.ntokens:
            a, b = affine_terms(block)
            return key_tokens(block.codes, q, a, b, block.bits)
        if not self._pages(block):  # flushes of different lengths (per-head, per-tensor)
            a, b = affine_terms(block)
            d = q.shape[-1]
            a, b = _per_channel(a, d), _per_channel(b, d)
            return key_groups_eager(block.codes, q, a, b, block.group_len, block.bits)
        d, bits, length = q.shape[-1], block.bits, block.group_len[0]
        a, b = affine_terms(block)
        a, b = _per_channel(a, d), _per_channel(b, d)
        bsz, h, n, nbytes = block.codes.shape
        full = n // length  # whole pages; a shorter last page (after crop) is a tail
        parts = []
        if full:
            pk = block.codes[:, :, : full * length].reshape(bsz, h, full, length, nbytes)
            parts.append(key_pages_eager(pk, q, a[:, :, :full], b[:, :, :full], bits))
        if n > full * length:
            pk = block.codes[:, :, full * length :].unsqueeze(2)
            at, bt = a[:, :, full : full + 1], b[:, :, full : full + 1]
            parts.append(key_pages_eager(pk, q, at, bt, bits))
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]

    def value_output(self, block: AffineBlock, p: torch.Tensor) -> torch.Tensor:
        d, bits = block.head_dim, block.bits
        a, b = affine_terms(block)
        pk = block.codes
        if len(block.group_len) != block.ntokens:  # token groups (per-head, per-tensor values)
            a, b = _per_channel(a, d), _per_channel(b, d)
            return value_groups_eager(pk, p, a, b, block.group_len, bits, d)
        if native_allowed():
            nk, na, nb = self._native_codes(block)
            if native.supports(nk, bits, d) and (d // na.shape[-1]) % code_layout(bits)[1] == 0:
                note_impl("native")
                return native.values_groups(nk, p, na, nb, bits, d)
        return value_tokens_eager(pk, p, a, b, bits, d)


# ------------------------------------------------------------------------------ attention
def code_domain_reason(
    layer_cache: Any,
    query: torch.Tensor,
    lengths: Any = None,
    check_mode: bool = True,
    common: bool = True,
) -> str | None:
    """Why ``layer_cache`` cannot take the CPU code-domain path for ``query`` (``None``: it
    can): the mode, a non-CPU query, shapes that do not fit, or a block without a CPU kernel.
    ``common=False``: the caller (the registry's :func:`~kvbench.attention.dispatch.resolve`)
    already ran :func:`~kvbench.attention.dispatch.common_reason`."""
    if check_mode and cpu_mode() == "reference":
        return f"{ENV_MODE}=reference"
    dev = getattr(getattr(query, "device", None), "type", "cpu")
    why = common_reason(layer_cache, query, lengths) if common else None
    if why:
        return why
    d = layer_cache.kv_shape[2]
    for name, side in (("key", layer_cache.k), ("value", layer_cache.v)):
        if side.block is not None:
            impl = block_kernel(side.block, dev)
            if impl is None:
                where = "" if dev == "cpu" else f" on {dev}"
                return f"{name} block {type(side.block).__name__} has no code-domain kernel{where}"
            why = (impl.key_reason if name == "key" else impl.value_reason)(side.block, d)
            if why:
                return why
    return None


def code_domain_attend(
    layer_cache: Any,
    query: torch.Tensor,
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, H_q, n_q, D]`` over ``layer_cache`` (a
    :class:`kvbench.cache.layer.LayerCache`) in the code domain; ``[B, H_q, n_q, D]`` in the query's
    dtype.  Same contract as :func:`kvbench.attention.reference.reference_attention` over
    ``keys_values()`` (GQA: query head ``h`` reads KV head ``h // (H_q / H_kv)``; causal mask
    aligned to the end when ``n_q > 1``; ``lengths``: per-row valid tokens; float32 logits and
    softmax).

    Raises
    ------
    ValueError
        The layout is not supported (the reason; see :func:`code_domain_reason`).
    """
    why = code_domain_reason(layer_cache, query, lengths, check_mode=False)
    if why:
        raise ValueError(why)
    return _attend(layer_cache, query, scaling, lengths)


def _float_pieces(part: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(t0, t1, part[:, :, t0:t1] as float32)`` covering a full-precision part
    ``[B, H, T, D]`` along T: one piece where the part is float32 already, fits one chunk or is
    not on the CPU, else chunks of :func:`~kvbench.cache.chunks.token_chunks` of about
    :data:`DENSE_CHUNK_BYTES` of float32 each, cast into one reused scratch (each piece is
    valid until the next is drawn)."""
    bsz, h, t, d = part.shape
    spans = list(token_chunks(bsz, h, t, d, elements=DENSE_CHUNK_BYTES // 4))
    if part.dtype == torch.float32 or len(spans) <= 1 or part.device.type != "cpu":
        yield 0, t, part.float()
        return
    buf = part.new_empty(bsz, h, spans[0][1], d, dtype=torch.float32)
    for t0, t1 in spans:
        chunk = buf[:, :, : t1 - t0]
        chunk.copy_(part[:, :, t0:t1])
        yield t0, t1, chunk


def dense_logits(q: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``q @ part^T`` in float32 for ``q [B, H_kv, M, D]`` float32 and a full-precision part
    ``part [B, H_kv, T, D]`` (any float dtype): ``[B, H_kv, M, T]`` float32.

    A part longer than one chunk is cast into one reused float32 scratch of
    :data:`DENSE_CHUNK_BYTES`, chunk by chunk along T (:func:`_float_pieces`), instead of a
    float32 copy of the whole part (at batch 8 x 32K x 8 heads x 128 that copy is 1 GiB of
    fresh pages per step; measured on 2 cores: ~5x faster, peak working memory one chunk; on
    the CPU only, where the cast's fresh pages cost more than the arithmetic).  Each logit is
    the same length-D dot product either way (equal bit for bit on the machines measured; the
    tests compare with the one-matmul form to float32 rounding)."""
    t, out = part.shape[2], None
    for t0, t1, x in _float_pieces(part):
        lg = torch.matmul(q, x.transpose(-1, -2))
        if t1 - t0 == t:
            return lg
        if out is None:
            out = q.new_empty(*q.shape[:-1], t)
        out[..., t0:t1] = lg
    return out


def dense_output(p: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``p @ part`` in float32 for probabilities ``p [B, H_kv, M, T]`` float32 and a
    full-precision part ``part [B, H_kv, T, D]``: ``[B, H_kv, M, D]`` float32, chunked along T
    as :func:`dense_logits` (the sum over T then adds chunk partial sums in order: equal to
    the one-matmul form up to float32 rounding)."""
    out = None
    for t0, t1, x in _float_pieces(part):
        o = torch.matmul(p[..., t0:t1], x)
        out = o if out is None else out.add_(o)
    return out


def _attend(
    layer_cache: Any,
    query: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
):
    """:func:`code_domain_attend` without its layout checks."""
    bsz, hq, nq, d = query.shape
    hkv = layer_cache.kv_shape[1]
    dev = query.device.type
    m = hq // hkv * nq
    scale = 1.0 / math.sqrt(d) if scaling is None else scaling
    q = (query.float() * scale).reshape(bsz, hkv, m, d)  # rows: (query head in group, n_q)
    ks, vs = layer_cache.k, layer_cache.v
    logits = []
    for part in (ks.sinks, ks.block, ks.residual):
        if isinstance(part, torch.Tensor):
            logits.append(dense_logits(q, part))
        elif part is not None:
            logits.append(block_kernel(part, dev).key_logits(part, q))
    lg = torch.cat(logits, -1) if len(logits) > 1 else logits[0]  # [B, H_kv, M, T]
    t = lg.shape[-1]
    if nq > 1 or lengths is not None:
        mask = length_mask(lengths, nq, t, query.device)  # [B|1, n_q, T]
        lg = lg.reshape(bsz, hkv, hq // hkv, nq, t).masked_fill(~mask[:, None, None], float("-inf"))
        lg = lg.reshape(bsz, hkv, m, t)
    probs = torch.softmax(lg, dim=-1)
    if getattr(layer_cache, "observes_attention", False):
        layer_cache.observe_attention(probs.reshape(bsz, hq, nq, t), lengths)
    out, off = None, 0
    for part in (vs.sinks, vs.block, vs.residual):
        if part is None:
            continue
        n = part.shape[2] if isinstance(part, torch.Tensor) else part.ntokens
        p = probs[..., off : off + n]
        off += n
        if isinstance(part, torch.Tensor):
            o = dense_output(p, part)
        else:
            o = block_kernel(part, dev).value_output(part, p.contiguous())
        out = o if out is None else out + o
    return out.reshape(bsz, hq, nq, d).to(query.dtype)


def _registry_run(layer_cache: Any, query: torch.Tensor, scaling: float | None, lengths: Any):
    """The registry's code-domain backend: ``(out, path)``; the mode picks the kernels.

    ``auto`` and ``native``: the native kernels (:mod:`kvbench.attention.native`) wherever a
    block supports them, else eager; ``eager``: eager.  The path names what ran:
    ``cpu-native``, ``cpu-eager``, or ``cpu-native+eager`` when blocks differed."""
    mode = cpu_mode()
    _state.native = query.device.type == "cpu" and mode in ("auto", "native") and native.available()
    _state.used = []
    try:
        out = _attend(layer_cache, query, scaling, lengths)
    finally:
        used, _state.used = _state.used, []
        _state.native = False
    dev = query.device.type
    if dev != "cpu":  # a block kernel registered for another device (QJL's on CUDA): eager
        return out, f"{dev}-eager"
    blocks = sum(side.block is not None for side in (layer_cache.k, layer_cache.v))
    if len(used) < blocks:  # a kernel that did not report ran its eager code
        used.append("eager")
    kinds = sorted(set(used) or {"eager"}, key=KERNEL_KINDS.index)
    return out, "cpu-" + "+".join(kinds)


def eager_attend(
    layer_cache: AttentionCache,
    query: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The eager code-domain attention without layout checks: the reference of blocks that
    have no dequantized form (QJL's sketches; :func:`kvbench.attention.dispatch.reference_attend`)."""
    return _attend(layer_cache, query, scaling, lengths)


class CodeDomainBackend:
    """The code-domain :class:`~kvbench.attention.backend.Backend` (any device whose blocks
    have kernels): :func:`code_domain_reason` and :func:`_registry_run`."""

    name = NAME
    device = "*"

    def reason(
        self, cache: AttentionCache, query: torch.Tensor, lengths: torch.Tensor | None
    ) -> str | None:
        return code_domain_reason(cache, query, lengths, common=False)

    def run(
        self,
        cache: AttentionCache,
        query: torch.Tensor,
        scaling: float | None,
        lengths: torch.Tensor | None,
    ) -> tuple[torch.Tensor, str]:
        return _registry_run(cache, query, scaling, lengths)


BACKEND = CodeDomainBackend()
