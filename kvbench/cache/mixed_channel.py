"""Mixed-precision per-channel key storage (Kitty, ChanMix, PN-Mix; docs/methods.md#kitty, docs/methods.md#chanmix, docs/methods.md#pn-mix, docs/methods.md#average-bits).

A page of ``G`` tokens of one (batch row, KV head) is quantized per channel (KIVI sense: one
(scale, zero) per channel per page, statistics over the page's tokens), but the channels fall
into *classes* stored at different code widths: ``class_bits[c]`` bits for class ``c``.  Class 0
is the first entry of ``class_bits`` (the methods list their classes best-first).

Storage of a :class:`MixedChannelBlock` (nothing else is held; ``tensors()`` lists all of it):

* ``codes``: one LSB-first bit stream per token, class 0 first (:func:`pack_mixed`,
  docs/methods.md#bit-packing);
* ``scale`` / ``zero``: one per channel per page, in the class-sorted channel order, in the
  codec's scale dtype (float16 by default; float8 e4m3 for ChanMix: 1 byte each);
* ``perm``: the channel permutation that sorts channels by class, one uint8 channel index per
  channel (int16 when ``D > 256``), category ``metadata``.  Either per page per (b, h) (Kitty's
  dynamic selection: ``[B, H, NP, D]``) or fixed per (b, h) for the whole generation (PN-Mix,
  ChanMix: ``[B|1, H, 1, D]``, one tensor shared by the codec and every block, so it is held
  and counted once).  When at most one class is non-empty the order is the identity and no
  ``perm`` is stored.

Dequantization restores the original channel order.  1-bit classes optionally use the midpoint
reconstruction (PN-Mix Eq. 7 [RECON], :func:`kvbench.cache.quant.quantize_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from kvbench.cache.blocks import crop_groups, expand_groups, own_storage
from kvbench.cache.layout import BlockLayout, CodeClass, Codes, GroupTerms, Permutation, dtype_name
from kvbench.cache.native_quant import quantize_pack
from kvbench.cache.quant import (
    check_bits,
    dequantize_groups,
    pack_bits,
    quantize_groups,
    unpack_bits,
)

#: ``selector(x [..., T, D], queries [B, H_q, T, D] | None) -> LongTensor [..., D]`` classes
Selector = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def rank_classes(scores: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Class of each element of ``scores [..., n]`` by rank: the ``counts[0]`` highest scores get
    class 0, the next ``counts[1]`` class 1, ...; ties go to the lower index (stable sort).

    Returns a LongTensor ``[..., n]``.  Raises ``ValueError`` if ``sum(counts) != n``.
    """
    n = scores.shape[-1]
    if sum(counts) != n or any(c < 0 for c in counts):
        raise ValueError(f"class counts {list(counts)} must be >= 0 and sum to {n}")
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    by_rank = torch.repeat_interleave(
        torch.arange(len(counts), device=scores.device), torch.tensor(counts, device=scores.device)
    ).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, by_rank)


def perm_from_classes(classes: torch.Tensor, n_classes: int) -> tuple[torch.Tensor, list[int]]:
    """Permutation sorting channels by class (stable: ascending channel order within a class)
    and the channels per class, which must be the same for every row.

    ``classes``: integer ``[..., D]`` in ``[0, n_classes)``.  Returns (LongTensor ``[..., D]``,
    counts).  Raises ``ValueError`` on out-of-range classes or unequal counts across rows.
    """
    c = classes.long()
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= n_classes):
        raise ValueError(f"channel classes must lie in [0, {n_classes}); got {c.unique().tolist()}")
    hist = torch.nn.functional.one_hot(c, n_classes).sum(-2).reshape(-1, n_classes)
    if hist.shape[0] and not bool((hist == hist[0]).all()):
        raise ValueError(
            "every (batch, head, page) must have the same number of channels per class"
        )
    counts = hist[0].tolist() if hist.shape[0] else [0] * n_classes
    return torch.sort(c, dim=-1, stable=True).indices, counts


