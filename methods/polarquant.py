"""``polarquant``: PolarQuant of Wu et al., "Leveraging Polar Transformation for Efficient Key
Cache Quantization and Decoding Acceleration" (arXiv 2502.00527), the variant PN-Mix compares
(Table 9 "Per-Channel after (r, θ)", Table 10 row "PolarQuant" = 2.25 bits, Table 3).  Not the
Google PolarQuant of Han et al. (arXiv 2502.02617); docs/methods.md#polarquant tells the two apart.

Each post-RoPE key is split into its RoPE 2-D sub-vectors ``(x, y)`` (the paper's idea, [SRC]
abstract).  The concrete quantizer is kvbench's reconstruction (docs/methods.md#polarquant), since the code was not to be
had [RECON, docs/methods.md#polarquant]:

* per pair and token ``r = hypot(x, y)`` and ``θ = atan2(y, x)`` in ``(-π, π]``;
* ``r`` and ``θ`` are each quantized per channel (per pair) with the asymmetric min-max quantizer
  over groups of ``group_size`` (G) tokens, ``radius_bits`` + ``angle_bits`` = 2 + 2 by default
  (the paper's own n/m may differ, e.g. 4 + 4), with a (scale, zero) per group for each;
* dequantization ``x^ = r^ cos θ^``, ``y^ = r^ sin θ^``;
* KIVI's key schedule with ``residual_length`` (R) = 128, no sinks; values by the core's default
  (``value_bits``: 16 = full precision, else KIVI per-token values).

Configurable choices the paper leaves open (all [RECON]):

* ``pairing``: ``"rotate_half"`` (default; channels (i, i + D/2), HF Llama/Qwen) or
  ``"interleaved"`` (channels (2i, 2i + 1), GPT-J / Meta-original layout).
* ``angle_wrap``: ``"minmax"`` (default; plain min-max over θ, ignoring that θ is circular, as
  kvbench's reconstruction (docs/methods.md#polarquant, angle_wrap) and Example 15 computes) or ``"circular"``: each group's angles are
  unwrapped so that the group's largest circular gap straddles the cut (angles below the first
  angle after that gap get + 2π) before the min-max; the stored zero then carries that offset.
  A group whose angles straddle ±π then spans its true arc instead of nearly 2π.  No extra
  metadata: dequantization is the same ``code * scale + zero`` and cos/sin absorb the 2π.

Nominal key bits (docs/methods.md#average-bits): ``(radius_bits + angle_bits) / 2 + 32 / G`` with fp16 scales, as
each pair's 2G elements per group carry two fp16 (scale, zero) pairs: 2 + 0.25 = 2.25 at the
defaults.

The stored key block, :class:`PolarBlock` (each RoPE pair as a quantized radius and angle), is
defined here; ``kvbench.kernels.cpu.polar`` reads it in the code domain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from kvbench import fields as kf
from kvbench.cache.blocks import AffineBlock, Codec, PerChannelCodec
from kvbench.cache.layout import BlockLayout, CodeClass, Codes, GroupTerms, Projection, dtype_name
from kvbench.cache.method import CacheConfig, Capabilities, Method

PAIRINGS = ("rotate_half", "interleaved")


def check_pairing(head_dim: int, pairing: str) -> None:
    """Raise ``ValueError`` unless ``head_dim`` is even and ``pairing`` is in :data:`PAIRINGS`."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not supported; allowed: {list(PAIRINGS)}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even to form RoPE pairs")


