"""``fp8``: a float8 KV cache as serving engines store it.

Sources: vLLM ``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (per-tensor ``k_scale`` /
``v_scale``, 1.0 when uncalibrated; vllm-project/vllm#41343, PR#2279, PR#3234), TensorRT-LLM's
FP8 KV cache (per-tensor scale, 1.0 without calibration); formats from Micikevicius et al.,
"FP8 Formats for Deep Learning", arXiv 2209.05433, Table 1 (E4M3 max 448, E5M2 max 57344).
docs/methods.md#transformers-peers; fp16 scale underflow to a subnormal, reciprocal overflow, 0*inf = NaN: pytorch/ao#1766 (PR#1770), docs/methods.md#half-precision-scale-underflow-and-reciprocal-overflow; large outlier channel vs per-tensor fp8 with default scale 1.0: vllm-project/vllm#41343 (and PR#2279 review), docs/methods.md#large-outlier-channel-with-per-tensor-fp8-and-unit-scale; uint8 buffer holding fp8 bits must be reinterpreted, not value-cast: vllm-project/vllm PR#3234 (fixes #3156), docs/methods.md#uint8-storage-reinterpreted-as-fp8; fp8 rounding (RTNE) and inf handling: triton-lang/triton#5925 (+ #5927, PR#11753), docs/methods.md#fp8-rounding-and-infinity-handling; negative zero and tiny negatives in FNUZ fp8 formats: triton-lang/triton PR#3997, docs/methods.md#negative-zero-and-tiny-negatives-in-fnuz-formats.

Storage: every key and value element is one byte of a torch float8 dtype (``format``:
``e4m3fn``, ``e5m2``, or AMD's ``e4m3fnuz`` / ``e5m2fnuz``), plus, with ``scale="amax"``, one
scale per granule in ``scale_dtype`` (float32 by default, as engines keep ``k_scale``):

* ``per-tensor``: one scale per flush, shared by all batch rows and heads (the engines' layout);
* ``per-head``: one scale per (batch row, KV head) per flush;
* ``per-token``: one scale per (batch row, KV head, token) over head_dim.

``scale="unit"`` stores no scale at all (1.0, the engines' uncalibrated default) and makes the
granularity irrelevant.  ``scale="amax"`` uses ``s = amax / fp8_max`` per granule, computed in
float32 over the granule's finite values and rounded *up* to ``scale_dtype`` (so ``|x / s|``
never exceeds the format's max); an all-zero granule stores 1.0.  Codes are ``fp8(x / s)``
rounded to nearest even by torch's cast; reads are ``fp8 -> float32 * s``.  A uint8 buffer of fp8
bits is decoded by reinterpreting storage (``.view``), never by a value cast (uint8 buffer holding fp8 bits must be reinterpreted, not value-cast: vllm-project/vllm PR#3234 (fixes #3156), docs/methods.md#uint8-storage-reinterpreted-as-fp8).

Non-finite and out-of-range inputs (the behaviour chosen here, tested): with
``overflow="saturate"`` (default) a finite value beyond ``+-fp8_max * s`` and ``+-inf`` are
clamped to ``+-fp8_max`` (``satfinite``, as vLLM's and TensorRT-LLM's casts do) and a
``RuntimeWarning`` gives the count; with ``overflow="raise"`` a ``ValueError`` is raised instead.
NaN stays NaN in both modes (it never becomes a finite code).  In ``*fnuz`` formats ``-0.0`` and
tiny negatives that round to zero are stored as ``+0`` (byte 0x00; 0x80 is NaN there).

Windows: ``residual_length`` (R, default 0: engines quantize every token on write) and
``num_sink_tokens``.  Per-token or unit scales use a sliding window of R newest full-precision
tokens; per-head / per-tensor scales flush blocks of R tokens (with R = 0 each arriving chunk is
quantized at once, so the prompt gets one scale and each decode token its own).  Nominal bits
``8 + m_s / g`` with ``m_s`` the scale bits (0 for unit) and ``g`` the elements per scale:
head_dim (per-token) or ``max(R, 1) * head_dim`` per head (per-head; per-tensor shares that
scale across heads as well, so its true overhead is lower).

The stored block, :class:`FP8Block` (formats :data:`FORMATS`: Micikevicius et al., arXiv
2209.05433, Table 1), is defined here; ``kvbench.kernels.cpu.fp8`` reads it in the code domain.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from dataclasses import dataclass, replace

import torch

from kvbench import fields as kf
from kvbench.cache.blocks import own_storage
from kvbench.cache.chunks import token_chunks
from kvbench.cache.finite import all_finite
from kvbench.cache.layout import BlockLayout, Codes, GroupTerms, dtype_name
from kvbench.cache.method import Capabilities, Method, MethodConfig
from kvbench.cache.quant import round_up_to_dtype
from kvbench.cache.schedule import BlockSchedule, SlidingSchedule

FORMATS = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
}


def fp8_decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Float32 values of stored fp8 codes ``[...]``.

    ``codes`` is a tensor of ``FORMATS[fmt]`` or a uint8 buffer holding fp8 bit patterns; the
    buffer is reinterpreted with ``.view`` (bytes 0x3C, 0xC0, 0x38, 0x00 in e5m2 are
    [1, -2, 0.5, 0]), never value-cast (uint8 buffer holding fp8 bits must be reinterpreted, not value-cast: vllm-project/vllm PR#3234 (fixes #3156), docs/methods.md#uint8-storage-reinterpreted-as-fp8).  Raises ``ValueError`` for any other dtype.
    """
    dt = FORMATS[fmt]
    if codes.dtype == torch.uint8:
        codes = codes.view(dt)
    elif codes.dtype != dt:
        raise ValueError(f"fp8 {fmt} codes must be {dt} or uint8 bits, got {codes.dtype}")
    return codes.float()


