"""The stored block of ``turboquant-mse``: codebook indices of the rotated unit vector and the
token's norm (Zandieh et al., arXiv 2504.19874, Alg. 1).  ``methods/turboquant_mse.py`` (the
codec) builds :class:`TurboBlock`; ``kvbench.kernels.cpu.turbo`` reads it in the code
domain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvbench.cache.blocks import own_storage
from kvbench.cache.quant import unpack_bits


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
