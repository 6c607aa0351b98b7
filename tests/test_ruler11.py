"""The ``ruler11`` workload (kvbench.bench.workloads.ruler11) and its tasks
(kvbench.bench.tasks.ruler_tasks): every generated prompt is parsed back independently (regular
expressions over the prompt text, token ids re-encoded) to find the needles, chains and word
counts, which must give the recorded answers; scoring on hand-written outputs; the Wilson
interval against the roots of its defining quadratic; the protocol refusal; a tiny-Llama run
in both protocols.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
import pytest

from kvbench.bench.context import RunContext
from kvbench.bench.intervals import wilson_ci
from kvbench.bench.tasks import ruler_tasks as rt
from kvbench.bench.tasks.tokens import encode
from kvbench.bench.workloads import check_metrics
from kvbench.bench.workloads.ruler11 import Ruler11
from kvbench.cache.registry import get_method

L = 700
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")


@pytest.fixture(scope="module")
def tiny():
    from tiny_lm import tiny_lm

    return tiny_lm(16)


def make(**params) -> Ruler11:
    base = {"lengths": [L], "num_examples": 1, "protect_prefix": 8, "protect_suffix": 32}
    return Ruler11(Ruler11.validate({"type": "ruler11", **base, **params}))


def examples(tok, info, **params) -> list[dict]:
    w = make(**params)
    w.prepare(RunContext(tokenizer=tok, model_info=info))
    return w.examples


# ------------------------------------------------------------------ generation
@pytest.mark.parametrize("task", list(rt.RULER11))
def test_generation_is_deterministic_and_fits(tiny, task) -> None:
    _, tok, _ = tiny
    spec = rt.RULER11[task]
    kw = dict(spec.kwargs)
    if spec.needles:
        kw.update(protect_prefix=8, protect_suffix=32)
    a = spec.generator(tok, 800, seed=3, **kw)
    b = spec.generator(tok, 800, seed=3, **kw)
    c = spec.generator(tok, 800, seed=4, **kw)
    assert a == b
    assert a["prompt"] != c["prompt"]
    ids = encode(tok, a["prompt"])
    assert a["context_tokens"] == len(ids) <= 800
    for s, e in a["needle_token_spans"]:  # protected regions hold no needle token
        assert 8 <= s < e <= len(ids) - 32


def _question(prompt: str) -> str:
    return prompt[prompt.rfind("\nWhat ") + 1 :]


@pytest.mark.parametrize("task", [t for t in rt.RULER11 if t.startswith("niah")])
def test_niah_answers_are_the_asked_keys_needles(tiny, task) -> None:
    _, tok, _ = tiny
    spec = rt.RULER11[task]
    ex = spec.generator(tok, 600, seed=1, protect_prefix=8, protect_suffix=32, **spec.kwargs)
    prompt = ex["prompt"]
    question = _question(prompt)
    body = prompt[: len(prompt) - len(question)]
    m = re.match(
        r"What (?:is|are all) the special magic (?:number|uuid)s? for (.+?) mentioned", question
    )
    asked = re.split(r", and |, ", m.group(1))
    found = NEEDLE.findall(body)
    values = [v for _, k, v in found if k in asked]
    assert values == ex["answers"] or sorted(values) == sorted(ex["answers"])
    assert all(body.count(f" for {k} is: ") >= 1 for k in asked)
    kw = spec.kwargs
    assert len(asked) == kw.get("num_queries", 1)
    assert len(ex["answers"]) == kw.get("num_queries", 1) * kw.get("num_values", 1)
    if kw.get("value_type") == "uuids":
        assert all(re.fullmatch(UUID, v) for v in ex["answers"])
    if kw.get("key_type") == "uuids":
        assert all(re.fullmatch(UUID, k) for k in asked)
    if kw["haystack"] == "needle":  # the haystack is distractor needles, every key distinct
        keys = [k for _, k, _ in found]
        assert len(found) > 2 and len(set(keys)) == len(keys)
        assert NEEDLE.sub("", body.split("\n", 1)[1]).strip() == ""
    else:  # only the task's own needles
        assert len(found) == kw.get("num_keys", 1) * kw.get("num_values", 1)
    if kw["haystack"] == "noise":
        rest = NEEDLE.sub("", body.split("\n", 1)[1])
        assert set(re.findall(r"[A-Z][^.]*\.", rest)) <= {
            "The grass is green.",
            "The sky is blue.",
            "The sun is yellow.",
            "Here we go.",
            "There and back again.",
        }
    ids = encode(tok, prompt)  # each recorded span decodes to its needle
    for (s, e), needle in zip(ex["needle_token_spans"], ex["needles"]):
        assert tok.decode(ids[s:e]).strip() == needle


def test_vt_answers_follow_the_chain(tiny) -> None:
    _, tok, _ = tiny
    spec = rt.RULER11["vt"]
    ex = spec.generator(tok, 600, seed=2, protect_prefix=8, protect_suffix=32, **spec.kwargs)
    prompt = ex["prompt"]
    value = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
    held = {value}
    names = []
    for left, right in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", prompt):
        src = right.removeprefix("VAR ")
        if src in held:
            held.add(left)
            names.append(left)
    assert names == ex["answers"]
    assert len(names) == 5


def test_cwe_and_fwe_answers_are_the_most_frequent_words(tiny) -> None:
    _, tok, _ = tiny
    cwe = rt.RULER11["cwe"].generator(tok, 800, seed=5)
    listing = cwe["prompt"].split("\n")[1]
    counts = collections.Counter(re.findall(r"\d+\. (\w+)", listing))
    top = sorted(counts, key=lambda w: -counts[w])
    k = len(cwe["answers"])
    assert set(top[:k]) == set(cwe["answers"])
    assert counts[top[k - 1]] > counts[top[k]]
    fwe = rt.RULER11["fwe"].generator(tok, 800, seed=5)
    coded = fwe["prompt"].split("coded words. ", 1)[1].split("\nQuestion:")[0]
    counts = collections.Counter(coded.split())
    top = [w for w, _ in counts.most_common()]
    assert top[:3] == fwe["answers"]
    assert counts[top[2]] > counts[top[3]]


def test_question_split_is_where_the_question_starts(tiny) -> None:
    _, tok, info = tiny
    for ex in examples(tok, info, tasks=list(rt.RULER11), new_tokens=4):
        ids = encode(tok, ex["prompt"])
        c = ex["context"]
        head, tail = tok.decode(ids[:c]), tok.decode(ids[c:])
        assert head + tail == ex["prompt"]
        assert tail.lstrip("\n").startswith(("What ", "Question:")), ex["id"]
        assert ex["record"]["question_tokens"] == len(ids) - c
        assert ex["record"]["prompt_tokens_total"] + 4 <= L  # RULER: prompt + budget fit


# ------------------------------------------------------------------ scoring
def test_string_match_worked_examples() -> None:
    gold = ["1234567", "7654321", "1111111"]
    assert rt.string_match_all("The numbers are 1234567, 7654321 and 1111111.", gold) == 1.0
    assert rt.string_match_all("They are 1234567 and 7654321.", gold) == pytest.approx(2 / 3)
    assert rt.string_match_all("I do not know.", gold) == 0.0
    assert rt.string_match_part("They are 1234567 and 9.", gold) == 1.0
    assert rt.string_match_part("none", gold) == 0.0
    assert rt.string_match_all("  Alpha\x00BETA ", ["alpha", "beta"]) == 1.0  # case, controls
    with pytest.raises(ValueError):
        rt.string_match_all("x", [])


def test_hand_written_outputs_score_per_task_with_intervals(tiny) -> None:
    _, tok, info = tiny
    w = make(tasks=["niah_multivalue", "vt"], num_examples=2, new_tokens=8)
    ctx = RunContext(tokenizer=tok, model_info=info)
    w.prepare(ctx)
    out = {}
    for ex in w.examples:
        a = ex["answers"]
        if ex["task"] == "niah_multivalue":  # example 0: all four, example 1: two of four
            out[ex["id"]] = " ".join(a) if ex["id"].endswith("/0") else f"{a[0]}, {a[1]}"
        else:  # vt: none, then all
            out[ex["id"]] = "no idea" if ex["id"].endswith("/0") else ", ".join(a)
    w.generate = lambda c, m, ex: {"text": out[ex["id"]], "new_tokens": 1, "stop_reason": "stub"}
    m = w.run(ctx, get_method("full")).metrics
    assert m[f"ruler11_niah_multivalue_{L}"] == pytest.approx(0.75)
    assert m[f"ruler11_vt_{L}"] == pytest.approx(0.5)
    assert m["ruler11_avg"] == m["task_score"] == pytest.approx(0.625)
    lo, hi = wilson_ci(1.5, 2)
    assert (m["ruler11_niah_multivalue_ci_low"], m["ruler11_niah_multivalue_ci_high"]) == (lo, hi)
    check_metrics(Ruler11, m)


def _wilson_by_roots(k: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The p0 with (p - p0)^2 = z^2 p0 (1 - p0) / n: roots of a quadratic in p0."""
    p = k / n
    roots = np.roots([1 + z * z / n, -(2 * p + z * z / n), p * p]).real
    return float(min(roots)), float(max(roots))


