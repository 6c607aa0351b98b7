"""Shared machinery of the task workloads (``gsm8k``, ``mgsm``, ``math``, ``humaneval``,
``ruler``, ``gpqa``, ``infinitebench``): example selection, prompts, greedy decoding through the
method's cache, per-example records.

Protocol (docs/design.md#accuracy): fixed prompts, greedy decoding (``do_sample=False``), one
sample per example, the quantized cache built fresh for every example, the prompt prefilled and
every new token decoded one at a time through :class:`kvbench.hf.cache.QuantizedKVCache`.
Generation stops at an end-of-sequence token of the tokenizer or the model's generation config,
at ``new_tokens`` tokens, or at the first stop string (the completion is cut before it, as
lm-evaluation-harness's ``until``).

Per-example predictions are stored **in the record**: ``per_layer["examples"]`` (one dict per
example: its index, the completion, the extracted answer, the gold answer, each score, prompt
and generated token counts, why generation stopped, and how many prompt keys were quantized
after prefill).  The record is written atomically by the runner, so the predictions are too.
The manifest (``Result.info``) records the dataset (id, source, path, sha256), the selected
example indices, the prompt template with one full rendered prompt, the chat template, the
few-shot exemplars, truncation and decoding settings.

Subsets: ``--limit N`` (``ctx.limit``) and the workload's ``max_examples`` keep N examples:
the first N in dataset order (``sample: first``, lm-evaluation-harness's ``--limit``) or N drawn
with ``random.Random(seed)`` (``sample: random``; the suite's seed), recorded either way.

Common parameters: ``max_examples`` (null = all; per language/task group), ``sample``
(``first`` | ``random``), ``new_tokens`` (generation budget), ``chat_template`` (apply the
tokenizer's chat template when it has one; few-shot exemplars become turns), ``stop`` (stop
strings; null = the task's defaults), ``batch_size`` (examples decoded together, default 1;
left-padded, each row cached alone, a finished row leaving the batch: docs/design.md#padding;
a method without ``capabilities.padding`` is refused, naming it), ``path`` (decode attention).

Tests replace :meth:`TaskWorkload.generate` with a stub to score hand-made completions without
a model.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import Any

import torch

from kvbench.bench.context import RunContext
from kvbench.bench.workloads import HIGHER, NONE
from kvbench.bench.workloads.batching import PadLedger, left_pad, pad_id, stored_pad_tokens
from kvbench.cache.method import Method, require_padding
from kvbench.fields import Field

from . import Result, Workload

#: parameters every task workload has (subclasses add theirs)
COMMON_PARAMS: dict[str, Any] = {
    "max_examples": None,
    "sample": "first",
    "new_tokens": 256,
    "chat_template": True,
    "stop": None,
    "batch_size": 1,
    "path": "attend",  # decode attention: LayerCache.attend, or "reference" (sdpa, keys_values)
}
SAMPLES = ("first", "random")


def select_indices(n: int, limit: int | None, sample: str = "first", seed: int = 0) -> list[int]:
    """Indices of the examples to evaluate: all ``n``, or ``limit`` of them.

    ``sample="first"``: ``0..limit-1``; ``"random"``: ``sorted(random.Random(seed).sample(...))``.
    Raises ``ValueError`` for an unknown ``sample`` or a negative ``limit``.
    """
    if sample not in SAMPLES:
        raise ValueError(f"sample={sample!r} is not supported; allowed: {list(SAMPLES)}")
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 0:
        raise ValueError(f"limit={limit} must be >= 0")
    if sample == "first":
        return list(range(limit))
    return sorted(random.Random(seed).sample(range(n), limit))


def render_prompt(
    tokenizer: Any,
    plain: str,
    messages: list[dict[str, str]] | None,
    use_chat: bool,
    gen_prefix: str = "",
) -> tuple[str, bool]:
    """The prompt text and whether the chat template was applied.

    With ``use_chat``, a tokenizer that has a chat template and ``messages``:
    ``apply_chat_template(messages, add_generation_prompt=True)`` followed by ``gen_prefix``;
    otherwise ``plain`` (which already ends with any generation prefix).
    """
    if use_chat and messages and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + gen_prefix, True
    return plain, False


def encode_text(tokenizer: Any, text: str, templated: bool) -> torch.Tensor:
    """``[1, n]`` token ids of a prompt: a rendered chat template already holds its special
    tokens (``add_special_tokens=False``); plain text gets the tokenizer's usual ones."""
    return tokenizer(text, add_special_tokens=not templated, return_tensors="pt")["input_ids"]


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids from the tokenizer and the model's generation config."""
    out: set[int] = set()
    for src in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
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


