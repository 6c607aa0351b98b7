"""Rotary position embedding (RoPE) as Hugging Face computes it: angles, pairs, rotation, and
:class:`Rotary`, what a block of pre-RoPE codes adds when it is read (KVQuant's pre-RoPE keys,
``methods/kvquant.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ANGLES: dict[tuple[float, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_angles(start: int, n: int, d: int, theta: float, device=None):
    """``(cos, sin)`` float32 ``[n, D/2]`` of HF's RoPE angles ``pos * theta^(-2i/D)`` at
    positions ``start .. start+n-1`` (computed in float32 as HF does).  Tables are kept per
    ``(theta, D, device)`` and grown by doubling, so a decode step reads them instead of
    recomputing ``n * D / 2`` cosines; each entry equals the direct computation bit for bit."""
    key = (float(theta), d, str(device or "cpu"))
    cached = _ANGLES.get(key)
    if cached is None or cached[0].shape[0] < start + n:
        cap = max(start + n, 2 * (0 if cached is None else cached[0].shape[0]), 256)
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        ang = torch.arange(0, cap, dtype=torch.float32)[:, None] * inv[None, :]
        cached = _ANGLES[key] = (ang.cos().to(device), ang.sin().to(device))
    return cached[0][start : start + n], cached[1][start : start + n]


def rope_pairs(d: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices ``(first, second)`` ``[D/2]`` of each RoPE pair: ``(i, i + D/2)`` for
    ``rotate_half``, ``(2i, 2i + 1)`` for ``interleaved``."""
    if layout == "rotate_half":
        return torch.arange(d // 2), torch.arange(d // 2, d)
    return torch.arange(0, d, 2), torch.arange(1, d, 2)


def rope(x: torch.Tensor, start: int, theta: float, layout: str, inverse: bool = False):
    """Rotate ``x [..., n, D]`` at positions ``start .. start+n-1`` (HF float32 angles
    ``pos * theta^(-2i/D)``); ``inverse``: the inverse rotation.  Returns float32."""
    n, d = x.shape[-2], x.shape[-1]
    cos, sin = rope_angles(start, n, d, theta)
    cos, sin = cos.to(x.device), sin.to(x.device) * (-1 if inverse else 1)
    xf = x.float()
    if layout == "rotate_half":
        a, b = xf[..., : d // 2], xf[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


@dataclass(frozen=True)
class Rotary:
    """What a pre-RoPE block's reads add: token ``j`` of the block is read rotated by RoPE at
    position ``start + j`` (base ``theta``, pair ``layout``, see :func:`rope`)."""

    theta: float
    layout: str
    start: int
