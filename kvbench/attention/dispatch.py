"""The attention dispatch: which backend computes a decode step's attention over a layer cache.

:meth:`kvbench.cache.layer.LayerCache.attend` calls :func:`attend`.  The backends are the entry
points of the group ``kvbench.backends`` (:data:`BACKENDS`, loaded on first use; kvbench's own
are declared in ``pyproject.toml`` exactly as a plugin declares its own), and
:data:`PREFERENCE` says, per device type, in which order they are asked:

1. ``"triton"`` (CUDA; ``kvbench.kernels.triton_backend``): the fused decode kernel over the
   whole cache;
2. ``"code-domain"`` (any device; ``kvbench.kernels.cpu``): sinks and residual as matmuls, each
   quantized block through the block kernel registered for its type and device;
3. the *reference* path, always last: :meth:`~kvbench.cache.layer.LayerCache.keys_values`
   (dequantize) and :func:`kvbench.attention.reference.reference_attention`.

The first backend whose ``reason`` is ``None`` runs; one that raises is reported (a
``RuntimeWarning`` naming the layout and the device) and the reference path runs, so bad input
never crashes a step.  The path taken is recorded on the cache as ``attend_path``
(``"triton"``, ``"cpu-native-fused"``, ``"cpu-native"``, ``"cpu-eager"``, ``"cpu-native+eager"``,
``"<device>-eager"``, or ``"reference"``) and why the faster ones declined or failed as ``attend_path_reason`` (``""``
when the first choice ran).  Nothing here reads a type name or a private field: a cache (or
side) whose reads are not its stored parts says so with ``reads_transformed`` (a reason string),
and a block type says what it stores by its kernel.

This module reads the cache through :class:`kvbench.attention.backend.AttentionCache` and never
imports :mod:`kvbench.cache.layer` (which imports it) nor a backend (``kvbench.kernels``).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from kvbench.attention.backend import AttentionCache, Backend, common_reason, layout_name
from kvbench.attention.reference import (
    NoDequantizedForm,
    length_mask,
    reference_attention,
    reference_probabilities,
    repeat_kv,
    view_attention,
)
from kvbench.registry import Registry

REFERENCE_PATH = "reference"
#: the recorded path of a call attended by :func:`attend_views`
VIEWS_PATH = "reference-views"


@dataclass(frozen=True)
class SideView:
    """Tokens of one side (keys or values) that a multi-token decode call's queries read in full
    precision although the cache now stores them quantized (flushed by a later step of the
    call under one-token decode; ``LayerCache.append_viewed``).

    Attributes
    ----------
    start : held-token index of the first such token (the tokens are ``start ..
        start + F - 1``, in the order ``keys_values`` returns them).
    full : ``[B, H_kv, F, D]``, their full-precision form as the residual held it (its
        storage dtype, stored space of a rotating layer).
    steps : int64 ``[F]``: query ``t`` of the call (0-based) reads token ``start + i`` in full
        precision when ``steps[i] > t``, else as stored.
    """

    start: int
    full: torch.Tensor
    steps: torch.Tensor


@dataclass(frozen=True)
class StepViews:
    """The :class:`SideView` of each side (``None``: that side's stored form is what every query
    reads)."""

    keys: SideView | None
    values: SideView | None


def _check_backend(name: str, obj: object) -> Backend:
    if not all(callable(getattr(obj, m, None)) for m in ("reason", "run", "devices_for")):
        raise TypeError(
            f"{obj!r} is not an attention backend: it needs reason(), run() and devices_for() "
            "(kvbench.attention.backend.Backend)"
        )
    return obj  # type: ignore[return-value]


#: every attention backend by name (entry-point group ``kvbench.backends``)
BACKENDS: Registry[Backend] = Registry("attention backend", "kvbench.backends", _check_backend)

#: backends asked, in order, for a query on each device type (the reference path comes last)
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("triton", "code-domain"),
    "cpu": ("code-domain",),
}
#: the order for a device type not in :data:`PREFERENCE`
OTHER_DEVICES: tuple[str, ...] = ("code-domain",)
#: the backend whose eager kernels are the reference of blocks without a dequantized form
#: (QJL's sketches): its ``eager(cache, query, scaling, lengths)`` (``None``: it cannot)
ESTIMATOR = "code-domain"


def backends_for(block_type: type) -> dict[str, list[str]]:
    """Which backends read ``block_type`` without dequantizing it, and on which device types:
    ``{backend name: [device types]}`` (for capabilities reports; computed from the
    registrations)."""
    found = {name: BACKENDS.get(name).devices_for(block_type) for name in BACKENDS.names()}
    return {name: devs for name, devs in found.items() if devs}


def device_type(query: torch.Tensor) -> str:
    """``"cpu"``, ``"cuda"``, ... of ``query``."""
    return query.device.type


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
    with contextlib.suppress(AttributeError):
        cache.attend_path = path
        cache.attend_path_reason = reason


def reference_attend(
    cache: AttentionCache,
    query: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference path: dequantize (``keys_values``) and softmax.  A cache whose blocks have
    no dequantized form (``keys_values`` raises :class:`NoDequantizedForm`: QJL's sketches) is
    read by the eager kernels of :data:`ESTIMATOR`, its blocks' estimator being their
    reference."""
    try:
        keys, values = cache.keys_values(query.dtype)
    except NoDequantizedForm:
        out = BACKENDS.get(ESTIMATOR).eager(cache, query, scaling, lengths)
        if out is None:
            raise
        return out
    if not cache.observes_attention:
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
    except Exception as e:  # noqa: BLE001 - any backend error: warned, recorded, reference runs
        # what it catches: any error of a backend (a kernel bug, an input it did not expect),
        # which must not end a run; reported as a RuntimeWarning and in the cache's
        # attend_path_reason ("backend failed: ..."), then the reference path computes the step
        msg = f"{type(e).__name__}: {e}"[:300]
        dev = query.device
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


def attend_views(
    cache: AttentionCache,
    query: torch.Tensor,
    scaling: float | None,
    views: StepViews,
) -> torch.Tensor:
    """Attention of a multi-token call's ``query [B, H_q, n_q, D]`` (the newest ``n_q``
    positions, causal) over ``cache``, query ``t`` reading the tokens of ``views`` flushed after
    its step in full precision: what each query reads under one-token decode (the
    ``exact-chunked`` protocol, docs/design.md#protocols).  Computed on the dequantized
    ``keys_values`` by :func:`kvbench.attention.reference.view_attention` (logits, softmax and
    sums in float32, or in the query's dtype when wider); ``[B, H_q, n_q, D]`` in the query's
    dtype.  Records ``attend_path`` :data:`VIEWS_PATH`.

    Raises ``ValueError`` for a view outside the held tokens, :class:`NoDequantizedForm` for a
    cache whose keys have none (QJL's sketches: such a method is cut one token per call)."""
    keys, values = cache.keys_values(query.dtype)
    out = view_attention(
        query,
        keys,
        values,
        scaling,
        None if views.keys is None else (views.keys.start, views.keys.full, views.keys.steps),
        None
        if views.values is None
        else (views.values.start, views.values.full, views.values.steps),
    )
    record(cache, VIEWS_PATH, "exact-chunked call: tokens flushed inside it read per query")
    return out


def layer_name(cache: AttentionCache) -> str:
    """``"<cache type>(keys=<type>, values=<type>)"`` for messages."""
    return f"{type(cache).__name__}({layout_name(cache)})"