def expand_groups(t: torch.Tensor, group_len: list[int]) -> torch.Tensor:
    """Per-group scales ``[., ., NG, 1]`` -> per token ``[., ., n, 1]``."""
    if all(g == 1 for g in group_len):
        return t
    return t.repeat_interleave(torch.tensor(group_len, device=t.device), dim=2)


@dataclass
class FP8Block:
    """fp8 codes of a run of tokens.

    Attributes
    ----------
    codes : ``[B, H_kv, n, D]`` of ``FORMATS[fmt]`` (or uint8 fp8 bits), 1 byte per element.
    scale : ``[B|1, H_kv|1, NG, 1]`` float32/float16, or ``None`` for unit scale.
    group_len : tokens covered by each of the NG scale groups (sums to ``n``).
    fmt : format name, a key of :data:`FORMATS`.
    batch_shared : the scale is shared by every batch row (per-tensor).
    """

    codes: torch.Tensor
    scale: torch.Tensor | None
    group_len: list[int]
    fmt: str
    batch_shared: bool = False

    @property
    def ntokens(self) -> int:
        return self.codes.shape[2]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        x = fp8_decode(self.codes, self.fmt)
        if self.scale is not None:
            x = x * expand_groups(self.scale, self.group_len).float()
        return x.to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [("codes", self.codes)]
        return out if self.scale is None else [*out, ("scales", self.scale)]

    def cat(self, other: FP8Block) -> FP8Block:
        if other.fmt != self.fmt or (other.scale is None) != (self.scale is None):
            raise ValueError("cannot concatenate fp8 blocks of different formats or scale modes")
        scale = None if self.scale is None else torch.cat([self.scale, other.scale], dim=2)
        codes = torch.cat([self.codes, other.codes], dim=2)
        return replace(self, codes=codes, scale=scale, group_len=self.group_len + other.group_len)

    def crop(self, n: int) -> FP8Block:
        starts = itertools.accumulate(self.group_len, initial=0)
        lens = [min(g, n - s) for g, s in zip(self.group_len, starts) if s < n]
        scale = None if self.scale is None else own_storage(self.scale[:, :, : len(lens)])
        return replace(self, codes=own_storage(self.codes[:, :, :n]), scale=scale, group_len=lens)

    def index_batch(self, idx: torch.Tensor) -> FP8Block:
        codes = self.codes.index_select(0, idx.to(self.codes.device))
        scale = self.scale  # a per-tensor scale is shared by all rows; others follow the codes
        if scale is not None and not self.batch_shared:
            scale = scale.index_select(0, idx.to(scale.device))
        return replace(self, codes=codes, scale=scale)


GRANULARITIES = ("per-tensor", "per-head", "per-token")
SCALE_MODES = ("unit", "amax")
FP8_SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16}
OVERFLOW = ("saturate", "raise")


def fp8_max(fmt: str) -> float:
    """Largest finite value of format ``fmt`` (448, 57344, 240, 57344)."""
    return float(torch.finfo(FORMATS[fmt]).max)


