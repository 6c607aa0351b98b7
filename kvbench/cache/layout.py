"""Typed, frozen descriptions of what a stored block holds, and the bit accounting derived from
them (docs/methods.md#average-bits, docs/design.md#stored-layouts).

Every codec returns a :class:`BlockLayout` from ``layout(head_dim)`` and every block reports its
own from its ``layout`` property; a method's nominal bits (``kvbench bits``, PN-Mix Table 10) are
:func:`bit_terms` of its key and value layouts, computed here and nowhere else.  What each part
of a layout describes, and how it counts in the formula ``b_eff + m_q / G + m_sal`` (PN-Mix
Table 10 [RECON]; terms held once per head or layer count 0), is the table of
docs/design.md#stored-layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: storage bits of one element by dtype name (``bit``: a packed 1-bit flag)
DTYPE_BITS = {
    "bit": 1,
    "uint8": 8,
    "int8": 8,
    "int16": 16,
    "int32": 32,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "float8_e4m3fnuz": 8,
    "float8_e5m2fnuz": 8,
    "float16": 16,
    "bfloat16": 16,
    "float32": 32,
}

#: how code slots are stored: ``lsb-first`` bit stream per token (:func:`kvbench.cache.quant.pack_bits`,
#: :func:`kvbench.cache.mixed_channel.pack_mixed`), ``int16`` one int16 per 16-bit code, ``float8_e4m3fn`` /
#: ``float16`` / ``bfloat16`` / ``float32`` raw floats, ``int8`` signed bytes, ``sign`` packed
#: sign bits of a sketch, ``index`` codebook indices (LSB-first)
PACKINGS = ("lsb-first", "int16", "int8", "sign", "index", "float8_e4m3fn", "float8_e5m2",
            "float8_e4m3fnuz", "float8_e5m2fnuz", "float16", "bfloat16", "float32")  # fmt: skip


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float16`` -> ``"float16"``; a name is checked against :data:`DTYPE_BITS`.

    Raises ``ValueError`` for a dtype without a storage width here."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_BITS:
        raise ValueError(f"dtype {dtype!r} has no storage width; allowed: {sorted(DTYPE_BITS)}")
    return name


def _positive(value: object, name: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")


@dataclass(frozen=True)
class CodeClass:
    """``slots`` codes of ``bits`` bits per token (channels, RoPE pairs, sketch dimensions),
    for ``token_share`` of the tokens (1: every token; SemKV's high plane: the high share)."""

    bits: int
    slots: int
    token_share: float = 1.0

    def __post_init__(self) -> None:
        _positive(self.bits, "bits")
        _positive(self.slots, "slots", 0)
        if not 0.0 <= self.token_share <= 1.0:
            raise ValueError(f"token_share={self.token_share!r} must lie in [0, 1]")


@dataclass(frozen=True)
class Codes:
    """The codes of one token: ``classes`` over ``head_dim`` channels, stored as ``packing``."""

    head_dim: int
    classes: tuple[CodeClass, ...]
    packing: str = "lsb-first"

    def __post_init__(self) -> None:
        _positive(self.head_dim, "head_dim")
        if not self.classes:
            raise ValueError("Codes needs at least one CodeClass")
        if self.packing not in PACKINGS:
            raise ValueError(f"packing={self.packing!r}; allowed: {list(PACKINGS)}")

    @classmethod
    def uniform(cls, bits: int, head_dim: int, packing: str = "lsb-first") -> Codes:
        """``bits`` bits for each of ``head_dim`` channels of every token."""
        return cls(head_dim, (CodeClass(bits, head_dim),), packing)

    @property
    def bits_per_element(self) -> float:
        """Average code bits per element, ``sum(bits * slots * token_share) / head_dim``."""
        if len(self.classes) == 1:
            c = self.classes[0]
            if c.slots == self.head_dim and c.token_share == 1.0:
                return c.bits
        return sum(c.bits * c.slots * c.token_share for c in self.classes) / self.head_dim


@dataclass(frozen=True)
class GroupTerms:
    """Per-group stored terms: ``count`` of each of ``names`` in ``dtype`` for every rectangle
    of ``tokens`` consecutive tokens x ``channels`` consecutive channels.

    KIVI per-channel keys: ``("scale", "zero")``, ``tokens=G``, ``channels=1``; KIVI per-token
    values: ``tokens=1``, ``channels=value_group_size``; a per-flush scale: ``tokens`` = the
    flush length R, ``channels=head_dim``."""

    names: tuple[str, ...]
    dtype: str
    tokens: int
    channels: int
    count: int = 1

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("GroupTerms needs at least one name")
        dtype_name(self.dtype)
        _positive(self.tokens, "tokens")
        _positive(self.channels, "channels")
        _positive(self.count, "count")

    @property
    def bits(self) -> int:
        """Bits stored per group."""
        return len(self.names) * self.count * DTYPE_BITS[self.dtype]

    @property
    def elements(self) -> int:
        """Elements (tokens x channels) one group covers."""
        return self.tokens * self.channels

    @property
    def axis(self) -> str:
        """``per-token`` (one token per group), else ``per-channel`` (groups span tokens)."""
        return "per-token" if self.tokens == 1 else "per-channel"


@dataclass(frozen=True)
class Permutation:
    """Channel order sorting channels by class: one ``index_dtype`` index per channel, per page
    of ``page_len`` tokens (``per_page``, Kitty) or once per (row, head) (PN-Mix, ChanMix)."""

    index_dtype: str
    per_page: bool
    page_len: int

    def __post_init__(self) -> None:
        dtype_name(self.index_dtype)
        _positive(self.page_len, "page_len")

    @property
    def bits_per_element(self) -> float:
        """``index bits / page_len`` per page; 0.0 when fixed (held once, amortized)."""
        return DTYPE_BITS[self.index_dtype] / self.page_len if self.per_page else 0.0


@dataclass(frozen=True)
class SparseOutliers:
    """``fraction`` of the elements stored apart as a ``value_dtype`` value and an
    ``index_dtype`` position each (KVQuant's dense-and-sparse split)."""

    fraction: float
    value_dtype: str
    index_dtype: str

    def __post_init__(self) -> None:
        dtype_name(self.value_dtype)
        dtype_name(self.index_dtype)
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction={self.fraction!r} must lie in [0, 1]")

    @property
    def bits_per_element(self) -> float:
        return self.fraction * (DTYPE_BITS[self.value_dtype] + DTYPE_BITS[self.index_dtype])


@dataclass(frozen=True)
class Projection:
    """A linear map applied to each token before quantizing (``kind``: ``random-orthogonal``,
    ``gaussian-sketch``, ``polar``, ``rope-unrotate``), ``in_dim`` -> ``out_dim``; held once
    per layer or regenerated from a seed, so it adds no bits per element."""

    kind: str
    in_dim: int
    out_dim: int


@dataclass(frozen=True)
class Codebook:
    """Reconstruction levels of non-uniform codes: ``entries`` levels in ``dtype``, one table
    per ``scope`` (``shared``, ``channel``, ``head``); held once, adds no bits per element."""

    entries: int
    dtype: str
    scope: str = "shared"


@dataclass(frozen=True)
class BlockLayout:
    """What one stored block holds per token (see the module docstring).

    ``page_len``: tokens per group along the token axis (G for KIVI-sense per-channel pages,
    1 for per-token storage, the flush length when a group is one whole flush)."""

    codes: Codes
    terms: GroupTerms | None = None
    metadata: tuple[GroupTerms, ...] = ()
    permutation: Permutation | None = None
    outliers: SparseOutliers | None = None
    projection: Projection | None = None
    codebook: Codebook | None = None
    page_len: int = 1

    @classmethod
    def full_precision(cls, head_dim: int, dtype: str = "float16") -> BlockLayout:
        """Unquantized storage (counted at 16 bits, the paper's convention)."""
        return cls(Codes.uniform(DTYPE_BITS[dtype_name(dtype)], head_dim, dtype))


@dataclass(frozen=True)
class BitTerms:
    """Terms of the nominal average-bits formula (docs/methods.md#average-bits): code bits
    ``b_eff``, ``m_q`` bits per group of ``group`` elements, ``m_sal`` bits per element."""

    b_eff: float
    m_q: float
    group: float
    m_sal: float

    def to_dict(self) -> dict[str, float]:
        return {"b_eff": self.b_eff, "m_q": self.m_q, "group": self.group, "m_sal": self.m_sal}


def bit_terms(layout: BlockLayout) -> BitTerms:
    """The formula's terms of ``layout``: ``b_eff`` = code bits per element; ``m_q``/``group``
    = the quantizer's group terms (0/1 without); ``m_sal`` = per-page permutation indices +
    metadata terms + sparse outliers, per element."""
    t = layout.terms
    m_q, group = (0, 1) if t is None else (t.bits, t.elements)
    parts: list[float] = []
    if layout.permutation is not None:
        parts.append(layout.permutation.bits_per_element)
    parts += [m.bits / m.elements for m in layout.metadata]
    if layout.outliers is not None:
        parts.append(layout.outliers.bits_per_element)
    return BitTerms(layout.codes.bits_per_element, m_q, group, sum(parts, 0))


def average_bits(
    b_eff: float, m_q: float, group: float, n_sink: int, tokens: int, m_sal: float = 0.0
) -> float:
    """Nominal average bits per element (docs/methods.md#average-bits, PN-Mix Table 10 [RECON])::

        (N_s * 16 + T_q * (b_eff + m_q / G + m_sal)) / (T_q + N_s)

    ``b_eff``: average code bits; ``m_q``: bits of (scale, zero) per group; ``group``: elements
    per group; ``m_sal``: saliency metadata bits per element; ``tokens``: quantized tokens T_q
    (the full-precision residual is excluded; sinks count at 16 bits).
    """
    per = b_eff + m_q / group + m_sal
    return (n_sink * 16 + tokens * per) / (tokens + n_sink)


def layout_bits(layout: BlockLayout, n_sink: int = 0, tokens: int = 32768) -> float:
    """Nominal bits per element of ``layout`` (:func:`average_bits` of :func:`bit_terms`)."""
    t = bit_terms(layout)
    return average_bits(t.b_eff, t.m_q, t.group, n_sink, tokens, t.m_sal)
