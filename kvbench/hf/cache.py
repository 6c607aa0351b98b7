"""``QuantizedKVCache``: a kvbench method as a Hugging Face transformers ``Cache``
(docs/design.md#quantized-kv-cache-for-transformers).

One :class:`KVBenchLayer` (a ``CacheLayerMixin``) per decoder layer wraps a kvbench
:class:`~kvbench.cache.layer.LayerCache` made by ``method.new_layer(layer_idx, num_kv_heads,
head_dim, dtype, device)`` on its first ``update``.  Pass the cache as ``**cache_kwarg(cache)``
(``past_key_values=`` with transformers 5.17, ``cache=`` with 5.24).

Update protocol (docs/design.md#protocols): the first ``update`` of a layer prefills
(``layer_cache.prefill(k, v)``) and returns the original K/V (``prefill_attention="full"``) or,
with ``"stored"``, what the cache stores after the prefill and its flush (``keys_values()``, or
``layer_cache.attend`` on the attend path).  Every later ``update`` appends
(``layer_cache.append(k, v)``); the deferred flush runs at once under ``write-then-attend``
(``end_step()``, :data:`PROTOCOLS`), under ``in-chunk-full`` when kvbench's attention function
(:mod:`kvbench.hf.attention`) finishes the step, or at the next ``append``.  It returns
``keys_values()`` (new tokens included), or on the attend path the inputs (the attention
function reads the layer cache).

``attn_implementation="kvbench"`` (:func:`kvbench.hf.attention.use_kvbench_attention`) gives
methods with ``needs_queries`` their post-RoPE prefill queries and shows the cache the 2-D
``attention_mask``: a left-padded batch is prefilled with per-row lengths and every decode
step's mask is checked (docs/design.md#padding); refusals raise
:class:`~kvbench.hf.padding.PaddedBatchError` naming the row or the method.  Without it the
cache works for methods that need no queries, one row at a time (a warning says so once); a
decode step of several rows raises ``PaddedBatchError``.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.cache.layer import LayerCache
from kvbench.cache.method import Method, require_padding
from kvbench.fields import Field
from kvbench.hf import padding
from kvbench.hf.attention import ATTN_IMPLEMENTATION, StepBinding, bind_step
from kvbench.hf.capture import CapturedQKV
from kvbench.hf.peers import sum_counts, text_config

if TYPE_CHECKING:  # annotations only
    from transformers import PretrainedConfig, PreTrainedModel

#: decoder layer types whose K/V this cache can hold (sliding windows are enforced by the
#: attention mask; all tokens are stored)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

#: the decode protocols (docs/design.md#protocols): a decode call's K/V are stored through the
#: method's update (residual, sinks, flushes, budgets) *before* its queries attend causally to
#: what the cache holds, as deployed engines do
WRITE_THEN_ATTEND = "write-then-attend"
#: the call's tokens attend to the quantized past plus each other in full precision; the flush
#: waits until after the call's attention (KIVI's reference code at one token per call)
IN_CHUNK_FULL = "in-chunk-full"
#: write-then-attend with each chunk cut, by its caller, where the cache announces a change of
#: the stored form of a token it already holds (:meth:`QuantizedKVCache.steady_appends`), so
#: every query reads what one-token decode shows it: any chunk gives C = 1's logits up to float
#: rounding (``chunked_logits``).  The cache's own update is write-then-attend's.
EXACT_CHUNKED = "exact-chunked"
PROTOCOLS = (WRITE_THEN_ATTEND, IN_CHUNK_FULL, EXACT_CHUNKED)
#: the rule of a ``protocol`` argument or parameter (:mod:`kvbench.fields`)
PROTOCOL_FIELD = Field(str, choices=PROTOCOLS)
#: the protocols a caller that does not cut its calls can run (the lm-eval backend)
STEP_PROTOCOLS = (WRITE_THEN_ATTEND, IN_CHUNK_FULL)
#: the rule of a ``protocol`` of such a caller
STEP_PROTOCOL_FIELD = Field(str, choices=STEP_PROTOCOLS)
#: every kvbench cache's default, and so every workload's that decodes through the model
DEFAULT_PROTOCOL = WRITE_THEN_ATTEND
#: what records name for a transformers peer's cache, which runs its own ``update``: quanto and
#: HQQ return a call's tokens in full precision and quantize afterwards (as ``in-chunk-full``
#: on a call that flushes, as ``write-then-attend`` otherwise), fp8 stores then returns the
#: stored form (``write-then-attend``), ``DynamicCache`` stores exactly
PEER_PROTOCOL = "transformers-update"


def cache_kwarg(
    cache: Cache | None, model: PreTrainedModel | type[PreTrainedModel] | None = None
) -> dict[str, Cache | None]:
    """``{name: cache}`` with the keyword the installed transformers expects for a cache in
    ``model(...)`` and ``model.generate(...)``: ``"cache"`` (5.24, where ``past_key_values`` is
    deprecated) or ``"past_key_values"`` (5.17).  Decided from ``model.forward``'s signature
    (default: ``LlamaForCausalLM.forward``)."""
    if model is None:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _text_config(config_or_model: PreTrainedModel | PretrainedConfig) -> PretrainedConfig:
    config = text_config(config_or_model)
    # an object that is no transformers config (or a config without decoder layers)
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise ValueError(
            f"config_or_model must be a transformers model or config with num_hidden_layers; "
            f"got {type(config_or_model).__name__}"
        )
    return config


def _layer_types(config: PretrainedConfig) -> list[str]:
    # both are model-specific config attributes: absent from most model types
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


class KVBenchLayer(CacheLayerMixin):
    """One decoder layer of a :class:`QuantizedKVCache`: a kvbench ``LayerCache`` behind the
    transformers ``CacheLayerMixin`` interface.

    ``keys``/``values`` (``CacheLayerMixin`` attributes) stay ``None``: the stored state is the
    layer cache's packed blocks, residual and sinks (``self.layer_cache``).  ``crop`` works but
    is not a trace-free rollback once tokens were flushed, so ``is_croppable`` is False
    (assisted decoding is refused by transformers).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: QuantizedKVCache, layer_idx: int) -> None:
        super().__init__()
        # weak: a strong back-reference would make every cache a cycle, freed only by the
        # cyclic collector
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.layer_cache: LayerCache | None = None
        self._unconsumed = False

    @property
    def owner(self) -> QuantizedKVCache:
        """The :class:`QuantizedKVCache` this layer belongs to (``RuntimeError`` once it is
        gone: a layer is not used without its cache)."""
        owner = self._owner()
        if owner is None:
            raise RuntimeError(f"KVBenchLayer {self.layer_idx}: its QuantizedKVCache was freed")
        return owner

    def __repr__(self) -> str:
        return f"KVBenchLayer({self.layer_idx}, {self.owner.method!r})"

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None
    ) -> None:
        """Create the ``LayerCache`` for ``key_states`` ``[B, H_kv, T, D]`` (dtype, device)."""
        _, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.layer_cache = self.owner.method.new_layer(
            self.layer_idx, h, d, key_states.dtype, key_states.device
        )
        # exact-chunked on the attend route: a call's queries may read per-query views
        self.layer_cache.step_views = self.owner.step_views
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new tokens ``[B, H_kv, n, D]`` and return the K/V this step attends to.

        First call (empty cache): prefill, returns the inputs themselves.  Later calls:
        append, returns ``keys_values()`` (or, on the ``attend`` path, the inputs, since the
        attention function then reads the layer cache directly).
        """
        if not self.is_initialized or self.layer_cache is None:
            self.lazy_initialization(key_states, value_states)
        lc = self.layer_cache
        if self._unconsumed:
            self.owner._attention_not_bound(self.layer_idx, key_states.shape[0])
        owner = self.owner
        prefill = lc.seq_length == 0
        stored = prefill and owner.prefill_stored  # the prompt attends to the stored cache
        attend = owner.attend and (stored or not prefill)
        b, _, n, _ = key_states.shape
        mask = padding.current(b, lc.seen_tokens + n)
        views = None  # what the call's queries read otherwise than stored (append_viewed)
        if prefill:
            owner.check_attention()  # before the prompt is stored
            lengths = None
            if mask is not None:
                lengths = padding.prefill_lengths(mask)
                try:
                    require_padding(self.owner.method)
                except ValueError as e:
                    raise padding.PaddedBatchError(str(e)) from None
            elif self.owner.rows_apart and b > 1:
                lengths = torch.full((b,), n)
            lc.prefill(key_states, value_states, lengths=lengths)
            keys, values = key_states, value_states
            if stored and not attend and not lc.awaiting_queries:
                # prefill_attention="stored" on the reference path: sdpa over what is stored
                keys, values = lc.keys_values()
                stored = False  # read here; the attention function needs not read it again
        else:
            held = lc.seen_tokens  # the 2-D mask counts every token seen (evicted ones too)
            rows = lc.row_lengths
            pads = [0] * b if rows is None else [lc.seq_length - r for r in rows]
            padding.check_decode(mask, pads, held, n)
            if lc.awaiting_queries:
                raise ValueError(
                    f"method {self.owner.method_name!r} needs post-RoPE queries at prefill "
                    f"(capabilities.needs_queries) but none arrived: load or switch the model "
                    f"with attn_implementation={ATTN_IMPLEMENTATION!r} "
                    f"(kvbench.hf.attention.use_kvbench_attention(model))"
                )
            if n > 1 and lc.eviction_appends(n - 1) < n - 1:
                owner.refuse_evicting_call(n, lc.eviction_appends(n - 1) + 1)
            if attend and n > 1 and lc.viewable():  # exact-chunked: stored, with views
                views = lc.append_viewed(key_states, value_states)
            else:
                lc.append(key_states, value_states)
                if owner.protocol != IN_CHUNK_FULL:
                    lc.end_step()  # stored (flushes included) before the call's queries attend
            keys, values = (key_states, value_states) if attend else lc.keys_values()
        self._unconsumed = True
        bind_step(
            StepBinding(
                lc,
                self.layer_idx,
                keys,
                prefill,
                attend,
                self._consumed,
                owner._attended,
                read_stored=stored,
                views=views,
            )
        )
        return keys, values

    def _consumed(self) -> None:
        self._unconsumed = False

    def prefill_from(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None
    ) -> None:
        """Prefill this (empty) layer directly with a prompt's K/V ``[B, H_kv, P, D]`` and its
        post-RoPE queries ``[B, H_q, P, D]`` (used by methods with ``needs_queries``), exactly
        what the model's own prefill through this cache stores (its prefill attention is full
        precision, so the prompt's K/V do not depend on the method).

        Raises ``ValueError`` when the layer already holds tokens, or when the method's
        ``prefill_attention`` is ``stored`` (the prompt's K/V of layers after the first then
        depend on the method: run the prompt through the model)."""
        if self.owner.prefill_stored:
            raise ValueError(
                f"method {self.owner.method_name!r} has prefill_attention='stored': its prompt "
                "attends to its own stored K/V, so a full-precision prompt capture is not its "
                "prefill; run the prompt through the model with this cache"
            )
        if not self.is_initialized or self.layer_cache is None:
            self.lazy_initialization(keys, values)
        lc = self.layer_cache
        if lc.seq_length:
            raise ValueError(f"layer {self.layer_idx}: prefill_from needs an empty layer")
        # exactly the model's prefill: update() stores, the attention function hands queries
        lc.prefill(keys, values)
        if queries is not None:
            lc.provide_queries(queries)

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask: all held tokens plus the new ones, offset
        by the tokens evicted (docs/design.md#eviction): held key ``j`` gets mask position
        ``j + evicted``, so the new tokens sit at their positions and every held token is
        before them.  Accepts the query length or (older transformers) ``cache_position``."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        lc = self.layer_cache
        held, evicted = (0, 0) if lc is None else (lc.seq_length, lc.evicted_tokens)
        return held + int(query_length), evicted

    def get_seq_length(self) -> int:
        """Tokens seen (evicted ones included): the next token's position."""
        return 0 if self.layer_cache is None else self.layer_cache.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def offload(self) -> None:
        """Offloading is not supported (no-op)."""

    def prefetch(self) -> None:
        """Offloading is not supported (no-op)."""

    def reset(self) -> None:
        """Drop the layer cache; the next ``update`` builds a fresh one (fresh codec state)."""
        self.layer_cache = None
        self.is_initialized = False
        self._unconsumed = False

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many newest tokens; 0: nothing; positive (legacy, 5.17): keep the
        first ``tokens_to_remove`` tokens.  Quantized and full-precision parts alike."""
        if self.layer_cache is None or tokens_to_remove == 0:
            return
        n = self.get_seq_length()
        if tokens_to_remove > 0:
            if tokens_to_remove >= n:
                return
            keep = tokens_to_remove
        else:
            keep = max(n + tokens_to_remove, 0)
        self.layer_cache.crop(keep)

    def _index(self, idx: torch.Tensor | list[int]) -> None:
        if self.layer_cache is None or self.get_seq_length() == 0:
            return
        idx = torch.as_tensor(idx)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        self.layer_cache.index_batch(idx.long().cpu())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder batch rows for beam search (``beam_idx`` [B])."""
        self._index(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (int indices or a bool mask)."""
        self._index(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times."""
        if self.layer_cache is not None and self.get_seq_length() > 0:
            self.layer_cache.repeat_batch(repeats)


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` that stores K/V with a kvbench method.

    Parameters
    ----------
    method : a :class:`~kvbench.cache.method.Method` instance, or a registered method name (then
        built with ``method_config``).  Never modified.
    config_or_model : the transformers model or its config (read only): gives the number of
        decoder layers and the layer types (full or sliding attention; sliding windows are
        applied by the mask and all tokens are stored).
    method_config : config fields when ``method`` is a name (copied, never modified).
    attend : route decode attention through ``layer_cache.attend(query)`` (the kernel path)
        instead of sdpa over the returned K/V.  Forced on for methods whose capabilities say
        they have no ``keys_values`` and for eviction methods that score by the attention
        decode steps read (``method.observes_attention``, docs/design.md#eviction).  Needs ``attn_implementation="kvbench"``.
    rows_apart : cache every row of a batch alone even when the batch has no padding, so that
        methods with cross-row statistics (per-tensor scales) give each row the results of the
        row run alone, as a padded batch does (docs/design.md#padding).  Batched workloads set
        it; default False (an unpadded batch shares such statistics).
    protocol : :data:`PROTOCOLS`: ``"write-then-attend"`` (default: each decode call's K/V are
        stored, the deferred flush included, before its queries attend causally to the cache)
        or ``"in-chunk-full"`` (the flush waits until after the call's attention, so a call's
        tokens attend to each other in full precision), or ``"exact-chunked"``
        (write-then-attend's update; the caller cuts its calls at :meth:`steady_appends`).  See
        the module docstring.

    The method's ``prefill_attention`` (``full`` | ``stored``, its config) decides what the
    prompt attends to (module docstring); :attr:`prefill_stored` says which.

    Raises
    ------
    ValueError
        Unknown method name or config field; unsupported layer types (linear attention, ...);
        the attend path on a model with sliding-window layers; a ``protocol`` not in
        :data:`PROTOCOLS`.
    """

    def __init__(
        self,
        method: Method | str,
        config_or_model: PreTrainedModel | PretrainedConfig,
        method_config: Mapping[str, object] | None = None,
        attend: bool = False,
        rows_apart: bool = False,
        protocol: str = DEFAULT_PROTOCOL,
    ) -> None:
        PROTOCOL_FIELD.check(protocol, "protocol", "QuantizedKVCache")
        if isinstance(method, str):
            from kvbench.cache.registry import get_method

            method = get_method(method, **dict(method_config or {}))
        elif method_config:
            raise ValueError("method_config is only used with a method name, not an instance")
        if not isinstance(method, Method):
            raise ValueError(f"method must be a kvbench Method or a name, got {type(method)}")
        config = _text_config(config_or_model)
        types = _layer_types(config)
        bad = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
        if bad:
            raise ValueError(
                f"QuantizedKVCache supports layer types {list(SUPPORTED_LAYER_TYPES)}; this model "
                f"has {bad}"
            )
        self.method = method
        self.method_name = method.name or type(method).__name__
        #: the decoder config of the model this cache was bound to (``None`` when bound to a
        #: config): its ``_attn_implementation`` follows the model's switches
        #: (``set_attn_implementation``), which :meth:`check_attention` reads at the prefill
        self.model_config = config if hasattr(config_or_model, "config") else None
        # an evictor that scores by observed attention reads it on the attend path only
        observes = method.observes_attention
        self.attend = bool(attend) or not method.capabilities.keys_values or observes
        if self.attend and "sliding_attention" in types:
            raise ValueError(
                "the attend path (attend=True, or a method without keys_values) ignores sliding "
                "windows; this model has sliding_attention layers"
            )
        self.num_layers = config.num_hidden_layers
        self.rows_apart = bool(rows_apart)
        #: the decode protocol (:data:`PROTOCOLS`)
        self.protocol = protocol
        #: the method's ``prefill_attention`` is ``stored``: the prompt attends to the cache
        self.prefill_stored = prefill_attention(method) == "stored"
        #: ``exact-chunked`` on the attend route with dequantizable keys: each layer's
        #: ``step_views`` (a call's queries read tokens its later steps flush in full
        #: precision, so sliding windows need not run one token per call)
        self.step_views = (
            protocol == EXACT_CHUNKED and self.attend and method.capabilities.keys_values
        )
        self._warned = False
        #: decode steps (layer calls) per attention path that ran, and the reasons recorded
        self.decode_paths: dict[str, int] = {}
        self.decode_path_reasons: set[str] = set()
        super().__init__(layers=[KVBenchLayer(self, i) for i in range(self.num_layers)])

    def __repr__(self) -> str:
        return f"QuantizedKVCache({self.method!r}, layers={len(self.layers)})"

    def _attention_not_bound(self, layer_idx: int, batch: int) -> None:
        """The last ``update`` of a layer was not followed by kvbench's attention function.

        Raises ``ValueError`` on the attend path, and :class:`~kvbench.hf.padding.PaddedBatchError`
        for a decode step of ``batch > 1`` rows: without kvbench's mask function the cache cannot
        see the ``attention_mask``, so a left-padded row would have been stored with its pads
        (docs/design.md#padding)."""
        if self.attend:
            raise ValueError(
                f"layer {layer_idx}: the attend path needs attn_implementation="
                f"{ATTN_IMPLEMENTATION!r} (kvbench.hf.attention.use_kvbench_attention(model))"
            )
        if batch > 1:
            raise padding.PaddedBatchError(
                f"layer {layer_idx}: decoding a batch of {batch} rows needs attn_implementation="
                f"{ATTN_IMPLEMENTATION!r} (kvbench.hf.attention.use_kvbench_attention(model)): "
                "without it the cache cannot see the attention_mask, so a left-padded row is "
                "stored with its pads, which then share key groups and flush blocks with the "
                "row's real tokens and change its results (docs/design.md#padding)"
            )
        if not self._warned:
            self._warned = True
            late = "flushes run at the next step and " if self.protocol == IN_CHUNK_FULL else ""
            warnings.warn(
                f"QuantizedKVCache is used without attn_implementation={ATTN_IMPLEMENTATION!r}: "
                f"{late}padded batches are not detected",
                stacklevel=3,
            )

    def check_attention(self) -> None:
        """Refuse, before a prefill stores anything, a method that needs what only kvbench's
        attention function hands the cache (the prompt's post-RoPE queries:
        ``method.needs_queries``; each decode step's attention: ``observes_attention``) when the
        model this cache was bound to runs another ``attn_implementation`` (a cache bound to a
        config is refused at its first decode step instead).

        Raises ``ValueError`` naming ``attn_implementation``, the value it needs and how to set
        it."""
        impl = getattr(self.model_config, "_attn_implementation", None)
        if not isinstance(impl, str) or impl == ATTN_IMPLEMENTATION:
            return
        needs = []
        if self.method.needs_queries:
            needs.append("the prompt's post-RoPE queries (capabilities.needs_queries)")
        if self.method.observes_attention:
            needs.append("the attention of each decode step (observes_attention)")
        if needs:
            raise ValueError(
                f"method {self.method_name!r} needs {' and '.join(needs)}, which only "
                f"attn_implementation={ATTN_IMPLEMENTATION!r} hands the cache; the model runs "
                f"attn_implementation={impl!r}: load or switch it with attn_implementation="
                f"{ATTN_IMPLEMENTATION!r} (kvbench.hf.attention.use_kvbench_attention(model), "
                "or run it inside kvbench.hf.attention.kvbench_attention(model)); nothing was "
                "stored"
            )

    def refuse_evicting_call(self, tokens: int, room: int) -> None:
        """Raise ``ValueError`` for a decode call of ``tokens`` tokens of which only the first
        ``room`` fit before the method's decode budget drops a token
        (:meth:`eviction_appends`); called before the call stores anything."""
        raise ValueError(
            f"method {self.method_name!r} keeps a decode budget (budget_tokens / keep_ratio) "
            f"that would drop tokens inside this decode call of {tokens} tokens (at most "
            f"{room} fit in one call now): a budget applies after every decode token "
            "(docs/design.md#eviction), so a call "
            "that evicts inside it would leave its earlier queries fewer tokens than one-token "
            "decode shows them, or none; cut decode calls where "
            "QuantizedKVCache.eviction_appends() says (kvbench's workloads do, under every "
            "protocol) or feed one token per call; nothing was stored"
        )

    def _attended(self, path: str, reason: str) -> None:
        self.decode_paths[path] = self.decode_paths.get(path, 0) + 1
        if reason:
            self.decode_path_reasons.add(reason)

    def prefill_from(self, captured: CapturedQKV) -> None:
        """Prefill every (empty) layer from a prompt's captured post-RoPE Q/K/V
        (:class:`kvbench.hf.capture.CapturedQKV`, e.g. of :func:`kvbench.hf.capture.capture_prompt`,
        in the model's dtype and device): the state the model's own prefill through this cache
        leaves, without running the model.  Queries go to methods with ``needs_queries``.

        Raises ``ValueError`` when the capture does not cover exactly this cache's layers."""
        if sorted(captured.layer_ids) != list(range(self.num_layers)):
            raise ValueError(
                f"the capture holds layers {captured.layer_ids}; this cache has "
                f"{self.num_layers} layers"
            )
        for i, k, v, q in zip(captured.layer_ids, captured.keys, captured.values, captured.queries):
            self.layers[i].prefill_from(k, v, q)

    def steady_appends(self, limit: int) -> int:
        """Tokens that can follow the next one in the same decode call while every query of the
        call still reads what one-token decode shows it (the ``exact-chunked`` protocol): the
        minimum over the layers of :meth:`kvbench.cache.layer.LayerCache.steady_appends`, in
        ``[0, limit]`` (tokens).  ``limit`` before any layer holds a token."""
        for lc in self.layer_caches():  # each layer looks no further than the others allow
            if lc is not None and limit > 0:
                limit = lc.steady_appends(limit)
        return limit

    def eviction_appends(self, limit: int) -> int:
        """Tokens that can follow the next one in the same decode call before a layer's decode
        budget drops a token (:meth:`kvbench.cache.layer.LayerCache.eviction_appends`, the
        minimum over the layers), in ``[0, limit]`` (tokens): ``limit`` for a method without
        a decode budget.  Callers cut decode calls here under every protocol;
        :meth:`steady_appends` is never above it.  A longer call is refused by ``update``."""
        for lc in self.layer_caches():
            if lc is not None and limit > 0:
                limit = lc.eviction_appends(limit)
        return limit

    # ------------------------------------------------------------------ kvbench views
    def layer_caches(self) -> list[LayerCache | None]:
        """The kvbench ``LayerCache`` of each layer (``None`` before its first update)."""
        return [layer.layer_cache for layer in self.layers]

    def nbytes(self) -> dict[str, int]:
        """Bytes held, summed over layers, by the categories of ``LayerCache.nbytes()``."""
        return sum_counts(lc.nbytes() for lc in self.layer_caches() if lc is not None)

    def quantized_tokens(self, layer_idx: int = 0) -> tuple[int, int]:
        """(keys, values) tokens held in quantized form by layer ``layer_idx``."""
        lc = self.layers[layer_idx].layer_cache
        return (0, 0) if lc is None else lc.quantized_tokens()


__all__ = [
    "DEFAULT_PROTOCOL",
    "EXACT_CHUNKED",
    "IN_CHUNK_FULL",
    "KVBenchLayer",
    "PEER_PROTOCOL",
    "PROTOCOLS",
    "PROTOCOL_FIELD",
    "QuantizedKVCache",
    "STEP_PROTOCOLS",
    "STEP_PROTOCOL_FIELD",
    "WRITE_THEN_ATTEND",
    "cache_kwarg",
    "cache_protocol",
    "has_sliding_layers",
    "make_hf_cache",
    "prefill_attention",
]


def prefill_attention(method: Method) -> str:
    """The method's ``prefill_attention`` (``full`` | ``stored``, a
    :class:`~kvbench.cache.method.MethodConfig` field)."""
    return method.config.prefill_attention


def make_hf_cache(
    method: Method,
    model: PreTrainedModel | PretrainedConfig,
    attend: bool = False,
    protocol: str = DEFAULT_PROTOCOL,
) -> Cache:
    """The transformers ``Cache`` that holds ``method``'s K/V for ``model`` (a model or its config).

    The method's own cache when it brings one (:meth:`Method.transformers_cache`: the transformers
    peers, which run their own ``update`` whatever ``protocol`` says: :data:`PEER_PROTOCOL`),
    else kvbench's :class:`QuantizedKVCache` (``attend``: decode attention runs through
    ``LayerCache.attend``; ``protocol``: :data:`PROTOCOLS`).  Raises ``ValueError`` for a
    ``protocol`` not in :data:`PROTOCOLS`.
    """
    PROTOCOL_FIELD.check(protocol, "protocol", "make_hf_cache")
    own = method.transformers_cache(model, attend=attend)
    if own is not None:
        return own
    return QuantizedKVCache(method, model, attend=attend, protocol=protocol)


def cache_protocol(cache: Cache | None) -> str:
    """The decode protocol ``cache`` runs: a :class:`QuantizedKVCache`'s ``protocol``, else
    :data:`PEER_PROTOCOL` (a transformers cache's own ``update``; ``None``: no cache).  A
    method's own cache class that declares a ``protocol`` of :data:`PROTOCOLS` runs that one."""
    protocol = getattr(cache, "protocol", None)  # transformers' caches have none
    return protocol if protocol in PROTOCOLS else PEER_PROTOCOL


def has_sliding_layers(config_or_model: Any) -> bool:
    """Whether a transformers model or config has sliding-window attention layers (which the
    attend path does not mask: :class:`QuantizedKVCache` refuses ``attend`` there); ``False``
    for an object without an integer ``num_hidden_layers``."""
    config = getattr(config_or_model, "config", config_or_model)
    return isinstance(getattr(config, "num_hidden_layers", None), int) and (
        "sliding_attention" in _layer_types(_text_config(config))
    )