def fp8_encode(y: torch.Tensor, fmt: str, overflow: str = "saturate") -> torch.Tensor:
    """Round ``y`` (any float dtype, already divided by its scale) to fp8 ``fmt``.

    Round-to-nearest-even (torch's cast); ``|y| > fp8_max`` and ``+-inf`` saturate to
    ``+-fp8_max`` with a ``RuntimeWarning`` (``overflow="saturate"``) or raise ``ValueError``
    (``overflow="raise"``); NaN stays NaN.  Returns a tensor of ``FORMATS[fmt]``, ``y``'s shape.
    """
    yf, n_over = _saturated(y.float(), fmt)
    _report_overflow(n_over, fmt, overflow)
    return yf.to(FORMATS[fmt])


def _saturated(yf: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int]:
    """``(yf clamped to +-fp8_max, how many elements were beyond it)``; NaN passes through."""
    top = fp8_max(fmt)
    n_over = int((yf.abs() > top).sum())
    return (yf.clamp(-top, top) if n_over else yf), n_over


def _report_overflow(n_over: int, fmt: str, overflow: str) -> None:
    """Raise (``overflow="raise"``) or warn about ``n_over`` saturated values (none: nothing)."""
    if not n_over:
        return
    top = fp8_max(fmt)
    if overflow == "raise":
        raise ValueError(
            f"{n_over} value(s) exceed the {fmt} range +-{top:g} after scaling "
            "(overflow='raise'); use scale='amax' or overflow='saturate'"
        )
    warnings.warn(
        f"fp8 {fmt}: {n_over} value(s) beyond +-{top:g} (or +-inf) saturated to +-{top:g}",
        RuntimeWarning,
        stacklevel=3,
    )


@dataclass
class FP8Codec:
    """Encodes ``[B, H_kv, n, D]`` tokens into an :class:`FP8Block` (see the module docstring).

    Raises ``ValueError`` when an amax scale overflows ``scale_dtype`` (use float32), or on
    overflow with ``overflow="raise"``.
    """

    fmt: str = "e4m3fn"
    scale_mode: str = "unit"
    granularity: str = "per-tensor"
    scale_dtype: torch.dtype = torch.float32
    overflow: str = "saturate"

    @property
    def token_group(self) -> int:
        whole_flush = self.scale_mode == "amax" and self.granularity != "per-token"
        return 0 if whole_flush else 1

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        return None

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        """One fp8 code per element; ``amax``: one scale per token (``per-token``) or per flush
        of ``flush_tokens`` tokens (``per-head`` / ``per-tensor``) in ``scale_dtype``."""
        fmt = dtype_name(FORMATS[self.fmt])
        codes = Codes.uniform(8, head_dim, fmt)
        if self.scale_mode == "unit":
            return BlockLayout(codes)
        tokens = 1 if self.granularity == "per-token" else max(flush_tokens, 1)
        terms = GroupTerms(("scale",), dtype_name(self.scale_dtype), tokens, head_dim)
        return BlockLayout(codes, terms, page_len=tokens)

    def encode(self, x: torch.Tensor) -> FP8Block:
        """``x [B, H_kv, n, D]`` (any float dtype) -> :class:`FP8Block`, chunk by chunk along T
        (:func:`~kvbench.cache.chunks.token_chunks`): an amax scale first takes the maximum over
        the chunks' maxima (exact: max is associative), then each chunk is divided by its
        scale and cast, so the codes and scales equal one pass's while the float32 working
        copies stay a chunk's (a whole pass makes several 1 GiB temporaries per side at
        batch 8 x 32K x 8 x 128).  Saturated values are counted over all chunks and reported
        once (warning or ``ValueError``, as :func:`fp8_encode`)."""
        b, h, n, d = x.shape
        spans = list(token_chunks(b, h, n, d)) or [(0, n)]
        s, lens = None, [1] * n
        if self.scale_mode != "unit":
            s, lens = self._scales(x, spans)
        codes = torch.empty(x.shape, dtype=FORMATS[self.fmt], device=x.device)
        over = 0
        for t0, t1 in spans:
            y = x[:, :, t0:t1].to(torch.float32, copy=True)  # in place below, never on x
            if s is not None:  # float32 division (fp16 scale underflow to a subnormal,
                # reciprocal overflow, 0*inf = NaN: pytorch/ao#1766 (PR#1770),
                # docs/methods.md#half-precision-scale-underflow-and-reciprocal-overflow)
                st = s[:, :, t0:t1] if self.granularity == "per-token" else s
                y = y.div_(st.float())
            y, k = _saturated(y, self.fmt)
            over += k
            codes[:, :, t0:t1] = y
        _report_overflow(over, self.fmt, self.overflow)
        shared = self.scale_mode != "unit" and self.granularity == "per-tensor"
        return FP8Block(codes, s, lens, self.fmt, shared)

    def _scales(self, x: torch.Tensor, spans: list[tuple[int, int]]):
        """``(s, group_len)``: ``amax / fp8_max`` per token ``[B, H, n, 1]``, per head
        ``[B, H, 1, 1]`` or per tensor ``[1, 1, 1, 1]``, stepped up one ulp where it fell below
        ``amax / fp8_max`` and rounded up to ``scale_dtype``; non-finite elements count as 0."""
        n = x.shape[2]
        finite = all_finite(x)
        maxima = []
        for t0, t1 in spans:
            a = x[:, :, t0:t1].to(torch.float32, copy=True).abs_()
            if not finite:
                a = torch.where(torch.isfinite(a), a, torch.zeros((), device=x.device))
            if self.granularity == "per-token":
                maxima.append(a.amax(dim=-1, keepdim=True))  # [B, H, chunk, 1]
            elif self.granularity == "per-head":
                maxima.append(a.amax(dim=(-1, -2), keepdim=True))  # [B, H, 1, 1]
            else:
                maxima.append(a.amax().reshape(1, 1, 1, 1))
        if self.granularity == "per-token":
            amax, lens = torch.cat(maxima, 2), [1] * n
        else:
            amax, lens = functools.reduce(torch.maximum, maxima), [n]
        top = fp8_max(self.fmt)
        s = amax / top  # float32; step up one ulp where it fell below amax / top
        s = torch.where(s.double() * top < amax.double(), torch.nextafter(s, s + 1), s)
        s = round_up_to_dtype(s, self.scale_dtype)
        if not bool(torch.isfinite(s).all()):
            raise ValueError(
                f"the fp8 scale amax/{top:g} overflows scale_dtype="
                f"{self.scale_dtype}; use scale_dtype='float32'"
            )
        return torch.where(s > 0, s, torch.ones((), dtype=s.dtype, device=s.device)), lens


