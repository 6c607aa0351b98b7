"""``turboquant-mse``: TurboQuant's MSE-optimal quantizer applied per token per head.

Source: Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate", arXiv 2504.19874, §3.1 (Algorithm 1, TurboQuant_mse; Lemma 1, the
coordinate law of a rotated unit vector; Theorem 1, ``D_mse <= (sqrt(3) pi / 2) 4^-b``); docs/methods.md#qjl
and docs/methods.md#worked-example-12.

Per token and KV head, ``x`` (head_dim ``d``) is stored as its norm ``||x||_2`` (``norm_dtype``,
float16: 16 bits) and the packed ``b``-bit indices ``idx_j = argmin_k |y_j - c_k|`` of
``y = Pi x / ||x||``: ``Pi`` a random orthogonal matrix (QR of a seeded Gaussian, signs fixed by
``diag(R)``: Haar), ``c`` the Lloyd-Max codebook of ``2^b`` centroids for one coordinate of a
uniformly random unit vector, density ``prop. (1 - t^2)^((d-3)/2)`` on [-1, 1] (``codebook=
"exact"``, Lemma 1) or ``N(0, 1/d)`` (``"gaussian"``, its large-d limit).  Dequantization:
``x~ = ||x|| * Pi^T c_idx``.  Bits per element ``b + 16/d`` (norm_dtype float16).

``Pi`` and the codebook are constants regenerated from (``seed``, layer, side, d) and (b, d):
they are not cache state and cost no bytes (a kernel regenerates them or uses a structured
transform); with ``store_rotation=True`` each side's ``d x d`` float32 ``Pi`` is held by its block
and counted as metadata.  The rotation of layer ``l`` is seeded with ``seed + 2 l`` for keys and
``seed + 2 l + 1`` for values.  A token holding NaN/Inf gets a NaN norm (its output is NaN); a
finite norm that overflows ``norm_dtype`` raises ``ValueError``.  ``apply_to`` chooses the
quantized sides; the other stays full precision.  Windows: ``residual_length`` R newest tokens
in full precision (default 0, quantize on write) and ``num_sink_tokens``.

The stored block, :class:`TurboBlock`, is defined here; ``kvbench.kernels.cpu.turbo`` reads it
in the code domain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import torch
from scipy import special

from kvbench import fields as kf
from kvbench.cache.blocks import own_storage
from kvbench.cache.chunks import token_chunks
from kvbench.cache.finite import all_finite
from kvbench.cache.layout import BlockLayout, Codebook, Codes, GroupTerms, Projection, dtype_name
from kvbench.cache.method import Capabilities, Method, MethodConfig
from kvbench.cache.quant import bucket_index, pack_bits, packed_size, unpack_bits
from kvbench.cache.schedule import NeverSchedule, SlidingSchedule


@dataclass
class TurboBlock:
    """TurboQuant-MSE codes of a run of tokens.

    Attributes
    ----------
    codes : uint8 ``[B, H_kv, n, ceil(D*bits/8)]``, packed codebook indices.
    norms : ``[B, H_kv, n, 1]`` in ``norm_dtype``, the tokens' L2 norms.
    rotation : ``[D, D]`` float32 ``Pi``; counted as metadata only if ``rotation_stored``.
    centroids : ``[2^bits]`` float32 codebook (a constant of (bits, D); never counted).
    """

    codes: torch.Tensor
    norms: torch.Tensor
    rotation: torch.Tensor
    centroids: torch.Tensor
    bits: int
    rotation_stored: bool = False

    @property
    def ntokens(self) -> int:
        return self.codes.shape[2]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        d = self.rotation.shape[0]
        idx = unpack_bits(self.codes, self.bits, d).long()
        y = self.centroids.to(self.codes.device)[idx]  # [B, H, n, D]
        return (y @ self.rotation.to(y.device) * self.norms.float()).to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [("codes", self.codes), ("scales", self.norms)]
        return [*out, ("metadata", self.rotation)] if self.rotation_stored else out

    def cat(self, other: TurboBlock) -> TurboBlock:
        if other.bits != self.bits or not torch.equal(other.rotation, self.rotation):
            raise ValueError("cannot concatenate TurboQuant blocks of different bits/rotation")
        return replace(
            self,
            codes=torch.cat([self.codes, other.codes], dim=2),
            norms=torch.cat([self.norms, other.norms], dim=2),
        )

    def crop(self, n: int) -> TurboBlock:
        return replace(
            self, codes=own_storage(self.codes[:, :, :n]), norms=own_storage(self.norms[:, :, :n])
        )

    def index_batch(self, idx: torch.Tensor) -> TurboBlock:
        return replace(
            self,
            codes=self.codes.index_select(0, idx.to(self.codes.device)),
            norms=self.norms.index_select(0, idx.to(self.norms.device)),
        )


APPLY_TO = ("keys", "values", "both")
CODEBOOKS = ("exact", "gaussian")
NORM_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def _gauss_m1(t: np.ndarray) -> np.ndarray:
    """Partial first moment of N(0, 1): int_{-inf}^t x phi(x) dx = -phi(t)."""
    return -np.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _law(dim: int | None):
    """(support, E[X^2], cdf, partial first moment, initial quantiles) of the coordinate law."""
    if dim is None:
        return (-np.inf, np.inf), 1.0, special.ndtr, _gauss_m1, special.ndtri
    a = (dim - 1) / 2.0  # (X + 1) / 2 ~ Beta(a, a); density C (1 - x^2)^(a - 1), C = 1/B(1/2, a)
    c = math.exp(-special.betaln(0.5, a))

    def cdf(t):
        return special.betainc(a, a, (t + 1) / 2)

    def m1(t):  # int_{-1}^t x C (1 - x^2)^(a-1) dx
        return -c * np.power(np.clip(1 - t * t, 0, None), a) / (2 * a)

    def quantile(p):
        return 2 * special.betaincinv(a, a, p) - 1

    return (-1.0, 1.0), 1.0 / dim, cdf, m1, quantile


@lru_cache(maxsize=64)
def _lloyd_max(bits: int, dim: int | None) -> tuple[tuple[float, ...], float]:
    k = 1 << bits
    (lo, hi), second, cdf, m1, quantile = _law(dim)
    c = quantile((np.arange(k) + 0.5) / k)
    for _ in range(100_000):  # Lloyd-Max: centroids = conditional means of their cells
        t = np.concatenate([[lo], (c[1:] + c[:-1]) / 2, [hi]])
        new = np.diff(m1(t)) / np.diff(cdf(t))
        done = np.max(np.abs(new - c)) < 1e-14
        c = new
        if done:
            break
    t = np.concatenate([[lo], (c[1:] + c[:-1]) / 2, [hi]])
    dist = second - float(np.sum(np.diff(cdf(t)) * c * c))  # E[X^2] - sum_i P_i c_i^2
    return tuple(float(v) for v in c), dist * (dim or 1)


def lloyd_max_codebook(bits: int, dim: int | None = None) -> tuple[np.ndarray, float]:
    """Lloyd-Max centroids (ascending, float64) and their distortion.

    ``dim=None``: for N(0, 1); the distortion is the per-coordinate MSE (Example 12: b = 1:
    +-0.797885, 0.363380).  ``dim=d >= 2``: for one coordinate of a uniformly random unit vector
    in R^d (density prop. ``(1 - t^2)^((d-3)/2)``), centroids in those units (multiply by
    ``sqrt(d)`` to compare with Example 12) and distortion ``d * MSE = E||u - u~||^2``.
    Raises ``ValueError`` for bits outside 1..8 or dim < 2.
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} is not supported; allowed: 1..8")
    if dim is not None and (not isinstance(dim, int) or dim < 2):
        raise ValueError(f"dim={dim!r} must be an integer >= 2 or None")
    c, dist = _lloyd_max(bits, dim)
    return np.array(c), dist


