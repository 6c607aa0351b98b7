"""``hf-fp8``: transformers' ``QuantizedCache(backend="fp8")`` (``Fp8QuantizedLayer``).

A peer (``capabilities.layer_cache=False``, :mod:`kvbench.hf.peers`), registered only usefully
where the installed transformers offers the backend (5.24 does; older releases raise a clear
error through :meth:`HFFP8.unavailable_reason`).  From transformers ``cache_utils.py``: K and V
are stored as ``float8_e4m3fn`` with one float32 scale per tensor (per layer and side),
calibrated as ``amax / 448`` on the prompt and frozen; later tokens are appended with that scale
(saturating casts are the backend's behaviour); no residual, no re-quantization; every step
dequantizes the whole history.  8 bits per element plus 4 bytes per layer and side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench.cache.layout import BlockLayout, Codes
from kvbench.cache.method import MethodConfig
from kvbench.hf.peers import HFPeer, text_config


@dataclass(frozen=True)
class HFFP8Config(MethodConfig):
    """No fields: the backend quantizes per tensor and takes no group-wise options."""


class HFFP8(HFPeer):
    """transformers ``QuantizedCache`` with the fp8 backend (per-tensor e4m3 scale)."""

    Config = HFFP8Config
    description = "peer: transformers QuantizedCache, fp8 backend (e4m3, per-tensor scale)"
    source = "transformers cache_utils.Fp8QuantizedLayer (5.24)"

    def unavailable_reason(self) -> str | None:
        from transformers import __version__, cache_utils

        if not hasattr(cache_utils, "Fp8QuantizedLayer"):
            return (
                f"method 'hf-fp8' needs a transformers release with the fp8 QuantizedCache "
                f"backend (Fp8QuantizedLayer); installed: transformers {__version__}"
            )
        return None

    def new_hf_layer(self) -> Any:
        self._check_available()
        from transformers.cache_utils import Fp8QuantizedLayer

        return Fp8QuantizedLayer()

    def transformers_cache(self, model: Any, attend: bool = False) -> Any:
        from transformers import QuantizedCache

        self._check_available()
        return QuantizedCache("fp8", text_config(model))

    def key_layout(self, head_dim: int) -> BlockLayout:
        """float8 e4m3 codes; the one float32 scale per tensor is not amortized here (4 bytes
        per layer)."""
        return BlockLayout(Codes.uniform(8, head_dim, "float8_e4m3fn"))

    def value_layout(self, head_dim: int) -> BlockLayout:
        return self.key_layout(head_dim)