@dataclass(frozen=True)
class FP8Config(MethodConfig):
    """Configuration of :class:`FP8`.

    Attributes
    ----------
    format : ``e4m3fn`` (default, max 448), ``e5m2`` (max 57344), ``e4m3fnuz`` (max 240),
        ``e5m2fnuz`` (max 57344).
    scale : ``unit`` (1.0, nothing stored; engines' uncalibrated default) or ``amax``.
    scale_granularity : ``per-tensor`` | ``per-head`` | ``per-token`` (used with ``amax``).
    scale_dtype : ``float32`` (default) or ``float16``.
    overflow : ``saturate`` (clamp to +-max with a warning) or ``raise``.
    residual_length : R full-precision newest tokens (default 0).
    num_sink_tokens : N_s first tokens kept in full precision (default 0).
    """

    format: str = kf.spec("e4m3fn", str, choices=tuple(FORMATS))
    scale: str = kf.spec("unit", str, choices=SCALE_MODES)
    scale_granularity: str = kf.spec("per-tensor", str, choices=GRANULARITIES)
    scale_dtype: str = kf.spec("float32", str, choices=tuple(FP8_SCALE_DTYPES))
    overflow: str = kf.spec("saturate", str, choices=OVERFLOW)
    residual_length: int = kf.spec(0, int, low=0)
    num_sink_tokens: int = kf.spec(0, int, low=0)


class FP8(Method):
    """float8 keys and values with unit or amax scales (vLLM / TensorRT-LLM FP8 KV cache)."""

    Config = FP8Config
    description = "float8 (e4m3fn / e5m2) K and V, unit or amax scale per tensor/head/token"
    source = "vLLM / TensorRT-LLM FP8 KV cache; Micikevicius et al. arXiv 2209.05433 Table 1"
    capabilities = Capabilities()

    def _codec(self) -> FP8Codec:
        c = self.config
        return FP8Codec(
            c.format, c.scale, c.scale_granularity, FP8_SCALE_DTYPES[c.scale_dtype], c.overflow
        )

    def key_codec(self, layer_idx: int, head_dim: int) -> FP8Codec:
        return self._codec()

    def value_codec(self, layer_idx: int, head_dim: int) -> FP8Codec:
        return self._codec()

    def key_schedule(self) -> object:
        r = self.config.residual_length
        return BlockSchedule(r) if self._codec().token_group == 0 else SlidingSchedule(r)

    value_schedule = key_schedule
