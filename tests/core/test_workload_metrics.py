"""The numbers a record carries, recomputed independently.

``Perplexity.run``, ``Generation.run`` and ``Passkey.run`` are fed hand-built log-probabilities,
sequences and completions (their model-facing helpers are replaced), and every metric is
recomputed here by a float64 loop over positions with ``torch.distributions`` KL and
hand-counted agreement.  Directions: ``next_token_kl`` is KL(P_full || P_method) (the reference
first, docs/design.md#protocols) and ``top1_agreement`` compares the method's argmax over the vocabulary with
the full-precision argmax.  The protocol itself (which positions are scored) is checked on a
seeded toy Llama (GQA, two layers): the chunked ``full`` run must give the log-probabilities of
one plain forward pass over the window.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from kvbench.hf.attention import use_kvbench_attention
from kvbench.kv.registry import get_method
from kvbench.workloads import generation as gen_mod
from kvbench.workloads import perplexity as ppl_mod
from kvbench.workloads.generation import Generation
from kvbench.workloads.passkey import Passkey
from kvbench.workloads.perplexity import Perplexity, chunked_logits

V = 11  # vocabulary of the hand-built distributions; != the number of positions scored


def _logprobs(n: int, seed: int, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(sharp * torch.randn(n, V, generator=g), dim=-1)


def _ctx(seed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(model=None, seed=seed, model_info={"head_dim": 64}, shared={})


def _kl_loop(ref: torch.Tensor, lp: torch.Tensor) -> list[float]:
    """KL(P_ref || P) per position, float64, via torch.distributions."""
    return [
        kl_divergence(Categorical(logits=r.double()), Categorical(logits=q.double())).item()
        for r, q in zip(ref, lp)
    ]


def _agree_loop(ref: torch.Tensor, lp: torch.Tensor) -> list[int]:
    out = []
    for r, q in zip(ref, lp):  # one position at a time: argmax over the vocabulary
        out.append(int(max(range(V), key=lambda i: r[i]) == max(range(V), key=lambda i: q[i])))
    return out


# ------------------------------------------------------------------------------ perplexity
def _perplexity_run(monkeypatch, windows, refs, method_lps, prefill):
    calls = iter(method_lps)
    monkeypatch.setattr(ppl_mod, "chunked_logits", lambda *a, **k: (next(calls), {"total": 1234}))
    wl = Perplexity(
        Perplexity.validate(
            {"type": "perplexity", "tokens": windows[0].numel(), "prefill": prefill, "chunk": 2}
        )
    )
    wl.windows, wl.ref, wl.info = windows, refs, {}
    return wl.run(_ctx(), get_method("full"))


@pytest.mark.parametrize("n_windows", [1, 3])
def test_perplexity_metrics_match_float64_loop(monkeypatch, n_windows: int) -> None:
    prefill, t = 4, 13  # 9 scored positions, vocabulary of 11
    g = torch.Generator().manual_seed(7)
    windows = [torch.randint(0, V, (t,), generator=g) for _ in range(n_windows)]
    refs = [_logprobs(t - prefill, 10 + w) for w in range(n_windows)]
    # the method's distributions: the reference perturbed, so that top-1 agrees at some positions
    lps = [
        torch.log_softmax(r + 1.2 * _logprobs(t - prefill, 20 + w), -1) for w, r in enumerate(refs)
    ]
    res = _perplexity_run(monkeypatch, windows, refs, lps, prefill)
    m = res.metrics

    nll, nll_ref, kls, agree = [], [], [], []
    for w, ref, lp in zip(windows, refs, lps):
        targets = w[prefill:].tolist()  # the tokens the scored positions predict
        nll.append(-sum(lp[i, tok].double().item() for i, tok in enumerate(targets)) / len(targets))
        nll_ref.append(
            -sum(ref[i, tok].double().item() for i, tok in enumerate(targets)) / len(targets)
        )
        kls.append(sum(_kl_loop(ref, lp)) / len(targets))
        agree.append(sum(_agree_loop(ref, lp)) / len(targets))
    ppl, ppl_ref = math.exp(sum(nll) / n_windows), math.exp(sum(nll_ref) / n_windows)
    assert m["ppl"] == pytest.approx(ppl, rel=1e-5)
    assert m["ppl_ref"] == pytest.approx(ppl_ref, rel=1e-5)
    assert m["ppl_delta"] == pytest.approx(ppl - ppl_ref, rel=1e-5, abs=1e-6)
    assert m["next_token_kl"] == pytest.approx(sum(kls) / n_windows, rel=1e-5)
    assert m["top1_agreement"] == pytest.approx(sum(agree) / n_windows, abs=1e-7)
    assert 0 < m["top1_agreement"] < 1  # the hand-built case has both kinds of position
    # the reversed direction KL(P_method || P_full) is a clearly different number here
    rev = sum(sum(_kl_loop(lp, ref)) / len(ref) for ref, lp in zip(refs, lps)) / n_windows
    assert abs(rev - m["next_token_kl"]) > 0.05 * m["next_token_kl"]
    assert m["bytes_total"] == 1234
    assert res.per_layer["window_kl"] == pytest.approx(kls, rel=1e-5)
    cis = {k for k in m if k.endswith(("_ci_low", "_ci_high"))}
    if n_windows == 1:
        assert cis == set()  # one window: no interval
    else:
        assert cis == {f"{b}_ci_{s}" for b in ("ppl_delta", "next_token_kl", "top1_agreement")
                       for s in ("low", "high")}  # fmt: skip
        lo, hi = m["next_token_kl_ci_low"], m["next_token_kl_ci_high"]
        assert min(kls) - 1e-5 <= lo <= hi <= max(kls) + 1e-5


def test_perplexity_of_the_reference_itself_is_exact(monkeypatch) -> None:
    windows = [torch.arange(10) % V]
    refs = [_logprobs(6, 3)]
    m = _perplexity_run(monkeypatch, windows, refs, [refs[0].clone()], 4).metrics
    assert m["next_token_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["top1_agreement"] == 1.0
    assert m["ppl_delta"] == pytest.approx(0.0, abs=1e-6)


def _toy_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
        intermediate_size=96,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return use_kvbench_attention(LlamaForCausalLM(cfg).eval())


@pytest.mark.parametrize("prefill, chunk", [(5, 1), (8, 3), (1, 64)])
def test_chunked_full_scores_the_same_positions_as_one_forward(prefill: int, chunk: int) -> None:
    model = _toy_llama()
    ids = torch.randint(0, 96, (1, 23), generator=torch.Generator().manual_seed(1))
    lp, _ = chunked_logits(model, ids, get_method("full"), prefill, chunk)
    with torch.no_grad():
        plain = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    # position i of lp predicts token prefill + i, i.e. the plain logits at prefill + i - 1
    assert lp.shape == (ids.shape[1] - prefill, 96)
    torch.testing.assert_close(lp.double(), plain[prefill - 1 : -1], atol=2e-5, rtol=0)


def test_chunked_quantized_method_reads_its_cache() -> None:
    # a 2-bit cache must change the scored distributions (so the workload measures the cache)
    model = _toy_llama()
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    full, _ = chunked_logits(model, ids, get_method("full"), 16, 4)
    q, nb = chunked_logits(
        model,
        ids,
        get_method("per-token", bits=2, value_bits=2, group_size=16, residual_length=8),
        16,
        4,
    )
    assert (full - q).abs().max() > 1e-3
    assert nb["total"] > 0


# ------------------------------------------------------------------------------ generation
def test_generation_metrics_match_hand_count(monkeypatch) -> None:
    n, bucket = 10, 4  # buckets: steps 0-3, 4-7, 8-9
    refs = [torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), torch.tensor([5] * 10)]
    gens = [torch.tensor([1, 2, 3, 0, 5, 6, 0, 8, 9, 10]), torch.tensor([5] * 10)]
    ref_lps = [_logprobs(n, 30), _logprobs(n, 31)]
    # perturbed references: top-1 agrees at some steps and not at others
    lps = [torch.log_softmax(r + 1.5 * _logprobs(n, 40 + i), -1) for i, r in enumerate(ref_lps)]
    g_iter, lp_iter = iter(gens), iter(lps)
    monkeypatch.setattr(gen_mod, "greedy", lambda *a, **k: next(g_iter))
    monkeypatch.setattr(gen_mod, "forced_logprobs", lambda *a, **k: next(lp_iter))
    wl = Generation(Generation.validate({"type": "generation", "new_tokens": n, "bucket": bucket}))
    wl.items = [(None, r, rl) for r, rl in zip(refs, ref_lps)]
    m = wl.run(_ctx(), get_method("full")).metrics

    # prompt 0 first differs at step 3 and matches 8 of 10; prompt 1 never differs
    assert m["gen_first_divergence"] == pytest.approx((3 + 10) / 2)
    assert m["gen_match_rate"] == pytest.approx((0.8 + 1.0) / 2)
    kl = [_kl_loop(r, q) for r, q in zip(ref_lps, lps)]
    agree = [_agree_loop(r, q) for r, q in zip(ref_lps, lps)]
    per_step_kl = [(a + b) / 2 for a, b in zip(*kl)]
    per_step_top1 = [(a + b) / 2 for a, b in zip(*agree)]
    assert m["next_token_kl"] == pytest.approx(sum(per_step_kl) / n, rel=1e-5)
    assert m["top1_agreement"] == pytest.approx(sum(per_step_top1) / n, abs=1e-7)
    for i, (lo, hi) in enumerate([(0, 4), (4, 8), (8, 10)]):
        assert m[f"drift_kl_b{i}"] == pytest.approx(sum(per_step_kl[lo:hi]) / (hi - lo), rel=1e-5)
        want = sum(per_step_top1[lo:hi]) / (hi - lo)
        assert m[f"drift_top1_b{i}"] == pytest.approx(want, abs=1e-7)
    assert "drift_kl_b3" not in m
    assert 0 < m["top1_agreement"] < 1 and len({m[f"drift_top1_b{i}"] for i in range(3)}) > 1
    assert m["gen_first_divergence_ci_low"] <= m["gen_first_divergence_ci_high"]
    assert 3 <= m["gen_first_divergence_ci_low"] and m["gen_first_divergence_ci_high"] <= 10


def test_generation_with_one_prompt_has_no_interval(monkeypatch) -> None:
    monkeypatch.setattr(gen_mod, "greedy", lambda *a, **k: torch.tensor([4, 4, 1]))
    monkeypatch.setattr(gen_mod, "forced_logprobs", lambda *a, **k: _logprobs(3, 1))
    wl = Generation(Generation.validate({"type": "generation", "new_tokens": 3, "bucket": 2}))
    wl.items = [(None, torch.tensor([4, 2, 1]), _logprobs(3, 1))]
    m = wl.run(_ctx(), get_method("full")).metrics
    assert m["gen_first_divergence"] == 1 and m["gen_match_rate"] == pytest.approx(2 / 3)
    assert not any(k.endswith(("_ci_low", "_ci_high")) for k in m)


# ------------------------------------------------------------------------------ passkey
def test_passkey_accuracy_counts_answers_in_the_completion(monkeypatch) -> None:
    import kvbench.hf.cache as hf_cache

    completions = iter(["the key is 12345.", "no idea", "1234 5", "x 99999 y"])

    class Model:
        def generate(self, ids, **kw):
            return torch.cat([ids, torch.zeros(1, 2, dtype=ids.dtype)], dim=1)

    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: next(completions))
    monkeypatch.setattr(hf_cache, "QuantizedKVCache", lambda method, model, **kw: None)
    monkeypatch.setattr(hf_cache, "cache_kwarg", lambda cache, model: {})
    wl = Passkey(Passkey.validate({"type": "passkey", "depths": [0.5]}))
    answers = ["12345", "54321", "12345", "99999"]
    wl.examples = [
        (
            {
                "answers": [a],
                "depth": 0.5,
                "seed": i,
                "needle_token_positions": [0],
                "context_tokens": 8,
            },
            torch.ones(1, 5, dtype=torch.long),
        )  # fmt: skip
        for i, a in enumerate(answers)
    ]
    res = wl.run(SimpleNamespace(model=Model(), tokenizer=tok, seed=0), get_method("full"))
    assert res.metrics == {"passkey_acc": 0.5}  # examples 0 and 3: "1234 5" is not "12345"
    assert [r["correct"] for r in res.per_layer["examples"]] == [True, False, False, True]
