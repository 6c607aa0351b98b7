"""Peers: transformers' own caches wrapped as kvbench methods, and honest byte counts for them.

The systems users would otherwise pick (``DynamicCache``, ``QuantizedCache`` with the quanto,
HQQ or fp8 backend) are registered as methods (``hf-dynamic``, ``hf-quanto``, ``hf-hqq``,
``hf-fp8``) so the memory and latency workloads measure them exactly like kvbench methods.
They have no kvbench :class:`~kvbench.cache.layer.LayerCache` (``capabilities.layer_cache=False``):
``new_layer`` raises, and workloads that need layer caches (fidelity) skip them.  What they
provide instead:

* ``transformers_cache(model)``: the transformers ``Cache`` for ``model`` (latency workload);
* ``new_hf_layer()``: one transformers cache layer, fed by ``layer.update(k, v)`` (memory
  workload: captured K/V replayed layer by layer, the same protocol as ``LayerCache``).

Memory honesty (docs/design.md#memory): quanto's tensor subclasses report the full-precision
size as ``numel() * element_size()`` and HQQ keeps scales and zeros in a ``meta`` dict, so the
byte count walks every tensor a layer holds down to the plain tensors that own storage
(:func:`plain_tensors`) and counts each allocation once (``untyped_storage().nbytes()``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.cache.layer import BYTE_KEYS
from kvbench.cache.method import Capabilities, Method, MethodConfig

if TYPE_CHECKING:  # annotations only: importing this module does not load transformers
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.cache_utils import Cache, CacheLayerMixin

#: attribute / meta-dict names of quantization metadata (scale, zero or shift of a group)
SCALE_NAMES = frozenset({"_scale", "_shift", "scale", "zero", "_zero", "shift"})
#: attribute names of code tensors inside a quantized tensor
CODE_NAMES = frozenset({"_data", "W_q", "data"})


def plain_tensors(obj: object, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every plain tensor reachable from ``obj`` as ``(path, tensor)``.

    Recurses into tensor subclasses (``__tensor_flatten__``: quanto's ``WeightQBitsTensor`` ->
    ``PackedTensor`` -> uint8 ``_data``), tuples, lists and dicts (HQQ's ``(W_q, meta)``).
    ``path`` joins the attribute names with ``.``.
    """
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, torch.Tensor):
        # a tensor subclass's protocol (quanto's): plain tensors have none, and its inner
        # tensors are attributes named by it
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if type(obj) is not torch.Tensor and flatten is not None:
            names, _ = obj.__tensor_flatten__()
            for n in names:
                out += plain_tensors(getattr(obj, n), f"{path}.{n}" if path else n)
        else:
            out.append((path, obj))
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            out += plain_tensors(x, f"{path}.{i}" if path else str(i))
    elif isinstance(obj, dict):
        for k, x in obj.items():
            out += plain_tensors(x, f"{path}.{k}" if path else str(k))
    return out


def storage_nbytes(obj: object) -> int:
    """Bytes of the distinct allocations behind every plain tensor reachable from ``obj``."""
    seen: dict[tuple[str, int], int] = {}
    for _, t in plain_tensors(obj):
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if st.nbytes():
            seen[key] = max(seen.get(key, 0), st.nbytes())
    return sum(seen.values())


def _category(path: str) -> str:
    """``codes``/``scales``/``metadata`` for a tensor inside a quantized state."""
    parts = path.split(".") if path else []
    if any(p in SCALE_NAMES for p in parts):
        return "scales"
    if not parts or parts[-1] in CODE_NAMES or parts == ["0"]:
        return "codes"  # a plain code tensor, quanto's packed data, the first of a tuple
    if len(parts) == 1 and parts[0].isdigit():
        return "scales"  # a bare tensor after the codes: fp8's per-tensor scale
    return "metadata"


