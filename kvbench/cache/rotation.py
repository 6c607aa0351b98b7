"""Orthonormal channel rotations that every layer cache applies before it stores K/V.

``rotation: hadamard`` (docs/design.md#rotation): keys and values ``[..., D]`` are multiplied by
a block-diagonal Walsh-Hadamard matrix ``H`` (Sylvester construction, blocks of ``b`` =
``rotation_block`` channels, entries ``+-1/sqrt(b)``, so ``H H^T = I``) before anything is
stored; queries get the keys' transform (``(qH)(kH)^T = q k^T``) and the attention output the
inverse of the values' (``P (vH) H^T = P v``).  Sources: ggml-org/llama.cpp PR #21038 (rotate Q,
K, V with an orthonormal 64 x 64 Hadamard when the KV cache is quantized, store them, rotate
the attention output back; ``self_k_rot`` / ``self_v_rot`` in ``src/llama-graph.cpp``); QuaRot
(Ashkboos et al., arXiv:2404.00456, Sec. 4: Hadamard on keys and queries, computational
invariance; its random Hadamard ``diag(s) H`` with seeded signs ``s``); RotateKV (Su et al.,
arXiv:2501.16383).  ``rotation_seed``: ``None`` plain Walsh-Hadamard, an int: channel signs
``s = +-1`` drawn from ``torch.Generator().manual_seed(seed)`` first, ``x -> (x * s) H``.

A method may also reorder its key channels (``key_order``: ``int4-block`` with ``channel_order:
gguf``); the order acts first, the Hadamard on the reordered channels, as llama.cpp rotates the
channels in its own (GGUF) order.  Values are never reordered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvbench import fields as kf

ROTATIONS = ("none", "hadamard")
#: allowed ``rotation_block`` values
BLOCKS = tuple(2**i for i in range(1, 13))


def hadamard(block: int) -> torch.Tensor:
    """Orthonormal Sylvester Walsh-Hadamard matrix ``[block, block]`` float64 (``H_1 = [1]``,
    ``H_2n = [[H, H], [H, -H]]``, divided by ``sqrt(block)``).  ``ValueError`` unless ``block``
    is a power of two."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"a Walsh-Hadamard block must be a power of two; got {block}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(block)


def random_signs(dim: int, seed: int) -> torch.Tensor:
    """``[dim]`` float64 of ``+-1`` drawn from ``torch.Generator().manual_seed(seed)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (dim,), generator=g).to(torch.float64) * 2 - 1


@dataclass
class ChannelRotation:
    """The orthonormal transform of one layer's channels: keys ``x[..., key_order]`` (when
    given), then ``* signs`` (when ``seed`` is set), then block-diagonal ``H`` of ``block``
    channels (``None``: no Hadamard, only the order); values the same without the order.

    :meth:`forward` / :meth:`back` take ``side`` ``"keys"`` (also queries) or ``"values"`` (also
    the attention output) and ``[..., head_dim]`` of any float dtype; they compute in float32
    (float64 for float64 input) and return the input's dtype."""

    head_dim: int
    block: int | None = None
    seed: int | None = None
    key_order: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def _parts(self, ct: torch.dtype, device: torch.device) -> tuple:
        key = (ct, device)
        if key not in self._cache:
            h = None if self.block is None else hadamard(self.block).to(device, ct)
            s = None if self.seed is None else random_signs(self.head_dim, self.seed).to(device, ct)
            o = None if self.key_order is None else self.key_order.to(device)
            inv = None if o is None else torch.argsort(o)
            self._cache[key] = (h, s, o, inv)
        return self._cache[key]

    def forward(self, x: torch.Tensor, side: str) -> torch.Tensor:
        """``x`` rotated into the stored space."""
        return self._apply(x, side, False)

    def back(self, x: torch.Tensor, side: str) -> torch.Tensor:
        """The inverse of :meth:`forward` (the transpose: every step is orthonormal)."""
        return self._apply(x, side, True)

    def _apply(self, x: torch.Tensor, side: str, inverse: bool) -> torch.Tensor:
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        h, s, o, inv = self._parts(ct, x.device)
        if side != "keys":
            o = inv = None
        y = x
        if o is not None and not inverse:
            y = y[..., o]
        if h is not None:
            y = y.to(ct)
            if s is not None and not inverse:
                y = y * s
            b = self.block
            y = (y.reshape(*y.shape[:-1], -1, b) @ h).reshape(x.shape)  # H^-1 = H^T = H
            if s is not None and inverse:
                y = y * s
        if inv is not None and inverse:
            y = y[..., inv]
        return y.to(x.dtype)


class RotationConfig(Protocol):
    """The rotation fields of a method config (:class:`~kvbench.cache.method.MethodConfig`,
    whose module imports this one)."""

    @property
    def rotation(self) -> str: ...

    @property
    def rotation_block(self) -> int: ...

    @property
    def rotation_seed(self) -> int | None: ...


def for_config(
    config: RotationConfig, head_dim: int, key_order: torch.Tensor | None = None
) -> ChannelRotation | None:
    """The :class:`ChannelRotation` of a method config (``rotation``, ``rotation_block``,
    ``rotation_seed``) for ``head_dim`` channels, or ``None`` when it is the identity.  Raises
    ``ValueError`` naming ``rotation_block`` when it does not divide ``head_dim``."""
    if config.rotation == "none":
        return None if key_order is None else ChannelRotation(head_dim, key_order=key_order)
    block = config.rotation_block
    if head_dim % block:
        ok = [b for b in BLOCKS if head_dim % b == 0]
        kf.reject(type(config).__name__, "rotation_block", block,
                  f"powers of two that divide head_dim={head_dim}: {ok}")  # fmt: skip
    return ChannelRotation(head_dim, block, config.rotation_seed, key_order)