@pytest.mark.parametrize("k,n", [(8, 10), (0, 20), (20, 20), (1, 3), (7.5, 16), (50, 100)])
def test_wilson_interval_against_its_quadratic(k, n) -> None:
    lo, hi = wilson_ci(k, n)
    r_lo, r_hi = _wilson_by_roots(k, n)
    assert lo == pytest.approx(max(r_lo, 0.0), abs=1e-12)
    assert hi == pytest.approx(min(r_hi, 1.0), abs=1e-12)


def test_wilson_published_values() -> None:
    # 8/10 at 95%: 0.4902 to 0.9433 (Newcombe 1998, Stat. Med. 17, method 3)
    lo, hi = wilson_ci(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson_ci(0, 0) is None
    with pytest.raises(ValueError):
        wilson_ci(3, 2)


# ------------------------------------------------------------------ protocol and parameters
def test_question_aware_on_a_task_without_a_question_is_refused(monkeypatch) -> None:
    bare = dataclasses.replace(rt.RULER11["cwe"], question=None)
    monkeypatch.setitem(rt.RULER11, "cwe", bare)
    with pytest.raises(ValueError, match=r"protocol.*'question-agnostic'"):
        make(tasks=["cwe", "vt"], protocol="question-aware")
    make(tasks=["cwe", "vt"], protocol="question-agnostic")  # allowed


@pytest.mark.parametrize(
    "params,match",
    [
        ({"protocol": "both"}, r"protocol.*question-agnostic.*question-aware"),
        ({"tasks": ["qa_1"]}, "tasks"),
        ({"lengths": [200]}, "lengths"),
        ({"num_examples": 0}, "num_examples"),
    ],
)
def test_bad_parameters_name_the_field(params, match) -> None:
    with pytest.raises(ValueError, match=match):
        make(**params)


# ------------------------------------------------------------------ tiny model runs
def test_tiny_llama_both_protocols(tiny) -> None:
    model, tok, info = tiny
    tasks = ["niah_single_1", "niah_multikey_2", "cwe"]
    texts = {}
    for protocol in rt.PROTOCOLS:
        w = make(tasks=tasks, num_examples=2, new_tokens=6, protocol=protocol)
        ctx = RunContext(model=model, tokenizer=tok, model_info=info, seed=0)
        w.prepare(ctx)
        res = w.run(ctx, get_method("full"))
        check_metrics(Ruler11, res.metrics)
        for t in tasks:
            for name in (f"ruler11_{t}_{L}", f"ruler11_{t}"):
                assert {name, f"{name}_ci_low", f"{name}_ci_high"} <= set(res.metrics)
        assert {f"ruler11_len{L}", "ruler11_avg", "task_score", "num_examples"} <= set(res.metrics)
        assert res.metrics["num_examples"] == 6
        assert res.info["protocol"] == protocol
        rows = res.per_layer["examples"]
        assert all(r["protocol"] == protocol for r in rows)
        texts[protocol] = [r["completion"] for r in rows]
        # the method compresses what the first forward holds: the context alone when agnostic
        kivi = get_method("kivi", bits=2, group_size=16, residual_length=32)
        for r in w.run(ctx, kivi).per_layer["examples"]:
            held = r["context_tokens"] if protocol == "question-agnostic" else r["prompt_tokens"]
            assert r["key_quantized_after_prefill"] == held - held % 32
    # the 16-bit cache gives the same greedy answers whether the question comes later or not
    assert texts["question-agnostic"] == texts["question-aware"]


def test_answer_prefix_opens_the_assistant_turn() -> None:
    closing = "<end>\n<assistant>\n"
    prompt = "ctx\nWhat is X? The special magic number for X is" + closing
    moved = rt.answer_after_turn(prompt, " The special magic", closing)
    assert moved == "ctx\nWhat is X?" + closing + " The special magic number for X is"
    assert rt.answer_after_turn(prompt, " The special magic", "") == prompt
