"""Task workloads whose data exist only on the Hugging Face hub: ``gpqa`` (GPQA-Diamond) and
``infinitebench`` (InfiniteBench, five English tasks).  Offline, :meth:`load` raises
``FileNotFoundError`` naming the hub id (``kvbench run --skip-unavailable`` skips them).

``gpqa``: ``Idavidrein/gpqa`` (config ``gpqa_diamond``, split ``train``, 198 questions; gated:
accept its terms on the hub and log in).  The four choices are shuffled per question with
``random.Random(seed * 100003 + index)``; zero-shot chain-of-thought prompt of the GPQA
baselines (``"What is the correct answer to this question: ..."``, answer format ``"The correct
answer is (X)"``).  Extraction: the last ``answer is (X)``, else the last ``(X)``.  Metric
``gpqa_acc``.

``infinitebench``: ``xinrongzhang2022/InfiniteBench`` (split = task), PN-Mix Table 12's tasks
``kv_retrieval``, ``longdialogue_qa_eng``, ``longbook_choice_eng``, ``longbook_qa_eng``,
``longbook_sum_eng``.  Prompts: the official ``gpt4_templates`` (OpenBMB/InfiniteBench
``src/prompt.py``), no chat template (``chat_template: false`` by default, as Table 12),
middle truncation of the prompt's tokens to ``max_context`` (32,000) as the official
``truncate_by_tokens``, greedy decoding with the official budgets (6-1,200 tokens).  Scores as
the official ``compute_scores.py``: kv_retrieval and longdialogue accuracy (label among the
output's words), longbook_choice (option letter), longbook_qa token F1, longbook_sum ROUGE-Lsum
(needs the ``rouge_score`` package).  Metrics ``ib_<task>`` and ``task_score`` (their mean).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter

import torch

from kvbench.bench.context import Example, Info, RunContext
from kvbench.bench.tasks.workload import COMMON_PARAMS, TaskWorkload
from kvbench.bench.workloads import HIGHER
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue


def hub_rows(
    hub_id: str, config: str | None, split: str, what: str, hint: str = ""
) -> tuple[list[dict[str, object]], Info]:
    """Rows of a hub-only dataset; ``FileNotFoundError`` with the hub id (and ``hint``, what to
    do instead) when unavailable."""
    from kvbench.data.hub import offline_requested
    from kvbench.data.loaders import hub_rows, sha256_text

    try:
        if offline_requested():
            raise OSError("KVBENCH_OFFLINE=1")
        rows = hub_rows(hub_id, config, split)
    except Exception as exc:  # any hub error: re-raised as FileNotFoundError naming it
        # (offline, missing, gated; run_suite's skip_unavailable skips such a workload)
        raise FileNotFoundError(
            f"{what} is not available here: it is loaded from the Hugging Face hub "
            f"({hub_id}, config {config}, split {split}), which failed with "
            f"{type(exc).__name__}: {str(exc)[:200]}{hint}"
        ) from None
    digest = sha256_text("\n".join(json.dumps(r, sort_keys=True, default=str) for r in rows))
    return rows, {
        "dataset_id": hub_id,
        "config": config,
        "split": split,
        "source": "hub",
        "num_rows": len(rows),
        "sha256": digest,
    }


# ----------------------------------------------------------------------------- GPQA
GPQA_TEMPLATE = (
    "What is the correct answer to this question: {question}\n\nChoices:\n(A) {A}\n(B) {B}\n"
    "(C) {C}\n(D) {D}\n\nLet's think step by step, then format the end of your response as "
    'follows: "The correct answer is (insert answer here)".'
)


def gpqa_letter(text: str) -> str | None:
    """The chosen letter: the last ``answer is (X)``, else the last ``(X)``."""
    m = re.findall(r"answer is:?\s*\(?([A-D])\)?", text)
    if m:
        return m[-1]
    m = re.findall(r"\(([A-D])\)", text)
    return m[-1] if m else None


class GPQA(TaskWorkload):
    type = "gpqa"
    METRICS = {"gpqa_acc": HIGHER}
    PARAMS = {**COMMON_PARAMS, "new_tokens": 1024, "subset": "gpqa_diamond"}
    PRIMARY = "gpqa_acc"

    def load(self, ctx: RunContext) -> tuple[list[Example], Info]:
        rows, info = hub_rows(
            "Idavidrein/gpqa",
            self.spec["subset"],
            "train",
            "GPQA (gated; accept its terms and log in)",
        )
        examples = []
        for i, r in enumerate(rows):
            choices = [
                r["Correct Answer"],
                r["Incorrect Answer 1"],
                r["Incorrect Answer 2"],
                r["Incorrect Answer 3"],
            ]
            order = list(range(4))
            random.Random(ctx.seed * 100003 + i).shuffle(order)
            shown = {chr(65 + j): str(choices[k]).strip() for j, k in enumerate(order)}
            text = GPQA_TEMPLATE.format(question=str(r["Question"]).strip(), **shown)
            examples.append(
                {
                    "id": r.get("Record ID", i),
                    "plain": text,
                    "messages": [{"role": "user", "content": text}],
                    "gold": chr(65 + order.index(0)),
                }
            )
        return examples, {
            "dataset": info,
            "prompt_template": GPQA_TEMPLATE,
            "choice_shuffle": "random.Random(seed * 100003 + index)",
        }

    def score(self, example: Example, completion: str) -> dict[str, JSONValue]:
        letter = gpqa_letter(completion)
        return {
            "scores": {"gpqa_acc": float(letter == example["gold"])},
            "extracted": letter,
            "gold": example["gold"],
        }


# ----------------------------------------------------------------------------- InfiniteBench
IB_TEMPLATES = {
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object "
    "below.\n\n{context}\n\n{input}",
    "longbook_qa_eng": "Read the book below and answer a question.\n\n{context}\n\nQuestion: "
    "{question}\n\nBe very concise.",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: "
    "{question}\n\nOnly one of the following options is correct, tell me the answer using one "
    "single letter (A, B, C, or D). Don't say anything else.\nA. {OPTION_A}\nB. {OPTION_B}\n"
    "C. {OPTION_C}\nD. {OPTION_D}",
    "longbook_sum_eng": "Summarize the following book.\n\n{context}",
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a "
    'character name is replaced with "$$MASK$$", and you should try to guess who that '
    "character is.\n\nThe dialogue:\n\n---\n\n{context}\n\n---\n\nEnd of dialogue.\n\nWhich "
    'character is most likely "$$MASK$$"? Just say the name used by the scriptwriter (before '
    "the colon marks) of one single character and nothing else.",
}
IB_BUDGETS = {
    "kv_retrieval": 50,
    "longbook_qa_eng": 40,
    "longbook_choice_eng": 40,
    "longbook_sum_eng": 1200,
    "longdialogue_qa_eng": 40,
}
_SEPARATORS = ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]


def _words(pred: str, seps: list[str] = _SEPARATORS) -> list[str]:
    for c in seps:
        pred = pred.replace(c, " ")
    return pred.split()


def _normalize(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def qa_f1(pred: str, answers: list[str]) -> float:
    """Max token F1 over the answers after SQuAD-style normalization (official qa_f1_score)."""
    best = 0.0
    for gt in answers:
        p, g = _normalize(pred).split(), _normalize(gt).split()
        same = sum((Counter(p) & Counter(g)).values())
        if same:
            prec, rec = same / len(p), same / len(g)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best


def choice_correct(pred: str, letters: list[str]) -> bool:
    """Official ``get_score_one_longbook_choice_eng``."""
    if pred and pred[0] in "ABCD":
        return pred[0] in letters
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        idx = pred.find(prefix)
        if idx == -1:
            continue
        after = pred[idx + len(prefix) + 1 :]
        return any(after.startswith(s) for s in letters)
    for word in pred.split():
        if word in "ABCD":
            return word in letters
    return False


def ib_score(task: str, pred: str, label: str | list[str]) -> float:
    """Score of one InfiniteBench prediction (official ``compute_scores.py``)."""
    if task == "kv_retrieval":
        return float(label in _words(pred))
    if task == "longdialogue_qa_eng":
        return float(label[0] in [w.upper() for w in _words(pred)])
    if task == "longbook_choice_eng":
        return float(choice_correct(pred, label))
    if task == "longbook_qa_eng":
        return qa_f1(pred, label)
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=True)
    return scorer.score(label, pred)["rougeLsum"].fmeasure


class InfiniteBench(TaskWorkload):
    type = "infinitebench"
    METRICS = {"ib_*": HIGHER}  # ib_score, ib_avg, ib_<task>
    LIST_PARAMS = TaskWorkload.LIST_PARAMS | {"tasks"}
    PARAMS = {
        **COMMON_PARAMS,
        "chat_template": False,
        "new_tokens": None,
        "tasks": list(IB_TEMPLATES),
        "max_context": 32000,
    }
    PRIMARY = "ib_avg"
    FIELDS = {
        "new_tokens": Field(int, low=0, optional=True),  # None or 0: the tasks' own budgets
        "tasks": Field(str, choices=tuple(IB_TEMPLATES), shape="list"),
        "max_context": Field(int, low=16),
    }

    def load(self, ctx: RunContext) -> tuple[list[Example], Info]:
        examples, infos = [], {}
        half = self.spec["max_context"] // 2
        for task in self.spec["tasks"]:
            rows, info = hub_rows(
                "xinrongzhang2022/InfiniteBench", None, task, f"InfiniteBench {task}"
            )
            infos[task] = info
            for i, r in enumerate(rows):
                opts = list(r.get("options") or [])
                fields = {"context": r["context"], "input": r["input"], "question": r["input"]}
                fields.update(
                    {
                        f"OPTION_{c}": (opts[j] if j < len(opts) else "")
                        for j, c in enumerate("ABCD")
                    }
                )
                text = IB_TEMPLATES[task].format(**fields)
                ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(ids) > 2 * half:  # official middle truncation
                    text = ctx.tokenizer.decode(ids[:half] + ids[-half:])
                answers = list(r["answer"]) if isinstance(r["answer"], list) else [r["answer"]]
                if task == "longbook_choice_eng":
                    label: str | list[str] = [chr(65 + opts.index(a)) for a in answers if a in opts]
                elif task in ("kv_retrieval", "longbook_sum_eng"):
                    label = answers[0]
                else:
                    label = answers
                examples.append(
                    {
                        "id": f"{task}/{r.get('id', i)}",
                        "group": task,
                        "task": task,
                        "plain": text,
                        "messages": [{"role": "user", "content": text}],
                        "gold": label,
                        "budget": IB_BUDGETS[task],
                        "record": {"task": task},
                    }
                )
        if "longbook_sum_eng" in self.spec["tasks"]:
            try:
                import rouge_score  # noqa: F401
            except ImportError:
                raise FileNotFoundError(
                    "infinitebench longbook_sum_eng needs the rouge_score package "
                    "(pip install rouge-score)"
                ) from None
        return examples, {
            "dataset": infos,
            "prompt_templates": "InfiniteBench gpt4_templates",
            "truncation": f"middle, to {2 * half} tokens (truncate_by_tokens)",
            "budgets": IB_BUDGETS,
        }

    def prompt_ids(self, ctx: RunContext, example: Example) -> tuple[torch.Tensor, int]:
        from kvbench.bench.tasks.workload import encode_text

        ids = encode_text(ctx.tokenizer, example["prompt"], example["templated"])
        return ids, self.spec["new_tokens"] or example["budget"]

    def score(self, example: Example, completion: str) -> dict[str, JSONValue]:
        s = ib_score(example["task"], completion, example["gold"])
        return {"scores": {"ib_score": s}, "extracted": None, "gold": example["gold"]}

    def extra_metrics(self, rows: list[dict[str, JSONValue]]) -> dict[str, float]:
        out = {}
        for t in self.spec["tasks"]:
            mine = [r["ib_score"] for r in rows if r.get("task") == t]
            if mine:
                out[f"ib_{t}"] = sum(mine) / len(mine)
        vals = [out[f"ib_{t}"] for t in self.spec["tasks"] if f"ib_{t}" in out]
        out["ib_avg"] = sum(vals) / len(vals) if vals else float("nan")
        return out
