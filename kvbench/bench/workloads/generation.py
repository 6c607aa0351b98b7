"""``generation``: greedy long-generation agreement and drift against the full-precision cache
(docs/design.md#generation-agreement).

For each fixed prompt (chat template applied when the tokenizer has one), the ``full`` cache
generates ``new_tokens`` greedy tokens (the reference, once per model).  Then, per method:

* free-running greedy generation with the method's cache: ``gen_first_divergence`` (tokens
  generated before the first token that differs from the reference; ``new_tokens`` if none)
  and ``gen_match_rate`` (share of positions equal to the reference), each with bootstrap
  intervals over prompts (none with one prompt);
* drift: the reference continuation is fed one token at a time (C = 1, exact decode,
  ``write-then-attend``: docs/design.md#when-quantization-happens) through the method's cache
  and its next-token distributions are compared with the reference run's: next-token KL and
  top-1 agreement, overall and per bucket of ``bucket`` decode steps (``drift_kl_b<i>``,
  ``drift_top1_b<i>``; PN-Mix's claim is about long outputs).

Decode attention (``path``, docs/design.md#two-attention-paths): ``attend`` (default) through
``LayerCache.attend``, ``reference`` through sdpa over ``keys_values()``; the path that ran and
the method's ``prefill_attention`` are recorded (manifest ``decode_attention``; peers and
sliding-window models take the reference path).

Parameters: ``prompts`` (list of strings; default: three fixed prompts), ``new_tokens`` (128),
``bucket`` (32), ``context_tokens`` (0: with n > 0, each prompt is preceded by a different
n-token window of ``context_text`` (default ``essays``), so that a method with a residual window
of R tokens has quantized pages to read while generating; recorded with the workload), ``path``
(``attend`` | ``reference``), ``batch_size`` (1: prompts decoded together, the reference batched
alike, as docs/design.md#padding says; a method without ``capabilities.padding`` is refused,
naming it; ``info["padding"]`` says what padding cost).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.bench.batching import PadLedger, chunks, left_pad, pad_id
from kvbench.bench.context import Info, RunContext
from kvbench.bench.decoding import DECODE_PATHS, decode_info, decode_route, merge_decode_info
from kvbench.bench.metrics import add_ci
from kvbench.bench.workloads import HIGHER, LOWER
from kvbench.cache.method import Method, require_padding
from kvbench.fields import Field
from kvbench.hf.attention import kvbench_attention
from kvbench.hf.cache import QuantizedKVCache, make_hf_cache

from . import Result, Workload

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

    from kvbench.bench.context import Tokenizer

DEFAULT_PROMPTS = [
    "Explain step by step how a refrigerator keeps food cold, and why it needs electricity.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "A train leaves at 3 pm travelling 60 km/h; a second leaves at 4 pm at 90 km/h on the same "
    "track. When does the second catch up? Reason carefully.",
]


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> torch.Tensor:
    """``[1, n]`` ids of ``prompt`` with the chat template when the tokenizer has one."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def _note(info: Info | None, cache: Cache, attend: bool, why: str) -> None:
    """Add ``cache``'s decode paths to ``info`` (a running ``decode_info`` record)."""
    if info is not None:  # a peer's transformers cache keeps the route asked for
        ran = cache.attend if isinstance(cache, QuantizedKVCache) else attend
        new = decode_info([cache], ran, why)
        info.update(merge_decode_info([new, info]))


@torch.no_grad()
def greedy(
    model: PreTrainedModel,
    ids: torch.Tensor,
    method: Method,
    new_tokens: int,
    path: str = "attend",
    info: Info | None = None,
) -> torch.Tensor:
    """Greedy continuation ``[new_tokens]`` (no early stop) with the method's cache; decode
    attention by ``path`` (module docstring); ``info``: filled with the paths that ran."""
    from kvbench.hf.cache import cache_kwarg

    attend, why = decode_route(method, model, path)
    cache = make_hf_cache(method, model, attend=attend)
    with kvbench_attention(model):
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **cache_kwarg(cache, model),
        )
    _note(info, cache, attend, why)
    return out[0, ids.shape[1] :].cpu()