@torch.no_grad()
def greedy_generate(
    model: Any,
    tokenizer: Any,
    ids: torch.Tensor,
    method: Method,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    path: str = "attend",
) -> dict[str, Any]:
    """Greedy decoding of ``ids [1, P]`` through the method's cache, one token per step;
    decode attention through ``LayerCache.attend`` (``path="attend"``: the attention-backend
    registry's code-domain kernels) or sdpa over ``keys_values()`` (``"reference"``), see
    :func:`kvbench.hf.cache.decode_route`.

    Returns ``text`` (decoded without special tokens, cut at the first stop string),
    ``new_tokens``, ``stop_reason`` (``eos``, ``stop:<string>`` or ``length``),
    ``prompt_tokens`` and ``key_quantized_after_prefill`` / ``value_quantized_after_prefill``
    (tokens of layer 0 held quantized right after the prefill) and ``decode_attention``
    (:func:`kvbench.hf.cache.decode_info`: the route and the paths that ran).
    """
    from kvbench.hf.attention import kvbench_attention
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg, decode_info, decode_route

    attend, why = decode_route(method, model, path)
    cache = QuantizedKVCache(method, model, attend=attend)
    kw = cache_kwarg(cache, model)
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    ends = eos_ids(model, tokenizer)
    new: list[int] = []
    reason = "length"
    with kvbench_attention(model):
        out = model(input_ids=ids, use_cache=True, **kw)
        kq, vq = cache.quantized_tokens(0)
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
    model: Any,
    tokenizer: Any,
    prompts: Sequence[torch.Tensor],
    method: Method,
    max_new_tokens: Sequence[int],
    stop: Sequence[str] = (),
    path: str = "attend",
) -> list[dict[str, Any]]:
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
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg, decode_info, decode_route

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


