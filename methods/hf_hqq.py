"""``hf-hqq``: transformers' ``QuantizedCache(backend="hqq")`` (HQQ, Badri & Shaji 2023).

A peer (``capabilities.layer_cache=False``, :mod:`kvbench.hf.peers`) with the same residual
logic as ``hf-quanto`` (whole prompt quantized at prefill; a flush re-quantizes all history;
docs/methods.md#transformers-peers) and HQQ's quantizer (``hqq.core.quantize.Quantizer.quantize``: min-max with
``scale_inv = (qmax / (max - min)).clamp(max=2e4)``, proximal ``optimize=True``, codes packed
into uint8).  HQQ keeps its codes outside any tensor subclass, as a plain uint8 tensor beside a
``meta`` dict holding the ``scale`` and ``zero`` tensors (in the compute dtype); the byte count
walks that dict.  ``axis=1`` groups ``q_group_size`` consecutive channels of a token
(per-token); ``axis=0`` (transformers' default) reshapes to ``[q_group_size, -1]``, so a group is
``q_group_size`` elements strided through the flat tensor: not a clean per-channel grouping of a
4-D cache (docs/methods.md#hf-hqq).  Defaults are transformers' (4 bits, axes 0, groups of 64,
residual 128).  Requires ``hqq`` (``pip install hqq``, or the clone's ``.[peers]`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench import fields as kf
from kvbench.cache.layout import BlockLayout, Codes, GroupTerms

from .hf_quanto import HFQuantizedConfig, HFQuanto


@dataclass(frozen=True)
class HFHQQConfig(HFQuantizedConfig):
    """As :class:`HFQuantizedConfig`; HQQ allows ``nbits`` in 1, 2, 3, 4, 8 and axes 0, 1."""

    nbits: int = kf.spec(4, int, choices=(1, 2, 3, 4, 8))
    axis_key: int = kf.spec(0, int, choices=(0, 1))
    axis_value: int = kf.spec(0, int, choices=(0, 1))


class HFHQQ(HFQuanto):
    """transformers ``QuantizedCache`` with the HQQ backend."""

    Config = HFHQQConfig
    backend: ClassVar[str] = "hqq"
    module: ClassVar[str] = "hqq"
    requirement: ClassVar[str] = "hqq>=0.2"
    description = "peer: transformers QuantizedCache, HQQ backend (re-quantizes all on flush)"
    source = "transformers cache_utils.HQQQuantizedLayer; hqq Quantizer; docs/methods.md#transformers-peers"

    def _layer_class(self) -> type:
        from transformers import cache_utils

        return cache_utils.HQQQuantizedLayer

    def key_layout(self, head_dim: int) -> BlockLayout:
        """``nbits`` + 16-bit scale and zero per ``q_group_size`` elements (16-bit compute dtype
        assumed; 3-bit codes are packed 10 per int32, i.e. 3.2 stored bits, not modelled)."""
        c = self.config
        terms = GroupTerms(("scale", "zero"), "float16", 1, c.q_group_size)
        return BlockLayout(Codes.uniform(c.nbits, head_dim), terms)