@torch.no_grad()
def forced_logprobs(
    model: PreTrainedModel,
    ids: torch.Tensor,
    cont: torch.Tensor,
    method: Method,
    path: str = "attend",
    info: Info | None = None,
) -> torch.Tensor:
    """Log-probs ``[len(cont), V]`` predicting each continuation token, feeding ``cont`` one
    token at a time through the method's cache after prefilling ``ids``; decode attention by
    ``path``; ``info``: filled with the paths that ran."""
    from kvbench.hf.cache import cache_kwarg

    attend, why = decode_route(method, model, path)
    cache = make_hf_cache(method, model, attend=attend)
    kw = cache_kwarg(cache, model)
    with kvbench_attention(model):
        out = model(input_ids=ids, use_cache=True, **kw)
        rows = [out.logits[0, -1].float()]
        for tok in cont[:-1]:
            out = model(input_ids=tok.view(1, 1).to(ids.device), use_cache=True, **kw)
            rows.append(out.logits[0, -1].float())
    _note(info, cache, attend, why)
    return torch.log_softmax(torch.stack(rows), dim=-1)


def _batch_cache(
    method: Method, model: PreTrainedModel, path: str
) -> tuple[QuantizedKVCache, bool, str]:
    attend, why = decode_route(method, model, path)
    return QuantizedKVCache(method, model, rows_apart=True, attend=attend), attend, why


@torch.no_grad()
def greedy_batch(
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
    method: Method,
    new_tokens: int,
    path: str = "attend",
    info: Info | None = None,
    ledger: PadLedger | None = None,
) -> list[torch.Tensor]:
    """:func:`greedy` of several prompts ``[1, P_i]`` at once (left-padded, each row cached
    alone: ``QuantizedKVCache(rows_apart=True)``): one continuation ``[new_tokens]`` per
    prompt.  ``ledger``: the batch is added to it."""
    from kvbench.hf.cache import cache_kwarg

    dev = next(model.parameters()).device
    pad = pad_id(model)
    ids, mask, _ = left_pad(prompts, pad, dev)
    cache, attend, why = _batch_cache(method, model, path)
    with kvbench_attention(model):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            **cache_kwarg(cache, model),
        )
    _note(info, cache, attend, why)
    if ledger is not None:
        ledger.add([p.shape[-1] for p in prompts], cache)
    return [row[ids.shape[1] :].cpu() for row in out]


@torch.no_grad()
def forced_logprobs_batch(
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
    conts: list[torch.Tensor],
    method: Method,
    path: str = "attend",
    info: Info | None = None,
) -> list[torch.Tensor]:
    """:func:`forced_logprobs` of several prompts at once: prompts left-padded with their
    positions, then every row's continuation (all of one length) fed one token per step; one
    ``[len(cont), V]`` per prompt."""
    from kvbench.hf.cache import cache_kwarg

    dev = next(model.parameters()).device
    ids, mask, pos = left_pad(prompts, pad_id(model), dev)
    cont = torch.stack([c.reshape(-1) for c in conts]).to(dev)
    cache, attend, why = _batch_cache(method, model, path)
    kw = cache_kwarg(cache, model)
    nxt = torch.tensor([p.shape[-1] for p in prompts], device=dev).view(-1, 1)
    one = torch.ones(len(prompts), 1, dtype=mask.dtype, device=dev)
    with kvbench_attention(model):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
        rows = [out.logits[:, -1].float()]
        for t in range(cont.shape[1] - 1):
            mask = torch.cat([mask, one], dim=1)
            out = model(
                input_ids=cont[:, t : t + 1],
                attention_mask=mask,
                position_ids=nxt + t,
                use_cache=True,
                **kw,
            )
            rows.append(out.logits[:, -1].float())
    _note(info, cache, attend, why)
    lp = torch.log_softmax(torch.stack(rows, dim=1), dim=-1)
    return list(lp.unbind(0))