def split_pairs(x: torch.Tensor, pairing: str = "rotate_half") -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` -> the two members of every RoPE pair, each ``[..., D/2]``.

    ``rotate_half``: ``(x[..., :D/2], x[..., D/2:])``; ``interleaved``: ``(x[..., 0::2],
    x[..., 1::2])``.  Raises ``ValueError`` for odd D or an unknown pairing.
    """
    d = x.shape[-1]
    check_pairing(d, pairing)
    if pairing == "rotate_half":
        return x[..., : d // 2], x[..., d // 2 :]
    return x[..., 0::2], x[..., 1::2]


def merge_pairs(a: torch.Tensor, b: torch.Tensor, pairing: str = "rotate_half") -> torch.Tensor:
    """Inverse of :func:`split_pairs`: two ``[..., D/2]`` tensors -> ``[..., D]``."""
    if pairing == "rotate_half":
        return torch.cat([a, b], dim=-1)
    return torch.stack([a, b], dim=-1).flatten(-2)


@dataclass
class PolarBlock:
    """Quantized (r, θ) of a run of tokens: two per-channel :class:`AffineBlock`\\ s over the
    ``D/2`` RoPE pairs.

    ``radius`` / ``angle``: codes uint8 ``[B, H_kv, n, ceil(D/2 * bits / 8)]``, scale and zero
    ``[B, H_kv, n / G, D/2]`` in the scale dtype.  Nothing else is stored.
    """

    radius: AffineBlock
    angle: AffineBlock
    pairing: str = "rotate_half"

    @property
    def ntokens(self) -> int:
        return self.radius.ntokens

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Keys ``[B, H_kv, n, D]`` in ``dtype``: ``x = r cos θ``, ``y = r sin θ`` (float32 math)."""
        r = self.radius.dequantize(torch.float32)
        t = self.angle.dequantize(torch.float32)
        return merge_pairs(r * torch.cos(t), r * torch.sin(t), self.pairing).to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.radius.tensors() + self.angle.tensors()

    def cat(self, other: PolarBlock) -> PolarBlock:
        return replace(
            self, radius=self.radius.cat(other.radius), angle=self.angle.cat(other.angle)
        )

    def crop(self, n: int) -> PolarBlock:
        return replace(self, radius=self.radius.crop(n), angle=self.angle.crop(n))

    def index_batch(self, idx: torch.Tensor) -> PolarBlock:
        return replace(self, radius=self.radius.index_batch(idx), angle=self.angle.index_batch(idx))


ANGLE_WRAPS = ("minmax", "circular")
CODE_BITS = tuple(range(1, 9))


def unwrap_angles(theta: torch.Tensor) -> torch.Tensor:
    """Shift each row of angles ``[..., n]`` (radians, in ``[-π, π]``) by multiples of 2π so the
    row's largest circular gap lies outside its span.

    The row is cut at the largest gap between circularly consecutive angles; angles smaller than
    the first angle after that gap get + 2π, so the row lies in ``[a, a + 2π)`` and its min-max
    range is 2π minus the largest gap.  A row whose largest gap already straddles ±π (ties
    included) is returned unchanged.  Same shape and dtype; NaN rows stay NaN-bearing.
    """
    s = theta.sort(dim=-1).values
    wrap_gap = s[..., :1] + 2 * math.pi - s[..., -1:]
    gaps = torch.cat([wrap_gap, s[..., 1:] - s[..., :-1]], dim=-1)  # gap j ends at s[j]
    start = s.gather(-1, gaps.argmax(dim=-1, keepdim=True))
    return torch.where(theta >= start, theta, theta + 2 * math.pi)


@dataclass
class PolarCodec:
    """Per-pair polar codec: r and θ quantized per channel over ``group_size`` tokens.

    ``encode(x)``: ``x [B, H_kv, n, D]`` (n a multiple of G, D even) -> :class:`PolarBlock`.
    r and θ are computed in float32 (float64 inputs stay float64).
    """

    radius_bits: int = 2
    angle_bits: int = 2
    group_size: int = 128
    scale_dtype: torch.dtype = torch.float16
    pairing: str = "rotate_half"
    angle_wrap: str = "minmax"
    token_group: int = field(default=0)

    def __post_init__(self) -> None:
        self.token_group = self.group_size

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        return None

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        """``radius_bits`` for each of the D/2 radii and ``angle_bits`` for each of the D/2
        angles per token; each radius and angle slot has a (scale, zero) per ``group_size``
        tokens, i.e. one pair per channel per page; the polar map is fixed (no bits)."""
        check_pairing(head_dim, self.pairing)
        half = head_dim // 2
        codes = Codes(
            head_dim, (CodeClass(self.radius_bits, half), CodeClass(self.angle_bits, half))
        )
        g = self.group_size
        terms = GroupTerms(("scale", "zero"), dtype_name(self.scale_dtype), g, 1)
        return BlockLayout(
            codes, terms, projection=Projection("polar", head_dim, head_dim), page_len=g
        )

    def encode(self, x: torch.Tensor) -> PolarBlock:
        b, h, n, _ = x.shape
        g = self.group_size
        if n % g:
            raise ValueError(
                f"per-channel groups need a multiple of group_size={g} tokens, got {n}"
            )
        xf = x if x.dtype == torch.float64 else x.float()
        a, c = split_pairs(xf, self.pairing)  # [B, H, n, P]
        r, theta = torch.hypot(a, c), torch.atan2(c, a)
        if self.angle_wrap == "circular":
            tg = theta.reshape(b, h, n // g, g, -1).transpose(-1, -2)  # [B, H, NP, P, G]
            theta = unwrap_angles(tg).transpose(-1, -2).reshape(theta.shape)
        radius = PerChannelCodec(self.radius_bits, self.scale_dtype, group_size=g).encode(r)
        angle = PerChannelCodec(self.angle_bits, self.scale_dtype, group_size=g).encode(theta)
        return PolarBlock(radius, angle, self.pairing)


@dataclass(frozen=True)
class PolarQuantConfig(CacheConfig):
    """PolarQuant settings; common fields in :class:`kvbench.cache.method.CacheConfig`.

    Attributes
    ----------
    radius_bits, angle_bits : code widths of r and θ, 1..8 (default 2 + 2) [RECON].
    pairing : ``"rotate_half"`` (default) or ``"interleaved"`` RoPE pairs [RECON].
    angle_wrap : ``"minmax"`` (default) or ``"circular"``; see the module docstring [RECON].
    """

    radius_bits: int = kf.spec(2, int, choices=CODE_BITS)
    angle_bits: int = kf.spec(2, int, choices=CODE_BITS)
    pairing: str = kf.spec("rotate_half", str, choices=PAIRINGS)
    angle_wrap: str = kf.spec("minmax", str, choices=ANGLE_WRAPS)


class PolarQuant(Method):
    """Keys as quantized (radius, angle) per RoPE pair; KIVI schedule; default values."""

    Config = PolarQuantConfig
    description = "PolarQuant (Wu et al.): per-pair (r, θ) per-channel min-max keys, 2+2 bits"
    source = (
        "Wu et al., arXiv 2502.00527; PN-Mix Tables 3, 9, 10; docs/methods.md#polarquant [RECON]"
    )
    capabilities = Capabilities(reconstruction=True)

    def key_codec(self, layer_idx: int, head_dim: int) -> Codec:
        """:class:`PolarCodec` for ``head_dim`` channels; ``ValueError`` if ``head_dim`` is odd."""
        c = self.config
        check_pairing(head_dim, c.pairing)
        return PolarCodec(
            c.radius_bits, c.angle_bits, c.group_size, c.torch_scale_dtype, c.pairing, c.angle_wrap
        )
