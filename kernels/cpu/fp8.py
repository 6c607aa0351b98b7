"""Code-domain attention of :class:`kvbench.methods.fp8.FP8Block` (the ``fp8`` method's blocks):
a 256-entry table of the format's values read by the native or eager kernels.
Registered in :mod:`kvbench.kernels.cpu.codedomain`.
"""

from __future__ import annotations

import torch

from kvbench.kernels.cpu import native
from kvbench.kernels.cpu.affine import EAGER_CHUNK_TOKENS, native_allowed, note_impl
from kvbench.methods.fp8 import FORMATS, FP8Block, expand_groups

_LUTS: dict[tuple[str, str], torch.Tensor] = {}


def fp8_table(fmt: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Float32 ``[256]``: the value of each fp8 byte of format ``fmt`` (NaN bytes are NaN).

    A 256-entry lookup gives exactly the values of the ``fp8 -> float32`` cast (the table is
    made by that cast) and is several times faster than the cast on the CPU."""
    key = (fmt, str(device))
    if key not in _LUTS:
        bytes_ = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _LUTS[key] = bytes_.view(FORMATS[fmt]).float().to(device)
    return _LUTS[key]


def _token_scale(block: FP8Block) -> torch.Tensor | None:
    """Float32 ``[B|1, H|1, 1, n]``: the scale of each token (``None``: unit scale)."""
    if block.scale is None:
        return None
    return expand_groups(block.scale, block.group_len).float()[..., 0].unsqueeze(2)


def _bytes(block: FP8Block) -> torch.Tensor:
    return block.codes if block.codes.dtype == torch.uint8 else block.codes.view(torch.uint8)


class FP8Attention:
    """Code-domain attention terms of :class:`FP8Block` (a block kernel).

    ``logit_t = s_t (q . fp8(c_t))`` and ``out = sum_t (p_t s_t) fp8(c_t)`` with ``fp8(.)`` the
    256-entry table :func:`fp8_table` (no dequantized cache: native, the lookup is done in
    registers; eager, in chunks of ``EAGER_CHUNK_TOKENS`` tokens)."""

    def key_reason(self, block: FP8Block, head_dim: int) -> str | None:
        return None

    value_reason = key_reason

    def key_logits(self, block: FP8Block, q: torch.Tensor) -> torch.Tensor:
        codes, lut = _bytes(block), fp8_table(block.fmt, q.device)
        if native_allowed() and native.supports(codes, 8, q.shape[-1]):
            out = native.keys_lut(codes, q, lut, 8)
            note_impl("native")
        else:
            outs = []
            for t0 in range(0, codes.shape[2], EAGER_CHUNK_TOKENS):
                x = lut[codes[:, :, t0 : t0 + EAGER_CHUNK_TOKENS].long()]
                outs.append(torch.matmul(q, x.transpose(-1, -2)))
            out = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
        s = _token_scale(block)
        return out if s is None else out * s

    def value_output(self, block: FP8Block, p: torch.Tensor) -> torch.Tensor:
        s = _token_scale(block)
        ps = p if s is None else p * s
        codes, lut = _bytes(block), fp8_table(block.fmt, p.device)
        if native_allowed() and native.supports(codes, 8, codes.shape[-1]):
            note_impl("native")
            return native.values_lut(codes, ps, lut, 8, codes.shape[-1])
        out = 0
        for t0 in range(0, codes.shape[2], EAGER_CHUNK_TOKENS):
            sl = slice(t0, t0 + EAGER_CHUNK_TOKENS)
            out = out + torch.matmul(ps[..., sl], lut[codes[:, :, sl].long()])
        return out
