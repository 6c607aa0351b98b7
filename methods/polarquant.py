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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from kvbench.cache.blocks import AffineBlock, Codec, PerChannelCodec
from kvbench.cache.layout import BlockLayout, CodeClass, Codes, GroupTerms, Projection, dtype_name
from kvbench.cache.method import CacheConfig, Capabilities, Method

PAIRINGS = ("rotate_half", "interleaved")
ANGLE_WRAPS = ("minmax", "circular")
CODE_BITS = tuple(range(1, 9))


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


class PolarAttention:
    """Code-domain keys of :class:`PolarBlock` for ``kvbench.attention.dispatch``.

    For pair ``j`` of token ``t`` in page ``P``, ``q . k = r_tj (qa_j cos θ_tj + qb_j sin θ_tj)``
    with ``r = c^r a^r_P + b^r_P`` and ``θ`` one of the page's ``2^angle_bits`` levels, so the
    step builds the table ``T_P[j, l] = qa_j cos θ_l + qb_j sin θ_l`` per page (once per query)
    and reads it at the angle codes (PolarQuant's table lookup, Wu et al. §3): native where
    allowed (:func:`kvbench.attention.native.keys_polar`, one pass over the codes), else eager in
    chunks of pages.  Keys only."""

    def key_reason(self, block: PolarBlock, head_dim: int) -> str | None:
        lens = block.radius.group_len
        if not lens or any(x != lens[0] for x in lens[:-1]) or lens[-1] > lens[0]:
            return "polar key pages are not of one length"
        if block.radius.group_len != block.angle.group_len:
            return "radius and angle pages differ"
        return None

    def value_reason(self, block: PolarBlock, head_dim: int) -> str | None:
        return "PolarQuant is a key layout"

    def key_logits(self, block: PolarBlock, q: torch.Tensor, compiled: bool) -> torch.Tensor:
        from kvbench.attention import native
        from kvbench.attention.codedomain import (
            EAGER_CHUNK_TOKENS,
            affine_terms,
            native_allowed,
            note_impl,
        )
        from kvbench.cache.quant import unpack_bits

        rad, ang = block.radius, block.angle
        bsz, h, m, d = q.shape
        d2, length, n = d // 2, rad.group_len[0], rad.ntokens
        qa, qb = split_pairs(q, block.pairing)  # [B, H, M, D/2]
        ar, br = affine_terms(rad)
        at, bt = affine_terms(ang)
        lv = torch.arange(1 << ang.bits, device=q.device, dtype=torch.float32)
        if (
            compiled
            and native_allowed()
            and rad.codes.device.type == "cpu"
            and max(rad.bits, ang.bits) <= 8
            and native.available()
        ):  # the page tables for every query row, then one pass over the codes
            theta = at[..., None] * lv + bt[..., None]  # [B, H, NP, D/2, K]
            tab = qa[:, :, None, :, :, None] * torch.cos(theta).unsqueeze(3) + qb[
                :, :, None, :, :, None
            ] * torch.sin(theta).unsqueeze(3)  # [B, H, NP, M, D/2, K]
            tab = tab.expand(bsz, h, *tab.shape[2:])
            npg = tab.shape[2]
            ar, br = (x.expand(bsz, h, npg, d2) for x in (ar, br))
            note_impl("native")
            return native.keys_polar(rad.codes, ang.codes, ar, br, tab, length, rad.bits, ang.bits)
        step = max(1, EAGER_CHUNK_TOKENS // length)
        outs = []
        for p0 in range(0, len(rad.group_len), step):
            p1 = min(p0 + step, len(rad.group_len))
            t0, t1 = p0 * length, min(p1 * length, n)
            npg = p1 - p0
            pad = npg * length - (t1 - t0)  # a shorter last page: pad its codes
            cr = unpack_bits(rad.codes[:, :, t0:t1], rad.bits, d2).float()
            ct = unpack_bits(ang.codes[:, :, t0:t1], ang.bits, d2).long()
            if pad:
                cr = torch.nn.functional.pad(cr, (0, 0, 0, pad))
                ct = torch.nn.functional.pad(ct, (0, 0, 0, pad))
            cr = cr.reshape(bsz, h, npg, length, d2)
            ct = ct.reshape(bsz, h, npg, length, d2)
            theta = at[:, :, p0:p1, :, None] * lv + bt[:, :, p0:p1, :, None]  # [B, H, np, D/2, K]
            tab = qa[:, :, :, None, :, None] * torch.cos(theta).unsqueeze(2) + qb[
                :, :, :, None, :, None
            ] * torch.sin(theta).unsqueeze(2)  # [B, H, M, np, D/2, K]
            tab = tab.expand(bsz, h, m, npg, d2, tab.shape[-1])
            idx = ct.unsqueeze(2).expand(bsz, h, m, npg, length, d2)
            sel = tab.unsqueeze(4).expand(bsz, h, m, npg, length, d2, tab.shape[-1])
            sel = sel.gather(-1, idx.unsqueeze(-1)).squeeze(-1)  # [B, H, M, np, L, D/2]
            r = cr * ar[:, :, p0:p1].unsqueeze(3) + br[:, :, p0:p1].unsqueeze(3)
            lg = (sel * r.unsqueeze(2)).sum(-1).reshape(bsz, h, m, npg * length)
            outs.append(lg[..., : t1 - t0])
        return torch.cat(outs, -1) if len(outs) > 1 else outs[0]

    def value_output(self, block: PolarBlock, p: torch.Tensor, compiled: bool) -> torch.Tensor:
        raise ValueError(self.value_reason(block, 0))


def _register() -> None:
    from kvbench.attention.block_kernels import register_block_kernel

    register_block_kernel(PolarBlock, PolarAttention(), ("cpu",))


_register()


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

    radius_bits: int = 2
    angle_bits: int = 2
    pairing: str = "rotate_half"
    angle_wrap: str = "minmax"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("radius_bits", "angle_bits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v not in CODE_BITS:
                raise ValueError(f"{name}={v!r} is not supported; allowed: 1..8")
        if self.pairing not in PAIRINGS:
            raise ValueError(
                f"pairing={self.pairing!r} is not supported; allowed: {list(PAIRINGS)}"
            )
        if self.angle_wrap not in ANGLE_WRAPS:
            raise ValueError(
                f"angle_wrap={self.angle_wrap!r} is not supported; allowed: {list(ANGLE_WRAPS)}"
            )


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
