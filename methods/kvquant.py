"""``kvquant``: KVQuant-lite (Hooper et al., "KVQuant: Towards 10 Million Context Length LLM
Inference with KV Cache Quantization", NeurIPS'24, arXiv 2401.18079, §3; code
SqueezeAILab/KVQuant ``quant/kvquant/simquant_module_quantizer.py``; docs/methods.md#kvquant).

Keys are quantized **pre-RoPE**, per channel, with *static* thresholds from
:meth:`KVQuant.calibrate`: per (KV head, channel) ``upper, lower = percentile(100 t),
percentile(100 (1 - t))``, ``t = 1 - (1 - tau) / 2``; ``u = (x - center) / half`` with
``center, half = (upper +- lower) / 2``; no token groups, so a key is quantized when its
schedule flushes it.  ``|u| > 1`` and non-finite elements are dense-and-sparse outliers kept
exactly in float16 with int32 flat indices into ``[n, B, H_kv, D]`` (metadata bytes); the rest
round to the nearest of ``2^bits`` levels: NUQ (``nuq=True``) = one LUT per layer from 1-D
k-means of the non-outlier calibration ``u`` (:func:`lloyd_levels`), else uniform levels.
``first_few_fp16`` = ``num_sink_tokens`` (default 1).
The cache receives post-RoPE keys: a flushed key is un-rotated at its position (index in the
cache) and the dequantized block re-rotated when read, with HF's float32 angles ``pos *
theta^(-2i/D)``; sinks and residual stay post-RoPE, exact in the compute dtype, or in the
config's ``storage_dtype`` (float16/bfloat16, docs/design.md#storage-dtype; a flush codes them
converted back to the compute dtype).  The thresholds and levels are stored in ``scale_dtype``
(float16 by default) and the outliers in float16 whatever the compute dtype, so
``storage_dtype`` leaves them as they are.  RoPE scaling (llama3, yarn) and
left-padding offsets are not modelled (the round trip stays exact).

[RECON] "lite": values use the core's per-token codec (``value_bits``; no value outliers or
LUT), no Q-Norm or Fisher weights, calibration skips each sequence's first ``num_sink_tokens``
tokens; k-means is Lloyd's algorithm over every non-outlier value from a quantile start (KVQuant
runs scikit-learn's seeded k-means++ on a subsample), which is deterministic and moves
continuously with its data, so the float noise between CPU instruction sets or thread counts
cannot jump the table to another local optimum.  Nominal key bits (docs/methods.md#average-bits): ``bits
+ (1 - tau) (16 + 32)`` (4.48 at the defaults; per-layer thresholds and LUT left out).

The stored key block, :class:`LUTBlock`, is defined here; ``kvbench.kernels.cpu.lut`` reads it in
the code domain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kvbench import fields as kf
from kvbench.cache.blocks import cat_blocks, own_storage
from kvbench.cache.chunks import token_chunks
from kvbench.cache.finite import all_finite
from kvbench.cache.layer import LayerCache, Side
from kvbench.cache.layout import BlockLayout, Codebook, Codes, Projection, SparseOutliers
from kvbench.cache.method import CacheConfig, Capabilities, Method
from kvbench.cache.quant import bucket_index, pack_bits, unpack_bits
from kvbench.cache.rope import Rotary, rope
from kvbench.cache.schedule import SlidingSchedule


@dataclass
class LUTBlock:
    """Pre-RoPE keys as level indices plus exact outliers.  codes: uint8 ``[B, H_kv, n,
    ceil(D*bits/8)]``; center, half: static ``[H_kv, D]`` (scale dtype); lut: ``[2^bits]`` sorted
    levels; out_idx: int32 ``[N]`` flat indices into ``[n, B, H_kv, D]``, ascending; out_val: fp16
    ``[N]``.
    rotary: ``None`` for codes read as stored (``pre_rope=False``); else the :class:`Rotary`
    that reads add (pre-RoPE codes re-rotated at their positions): :meth:`dequantize` returns
    the post-RoPE keys, and the code-domain kernel rotates the query instead."""

    codes: torch.Tensor
    center: torch.Tensor
    half: torch.Tensor
    lut: torch.Tensor
    out_idx: torch.Tensor
    out_val: torch.Tensor
    bits: int
    head_dim: int
    rotary: Rotary | None = None

    @property
    def ntokens(self) -> int:
        return self.codes.shape[2]

    def _row(self) -> int:  # elements of one token over B and H_kv
        return self.codes.shape[0] * self.codes.shape[1] * self.head_dim

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        b, h, n, _ = self.codes.shape
        codes = unpack_bits(self.codes, self.bits, self.head_dim).long()
        u = self.lut.float()[codes]
        x = u * self.half.float()[:, None, :] + self.center.float()[:, None, :]
        xt = x.permute(2, 0, 1, 3).reshape(-1).clone()
        xt[self.out_idx.long()] = self.out_val.float()
        x = xt.reshape(n, b, h, self.head_dim).permute(1, 2, 0, 3)
        if self.rotary is not None:
            r = self.rotary
            x = rope(x, r.start, r.theta, r.layout)
        return x.to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        meta = [("metadata", t) for t in (self.lut, self.out_idx, self.out_val)]
        return [("codes", self.codes), ("scales", self.center), ("scales", self.half), *meta]

    def cat(self, other: LUTBlock) -> LUTBlock:
        r, o = self.rotary, other.rotary
        if (r is None) != (o is None) or (
            r is not None
            and (o.theta, o.layout, o.start) != (r.theta, r.layout, r.start + self.ntokens)
        ):
            raise ValueError("cannot concatenate LUT blocks of different RoPE positions/settings")
        idx = torch.cat([self.out_idx, other.out_idx + self._row() * self.ntokens])
        codes = torch.cat([self.codes, other.codes], 2)
        val = torch.cat([self.out_val, other.out_val])
        return replace(self, codes=codes, out_idx=idx, out_val=val)

    @staticmethod
    def join(parts: list[LUTBlock]) -> LUTBlock:
        """One block of ``parts`` (consecutive runs of tokens with one set of thresholds and
        one ``rotary``, e.g. the chunks of one encode) in one concatenation: the outlier
        indices of each part offset by the tokens before it."""
        if len(parts) == 1:
            return parts[0]
        offs, n = [], 0
        for p in parts:
            offs.append(n)
            n += p.ntokens
        row = parts[0]._row()
        idx = torch.cat([p.out_idx + row * o for p, o in zip(parts, offs)])
        codes = torch.cat([p.codes for p in parts], 2)
        val = torch.cat([p.out_val for p in parts])
        return replace(parts[0], codes=codes, out_idx=idx, out_val=val)

    def crop(self, n: int) -> LUTBlock:
        keep, codes = self.out_idx < self._row() * n, own_storage(self.codes[:, :, :n])
        return replace(self, codes=codes, out_idx=self.out_idx[keep], out_val=self.out_val[keep])

    def index_batch(self, idx: torch.Tensor) -> LUTBlock:
        idx = idx.to(self.codes.device).long()
        row, hd = self._row(), self._row() // self.codes.shape[0]
        t, rem = self.out_idx.long() // row, self.out_idx.long() % row
        i, j = (rem[:, None] // hd == idx[None, :]).nonzero(as_tuple=True)
        new_idx, codes = (t[i] * (len(idx) * hd) + j * hd + rem[i] % hd).int(), self.codes[idx]
        order = torch.argsort(new_idx)  # kept ascending (the native kernel walks them in order)
        return replace(self, codes=codes, out_idx=new_idx[order], out_val=self.out_val[i][order])


ROPE_LAYOUTS, NUQ_MAX_ITERS = ("rotate_half", "interleaved"), 1000


def lut_layout(bits: int, tau: float, head_dim: int, pre_rope: bool = False) -> BlockLayout:
    """Layout of a :class:`LUTBlock`: ``bits``-bit LUT indices per element (one shared table of
    ``2^bits`` levels; per-channel calibrated center/half held once per layer), ``1 - tau`` of
    the elements as sparse float16 outliers with an int32 position each; pre-RoPE keys carry the
    inverse rotation."""
    proj = Projection("rope-unrotate", head_dim, head_dim) if pre_rope else None
    return BlockLayout(
        Codes.uniform(bits, head_dim, "index"),
        outliers=SparseOutliers(1 - tau, "float16", "int32"),
        projection=proj,
        codebook=Codebook(2**bits, "float16", "shared"),
    )


@dataclass
class LUTCodec:
    """``encode(x [B, H_kv, n, D]) -> LUTBlock`` with static ``center``/``half`` ``[H_kv, D]``:
    outliers (see :func:`normalize`) kept exactly, the rest rounded to the nearest level."""

    bits: int
    tau: float
    lut: torch.Tensor
    center: torch.Tensor
    half: torch.Tensor
    token_group: int = 1

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        return None

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        return lut_layout(self.bits, self.tau, head_dim)

    def encode(self, x: torch.Tensor) -> LUTBlock:
        """``x [B, H_kv, n, D]`` -> :class:`LUTBlock`, chunk by chunk along T
        (:func:`~kvbench.cache.chunks.token_chunks`: each element is coded against static
        thresholds, so the codes and outliers equal one pass's, while the float32 working
        copies stay a chunk's)."""
        b, h, n, d = x.shape
        return LUTBlock.join(
            [self._encode_tokens(x[:, :, t0:t1]) for t0, t1 in token_chunks(b, h, n, d)]
            or [self._encode_tokens(x)]  # no tokens: one empty block
        )

    def _encode_tokens(self, x: torch.Tensor) -> LUTBlock:
        c, h = self.center.to(x.device), self.half.to(x.device)
        u, out = normalize(x.float(), c, h, self.tau)
        lut = self.lut.to(x.device)
        codes = bucket_index(u, (lut[1:].float() + lut[:-1].float()) / 2)
        if out is None:  # no outliers (finite input, tau = 1)
            idx = torch.zeros(0, dtype=torch.int64, device=x.device)
        else:
            idx = out.permute(2, 0, 1, 3).reshape(-1).nonzero().flatten()
        val = x.permute(2, 0, 1, 3).reshape(-1)[idx].half()
        packed = pack_bits(codes, self.bits)
        return LUTBlock(packed, c, h, lut, idx.int(), val, self.bits, x.shape[3])


def lloyd_levels(u: torch.Tensor, k: int, max_iters: int, tol: float = 1e-10) -> torch.Tensor:
    """Sorted 1-D k-means centroids ``[k]`` (float64) of every value of ``u`` (any shape).

    Lloyd's algorithm, exact on all values: sorted once; each step puts the boundaries at the
    midpoints between neighbouring centroids and moves each centroid to the mean of its values
    (prefix sums; an empty cell keeps its centroid, which lies between its neighbours' cells,
    so the centroids stay sorted), until no centroid moves by more than ``tol`` or after
    ``max_iters`` steps.  Start: the order statistics at quantiles ``(i + 1/2) / k``.  Deterministic, and continuous in ``u`` away from
    ties, unlike a randomly seeded k-means++ start whose table jumps between local optima under
    float noise (KVQuant, arXiv 2401.18079 §3.2, fits its non-uniform levels with k-means; its
    code seeds scikit-learn's k-means++).  Raises ``ValueError`` when ``u`` has fewer than ``k``
    values."""
    x = u.detach().reshape(-1).double().cpu().sort().values
    n = x.numel()
    if n < k:
        raise ValueError(f"k-means needs >= {k} non-outlier calibration values, got {n}")
    sums = torch.cat([x.new_zeros(1), x.cumsum(0)])
    cent = x[((torch.arange(k, dtype=torch.float64) + 0.5) * n / k).long()]
    ends = torch.tensor([n])
    for _ in range(max_iters):
        edges = torch.cat(
            [ends.new_zeros(1), torch.searchsorted(x, (cent[1:] + cent[:-1]) / 2), ends]
        )
        count = edges[1:] - edges[:-1]
        mean = (sums[edges[1:]] - sums[edges[:-1]]) / count.clamp(min=1)
        new = torch.where(count > 0, mean, cent)
        done = bool((new - cent).abs().max() <= tol)
        cent = new
        if done:
            break
    return cent


def normalize(x: torch.Tensor, center: torch.Tensor, half: torch.Tensor, tau: float):
    """``(u, out)`` for ``x [..., H, n, D]`` with thresholds ``[H, D]``: normalized values (0 at
    outliers) and the outlier mask (non-finite, or outside the range when ``tau < 1``);
    ``out`` is ``None`` when there is no outlier by construction (finite input and
    ``tau = 1``: no mask is built)."""
    c, h = center.float()[:, None, :], half.float()[:, None, :]
    out = None if all_finite(x) else ~torch.isfinite(x)
    if tau < 1:
        far = (x - c).abs() > h
        out = far if out is None else out | far
    u = (x - c) / torch.where(h > 0, h, torch.ones((), device=x.device))
    if out is None:
        return u.contiguous(), None
    return torch.where(out, torch.zeros((), device=x.device), u).contiguous(), out


@dataclass
class PreRopeSide(Side):
    """Key side whose blocks hold pre-RoPE codes: a flush un-rotates the tokens at their
    positions (index in the cache) and stores them with the :class:`Rotary` that reads add,
    so the block's layout says what is read (its ``dequantize`` re-rotates; the code-domain
    kernel rotates the query)."""

    theta: float = 10000.0
    layout: str = "rotate_half"

    def flush(self, n: int) -> None:
        if n <= 0 or self.codec is None:
            return
        start = len(self) - self.residual.shape[2]  # position of the oldest residual token
        head, rest = self.residual[:, :, :n], self.residual[:, :, n:]
        self.residual = own_storage(rest) if rest.shape[2] else None
        if self.compute_dtype is not None:  # a 16-bit-stored residual is coded as computed
            head = head.to(self.compute_dtype)
        b, h, m, d = head.shape  # un-rotated and coded chunk by chunk (elementwise: equal)
        parts = [
            self.codec.encode(rope(head[:, :, t0:t1], start + t0, self.theta, self.layout, True))
            for t0, t1 in token_chunks(b, h, m, d)
        ]
        blk = replace(LUTBlock.join(parts), rotary=Rotary(self.theta, self.layout, start))
        self.block = cat_blocks(self.block, blk)


DEFAULT_THETA = 10000.0  # RoPE base when neither the config nor a model gives one


@dataclass(frozen=True)
class KVQuantConfig(CacheConfig):
    """KVQuant-lite settings; common fields: :class:`kvbench.cache.method.CacheConfig`.

    bits : key code width 2, 3 or 4 (default 4: the "nuq4-1%" checkpoints).
    sparsity_threshold : tau in (0.5, 1]; a fraction 1 - tau of the calibration keys lies
        outside the thresholds (1% at 0.99); 1.0: no outliers, keys clamp to the range.
    nuq : k-means LUT levels (default True; :func:`lloyd_levels`), else uniform levels.
    pre_rope, rope_theta, rope_layout : quantize keys before RoPE (default True), RoPE base
        (``None``: the model's, filled by :meth:`KVQuant.for_model` — the runner calls it —
        else 10000), ``rotate_half``/``interleaved``.
    Defaults differing from the core: ``num_sink_tokens=1`` (``first_few_fp16``),
    ``residual_length=0`` (every token is quantized); ``group_size`` only sets the value group.
    """

    bits: int = kf.spec(4, int, choices=(2, 3, 4))
    num_sink_tokens: int = 1
    residual_length: int = 0
    sparsity_threshold: float = kf.spec(0.99, float, low=0.5, high=1, low_open=True)
    nuq: bool = kf.spec(True, bool)
    pre_rope: bool = kf.spec(True, bool)
    rope_theta: float | None = kf.spec(None, float, low=0, low_open=True, optional=True)
    rope_layout: str = kf.spec("rotate_half", str, choices=ROPE_LAYOUTS)

    token_axis_keys = False


class KVQuant(Method):
    """KVQuant-lite: pre-RoPE static per-channel keys, 1% exact outliers, NUQ levels."""

    Config = KVQuantConfig
    description = "KVQuant-lite: pre-RoPE per-channel keys, calibrated ranges, sparse outliers"
    source = "Hooper et al., NeurIPS'24, arXiv 2401.18079, §3.1-3.5; docs/methods.md#kvquant"
    capabilities = Capabilities(needs_calibration=True, reconstruction=True)

    def __init__(self, config: KVQuantConfig | None = None, **overrides) -> None:
        super().__init__(config, **overrides)
        #: layer -> (center, half) ``[H_kv, D]`` and sorted levels ``[2^bits]``, scale dtype
        self.calibration: dict[int, tuple] = {}
        self.calibration_source = ""

    def for_model(self, info: dict) -> KVQuant:
        """Fill ``rope_theta`` from the model (``kvbench.hf.info.model_info``) when unset."""
        if self.config.rope_theta is None and info.get("rope_theta"):
            self.config = replace(self.config, rope_theta=float(info["rope_theta"]))
        return self

    def calibrate(self, keys_by_layer: dict, values_by_layer=None, source: str = "") -> KVQuant:
        """Set each layer's static thresholds and LUT from calibration data only; returns self.

        ``keys_by_layer[l]``: post-RoPE keys ``[N, H_kv, T, D]`` of N sequences disjoint from the
        evaluation text (token ``t`` at position ``t``); ``values_by_layer`` is unused (values
        are per-token dynamic); ``source`` names the text (kept in ``calibration_source``).
        Raises ``ValueError`` on a bad shape (odd ``D`` with ``pre_rope``) or too few
        non-outlier values for k-means."""
        c, sd, self.calibration_source = self.config, self.config.torch_scale_dtype, source
        t = 1 - (1 - c.sparsity_threshold) / 2
        for layer, k in keys_by_layer.items():
            if k.dim() != 4 or k.shape[2] <= c.num_sink_tokens or (c.pre_rope and k.shape[3] % 2):
                msg = "must be [N, H_kv, T, D] with T > num_sink_tokens (even D for pre_rope)"
                raise ValueError(f"keys_by_layer[{layer}] {msg}, got {tuple(k.shape)}")
            k = (
                rope(k, 0, c.rope_theta or DEFAULT_THETA, c.rope_layout, inverse=True)
                if c.pre_rope
                else k.float()
            )
            data = k[:, :, c.num_sink_tokens :].transpose(0, 1).flatten(1, 2)  # [H, N*T', D]
            arr = data.double().cpu().numpy()
            up = torch.from_numpy(np.percentile(arr, 100 * t, axis=1))
            lo = torch.from_numpy(np.percentile(arr, 100 * (1 - t), axis=1))
            center, half = ((up + lo) / 2).to(sd), ((up - lo) / 2).to(sd)
            u, out = normalize(data.cpu(), center, half, c.sparsity_threshold)
            kept = u.flatten() if out is None else u[~out]  # the non-outlier values
            self.calibration[layer] = (center, half, self._lut(kept))
        return self

    def _lut(self, u: torch.Tensor) -> torch.Tensor:
        """Levels (scale dtype): :func:`lloyd_levels` of normalized values ``u`` (NUQ), or the
        uniform ``linspace(-1, 1, 2^bits)``."""
        c = self.config
        if not c.nuq:
            return torch.linspace(-1, 1, 1 << c.bits).to(c.torch_scale_dtype)
        return lloyd_levels(u, 1 << c.bits, NUQ_MAX_ITERS).to(c.torch_scale_dtype)

    def key_codec(self, layer_idx: int, head_dim: int) -> LUTCodec:
        """Raises ``RuntimeError`` for a layer :meth:`calibrate` has not seen."""
        c, cal = self.config, self.calibration.get(layer_idx)
        if cal is None:
            msg = f"kvquant: layer {layer_idx} is not calibrated; call method.calibrate()"
            raise RuntimeError(f"{msg} before building caches (capabilities.needs_calibration)")
        return LUTCodec(c.bits, c.sparsity_threshold, cal[2], cal[0], cal[1])

    def key_schedule(self) -> object:
        return SlidingSchedule(self.config.residual_length)

    def new_layer(self, layer_idx, num_kv_heads, head_dim, *args, **kwargs) -> LayerCache:
        """As :meth:`Method.new_layer`.  Raises ``RuntimeError`` for an uncalibrated layer and
        ``ValueError`` when the calibration had another ``[H_kv, D]``."""
        c = self.config
        layer = super().new_layer(layer_idx, num_kv_heads, head_dim, *args, **kwargs)
        shape = list(layer.k.codec.center.shape)
        if shape != [num_kv_heads, head_dim]:
            msg = f"layer {layer_idx} was calibrated for [H_kv, D] = {shape}"
            raise ValueError(f"{msg}, not {[num_kv_heads, head_dim]}")
        if c.pre_rope:
            theta, k = float(c.rope_theta or DEFAULT_THETA), layer.k
            layer.k = PreRopeSide(k.codec, k.schedule, theta=theta, layout=c.rope_layout)
        return layer

    def key_layout(self, head_dim: int) -> BlockLayout:
        """:func:`lut_layout` of the config (known before calibration)."""
        c = self.config
        return lut_layout(c.bits, c.sparsity_threshold, head_dim, c.pre_rope)
