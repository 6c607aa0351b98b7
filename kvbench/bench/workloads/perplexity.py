"""``perplexity``: perplexity, next-token KL and top-1 agreement while attending to the
*quantized* past.  Per window of ``tokens`` (T) tokens: prefill ``prefill`` (P) tokens into the
method's cache, feed the rest in chunks of ``chunk`` (C) tokens (C = 1 is exact decode), and
score the predictions of tokens P..T-1 against the ``full`` cache under the identical schedule
(computed once per model in ``prepare``): ``next_token_kl`` = mean KL(P_full || P_method),
``top1_agreement`` = share of positions whose argmax matches, ``ppl_delta`` = ppl - ppl_ref,
with bootstrap 95% intervals (``*_ci_low``/``*_ci_high``) over blocks of scored tokens
(:func:`kvbench.bench.metrics.interval_rule`, recorded in ``info.intervals``).
Protocol and intervals: docs/design.md#perplexity-and-next-token-agreement; what a chunk
attends to under ``protocol`` (``write-then-attend``, default, or ``in-chunk-full``) and the
prompt under the method's ``prefill_attention`` (``full`` | ``stored``):
docs/design.md#when-quantization-happens.

Storage of the cache the scored tokens attended to (one cache state per row; mean over
windows): ``bytes_total``, ``bytes_key_total``, ``bytes_value_total`` (all layers, measured by
``nbytes``: :func:`kvbench.hf.peers.cache_nbytes`) and ``effective_bits``,
``effective_key_bits``, ``effective_value_bits`` (8 x bytes / K or V elements held:
layers x B x H_kv x tokens x D), each of the cache after the last chunk's write (what the last
scored token attended to), and ``*_mean_scored``: the mean over scored positions of the cache
each one attended to (measured after each call's write; the prefill's prediction counts the
cache after the prefill).  The full-precision parts (residual, sinks, ``full``) count in the
dtype they are stored in: the method's ``storage_dtype`` (docs/design.md#storage-dtype), else
the model's dtype (4 bytes on the default float32 CPU model; manifest ``storage.dtype``); the
manifest's ``storage.full_precision_dtype`` names the dtype read from the tensors the last
cache held (:func:`full_precision_dtype`; a transformers peer's own, which kvbench cannot set).
The reference log-probs are always those of ``full`` stored in the model's dtype.  Under
``in-chunk-full`` a chunk attended to its own tokens in full precision before its flush, which
these bytes (after the flush) do not count.

Decode attention (``path``, docs/design.md#two-attention-paths): ``attend`` (default) runs each
chunk's attention of a kvbench cache through ``LayerCache.attend`` (the attention-backend
registry: code-domain kernels on the CPU, never dequantizing the whole cache per step);
``reference`` through sdpa over the dequantized ``keys_values()``.  The two agree within the
registry's tolerance; the path that ran is recorded (manifest ``decode_attention``, with the
``protocol`` and ``prefill_attention`` that ran).  Peers (their own transformers caches) and
sliding-window models take the reference path (recorded); a peer runs its cache's own
``update`` (``protocol`` recorded as ``transformers-update``: quanto and HQQ return a chunk in
full precision on the call that flushes, fp8 stores first) and refuses ``prefill_attention:
stored``.

Shared prefill: with ``prefill_attention: full`` the prompt's K/V and last logits are computed
once per window in ``prepare`` (:func:`kvbench.hf.capture.capture_prompt`) and prefill each
method's cache (``QuantizedKVCache.prefill_from``); a method with ``stored`` runs its prompt
through the model.

Parameters: ``text`` (default ``wikitext2``), ``tokens`` (2048), ``prefill`` (1024), ``chunk``
(64), ``windows`` (2), ``path`` (``attend`` | ``reference``), ``protocol``
(``write-then-attend`` | ``in-chunk-full``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvbench.bench.context import Info, Reference, RunContext
from kvbench.bench.decoding import DECODE_PATHS, decode_info, decode_route
from kvbench.bench.metrics import (
    HIGHER,
    LOWER,
    NONE,
    STORAGE_METRICS,
    add_block_ci,
    interval_rule,
)
from kvbench.cache.method import Method
from kvbench.fields import Field
from kvbench.hf.attention import kvbench_attention
from kvbench.hf.cache import (
    DEFAULT_PROTOCOL,
    EXACT_CHUNKED,
    PROTOCOL_FIELD,
    QuantizedKVCache,
    make_hf_cache,
    prefill_attention,
)
from kvbench.hf.capture import PromptState
from kvbench.jsontypes import JSONValue

from . import Result, Workload, reject

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

#: the storage metrics of one cache state (module docstring), each also as ``<name>_mean_scored``
STATE_METRICS = (
    "bytes_total",
    "bytes_key_total",
    "bytes_value_total",
    "effective_bits",
    "effective_key_bits",
    "effective_value_bits",
)


@dataclass(frozen=True)
class ScoredState:
    """The cache that the predictions of one model call attended to.

    Attributes
    ----------
    positions : scored positions the call predicted (1 for the prefill: its last logit).
    nbytes : bytes the cache held after the call's write
        (:func:`kvbench.hf.peers.cache_nbytes`: ``key_total``, ``value_total``, ``total``, ...).
    elements : K (= V) elements held then: layers x B x H_kv x tokens x D.
    quantized_keys : key tokens held in quantized form over key tokens held, all layers
        (``LayerCache.quantized_tokens``); ``None`` for a transformers cache (peers).
    full_precision_dtype : the dtype(s) the full-precision parts held then are stored in
        (:func:`full_precision_dtype`).
    """

    positions: int
    nbytes: dict[str, int]
    elements: int
    quantized_keys: float | None = None
    full_precision_dtype: str = "none held"

    def metrics(self) -> dict[str, float]:
        """:data:`STATE_METRICS` of this state (bytes; bits = 8 x bytes / elements)."""
        k, v = self.nbytes["key_total"], self.nbytes["value_total"]
        return {
            "bytes_total": k + v,
            "bytes_key_total": k,
            "bytes_value_total": v,
            "effective_bits": 8 * (k + v) / (2 * self.elements),
            "effective_key_bits": 8 * k / self.elements,
            "effective_value_bits": 8 * v / self.elements,
        }


def storage_metrics(states: list[ScoredState]) -> dict[str, float]:
    """:data:`STATE_METRICS` of the last state (what the last scored token attended to) and
    ``<name>_mean_scored``: their mean over scored positions (each call's state weighted by
    the positions it predicted); ``quantized_key_fraction`` of the last state where known
    (the runner flags a run whose method quantized almost nothing: ``quantized_flag``)."""
    last = states[-1].metrics()
    n = sum(s.positions for s in states)
    each = [(s.positions, s.metrics()) for s in states]
    mean = {f"{k}_mean_scored": sum(w * m[k] for w, m in each) / n for k in STATE_METRICS}
    frac = states[-1].quantized_keys
    return {**last, **mean, **({} if frac is None else {"quantized_key_fraction": frac})}


def quantized_key_fraction(cache: Cache) -> float | None:
    """Key tokens held quantized over key tokens held, summed over the layers of a kvbench
    :class:`~kvbench.hf.cache.QuantizedKVCache`; ``None`` for any other cache."""
    if not isinstance(cache, QuantizedKVCache):
        return None
    layers = [lc for lc in cache.layer_caches() if lc is not None]
    held = sum(lc.seq_length for lc in layers)
    return sum(lc.quantized_tokens()[0] for lc in layers) / held if held else 0.0


def full_precision_dtype(cache: Cache) -> str:
    """The dtype the full-precision parts of ``cache`` are stored in, read from the tensors it
    holds: a kvbench :class:`~kvbench.hf.cache.QuantizedKVCache`'s sinks and residual (every
    layer; ``storage_dtype``, docs/design.md#storage-dtype, else the compute dtype), a
    transformers cache's unquantized K/V (``DynamicCache``'s tensors, ``QuantizedCache``'s
    residual: :func:`kvbench.hf.peers.hf_layer_tensors`).  Dtype names without ``torch.``
    (``"float16"``), several joined by ``", "`` in sorted order; ``"none held"`` when the cache
    holds no full-precision tensor."""
    from kvbench.hf.peers import hf_layer_tensors

    if isinstance(cache, QuantizedKVCache):
        held = [lc.tensors() for lc in cache.layer_caches() if lc is not None]
        fp = ("residual", "sinks")
    else:
        held, fp = [hf_layer_tensors(layer) for layer in cache.layers], ("residual",)
    names = {str(t.dtype).removeprefix("torch.") for ts in held for _, c, t in ts if c in fp}
    return ", ".join(sorted(names)) or "none held"


def _elements(model: PreTrainedModel, cache: Cache, batch: int) -> int:
    from kvbench.hf.info import model_info

    info = model_info(model)
    per_token = info["num_hidden_layers"] * info["num_key_value_heads"] * info["head_dim"]
    return per_token * batch * cache.get_seq_length()


def chunk_spans(prefill: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """The decode chunks of the fill after a prefill of ``prefill`` tokens that leaves the cache
    holding ``end`` tokens: ``[(s, e), ...]`` (token positions, ``e`` exclusive), ``chunk``
    tokens each from ``prefill`` on, the last one shorter when ``end - prefill`` is not a
    multiple of ``chunk``.  The perplexity workload feeds these (``end`` = T - 1: token T - 1 is
    only predicted); the memory workload's ``fill: chunks`` replays the same ones."""
    return [(s, min(s + chunk, end)) for s in range(prefill, end, chunk)]