def pack_mixed(codes: Sequence[torch.Tensor], bits: Sequence[int]) -> torch.Tensor:
    """Pack codes of several widths into one LSB-first bit stream per row.

    ``codes[c]``: integer ``[..., n_c]`` with values in ``[0, 2^bits[c])``.  Returns uint8
    ``[..., ceil(sum n_c*bits_c / 8)]``: code ``i`` of class ``c`` occupies ``bits[c]`` bits,
    least significant first, after all codes of the classes before it.  For one class this is
    exactly :func:`kvbench.cache.quant.pack_bits`.
    """
    pairs = [(c, b) for c, b in zip(codes, bits) if c.shape[-1]]
    if not pairs:
        return torch.zeros(*codes[0].shape[:-1], 0, dtype=torch.uint8, device=codes[0].device)
    if all(c.shape[-1] * b % 8 == 0 for c, b in pairs[:-1]):  # byte-aligned class boundaries
        return torch.cat([pack_bits(c, b) for c, b in pairs], dim=-1)
    planes = []
    for c, b in pairs:
        shifts = torch.arange(b, dtype=torch.uint8, device=c.device)
        planes.append(((c.to(torch.uint8).unsqueeze(-1) >> shifts) & 1).flatten(-2))
    return pack_bits(torch.cat(planes, dim=-1), 1)


def unpack_mixed(
    packed: torch.Tensor, bits: Sequence[int], counts: Sequence[int]
) -> list[torch.Tensor]:
    """Inverse of :func:`pack_mixed`: uint8 ``[..., bytes]`` -> ``[codes [..., n_c] per class]``
    (uint8; an empty class gives a ``[..., 0]`` tensor)."""
    lead = packed.shape[:-1]
    live = [(b, n) for b, n in zip(bits, counts) if n]
    aligned = all(n * b % 8 == 0 for b, n in live[:-1])
    stream = None if aligned else unpack_bits(packed, 1, sum(b * n for b, n in live))
    empty = torch.zeros(*lead, 0, dtype=torch.uint8, device=packed.device)
    out: list[torch.Tensor] = []
    off = 0
    for b, n in zip(bits, counts):
        if not n:
            out.append(empty)
        elif aligned:
            nbytes = (n * b + 7) // 8
            out.append(unpack_bits(packed[..., off : off + nbytes], b, n))
            off += nbytes
        else:
            seg = stream[..., off : off + n * b].reshape(*lead, n, b)
            code = seg[..., 0].clone()  # bit planes LSB first, assembled by shift-or in uint8
            for i in range(1, b):
                code |= seg[..., i] << i
            out.append(code)
            off += n * b
    return out


#: RoPE channel pairings: ``rotate-half`` pairs channel ``i`` with ``i + D/2`` (Llama's
#: ``rotate_half``), ``interleaved`` pairs ``2i`` with ``2i + 1`` (GPT-J)
PAIRINGS = ("rotate-half", "interleaved")


