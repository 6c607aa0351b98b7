"""The attention dispatch: which backend computes a decode step's attention over a layer cache.

:meth:`kvbench.cache.layer.LayerCache.attend` calls :func:`attend`.  The backends are registered
in :data:`BACKENDS` below (one ``register`` call each, nothing registers itself at import), and
:data:`PREFERENCE` says, per device type, in which order they are asked:

1. ``"triton"`` (CUDA; :mod:`kvbench.attention.triton`): the fused decode kernel over the whole
   cache;
2. ``"code-domain"`` (any device; :mod:`kvbench.attention.codedomain`): sinks and residual as
   matmuls, each quantized block through the block kernel registered for its type and device
   (:mod:`kvbench.attention.block_kernels`; the built-in kernels, :mod:`kvbench.attention.blocks`
   for the methods' own layouts, are registered below, in one place);
3. the *reference* path, always last: :meth:`~kvbench.cache.layer.LayerCache.keys_values`
   (dequantize) and :func:`kvbench.attention.reference.reference_attention`.

The first backend whose ``reason`` is ``None`` runs.  The path taken is recorded on the cache as
``attend_path`` (``"triton"``, ``"cpu-native"``, ``"cpu-eager"``, ``"cpu-native+eager"``,
``"<device>-eager"``, or ``"reference"``) and why the faster ones declined
as ``attend_path_reason`` (``""`` when the first choice ran).  Nothing here reads a type name or
a private field: a cache (or side) whose reads are not its stored parts says so with
``reads_transformed`` (a reason string), and a block type says what it stores by its kernel.

Bad input never crashes a step and never gives a silent wrong result: a layout without a backend
for the device takes the reference path with the reason recorded; a backend that raises at run
time is reported (one ``RuntimeWarning`` naming the layout and the device, then the reference
path runs; the reason is recorded).

This module reads the cache through :class:`kvbench.attention.backend.AttentionCache` and never
imports :mod:`kvbench.cache.layer` (which imports it).
"""

from __future__ import annotations

import warnings

import torch

from kvbench.attention import codedomain, triton
from kvbench.attention.backend import AttentionCache, Backend, common_reason, layout_name
from kvbench.attention.block_kernels import kernel_devices, register_block_kernel
from kvbench.attention.blocks import fp8, lut, mixed_tokens, polar, qjl, turbo
from kvbench.attention.mixed_channel import MixedChannelAttention
from kvbench.attention.reference import (
    length_mask,
    reference_attention,
    reference_probabilities,
    repeat_kv,
)
from kvbench.cache.blocks import AffineBlock
from kvbench.cache.fp8 import FP8Block
from kvbench.cache.lut import LUTBlock
from kvbench.cache.mixed_channel import MixedChannelBlock
from kvbench.cache.mixed_tokens import MixedTokenBlock
from kvbench.cache.polar import PolarBlock
from kvbench.cache.qjl import QJLBlock
from kvbench.cache.turbo import TurboBlock
from kvbench.registry import Registry

REFERENCE_PATH = "reference"

#: every attention backend by name
BACKENDS: Registry[Backend] = Registry("attention backend")
BACKENDS.register(triton.NAME, triton.BACKEND)
BACKENDS.register(codedomain.NAME, codedomain.BACKEND)

#: backends asked, in order, for a query on each device type (the reference path comes last)
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": (triton.NAME, codedomain.NAME),
    "cpu": (codedomain.NAME,),
}
#: the order for a device type not in :data:`PREFERENCE`
OTHER_DEVICES: tuple[str, ...] = (codedomain.NAME,)

# the code-domain kernel of every built-in block type, one layout each (a plugin registers its
# own block type with kvbench.attention.block_kernels.register_block_kernel)
register_block_kernel(AffineBlock, codedomain.AffineBlockAttention(), ("cpu",))
register_block_kernel(MixedChannelBlock, MixedChannelAttention(), ("cpu",))
register_block_kernel(FP8Block, fp8.FP8Attention(), ("cpu",))
register_block_kernel(LUTBlock, lut.LUTAttention(), ("cpu",))
register_block_kernel(PolarBlock, polar.PolarAttention(), ("cpu",))
register_block_kernel(QJLBlock, qjl.QJLAttention(), ("cpu", "cuda"))
register_block_kernel(MixedTokenBlock, mixed_tokens.MixedTokenAttention(), ("cpu",))
register_block_kernel(TurboBlock, turbo.TurboAttention(), ("cpu",))


