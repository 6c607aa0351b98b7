"""``hf-quanto``: transformers' ``QuantizedCache(backend="quanto")`` (optimum-quanto).

A peer (``capabilities.layer_cache=False``, :mod:`kvbench.hf.peers`).  Behaviour, from
transformers ``cache_utils.py`` ``QuantizedLayer`` / ``QuantoQuantizedLayer`` (docs/methods.md#transformers-peers):

* prefill: the **whole prompt** is quantized at once and no full-precision residual is kept;
* decode: the step reads ``cat(dequant(Q), residual, new)``; when ``residual + 1 >=
  residual_length`` the whole concatenation (dequantized old tokens included) is re-quantized and
  the residual emptied, so every flush re-quantizes all history (docs/methods.md#worked-example-16);
* ``axis=0`` (default) groups ``q_group_size`` consecutive elements of the contiguous
  ``[B, H_kv, T, D]`` tensor, i.e. per-token groups along head_dim (KIVI's "per-token"; HF calls
  it "per-channel", the naming trap); ``axis=-1`` is per-channel over flattened rows;
* ``MaxOptimizer`` min-max scale and shift, stored in the K/V dtype; codes qint2/qint4 packed
  into uint8.

Bytes are counted from the packed ``uint8`` data and the ``_scale``/``_shift`` tensors inside
quanto's ``WeightQBitsTensor`` (whose own ``numel() * element_size()`` reports the full-precision
size).  Defaults are transformers' (4 bits, axes 0, groups of 64, residual 128).
Requires ``optimum-quanto >= 0.2.5`` (``pip install optimum-quanto``, or the clone's ``.[peers]`` extra).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

from kvbench import fields as kf
from kvbench.cache.layout import BlockLayout, Codes, GroupTerms
from kvbench.cache.method import MethodConfig
from kvbench.hf.peers import HFPeer, text_config


@dataclass(frozen=True)
class HFQuantizedConfig(MethodConfig):
    """The arguments of transformers' ``QuantizedCache`` for a group-wise backend.

    Attributes
    ----------
    nbits : code width (quanto: 2 or 4).
    axis_key, axis_value : quantization axis (quanto: 0 = per-token groups along head_dim,
        -1 = per-channel).
    q_group_size : elements per group.
    residual_length : the full-precision window; a flush re-quantizes everything.
    """

    nbits: int = kf.spec(4, int, choices=(2, 4))
    axis_key: int = kf.spec(0, int, choices=(0, -1))
    axis_value: int = kf.spec(0, int, choices=(0, -1))
    q_group_size: int = kf.spec(64, int, low=1)
    residual_length: int = kf.spec(128, int, low=0)

    def cache_kwargs(self) -> dict[str, int]:
        return {
            "nbits": self.nbits,
            "axis_key": self.axis_key,
            "axis_value": self.axis_value,
            "q_group_size": self.q_group_size,
            "residual_length": self.residual_length,
        }


class HFQuanto(HFPeer):
    """transformers ``QuantizedCache`` with the optimum-quanto backend."""

    Config = HFQuantizedConfig
    backend: ClassVar[str] = "quanto"
    module: ClassVar[str] = "optimum.quanto"
    requirement: ClassVar[str] = "optimum-quanto>=0.2.5"
    description = "peer: transformers QuantizedCache, quanto backend (re-quantizes all on flush)"
    source = "transformers cache_utils.QuantoQuantizedLayer; optimum-quanto; docs/methods.md#transformers-peers"

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec(self.module.split(".")[0]) is None or (
            "." in self.module and importlib.util.find_spec(self.module) is None
        ):
            return (
                f"method {self.name or self.backend!r} needs {self.requirement} "
                f"(pip install '{self.requirement}', or .venv/bin/pip install -e '.[peers]' in a "
                "kvbench clone)"
            )
        return None

    def _layer_class(self) -> type:
        from transformers import cache_utils

        return cache_utils.QuantoQuantizedLayer

    def new_hf_layer(self) -> Any:
        self._check_available()
        return self._layer_class()(**self.config.cache_kwargs())

    def transformers_cache(self, model: Any, attend: bool = False) -> Any:
        """``QuantizedCache(backend, config, **fields)`` for ``model`` (a model or its config)."""
        from transformers import QuantizedCache

        self._check_available()
        return QuantizedCache(self.backend, text_config(model), **self.config.cache_kwargs())

    def key_layout(self, head_dim: int) -> BlockLayout:
        """``nbits`` codes + a 16-bit scale and a 16-bit shift per ``q_group_size`` elements
        (scale and shift are stored in the K/V dtype; 16-bit K/V assumed, as in the paper)."""
        c = self.config
        terms = GroupTerms(("scale", "shift"), "float16", 1, c.q_group_size)
        return BlockLayout(Codes.uniform(c.nbits, head_dim), terms)

    def value_layout(self, head_dim: int) -> BlockLayout:
        return self.key_layout(head_dim)