class TaskWorkload(Workload):
    """Base of the task workloads; see the module docstring.

    Subclasses set ``type``, ``PARAMS`` (``COMMON_PARAMS`` plus their own), ``PRIMARY`` (the
    score that becomes ``task_score``) and implement :meth:`load` (examples and dataset info)
    and :meth:`score`.  Each example is a dict with at least ``plain`` (the prompt without a
    chat template) and optionally ``messages`` (chat turns) and ``gen_prefix``.
    """

    LIST_PARAMS = frozenset({"stop"})
    PRIMARY: str = "accuracy"
    METRICS = {"task_score": HIGHER, "num_examples": NONE}
    DEFAULT_STOP: tuple[str, ...] = ()
    FIELDS = {
        "max_examples": Field(int, low=1, optional=True),
        "sample": Field(str, choices=SAMPLES),
        "new_tokens": Field(int, low=1),
        "chat_template": Field(bool),
        "stop": Field(str, nonempty=True, shape="list", min_items=0, optional=True),
        "batch_size": Field(int, low=1),
    }

    @classmethod
    def check(cls, spec: dict[str, Any], pre: str) -> None:
        from kvbench.hf.cache import DECODE_PATHS  # not at import: it loads transformers

        Field(str, choices=DECODE_PATHS).check(spec["path"], "path", pre.removesuffix(": "))
        cls.check_task(spec, pre)

    @classmethod
    def check_task(cls, spec: dict[str, Any], pre: str) -> None:
        """Task-specific rules relating parameters, or normalizing them (raise through
        :func:`kvbench.bench.workloads.reject`)."""

    # ----------------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def load(self, ctx: RunContext) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """All examples of the task and a manifest dict (dataset info, prompt template...)."""

    @abc.abstractmethod
    def score(self, example: dict[str, Any], completion: str) -> dict[str, Any]:
        """``{"scores": {name: value in [0, 1]}, "extracted": ..., "gold": ...}``."""

    # ----------------------------------------------------------------- machinery
    @property
    def stop(self) -> list[str]:
        s = self.spec.get("stop")
        return list(self.DEFAULT_STOP) if s is None else list(s)

    def prepare(self, ctx: RunContext) -> None:
        key = (self.type, repr(sorted(self.spec.items())), ctx.limit, ctx.seed)
        if key in ctx.shared.examples:
            self.examples, self.info = ctx.shared.examples[key]
            return
        examples, info = self.load(ctx)
        limit = self.spec.get("max_examples")  # per group
        if ctx.limit is not None:
            limit = ctx.limit if limit is None else min(limit, ctx.limit)
        groups: dict[Any, list[int]] = {}
        for i, ex in enumerate(examples):  # a limit applies within each group (language...)
            groups.setdefault(ex.get("group"), []).append(i)
        idx = [
            members[j]
            for members in groups.values()
            for j in select_indices(len(members), limit, self.spec["sample"], ctx.seed)
        ]
        self.examples = []
        tok = ctx.tokenizer
        for i in idx:
            ex = dict(examples[i], index=i)
            if "prompt" not in ex:  # pre-rendered prompts (ruler) carry their own flags
                ex["prompt"], ex["templated"] = render_prompt(
                    tok,
                    ex["plain"],
                    ex.get("messages"),
                    self.spec["chat_template"],
                    ex.get("gen_prefix", ""),
                )
            self.examples.append(ex)
        first = self.examples[0] if self.examples else {}
        info = {
            **info,
            "examples": {
                "selected": len(idx),
                "available": len(examples),
                "sample": self.spec["sample"],
                "seed": ctx.seed,
                "indices": idx if len(idx) <= 5000 else f"{len(idx)} indices",
            },
            "chat_template": {
                "requested": self.spec["chat_template"],
                "applied": bool(first.get("templated")),
                "template": getattr(tok, "chat_template", None) if first.get("templated") else None,
            },
            "example_prompt": first.get("prompt"),
            "decoding": {
                "strategy": "greedy (argmax), one sample per example, batch "
                f"{self.spec.get('batch_size', 1)} (left padding, each row cached alone)",
                "max_new_tokens": self.spec["new_tokens"],
                "stop": self.stop,
                "eos": sorted(eos_ids(ctx.model, tok)) if ctx.model is not None else None,
            },
            "per_example_predictions": "per_layer['examples'] of this record",
        }
        info.setdefault(
            "truncation",
            "none: a prompt longer than the model's context is refused; new tokens are capped at"
            " the context left",
        )
        self.info = info
        ctx.shared.examples[key] = (self.examples, self.info)

    def prompt_ids(self, ctx: RunContext, example: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """The example's prompt ids ``[1, P]`` and its new-token budget.  Raises
        ``ValueError`` if the prompt does not fit the model's context."""
        ids = encode_text(ctx.tokenizer, example["prompt"], example["templated"])
        max_pos = ctx.max_positions
        if ids.shape[1] >= max_pos:
            raise ValueError(
                f"{self.type} example {example['index']}: prompt of {ids.shape[1]} tokens does "
                f"not fit the model's context of {max_pos}"
            )
        return ids, min(self.spec["new_tokens"], max_pos - ids.shape[1])

    def generate(self, ctx: RunContext, method: Method, example: dict[str, Any]) -> dict[str, Any]:
        """Greedy completion of one example (tests replace this with a stub)."""
        ids, n = self.prompt_ids(ctx, example)
        return greedy_generate(
            ctx.model, ctx.tokenizer, ids, method, n, self.stop, self.spec.get("path", "attend")
        )

    def generate_batch(
        self, ctx: RunContext, method: Method, examples: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Greedy completions of several examples in one left-padded batch."""
        if len(examples) == 1:
            return [self.generate(ctx, method, examples[0])]
        ids, budgets = zip(*(self.prompt_ids(ctx, ex) for ex in examples))
        return greedy_generate_batch(
            ctx.model,
            ctx.tokenizer,
            ids,
            method,
            budgets,
            self.stop,
            self.spec.get("path", "attend"),
        )

    def extra_metrics(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """Metrics beyond the per-score means (e.g. per-language averages)."""
        return {}

    def run(self, ctx: RunContext, method: Method) -> Result:
        rows: list[dict[str, Any]] = []
        sums: dict[str, float] = {}
        bs = self.spec.get("batch_size", 1)
        if bs > 1:
            require_padding(method)
        gens: list[dict[str, Any]] = []
        ledger = PadLedger(bs)
        for i in range(0, len(self.examples), bs):
            part = [dict(g) for g in self.generate_batch(ctx, method, self.examples[i : i + bs])]
            lens = [g.get("prompt_tokens") for g in part]
            stored = [g.pop("pad_tokens_stored", 0) for g in part]
            if all(isinstance(n, int) for n in lens):
                ledger.add(lens, stored=None if None in stored else sum(stored))
            gens.extend(part)
        decode: list[dict[str, Any]] = []
        for ex, gen in zip(self.examples, gens):
            if "decode_attention" in gen:
                decode.append(gen.pop("decode_attention"))
            s = self.score(ex, gen["text"])
            for k, v in s["scores"].items():
                sums[k] = sums.get(k, 0.0) + float(v)
            row = {
                "index": ex["index"],
                "id": ex.get("id", ex["index"]),
                "completion": gen["text"],
                "extracted": s.get("extracted"),
                "gold": s.get("gold", ex.get("gold")),
                **{k: v for k, v in s["scores"].items()},
                **{k: v for k, v in gen.items() if k != "text"},
                **ex.get("record", {}),
            }
            rows.append(row)
        n = max(len(rows), 1)
        metrics = {k: v / n for k, v in sums.items()}
        metrics.update(self.extra_metrics(rows))
        metrics["task_score"] = metrics.get(self.PRIMARY, float("nan"))
        metrics["num_examples"] = len(rows)
        info = dict(self.info)
        if ledger.batches:
            info["padding"] = ledger.info()
        if decode:
            info["decode_attention"] = merge_decode_info(decode)
        return Result(metrics, {"examples": rows}, info)


def merge_decode_info(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``decode_attention`` record from several (per example): paths summed, reasons
    united, the route and its reason of the first."""
    paths: dict[str, int] = {}
    reasons: set[str] = set()
    for d in parts:
        for k, n in d.get("paths", {}).items():
            paths[k] = paths.get(k, 0) + n
        reasons |= set(d.get("path_reasons", []))
    return {**parts[0], "paths": dict(sorted(paths.items())), "path_reasons": sorted(reasons)}
