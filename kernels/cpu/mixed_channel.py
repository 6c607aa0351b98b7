"""CPU code-domain keys for mixed-precision channel classes (Kitty, PN-Mix, ChanMix).

A :class:`kvbench.cache.mixed_channel.MixedChannelBlock` stores, per page of ``L`` tokens, the channels
sorted by class (``perm``), each class ``c`` as ``class_bits[c]``-bit per-channel codes with
one (scale, zero) per channel per page.  With ``x[t, perm[j]] = c_j[t] a_j + b_j`` (``j`` the
class-sorted position; ``a, b`` as in :func:`kvbench.kernels.cpu.affine.affine_terms`, 1-bit classes
with the midpoint terms), the logit of token ``t`` of page ``P`` is::

    q . x_t = sum_c  (q_perm * a_P)[class c] . codes_c[t]  +  q_perm . b_P

so the query is gathered once per step (``q_perm = q[perm]``: once per page for Kitty's per-page
permutation, once for a fixed one), then each class is a per-channel page product on its own
slice of the packed bytes (native; or unpack + matmul, eager).  Bit-plane packed layouts (a
class boundary not on a byte, :func:`kvbench.cache.mixed_channel.pack_mixed`) are read by the
native bit-stream kernels, else eager.  Values are never stored this way.
"""

from __future__ import annotations

import functools

import torch

from kvbench.cache.mixed_channel import MixedChannelBlock, unpack_mixed
from kvbench.cache.quant import unpack_bits
from kvbench.kernels.cpu import native
from kvbench.kernels.cpu.affine import EAGER_CHUNK_TOKENS, native_allowed, note_impl
from kvbench.kernels.cpu.native import code_layout


def _byte_aligned(bits: tuple[int, ...], counts: tuple[int, ...]) -> bool:
    live = [(b, n) for b, n in zip(bits, counts) if n]
    return all(n * b % 8 == 0 for b, n in live[:-1])


