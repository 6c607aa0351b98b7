"""Decoding through a model with a method's cache, for the workloads that do (``perplexity``,
``generation``, ``passkey``, the task workloads): the decode-attention route
(:data:`DECODE_PATHS`, :func:`decode_route`), what a run records about it (:func:`decode_info`,
:func:`merge_decode_info`: the manifest's ``decode_attention``), end-of-sequence ids and stop
strings, and greedy decoding of one prompt or a left-padded batch (:func:`greedy_generate`,
:func:`greedy_generate_batch`, the task workloads' decoding: docs/design.md#accuracy).

Importing this module loads no transformers; the functions that build caches import
:mod:`kvbench.hf` when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

import torch

from kvbench.bench.batching import left_pad, pad_id, stored_pad_tokens
from kvbench.cache.method import Method

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
    from transformers.cache_utils import Cache

    from kvbench.hf.shapes import ByteTokenizer


@runtime_checkable
class CountsDecodePaths(Protocol):
    """A cache that counts the decode paths its layers ran (kvbench's
    :class:`~kvbench.hf.cache.QuantizedKVCache`; a peer's transformers cache does not)."""

    method: Method
    decode_paths: dict[str, int]
    decode_path_reasons: set[str]


class DecodeInfo(TypedDict, total=False):
    """The manifest's ``decode_attention`` (:func:`decode_info`; a running record may start
    empty)."""

    route: str
    route_reason: str
    protocol: str
    prefill_attention: str
    paths: dict[str, int]
    path_reasons: list[str]


class Completion(TypedDict, total=False):
    """One greedy completion (:func:`greedy_generate`, :func:`greedy_generate_batch`)."""

    text: str
    new_tokens: int
    stop_reason: str
    prompt_tokens: int
    key_quantized_after_prefill: int
    value_quantized_after_prefill: int
    decode_attention: DecodeInfo
    pad_tokens_stored: int | None


#: ``path`` values of the workloads that decode through a model (perplexity, generation,
#: passkey, task workloads): ``attend`` routes kvbench caches' decode steps through
#: ``LayerCache.attend`` (the attention-backend registry: code-domain kernels, fused kernels,
#: else the reference path, each step recorded); ``reference`` through sdpa over the
#: dequantized ``keys_values()``.  Both agree within the registry's tolerance (1e-5 relative
#: per attention row, ``tests/attention/test_attend_backends.py``).
DECODE_PATHS = ("attend", "reference")


def decode_route(
    method: Method, model: PreTrainedModel | PretrainedConfig, path: str = "attend"
) -> tuple[bool, str]:
    """``(attend, why)`` for ``method``'s cache on ``model`` under the workload's ``path``:
    whether decode steps go through ``LayerCache.attend``, and why not when they do not (the
    method brings its own transformers cache; the model has sliding-window layers, which the
    attend path does not mask; ``path="reference"``).  A method without ``keys_values``
    always attends (its cache forces it).

    Raises ``ValueError`` for a ``path`` not in :data:`DECODE_PATHS`."""
    if path not in DECODE_PATHS:
        raise ValueError(f"path={path!r} is not supported; allowed: {list(DECODE_PATHS)}")
    if not method.capabilities.layer_cache or method.transformers_cache(model) is not None:
        return False, "the method's own transformers cache (sdpa over the K/V it returns)"
    from kvbench.hf.cache import has_sliding_layers  # not at import: it loads transformers

    if has_sliding_layers(model):
        return False, "the model has sliding-window layers (the attend path has no window mask)"
    if path == "reference" and method.capabilities.keys_values:
        return False, "path=reference (sdpa over keys_values())"
    return True, ""


def decode_info(caches: Sequence[Cache], attend: bool, why: str) -> DecodeInfo:
    """What a workload records about its decode attention (manifest ``decode_attention``):
    ``route`` (``attend`` or ``reference``), ``route_reason``, ``protocol`` (of the first cache,
    :func:`cache_protocol`: the workloads use one protocol per run), ``prefill_attention``
    (``full`` | ``stored``, of the first cache's method; ``full`` for a peer), and summed over
    ``caches`` ``paths`` (layer decode calls per path that ran: ``cpu-native``,
    ``cpu-eager``, ``triton``, ``reference`` on the attend route, ``sdpa-keys-values`` on the
    reference route) and ``path_reasons`` (why faster backends declined)."""
    from kvbench.hf.cache import cache_protocol, prefill_attention
    from kvbench.hf.peers import sum_counts

    ours = [c for c in caches if isinstance(c, CountsDecodePaths)]  # a peer's cache counts none
    paths = sum_counts(c.decode_paths for c in ours)
    reasons = set().union(*(c.decode_path_reasons for c in ours))
    first = caches[0] if caches else None
    return {
        "route": "attend" if attend else "reference",
        "route_reason": why,
        "protocol": cache_protocol(first),
        "prefill_attention": (
            prefill_attention(first.method) if isinstance(first, CountsDecodePaths) else "full"
        ),
        "paths": dict(sorted(paths.items())),
        "path_reasons": sorted(reasons),
    }


def eos_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | ByteTokenizer | None
) -> set[int]:
    """End-of-sequence ids from the tokenizer and the model's generation config."""
    out: set[int] = set()
    gen = model.generation_config  # None for a model that cannot generate
    for src in (
        None if tokenizer is None else tokenizer.eos_token_id,
        None if gen is None else gen.eos_token_id,
    ):
        if isinstance(src, int):
            out.add(src)
        elif isinstance(src, (list, tuple)):
            out.update(int(x) for x in src)
    return out


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    """``text`` cut before the earliest occurrence of any stop string, and that string."""
    best, which = len(text), None
    for s in stop:
        i = text.find(s) if s else -1
        if 0 <= i < best:
            best, which = i, s
    return text[:best], which