def pair_channels(head_dim: int, pairing: str = "rotate-half") -> torch.Tensor:
    """Channels of each RoPE pair: LongTensor ``[D/2, 2]``.  Raises ``ValueError`` for an odd
    ``head_dim`` or an unknown ``pairing``."""
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even: RoPE rotates channel pairs")
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not supported; allowed: {list(PAIRINGS)}")
    i = torch.arange(head_dim // 2)
    if pairing == "rotate-half":
        return torch.stack([i, i + head_dim // 2], dim=1)
    return torch.stack([2 * i, 2 * i + 1], dim=1)


def high_pairs(head_dim: int, high_ratio: float) -> int:
    """``n_H = floor(high_ratio * D/2)`` (with Kitty's 1e-6 float guard)."""
    return int(high_ratio * (head_dim // 2) + 1e-6)


CHANNEL_STATS = ("magnitude", "variance", "range", "absmax")


def channel_scores(x: torch.Tensor, stat: str) -> torch.Tensor:
    """Key statistic of each channel over the token axis: ``x [..., T, D]`` -> ``[..., D]``.

    ``magnitude``: mean |x|; ``variance``: population variance; ``range``: max - min;
    ``absmax``: max |x|.  Float32 (float64 for float64 input).  Raises ``ValueError`` for an
    unknown ``stat``.
    """
    xf = x.double() if x.dtype == torch.float64 else x.float()
    if stat == "magnitude":
        return xf.abs().mean(dim=-2)
    if stat == "variance":
        return xf.var(dim=-2, unbiased=False)
    if stat == "range":
        return xf.amax(dim=-2) - xf.amin(dim=-2)
    if stat == "absmax":
        return xf.abs().amax(dim=-2)
    raise ValueError(f"channel statistic {stat!r} is not supported; allowed: {list(CHANNEL_STATS)}")


def _perm_dtype(d: int) -> torch.dtype:
    return torch.uint8 if d <= 256 else torch.int16


def mixed_layout(
    class_bits: Sequence[int],
    class_counts: Sequence[int],
    group_size: int,
    scale_dtype: torch.dtype | str,
    per_page: bool,
) -> BlockLayout:
    """Layout of a :class:`MixedChannelBlock`: ``class_counts[c]`` channels at
    ``class_bits[c]`` bits (one LSB-first stream per token), a (scale, zero) per channel per
    page of ``group_size`` tokens, and the class permutation (per page or fixed) when more than
    one class is non-empty."""
    d = sum(class_counts)
    classes = tuple(CodeClass(b, n) for b, n in zip(class_bits, class_counts))
    live = sum(1 for n in class_counts if n)
    perm = None
    if live > 1:
        perm = Permutation(dtype_name(_perm_dtype(d)), per_page, group_size)
    return BlockLayout(
        Codes(d, classes),
        GroupTerms(("scale", "zero"), dtype_name(scale_dtype), group_size, 1),
        permutation=perm,
        page_len=group_size,
    )


# --------------------------------------------------------------------------------------------
# block
# --------------------------------------------------------------------------------------------


@dataclass
class MixedChannelBlock:
    """Per-channel codes of a run of pages with channel classes at different widths.

    Attributes
    ----------
    codes : uint8 ``[B, H_kv, n, ceil(sum_c n_c*b_c / 8)]`` (:func:`pack_mixed`, class-sorted).
    scale, zero : ``[B, H_kv, NG, D]`` in the scale dtype, class-sorted channel order.
    perm : uint8/int16 ``[B|1, H_kv, NG, D]`` (``per_page``) or ``[B|1, H_kv, 1, D]`` (fixed),
        the original channel at each class-sorted position; ``None`` for the identity.
    group_len : tokens of each of the NG pages (sums to ``n``; a cropped page is shorter).
    class_bits, class_counts : code width and channels of each class.
    midpoint : 1-bit classes use the midpoint reconstruction.
    per_page : ``perm`` holds one permutation per page (else one fixed for all pages).
    perm_shared : ``perm`` (batch 1) is shared by every batch row (a calibrated assignment).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    perm: torch.Tensor | None
    group_len: list[int]
    class_bits: tuple[int, ...]
    class_counts: tuple[int, ...]
    head_dim: int
    midpoint: bool = False
    per_page: bool = False
    perm_shared: bool = False

    @property
    def ntokens(self) -> int:
        return self.codes.shape[2]

    @property
    def layout(self) -> BlockLayout:
        """What this block stores (:func:`mixed_layout`; page length ``max(group_len)``)."""
        return mixed_layout(
            self.class_bits, self.class_counts, max(self.group_len, default=1),
            self.scale.dtype, self.per_page,
        )  # fmt: skip

    def _token_perm(self) -> torch.Tensor:
        """``perm`` per token: LongTensor ``[B, H, n, D]``."""
        b, h, n, _ = self.codes.shape
        p = expand_groups(self.perm, self.group_len) if self.per_page else self.perm
        return p.long().expand(b, h, n, self.head_dim)

    def unpacked_codes(self) -> torch.Tensor:
        """Codes ``[B, H_kv, n, D]`` (int64) in the original channel order."""
        parts = unpack_mixed(self.codes, self.class_bits, self.class_counts)
        cp = torch.cat([p.long() for p in parts], dim=-1)
        if self.perm is None:
            return cp
        return torch.empty_like(cp).scatter_(-1, self._token_perm(), cp)

    def channel_bits(self) -> torch.Tensor:
        """Code width of each original channel: LongTensor ``[B|1, H_kv, NG|1, D]``."""
        sorted_bits = torch.repeat_interleave(
            torch.tensor(self.class_bits), torch.tensor(self.class_counts)
        )
        if self.perm is None:
            return sorted_bits.view(1, 1, 1, -1)
        p = self.perm.long()
        return torch.empty_like(p).scatter_(-1, p, sorted_bits.expand_as(p))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Keys ``[B, H_kv, n, D]`` in ``dtype``, original channel order (math in float32)."""
        parts = unpack_mixed(self.codes, self.class_bits, self.class_counts)
        s = expand_groups(self.scale.float(), self.group_len)
        z = expand_groups(self.zero.float(), self.group_len)
        out, off = [], 0
        for c, bits, cnt in zip(parts, self.class_bits, self.class_counts):
            if cnt:
                sl = slice(off, off + cnt)
                mid = self.midpoint and bits == 1
                out.append(dequantize_groups(c, s[..., sl], z[..., sl], bits, midpoint=mid))
                off += cnt
        xp = torch.cat(out, dim=-1)
        if self.perm is not None:
            xp = torch.empty_like(xp).scatter_(-1, self._token_perm(), xp)
        return xp.to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [("codes", self.codes), ("scales", self.scale), ("scales", self.zero)]
        return out if self.perm is None else [*out, ("metadata", self.perm)]

    def _layout(self) -> tuple:
        return (self.class_bits, self.class_counts, self.head_dim, self.midpoint,
                self.per_page, self.scale.dtype)  # fmt: skip

    def cat(self, other: MixedChannelBlock) -> MixedChannelBlock:
        """Append ``other``'s tokens.  Raises ``ValueError`` if the class layout differs or,
        for a fixed assignment, the two blocks were made with different assignments."""
        if not isinstance(other, MixedChannelBlock) or other._layout() != self._layout():
            raise ValueError("cannot concatenate mixed blocks of different class layouts")
        perm = self.perm
        if self.per_page and perm is not None:
            perm = torch.cat([self.perm, other.perm], dim=2)
        elif perm is not None and other.perm is not perm:
            if other.perm.shape != perm.shape or not torch.equal(other.perm, perm):
                raise ValueError("cannot concatenate blocks made with different channel classes")
        return replace(
            self,
            codes=torch.cat([self.codes, other.codes], dim=2),
            scale=torch.cat([self.scale, other.scale], dim=2),
            zero=torch.cat([self.zero, other.zero], dim=2),
            perm=perm,
            group_len=self.group_len + other.group_len,
        )

    def crop(self, n: int) -> MixedChannelBlock:
        """Keep the first ``n`` tokens; a page cut in two keeps its scale, zero and perm."""
        lens = crop_groups(self.group_len, n)
        k = len(lens)
        perm = self.perm
        if self.per_page and perm is not None:
            perm = own_storage(perm[:, :, :k])
        return replace(
            self,
            codes=own_storage(self.codes[:, :, :n]),
            scale=own_storage(self.scale[:, :, :k]),
            zero=own_storage(self.zero[:, :, :k]),
            perm=perm,
            group_len=lens,
        )

    def index_batch(self, idx: torch.Tensor) -> MixedChannelBlock:
        """Keep/reorder batch rows ``idx`` (``repeat_batch`` of a B == 1 block included); a
        ``perm_shared`` permutation stays as it is."""
        idx = idx.to(self.codes.device)
        perm = self.perm
        if perm is not None and not self.perm_shared:
            perm = perm.index_select(0, idx)
        return replace(
            self,
            codes=self.codes.index_select(0, idx),
            scale=self.scale.index_select(0, idx),
            zero=self.zero.index_select(0, idx),
            perm=perm,
        )


# --------------------------------------------------------------------------------------------
# codec
# --------------------------------------------------------------------------------------------


class MixedChannelCodec:
    """Encodes pages of ``group_size`` tokens into :class:`MixedChannelBlock`.

    Parameters
    ----------
    class_bits : code width of each class (1..8), class 0 first.
    selector : ``selector(x, queries) -> LongTensor`` class of each channel (see ``Selector``).
        ``per_page=True``: called by :meth:`encode` with each flush's pages
        ``[B, H_kv, NP, G, D]`` (``queries=None``) and returns ``[B, H_kv, NP, D]`` (Kitty).
        ``per_page=False``: called once by :meth:`prepare` with the prefill keys
        ``[B, H_kv, P, D]`` and queries ``[B, H_q, P, D]`` (or ``None``) and returns
        ``[B, H_kv, D]``; the assignment is then fixed for the whole generation (PN-Mix).
    group_size : G, tokens per page; a flush must hand a multiple of it.
    scale_dtype : storage dtype of scale and zero (float16, bfloat16, float32, float8_e4m3fn).
    midpoint : 1-bit classes use the midpoint reconstruction.
    per_page : see ``selector``.
    classes : a fixed assignment ``[B|1, H_kv, D]`` given up front (calibrated ChanMix); then
        ``selector`` may be ``None`` and :meth:`prepare` keeps it.
    class_counts : channels of each class when the config fixes them (Kitty, PN-Mix, ChanMix):
        :meth:`layout` needs them before any selection, and a selection with other counts
        raises ``ValueError``.

    Every row (batch, head, page) must assign the same number of channels to each class.
    """

    def __init__(
        self,
        class_bits: Sequence[int],
        selector: Selector | None = None,
        *,
        group_size: int = 128,
        scale_dtype: torch.dtype = torch.float16,
        midpoint: bool = False,
        per_page: bool = False,
        classes: torch.Tensor | None = None,
        class_counts: Sequence[int] | None = None,
    ) -> None:
        if not class_bits:
            raise ValueError("class_bits must name at least one class")
        for i, b in enumerate(class_bits):
            if check_bits(b, f"class_bits[{i}]") == 16:
                raise ValueError(f"class_bits[{i}]=16 is not supported; allowed: 1..8")
        if selector is None and classes is None:
            raise ValueError("MixedChannelCodec needs a selector or fixed classes")
        if per_page and selector is None:
            raise ValueError("per_page=True needs a selector")
        self.class_bits = tuple(class_bits)
        self.selector = selector
        self.group_size = self.token_group = group_size
        self.scale_dtype = scale_dtype
        self.midpoint = midpoint
        self.per_page = per_page
        self.perm: torch.Tensor | None = None  # fixed assignment, [B|1, H, D]
        self.class_counts: tuple[int, ...] | None = None
        self.expected_counts = None if class_counts is None else tuple(class_counts)
        if self.expected_counts is not None and len(self.expected_counts) != len(class_bits):
            raise ValueError(
                f"class_counts {list(class_counts)} must give one count per class of "
                f"class_bits {list(class_bits)}"
            )
        self.perm_shared = False
        if classes is not None:
            self.set_classes(classes, shared=classes.dim() == 3 and classes.shape[0] == 1)

    def set_classes(self, classes: torch.Tensor, shared: bool = False) -> None:
        """Fix the class of each channel, ``[B|1, H_kv, D]``, for every later page.

        ``shared``: a batch-1 assignment used by every batch row (not reindexed by
        :meth:`index_batch`); otherwise it is per sequence."""
        if classes.dim() != 3:
            raise ValueError(f"fixed classes must be [B, H_kv, D]; got {tuple(classes.shape)}")
        perm, counts = perm_from_classes(classes, len(self.class_bits))
        self._check_counts(counts)
        self.class_counts = tuple(counts)
        self.perm_shared = shared
        live = sum(1 for c in counts if c)
        self.perm = None if live <= 1 else perm.to(_perm_dtype(classes.shape[-1])).unsqueeze(2)

    def _check_counts(self, counts: Sequence[int]) -> None:
        if self.expected_counts is not None and tuple(counts) != self.expected_counts:
            raise ValueError(
                f"channel classes hold {list(counts)} channels per class; the codec was "
                f"configured for class_counts {list(self.expected_counts)}"
            )

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        """The layout of the blocks :meth:`encode` makes (:func:`mixed_layout`).  Raises
        ``ValueError`` when the class counts are neither configured nor selected yet, or do not
        sum to ``head_dim``."""
        counts = self.expected_counts or self.class_counts
        if counts is None:
            raise ValueError(
                "the channel classes are chosen at prefill; give class_counts to know the "
                "layout before"
            )
        if sum(counts) != head_dim:
            raise ValueError(f"class_counts {list(counts)} do not sum to head_dim={head_dim}")
        return mixed_layout(
            self.class_bits, counts, self.group_size, self.scale_dtype, self.per_page
        )

    @property
    def classes(self) -> torch.Tensor | None:
        """The fixed assignment as classes ``[B|1, H_kv, D]`` (``None`` before :meth:`prepare`
        or for per-page selection).  With one non-empty class: ``[1, 1, D]``."""
        if self.per_page or self.class_counts is None:
            return None
        by_pos = torch.repeat_interleave(
            torch.arange(len(self.class_counts)), torch.tensor(self.class_counts)
        )
        if self.perm is None:
            return by_pos.view(1, 1, -1)
        p = self.perm[:, :, 0].long()
        return torch.empty_like(p).scatter_(-1, p, by_pos.expand_as(p))

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        """Select the fixed assignment from the prefill (no-op for per-page selection or a
        given assignment without selector)."""
        if self.per_page or self.selector is None:
            return
        self.set_classes(self.selector(keys, queries))

    def index_batch(self, idx: torch.Tensor) -> None:
        """Reorder the per-sequence fixed assignment with the cache (beam search, batch
        repeat); an assignment given up front is shared by all rows and stays."""
        if self.perm is not None and not self.perm_shared:
            self.perm = self.perm.index_select(0, idx.to(self.perm.device))

    def encode(self, x: torch.Tensor) -> MixedChannelBlock:
        """Quantize ``x [B, H_kv, n, D]`` (``n`` a multiple of G) into a block.

        Raises ``ValueError`` if ``n % G``, if a fixed assignment is missing (no prefill) or
        does not fit ``x``'s shape, or if a scale/zero overflows the scale dtype."""
        b, h, n, d = x.shape
        g = self.group_size
        if n % g:
            raise ValueError(
                f"per-channel groups need a multiple of group_size={g} tokens, got {n}"
            )
        pages = x.reshape(b, h, n // g, g, d)
        if self.per_page:
            perm, counts = perm_from_classes(self.selector(pages, None), len(self.class_bits))
            self._check_counts(counts)
            live = sum(1 for c in counts if c)
            perm = None if live <= 1 else perm.to(_perm_dtype(d))
        else:
            if self.class_counts is None:
                raise ValueError(
                    "the channel classes are chosen at prefill: call prefill() (or "
                    "set_classes()) before quantizing tokens"
                )
            perm, counts = self.perm, list(self.class_counts)
            rows = 1 if self.perm_shared else b
            if perm is not None and (perm.shape[0], perm.shape[1], perm.shape[3]) != (rows, h, d):
                raise ValueError(
                    f"channel classes [B, H_kv, D] = {(perm.shape[0], perm.shape[1], perm.shape[3])}"
                    f" do not fit keys [B, H_kv, n, D] = {tuple(x.shape)}"
                )
        xp = pages
        if perm is not None:
            idx = perm.long().unsqueeze(3).expand(b, h, n // g, g, d)
            xp = pages.gather(-1, idx)
        codes, scales, zeros, off = [], [], [], 0
        for bits, cnt in zip(self.class_bits, counts):
            seg = xp[..., off : off + cnt].transpose(-1, -2)  # [B, H, NP, n_c, G]
            off += cnt
            if not cnt:
                codes.append(torch.zeros(b, h, n, 0, dtype=torch.int32, device=x.device))
                continue
            mid = self.midpoint and bits == 1
            got = quantize_pack(  # native one-pass (kvbench.cache.native_quant), same codes
                xp.reshape(b, h, n, d)[..., off - cnt : off], bits, g, 1, midpoint=mid,
                scale_dtype=self.scale_dtype, packed=False,
            )  # fmt: skip
            if got is not None:
                codes.append(got[0])
                scales.append(got[1])
                zeros.append(got[2])
                continue
            q = quantize_groups(seg, bits, midpoint=mid, scale_dtype=self.scale_dtype)
            codes.append(q.codes.transpose(-1, -2).reshape(b, h, n, cnt))
            scales.append(q.scale.squeeze(-1))
            zeros.append(q.zero.squeeze(-1))
        return MixedChannelBlock(
            codes=pack_mixed(codes, self.class_bits),
            scale=torch.cat(scales, dim=-1),
            zero=torch.cat(zeros, dim=-1),
            perm=perm,
            group_len=[g] * (n // g),
            class_bits=self.class_bits,
            class_counts=tuple(counts),
            head_dim=d,
            midpoint=self.midpoint,
            per_page=self.per_page,
            perm_shared=self.perm_shared and not self.per_page,
        )
