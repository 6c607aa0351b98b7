"""The code-domain arithmetic of affine codes, shared by every CPU block kernel, and the
kernel of :class:`kvbench.cache.blocks.AffineBlock`.

Math (one KV head, ``M = (H_q / H_kv) * n_q`` query rows ``q`` already multiplied by the logit
scale; a block stores codes ``c`` with per-group affine terms ``x = c * a + b``, where
``a, b`` = ``(scale, zero)``, ``(scale/2, zero + scale/4)`` for 1-bit midpoint codes and
``(scale, -2^(b-1) scale)`` for symmetric codes, :func:`affine_terms`):

* keys with per-token terms over channel groups of ``cg`` channels (per-token, int-block,
  llama.cpp ``q4_0`` keys): ``logit[t] = sum_g a_{t,g} (q_g . c_{t,g}) + sum_g b_{t,g} sum(q_g)``;
* keys in pages of ``L`` tokens with per-page, per-channel-group terms (KIVI per-channel keys,
  ``L = G``; per-head keys, one page): ``logit[t] = (q * a_P) . c_t + q . b_P`` for token ``t``
  of page ``P`` -- one ``q * a_P`` per page, then a dot product with the codes;
* values with per-token terms over channel groups of ``cg`` channels (KIVI values):
  ``out[d] = sum_t (p_t a_{t,g(d)}) c_{t,d} + sum_t p_t b_{t,g(d)}``.

Two implementations of the block terms, equal up to float rounding: *native* (the C kernels of
:mod:`kvbench.kernels.cpu.native`), used only where the running step allows it
(:func:`native_allowed`, set by the code-domain backend) and reported (:func:`note_impl`), and
*eager*: ``unpack_bits`` + matmul in chunks of :data:`EAGER_CHUNK_TOKENS` tokens (bounded
temporaries).

:class:`AffineBlockAttention` covers per-channel/per-head pages and per-token groups for keys,
per-token groups for values, 1..8 bits (and 16), any channel group dividing ``D``.
"""

from __future__ import annotations

import torch

from kvbench.cache.blocks import AffineBlock
from kvbench.cache.quant import unpack_bits
from kvbench.kernels.cpu import native
from kvbench.kernels.cpu.native import code_layout

#: tokens per chunk of the eager path (bounds its temporary unpacked codes)
EAGER_CHUNK_TOKENS = 1024


class _StepState:
    """What the running step of the code-domain backend (:mod:`kvbench.kernels.cpu.codedomain`)
    allows (``native``) and which implementation each quantized block used (``used``, for the
    recorded path)."""

    native = False
    used: list[str] = []


_state = _StepState()


def native_allowed() -> bool:
    """Whether a block kernel may use :mod:`kvbench.kernels.cpu.native` in the running step."""
    return _state.native


def note_impl(impl: str) -> None:
    """A block kernel reports the implementation it ran (``"native"``): the recorded path
    names it (``cpu-native``; ``cpu-native+eager`` when another block did not report)."""
    _state.used.append(impl)


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


class AffineBlockAttention:
    """Block kernel of :class:`kvbench.cache.blocks.AffineBlock` (see the module docstring).

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
