"""Capture the full-precision model's post-RoPE Q, K, V per layer (fidelity and memory suites).

One forward pass over token ids without a cache, through kvbench's registered attention
function (:mod:`kvbench.hf.attention`) in capture mode: each layer's attention call records the
post-RoPE queries ``[B, H_q, T, D]`` and the keys/values ``[B, H_kv, T, D]`` (KV heads, not
repeated), exactly the tensors transformers' ``DynamicCache`` would store for that layer.
Nothing in the model is copied or patched; only its ``attn_implementation`` is switched to
``"kvbench"`` for the call (and switched back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvbench.hf.attention import capturing, kvbench_attention

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedModel


@dataclass
class CapturedQKV:
    """Per-layer tensors of one forward pass, CPU float32, in layer order.

    Attributes
    ----------
    queries : ``[B, H_q, T, D]`` post-RoPE queries of each layer.
    keys : ``[B, H_kv, T, D]`` post-RoPE keys.
    values : ``[B, H_kv, T, D]`` values.
    scaling : each layer's attention logit scale (``None`` means 1/sqrt(D)).
    layer_ids : the ``module.layer_idx`` of each entry.
    """

    queries: list[torch.Tensor] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    scaling: list[float | None] = field(default_factory=list)
    layer_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)


def capture_qkv(
    model: PreTrainedModel, input_ids: torch.Tensor, layers: list[int] | None = None
) -> CapturedQKV:
    """Run ``model`` once over ``input_ids`` ``[B, T]`` (no cache, no padding) and return every
    layer's post-RoPE Q, K, V as CPU float32 (:class:`CapturedQKV`).

    ``layers``: keep only these layer indices (default all).  The model's
    ``attn_implementation`` is set to ``"kvbench"`` for the call and restored afterwards.

    Raises
    ------
    ValueError
        ``input_ids`` not 2D, or no attention call was seen (the model does not dispatch through
        ``transformers.AttentionInterface``).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [B, T] tensor of token ids")
    found: dict[int, tuple] = {}
    keep = None if layers is None else set(layers)

    def record(layer_idx, query, key, value, scaling) -> None:
        if keep is None or layer_idx in keep:
            found[layer_idx] = tuple(
                t.detach().to("cpu", torch.float32) for t in (query, key, value)
            ) + (scaling,)

    with kvbench_attention(model), torch.no_grad(), capturing(record):
        model(input_ids=input_ids.to(model.device), use_cache=False)
    return _assemble(found, ", or `layers` names no attention layer")


def _assemble(found: dict[int, tuple], why: str = "") -> CapturedQKV:
    """The recorded ``{layer_idx: (q, k, v, scaling)}`` as a :class:`CapturedQKV`, in layer
    order; ``ValueError`` (ending in ``why``) when nothing was recorded."""
    if not found:
        raise ValueError(
            "no attention call was captured: the model does not use transformers' "
            f"AttentionInterface{why}"
        )
    out = CapturedQKV()
    for idx in sorted(found, key=lambda i: -1 if i is None else i):
        q, k, v, s = found[idx]
        out.queries.append(q)
        out.keys.append(k)
        out.values.append(v)
        out.scaling.append(s)
        out.layer_ids.append(idx)
    return out


@dataclass
class PromptState:
    """A prompt's per-layer post-RoPE Q, K, V in the model's own dtype and device (what a cache
    prefilled with the prompt stores) and the logits predicting the next token.

    Attributes
    ----------
    captured : :class:`CapturedQKV` (queries ``[B, H_q, P, D]``, keys/values ``[B, H_kv, P, D]``).
    last_logits : float32 ``[B, V]``, the model's logits at the prompt's last position.
    """

    captured: CapturedQKV
    last_logits: torch.Tensor


def capture_prompt(model: PreTrainedModel, input_ids: torch.Tensor) -> PromptState:
    """Run the full-precision prefill of ``input_ids`` ``[B, P]`` once (no cache) and keep every
    layer's post-RoPE Q, K, V as they are (model dtype and device) with the last position's
    logits.  A kvbench cache's prefill attention is full precision (docs/design.md#protocols),
    so the prompt's K/V and logits are the same for every method: workloads prefill each
    method's cache from this state (:meth:`kvbench.hf.cache.QuantizedKVCache.prefill_from`)
    instead of rerunning the prompt through the model per method.

    Raises ``ValueError`` as :func:`capture_qkv`."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [B, T] tensor of token ids")
    found: dict[int, tuple] = {}

    def record(layer_idx, query, key, value, scaling) -> None:
        found[layer_idx] = (query.detach(), key.detach(), value.detach(), scaling)

    kw = {}
    import inspect

    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1  # the prompt's other logits are never read
    with kvbench_attention(model), torch.no_grad(), capturing(record):
        out = model(input_ids=input_ids.to(model.device), use_cache=False, **kw)
    return PromptState(_assemble(found), out.logits[:, -1].float())
