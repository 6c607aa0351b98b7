"""``qjl``: QJL, 1-bit quantized Johnson-Lindenstrauss sketches of the keys.

Source: Zandieh, Daliri, Han, "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with
Zero Overhead", arXiv 2406.03482, §3 (Definition 1; Lemma 2, unbiasedness) and §4; code
amirzandieh/QJL (``models/llama3_utils_qjl.py`` ``QJLSketch`` / ``QJLKeyQuantizer``,
``qjl_kernel/csrc/qjl_gqa_score_kernel.cu``); docs/methods.md#qjl and docs/methods.md#worked-example-14.

Keys: with a seeded Gaussian ``S in R^{m x d}`` (m = ``sketch_dim``) a key is stored as
``sign(S k)`` (bit 1 iff ``(S k)_r > 0``, packed 8 per byte) and ``||k||_2`` (float16).  There are
no dequantized keys; a sketched key's logit is the unbiased estimate (query not quantized)::

    <q, k>  ~  sqrt(pi/2) / m * ||k||_2 * <S q, sign(S k)>

Outliers (``outlier_channels`` o > 0, as the repo): per group of ``group_size`` tokens the o
channels of largest norm over the group are split off and sketched separately with the first
``outlier_sketch_dim`` rows of S (default m/2, the repo's ``s // 16`` bytes) and their own norm;
the logit is the sum of both estimates; the o indices (uint8) are stored per group.

Windows (repo): keys stay exact until a block of ``residual_length`` R (128) tokens is sketched
(docs/methods.md#flush-schedules); ``num_sink_tokens`` stay exact.  Values: KIVI-style per-token, 2 bits,
groups of 32 channels, sliding window R (repo ``--value_quantization_bits 2 --group_size 32``).
S is regenerated from ``seed + layer`` (cached per process), not cache state: no bytes.
``sketch="orthogonal"`` is the repo's ``init_rot_dir`` (blocks of d rows orthonormalized, times
sqrt(d)), slightly biased for small d.  Key bits ``m/d + 16/d`` (+ ``(m_o + 16)/d + 8o/(Gd)``).

The stored key block, :class:`QJLBlock`, is defined here; it has no dequantized form
(:meth:`QJLBlock.scores` is its estimator of ``<q, k>``); ``kvbench.kernels.cpu.qjl`` reads it
in the code domain.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from kvbench import fields as kf
from kvbench.attention.reference import NoDequantizedForm
from kvbench.cache.blocks import own_storage
from kvbench.cache.chunks import token_chunks
from kvbench.cache.finite import all_finite
from kvbench.cache.layer import LayerCache
from kvbench.cache.layout import BlockLayout, CodeClass, Codes, GroupTerms, Projection, dtype_name
from kvbench.cache.method import CacheConfig, Capabilities, Method
from kvbench.cache.quant import pack_bits, unpack_bits

NO_KEYS = (
    "QJL has no dequantized keys (capability keys_values=False): its keys are 1-bit JL "
    "sketches; use LayerCache.attend(query), which scores them with the QJL estimator"
)


def _signs(packed: torch.Tensor, m: int) -> torch.Tensor:
    return unpack_bits(packed, 1, m).float() * 2 - 1  # [..., m] in {-1, +1}


@dataclass
class QJLBlock:
    """Sketched keys of a run of tokens (no ``dequantize``: see :meth:`scores`).

    Attributes
    ----------
    signs : uint8 ``[B, H_kv, n, ceil(m/8)]``; norms : ``[B, H_kv, n]`` (inlier) L2 norms.
    sketch : ``S [m, d]`` float32 (a seed-derived constant; not counted).
    group_len : tokens per outlier group.  With outliers: ``outlier_idx`` uint8
    ``[B, H_kv, NG, o]``, ``outlier_signs`` uint8 ``[B, H_kv, n, ceil(m_o/8)]``,
    ``outlier_norms`` ``[B, H_kv, n]``.
    """

    signs: torch.Tensor
    norms: torch.Tensor
    sketch: torch.Tensor
    group_len: list[int]
    outlier_idx: torch.Tensor | None = None
    outlier_signs: torch.Tensor | None = None
    outlier_norms: torch.Tensor | None = None
    outlier_dim: int = 0

    @property
    def ntokens(self) -> int:
        return self.signs.shape[2]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NoDequantizedForm(NO_KEYS)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        tok, grp = self._fields()
        cats = {"signs": "codes", "outlier_signs": "codes", "outlier_idx": "metadata"}
        return [(cats.get(f, "scales"), getattr(self, f)) for f in tok + grp]

    def _fields(self) -> tuple[list[str], list[str]]:
        if self.outlier_idx is None:
            return ["signs", "norms"], []
        return ["signs", "norms", "outlier_signs", "outlier_norms"], ["outlier_idx"]

    def cat(self, other: QJLBlock) -> QJLBlock:
        if self._fields() != other._fields() or not torch.equal(other.sketch, self.sketch):
            raise ValueError("cannot concatenate QJL blocks of different sketches or outliers")
        tok, grp = self._fields()
        kw = {f: torch.cat([getattr(self, f), getattr(other, f)], dim=2) for f in tok + grp}
        return replace(self, group_len=self.group_len + other.group_len, **kw)

    def crop(self, n: int) -> QJLBlock:
        starts = itertools.accumulate(self.group_len, initial=0)
        lens = [min(g, n - s) for g, s in zip(self.group_len, starts) if s < n]
        tok, grp = self._fields()
        kw = {f: own_storage(getattr(self, f)[:, :, :n]) for f in tok}
        kw |= {f: own_storage(getattr(self, f)[:, :, : len(lens)]) for f in grp}
        return replace(self, group_len=lens, **kw)

    def index_batch(self, idx: torch.Tensor) -> QJLBlock:
        tok, grp = self._fields()
        idx = idx.to(self.signs.device)
        return replace(self, **{f: getattr(self, f).index_select(0, idx) for f in tok + grp})

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """Estimated ``<q, k>``: ``query [B, H_q, n_q, D]`` -> ``[B, H_q, n_q, n]`` float32; query
        head h reads KV head ``h // (H_q / H_kv)``; outliers use ``<S q', s> = <q', S^T s>``."""
        b, hq, nq, d = query.shape
        h, m = self.signs.shape[1], self.sketch.shape[0]
        s_mat = self.sketch.to(query.device)
        q = query.float().reshape(b, h, (hq // h) * nq, d)  # query heads of one KV head
        s_in = _signs(self.signs, m)  # [B, H, n, m]
        c_in = math.sqrt(math.pi / 2) / m * self.norms.float()  # [B, H, n]
        logits = (q @ s_mat.T) @ s_in.transpose(-1, -2) * c_in.unsqueeze(-2)
        if self.outlier_idx is not None:
            mo = self.outlier_dim
            c_out = math.sqrt(math.pi / 2) / mo * self.outlier_norms.float()
            groups = torch.repeat_interleave(torch.tensor(self.group_len, device=q.device))
            idx = self.outlier_idx.long()[:, :, groups]  # [B, H, n, o]
            mask = torch.zeros(*idx.shape[:3], d, device=q.device).scatter_(-1, idx, 1.0)
            z_out = _signs(self.outlier_signs, mo) @ s_mat[:mo]  # S_o^T sign(S_o k_out)
            w = mask * (c_out.unsqueeze(-1) * z_out - c_in.unsqueeze(-1) * (s_in @ s_mat))
            logits = logits + q @ w.transpose(-1, -2)
        return logits.reshape(b, hq, nq, -1)


SKETCHES = ("gaussian", "orthogonal")
NORM_DTYPES = {"float16": torch.float16, "float32": torch.float32}


@lru_cache(maxsize=256)
def qjl_sketch_matrix(m: int, d: int, seed: int, kind: str = "gaussian") -> torch.Tensor:
    """``S [m, d]`` float32, i.i.d. N(0, 1) from ``torch.Generator().manual_seed(seed)``;
    ``orthogonal``: each block of d rows replaced by sqrt(d) x orthonormal rows (repo)."""
    s = torch.randn(m, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if kind == "orthogonal":
        s = torch.cat([torch.linalg.qr(c.T)[0].T * math.sqrt(d) for c in s.split(d)], dim=0)
    return s.float()


def qjl_layout(
    sketch_dim: int,
    head_dim: int,
    group_size: int,
    outlier_channels: int,
    outlier_dim: int,
    norm_dtype: torch.dtype | str,
) -> BlockLayout:
    """Layout of a :class:`QJLBlock`: ``sketch_dim`` sign bits per token (and ``outlier_dim``
    for the outlier channels' own sketch), one key norm per token (and an outlier norm), and
    with outliers one channel index (uint8; int16 for D > 256) per outlier channel per
    ``group_size`` tokens; the Gaussian sketch matrix is held once per layer."""
    nb = dtype_name(norm_dtype)
    classes = [CodeClass(1, sketch_dim)]
    if not outlier_channels:
        return BlockLayout(
            Codes(head_dim, tuple(classes), "sign"),
            GroupTerms(("norm",), nb, 1, head_dim),
            projection=Projection("gaussian-sketch", head_dim, sketch_dim),
        )
    classes.append(CodeClass(1, outlier_dim))
    idx = GroupTerms(
        ("outlier-index",), "uint8" if head_dim <= 256 else "int16", group_size, head_dim,
        count=outlier_channels,
    )  # fmt: skip
    return BlockLayout(
        Codes(head_dim, tuple(classes), "sign"),
        GroupTerms(("norm", "outlier-norm"), nb, 1, head_dim),
        metadata=(idx,),
        projection=Projection("gaussian-sketch", head_dim, sketch_dim),
        page_len=group_size,
    )


@dataclass
class QJLKeyCodec:
    """Sketches keys ``[B, H_kv, n, D]`` into a :class:`QJLBlock` with ``sketch [m, D]``.

    With ``outlier_channels`` o > 0 a flush must hold a multiple of ``group_size`` tokens.  A
    token with NaN/Inf gets a NaN norm (its logits are NaN).  Raises ``ValueError`` if a norm
    overflows ``norm_dtype``.
    """

    sketch: torch.Tensor
    group_size: int = 32
    outlier_channels: int = 0
    outlier_dim: int = 0
    norm_dtype: torch.dtype = torch.float16

    @property
    def token_group(self) -> int:
        return self.group_size if self.outlier_channels else 1

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        return None

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        return qjl_layout(
            self.sketch.shape[0], head_dim, self.group_size, self.outlier_channels,
            self.outlier_dim, self.norm_dtype,
        )  # fmt: skip

    def _norm(self, x: torch.Tensor, finite: torch.Tensor | None) -> torch.Tensor:
        nrm = torch.linalg.vector_norm(x, dim=-1).to(self.norm_dtype)
        if bool((~torch.isfinite(nrm)).any()):
            raise ValueError(f"a key norm overflows norm_dtype={self.norm_dtype}; use float32")
        if finite is None:  # every token finite
            return nrm
        return torch.where(finite, nrm, torch.full_like(nrm, float("nan")))

    def encode(self, x: torch.Tensor) -> QJLBlock:
        """``x [B, H_kv, n, D]`` -> :class:`QJLBlock`, chunk by chunk along T in whole outlier
        groups (:func:`~kvbench.cache.chunks.token_chunks`: a token's signs and norms depend on
        it and its group alone, so they equal one pass's, while the float32 working copies
        stay a chunk's).  Raises ``ValueError`` when ``n`` is not a multiple of
        ``group_size`` (with outliers) or a norm overflows ``norm_dtype``."""
        b, h, n, d = x.shape
        g, o = self.group_size, self.outlier_channels
        if o and n % g:
            raise ValueError(f"outlier groups need a multiple of group_size={g} tokens, not {n}")
        parts = [
            self._encode_tokens(x[:, :, t0:t1])
            for t0, t1 in token_chunks(b, h, n, d, group=g if o else 1)
        ] or [self._encode_tokens(x)]  # no tokens: one empty block
        if len(parts) == 1:
            return parts[0]
        tok, grp = parts[0]._fields()
        kw = {f: torch.cat([getattr(p, f) for p in parts], dim=2) for f in tok + grp}
        return replace(parts[0], group_len=[k for p in parts for k in p.group_len], **kw)

    def _encode_tokens(self, x: torch.Tensor) -> QJLBlock:
        b, h, n, d = x.shape
        xf = x.float()
        # finite input (the common case) takes no masks; else a token with a non-finite
        # element is sketched as 0 there and gets a NaN norm (the same values either way)
        finite = None if all_finite(x) else torch.isfinite(xf).all(dim=-1)
        zero = torch.zeros((), device=x.device)
        xs = xf if finite is None else torch.where(torch.isfinite(xf), xf, zero)
        s_mat = self.sketch.to(x.device)
        g, o = self.group_size, self.outlier_channels
        if not o:
            bits = pack_bits((xs @ s_mat.T > 0).to(torch.uint8), 1)
            return QJLBlock(bits, self._norm(xs, finite), self.sketch, [1] * n)
        cn = torch.linalg.vector_norm(xs.reshape(b, h, n // g, g, d), dim=-2)  # [B, H, NG, D]
        idx = cn.topk(o, dim=-1).indices
        mask = torch.zeros_like(cn).scatter_(-1, idx, 1.0).repeat_interleave(g, dim=2)
        k_out, k_in = xs * mask, xs * (1 - mask)
        b_in = pack_bits((k_in @ s_mat.T > 0).to(torch.uint8), 1)
        b_out = pack_bits((k_out @ s_mat[: self.outlier_dim].T > 0).to(torch.uint8), 1)
        n_in, n_out = self._norm(k_in, finite), self._norm(k_out, finite)
        idx = idx.to(torch.uint8 if d <= 256 else torch.int16)
        lens, mo = [g] * (n // g), self.outlier_dim
        return QJLBlock(b_in, n_in, self.sketch, lens, idx, b_out, n_out, mo)


class QJLLayerCache(LayerCache):
    """A :class:`~kvbench.cache.layer.LayerCache` whose sketched keys are read only by
    :meth:`attend` (through the registered kernel,
    :class:`kvbench.kernels.cpu.qjl.QJLAttention`: exact logits for sinks and
    residual, the QJL estimate for sketched keys, float32 softmax)."""

    def keys_values(self, dtype: torch.dtype | None = None):
        raise NoDequantizedForm(NO_KEYS)


@dataclass(frozen=True)
class QJLConfig(CacheConfig):
    """Configuration of :class:`QJL` (common fields: :class:`~kvbench.cache.method.CacheConfig`).

    Attributes
    ----------
    group_size : G, tokens per outlier group (default 32; also the default value group).
    residual_length : R, keys sketched in blocks of R (default 128, a multiple of G).
    value_bits : per-token value bits (default 2; 16 = full-precision values).
    sketch_dim : m (default 256).  outlier_channels : o (default 0).
    outlier_sketch_dim : m_o (default ``sketch_dim // 2``).  sketch : ``gaussian`` | ``orthogonal``.
    seed : base seed of S (default 0).  norm_dtype : ``float16`` (default) | ``float32``.
    """

    group_size: int = 32
    residual_length: int = 128
    value_bits: int = 2
    sketch_dim: int = kf.spec(256, int, low=1)
    outlier_channels: int = kf.spec(0, int, low=0)
    outlier_sketch_dim: int | None = kf.spec(None, int, low=1, optional=True)
    sketch: str = kf.spec("gaussian", str, choices=SKETCHES)
    seed: int = kf.spec(0, int, low=0)
    norm_dtype: str = kf.spec("float16", str, choices=tuple(NORM_DTYPES))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.outlier_dim > self.sketch_dim:
            self.reject(
                "outlier_sketch_dim",
                f"None (sketch_dim // 2) or integers 1..{self.sketch_dim} (<= sketch_dim)",
            )

    @property
    def outlier_dim(self) -> int:
        return self.outlier_sketch_dim or max(self.sketch_dim // 2, 1)


class QJL(Method):
    """QJL: 1-bit JL sketches + norms for keys (estimated logits), per-token values."""

    Config = QJLConfig
    description = "QJL: keys as sign(S k) sketches + fp16 norm, unbiased logit estimator"
    source = "Zandieh et al., arXiv 2406.03482, §3-4; repo amirzandieh/QJL; docs/methods.md#qjl and docs/methods.md#worked-example-14"
    capabilities = Capabilities(keys_values=False)

    def key_codec(self, layer_idx: int, head_dim: int) -> QJLKeyCodec:
        c = self.config
        if c.outlier_channels >= head_dim:
            raise ValueError(f"outlier_channels={c.outlier_channels} must be < head_dim={head_dim}")
        s_mat = qjl_sketch_matrix(c.sketch_dim, head_dim, c.seed + layer_idx, c.sketch)
        return QJLKeyCodec(
            s_mat, c.group_size, c.outlier_channels, c.outlier_dim, NORM_DTYPES[c.norm_dtype]
        )

    def new_layer(self, layer_idx: int, num_kv_heads: int, head_dim: int, dtype=None, device=None):
        """One empty :class:`QJLLayerCache` (same arguments as :meth:`Method.new_layer`)."""
        kc, vc = self.key_codec(layer_idx, head_dim), self.value_codec(layer_idx, head_dim)
        ns = self.config.num_sink_tokens
        return QJLLayerCache(kc, vc, self.key_schedule(), self.value_schedule(), ns)

    def key_layout(self, head_dim: int) -> BlockLayout:
        """:func:`qjl_layout` of the config."""
        c = self.config
        return qjl_layout(
            c.sketch_dim, head_dim, c.group_size, c.outlier_channels, c.outlier_dim,
            NORM_DTYPES[c.norm_dtype],
        )  # fmt: skip
