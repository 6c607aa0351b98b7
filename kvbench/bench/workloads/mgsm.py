"""``mgsm``: MGSM (Shi et al., 2022; 250 problems in each of 11 languages), native-language chain
of thought as lm-evaluation-harness's ``mgsm_native_cot_XX`` tasks (``lm_eval/tasks/mgsm``:
``utils.py`` ``LANGUAGES`` question/answer prefixes, ``native_cot/cot_yaml``).  PN-Mix Table 6
reports 8-shot native CoT, flexible-extract accuracy, full test sets.

Prompt per language: ``"{QUESTION} {question}\\n{ANSWER}"`` (e.g. ``"问题: ...\\n逐步解答:"``).
``num_fewshot`` (default 8) exemplars are the first ``num_fewshot`` rows of the MGSM *train*
split (lm-eval's ``training_split: train``; its questions and answers already carry the native
prefixes), each ``"{question}\\n{ANSWER} {step-by-step answer}"``, joined by ``"\\n\\n"``.  The
train split is loaded from the hub (``juletxara/mgsm``, config = language) through
:func:`kvbench.data.loaders.load_rows`; the local data folder has only the test split, so offline the
8-shot setting fails with a clear message and ``num_fewshot: 0`` (zero-shot native CoT) is the
offline setting.  With ``chat_template`` the exemplars become user/assistant turns.

Scores per example: ``flexible`` (lm-eval's flexible-extract: the last number-like span, after
mapping native digits to ASCII) and ``strict`` (the native answer phrase,
:func:`kvbench.bench.tasks.extract.mgsm_strict`), compared with ``answer_number`` exactly.  Metrics:
``mgsm_<lang>`` (flexible) and ``mgsm_strict_<lang>`` per language, ``mgsm_flexible`` /
``mgsm_strict`` averaged over the selected languages (equal weight), ``task_score`` =
``mgsm_flexible``.  ``--limit N`` keeps N problems per language.  Stop strings: ``"\\n\\n"``
and the chat end markers (lm-eval 4.0 also stops at a single newline; kvbench keeps multi-line
answers so that chat models are not cut after their first line).
"""

from __future__ import annotations

from kvbench.bench.context import Example, Info, RunContext
from kvbench.bench.tasks.extract import (
    FLEXIBLE_REGEX,
    INVALID,
    ascii_digits,
    mgsm_strict,
    numbers_equal,
    regex_filter,
)
from kvbench.bench.tasks.workload import COMMON_PARAMS, TaskWorkload
from kvbench.bench.workloads import HIGHER
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue

#: lm-evaluation-harness mgsm/utils.py LANGUAGES: (QUESTION, ANSWER) prefixes
PREFIXES: dict[str, tuple[str, str]] = {
    "bn": (
        "\u09aa\u09cd\u09b0\u09b6\u09cd\u09a8:",
        "\u09a7\u09be\u09aa\u09c7 \u09a7\u09be\u09aa\u09c7 \u0989\u09a4\u09cd\u09a4\u09b0:",
    ),
    "de": ("Frage:", "Schritt-f\u00fcr-Schritt-Antwort:"),
    "en": ("Question:", "Step-by-Step Answer:"),
    "es": ("Pregunta:", "Respuesta paso a paso:"),
    "fr": ("Question :", "R\u00e9ponse \u00e9tape par \u00e9tape :"),
    "ja": ("\u554f\u984c:", "\u30b9\u30c6\u30c3\u30d7\u3054\u3068\u306e\u7b54\u3048:"),
    "ru": (
        "\u0417\u0430\u0434\u0430\u0447\u0430:",
        "\u041f\u043e\u0448\u0430\u0433\u043e\u0432\u043e\u0435\u0440\u0435\u0448\u0435\u043d"
        "\u0438\u0435:",
    ),
    "sw": ("Swali:", "Jibu la Hatua kwa Hatua:"),
    "te": (
        "\u0c2a\u0c4d\u0c30\u0c36\u0c4d\u0c28:",
        "\u0c26\u0c36\u0c32\u0c35\u0c3e\u0c30\u0c40\u0c17\u0c3e "
        "\u0c38\u0c2e\u0c3e\u0c27\u0c3e\u0c28\u0c02:",
    ),
    "th": (
        "\u0e42\u0e08\u0e17\u0e22\u0e4c:",
        "\u0e04\u0e33\u0e15\u0e2d\u0e1a\u0e17\u0e35\u0e25\u0e30\u0e02\u0e31\u0e49\u0e19"
        "\u0e15\u0e2d\u0e19:",
    ),
    "zh": ("\u95ee\u9898:", "\u9010\u6b65\u89e3\u7b54:"),
}
LANGUAGES = tuple(sorted(PREFIXES))


