"""Code-domain keys of :class:`kvbench.methods.qjl.QJLBlock` (``qjl``'s sketched keys): the QJL
estimator on the native per-token kernel, else in torch.  Registered (CPU and CUDA) in
:mod:`kvbench.kernels.cpu.codedomain`."""

from __future__ import annotations

import math

import torch

from kvbench.kernels.cpu import native
from kvbench.kernels.cpu.affine import native_allowed, note_impl
from kvbench.methods.qjl import QJLBlock


def native_scores(block: QJLBlock, q: torch.Tensor) -> torch.Tensor | None:
    """The estimator of :meth:`QJLBlock.scores` without outliers, in the code domain of the native
    kernels (:mod:`kvbench.kernels.cpu.native`): ``q [B, H_kv, M, D]`` float32 (query rows of
    one KV head) -> ``[B, H_kv, M, n]`` float32, or ``None`` where the kernels do not take
    the block (outlier channels, ``m`` not a multiple of 8, no native build).

    With sign bits ``b_j`` (``sign = 2 b_j - 1``) and ``c_t = sqrt(pi/2) / m * |k_t|``:
    ``c_t <S q, sign(S k_t)> = sum_j (S q)_j (b_j a_t + z_t)``, ``a_t = 2 c_t``, ``z_t =
    -c_t``: the per-token affine key kernel over the ``m`` sketch coordinates (one group),
    after sketching the query once (``S q``, ``M x D x m`` multiply-adds per KV head)."""
    m = block.sketch.shape[0]
    if block.outlier_idx is not None or not native.supports(block.signs, 1, m):
        return None
    sq = q @ block.sketch.to(q.device).T  # [B, H, M, m]
    c = (math.sqrt(math.pi / 2) / m * block.norms.float()).unsqueeze(-1)  # [B, H, n, 1]
    return native.keys_groups(block.signs, sq, 2 * c, -c, 1)


class QJLAttention:
    """Code-domain keys of :class:`QJLBlock` (a block kernel): the estimator
    :meth:`QJLBlock.scores` (the query sketched once per step, ``S q``, then dotted with the
    stored signs), on the native per-token kernel where it takes the block
    (:func:`native_scores`), else eager.  Keys only; the eager estimator is also the
    reference of these keys (they have no dequantized form)."""

    def key_reason(self, block: QJLBlock, head_dim: int) -> str | None:
        return None

    def value_reason(self, block: QJLBlock, head_dim: int) -> str | None:
        return "QJL sketches keys only"

    def key_logits(self, block: QJLBlock, q: torch.Tensor) -> torch.Tensor:
        # q [B, H_kv, M, D] (one row group per KV head) -> [B, H, M, n]
        out = native_scores(block, q) if native_allowed() else None
        if out is not None:
            note_impl("native")
            return out
        return block.scores(q)

    def value_output(self, block: QJLBlock, p: torch.Tensor) -> torch.Tensor:
        raise ValueError(self.value_reason(block, 0))
