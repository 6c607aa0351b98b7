"""Route a LayerCache's decode attention to the fused Triton kernel when it can run.

``LayerCache.attend`` -> :func:`kvbench.attend.cpu.fast_attend` calls :func:`try_fused_attend`
for CUDA queries; it returns the kernel's output, or ``None`` so that the caller takes the
reference path (``keys_values()`` + softmax).  ``None`` is returned, without touching Triton,
for CPU tensors (KVQ-11: normal CPU use never reaches a GPU launch), when Triton is missing,
when ``KVBENCH_FUSED_ATTENTION=0``, and for layouts the
kernel does not cover (head_dim other than 64/128, several query tokens, symmetric or
per-head/per-tensor keys, float8 scales, more than two channel classes, ...).  Either way the
layer cache records which path ran in ``layer_cache.attend_path`` (``"triton"`` or
``"reference"``) and why in ``layer_cache.attend_path_reason``.

The blocks are read by duck typing (:class:`kvbench.kv.blocks.AffineBlock`,
:class:`kvbench.kv.mixed.MixedChannelBlock` attributes), so this module imports only torch (and
the kernels lazily); it never imports the kvbench core.
"""

from __future__ import annotations

import os

import torch

ENV_SWITCH = "KVBENCH_FUSED_ATTENTION"
TRITON_PATH, REFERENCE_PATH = "triton", "reference"
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pages_ok(group_len: list[int], g: int) -> bool:
    # token t of the block must lie in page t // g: all pages full but the last
    return bool(group_len) and all(x == g for x in group_len[:-1]) and 0 < group_len[-1] <= g


def key_layout(block, head_dim: int):
    """:class:`~.decode_attention.QuantKeys` for a key block, or a reason string."""
    from .decode_attention import QuantKeys

    kind = type(block).__name__
    if kind == "AffineBlock":
        if block.symmetric or block.zero is None or getattr(block, "batch_shared", False):
            return "symmetric or per-tensor keys"
        if block.bits not in range(1, 9) or block.scale.shape[-1] != head_dim:
            return f"keys are not per-channel 1..8-bit codes (bits={block.bits})"
        g = block.group_len[0]
        if not _pages_ok(block.group_len, g) or g < 16 or g % 16:
            return "key groups are not pages of a multiple of 16 tokens"
        mid = bool(block.midpoint and block.bits == 1)
        counts = (head_dim,)
        return QuantKeys(block.codes, block.scale, block.zero, g, (block.bits,), counts, None, mid)
    if kind == "MixedChannelBlock":
        g = block.group_len[0]
        if not _pages_ok(block.group_len, g) or g < 16 or g % 16:
            return "key groups are not pages of a multiple of 16 tokens"
        return QuantKeys(
            block.codes,
            block.scale,
            block.zero,
            g,
            tuple(block.class_bits),
            tuple(block.class_counts),
            block.perm,
            bool(block.midpoint),
        )
    return f"key block {kind} has no fused kernel"


def value_layout(block):
    """:class:`~.decode_attention.QuantValues` for a value block, or a reason string."""
    from .decode_attention import QuantValues

    kind = type(block).__name__
    if kind != "AffineBlock":
        return f"value block {kind} has no fused kernel"
    if block.symmetric or block.zero is None or getattr(block, "batch_shared", False):
        return "symmetric or per-tensor values"
    if block.bits not in range(1, 9) or len(block.group_len) != block.ntokens:
        return "values are not per-token 1..8-bit codes"
    return QuantValues(block.codes, block.scale, block.zero, block.bits, bool(block.midpoint))


def fused_attend(layer_cache, query: torch.Tensor, scaling: float | None = None, **kernel_kwargs):
    """Run the fused kernel on ``layer_cache``'s storage (no device or Triton gate).

    ``query``: ``[B, H_q, 1, D]``.  Returns ``[B, H_q, 1, D]`` in the query dtype.  Raises
    ``ValueError`` when the layout is not supported (the reason in the message), plus whatever
    :func:`~.decode_attention.fused_decode_attention` raises.
    """
    from .decode_attention import SUPPORTED_HEAD_DIMS, fused_decode_attention

    if getattr(layer_cache, "_awaiting_queries", False):
        raise ValueError("the prefill is still waiting for its queries")
    d = query.shape[-1]
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError("the fused kernel takes one query token per sequence")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={d} not supported by the fused kernel")
    ks, vs = layer_cache.k, layer_cache.v
    kq = vq = None
    if ks.block is not None:
        kq = key_layout(ks.block, d)
        if isinstance(kq, str):
            raise ValueError(kq)
    if vs.block is not None:
        vq = value_layout(vs.block)
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
    layer_cache, query: torch.Tensor, scaling: float | None = None
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
        out = fused_attend(layer_cache, query, scaling)
    except ValueError as e:  # unsupported layout: the reference path handles it
        _set_path(layer_cache, REFERENCE_PATH, str(e))
        return None
    _set_path(layer_cache, TRITON_PATH, "")
    return out


def attend_path(layer_cache) -> str | None:
    """Which path the last ``attend`` of ``layer_cache`` took (``None`` before any)."""
    return getattr(layer_cache, "attend_path", None)
