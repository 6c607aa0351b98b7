"""``perplexity``: perplexity, next-token KL and top-1 agreement while attending to the
*quantized* past (docs/design.md#protocols).

Protocol per window of ``tokens`` (T) tokens: prefill ``prefill`` (P) tokens into the method's
cache, then feed the rest in chunks of ``chunk`` (C) tokens; each chunk attends to the cache's
quantized past plus full precision within the chunk (C = 1 is exact decode).  Predictions of
tokens P..T-1 are scored.  The ``full`` cache under the identical schedule is the reference
(computed once per model in ``prepare``): ``next_token_kl`` = mean KL(P_full || P_method),
``top1_agreement`` = share of positions whose argmax matches, ``ppl_delta`` = ppl - ppl_ref.
Bootstrap 95% intervals (``*_ci_low``/``*_ci_high``) resample blocks of scored tokens
(:func:`kvbench.bench.workloads.metrics.interval_rule`, recorded in ``info.intervals``).

Decode attention (``path``, docs/design.md#two-attention-paths): ``attend`` (default) runs each
chunk's attention of a kvbench cache through ``LayerCache.attend`` (the attention-backend
registry: code-domain kernels on the CPU, never dequantizing the whole cache per step);
``reference`` through sdpa over the dequantized ``keys_values()``.  The two agree within the
registry's tolerance; the path that ran is recorded (manifest ``decode_attention``).  Peers
(their own transformers caches) and sliding-window models take the reference path (recorded).

Shared prefill: the prefill attention of a kvbench cache is full precision, so the prompt's K/V
and its last logits are the same for every method; they are computed once per window in
``prepare`` (:func:`kvbench.hf.capture.capture_prompt`) and each method's cache is prefilled from
them (``QuantizedKVCache.prefill_from``); only the chunks run through the model per method.

Parameters: ``text`` (default ``wikitext2``), ``tokens`` (2048), ``prefill`` (1024), ``chunk``
(64), ``windows`` (2), ``path`` (``attend`` | ``reference``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbench.bench.context import Reference, RunContext
from kvbench.bench.workloads.metrics import (
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
    DECODE_PATHS,
    QuantizedKVCache,
    decode_info,
    decode_route,
    make_hf_cache,
)
from kvbench.hf.capture import PromptState

from . import Result, Workload, reject


@torch.no_grad()
def chunked_logits(
    model: Any,
    ids: torch.Tensor,
    method: Method,
    prefill: int,
    chunk: int,
    path: str = "attend",
    prompt: Any = None,
    info: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, int]]:
    """Log-probabilities ``[T - P, V]`` (float32) predicting tokens ``P..T-1`` of ``ids [1, T]``
    under the schedule above, and the cache's bytes at the end.

    ``path``: the decode attention route (see the module docstring; :data:`DECODE_PATHS`).
    ``prompt``: the window's :class:`kvbench.hf.capture.PromptState` of ``ids[:, :P]``; a
    kvbench cache is then prefilled from it instead of running the prompt through the model
    (same state, same logits).  ``info``: when given, filled with the decode attention record
    (:func:`kvbench.hf.cache.decode_info`)."""
    from kvbench.hf.cache import cache_kwarg

    attend, why = decode_route(method, model, path)
    cache = make_hf_cache(method, model, attend=attend)
    kw = cache_kwarg(cache, model)
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    t = ids.shape[1]
    with kvbench_attention(model):
        if prompt is not None and isinstance(cache, QuantizedKVCache):
            cache.prefill_from(prompt.captured)
            logits = [prompt.last_logits[:, None].to(dev)]
        else:
            out = model(input_ids=ids[:, :prefill], use_cache=True, **kw)
            logits = [out.logits[:, -1:].float()]
        for s in range(prefill, t - 1, chunk):
            e = min(s + chunk, t - 1)
            out = model(input_ids=ids[:, s:e], use_cache=True, **kw)
            logits.append(out.logits.float())
    lp = torch.log_softmax(torch.cat(logits, dim=1)[0], dim=-1)
    from kvbench.hf.peers import cache_nbytes

    if info is not None:
        info.update(decode_info([cache], cache.attend if hasattr(cache, "attend") else attend, why))
    return lp, cache_nbytes(cache)


class Perplexity(Workload):
    type = "perplexity"
    METRICS = {
        "ppl": LOWER,
        "ppl_ref": NONE,  # the full-precision reference: informational
        "ppl_delta": LOWER,
        "next_token_kl": LOWER,
        "top1_agreement": HIGHER,
        **STORAGE_METRICS,
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
    }
    FIELDS = {
        "tokens": Field(int, low=2),
        "prefill": Field(int, low=1),
        "chunk": Field(int, low=1),
        "windows": Field(int, low=1),
        "path": Field(str, choices=DECODE_PATHS),
    }

    @classmethod
    def check(cls, spec: dict[str, Any], pre: str) -> None:
        if spec["prefill"] >= spec["tokens"]:
            reject(pre, "prefill", spec["prefill"], f"integers 1..{spec['tokens'] - 1} (< tokens)")

    def prepare(self, ctx: RunContext) -> None:
        from kvbench.cache.registry import get_method
        from kvbench.data.loaders import load_text, token_windows

        key = (
            "perplexity",
            *(self.spec[k] for k in ("text", "tokens", "prefill", "chunk", "windows", "path")),
        )
        if key in ctx.shared.references:
            got = ctx.shared.references[key]
            self.windows, self.prompts, self.ref, self.info = (
                got.windows,
                got.prompts,
                got.logprobs,
                got.info,
            )
            return
        max_pos = ctx.max_positions
        if self.spec["tokens"] > max_pos:
            raise ValueError(
                f"tokens={self.spec['tokens']} exceeds the model's maximum context {max_pos}"
            )
        text, tinfo = load_text(self.spec["text"])
        n = self.spec["windows"] if ctx.limit is None else min(ctx.limit, self.spec["windows"])
        self.windows, winfo = token_windows(ctx.tokenizer, text, self.spec["tokens"], n)
        from kvbench.hf.capture import capture_prompt

        full = get_method("full")
        p, c, route = self.spec["prefill"], self.spec["chunk"], self.spec["path"]
        # the prompt's K/V and last logits, shared by every method's prefill (module docstring)
        self.prompts = [capture_prompt(ctx.model, w[None, :p]) for w in self.windows]
        # float32 reference log-probs (T-P x vocab per window): `full` must score exactly 0 KL
        self.ref = [
            chunked_logits(ctx.model, w[None], full, p, c, route, prompt)[0]
            for w, prompt in zip(self.windows, self.prompts)
        ]
        self.info = {"dataset": tinfo, "windows": winfo}
        ctx.shared.references[key] = Reference(self.windows, self.prompts, self.ref, self.info)

    def run(self, ctx: RunContext, method: Method) -> Result:
        p = self.spec["prefill"]
        nll, nll_ref, kls, agree, tokens = [], [], [], [], []
        nbytes: dict[str, int] = {}
        decode: dict[str, Any] = {}
        prompts = self.prompts or [None] * len(self.windows)
        for w, ref, prompt in zip(self.windows, self.ref, prompts):
            lp, nbytes = chunked_logits(
                ctx.model, w[None], method, p, self.spec["chunk"], self.spec["path"], prompt,
                info=decode,
            )  # fmt: skip
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
        if nbytes:
            metrics["bytes_total"] = nbytes["total"]
        bits = method.average_bits(head_dim=ctx.model_info.get("head_dim", 128))
        metrics["nominal_key_bits"] = bits["key_bits"]
        metrics["nominal_value_bits"] = bits["value_bits"]
        per = {"window_nll": nll, "window_nll_ref": nll_ref, "window_kl": kls, "window_top1": agree}
        info = {**self.info, "intervals": rule}
        if decode:
            info["decode_attention"] = decode
        return Result(metrics, per, info)