def merge_decode_info(parts: Sequence[DecodeInfo]) -> DecodeInfo:
    """One ``decode_attention`` record from several (per example): paths summed, reasons
    united, the route and its reason of the first."""
    paths: dict[str, int] = {}
    reasons: set[str] = set()
    for d in parts:
        for k, n in d.get("paths", {}).items():
            paths[k] = paths.get(k, 0) + n
        reasons |= set(d.get("path_reasons", []))
    return {**parts[0], "paths": dict(sorted(paths.items())), "path_reasons": sorted(reasons)}


@torch.no_grad()
def greedy_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | ByteTokenizer,
    ids: torch.Tensor,
    method: Method,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    path: str = "attend",
    context: int | None = None,
) -> Completion:
    """Greedy decoding of ``ids [1, P]`` through the method's cache, one token per step;
    decode attention through ``LayerCache.attend`` (``path="attend"``: the attention-backend
    registry's code-domain kernels) or sdpa over ``keys_values()`` (``"reference"``), see
    :func:`decode_route`.

    The prompt is prefilled in one forward, or with ``context`` in two (the ``ruler11``
    workload's ``question-agnostic`` protocol): its first ``context`` tokens (the prefill,
    where the method compresses), then the other ``P - context`` (a multi-token append, as a
    decode call, cut where a decode budget drops a token:
    :meth:`~kvbench.hf.cache.QuantizedKVCache.eviction_appends`, docs/design.md#eviction).
    ``0 < context < P``, else ``ValueError``.

    Returns ``text`` (decoded without special tokens, cut at the first stop string),
    ``new_tokens``, ``stop_reason`` (``eos``, ``stop:<string>`` or ``length``),
    ``prompt_tokens`` and ``key_quantized_after_prefill`` / ``value_quantized_after_prefill``
    (tokens of layer 0 held quantized right after the prefill: after the first forward) and
    ``decode_attention`` (:func:`decode_info`: the route and the paths that ran).
    """
    from kvbench.hf.attention import kvbench_attention
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

    if context is not None and not 0 < context < ids.shape[1]:
        raise ValueError(f"context={context} must split the prompt of {ids.shape[1]} tokens")
    attend, why = decode_route(method, model, path)
    cache = QuantizedKVCache(method, model, attend=attend)
    kw = cache_kwarg(cache, model)
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    ends = eos_ids(model, tokenizer)
    new: list[int] = []
    reason = "length"
    with kvbench_attention(model):
        out = model(input_ids=ids if context is None else ids[:, :context], use_cache=True, **kw)
        kq, vq = cache.quantized_tokens(0)
        s = ids.shape[1] if context is None else context
        while s < ids.shape[1]:  # one call, cut where a decode budget drops a token
            m = s + 1 + cache.eviction_appends(ids.shape[1] - s - 1)
            out = model(input_ids=ids[:, s:m], use_cache=True, **kw)
            s = m
        for step in range(max_new_tokens):
            tok = int(out.logits[0, -1].argmax())
            if tok in ends:
                reason = "eos"
                break
            new.append(tok)
            if stop:
                raw = tokenizer.decode(new, skip_special_tokens=False)
                _, hit = cut_at_stop(raw, stop)
                if hit is not None:
                    reason = f"stop:{hit}"
                    break
            if step + 1 < max_new_tokens:
                out = model(input_ids=torch.tensor([[tok]], device=dev), use_cache=True, **kw)
    text = tokenizer.decode(new, skip_special_tokens=True)
    text, _ = cut_at_stop(text, stop)
    return {
        "text": text,
        "new_tokens": len(new),
        "stop_reason": reason,
        "prompt_tokens": int(ids.shape[1]),
        "key_quantized_after_prefill": kq,
        "value_quantized_after_prefill": vq,
        "decode_attention": decode_info([cache], cache.attend, why),
    }


