"""Run a LayerCache's decode attention on the fused Triton kernel.

The CUDA attention backend (:mod:`kvbench.kernels.triton_backend`, entry point ``triton`` of
``kvbench.backends``) calls :func:`unsupported` and :func:`fused_attend`.
:func:`try_fused_attend` is the stand-alone form: the kernel's output, or ``None`` so that the
caller takes the reference path (``keys_values()`` + softmax).  ``None`` is returned, without touching Triton,
for CPU tensors (device placement before a kernel launch (CPU tensor to Triton): jy-yuan/KIVI#24 and #13, docs/methods.md#device-placement-before-a-kernel-launch: normal CPU use never reaches a GPU launch), when Triton is missing,
when ``KVBENCH_FUSED_ATTENTION=0``, and for layouts the
kernel does not cover (head_dim other than 64/128, several query tokens, symmetric or
per-head/per-tensor keys, float8 scales, more than two channel classes, ...).  Either way the
layer cache records which path ran in ``layer_cache.attend_path`` (``"triton"`` or
``"reference"``) and why in ``layer_cache.attend_path_reason``.

Block types are handed to the kernel by converters that the caller passes as :class:`Layouts`
(per exact block type; ``kvbench.kernels.triton_backend.LAYOUTS`` gives the core's:
``AffineBlock``, ``MixedChannelBlock``), so this module imports only torch; it never imports
nor looks up the kvbench core.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENV_SWITCH = "KVBENCH_FUSED_ATTENTION"
TRITON_PATH, REFERENCE_PATH = "triton", "reference"
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Layouts:
    """How the kernel reads each stored block type (exact types; this module imports only
    torch, so the converters come from the caller).

    ``key[type](block, head_dim)`` -> :class:`~.decode_attention.QuantKeys` or a reason string;
    ``value[type](block)`` -> :class:`~.decode_attention.QuantValues` or a reason string."""

    key: dict
    value: dict


def key_layout(block, head_dim: int, layouts: Layouts):
    """:class:`~.decode_attention.QuantKeys` for a key block, or a reason string."""
    fn = layouts.key.get(type(block))
    if fn is None:
        return f"key block {type(block).__name__} has no fused kernel"
    return fn(block, head_dim)


def value_layout(block, layouts: Layouts):
    """:class:`~.decode_attention.QuantValues` for a value block, or a reason string."""
    fn = layouts.value.get(type(block))
    if fn is None:
        return f"value block {type(block).__name__} has no fused kernel"
    return fn(block)


def unsupported(layer_cache, query: torch.Tensor, layouts: Layouts) -> str | None:
    """Why :func:`fused_attend` cannot run ``query`` over ``layer_cache`` (``None``: it can);
    checks only, launches nothing."""
    from .decode_attention import SUPPORTED_HEAD_DIMS

    d = query.shape[-1]
    if query.dim() != 4 or query.shape[2] != 1:
        return "the fused kernel takes one query token per sequence"
    if d not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={d} not supported by the fused kernel"
    found = []
    if layer_cache.k.block is not None:
        found.append(key_layout(layer_cache.k.block, d, layouts))
    if layer_cache.v.block is not None:
        found.append(value_layout(layer_cache.v.block, layouts))
    for x in found:
        if isinstance(x, str):
            return x
        if x.scale.dtype not in _SCALE_DTYPES:
            return f"scale dtype {x.scale.dtype} has no fused kernel"
    return None


def fused_attend(
    layer_cache,
    query: torch.Tensor,
    scaling: float | None = None,
    *,
    layouts: Layouts,
    **kernel_kwargs,
):
    """Run the fused kernel on ``layer_cache``'s storage (no device or Triton gate); the blocks
    are read through ``layouts``.

    ``query``: ``[B, H_q, 1, D]``.  Returns ``[B, H_q, 1, D]`` in the query dtype.  Raises
    ``ValueError`` when the layout is not supported (the reason in the message), plus whatever
    :func:`~.decode_attention.fused_decode_attention` raises.
    """
    from .decode_attention import SUPPORTED_HEAD_DIMS, fused_decode_attention

    if getattr(layer_cache, "awaiting_queries", False):
        raise ValueError("the prefill is still waiting for its queries")
    d = query.shape[-1]
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError("the fused kernel takes one query token per sequence")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={d} not supported by the fused kernel")
    ks, vs = layer_cache.k, layer_cache.v
    kq = vq = None
    if ks.block is not None:
        kq = key_layout(ks.block, d, layouts)
        if isinstance(kq, str):
            raise ValueError(kq)
    if vs.block is not None:
        vq = value_layout(vs.block, layouts)
        if isinstance(vq, str):
            raise ValueError(vq)
    for x in (kq, vq):
        if x is not None and x.scale.dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale dtype {x.scale.dtype} has no fused kernel")
    return fused_decode_attention(
        query,
        k_sinks=ks.sinks,
        k_quant=kq,
        k_residual=ks.residual,
        v_sinks=vs.sinks,
        v_quant=vq,
        v_residual=vs.residual,
        scaling=scaling,
        **kernel_kwargs,
    )


def _set_path(layer_cache, path: str, reason: str) -> None:
    try:
        layer_cache.attend_path = path
        layer_cache.attend_path_reason = reason
    except AttributeError:  # a cache class with __slots__: nothing to record on
        pass


def try_fused_attend(
    layer_cache, query: torch.Tensor, scaling: float | None = None, *, layouts: Layouts
) -> torch.Tensor | None:
    """The fused kernel's attention output for ``layer_cache``, or ``None`` to use the
    reference path (see the module docstring).  Records ``layer_cache.attend_path``."""
    if not query.is_cuda:
        _set_path(layer_cache, REFERENCE_PATH, "CPU tensors")
        return None
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _set_path(layer_cache, REFERENCE_PATH, f"{ENV_SWITCH}=0")
        return None
    from . import HAS_TRITON

    if HAS_TRITON:
        from . import _triton  # imports Triton (never raises: HAS_TRITON says if it worked)
    if not HAS_TRITON or not _triton.HAS_TRITON:
        _set_path(layer_cache, REFERENCE_PATH, "Triton is not installed")
        return None
    try:
        out = fused_attend(layer_cache, query, scaling, layouts=layouts)
    except ValueError as e:  # unsupported layout: the reference path handles it
        _set_path(layer_cache, REFERENCE_PATH, str(e))
        return None
    _set_path(layer_cache, TRITON_PATH, "")
    return out


def attend_path(layer_cache) -> str | None:
    """Which path the last ``attend`` of ``layer_cache`` took (``None`` before any)."""
    return getattr(layer_cache, "attend_path", None)