def _word_counts(bits: tuple[int, ...], counts: tuple[int, ...], nbytes: int) -> list[int] | None:
    """Channels per class as the native per-class kernel reads them: each class's count rounded
    up to a multiple of 8 channels where the row has room after the class (the vectorised
    keys read 8 channels at a time), else to whole code words
    (:func:`kvbench.kernels.cpu.native.code_layout`); ``None`` when a class that is not the last does
    not end on a whole word, or the row has no room for the rounded-up last class.  The extra
    channels read the next class's bytes or the row's trailing bits and get a zero query, so
    they add nothing (Kitty's two 4-bit channels: one byte, read as 8 channels in 4)."""
    live = [i for i, n in enumerate(counts) if n]
    out, boff = [], 0
    for i, (b, n) in enumerate(zip(bits, counts)):
        cpw = code_layout(b)[1]
        wide = -(-n // cpw) * cpw
        if wide != n and (i != live[-1] or boff + wide * b // 8 > nbytes):
            return None
        eight = -(-n // 8) * 8
        if eight % cpw == 0 and boff + eight * b // 8 <= nbytes:
            wide = eight
        out.append(wide)
        boff += (n * b + 7) // 8
    return out


def _tile_unit(bits: int) -> int:
    """Codes per unit of the native tiled keys: a 32-bit word (1, 2, 4, 8 bits) or 32 codes."""
    return 32 // bits if bits & (bits - 1) == 0 else 32


def _native_offbyte(
    block: MixedChannelBlock, flat: torch.Tensor, qs_all: torch.Tensor, length: int
) -> torch.Tensor | None:
    """Logits of a block whose class boundaries are off the byte (ChanMix): each class read
    by the tiled raw kernel from its first bit (``bit0``), padded to whole tile units with a
    zero query (the extra channels read the next class's bits, or zeros past the row, and add
    nothing).  ``flat`` uint8 ``[B, H, T, nbytes]``, ``qs_all`` ``[B, H, M, np, D]`` (scales
    folded in, class-sorted).  ``None`` where the native kernels are unavailable."""
    if flat.dtype != torch.uint8 or not native.available() or flat.stride(-1) != 1:
        return None
    big, small = _offbyte_plan(block.class_bits, block.class_counts)
    out = None
    for bits, cnt, wide, off, bo in big:
        qw = torch.nn.functional.pad(qs_all[..., off : off + cnt], (0, wide - cnt))
        res = native.keys_raw_rows(flat[..., bo // 8 :], qw, length, bits, bit0=bo % 8)
        out = res if out is None else out + res
    if small is not None:  # one bit-stream call over the small classes' channels
        chans, widths, offsets = small
        res = native.keys_stream_rows(flat, qs_all[..., chans], widths, length, offsets)
        out = res if out is None else out + res
    return out


@functools.lru_cache(maxsize=64)
def _offbyte_plan(class_bits: tuple[int, ...], class_counts: tuple[int, ...]):
    """What :func:`_native_offbyte` reads, per class layout (computed once): ``big`` =
    ``(bits, count, padded count, first channel, first bit)`` of the classes read whole,
    ``small`` = ``(channels, widths, bit
    offsets)`` of the classes that would be mostly padding (``None`` if there are none)."""
    big, rest, off, bo = [], [], 0, 0
    for bits, cnt in zip(class_bits, class_counts):
        if not cnt:
            continue
        wide = -(-cnt // _tile_unit(bits)) * _tile_unit(bits)
        if 2 * cnt < wide or wide > native.MAX_HEAD_DIM:  # mostly padding: read channel-wise
            rest.append((bits, cnt, off, bo))
        else:
            big.append((bits, cnt, wide, off, bo))
        off += cnt
        bo += cnt * bits
    small = None
    if rest:
        chans = torch.cat([torch.arange(o, o + n) for _, n, o, _ in rest])
        widths = torch.cat([torch.full((n,), b) for b, n, _, _ in rest])
        offsets = torch.cat([bit + b * torch.arange(n) for b, n, _, bit in rest])
        small = (chans, widths, offsets)
    return big, small


def _class_terms(block: MixedChannelBlock, pages: slice):
    """Float32 ``(a, b)`` ``[B, H, np, D]`` in class-sorted order for ``pages``."""
    s = block.scale[:, :, pages].float()
    z = block.zero[:, :, pages].float()
    if not block.midpoint or 1 not in block.class_bits:
        return s, z
    sorted_bits = torch.repeat_interleave(
        torch.tensor(block.class_bits), torch.tensor(block.class_counts)
    ).to(s.device)
    mid = sorted_bits == 1
    return torch.where(mid, s * 0.5, s), torch.where(mid, z + s * 0.25, z)


def _pages(
    block: MixedChannelBlock,
    codes: torch.Tensor,
    qp: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[B, H, M, np * L]`` of ``np`` pages of ``L`` tokens: ``codes`` uint8
    ``[B, H, np, L, nbytes]``, ``qp`` the class-sorted query ``[B, H, M, np|1, D]``, ``a, b``
    ``[B, H, np, D]``: native where the step allows it and the class fits, else unpack +
    matmul."""
    bsz, h, npg, length, nbytes = codes.shape
    m = qp.shape[2]
    qs_all = qp * a.unsqueeze(2)  # [B, H, M, np, D]
    out = (qp * b.unsqueeze(2)).sum(-1).unsqueeze(-1)  # [B, H, M, np, 1]
    aligned = _byte_aligned(block.class_bits, block.class_counts)
    wide = _word_counts(block.class_bits, block.class_counts, nbytes) if aligned else None
    off = boff = 0
    for ci, (bits, cnt) in enumerate(zip(block.class_bits, block.class_counts)):
        if not cnt:
            continue
        qs = qs_all[..., off : off + cnt]
        nb = (cnt * bits + 7) // 8
        res = None
        if wide is not None and native_allowed():
            nw = wide[ci] * bits // 8  # whole words (the last class may read trailing bits)
            flat = codes.reshape(bsz, h, npg * length, nbytes)[..., boff : boff + nw]
            if native.supports(flat, bits, wide[ci]):
                qw = torch.nn.functional.pad(qs, (0, wide[ci] - cnt))  # zero query: no term
                res = native.keys_raw_rows(flat, qw, length, bits)
                res = res.reshape(bsz, h, m, npg, length)
                note_impl("native")
        if res is None:
            res = _eager_class(block, codes, qs, ci, cnt, bits, boff, nb, aligned)
        out = out + res
        off += cnt
        boff += nb
    return out.reshape(bsz, h, m, npg * length)


def _eager_class(block, codes, qs, ci, cnt, bits, boff, nb, aligned) -> torch.Tensor:
    """One class's ``(q_perm a) . codes`` by unpack + matmul in page chunks: ``[B, H, M, np, L]``."""
    bsz, h, npg, length, nbytes = codes.shape
    step = max(1, EAGER_CHUNK_TOKENS // length)
    outs = []
    for p0 in range(0, npg, step):
        ck = codes[:, :, p0 : p0 + step]
        if aligned:
            c = unpack_bits(ck[..., boff : boff + nb], bits, cnt)
        else:
            c = unpack_mixed(ck, block.class_bits, block.class_counts)[ci]
        c = c.float()  # [B, H, np, L, cnt]
        qc = qs[:, :, :, p0 : p0 + step].permute(0, 1, 3, 2, 4)  # [B, H, np, M, cnt]
        outs.append(torch.matmul(qc, c.transpose(-1, -2)).permute(0, 1, 3, 2, 4))
    return torch.cat(outs, 3) if len(outs) > 1 else outs[0]


def _native_classes(block: MixedChannelBlock) -> bool:
    """Whether every class can take the per-class native kernel (byte-aligned class
    boundaries, whole code words per class but perhaps the last, :func:`_word_counts`); else
    one bit-stream call reads the block."""
    return _byte_aligned(block.class_bits, block.class_counts) and (
        _word_counts(block.class_bits, block.class_counts, block.codes.shape[-1]) is not None
    )


def _native_stream(block: MixedChannelBlock, qp: torch.Tensor, n: int, length: int):
    """All pages (a shorter last one included) in native calls over the bit stream of the
    class codes: per class from its first bit (:func:`_native_offbyte`), else one call of
    :func:`kvbench.kernels.cpu.native.keys_stream_rows`: ``[B, H, M, n]``, or ``None`` when the
    native kernels cannot take the block."""
    codes = block.codes
    d = qp.shape[-1]
    if codes.dtype != torch.uint8 or not native.available() or d > native.MAX_HEAD_DIM:
        return None
    npg = -(-n // length)
    a, b = _class_terms(block, slice(0, npg))  # [B, H, np, D]
    qs = qp * a.unsqueeze(2)  # [B, H, M, np, D]
    bias = (qp * b.unsqueeze(2)).sum(-1)  # [B, H, M, np]
    out = _native_offbyte(block, codes[:, :, :n], qs, length)
    if out is None:
        widths = torch.repeat_interleave(
            torch.tensor(block.class_bits), torch.tensor(block.class_counts)
        )
        out = native.keys_stream_rows(codes[:, :, :n], qs, widths, length)
    bsz, h, m = out.shape[:3]
    pad = npg * length - n
    bias = bias.unsqueeze(-1).expand(bsz, h, m, npg, length).reshape(bsz, h, m, npg * length)
    return out + (bias[..., :n] if pad else bias)


class MixedChannelAttention:
    """:class:`~kvbench.kernels.cpu.codedomain.BlockKernel` of
    :class:`~kvbench.cache.mixed_channel.MixedChannelBlock` keys (see the module docstring)."""

    def key_reason(self, block: MixedChannelBlock, head_dim: int) -> str | None:
        lens = block.group_len
        if not lens or any(x != lens[0] for x in lens[:-1]) or lens[-1] > lens[0]:
            return "mixed key pages are not of one length"
        return None

    def value_reason(self, block: MixedChannelBlock, head_dim: int) -> str | None:
        return "mixed channel classes are a key layout (values are per-token)"

    def key_logits(self, block: MixedChannelBlock, q: torch.Tensor):
        bsz, h, m, d = q.shape
        length = block.group_len[0]
        n = block.ntokens
        full = n // length
        codes = block.codes
        nbytes = codes.shape[-1]
        if block.perm is None:
            qp = q.unsqueeze(3)  # [B, H, M, 1, D]
        else:
            perm = block.perm.long().expand(bsz, h, -1, d)  # [B, H, NP|1, D]
            qx = q.unsqueeze(3).expand(bsz, h, m, perm.shape[2], d)
            qp = qx.gather(-1, perm.unsqueeze(2).expand(bsz, h, m, perm.shape[2], d))
        if native_allowed() and not _native_classes(block):
            out = _native_stream(block, qp, n, length)
            if out is not None:
                note_impl("native")
                return out
        parts = []
        if full:
            sl = slice(0, full)
            a, b = _class_terms(block, sl)
            ck = codes[:, :, : full * length].reshape(bsz, h, full, length, nbytes)
            qf = qp if qp.shape[3] == 1 else qp[:, :, :, sl]
            parts.append(_pages(block, ck, qf, a, b))
        if n > full * length:
            sl = slice(full, full + 1)
            a, b = _class_terms(block, sl)
            ck = codes[:, :, full * length :].unsqueeze(2)
            qt = qp if qp.shape[3] == 1 else qp[:, :, :, sl]
            parts.append(_pages(block, ck, qt, a, b))
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]

    def value_output(self, block: MixedChannelBlock, p: torch.Tensor):
        raise ValueError(self.value_reason(block, block.head_dim))
