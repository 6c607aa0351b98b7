"""RULER-style synthetic generators: needle depth, protected windows, determinism, scoring."""

from __future__ import annotations

import collections
import re
import sys

import pytest

from kvbench.bench.tasks import synthetic as syn
from kvbench.bench.tasks.haystack import haystack_sentences, split_sentences, word_list
from kvbench.bench.tasks.tokens import encode

tokenizers = pytest.importorskip("tokenizers")

L = 4096
NEEDLE_TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt"]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE (GPT-2 style, like SmolLM2's) trained offline on the essays."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(haystack_sentences("essay")[:3000], trainer=trainer)
    return tok


class WordTokenizer:
    """The minimal protocol: ``encode(text) -> list[int]`` (no keyword arguments)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in re.findall(r"\w+|[^\w\s]", text)]


def _needle_ids_ok(tok, example: dict) -> None:
    ids = encode(tok, example["prompt"])
    assert example["context_tokens"] == len(ids)
    for (start, end), needle, pos in zip(
        example["needle_token_spans"], example["needles"], example["needle_token_positions"]
    ):
        assert start == pos
        assert tok.decode(ids[start:end]).strip() == needle


def test_haystack_assets_without_imports() -> None:
    sents = haystack_sentences("essay")
    assert len(sents) > 5000
    assert sents[0].startswith("July 2010What hard liquor")
    assert split_sentences("It grew.We saw it. Then  it\nwent!") == [
        "It grew.",
        "We saw it.",
        "Then it went!",
    ]
    nouns = word_list("noun")
    assert len(nouns) > 5000 and all(w.isalpha() and w.islower() for w in nouns)
    assert "needlehaystack" not in sys.modules and "wonderwords" not in sys.modules


@pytest.mark.parametrize("depth", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_niah_needle_at_requested_depth(bpe, depth: float) -> None:
    example = syn.niah_single(bpe, L, seed=7, depth=depth)
    _needle_ids_ok(bpe, example)
    assert L - 0.01 * L <= example["context_tokens"] <= L
    (pos,) = example["needle_token_positions"]
    assert abs(pos - depth * example["context_tokens"]) <= 0.01 * L
    key = example["answers"][0]
    assert re.fullmatch(r"\d{5}", key)
    assert f"The pass key is {key}. Remember it." in example["prompt"]
    assert example["prompt"].endswith("What is the pass key? The pass key is")
    assert example["depth"] == depth and example["task"] == "niah_single" and example["seed"] == 7


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("depth", [0.0, 1.0])
def test_needles_avoid_protected_prefix_and_suffix(bpe, task: str, depth: float) -> None:
    prefix, suffix = 300, 500
    example = syn.generate(
        task, bpe, L, seed=3, depth=depth, protect_prefix=prefix, protect_suffix=suffix
    )
    _needle_ids_ok(bpe, example)
    total = example["context_tokens"]
    for start, end in example["needle_token_spans"]:
        assert prefix <= start < end <= total - suffix
    first = example["needle_token_positions"][0]
    target = min(max(depth * total, prefix), total - suffix)  # clamped to the window
    needle_tokens = sum(end - start for start, end in example["needle_token_spans"])
    assert abs(first - target) <= 0.01 * L + needle_tokens  # later needles must fit after it


@pytest.mark.parametrize("task", list(syn.TASKS))
def test_deterministic_from_seed(bpe, task: str) -> None:
    a = syn.generate(task, bpe, 2048, seed=11)
    b = syn.generate(task, bpe, 2048, seed=11)
    c = syn.generate(task, bpe, 2048, seed=12)
    assert a == b
    assert a["prompt"] != c["prompt"]
    assert set(a) >= {
        "prompt",
        "answers",
        "needle_token_positions",
        "context_tokens",
        "depth",
        "seed",
        "task",
    }
    assert a["context_tokens"] <= 2048
    assert syn.score(" ".join(a["answers"]), a["answers"]) == 1.0


def test_multi_needle_tasks_content(bpe) -> None:
    mk = syn.niah_multikey(bpe, L, seed=5, depth=0.5, num_needles=4)
    assert len(mk["needles"]) == 4 and len(mk["answers"]) == 1
    key = re.search(r"magic number for (\S+) mentioned", mk["prompt"]).group(1)
    assert mk["needles"][0] == f"One of the special magic numbers for {key} is: {mk['answers'][0]}."
    assert len({re.search(r"for (\S+) is", n).group(1) for n in mk["needles"]}) == 4

    mv = syn.niah_multivalue(bpe, L, seed=5, depth=0.5, num_values=3)
    assert len(mv["answers"]) == 3 and all(a in mv["prompt"] for a in mv["answers"])

    mq = syn.niah_multiquery(bpe, L, seed=5, depth=0.5, num_needles=4, num_queries=2)
    assert len(mq["answers"]) == 2 and ", and " in mq["prompt"][-200:]

    vt = syn.variable_tracking(bpe, L, seed=5, depth=0.2, num_chains=2, num_hops=3)
    _needle_ids_ok(bpe, vt)
    assert len(vt["answers"]) == 4 and len(vt["needles"]) == 8
    chain = vt["needle_token_positions"][:4]
    assert chain == sorted(chain)
    value = re.search(r"VAR \w+ = (\d+)$", vt["needles"][0]).group(1)
    assert f"assigned the value {value} in the text" in vt["prompt"]
    for name, needle in zip(vt["answers"], vt["needles"]):
        assert needle.startswith(f"VAR {name} = ")


def test_word_frequency_tasks(bpe) -> None:
    short = syn.common_words(bpe, 2048, seed=2)
    short_counts = collections.Counter(re.findall(r"\d+\. (\w+)", short["prompt"]))
    assert {short_counts[w] for w in short["answers"]} == {6}  # RULER's short-context setting

    cwe = syn.common_words(bpe, L, seed=2)
    words = re.findall(r"\d+\. (\w+)", cwe["prompt"])
    counts = collections.Counter(words)
    assert sorted(w for w, _ in counts.most_common(10)) == sorted(cwe["answers"])
    assert all(counts[w] == 30 for w in cwe["answers"])
    assert max(n for w, n in counts.items() if w not in cwe["answers"]) == 3
    assert cwe["needle_token_positions"] == [] and L - 0.02 * L <= cwe["context_tokens"] <= L

    fwe = syn.frequent_words(bpe, L, seed=2)
    body = fwe["prompt"].split("coded words. ", 1)[1].split("\nQuestion:")[0]
    top = collections.Counter(body.split()).most_common(4)
    assert [w for w, _ in top[:3]] == fwe["answers"]
    assert top[2][1] > top[3][1]


def test_minimal_protocol_and_wrap() -> None:
    tok = WordTokenizer()
    wrap = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    example = syn.niah_multikey(
        tok,
        1500,
        seed=1,
        depth=0.4,
        protect_prefix=32,
        protect_suffix=64,
        haystack="noise",
        wrap=wrap,
    )
    ids = tok.encode(example["prompt"])
    assert example["prompt"].startswith(wrap[0]) and example["prompt"].endswith(wrap[1])
    assert len(ids) == example["context_tokens"] <= 1500
    for (start, end), needle in zip(example["needle_token_spans"], example["needles"]):
        assert ids[start:end] == tok.encode(needle)
        assert 32 <= start and end <= len(ids) - 64
    assert abs(example["needle_token_positions"][0] - 0.4 * len(ids)) <= 15


def test_errors(bpe) -> None:
    with pytest.raises(ValueError, match="no room"):
        syn.niah_single(bpe, 1000, depth=0.5, protect_prefix=600, protect_suffix=600)
    with pytest.raises(ValueError, match="unknown task"):
        syn.generate("niah", bpe, 1000)
    with pytest.raises(ValueError, match="depths"):
        syn.niah_single(bpe, 1000, depth=1.5)
    with pytest.raises(ValueError, match="num_queries"):
        syn.niah_multiquery(bpe, 1000, num_needles=2, num_queries=3)


def test_score() -> None:
    answers = ["1234567", "7654321"]
    assert syn.score("The numbers are 1234567 and 7654321.", answers) == 1.0
    assert syn.score("Only 1234567.", answers) == 0.5
    assert syn.score("", answers) == 0.0
    assert syn.score("ABCDE, fghij", ["abcde", "FGHIJ"]) == 1.0
    assert syn.score_any("Only 1234567.", answers) == 1.0
    with pytest.raises(ValueError):
        syn.score("x", [])


@pytest.mark.slow
def test_default_model_tokenizer_positions() -> None:
    """Positions agree with the real SmolLM2 tokenizer (byte-level BPE) when it is cached."""
    models = pytest.importorskip("kvbench.hf.models")
    folder = models.converted_model_dir()
    if not (folder / "tokenizer.json").exists():
        pytest.skip("the default model has not been converted yet")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    for task in NEEDLE_TASKS:
        example = syn.generate(
            task, tok, 8192, seed=0, depth=0.5, protect_prefix=4, protect_suffix=128
        )
        ids = tok.encode(example["prompt"], add_special_tokens=False)
        assert len(ids) == example["context_tokens"] <= 8192
        for (start, end), needle in zip(example["needle_token_spans"], example["needles"]):
            assert tok.decode(ids[start:end]).strip() == needle
            assert 4 <= start and end <= len(ids) - 128
