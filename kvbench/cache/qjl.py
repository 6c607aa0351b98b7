"""The stored key block of ``qjl``: 1-bit Johnson-Lindenstrauss sketches of the keys and their
norms, with optional outlier channels sketched apart (Zandieh et al., QJL).  The block has no
dequantized form; :meth:`QJLBlock.scores` is its estimator of ``<q, k>``.  ``methods/qjl.py``
(the codec) builds it; ``kvbench.kernels.cpu.qjl`` reads it in the code domain.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch

from kvbench.cache.blocks import own_storage
from kvbench.cache.quant import unpack_bits

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
        raise NotImplementedError(NO_KEYS)

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
