"""The stored key block of ``polarquant``: each RoPE pair ``(x, y)`` as a quantized radius and
angle (Wu et al., PolarQuant).  ``methods/polarquant.py`` (the codec) builds
:class:`PolarBlock`; ``kvbench.kernels.cpu.polar`` reads it in the code domain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvbench.cache.blocks import AffineBlock

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
