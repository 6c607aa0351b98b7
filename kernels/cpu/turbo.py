"""Code-domain attention of :class:`kvbench.methods.turboquant_mse.TurboBlock` (``turboquant-mse``'s
blocks): the query rotated once, a codebook lookup per code, one rotation of the output.
Registered in :mod:`kvbench.kernels.cpu.codedomain`."""

from __future__ import annotations

import torch

from kvbench.cache.quant import unpack_bits
from kvbench.kernels.cpu import native
from kvbench.kernels.cpu.affine import EAGER_CHUNK_TOKENS, native_allowed, note_impl
from kvbench.kernels.cpu.native import code_layout
from kvbench.methods.turboquant_mse import TurboBlock


class TurboAttention:
    """Code-domain attention of :class:`TurboBlock` (a block kernel).

    With ``x_t = |x_t| centroid[c_t] Pi`` (Zandieh et al., arXiv 2504.19874, Alg. 1): keys
    ``q . x_t = |x_t| (q Pi^T) . centroid[c_t]`` (the query rotated once per step); values
    ``sum_t p_t x_t = (sum_t p_t |x_t| centroid[c_t]) Pi`` (one rotation of the output).  No
    rotated or dequantized cache is made: native, the codebook lookup is done in registers;
    eager, unpack + lookup + matmul in chunks of ``EAGER_CHUNK_TOKENS``."""

    def key_reason(self, block: TurboBlock, head_dim: int) -> str | None:
        return (
            None
            if 8 % block.bits == 0 or head_dim % code_layout(block.bits)[1] == 0
            else ("head_dim does not fit whole code words")
        )

    value_reason = key_reason

    def key_logits(self, block: TurboBlock, q: torch.Tensor) -> torch.Tensor:
        rot = block.rotation.to(q.device)
        cent = block.centroids.to(q.device).float()
        qr = q @ rot.T  # [B, H, M, D]
        d, bits = rot.shape[0], block.bits
        if native_allowed() and native.supports(block.codes, bits, d):
            out = native.keys_lut(block.codes, qr, cent, bits)
            note_impl("native")
        else:
            outs = []
            for t0 in range(0, block.ntokens, EAGER_CHUNK_TOKENS):
                sl = slice(t0, t0 + EAGER_CHUNK_TOKENS)
                y = cent[unpack_bits(block.codes[:, :, sl], bits, d).long()]
                outs.append(torch.matmul(qr, y.transpose(-1, -2)))
            out = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
        return out * block.norms.float()[..., 0].unsqueeze(2)

    def value_output(self, block: TurboBlock, p: torch.Tensor) -> torch.Tensor:
        rot = block.rotation.to(p.device)
        cent = block.centroids.to(p.device).float()
        ps = p * block.norms.float()[..., 0].unsqueeze(2)
        d, bits = rot.shape[0], block.bits
        if native_allowed() and native.supports(block.codes, bits, d):
            out = native.values_lut(block.codes, ps, cent, bits, d)
            note_impl("native")
        else:
            out = 0
            for t0 in range(0, block.ntokens, EAGER_CHUNK_TOKENS):
                sl = slice(t0, t0 + EAGER_CHUNK_TOKENS)
                y = cent[unpack_bits(block.codes[:, :, sl], bits, d).long()]
                out = out + torch.matmul(ps[..., sl], y)
        return out @ rot