@torch.no_grad()
def greedy_generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | ByteTokenizer,
    prompts: Sequence[torch.Tensor],
    method: Method,
    max_new_tokens: Sequence[int],
    stop: Sequence[str] = (),
    path: str = "attend",
) -> list[Completion]:
    """:func:`greedy_generate` of several prompts ``[1, P_i]`` at once: left-padded into one
    batch with its attention mask and positions, one token per step for every unfinished row (a
    finished row leaves the batch: ``Cache.batch_select_indices`` drops its cache rows, so later
    steps neither compute nor attend for it), each row stopping as :func:`greedy_generate` does
    with its own ``max_new_tokens[i]``; ``path`` chooses the decode attention as in
    :func:`greedy_generate`.  Returns one result dict per prompt, in order; the
    quantized-after-prefill counts are the row's own (docs/design.md#padding), and each carries
    the batch's ``decode_attention``.

    Raises ``kvbench.hf.padding.PaddedBatchError`` (a ``ValueError``) naming the method when it
    lacks ``capabilities.padding`` and the prompts differ in length."""
    from kvbench.hf.attention import kvbench_attention
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

    attend, why = decode_route(method, model, path)
    dev = next(model.parameters()).device
    lens = [int(p.shape[-1]) for p in prompts]
    b, width = len(prompts), max(lens)
    ids, mask, pos = left_pad(prompts, pad_id(model, tokenizer), dev)
    cache = QuantizedKVCache(method, model, rows_apart=True, attend=attend)
    kw = cache_kwarg(cache, model)
    ends = eos_ids(model, tokenizer)
    new: list[list[int]] = [[] for _ in range(b)]
    reason = ["length"] * b
    done = [n <= 0 for n in max_new_tokens]
    nxt = torch.tensor(lens, device=dev).view(-1, 1)
    active = list(range(b))  # original index of each row still in the batch
    stored = None
    with kvbench_attention(model):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
        lc = cache.layer_caches()[0]
        rows = lc.rows if lc is not None and lc.rows is not None else None
        quant = [r.quantized_tokens() for r in rows] if rows else [cache.quantized_tokens(0)] * b
        while not all(done):
            toks = out.logits[:, -1].argmax(-1)
            for j, i in enumerate(active):
                if done[i]:
                    continue
                tok = int(toks[j])
                if tok in ends:
                    reason[i], done[i] = "eos", True
                    continue
                new[i].append(tok)
                if stop:
                    _, hit = cut_at_stop(tokenizer.decode(new[i], skip_special_tokens=False), stop)
                    if hit is not None:
                        reason[i], done[i] = f"stop:{hit}", True
                        continue
                if len(new[i]) >= max_new_tokens[i]:
                    done[i] = True
            if all(done):
                break
            keep = [j for j, i in enumerate(active) if not done[i]]
            if len(keep) < len(active):  # retire finished rows: later steps decode only the rest
                if stored is None:  # measured while every row is still held
                    stored = stored_pad_tokens(cache, lens, width)
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                toks, mask, nxt = toks[sel], mask[sel], nxt[sel]
                active = [active[j] for j in keep]
            one = torch.ones(len(active), 1, dtype=mask.dtype, device=dev)
            mask = torch.cat([mask, one], dim=1)
            out = model(
                input_ids=toks.view(-1, 1),
                attention_mask=mask,
                position_ids=nxt,
                use_cache=True,
                **kw,
            )
            nxt = nxt + 1
    if stored is None:
        stored = stored_pad_tokens(cache, lens, width)
    results = []
    for i in range(b):
        text, _ = cut_at_stop(tokenizer.decode(new[i], skip_special_tokens=True), stop)
        results.append(
            {
                "text": text,
                "new_tokens": len(new[i]),
                "stop_reason": reason[i],
                "prompt_tokens": lens[i],
                "key_quantized_after_prefill": quant[i][0],
                "value_quantized_after_prefill": quant[i][1],
                "decode_attention": decode_info([cache], cache.attend, why),
                "pad_tokens_stored": stored if i == 0 else 0,  # the batch's, on its first row
            }
        )
    return results