def test_prompt(lang: str, question: str) -> str:
    """``"{QUESTION} {question}\\n{ANSWER}"`` for a test problem."""
    q, a = PREFIXES[lang]
    return f"{q} {question}\n{a}"


def load_exemplars(lang: str, k: int) -> list[tuple[str, str]]:
    """The first ``k`` rows of the MGSM train split as (prompt, target) pairs.

    Raises ``FileNotFoundError`` with an actionable message when the hub is unreachable.
    """
    from .hub_tasks import hub_rows  # the train split exists only on the hub

    what = f"MGSM {k}-shot native CoT (its exemplars: the train split)"
    rows, _ = hub_rows("juletxara/mgsm", lang, "train", what, "; run with num_fewshot: 0 offline")
    _, a = PREFIXES[lang]
    out = []
    for r in rows[:k]:
        target = str(r["answer"])[len(a) + 1 :] if r.get("answer") else str(r["answer_number"])
        out.append((f"{r['question']}\n{a}", target))
    return out


class MGSM(TaskWorkload):
    type = "mgsm"
    METRICS = {"mgsm_*": HIGHER}  # mgsm_flexible, mgsm_<lang>, mgsm_strict_<lang>
    LIST_PARAMS = TaskWorkload.LIST_PARAMS | {"languages"}
    PARAMS = {**COMMON_PARAMS, "languages": list(LANGUAGES), "num_fewshot": 8}
    PRIMARY = "mgsm_flexible"
    DEFAULT_STOP = ("\n\n", "</s>", "<|im_end|>")
    FIELDS = {
        "languages": Field(str, choices=LANGUAGES, shape="one-or-list"),
        "num_fewshot": Field(int, low=0, high=8),
    }

    @classmethod
    def check_task(cls, spec: dict[str, JSONValue], pre: str) -> None:
        if isinstance(spec["languages"], str):
            spec["languages"] = [spec["languages"]]

    def load(self, ctx: RunContext) -> tuple[list[Example], Info]:
        from kvbench.data.loaders import load_rows

        k = self.spec["num_fewshot"]
        examples, datasets, shots = [], {}, {}
        for lang in self.spec["languages"]:
            rows, info = load_rows(f"mgsm_{lang}")
            datasets[lang] = info
            ex = load_exemplars(lang, k) if k else []
            shots[lang] = ex
            for i, r in enumerate(rows):
                prompt = test_prompt(lang, r["question"])
                plain = "".join(f"{p} {t}\n\n" for p, t in ex) + prompt
                turns: list[dict[str, str]] = []
                for p, t in ex:
                    turns += [{"role": "user", "content": p}, {"role": "assistant", "content": t}]
                turns.append({"role": "user", "content": prompt})
                examples.append(
                    {
                        "id": f"{lang}/{i}",
                        "group": lang,
                        "lang": lang,
                        "plain": plain,
                        "messages": turns,
                        "gold": r["answer_number"],
                        "record": {"lang": lang},
                    }
                )
        return examples, {
            "dataset": datasets,
            "prompt_template": "lm-evaluation-harness mgsm native CoT: '{QUESTION} {question}\\n"
            "{ANSWER}', target delimiter ' ', few-shot delimiter '\\n\\n'",
            "prefixes": {lang: PREFIXES[lang] for lang in self.spec["languages"]},
            "fewshot": {
                "num_fewshot": k,
                "source": "juletxara/mgsm train split, first_n",
                "exemplars": shots,
            },
        }

    def score(self, example: Example, completion: str) -> dict[str, JSONValue]:
        lang, gold = example["lang"], example["gold"]
        flexible = regex_filter(ascii_digits(completion), FLEXIBLE_REGEX, group_select=-1)
        strict = mgsm_strict(completion, lang)
        g = str(int(gold)) if isinstance(gold, float) and gold.is_integer() else str(gold)
        return {
            "scores": {
                "mgsm_flexible": float(flexible != INVALID and numbers_equal(flexible, g)),
                "mgsm_strict": float(strict != INVALID and numbers_equal(strict, g)),
            },
            "extracted": {"strict": strict, "flexible": flexible},
            "gold": gold,
        }

    def extra_metrics(self, rows: list[dict[str, JSONValue]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for lang in self.spec["languages"]:
            mine = [r for r in rows if r.get("lang") == lang]
            if mine:
                out[f"mgsm_{lang}"] = sum(r["mgsm_flexible"] for r in mine) / len(mine)
                out[f"mgsm_strict_{lang}"] = sum(r["mgsm_strict"] for r in mine) / len(mine)
        langs = [lang for lang in self.spec["languages"] if f"mgsm_{lang}" in out]
        if langs:
            out["mgsm_flexible"] = sum(out[f"mgsm_{x}"] for x in langs) / len(langs)
            out["mgsm_strict"] = sum(out[f"mgsm_strict_{x}"] for x in langs) / len(langs)
        return out