@lru_cache(maxsize=256)
def haar_rotation(dim: int, seed: int) -> torch.Tensor:
    """Random orthogonal ``[dim, dim]`` float32 matrix: QR of a float64 Gaussian drawn from
    ``torch.Generator().manual_seed(seed)``, columns' signs fixed by ``sign(diag(R))``."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def turbo_layout(bits: int, head_dim: int, norm_dtype: torch.dtype | str) -> BlockLayout:
    """Layout of a :class:`TurboBlock`: one ``bits``-bit codebook index per rotated coordinate
    (a shared table of ``2^bits`` Lloyd-Max levels), one norm per token in ``norm_dtype``; the
    random rotation is held once per layer."""
    return BlockLayout(
        Codes.uniform(bits, head_dim, "index"),
        GroupTerms(("norm",), dtype_name(norm_dtype), 1, head_dim),
        projection=Projection("random-orthogonal", head_dim, head_dim),
        codebook=Codebook(2**bits, "float32", "shared"),
    )


@dataclass
class TurboQuantCodec:
    """Encodes ``[B, H_kv, n, D]`` tokens (any float dtype) into a :class:`TurboBlock`.

    ``rotation [D, D]``, ``centroids [2^bits]`` (unit-vector coordinate units).  Raises
    ``ValueError`` on a head_dim other than the rotation's, or a norm overflowing ``norm_dtype``.
    """

    bits: int
    rotation: torch.Tensor
    centroids: torch.Tensor
    norm_dtype: torch.dtype = torch.float16
    store_rotation: bool = False
    token_group: int = 1

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        return None

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        return turbo_layout(self.bits, head_dim, self.norm_dtype)

    def encode(self, x: torch.Tensor) -> TurboBlock:
        """``x [B, H_kv, n, D]`` -> :class:`TurboBlock`, chunk by chunk along T
        (:func:`~kvbench.cache.chunks.token_chunks`: every token is coded alone, so the codes and
        norms equal one pass's, while the float32 working copies stay a chunk's).  Raises
        ``ValueError`` when a norm overflows ``norm_dtype`` or ``D`` is not the rotation's."""
        d = self.rotation.shape[0]
        if x.shape[-1] != d:
            raise ValueError(f"head_dim {x.shape[-1]} does not match the rotation's {d}")
        b, h, n, _ = x.shape
        codes = torch.empty(b, h, n, packed_size(d, self.bits), dtype=torch.uint8, device=x.device)
        norms = torch.empty(b, h, n, 1, dtype=self.norm_dtype, device=x.device)
        rot, c = self.rotation.to(x.device), self.centroids.to(x.device)
        mids = (c[1:] + c[:-1]) / 2
        for t0, t1 in token_chunks(b, h, n, d):
            codes[:, :, t0:t1], norms[:, :, t0:t1] = self._encode_tokens(x[:, :, t0:t1], rot, mids)
        return TurboBlock(codes, norms, rot, c, self.bits, self.store_rotation)

    def _encode_tokens(self, x: torch.Tensor, rot: torch.Tensor, mids: torch.Tensor):
        """Packed codes and norms of ``x [B, H_kv, n, D]`` (Algorithm 1: ``y = Pi u``,
        ``u = x / ||x||``, nearest centroid per coordinate); a token with a non-finite element
        gets a NaN norm (finite input, the common case, takes no masks: same values)."""
        xf = x.float()
        finite = None if all_finite(x) else torch.isfinite(xf).all(dim=-1, keepdim=True)
        xs = xf if finite is None else torch.where(finite, xf, torch.zeros((), device=x.device))
        norm = torch.linalg.vector_norm(xs, dim=-1, keepdim=True)  # [B, H, n, 1]
        norm_st = norm.to(self.norm_dtype)
        if bool((~torch.isfinite(norm_st)).any()):
            raise ValueError(f"a token norm overflows norm_dtype={self.norm_dtype}; use float32")
        if finite is not None:
            norm_st = torch.where(finite, norm_st, torch.full_like(norm_st, float("nan")))
        u = xs / torch.where(norm > 0, norm, torch.ones((), device=x.device))
        y = u @ rot.T  # y = Pi u, per row
        idx = bucket_index(y, mids)  # nearest centroid
        return pack_bits(idx, self.bits), norm_st


