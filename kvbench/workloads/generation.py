"""``generation``: greedy long-generation agreement and drift against the full-precision cache.

For each fixed prompt (chat template applied when the tokenizer has one), the ``full`` cache
generates ``new_tokens`` greedy tokens (the reference, once per model).  Then, per method:

* free-running greedy generation with the method's cache: ``gen_first_divergence`` (tokens
  generated before the first token that differs from the reference; ``new_tokens`` if none)
  and ``gen_match_rate`` (share of positions equal to the reference);
* drift: the reference continuation is fed one token at a time (C = 1, exact decode) through
  the method's cache and its next-token distributions are compared with the reference run's:
  next-token KL and top-1 agreement per bucket of ``bucket`` decode steps
  (``drift_kl_b<i>``, ``drift_top1_b<i>``; PN-Mix's claim is about long outputs).

Bootstrap intervals over prompts for the first divergence and match rate (none with one prompt).
Decode attention (``path``): ``attend`` (default) runs a kvbench cache's decode steps through
``LayerCache.attend`` (the attention-backend registry's code-domain kernels on the CPU, instead of
dequantizing the whole cache at every step); ``reference`` through sdpa over ``keys_values()``.
They agree within the registry's tolerance; the path that ran is recorded (manifest
``decode_attention``; peers and sliding-window models take the reference path).
Parameters: ``prompts`` (list of strings; default: three fixed prompts), ``new_tokens`` (128),
``bucket`` (32), ``context_tokens`` (0: with n > 0, each prompt is preceded by a different
n-token window of ``context_text`` (default ``essays``), so that a method with a residual window
of R tokens has quantized pages to read while generating; recorded with the workload), ``path``
(``attend`` | ``reference``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.hf.attention import kvbench_attention
from kvbench.hf.cache import DECODE_PATHS, decode_info, decode_route, make_hf_cache
from kvbench.kv.method import Method
from kvbench.workloads import HIGHER, LOWER
from kvbench.workloads.metrics import add_ci

from . import Result, Workload

DEFAULT_PROMPTS = [
    "Explain step by step how a refrigerator keeps food cold, and why it needs electricity.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "A train leaves at 3 pm travelling 60 km/h; a second leaves at 4 pm at 90 km/h on the same "
    "track. When does the second catch up? Reason carefully.",
]


def encode_prompt(tokenizer: Any, prompt: str) -> torch.Tensor:
    """``[1, n]`` ids of ``prompt`` with the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def _note(info: dict[str, Any] | None, cache: Any, attend: bool, why: str) -> None:
    """Add ``cache``'s decode paths to ``info`` (a running ``decode_info`` record)."""
    if info is None:
        return
    new = decode_info([cache], getattr(cache, "attend", attend), why)
    paths = dict(info.get("paths", {}))
    for k, n in new["paths"].items():
        paths[k] = paths.get(k, 0) + n
    reasons = sorted(set(info.get("path_reasons", [])) | set(new["path_reasons"]))
    info.update(new, paths=dict(sorted(paths.items())), path_reasons=reasons)


@torch.no_grad()
def greedy(
    model: Any,
    ids: torch.Tensor,
    method: Method,
    new_tokens: int,
    path: str = "attend",
    info: dict[str, Any] | None = None,
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
    model: Any,
    ids: torch.Tensor,
    cont: torch.Tensor,
    method: Method,
    path: str = "attend",
    info: dict[str, Any] | None = None,
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
    }

    @classmethod
    def check(cls, spec: dict[str, Any], pre: str) -> None:
        n, b, c = spec["new_tokens"], spec["bucket"], spec["context_tokens"]
        if not (isinstance(n, int) and isinstance(b, int) and n >= 1 and b >= 1):
            raise ValueError(f"{pre}new_tokens and bucket must be positive integers")
        if not (isinstance(c, int) and c >= 0):
            raise ValueError(f"{pre}context_tokens must be an integer >= 0")
        if spec["prompts"] is not None and not (
            isinstance(spec["prompts"], list) and all(isinstance(p, str) for p in spec["prompts"])
        ):
            raise ValueError(f"{pre}prompts must be a list of strings")
        if spec["path"] not in DECODE_PATHS:
            raise ValueError(
                f"{pre}path={spec['path']!r} is not supported; allowed: {list(DECODE_PATHS)}"
            )

    def prepare(self, ctx: Any) -> None:
        from kvbench.kv.registry import get_method

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
        key = ("generation", tuple(prompts), self.spec["new_tokens"], self.spec["path"])
        if key in ctx.shared:
            self.items = ctx.shared[key]
            return
        full = get_method("full")
        self.items = []
        for p in prompts:
            ids = encode_prompt(ctx.tokenizer, p)
            ref = greedy(ctx.model, ids, full, self.spec["new_tokens"], self.spec["path"])
            ref_lp = forced_logprobs(ctx.model, ids, ref, full, self.spec["path"])
            self.items.append((ids, ref, ref_lp))
        ctx.shared[key] = self.items

    def run(self, ctx: Any, method: Method) -> Result:
        n, bucket = self.spec["new_tokens"], self.spec["bucket"]
        first, match, kl_steps, top1_steps = [], [], [], []
        route, decode = self.spec["path"], {}
        for ids, ref, ref_lp in self.items:
            gen = greedy(ctx.model, ids, method, n, route, info=decode)
            same = (gen == ref).tolist()
            first.append(same.index(False) if False in same else n)
            match.append(sum(same) / n)
            lp = forced_logprobs(ctx.model, ids, ref, method, route, info=decode)
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
        per = {"first_divergence": first, "match_rate": match}
        info: dict[str, Any] = {"prompts": len(self.items), "bucket": bucket}
        if decode:
            info["decode_attention"] = decode
        return Result(metrics, per, info)
