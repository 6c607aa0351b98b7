"""Stored quantized token blocks and the codecs that make them (docs/design.md#codec-and-block).

A *codec* turns full-precision tokens ``[B, H_kv, n, D]`` into a *block*: packed codes plus the
metadata needed to dequantize them, never a full-precision copy (``nbytes()`` sums what blocks
hold); blocks of one side are concatenated along the token axis as the cache flushes.  In an
:class:`AffineBlock` every (scale, zero) covers ``group_len[g]`` consecutive tokens x
``D // Dg`` consecutive channels; each codec's rectangle is in that section's table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

from kvbench.cache.layout import BlockLayout, Codes, GroupTerms, dtype_name
from kvbench.cache.quant import (
    check_bits,
    dequantize_groups,
    pack_bits,
    quantize_groups,
    unpack_bits,
)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it spans its whole allocation, else a compact copy.

    A stored slice must not be a view into a larger tensor (a prompt, a cropped block): the view
    would keep the rest allocated (a full-precision copy of quantized tokens) while
    :func:`tensor_bytes` counts only the slice.
    """
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the given tensors (``numel * element_size``; ``None`` counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def expand_groups(t: torch.Tensor, group_len: list[int]) -> torch.Tensor:
    """Per-group metadata ``[B, H, NG, X]`` -> per token ``[B, H, sum(group_len), X]``."""
    if all(g == 1 for g in group_len):
        return t
    if all(g == group_len[0] for g in group_len):
        return t.repeat_interleave(group_len[0], dim=2)
    return t.repeat_interleave(torch.tensor(group_len, device=t.device), dim=2)


def crop_groups(group_len: list[int], n: int) -> list[int]:
    """The token groups left of ``group_len`` when only the first ``n`` tokens are kept (a
    group cut in two keeps its start)."""
    lens, total = [], 0
    for g in group_len:
        if total >= n:
            break
        lens.append(min(g, n - total))
        total += lens[-1]
    return lens


@runtime_checkable
class Block(Protocol):
    """What a cache side stores for its quantized tokens.

    Required members: ``ntokens`` (int), ``dequantize(dtype) -> [B, H_kv, n, D]``,
    ``tensors() -> [(category, tensor)]`` with category in ``codes | scales | metadata``: every
    tensor the block holds (the cache's byte count is their sum), ``cat(other) -> Block``,
    ``crop(n) -> Block`` (keep the first n tokens), ``index_batch(idx) -> Block``.
    Built-in blocks also describe what they hold as a typed ``layout``
    (:class:`kvbench.cache.layout.BlockLayout`).

    Optional member ``gather(keep) -> Block``: keep tokens ``keep`` (int64 ``[B, H_kv, K]``,
    ascending in each row and head, the same ``K`` everywhere) and drop the rest, each kept
    token dequantizing exactly as before (token eviction, docs/design.md#eviction).  A block
    without it cannot lose tokens once flushed: the layer cache refuses such an eviction with a
    ``TypeError`` naming the block type.
    """

    @property
    def ntokens(self) -> int: ...

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor: ...

    def tensors(self) -> list[tuple[str, torch.Tensor]]: ...

    def cat(self, other: Block) -> Block: ...

    def crop(self, n: int) -> Block: ...

    def index_batch(self, idx: torch.Tensor) -> Block: ...


@dataclass
class AffineBlock:
    """Min-max affine codes of a run of tokens, packed along the channel axis.

    Attributes
    ----------
    codes : uint8 ``[B, H_kv, n, ceil(D*bits/8)]`` (int16 ``[B, H_kv, n, D]`` for 16 bits).
    scale, zero : ``[B|1, H_kv|1, NG, Dg]`` in the scale dtype; ``zero`` (the group min) is
        ``None`` for symmetric codes.
    group_len : tokens covered by each of the NG token groups (sums to ``n``).
    batch_shared : ``scale``/``zero`` are shared by every batch row (per-tensor); otherwise a
        metadata tensor whose batch dim equals the codes' is per row and follows
        :meth:`index_batch` (also when ``B == 1``).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_len: list[int]
    bits: int
    head_dim: int
    symmetric: bool = False
    midpoint: bool = False
    batch_shared: bool = False

    @property
    def ntokens(self) -> int:
        return self.codes.shape[2]

    @property
    def layout(self) -> BlockLayout:
        """What this block stores (:class:`~kvbench.cache.layout.BlockLayout`): ``bits``-bit codes
        of ``head_dim`` channels; one scale (and zero) per ``max(group_len)`` tokens x
        ``head_dim // Dg`` channels in the scale dtype."""
        tokens = max(self.group_len, default=1)
        return affine_layout(
            self.bits, self.head_dim, self.scale.dtype, self.zero is None, tokens,
            self.head_dim // self.scale.shape[-1],
        )  # fmt: skip

    def unpacked_codes(self) -> torch.Tensor:
        """Codes ``[B, H_kv, n, D]`` (uint8 or int32)."""
        return unpack_bits(self.codes, self.bits, self.head_dim)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        c = self.unpacked_codes()
        b, h, n, d = c.shape
        dg = self.scale.shape[-1]
        s = expand_groups(self.scale, self.group_len).unsqueeze(-1)
        z = None if self.zero is None else expand_groups(self.zero, self.group_len).unsqueeze(-1)
        c = c.reshape(b, h, n, dg, d // dg)
        x = dequantize_groups(
            c, s, z, self.bits, symmetric=self.symmetric, midpoint=self.midpoint, dtype=dtype
        )
        return x.reshape(b, h, n, d)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [("codes", self.codes), ("scales", self.scale)]
        return out if self.zero is None else [*out, ("scales", self.zero)]

    def cat(self, other: AffineBlock) -> AffineBlock:
        return AffineBlock.join([self, other])

    @staticmethod
    def join(parts: list[AffineBlock]) -> AffineBlock:
        """One block of ``parts`` (consecutive runs of tokens with one quantizer setting, e.g.
        the chunks of one encode) in one concatenation per tensor (:meth:`cat` pairwise would
        copy the first parts again for every later one).  Raises ``ValueError`` when the
        quantizer settings differ."""
        if len(parts) == 1:
            return parts[0]
        if any(isinstance(p, IndexedAffineBlock) for p in parts):  # tokens index their rows
            out = IndexedAffineBlock.of(parts[0])
            for p in parts[1:]:
                out = out.cat(p)
            return out
        p0 = parts[0]
        for p in parts[1:]:
            if (p.bits, p.symmetric, p.midpoint, p.scale.shape[-1]) != (
                p0.bits, p0.symmetric, p0.midpoint, p0.scale.shape[-1]
            ):  # fmt: skip
                raise ValueError("cannot concatenate blocks of different quantizer settings")

        return replace(
            p0,
            codes=torch.cat([p.codes for p in parts], dim=2),
            scale=torch.cat([p.scale for p in parts], dim=2),
            zero=None if p0.zero is None else torch.cat([p.zero for p in parts], dim=2),
            # one C-level copy of the lists: a comprehension over every group was the larger
            # part of a decode step's one-token flush at a few thousand tokens
            group_len=list(itertools.chain.from_iterable(p.group_len for p in parts)),
        )

    def crop(self, n: int) -> AffineBlock:
        """Keep the first ``n`` tokens; a group cut in two keeps its (scale, zero)."""
        lens = crop_groups(self.group_len, n)
        kept = len(lens)
        return replace(
            self,
            codes=own_storage(self.codes[:, :, :n]),
            scale=own_storage(self.scale[:, :, :kept]),
            zero=None if self.zero is None else own_storage(self.zero[:, :, :kept]),
            group_len=lens,
        )

    def gather(self, keep: torch.Tensor) -> AffineBlock:
        """Keep tokens ``keep`` (int64 ``[B, H_kv, K]``, ascending per row and head; the
        optional :class:`Block` member), each dequantizing exactly as before.

        When every row and head keeps the same tokens (a sliding window), each token group
        keeps its (scale, zero) and covers its kept tokens (groups left empty are dropped).
        Otherwise a group's tokens may be kept in one head and dropped in another: the result
        is an :class:`IndexedAffineBlock` (each kept token indexes its group's (scale, zero)
        row), whose values are unchanged."""
        b, h, _, nbytes = self.codes.shape
        keep = keep.to(self.codes.device)
        k = keep.shape[2]
        codes = torch.gather(self.codes, 2, keep[..., None].expand(b, h, k, nbytes))
        lens = torch.tensor(self.group_len, device=keep.device)
        if bool((keep == keep[:1, :1]).all()):  # one set of tokens for every row and head
            group = torch.repeat_interleave(torch.arange(len(lens), device=keep.device), lens)
            counts = torch.bincount(group[keep[0, 0]], minlength=len(lens))
            groups = counts.nonzero().flatten()

            def sel(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else own_storage(t.index_select(2, groups.to(t.device)))

            return replace(
                self, codes=codes, scale=sel(self.scale), zero=sel(self.zero),
                group_len=counts[groups].tolist(),
            )  # fmt: skip

        return IndexedAffineBlock.of(self).gather(keep)

    def index_batch(self, idx: torch.Tensor) -> AffineBlock:
        def sel(t: torch.Tensor | None) -> torch.Tensor | None:
            # per-row metadata follows the codes, a B == 1 cache included (repeat_batch);
            # metadata broadcast over the batch ([1, ...] with B > 1, or shared) stays
            if t is None or self.batch_shared or t.shape[0] != self.codes.shape[0]:
                return t
            return t.index_select(0, idx.to(t.device))

        return replace(
            self,
            codes=self.codes.index_select(0, idx.to(self.codes.device)),
            scale=sel(self.scale),
            zero=sel(self.zero),
        )


def _index_dtype(rows: int) -> torch.dtype:
    """The narrowest signed integer dtype that indexes ``rows`` rows."""
    return torch.int16 if rows <= torch.iinfo(torch.int16).max else torch.int32


@dataclass
class IndexedAffineBlock(AffineBlock):
    """Affine codes whose tokens index their (scale, zero) rows: what an eviction leaves of
    an :class:`AffineBlock` when rows or heads keep different tokens of a token group
    (docs/design.md#eviction).

    ``scale``, ``zero``: ``[B, H_kv, NG, Dg]``, one row per (row, head) group;
    ``group_index``: int16 (int32 past 32767 rows) ``[B, H_kv, n]``, the row of each token,
    counted as ``metadata`` bytes; ``group_len``: the token groups the rows were made for
    (what :attr:`layout` describes; ``ntokens`` is the codes').  No attention kernel reads
    this type: the reference path does (``dequantize``)."""

    group_index: torch.Tensor | None = None

    @staticmethod
    def of(block: AffineBlock) -> IndexedAffineBlock:
        """``block`` with a row index per token (itself when it has one)."""
        if isinstance(block, IndexedAffineBlock):
            return block
        b, h, n, _ = block.codes.shape
        lens = torch.tensor(block.group_len, device=block.codes.device)
        rows = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)

        def full(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.expand(b, h, *t.shape[2:]).contiguous()

        return IndexedAffineBlock(
            block.codes, full(block.scale), full(block.zero), list(block.group_len), block.bits,
            block.head_dim, block.symmetric, block.midpoint, False,
            rows.to(_index_dtype(len(lens))).expand(b, h, n).contiguous(),
        )  # fmt: skip

    def _per_token(self) -> AffineBlock:
        """The same values as an :class:`AffineBlock` with one (scale, zero) per token."""
        idx = self.group_index.long()

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.gather(t, 2, idx[..., None].expand(*idx.shape, t.shape[-1]))

        n = self.ntokens
        return AffineBlock(
            self.codes, pick(self.scale), pick(self.zero), [1] * n, self.bits, self.head_dim,
            self.symmetric, self.midpoint,
        )  # fmt: skip

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._per_token().dequantize(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [*super().tensors(), ("metadata", self.group_index)]

    def _compact(self, codes: torch.Tensor, index: torch.Tensor) -> IndexedAffineBlock:
        """This block with ``codes`` and row ``index``, keeping only the rows some token
        indexes."""
        used = torch.unique(index.long())
        remap = torch.full((self.scale.shape[2],), -1, dtype=torch.long, device=index.device)
        remap[used] = torch.arange(len(used), device=index.device)

        def sel(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else own_storage(t.index_select(2, used.to(t.device)))

        return replace(
            self, codes=own_storage(codes), scale=sel(self.scale), zero=sel(self.zero),
            group_index=remap[index.long()].to(_index_dtype(len(used))),
        )  # fmt: skip

    def gather(self, keep: torch.Tensor) -> IndexedAffineBlock:
        b, h, _, nbytes = self.codes.shape
        keep = keep.to(self.codes.device)
        codes = torch.gather(self.codes, 2, keep[..., None].expand(b, h, keep.shape[2], nbytes))
        return self._compact(codes, torch.gather(self.group_index, 2, keep))

    def crop(self, n: int) -> IndexedAffineBlock:
        return self._compact(self.codes[:, :, :n], self.group_index[:, :, :n])

    def cat(self, other: AffineBlock) -> IndexedAffineBlock:
        o = IndexedAffineBlock.of(other)
        if (o.bits, o.symmetric, o.midpoint, o.scale.shape[-1]) != (
            self.bits, self.symmetric, self.midpoint, self.scale.shape[-1]
        ):  # fmt: skip
            raise ValueError("cannot concatenate blocks of different quantizer settings")
        rows = self.scale.shape[2]
        index = torch.cat([self.group_index.long(), o.group_index.long() + rows], dim=2)
        return replace(
            self,
            codes=torch.cat([self.codes, o.codes], dim=2),
            scale=torch.cat([self.scale, o.scale], dim=2),
            zero=None if self.zero is None else torch.cat([self.zero, o.zero], dim=2),
            group_len=[*self.group_len, *o.group_len],
            group_index=index.to(_index_dtype(rows + o.scale.shape[2])),
        )

    def index_batch(self, idx: torch.Tensor) -> IndexedAffineBlock:
        def sel(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, idx.to(t.device))

        return replace(
            self, codes=sel(self.codes), scale=sel(self.scale), zero=sel(self.zero),
            group_index=sel(self.group_index),
        )  # fmt: skip


def affine_layout(
    bits: int,
    head_dim: int,
    scale_dtype: torch.dtype | str,
    symmetric: bool,
    tokens: int,
    channels: int,
) -> BlockLayout:
    """Layout of min-max affine codes: ``bits``-bit codes (LSB-first; int16 for 16 bits), one
    ``scale`` (and ``zero`` unless ``symmetric``) per ``tokens`` x ``channels`` rectangle."""
    names = ("scale",) if symmetric else ("scale", "zero")
    return BlockLayout(
        Codes.uniform(bits, head_dim, "int16" if bits == 16 else "lsb-first"),
        GroupTerms(names, dtype_name(scale_dtype), tokens, channels),
        page_len=tokens,
    )


def cat_blocks(a: Block | None, b: Block | None) -> Block | None:
    """Concatenate two optional blocks along the token axis."""
    if a is None:
        return b
    if b is None:
        return a
    return a.cat(b)


# --------------------------------------------------------------------------------------------
# Codecs
# --------------------------------------------------------------------------------------------


class Codec(Protocol):
    """Turns full-precision tokens ``[B, H_kv, n, D]`` into a :class:`Block`.

    ``token_group``: tokens per group along T; a flush hands the codec a multiple of it
    (1 for per-token groups; 0 for codecs whose groups are whole flushes).
    ``prepare(keys, queries)`` is called once at prefill before the first ``encode``
    (channel or pair selection); codecs that select nothing ignore it.

    ``layout(head_dim, flush_tokens)`` describes the blocks ``encode`` makes for ``head_dim``
    channels (``flush_tokens``: tokens per flush, used by codecs whose group is a whole flush);
    the nominal bit accounting is derived from it (:func:`kvbench.cache.layout.bit_terms`).
    """

    token_group: int

    def encode(self, x: torch.Tensor) -> Block: ...

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout: ...

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None: ...


@dataclass
class AffineCodec:
    """Common settings of the uniform affine codecs."""

    bits: int
    scale_dtype: torch.dtype = torch.float16
    symmetric: bool = False
    midpoint: bool = False
    token_group: int = field(default=1)

    def __post_init__(self) -> None:
        check_bits(self.bits)

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        return None

    def _layout(self, head_dim: int, tokens: int, channels: int) -> BlockLayout:
        return affine_layout(
            self.bits, head_dim, self.scale_dtype, self.symmetric, max(tokens, 1), channels
        )

    def _quantize(self, groups: torch.Tensor):
        return quantize_groups(
            groups,
            self.bits,
            symmetric=self.symmetric,
            midpoint=self.midpoint and self.bits == 1,
            scale_dtype=self.scale_dtype,
        )

    def _native(
        self, x: torch.Tensor, tokens: int, channels: int, group_len: list[int], shared=False
    ) -> AffineBlock | None:
        """The block from the native one-pass quantizer (:mod:`kvbench.cache.native_quant`:
        the same codes, scales and zeros as the torch path) for groups of ``tokens`` x
        ``channels``, or ``None`` where it does not serve the input (the torch path runs)."""
        from kvbench.cache.native_quant import quantize_pack

        got = quantize_pack(
            x, self.bits, tokens, channels, symmetric=self.symmetric,
            midpoint=self.midpoint and self.bits == 1, scale_dtype=self.scale_dtype,
            shared=shared,
        )  # fmt: skip
        if got is None:
            return None
        codes, scale, zero = got
        return AffineBlock(
            codes, scale, zero, group_len, self.bits, x.shape[-1], symmetric=self.symmetric,
            midpoint=self.midpoint and self.bits == 1, batch_shared=shared,
        )  # fmt: skip

    def _block(self, codes, q, group_len, head_dim) -> AffineBlock:
        return AffineBlock(
            pack_bits(codes, self.bits, check=False),  # clamped by quantize_groups
            q.scale,
            q.zero,
            group_len,
            self.bits,
            head_dim,
            symmetric=self.symmetric,
            midpoint=self.midpoint and self.bits == 1,
        )


@dataclass
class PerChannelCodec(AffineCodec):
    """KIVI-sense per-channel: one (scale, zero) per (b, h, channel, G consecutive tokens).

    Source: KIVI (Liu et al., ICML'24) §3.2, keys; docs/methods.md#kivi.  ``encode`` needs ``n % G == 0``.
    """

    group_size: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        self.token_group = self.group_size

    def encode(self, x: torch.Tensor) -> AffineBlock:
        b, h, n, d = x.shape
        g = self.group_size
        if n % g:
            raise ValueError(
                f"per-channel groups need a multiple of group_size={g} tokens, got {n}"
            )
        fast = self._native(x, g, 1, [g] * (n // g))
        if fast is not None:
            return fast
        xg = x.reshape(b, h, n // g, g, d).transpose(-1, -2)  # [B, H, NP, D, G]
        q = self._quantize(xg)
        codes = q.codes.transpose(-1, -2).reshape(b, h, n, d)
        q.scale, q.zero = q.scale.squeeze(-1), None if q.zero is None else q.zero.squeeze(-1)
        return self._block(codes, q, [g] * (n // g), d)

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        """One (scale, zero) per channel per ``group_size`` tokens."""
        return self._layout(head_dim, self.group_size, 1)


@dataclass
class PerTokenCodec(AffineCodec):
    """KIVI-sense per-token: one (scale, zero) per (b, h, token, ``channel_group`` channels).

    Source: KIVI §3.2, values; docs/methods.md#kivi.  ``channel_group`` must divide head_dim.
    """

    channel_group: int = 128

    def _group(self, head_dim: int) -> int:
        """``channel_group``; raises ``ValueError`` unless it divides ``head_dim``."""
        if head_dim % self.channel_group:
            raise ValueError(
                f"value_group_size={self.channel_group} does not divide head_dim={head_dim}; "
                f"choose a divisor of {head_dim}"
            )
        return self.channel_group

    def encode(self, x: torch.Tensor) -> AffineBlock:
        b, h, n, d = x.shape
        cg = self._group(d)
        fast = self._native(x, 1, cg, [1] * n)
        if fast is not None:
            return fast
        q = self._quantize(x.reshape(b, h, n, d // cg, cg))
        codes = q.codes.reshape(b, h, n, d)
        q.scale, q.zero = q.scale.squeeze(-1), None if q.zero is None else q.zero.squeeze(-1)
        return self._block(codes, q, [1] * n, d)

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        """One (scale, zero) per token per ``channel_group`` channels.  Raises ``ValueError`` if
        ``channel_group`` does not divide ``head_dim``."""
        return self._layout(head_dim, 1, self._group(head_dim))


@dataclass
class PerHeadCodec(AffineCodec):
    """One (scale, zero) per (b, h) over all tokens x channels of one flush.

    The textbook's ``PerChannelQuantizedCache`` (it calls per-head "per-channel"); docs/methods.md#per-head.
    """

    token_group: int = 0

    def encode(self, x: torch.Tensor) -> AffineBlock:
        b, h, n, d = x.shape
        fast = self._native(x, n, d, [n])
        if fast is not None:
            return fast
        q = self._quantize(x.reshape(b, h, 1, n * d))
        codes = q.codes.reshape(b, h, n, d)
        return self._block(codes, q, [n], d)

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        """One (scale, zero) per (row, head) per flush of ``flush_tokens`` tokens."""
        return self._layout(head_dim, flush_tokens, head_dim)


@dataclass
class PerTensorCodec(AffineCodec):
    """One (scale, zero) for the whole flushed tensor (all batch rows and heads); docs/methods.md#uniform."""

    token_group: int = 0

    def encode(self, x: torch.Tensor) -> AffineBlock:
        b, h, n, d = x.shape
        fast = self._native(x, n, d, [n], shared=True)
        if fast is not None:
            return fast
        q = self._quantize(x.reshape(1, 1, 1, b * h * n * d))
        codes = q.codes.reshape(b, h, n, d)
        return replace(self._block(codes, q, [n], d), batch_shared=True)

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        """One (scale, zero) per flush of ``flush_tokens`` tokens, shared by all rows and heads
        (counted per (row, head), the convention of docs/methods.md#uniform)."""
        return self._layout(head_dim, flush_tokens, head_dim)
