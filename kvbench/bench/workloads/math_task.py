"""``math``: competition math with boxed answers: MATH-500, AIME 2024, AIME 2025, AMC 2023
(``dataset``: ``math500`` | ``aime24`` | ``aime25`` | ``amc23``, through
:func:`kvbench.data.loaders.load_rows`).

Prompt (zero-shot, the DeepSeek-R1 usage recommendation for math, also used by the PN-Mix
reasoning models): ``"{problem}\\nPlease reason step by step, and put your final answer within
\\\\boxed{}."`` as the user turn of the chat template (``prompt_template`` overrides it;
``{problem}`` is substituted).  Greedy decoding, ``new_tokens`` (default 1024; the paper's
reasoning runs use budgets of 32K tokens, far beyond a CPU run).

Scoring: the last ``\\boxed{}`` (else Minerva's "final answer is" phrase) of the completion,
:func:`kvbench.bench.tasks.math_answer.extract_math_answer`; MATH-500 and AMC 2023 compare it
with the reference by :func:`kvbench.bench.tasks.math_answer.is_equiv` (MATH ``strip_string``
normalization, then exact numeric equality, so ``\\frac{1}{2}`` equals ``0.5``); AIME answers
are integers 0..999 (:func:`kvbench.bench.tasks.math_answer.aime_answer`).  Metric
``<dataset>_acc`` and ``task_score``.
``subjects`` filters MATH-500 by subject (PN-Mix Table 2's "MATH-Alg." is approximated by
``subjects: [Algebra]``, 124 of the 500 problems); ``levels`` by difficulty level.
"""

from __future__ import annotations

from kvbench.bench.context import Example, Info, RunContext
from kvbench.bench.tasks.math_answer import aime_answer, extract_math_answer, is_equiv
from kvbench.bench.tasks.workload import COMMON_PARAMS, TaskWorkload
from kvbench.bench.workloads import HIGHER
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue

from . import reject

DATASETS = ("math500", "aime24", "aime25", "amc23")
DEFAULT_TEMPLATE = (
    "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)


class MathTask(TaskWorkload):
    type = "math"
    METRICS = {"*_acc": HIGHER}  # <dataset>_acc: math500_acc, aime24_acc, ...
    LIST_PARAMS = TaskWorkload.LIST_PARAMS | {"subjects", "levels"}
    PARAMS = {
        **COMMON_PARAMS,
        "new_tokens": 1024,
        "dataset": "math500",
        "subjects": None,
        "levels": None,
        "prompt_template": DEFAULT_TEMPLATE,
    }
    FIELDS = {
        "dataset": Field(str, choices=DATASETS),
        "subjects": Field(None, shape="list", min_items=0, optional=True),
        "levels": Field(None, shape="list", min_items=0, optional=True),
    }

    @property
    def PRIMARY(self) -> str:  # noqa: N802 - the base's class attribute name
        return f"{self.spec['dataset']}_acc"

    @classmethod
    def check_task(cls, spec: dict[str, JSONValue], pre: str) -> None:
        for name in ("subjects", "levels"):
            if spec[name] and spec["dataset"] != "math500":
                allowed = f"None with dataset={spec['dataset']!r} (they filter only 'math500')"
                reject(pre, name, spec[name], allowed)
        if "{problem}" not in spec["prompt_template"]:
            reject(
                pre, "prompt_template", spec["prompt_template"], "strings containing '{problem}'"
            )

    def load(self, ctx: RunContext) -> tuple[list[Example], Info]:
        from kvbench.data.loaders import load_rows

        rows, info = load_rows(self.spec["dataset"])
        subjects, levels = self.spec["subjects"], self.spec["levels"]
        examples = []
        for i, r in enumerate(rows):
            if subjects and r.get("subject") not in subjects:
                continue
            if levels and r.get("level") not in levels:
                continue
            text = self.spec["prompt_template"].format(problem=r["problem"])
            examples.append(
                {
                    "id": r.get("unique_id", r.get("id", i)),
                    "plain": text,
                    "messages": [{"role": "user", "content": text}],
                    "gold": str(r["answer"]),
                }
            )
        if not examples:
            raise ValueError(
                f"math: no {self.spec['dataset']} problem matches subjects="
                f"{subjects} levels={levels}"
            )
        return examples, {
            "dataset": info,
            "filter": {"subjects": subjects, "levels": levels},
            "prompt_template": self.spec["prompt_template"],
            "fewshot": {"num_fewshot": 0},
            "scoring": "aime_answer (integer 0..999)"
            if self.spec["dataset"].startswith("aime")
            else "is_equiv(extract_math_answer(completion), answer)",
        }

    def score(self, example: Example, completion: str) -> dict[str, JSONValue]:
        gold = example["gold"]
        if self.spec["dataset"].startswith("aime"):
            pred: int | str | None = aime_answer(completion)
            ok = pred is not None and str(pred) == str(int(float(gold)))
        else:
            pred = extract_math_answer(completion)
            ok = is_equiv(pred, gold)
        return {"scores": {self.PRIMARY: float(ok)}, "extracted": pred, "gold": gold}