def hf_layer_tensors(layer: CacheLayerMixin) -> list[tuple[str, str, torch.Tensor]]:
    """Every plain tensor a transformers cache layer holds, as ``(side, category, tensor)``.

    ``keys``/``values`` (``DynamicLayer``'s tensors; the full-precision residual of a
    ``QuantizedLayer``) are ``residual``; ``_quantized_keys``/``_quantized_values`` are split
    into ``codes`` (packed data, fp8 payload), ``scales`` (scale, zero, shift) and ``metadata``
    (any other tensor, e.g. in HQQ's meta dict).  Tensors are deduplicated by allocation.
    """
    out, seen = [], set()
    for side, plain, quant in (
        ("key", layer.keys, "_quantized_keys"),
        ("value", layer.values, "_quantized_values"),
    ):
        items = [("residual", t) for _, t in plain_tensors(plain)]
        # a QuantizedLayer's quantized part exists once it flushed (other layers have none)
        items += [(_category(p), t) for p, t in plain_tensors(getattr(layer, quant, None))]
        for cat, t in items:
            key = (str(t.device), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key in seen or t.untyped_storage().nbytes() == 0:
                continue
            seen.add(key)
            out.append((side, cat, t))
    return out


def hf_layer_nbytes(layer: CacheLayerMixin) -> dict[str, int]:
    """Bytes held by a transformers cache layer, with the keys of ``LayerCache.nbytes()``
    (``codes, scales, metadata, residual, sinks, key_total, value_total, total``), summed from
    the storage of :func:`hf_layer_tensors` (inner storage of tensor subclasses)."""
    out = dict.fromkeys(BYTE_KEYS, 0) | {"key_total": 0, "value_total": 0}
    for side, cat, t in hf_layer_tensors(layer):
        n = t.untyped_storage().nbytes()
        out[cat] += n
        out[f"{side}_total"] += n
    out["total"] = out["key_total"] + out["value_total"]
    return out


def hf_layer_keys_values(layer: CacheLayerMixin) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V ``[B, H_kv, T, D]`` a transformers cache layer holds now, dequantized (the
    quantized part, then the full-precision residual)."""
    parts = []
    for fp, quant in ((layer.keys, "_quantized_keys"), (layer.values, "_quantized_values")):
        q = getattr(layer, quant, None)  # a QuantizedLayer's, once it flushed
        got = [] if q is None else [layer._dequantize(q)]
        if fp is not None and fp.dim() == 4 and fp.shape[-2]:
            got.append(fp)
        if not got:
            raise ValueError("the cache layer is empty")
        dt = got[-1].dtype
        parts.append(torch.cat([g.to(dt) for g in got], dim=-2) if len(got) > 1 else got[0])
    return parts[0], parts[1]


def cache_nbytes(cache: Cache) -> dict[str, int]:
    """Bytes held by a whole cache: kvbench's ``QuantizedKVCache.nbytes()``, or the sum of
    :func:`hf_layer_nbytes` over a transformers cache's layers."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return cache.nbytes()
    return sum_counts(hf_layer_nbytes(layer) for layer in cache.layers)


def sum_counts(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Per key, the sum of its values over ``parts`` (keys in first-seen order)."""
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


class HFPeer(Method, abc.ABC):
    """Base of the transformers-cache peers (see the module docstring).

    Subclasses implement :meth:`new_hf_layer` and :meth:`transformers_cache`, and may override
    :meth:`unavailable_reason` (a missing optional package).
    """

    #: padding=False: kvbench does not check how a transformers cache treats pads (quantized
    #: peers put them into their statistics)
    capabilities: ClassVar[Capabilities] = Capabilities(layer_cache=False, padding=False)
    #: the pip requirement that provides the backend (``None``: transformers alone)
    requirement: ClassVar[str | None] = None

    def __init__(self, config: MethodConfig | None = None, **overrides: object) -> None:
        """As :class:`~kvbench.cache.method.Method`; ``ValueError`` for ``prefill_attention``
        other than ``full``: a peer's prompt attends to what its transformers cache's
        ``update`` returns (the prompt's own K/V), which kvbench does not change."""
        super().__init__(config, **overrides)
        if self.config.prefill_attention != "full":
            self.config.reject(
                "prefill_attention",
                "'full' (a transformers peer's prompt attends to the K/V its own cache's update "
                "returns; kvbench cannot make it read the stored cache)",
            )

    def new_layer(self, layer_idx: int, num_kv_heads: int, head_dim: int, *args, **kwargs):
        raise ValueError(
            f"method {self.name or type(self).__name__!r} wraps a transformers cache "
            "(capabilities.layer_cache=False) and has no kvbench LayerCache; it runs in the "
            "memory and latency workloads (transformers_cache / new_hf_layer), not in workloads that "
            "replay layer caches (fidelity)"
        )

    @abc.abstractmethod
    def new_hf_layer(self) -> CacheLayerMixin:
        """One empty transformers cache layer (``CacheLayerMixin``), fed by ``update(k, v)``."""

    @abc.abstractmethod
    def transformers_cache(
        self, model: PreTrainedModel | PretrainedConfig, attend: bool = False
    ) -> Cache:
        """The peer's transformers ``Cache`` for ``model`` (see :meth:`Method.transformers_cache`)."""

    def _check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise ValueError(reason)


def text_config(model: PreTrainedModel | PretrainedConfig) -> PretrainedConfig:
    """The decoder config of a model or config (``get_text_config(decoder=True)``)."""
    config = getattr(model, "config", model)  # a model's, or the config itself
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


__all__ = [
    "HFPeer",
    "cache_nbytes",
    "hf_layer_keys_values",
    "hf_layer_nbytes",
    "hf_layer_tensors",
    "plain_tensors",
    "storage_nbytes",
    "sum_counts",
    "text_config",
]