def backends_for(block_type: type) -> dict[str, list[str]]:
    """Which devices can attend to ``block_type`` without dequantizing:
    ``{"code_domain": [devices], "fused": ["<backend>@<device>", ...]}`` (for capabilities
    reports; computed from the registrations)."""
    fused = []
    for name in BACKENDS.names():
        b = BACKENDS.get(name)
        if block_type in getattr(b, "layouts", ()):
            fused.append(f"{b.name}@{b.device}")
    return {"code_domain": kernel_devices(block_type), "fused": fused}


def device_type(query: torch.Tensor) -> str:
    """``"cpu"``, ``"cuda"``, ... of ``query`` (an object without a device: ``"cuda"`` if it
    says ``is_cuda``, else ``"cpu"``)."""
    dev = getattr(getattr(query, "device", None), "type", None)
    return dev or ("cuda" if getattr(query, "is_cuda", False) else "cpu")


def resolve(
    cache: AttentionCache, query: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[Backend | None, list[str]]:
    """``(backend, reasons)``: the first backend of :data:`PREFERENCE` for the query's device
    that accepts the step (``None``: the reference path) and why the ones before it
    declined."""
    why = common_reason(cache, query, lengths)
    if why:
        return None, [why]
    reasons: list[str] = []
    dev = device_type(query)
    for name in PREFERENCE.get(dev, OTHER_DEVICES):
        backend = BACKENDS.get(name)
        why = backend.reason(cache, query, lengths)
        if why is None:
            return backend, reasons
        reasons.append(why)
    return None, reasons


def record(cache: AttentionCache, path: str, reason: str) -> None:
    """Set ``attend_path`` / ``attend_path_reason`` (a cache with ``__slots__``: nothing)."""
    try:
        cache.attend_path = path
        cache.attend_path_reason = reason
    except AttributeError:
        pass


def reference_attend(
    cache: AttentionCache,
    query: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference path: dequantize (``keys_values``) and softmax.  A cache whose blocks have
    no dequantized form (``keys_values`` raises ``NotImplementedError``: QJL's sketches) is
    read by the eager code-domain backend, its blocks' estimator being their reference."""
    try:
        keys, values = cache.keys_values(query.dtype)
    except NotImplementedError:
        if codedomain.code_domain_reason(cache, query, lengths, False):
            raise
        return codedomain.eager_attend(cache, query, scaling, lengths)
    if not getattr(cache, "observes_attention", False):
        return reference_attention(query, keys, values, scaling, lengths=lengths)
    probs = reference_probabilities(query, keys, scaling, lengths)
    cache.observe_attention(probs, lengths)
    v = repeat_kv(values.float(), query.shape[1] // values.shape[1])
    return torch.matmul(probs, v).to(query.dtype)


def attend(
    cache: AttentionCache,
    query: torch.Tensor,
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, H_q, n_q, D]`` over ``cache`` by the first backend that
    accepts it; ``[B, H_q, n_q, D]`` in the query's dtype.  ``lengths``: optional int ``[B]``,
    the valid cached tokens of each row (row ``b`` holds its tokens at positions
    ``[0, lengths[b])`` and its queries are its last ``n_q`` positions); ``None``: every row
    holds the whole cache.  Records ``attend_path`` and ``attend_path_reason`` (see the module
    docstring).

    Raises ``ValueError`` for ``lengths`` outside ``[n_q, T]`` (before any backend runs)."""
    if lengths is not None:
        length_mask(lengths, query.shape[2], cache.seq_length)  # validates
    backend, reasons = resolve(cache, query, lengths)
    if backend is None:
        record(cache, REFERENCE_PATH, "; ".join(reasons))
        return reference_attend(cache, query, scaling, lengths)
    try:
        out, path = backend.run(cache, query, scaling, lengths)
    except Exception as e:  # noqa: BLE001 - a backend bug must not end a run: report it
        msg = f"{type(e).__name__}: {e}"[:300]
        dev = getattr(query, "device", "?")
        warnings.warn(
            f"kvbench attention backend failed on {layer_name(cache)} ({dev}): {msg}; "
            "using the reference path",
            RuntimeWarning,
            stacklevel=3,
        )
        record(cache, REFERENCE_PATH, f"backend failed: {msg}")
        return reference_attend(cache, query, scaling, lengths)
    record(cache, path, "; ".join(reasons))
    return out


def layer_name(cache: AttentionCache) -> str:
    """``"<cache type>(keys=<type>, values=<type>)"`` for messages."""
    return f"{type(cache).__name__}({layout_name(cache)})"