def run_batched(
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
    method: Method,
    new_tokens: int,
    path: str,
    batch_size: int,
    refs: list[torch.Tensor] | None = None,
    info: Info | None = None,
    ledger: PadLedger | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Greedy continuations of ``prompts`` and the log-probs of teacher-forcing ``refs`` (their
    own continuations when ``None``), ``batch_size`` prompts at a time (batch 1: :func:`greedy`
    and :func:`forced_logprobs`, any transformers cache)."""
    gens: list[torch.Tensor] = []
    lps: list[torch.Tensor] = []
    for idx in chunks(range(len(prompts)), batch_size):
        ps = [prompts[i] for i in idx]
        if len(ps) == 1:
            g = [greedy(model, ps[0], method, new_tokens, path, info=info)]
            if ledger is not None and isinstance(ps[0], torch.Tensor):
                ledger.add([ps[0].shape[-1]])  # one prompt: no pads
        else:
            g = greedy_batch(model, ps, method, new_tokens, path, info=info, ledger=ledger)
        cs = g if refs is None else [refs[i] for i in idx]
        if len(ps) == 1:
            lp = [forced_logprobs(model, ps[0], cs[0], method, path, info=info)]
        else:
            lp = forced_logprobs_batch(model, ps, cs, method, path, info=info)
        gens += g
        lps += lp
    return gens, lps


class Generation(Workload):
    type = "generation"
    METRICS = {
        "gen_first_divergence": HIGHER,
        "gen_match_rate": HIGHER,
        "next_token_kl": LOWER,
        "top1_agreement": HIGHER,
        "drift_kl_b*": LOWER,  # KL(P_full || P_method) over decode steps [i*bucket, (i+1)*bucket)
        "drift_top1_b*": HIGHER,
    }
    LIST_PARAMS = frozenset({"prompts"})
    layer_cache = False  # any transformers cache: peers run through their transformers_cache
    PARAMS = {
        "prompts": None,
        "new_tokens": 128,
        "bucket": 32,
        "context_tokens": 0,
        "context_text": "essays",
        "path": "attend",
        "batch_size": 1,
    }
    FIELDS = {
        "prompts": Field(str, shape="list", min_items=0, optional=True),
        "new_tokens": Field(int, low=1),
        "bucket": Field(int, low=1),
        "context_tokens": Field(int, low=0),
        "path": Field(str, choices=DECODE_PATHS),
        "batch_size": Field(int, low=1),
    }

    def prepare(self, ctx: RunContext) -> None:
        from kvbench.cache.registry import get_method

        prompts = self.spec["prompts"] or DEFAULT_PROMPTS
        if ctx.limit is not None:
            prompts = prompts[: ctx.limit]
        n_ctx = self.spec["context_tokens"]
        if n_ctx:  # a document before each request, so the cache holds quantized pages
            from kvbench.data.loaders import load_text, token_windows

            text, _ = load_text(self.spec["context_text"])
            win, _ = token_windows(ctx.tokenizer, text, n_ctx, len(prompts))
            docs = [ctx.tokenizer.decode(w) for w in win]
            prompts = [f"{d}\n\nThe text above is background. {p}" for d, p in zip(docs, prompts)]
        bs, route = self.spec.get("batch_size", 1), self.spec["path"]
        key = ("generation", tuple(prompts), self.spec["new_tokens"], route, bs)
        if key in ctx.shared.continuations:
            self.items = ctx.shared.continuations[key]
            return
        ids = [encode_prompt(ctx.tokenizer, p) for p in prompts]
        refs, ref_lps = run_batched(
            ctx.model, ids, get_method("full"), self.spec["new_tokens"], route, bs
        )
        self.items = list(zip(ids, refs, ref_lps))
        ctx.shared.continuations[key] = self.items

    def run(self, ctx: RunContext, method: Method) -> Result:
        n, bucket = self.spec["new_tokens"], self.spec["bucket"]
        first, match, kl_steps, top1_steps = [], [], [], []
        route, decode = self.spec["path"], {}
        bs = self.spec.get("batch_size", 1)
        if bs > 1:
            require_padding(method)
        ledger = PadLedger(bs)
        ids, refs, ref_lps = (list(x) for x in zip(*self.items))
        gens, lps = run_batched(ctx.model, ids, method, n, route, bs, refs, decode, ledger)
        for gen, ref, ref_lp, lp in zip(gens, refs, ref_lps, lps):
            same = (gen == ref).tolist()
            first.append(same.index(False) if False in same else n)
            match.append(sum(same) / n)
            r = ref_lp.float()
            kl_steps.append((r.exp() * (r - lp)).sum(-1))
            top1_steps.append((r.argmax(-1) == lp.argmax(-1)).float())
        kl, top1 = torch.stack(kl_steps).mean(0), torch.stack(top1_steps).mean(0)
        metrics = {
            "gen_first_divergence": sum(first) / len(first),
            "gen_match_rate": sum(match) / len(match),
            "next_token_kl": kl.mean().item(),
            "top1_agreement": top1.mean().item(),
        }
        for name, vals in (("gen_first_divergence", first), ("gen_match_rate", match)):
            add_ci(metrics, name, vals, seed=ctx.seed)
        for i in range(0, n, bucket):
            metrics[f"drift_kl_b{i // bucket}"] = kl[i : i + bucket].mean().item()
            metrics[f"drift_top1_b{i // bucket}"] = top1[i : i + bucket].mean().item()
        per = {
            "first_divergence": first,
            "match_rate": match,
            "next_token_kl": [float(x.mean()) for x in kl_steps],
        }
        info: Info = {
            "prompts": len(self.items),
            "bucket": bucket,
            "padding": ledger.info(),
        }
        if decode:
            info["decode_attention"] = decode
        return Result(metrics, per, info)
