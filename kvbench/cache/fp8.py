"""The stored block of the ``fp8`` method: float8 codes with optional per-group scales.

:class:`FP8Block` is the layout; ``methods/fp8.py`` (the codec) builds it and
``kvbench.kernels.cpu.fp8`` reads it in the code domain.  Formats: :data:`FORMATS`
(Micikevicius et al., arXiv 2209.05433, Table 1).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from kvbench.cache.blocks import own_storage

FORMATS = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
}


def fp8_decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Float32 values of stored fp8 codes ``[...]``.

    ``codes`` is a tensor of ``FORMATS[fmt]`` or a uint8 buffer holding fp8 bit patterns; the
    buffer is reinterpreted with ``.view`` (bytes 0x3C, 0xC0, 0x38, 0x00 in e5m2 are
    [1, -2, 0.5, 0]), never value-cast (uint8 buffer holding fp8 bits must be reinterpreted, not value-cast: vllm-project/vllm PR#3234 (fixes #3156), docs/methods.md#uint8-storage-reinterpreted-as-fp8).  Raises ``ValueError`` for any other dtype.
    """
    dt = FORMATS[fmt]
    if codes.dtype == torch.uint8:
        codes = codes.view(dt)
    elif codes.dtype != dt:
        raise ValueError(f"fp8 {fmt} codes must be {dt} or uint8 bits, got {codes.dtype}")
    return codes.float()


def expand_groups(t: torch.Tensor, group_len: list[int]) -> torch.Tensor:
    """Per-group scales ``[., ., NG, 1]`` -> per token ``[., ., n, 1]``."""
    if all(g == 1 for g in group_len):
        return t
    return t.repeat_interleave(torch.tensor(group_len, device=t.device), dim=2)


@dataclass
class FP8Block:
    """fp8 codes of a run of tokens.

    Attributes
    ----------
    codes : ``[B, H_kv, n, D]`` of ``FORMATS[fmt]`` (or uint8 fp8 bits), 1 byte per element.
    scale : ``[B|1, H_kv|1, NG, 1]`` float32/float16, or ``None`` for unit scale.
    group_len : tokens covered by each of the NG scale groups (sums to ``n``).
    fmt : format name, a key of :data:`FORMATS`.
    batch_shared : the scale is shared by every batch row (per-tensor).
    """

    codes: torch.Tensor
    scale: torch.Tensor | None
    group_len: list[int]
    fmt: str
    batch_shared: bool = False

    @property
    def ntokens(self) -> int:
        return self.codes.shape[2]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        x = fp8_decode(self.codes, self.fmt)
        if self.scale is not None:
            x = x * expand_groups(self.scale, self.group_len).float()
        return x.to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [("codes", self.codes)]
        return out if self.scale is None else [*out, ("scales", self.scale)]

    def cat(self, other: FP8Block) -> FP8Block:
        if other.fmt != self.fmt or (other.scale is None) != (self.scale is None):
            raise ValueError("cannot concatenate fp8 blocks of different formats or scale modes")
        scale = None if self.scale is None else torch.cat([self.scale, other.scale], dim=2)
        codes = torch.cat([self.codes, other.codes], dim=2)
        return replace(self, codes=codes, scale=scale, group_len=self.group_len + other.group_len)

    def crop(self, n: int) -> FP8Block:
        starts = itertools.accumulate(self.group_len, initial=0)
        lens = [min(g, n - s) for g, s in zip(self.group_len, starts) if s < n]
        scale = None if self.scale is None else own_storage(self.scale[:, :, : len(lens)])
        return replace(self, codes=own_storage(self.codes[:, :, :n]), scale=scale, group_len=lens)

    def index_batch(self, idx: torch.Tensor) -> FP8Block:
        codes = self.codes.index_select(0, idx.to(self.codes.device))
        scale = self.scale  # a per-tensor scale is shared by all rows; others follow the codes
        if scale is not None and not self.batch_shared:
            scale = scale.index_select(0, idx.to(scale.device))
        return replace(self, codes=codes, scale=scale)
