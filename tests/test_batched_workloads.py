"""``batch_size`` in the ``generation`` and ``passkey`` workloads (docs/design.md#padding).

The right value of each prompt of a left-padded batch is that prompt run alone (``batch_size:
1``, the workload's unbatched path, which never builds a mask).  A seeded tiny random Llama with
GQA (tests/tiny_lm.py, head_dim 32 so that llama.cpp blocks fit), small groups and residuals so
that every method quantizes within the few tokens generated.  The padding ledger's counts are
checked against pads counted by hand from the prompt lengths.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_padded_batch import same_fp16_scales
from tiny_lm import tiny_lm

from kvbench.bench.context import RunContext
from kvbench.bench.workloads import WORKLOADS
from kvbench.cache.method import Capabilities
from kvbench.cache.registry import get_method, get_method_class

SMALL = {"group_size": 4, "residual_length": 4, "num_sink_tokens": 2, "value_bits": 2, "bits": 2}
METHODS = ["full", "kivi", "per-token", "pn-mix", "int4-block", "fp8"]
PROMPTS = [
    "The pass key is 71432. Remember it.",
    "Hello.",
    "Grace Hopper wrote the first compiler in nineteen fifty two, people say.",
    "A train leaves at noon.",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def method(name: str):
    fields = {f.name for f in dataclasses.fields(get_method_class(name).Config)}
    return get_method(name, **{k: v for k, v in SMALL.items() if k in fields})


def make(kind: str, **params):
    if kind == "passkey":
        params = {"protect_prefix": 16, "protect_suffix": 32, **params}
    cls = WORKLOADS.get(kind)
    return cls(cls.validate({"type": kind, **params}))


def run(kind: str, name: str, bs: int, edit=None, **params):
    model, tok, info = tiny_lm(32)
    w = make(kind, batch_size=bs, **params)
    ctx = RunContext(model=model, tokenizer=tok, model_info=info, seed=0)
    w.prepare(ctx)
    if edit is not None:
        edit(w)
    return w, w.run(ctx, method(name))


def shorten(w) -> None:
    """Haystack prompts of one length: drop the first 5 and 11 tokens of the 2nd and 3rd."""
    w.examples = [(ex, ids[:, (0, 5, 11, 0)[i] :]) for i, (ex, ids) in enumerate(w.examples)]


def hand_pads(lens: list[int], bs: int) -> int:
    total = 0
    for i in range(0, len(lens), bs):
        chunk = lens[i : i + bs]
        total += sum(max(chunk) - n for n in chunk)
    return total


@pytest.mark.parametrize("name", METHODS)
def test_generation_batch_3_equals_batch_1_per_prompt(name):
    params = dict(prompts=PROMPTS, new_tokens=8, bucket=4)
    w1, one = run("generation", name, 1, **params)
    w3, three = run("generation", name, 3, **params)
    lens = [int(ids.shape[1]) for ids, _, _ in w3.items]
    assert len(set(lens[:3])) == 3  # the first batch is padded
    # the full-precision reference is batched too and gives the same continuations
    for (_, r1, _), (_, r3, _) in zip(w1.items, w3.items):
        assert torch.equal(r1, r3)
    assert three.per_layer["first_divergence"] == one.per_layer["first_divergence"]
    assert three.per_layer["match_rate"] == one.per_layer["match_rate"]
    # next-token KL (1e-6..1e-4 here) moves by less than the log-probs do: float32 noise of the
    # batched matmuls (seen up to 1.2e-7; a code at a rounding boundary may flip); the log-probs
    # themselves are bounded (1e-5) in the next test
    for a, b in zip(three.per_layer["next_token_kl"], one.per_layer["next_token_kl"]):
        assert a == pytest.approx(b, abs=1e-6)
    pad = three.info["padding"]
    assert pad["batch_size"] == 3 and pad["batches"] == 2 and pad["padded_batches"] == 1
    assert pad["prompt_tokens"] == sum(lens)
    assert pad["pad_tokens"] == hand_pads(lens, 3)
    assert pad["pad_tokens_stored"] == 0
    assert one.info["padding"]["pad_tokens"] == 0
    assert three.info["decode_attention"]["route"] == "attend"
    if name != "full":  # the method quantized something in the window compared
        assert one.metrics["next_token_kl"] > 0


@pytest.mark.parametrize("name", METHODS)
def test_batched_greedy_and_teacher_forcing_equal_each_prompt_alone(name):
    """The two batched primitives of ``generation``: greedy tokens identical, teacher-forced
    log-probs within float32 noise (1e-5, as tests/test_padded_batch.py bounds the logits;
    pads in the statistics or a wrong position give ~1e-4 and more)."""
    from kvbench.bench.workloads.generation import (
        forced_logprobs,
        forced_logprobs_batch,
        greedy,
        greedy_batch,
    )

    model, tok, _ = tiny_lm(32)
    ids = [tok(p, return_tensors="pt")["input_ids"] for p in PROMPTS[:3]]
    gens = greedy_batch(model, ids, method(name), 8)
    conts = [
        torch.randint(0, len(tok), (8,), generator=torch.Generator().manual_seed(i))
        for i in range(3)
    ]
    lps = forced_logprobs_batch(model, ids, conts, method(name))
    for p, g, c, lp in zip(ids, gens, conts, lps):
        assert torch.equal(g, greedy(model, p, method(name), 8))
        want = forced_logprobs(model, p, c, method(name))
        assert lp.shape == want.shape == (8, len(tok))
        assert (lp - want).abs().max() <= 1e-5, (lp - want).abs().max()


@pytest.mark.parametrize("name", METHODS)
def test_passkey_batch_3_equals_batch_1_per_example(name):
    params = dict(length=256, depths=[0.3, 0.7], seeds=2, new_tokens=6)
    _, one = run("passkey", name, 1, shorten, **params)
    w, three = run("passkey", name, 3, shorten, **params)
    lens = [int(ids.shape[1]) for _, ids in w.examples]
    assert len(set(lens[:3])) == 3  # the first batch is padded
    assert three.per_layer["examples"] == one.per_layer["examples"]
    assert [r["prompt_tokens"] for r in three.per_layer["examples"]] == lens
    assert three.metrics == one.metrics
    pad = three.info["padding"]
    assert pad["pad_tokens"] == hand_pads(lens, 3) > 0
    assert pad["pad_tokens_stored"] == 0 and pad["batches"] == 2


def test_unpadded_passkey_batch_keeps_per_tensor_statistics_per_row(monkeypatch):
    """Haystack prompts of one length make an unpadded batch; ``uniform`` has one scale per
    flushed tensor, which a shared batched cache would compute over all rows: each row is
    cached alone (``rows_apart``), so its stored scales are those of batch 1."""
    import kvbench.hf.cache as hfc

    made = []

    class Recording(hfc.QuantizedKVCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(hfc, "QuantizedKVCache", Recording)
    params = dict(length=256, depths=[0.3, 0.7], seeds=2, new_tokens=6)
    w, three = run("passkey", "uniform", 3, **params)
    batched, made[:] = made[0], []
    _, one = run("passkey", "uniform", 1, **params)
    assert len({int(ids.shape[1]) for _, ids in w.examples}) == 1
    assert three.info["padding"]["pad_tokens"] == 0
    assert three.per_layer["examples"] == one.per_layer["examples"]
    for b in range(3):
        for lb, la in zip(batched.layer_caches(), made[b].layer_caches()):
            got = [t for _, c, t in lb.rows[b].tensors() if c == "scales"]
            want = [t for _, c, t in la.tensors() if c == "scales"]
            assert got and len(got) == len(want)
            assert same_fp16_scales(got, want)


def test_batched_generation_and_passkey_refuse_a_method_without_padding():
    class NoPad(type(get_method("kivi"))):
        capabilities = Capabilities(padding=False)

    meth = NoPad(**SMALL)
    meth.name = "no-pad"
    model, tok, info = tiny_lm(32)
    ctx = RunContext(model=model, tokenizer=tok, model_info=info, seed=0)
    gen = make("generation", prompts=PROMPTS[:2], new_tokens=2, bucket=2, batch_size=2)
    key = make("passkey", length=256, depths=[0.5], seeds=2, new_tokens=2, batch_size=2)
    for w in (gen, key):
        w.prepare(ctx)
        with pytest.raises(ValueError, match="'no-pad' does not support padded batches"):
            w.run(ctx, meth)


@pytest.mark.parametrize("kind", ["generation", "passkey", "gsm8k"])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_batch_size_must_be_a_positive_integer(kind, bad):
    with pytest.raises(ValueError, match="batch_size"):
        make(kind, batch_size=bad)