@dataclass(frozen=True)
class TurboQuantMSEConfig(MethodConfig):
    """Configuration of :class:`TurboQuantMSE`.

    Attributes
    ----------
    bits : b, codebook index bits, 1..4 (default 2).
    apply_to : ``keys`` | ``values`` | ``both`` (default).
    codebook : ``exact`` (Lemma 1 law for head_dim, default) or ``gaussian`` (N(0, 1/d)).
    seed : base seed of the rotations (default 0).
    store_rotation : hold and count each side's rotation (default False: regenerated).
    norm_dtype : ``float16`` (default) or ``float32``.
    residual_length, num_sink_tokens : full-precision windows (default 0, 0).
    """

    bits: int = kf.spec(2, int, choices=(1, 2, 3, 4))
    apply_to: str = kf.spec("both", str, choices=APPLY_TO)
    codebook: str = kf.spec("exact", str, choices=CODEBOOKS)
    seed: int = kf.spec(0, int, low=0)
    store_rotation: bool = kf.spec(False, bool)
    norm_dtype: str = kf.spec("float16", str, choices=tuple(NORM_DTYPES))
    residual_length: int = kf.spec(0, int, low=0)
    num_sink_tokens: int = kf.spec(0, int, low=0)


class TurboQuantMSE(Method):
    """Random rotation + per-coordinate Lloyd-Max codebook + fp16 norm, per token per head."""

    Config = TurboQuantMSEConfig
    description = "TurboQuant-MSE: random rotation, Lloyd-Max codebook, fp16 norm per token"
    source = "Zandieh et al., arXiv 2504.19874, §3.1 Algorithm 1, Lemma 1; docs/methods.md#turboquant-mse and docs/methods.md#worked-example-12"
    capabilities = Capabilities()

    def _applies(self, side: str) -> bool:
        return self.config.apply_to in (side, "both")

    def _codec(self, layer_idx: int, head_dim: int, side: int) -> TurboQuantCodec:
        c = self.config
        if head_dim < 2:
            raise ValueError(f"head_dim={head_dim} must be >= 2")
        cents, _ = lloyd_max_codebook(c.bits, head_dim if c.codebook == "exact" else None)
        if c.codebook == "gaussian":
            cents = cents / math.sqrt(head_dim)
        rot = haar_rotation(head_dim, c.seed + 2 * layer_idx + side)
        return TurboQuantCodec(
            c.bits,
            rot,
            torch.tensor(cents, dtype=torch.float32),
            NORM_DTYPES[c.norm_dtype],
            c.store_rotation,
        )

    def key_codec(self, layer_idx: int, head_dim: int) -> TurboQuantCodec | None:
        return self._codec(layer_idx, head_dim, 0) if self._applies("keys") else None

    def value_codec(self, layer_idx: int, head_dim: int) -> TurboQuantCodec | None:
        return self._codec(layer_idx, head_dim, 1) if self._applies("values") else None

    def key_schedule(self) -> object:
        r = self.config.residual_length
        return SlidingSchedule(r) if self._applies("keys") else NeverSchedule()

    def value_schedule(self) -> object:
        r = self.config.residual_length
        return SlidingSchedule(r) if self._applies("values") else NeverSchedule()

    def _layout(self, side: str, head_dim: int) -> BlockLayout:
        if not self._applies(side):
            return BlockLayout.full_precision(head_dim)
        return turbo_layout(self.config.bits, head_dim, NORM_DTYPES[self.config.norm_dtype])

    def key_layout(self, head_dim: int) -> BlockLayout:
        """:func:`turbo_layout` (full precision when ``apply_to`` leaves keys out)."""
        return self._layout("keys", head_dim)

    def value_layout(self, head_dim: int) -> BlockLayout:
        return self._layout("values", head_dim)
