"""kvbench's attention function for Hugging Face transformers (``attn_implementation="kvbench"``).

transformers calls ``Cache.update`` *before* the layer's attention function and never passes
the cache to it, so ``QuantizedKVCache.update`` stores a :class:`StepBinding` (:func:`bind_step`)
and :func:`kvbench_attention_forward`, registered under :data:`ATTN_IMPLEMENTATION`, uses it when
it matches (same ``module.layer_idx`` and the very key tensor ``update`` returned): it checks a
padded batch, hands prefill queries to ``provide_queries``, attends (transformers' sdpa over the
returned K/V, or ``layer_cache.attend``; a ``prefill_attention="stored"`` prefill that waited for
its queries reads ``keys_values()`` here) and finishes the step with ``end_step()``.  Without a
matching binding it is plain sdpa.  Steps and reasons:
docs/design.md#queries-for-methods-that-need-them.

A *capture* hook (:func:`capturing`, used by :mod:`kvbench.hf.capture`) sees every call's
post-RoPE Q, K, V.  The mask function registered under the same name is transformers'
``sdpa_mask``; it also records the forward's 2-D mask (:mod:`kvbench.hf.padding`) and tags
masks that contain padding.  A custom 4D mask passed by the caller is not inspected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvbench.attention.dispatch import StepViews
from kvbench.cache.layer import LayerCache
from kvbench.hf import padding
from kvbench.hf.padding import PaddedBatchError

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedModel

#: the name to pass as ``attn_implementation``
ATTN_IMPLEMENTATION = "kvbench"
#: the recorded path of a decode step on the reference route (sdpa over ``keys_values()``)
SDPA_PATH = "sdpa-keys-values"
_PADDED_ATTR = "_kvbench_padded"

#: a model, or any object standing in for one
ModelT = TypeVar("ModelT")
#: a transformers model
PreTrainedT = TypeVar("PreTrainedT", bound="PreTrainedModel")


@dataclass
class StepBinding:
    """What ``QuantizedKVCache.update`` tells the attention function about one layer call.

    Attributes
    ----------
    layer_cache : the :class:`kvbench.cache.layer.LayerCache` of this layer.
    layer_idx : the model layer (``module.layer_idx`` must match).
    keys : the exact key tensor ``update`` returned (matched by identity).
    prefill : this call was the layer's prefill (queries go to ``provide_queries``).
    attend : route this step through ``layer_cache.attend`` instead of sdpa (a decode step, or
        a prefill with ``prefill_attention="stored"``).
    on_consumed : called when the attention function has used the binding.
    on_attended : called after a decode step's attention with ``(path, reason)``: the path that
        ran (the registry's ``attend_path`` on the attend route, :data:`SDPA_PATH` on the
        reference route) and why.
    read_stored : a prefill with ``prefill_attention="stored"`` on the sdpa route: attend to the
        layer cache's ``keys_values()`` after ``provide_queries`` instead of ``keys``.
    views : a decode call's per-query views (``LayerCache.append_viewed``, ``exact-chunked``):
        attend with ``layer_cache.attend_views``; ``None``: ``layer_cache.attend``.
    """

    layer_cache: LayerCache
    layer_idx: int
    keys: torch.Tensor
    prefill: bool
    attend: bool = False
    on_consumed: Callable[[], None] | None = None
    on_attended: Callable[[str, str], None] | None = None
    read_stored: bool = False
    views: StepViews | None = None


_STEP: ContextVar[StepBinding | None] = ContextVar("kvbench_step", default=None)
_CAPTURE: ContextVar[Callable[..., None] | None] = ContextVar("kvbench_capture", default=None)


def bind_step(binding: StepBinding | None) -> None:
    """Make ``binding`` the one the next attention call checks (``None`` clears it)."""
    _STEP.set(binding)


@contextlib.contextmanager
def capturing(record: Callable[..., None]) -> Iterator[None]:
    """While active, every kvbench attention call first runs ``record(layer_idx, query, key,
    value, scaling)`` with post-RoPE ``query [B, H_q, T, D]``, the ``key``/``value``
    ``[B, H_kv, S, D]`` the attention reads (what ``Cache.update`` returned, or the layer's own
    K/V without a cache) and the logit scale (``None`` = 1/sqrt(D))."""
    token = _CAPTURE.set(record)
    try:
        yield
    finally:
        _CAPTURE.reset(token)


def has_padding(attention_mask: torch.Tensor | None) -> bool:
    """Whether a 4D mask was tagged by :func:`kvbench_mask` as built from a padded 2D mask."""
    return bool(getattr(attention_mask, _PADDED_ATTR, False))


def kvbench_mask(*args: object, **kwargs: object) -> torch.Tensor | None:
    """transformers' ``sdpa_mask`` (same arguments, same result), tagging padded masks.

    The 2D ``attention_mask`` argument (``[B, kv_len]``, True = real token) is recorded for
    the cache (:func:`kvbench.hf.padding.record`); with any False entry it marks the returned 4D
    mask, so :func:`kvbench_attention_forward` can check that the cache knows the padding.
    """
    mask = sdpa_mask(*args, **kwargs)
    pad = kwargs.get("attention_mask")
    padding.record(pad)
    if (
        isinstance(mask, torch.Tensor)
        and isinstance(pad, torch.Tensor)
        and pad.dim() == 2
        and not bool(pad.bool().all())
    ):
        setattr(mask, _PADDED_ATTR, True)
    return mask


def kvbench_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"kvbench"`` (see the module docstring).

    Parameters
    ----------
    module : the attention module (``module.layer_idx`` identifies the layer).
    query : post-RoPE ``[B, H_q, T, D]``.
    key, value : ``[B, H_kv, S, D]`` as returned by ``Cache.update`` (not repeated).
    attention_mask : 4D boolean mask from :func:`kvbench_mask`, or ``None``.
    dropout, scaling, kwargs : passed to ``sdpa_attention_forward``.

    Returns
    -------
    ``(attn_output [B, T, H_q, D], None)``, as transformers' sdpa function.

    Raises
    ------
    PaddedBatchError
        The batch is padded but the kvbench cache was not prefilled with its per-row lengths
        (docs/design.md#padding).
    ValueError
        ``dropout > 0`` on the ``attend`` path (it has no dropout; use ``model.eval()``).
    """
    layer_idx = getattr(module, "layer_idx", None)
    record = _CAPTURE.get()
    if record is not None:
        record(layer_idx, query, key, value, scaling)
    step = _STEP.get()
    if step is None or step.keys is not key or step.layer_idx != layer_idx:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    _STEP.set(None)  # one attention call per update; drop the references
    if step.on_consumed is not None:
        step.on_consumed()
    lc = step.layer_cache
    if has_padding(attention_mask) and lc.row_lengths is None:
        raise PaddedBatchError(
            f"layer {layer_idx}: the attention_mask has padding but the kvbench cache was not "
            "prefilled with per-row lengths (statistics, sinks and selections would mix pads "
            "with real tokens; docs/design.md#padding). Pass the 2-D attention_mask with left "
            "padding from the first forward on."
        )
    if lc.padding_tokens and not has_padding(attention_mask):
        raise PaddedBatchError(
            f"layer {layer_idx}: the kvbench cache holds a left-padded batch but this step's "
            "mask has no padding (a mask recorded by another forward?); pass the batch's 2-D "
            "attention_mask at every step"
        )
    if step.prefill:
        lc.provide_queries(query)
    if step.attend:
        if dropout:
            raise ValueError(
                f"dropout={dropout} is not supported on the attend path; call model.eval()"
            )
        if step.prefill:
            out = _attend_prompt(lc, query, scaling)
        elif step.views is not None:
            out = lc.attend_views(query, scaling, step.views)
        else:
            out = lc.attend(query, scaling)
        result = (out.transpose(1, 2).contiguous(), None)
        path = lc.attend_path or "unknown"
        reason = lc.attend_path_reason or ""
    else:
        if step.read_stored:  # prefill_attention="stored", after the prefill waited for queries
            key, value = lc.keys_values()
        result = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        path, reason = SDPA_PATH, ""
    if not step.prefill and step.on_attended is not None:
        step.on_attended(path, reason)
    lc.end_step()
    return result