@torch.no_grad()
def chunked_logits(
    model: PreTrainedModel,
    ids: torch.Tensor,
    method: Method,
    prefill: int,
    chunk: int,
    path: str = "attend",
    prompt: PromptState | None = None,
    info: Info | None = None,
    protocol: str = DEFAULT_PROTOCOL,
) -> tuple[torch.Tensor, list[ScoredState]]:
    """Log-probabilities ``[T - P, V]`` (float32) predicting tokens ``P..T-1`` of ``ids [1, T]``
    under the schedule above, and the cache each call's predictions attended to
    (:class:`ScoredState` per call: the prefill, then each chunk; :func:`storage_metrics`).

    ``path``: the decode attention route (see the module docstring; :data:`DECODE_PATHS`).
    ``protocol``: :data:`kvbench.hf.cache.PROTOCOLS` (module docstring); under
    ``exact-chunked`` a kvbench cache's chunk runs as calls cut at
    :meth:`~kvbench.hf.cache.QuantizedKVCache.steady_appends` (one :class:`ScoredState` per
    chunk, after its last call), a peer's chunk as one call (recorded ``transformers-update``);
    under any protocol a kvbench cache's chunk is also cut where a decode budget drops a token
    (:meth:`~kvbench.hf.cache.QuantizedKVCache.eviction_appends`: one token per call once an
    evictor's budget is full; every other method's chunk is one call).
    ``prompt``: the window's :class:`kvbench.hf.capture.PromptState` of ``ids[:, :P]``; a
    kvbench cache of a method with ``prefill_attention: full`` is then prefilled from it instead
    of running the prompt through the model (same state, same logits); one with ``stored`` runs
    the prompt.  ``info``: when given, filled with the decode attention record
    (:func:`kvbench.bench.decoding.decode_info`).

    Raises ``ValueError`` for a ``path`` or ``protocol`` not allowed."""
    from kvbench.hf.cache import cache_kwarg
    from kvbench.hf.peers import cache_nbytes

    attend, why = decode_route(method, model, path)
    cache = make_hf_cache(method, model, attend=attend, protocol=protocol)
    kw = cache_kwarg(cache, model)
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    t = ids.shape[1]
    states: list[ScoredState] = []

    def stored(positions: int) -> None:
        elements = _elements(model, cache, ids.shape[0])
        frac = quantized_key_fraction(cache)
        fp = full_precision_dtype(cache)
        states.append(ScoredState(positions, cache_nbytes(cache), elements, frac, fp))

    shared = prompt is not None and isinstance(cache, QuantizedKVCache)
    with kvbench_attention(model):
        if shared and prefill_attention(method) == "full":
            cache.prefill_from(prompt.captured)
            logits = [prompt.last_logits[:, None].to(dev)]
        else:
            out = model(input_ids=ids[:, :prefill], use_cache=True, **kw)
            logits = [out.logits[:, -1:].float()]
        stored(1)
        # exact-chunked: each chunk cut where the cache announces a change of what it holds;
        # any protocol: where a decode budget drops a token (docs/design.md#eviction)
        ours = isinstance(cache, QuantizedKVCache)
        cut = cache.steady_appends if protocol == EXACT_CHUNKED and ours else None
        if cut is None and ours:
            cut = cache.eviction_appends
        for s, e in chunk_spans(prefill, t - 1, chunk):
            part = []
            while s < e:
                m = e if cut is None else s + 1 + cut(e - s - 1)
                part.append(model(input_ids=ids[:, s:m], use_cache=True, **kw).logits.float())
                s = m
            logits.append(torch.cat(part, dim=1))
            stored(sum(x.shape[1] for x in part))
    lp = torch.log_softmax(torch.cat(logits, dim=1)[0], dim=-1)
    if info is not None:
        info.update(decode_info([cache], cache.attend if hasattr(cache, "attend") else attend, why))
    return lp, states


