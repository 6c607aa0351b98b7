"""The base class of the task workloads (``gsm8k``, ``mgsm``, ``math``, ``humaneval``,
``ruler``, ``gpqa``, ``infinitebench``): :class:`TaskWorkload`, with example selection,
prompts and per-example records; the greedy decoding it runs is
:func:`kvbench.bench.decoding.greedy_generate`.

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
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from kvbench.bench.batching import PadLedger
from kvbench.bench.context import RunContext
from kvbench.bench.decoding import (
    DECODE_PATHS,
    Completion,
    DecodeInfo,
    eos_ids,
    greedy_generate,
    greedy_generate_batch,
    merge_decode_info,
)
from kvbench.bench.workloads import HIGHER, NONE, Result, Workload
from kvbench.cache.method import Method, require_padding
from kvbench.fields import Field

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvbench.hf.shapes import ByteTokenizer

#: one example of a task: its prompt fields (``plain``, ``messages``, ``gen_prefix``, then
#: ``prompt``, ``templated``, ``index``), gold answer, group and record fields
Example = dict[str, object]

#: parameters every task workload has (subclasses add theirs)
COMMON_PARAMS: dict[str, object] = {
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
    tokenizer: PreTrainedTokenizerBase | ByteTokenizer | None,
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
    if use_chat and messages and tokenizer is not None and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + gen_prefix, True
    return plain, False


def encode_text(
    tokenizer: PreTrainedTokenizerBase | ByteTokenizer, text: str, templated: bool
) -> torch.Tensor:
    """``[1, n]`` token ids of a prompt: a rendered chat template already holds its special
    tokens (``add_special_tokens=False``); plain text gets the tokenizer's usual ones."""
    return tokenizer(text, add_special_tokens=not templated, return_tensors="pt")["input_ids"]


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
        Field(str, choices=DECODE_PATHS).check(spec["path"], "path", pre.removesuffix(": "))
        cls.check_task(spec, pre)

    @classmethod
    def check_task(cls, spec: dict[str, Any], pre: str) -> None:
        """Task-specific rules relating parameters, or normalizing them (raise through
        :func:`kvbench.bench.workloads.reject`)."""

    # ----------------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def load(self, ctx: RunContext) -> tuple[list[Example], dict[str, Any]]:
        """All examples of the task and a manifest dict (dataset info, prompt template...)."""

    @abc.abstractmethod
    def score(self, example: Example, completion: str) -> dict[str, Any]:
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
        groups: dict[Hashable, list[int]] = {}
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
                "template": tok.chat_template
                if tok is not None and first.get("templated")
                else None,
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

    def prompt_ids(self, ctx: RunContext, example: Example) -> tuple[torch.Tensor, int]:
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

    def generate(self, ctx: RunContext, method: Method, example: Example) -> Completion:
        """Greedy completion of one example (tests replace this with a stub)."""
        ids, n = self.prompt_ids(ctx, example)
        return greedy_generate(
            ctx.model, ctx.tokenizer, ids, method, n, self.stop, self.spec.get("path", "attend")
        )

    def generate_batch(
        self, ctx: RunContext, method: Method, examples: list[Example]
    ) -> list[Completion]:
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

    def extra_metrics(self, rows: list[dict[str, object]]) -> dict[str, float]:
        """Metrics beyond the per-score means (e.g. per-language averages)."""
        return {}

    def run(self, ctx: RunContext, method: Method) -> Result:
        rows: list[dict[str, object]] = []
        sums: dict[str, float] = {}
        bs = self.spec.get("batch_size", 1)
        if bs > 1:
            require_padding(method)
        gens: list[Completion] = []
        ledger = PadLedger(bs)
        for i in range(0, len(self.examples), bs):
            part = [dict(g) for g in self.generate_batch(ctx, method, self.examples[i : i + bs])]
            lens = [g.get("prompt_tokens") for g in part]
            stored = [g.pop("pad_tokens_stored", 0) for g in part]
            if all(isinstance(n, int) for n in lens):
                ledger.add(lens, stored=None if None in stored else sum(stored))
            gens.extend(part)
        decode: list[DecodeInfo] = []
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