def _attend_prompt(lc: LayerCache, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """A prompt's attention ``[B, H_q, P, D]`` over what ``lc`` stores (``prefill_attention=
    "stored"``), causal aligned to the end.  A layer that caches rows apart (a padded batch)
    is read row by row: row ``b`` holds its ``n_b`` real tokens, its last ``n_b`` queries attend
    to them, and its pad positions (never stored, never read by a real token) get zeros."""
    rows = lc.rows
    if rows is None:
        return lc.attend(query, scaling)
    out = torch.zeros_like(query)
    for b, row in enumerate(rows):
        n = row.seq_length
        out[b : b + 1, :, -n:] = row.attend(query[b : b + 1, :, -n:], scaling)
    lc.attend_path = "+".join(sorted({str(r.attend_path) for r in rows}))
    lc.attend_path_reason = "per-row caches (padded batch)"
    return out


def register() -> str:
    """Register the attention and mask functions under :data:`ATTN_IMPLEMENTATION`
    (idempotent; done on import) and return that name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvbench_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvbench_mask)
    return ATTN_IMPLEMENTATION


@contextlib.contextmanager
def kvbench_attention(model: ModelT) -> Iterator[ModelT]:
    """Inside the ``with`` block ``model`` runs ``attn_implementation="kvbench"`` (switched with
    ``set_attn_implementation`` when it runs another one, and switched back afterwards, also on
    an error); yields the model.  Workloads wrap their runs in it, so that a model loaded with
    ``"sdpa"`` or ``"eager"`` still routes decode steps through ``LayerCache.attend``."""
    register()
    prev = getattr(getattr(model, "config", None), "_attn_implementation", None)
    # an object without transformers' switch (a stand-in model) has nothing to switch
    switch = prev != ATTN_IMPLEMENTATION and hasattr(model, "set_attn_implementation")
    if switch:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield model
    finally:
        if switch and prev is not None:
            model.set_attn_implementation(prev)


def use_kvbench_attention(model: PreTrainedT) -> PreTrainedT:
    """Switch ``model`` to ``attn_implementation="kvbench"`` (``set_attn_implementation``) and
    return it.  Loading with ``from_pretrained(..., attn_implementation="kvbench")`` after
    importing this module does the same."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


register()
