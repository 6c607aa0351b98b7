"""``gsm8k``: GSM8K test (1319 problems), 8-shot chain of thought as lm-evaluation-harness's
``gsm8k_cot`` task (``lm_eval/tasks/gsm8k/gsm8k-cot.yaml``, version 3.0).

Prompt: the 8 Wei et al. (2022) exemplars of that file, each ``"Q: {question}\\nA: {target}"``,
joined by ``"\\n\\n"``, then ``"Q: {question}\\nA:"``.  With ``chat_template`` (default) and a
tokenizer that has one, the exemplars become user/assistant turns (lm-eval's
``--apply_chat_template --fewshot_as_multiturn``; ``fewshot_as_multiturn: false`` puts the whole
plain prompt in one user turn).  Greedy decoding, stop strings ``Q:``, ``</s>``,
``<|im_end|>`` (the yaml's ``until``), ``new_tokens`` 256.

Scores (both filters of the yaml, each then compared by the ``exact_match`` metric after its
``regexes_to_ignore``, :func:`kvbench.bench.tasks.extract.harness_exact_match`; ``compare: numeric``
compares the same strings as exact numbers instead):

* ``gsm8k_strict``: ``strict-match``, the first ``The answer is <number>.``;
* ``gsm8k_flexible``: ``flexible-extract``, the last number-like span.

``task_score`` = ``gsm8k_flexible``.  Data: ``kvbench.data.loaders.load_rows("gsm8k")`` (hub
``openai/gsm8k`` / local copy).  Other parameters: see :mod:`kvbench.bench.tasks.workload`.
"""

from __future__ import annotations

from kvbench.bench.context import Example, Info, RunContext
from kvbench.bench.tasks.extract import (
    gsm8k_cot_strict,
    gsm8k_flexible,
    gsm8k_gold,
    harness_exact_match,
    numbers_equal,
)
from kvbench.bench.tasks.workload import COMMON_PARAMS, TaskWorkload
from kvbench.bench.workloads import HIGHER
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue

#: lm-evaluation-harness gsm8k-cot.yaml ``fewshot_config.samples`` (first_n sampler)
EXEMPLARS: list[tuple[str, str]] = [
    (
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. "
        "After they are done, there will be 21 trees. How many trees did the grove workers "
        "plant today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. "
        "So there must have been 21 - 15 = 6. The answer is 6.",
    ),
    (
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in "
        "the parking lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.",
    ),
    (
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they "
        "have left in total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = "
        "74. After eating 35, they had 74 - 35 = 39. The answer is 39.",
    ),
    (
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How "
        "many lollipops did Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave "
        "Denny 20 - 12 = 8. The answer is 8.",
    ),
    (
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How "
        "many toys does he have now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 "
        "more toys. 5 + 4 = 9. The answer is 9.",
    ),
    (
        "There were nine computers in the server room. Five more computers were installed each "
        "day, from monday to thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. "
        "So 5 * 4 = 20 computers were added. 9 + 20 is 29. The answer is 29.",
    ),
    (
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 "
        "more. How many golf balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. "
        "After losing 2 more, he had 35 - 2 = 33 golf balls. The answer is 33.",
    ),
    (
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she "
        "has 23 - 15 dollars left. 23 - 15 is 8. The answer is 8.",
    ),
]
COMPARES = ("harness", "numeric")


def doc_to_text(question: str) -> str:
    """``"Q: {question}\\nA:"`` (gsm8k-cot.yaml ``doc_to_text``)."""
    return f"Q: {question}\nA:"


def fewshot_prompt(question: str, k: int = 8) -> tuple[str, list[dict[str, str]]]:
    """(plain prompt, chat turns) with the first ``k`` exemplars (``0 <= k <= 8``)."""
    shots = EXEMPLARS[:k]
    plain = "".join(f"{doc_to_text(q)} {t}\n\n" for q, t in shots) + doc_to_text(question)
    turns: list[dict[str, str]] = []
    for q, t in shots:
        turns += [{"role": "user", "content": doc_to_text(q)}, {"role": "assistant", "content": t}]
    turns.append({"role": "user", "content": doc_to_text(question)})
    return plain, turns


class GSM8K(TaskWorkload):
    type = "gsm8k"
    METRICS = {"gsm8k_strict": HIGHER, "gsm8k_flexible": HIGHER}
    PARAMS = {
        **COMMON_PARAMS,
        "num_fewshot": 8,
        "fewshot_as_multiturn": True,
        "compare": "harness",
    }
    PRIMARY = "gsm8k_flexible"
    DEFAULT_STOP = ("Q:", "</s>", "<|im_end|>")
    FIELDS = {
        "num_fewshot": Field(int, low=0, high=len(EXEMPLARS)),
        "fewshot_as_multiturn": Field(bool),
        "compare": Field(str, choices=COMPARES),
    }

    def load(self, ctx: RunContext) -> tuple[list[Example], Info]:
        from kvbench.data.loaders import load_rows

        rows, info = load_rows("gsm8k")
        k = self.spec["num_fewshot"]
        examples = []
        for i, r in enumerate(rows):
            plain, turns = fewshot_prompt(r["question"], k)
            if not self.spec["fewshot_as_multiturn"]:
                turns = [{"role": "user", "content": plain}]
            examples.append(
                {"id": i, "plain": plain, "messages": turns, "gold": gsm8k_gold(r["answer"])}
            )
        return examples, {
            "dataset": info,
            "prompt_template": "lm-evaluation-harness gsm8k-cot.yaml v3.0: 'Q: {question}\\nA:'"
            " with target delimiter ' ' and few-shot delimiter '\\n\\n'",
            "fewshot": {
                "num_fewshot": k,
                "sampler": "first_n",
                "as_multiturn": self.spec["fewshot_as_multiturn"],
                "exemplars": [{"question": q, "target": t} for q, t in EXEMPLARS[:k]],
            },
            "filters": {
                "strict-match": "The answer is (\\-?[0-9\\.\\,]+). (first)",
                "flexible-extract": "(-?[$0-9.,]{2,})|(-?[0-9]+) (last)",
                "compare": self.spec["compare"],
            },
        }

    def score(self, example: Example, completion: str) -> dict[str, JSONValue]:
        eq = harness_exact_match if self.spec["compare"] == "harness" else numbers_equal
        strict, flexible = gsm8k_cot_strict(completion), gsm8k_flexible(completion)
        gold = example["gold"]
        return {
            "scores": {
                "gsm8k_strict": float(eq(strict, gold)),
                "gsm8k_flexible": float(eq(flexible, gold)),
            },
            "extracted": {"strict": strict, "flexible": flexible},
            "gold": gold,
        }