class Perplexity(Workload):
    type = "perplexity"
    METRICS = {
        "ppl": LOWER,
        "ppl_ref": NONE,  # the full-precision reference: informational
        "ppl_delta": LOWER,
        "next_token_kl": LOWER,
        "top1_agreement": HIGHER,
        **STORAGE_METRICS,
        # the mean over scored positions of the cache each attended to (module docstring)
        "effective_*bits_mean_scored": LOWER,
        "quantized_key_fraction": NONE,  # what the run covered, not a quality
    }
    layer_cache = False  # any transformers cache: peers run through their transformers_cache
    #: per window, the prompt's K/V and last logits (``prepare``); ``None``: each run prefills
    prompts: list[PromptState] | None = None
    PARAMS = {
        "text": "wikitext2",
        "tokens": 2048,
        "prefill": 1024,
        "chunk": 64,
        "windows": 2,
        "path": "attend",
        "protocol": DEFAULT_PROTOCOL,
    }
    FIELDS = {
        "tokens": Field(int, low=2),
        "prefill": Field(int, low=1),
        "chunk": Field(int, low=1),
        "windows": Field(int, low=1),
        "path": Field(str, choices=DECODE_PATHS),
        "protocol": PROTOCOL_FIELD,
    }

    @classmethod
    def check(cls, spec: dict[str, JSONValue], pre: str) -> None:
        if spec["prefill"] >= spec["tokens"]:
            reject(pre, "prefill", spec["prefill"], f"integers 1..{spec['tokens'] - 1} (< tokens)")
        scored = spec["tokens"] - spec["prefill"]  # tokens fed in chunks: T - P
        if spec["chunk"] > scored:
            reject(pre, "chunk", spec["chunk"], f"integers 1..{scored} (<= tokens - prefill)")

    def prepare(self, ctx: RunContext) -> None:
        from kvbench.cache.registry import get_method
        from kvbench.data.loaders import load_text, token_windows

        names = ("text", "tokens", "prefill", "chunk", "windows", "path", "protocol")
        key = ("perplexity", *(self.spec[k] for k in names))
        if key in ctx.shared.references:
            got = ctx.shared.references[key]
            self.windows, self.prompts, self.ref = got.windows, got.prompts, got.logprobs
            self.info = got.info
            return
        self.check_context(ctx, "tokens")
        text, tinfo = load_text(self.spec["text"])
        n = self.spec["windows"] if ctx.limit is None else min(ctx.limit, self.spec["windows"])
        self.windows, winfo = token_windows(ctx.tokenizer, text, self.spec["tokens"], n)
        from kvbench.hf.capture import capture_prompt

        full = get_method("full")
        p, c, route = self.spec["prefill"], self.spec["chunk"], self.spec["path"]
        # the prompt's K/V and last logits, shared by every method's prefill (module docstring)
        self.prompts = [capture_prompt(ctx.model, w[None, :p]) for w in self.windows]
        # float32 reference log-probs (T-P x vocab per window): `full` must score exactly 0 KL
        proto = self.spec["protocol"]
        self.ref = [
            chunked_logits(ctx.model, w[None], full, p, c, route, prompt, protocol=proto)[0]
            for w, prompt in zip(self.windows, self.prompts)
        ]
        self.info = {"dataset": tinfo, "windows": winfo}
        ctx.shared.references[key] = Reference(self.windows, self.prompts, self.ref, self.info)

    def run(self, ctx: RunContext, method: Method) -> Result:
        p = self.spec["prefill"]
        nll, nll_ref, kls, agree, tokens = [], [], [], [], []
        storage: list[dict[str, float]] = []
        stored_in: set[str] = set()  # the last state's full-precision dtype, per window
        decode: Info = {}
        prompts = self.prompts or [None] * len(self.windows)
        for w, ref, prompt in zip(self.windows, self.ref, prompts):
            lp, states = chunked_logits(
                ctx.model, w[None], method, p, self.spec["chunk"], self.spec["path"], prompt,
                info=decode, protocol=self.spec["protocol"],
            )  # fmt: skip
            storage.append(storage_metrics(states))
            stored_in.add(states[-1].full_precision_dtype)
            ref = ref.float()
            target = w[p:].to(lp.device)
            nll.append(-lp.gather(1, target[:, None]).mean().item())
            nll_ref.append(-ref.gather(1, target[:, None]).mean().item())
            kl = (ref.exp() * (ref - lp)).sum(-1)
            kls.append(kl.mean().item())
            hit = (ref.argmax(-1) == lp.argmax(-1)).double()
            agree.append(hit.mean().item())
            tok_nll = [-x.gather(1, target[:, None])[:, 0].double() for x in (lp, ref)]
            tokens.append(torch.stack([kl.double(), hit, *tok_nll], -1).cpu())  # [T - P, 4]
        ppl, ppl_ref = math.exp(sum(nll) / len(nll)), math.exp(sum(nll_ref) / len(nll_ref))
        metrics = {
            "ppl": ppl,
            "ppl_ref": ppl_ref,
            "ppl_delta": ppl - ppl_ref,
            "next_token_kl": sum(kls) / len(kls),
            "top1_agreement": sum(agree) / len(agree),
        }
        block, rule = interval_rule(len(tokens))
        for name, stat in (  # columns of `tokens`: KL, top-1 hit, NLL, reference NLL
            ("ppl_delta", lambda m: m[:, 2].exp() - m[:, 3].exp()),
            ("next_token_kl", lambda m: m[:, 0]),
            ("top1_agreement", lambda m: m[:, 1]),
        ):
            add_block_ci(metrics, name, tokens, block, seed=ctx.seed, stat=stat)
        for k in storage[0]:  # the mean over windows (equal lengths: usually equal values)
            metrics[k] = sum(m[k] for m in storage) / len(storage)
        bits = method.average_bits(head_dim=ctx.model_info.get("head_dim", 128))
        metrics["nominal_key_bits"] = bits["key_bits"]
        metrics["nominal_value_bits"] = bits["value_bits"]
        per = {
            "window_nll": nll,
            "window_nll_ref": nll_ref,
            "window_kl": kls,
            "window_top1": agree,
            "window_bytes_total": [m["bytes_total"] for m in storage],
            "window_bytes_total_mean_scored": [m["bytes_total_mean_scored"] for m in storage],
        }
        info = {**self.info, "intervals": rule}
        dtype = "unknown" if ctx.model is None else str(ctx.model.dtype).removeprefix("torch.")
        info["storage"] = {
            "dtype": dtype,
            # measured on the cache the last scored token attended to (peers included)
            "full_precision_dtype": ", ".join(sorted(stored_in)),
            "measured": "bytes_* / effective_*: the cache after the last chunk's write (what the "
            "last scored token attended to), all layers; *_mean_scored: mean over scored "
            "positions of the cache each attended to; mean over windows",
        }
        if decode:
            info["decode_attention"] = decode
        return Result(metrics, per, info)
