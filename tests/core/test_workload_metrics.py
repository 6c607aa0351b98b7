"""The numbers a record carries, recomputed independently.

``Perplexity.run``, ``Generation.run`` and ``Passkey.run`` are fed hand-built log-probabilities,
sequences and completions (their model-facing helpers are replaced), and every metric is
recomputed here by a float64 loop over positions with ``torch.distributions`` KL and
hand-counted agreement.  Directions: ``next_token_kl`` is KL(P_full || P_method) (the reference
first, docs/design.md#protocols) and ``top1_agreement`` compares the method's argmax over the vocabulary with
the full-precision argmax.  The protocol itself (which positions are scored) is checked on a
seeded toy Llama (GQA, two layers): the chunked ``full`` run must give the log-probabilities of
one plain forward pass over the window.

``layer_fidelity`` and ``Fidelity.run`` are compared with the replay protocol written out and
every value recomputed from the cache's dequantized K/V by float64 numpy loops (causal softmax
per position, ``scipy.special.rel_entr``), the bytes summed over the cache's tensors, and hand
counts of the quantized fraction and bits.  ``run_batched`` is checked with recording stand-ins
for the model-facing helpers: which prompts go together, which continuation is teacher-forced.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import special
from tiny_lm import toy_llama
from torch.distributions import Categorical, kl_divergence

from kvbench.bench.context import RunContext
from kvbench.bench.workloads import generation as gen_mod
from kvbench.bench.workloads import perplexity as ppl_mod
from kvbench.bench.workloads.fidelity import Fidelity, layer_fidelity
from kvbench.bench.workloads.generation import Generation, run_batched
from kvbench.bench.workloads.passkey import Passkey
from kvbench.bench.workloads.perplexity import Perplexity, ScoredState, chunked_logits
from kvbench.cache.registry import get_method

V = 11  # vocabulary of the hand-built distributions; != the number of positions scored


def _logprobs(n: int, seed: int, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(sharp * torch.randn(n, V, generator=g), dim=-1)


def _ctx(seed: int = 0) -> RunContext:
    return RunContext(model=None, seed=seed, model_info={"head_dim": 64})


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
    # one cache state: 600 + 634 bytes for 100 K (= V) elements
    state = [ScoredState(9, {"key_total": 600, "value_total": 634, "total": 1234}, 100)]
    monkeypatch.setattr(ppl_mod, "chunked_logits", lambda *a, **k: (next(calls), state))
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
    assert m["bytes_total"] == 1234 and m["bytes_key_total"] == 600
    assert m["effective_key_bits"] == 48 and m["effective_value_bits"] == pytest.approx(50.72)
    assert m["effective_bits"] == pytest.approx(8 * 1234 / 200)
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


@pytest.mark.parametrize("prefill, chunk", [(5, 1), (8, 3), (1, 64)])
def test_chunked_full_scores_the_same_positions_as_one_forward(prefill: int, chunk: int) -> None:
    model = toy_llama()
    ids = torch.randint(0, 96, (1, 23), generator=torch.Generator().manual_seed(1))
    lp, _ = chunked_logits(model, ids, get_method("full"), prefill, chunk)
    with torch.no_grad():
        plain = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    # position i of lp predicts token prefill + i, i.e. the plain logits at prefill + i - 1
    assert lp.shape == (ids.shape[1] - prefill, 96)
    torch.testing.assert_close(lp.double(), plain[prefill - 1 : -1], atol=2e-5, rtol=0)


def test_chunked_quantized_method_reads_its_cache() -> None:
    # a 2-bit cache must change the scored distributions (so the workload measures the cache)
    model = toy_llama()
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
    assert nb[-1].nbytes["total"] > 0


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
        generation_config = None

        def generate(self, ids, **kw):
            return torch.cat([ids, torch.zeros(1, 2, dtype=ids.dtype)], dim=1)

    tok = SimpleNamespace(
        decode=lambda ids, skip_special_tokens=True: next(completions),
        eos_token_id=None,
        pad_token_id=None,
    )
    cache = SimpleNamespace(attend=False)  # what passkey reads of a QuantizedKVCache
    monkeypatch.setattr(hf_cache, "QuantizedKVCache", lambda method, model, **kw: cache)
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
    res = wl.run(RunContext(model=Model(), tokenizer=tok, seed=0), get_method("full"))
    assert res.metrics == {"passkey_acc": 0.5}  # examples 0 and 3: "1234 5" is not "12345"
    assert [r["correct"] for r in res.per_layer["examples"]] == [True, False, False, True]


# ------------------------------------------------------------------------------ fidelity


def _qkv(seed: int, t: int = 22, hq: int = 4, hkv: int = 2, d: int = 8, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-0.5, 0.5, d)  # channels of different ranges, as real keys have
    q = torch.randn(1, hq, t, d, generator=g).to(dtype)
    k = (torch.randn(1, hkv, t, d, generator=g) * scale).to(dtype)
    v = torch.randn(1, hkv, t, d, generator=g).to(dtype)
    return q, k, v


def _cache_by_hand(method, q, k, v, prefill):
    """The replay protocol written out: prefill P tokens with their queries, append the rest
    one at a time, settle the last flush."""
    layer = method.new_layer(0, k.shape[1], k.shape[3], k.dtype, "cpu")
    layer.prefill(k[:, :, :prefill], v[:, :, :prefill], queries=q[:, :, :prefill])
    for t in range(prefill, k.shape[2]):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    layer.end_step()
    return layer


def _loop_attention(q, k, v, start, scale):
    """Causal softmax attention of positions ``start..T-1`` by explicit loops, float64 numpy:
    (probabilities per (head, position) over keys 0..pos, outputs ``[H_q, T - start, D]``)."""
    q, k, v = (x.double().numpy()[0] for x in (q, k, v))
    hq, t, _ = q.shape
    rep = hq // k.shape[0]
    probs, outs = {}, np.zeros((hq, t - start, q.shape[-1]))
    for h in range(hq):
        for pos in range(start, t):
            a = special.softmax(k[h // rep, : pos + 1] @ q[h, pos] * scale)
            probs[h, pos] = a
            outs[h, pos - start] = a @ v[h // rep, : pos + 1]
    return probs, outs


def _fidelity_by_hand(method, q, k, v, prefill, scaling):
    """Every layer_fidelity value from the cache's own dequantized K/V, by float64 numpy."""
    layer = _cache_by_hand(method, q, k, v, prefill)
    t, d = k.shape[2], k.shape[3]
    scale = 1 / np.sqrt(d) if scaling is None else scaling
    kn, vn = k.double().numpy(), v.double().numpy()
    out = {}
    if method.capabilities.keys_values:
        kq, vq = (x.double().numpy() for x in layer.keys_values(torch.float32))
        out["key_mse"] = ((kn - kq) ** 2).mean()
        out["key_rel_mse"] = ((kn - kq) ** 2).sum() / (kn**2).sum()
        out["value_mse"] = ((vn - vq) ** 2).mean()
        a, o = _loop_attention(q, k, v, prefill, scale)
        a2, o2 = _loop_attention(q, torch.from_numpy(kq), torch.from_numpy(vq), prefill, scale)
        out["attn_kl"] = np.mean([special.rel_entr(a[i], a2[i]).sum() for i in a])
        out["attn_out_rel_err"] = np.linalg.norm(o - o2) / np.linalg.norm(o)
    else:
        _, o = _loop_attention(q, k, v, prefill, scale)
        approx = layer.attend(q[:, :, prefill:], scaling)[0].double().numpy()
        out["attn_out_rel_err"] = np.linalg.norm(o - approx) / np.linalg.norm(o)
    tensors = layer.tensors()
    nq = layer.quantized_tokens()[0]
    out["quantized_key_fraction"] = nq / t
    for side in ("key", "value"):
        held = sum(x.numel() * x.element_size() for s, _, x in tensors if s == side)
        out[f"effective_{side}_bits"] = 8 * held / k.numel()
    return out


def _check_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name


KIVI = {"bits": 2, "group_size": 4, "residual_length": 4}  # fp16 values (value_bits 16)


@pytest.mark.parametrize("scaling", [None, 0.3])
def test_layer_fidelity_matches_float64_loop(scaling) -> None:
    method = get_method("kivi", **KIVI)
    q, k, v = _qkv(1)
    got = layer_fidelity(method, 0, q, k, v, 16, scaling)
    _check_close(got, _fidelity_by_hand(method, q, k, v, 16, scaling))
    # hand count: P = 16 keys quantized at prefill, a full residual of R = 4 at step 20, the
    # last 2 of T = 22 in full precision; fp16 values (none quantized).  Per quantized key
    # 2 bits + an fp16 (scale, zero) per G = 4 tokens: 10 bits; a residual key 16 bits.
    assert got["quantized_key_fraction"] == 20 / 22
    assert got["effective_key_bits"] == pytest.approx((20 * 10 + 2 * 16) / 22, rel=1e-12)
    assert got["effective_value_bits"] == 16
    assert got["key_mse"] > 0 and got["attn_kl"] > 0 and got["value_mse"] == 0


def test_layer_fidelity_without_keys_values_reports_the_attention_output_error() -> None:
    method = get_method("kivi", **KIVI, value_bits=2)
    method.capabilities = dataclasses.replace(method.capabilities, keys_values=False)
    q, k, v = _qkv(2)
    got = layer_fidelity(method, 0, q, k, v, 16, 0.3)
    want = _fidelity_by_hand(method, q, k, v, 16, 0.3)
    _check_close(got, want)
    assert "attn_kl" not in got and got["attn_out_rel_err"] > 1e-3


@pytest.mark.parametrize("layers", ["all", [1]])
def test_fidelity_run_averages_layers(layers) -> None:
    method = get_method("per-head", bits=2, value_bits=4, residual_length=4)
    seen = []
    new_layer = method.new_layer
    method.new_layer = lambda idx, *a: (seen.append(idx), new_layer(idx, *a))[1]
    qkv = [_qkv(3), _qkv(4)]
    scaling = [0.3, 0.7]
    wl = Fidelity(Fidelity.validate({"type": "fidelity", "tokens": 22, "prefill": 16,
                                     "layers": layers}))  # fmt: skip
    wl.captured = SimpleNamespace(
        layer_ids=[3, 5], queries=[x[0] for x in qkv], keys=[x[1] for x in qkv],
        values=[x[2] for x in qkv], scaling=scaling,
    )  # fmt: skip
    wl.info = {"kv_source": "test"}
    res = wl.run(_ctx(), method)
    idx = [0, 1] if layers == "all" else layers
    assert seen == [[3, 5][i] for i in idx]  # each layer's cache made for its own layer id
    per = [_fidelity_by_hand(method, *qkv[i], 16, scaling[i]) for i in idx]
    want = {name: sum(p[name] for p in per) / len(per) for name in per[0]}
    # nominal bits (hand count, head_dim 8): 2 or 4 bits + an fp16 (scale, zero) per flush of
    # R = 4 tokens x 8 channels, 32 / 32 = 1 bit
    want |= {"nominal_key_bits": 3.0, "nominal_value_bits": 5.0}
    _check_close(res.metrics, want)
    assert res.per_layer["layers"] == idx
    for name in per[0]:
        assert res.per_layer[name] == pytest.approx([p[name] for p in per], rel=1e-6)
    assert res.info == {"kv_source": "test"}


# ------------------------------------------------------------------------------ batching
def _fake_model_calls(monkeypatch, calls, seen=None):
    """Replace the four model-facing helpers by recorders: a continuation is the prompt's
    first id repeated, a log-prob matrix is a constant that names the prompt and continuation;
    ``seen`` gets each call's (model, method) and its ``info`` is marked."""
    seen = [] if seen is None else seen

    def note(kind, model, method, info):
        seen.append((model, method))
        if info is not None:  # the decode record each call adds to
            info.setdefault("calls", []).append(kind)

    def cont(p, n):
        return torch.full((n,), int(p.reshape(-1)[0]))

    def lp(p, c):
        return torch.full((len(c), 3), float(int(p.reshape(-1)[0]) * 100 + int(c[0])))

    def greedy(model, p, method, n, path, info=None):
        calls.append(("greedy", int(p.reshape(-1)[0]), n, path))
        note("greedy", model, method, info)
        return cont(p, n)

    def greedy_batch(model, ps, method, n, path, info=None, ledger=None):
        calls.append(("greedy_batch", [int(p.reshape(-1)[0]) for p in ps], n, path))
        note("greedy_batch", model, method, info)
        ledger.add([p.shape[-1] for p in ps])
        return [cont(p, n) for p in ps]

    def forced(model, p, c, method, path, info=None):
        calls.append(("forced", int(p.reshape(-1)[0]), c.tolist(), path))
        note("forced", model, method, info)
        return lp(p, c)

    def forced_batch(model, ps, cs, method, path, info=None):
        calls.append(("forced_batch", [int(p.reshape(-1)[0]) for p in ps],
                      [c.tolist() for c in cs], path))  # fmt: skip
        note("forced_batch", model, method, info)
        return [lp(p, c) for p, c in zip(ps, cs)]

    monkeypatch.setattr(gen_mod, "greedy", greedy)
    monkeypatch.setattr(gen_mod, "greedy_batch", greedy_batch)
    monkeypatch.setattr(gen_mod, "forced_logprobs", forced)
    monkeypatch.setattr(gen_mod, "forced_logprobs_batch", forced_batch)


@pytest.mark.parametrize("with_refs", [False, True])
def test_run_batched_cuts_batches_and_teacher_forces_the_right_continuation(
    monkeypatch, with_refs
) -> None:
    calls, seen = [], []
    _fake_model_calls(monkeypatch, calls, seen)
    prompts = [torch.tensor([[p] * n]) for p, n in ((1, 3), (2, 5), (3, 4))]  # [1, P_i]
    refs = [torch.tensor([7, 8]), torch.tensor([6, 6]), torch.tensor([9, 5])]
    ledger, info, model, method = gen_mod.PadLedger(2), {}, object(), get_method("full")
    gens, lps = run_batched(model, prompts, method, 2, "reference", 2,
                            refs if with_refs else None, info, ledger)  # fmt: skip
    assert seen == [(model, method)] * 4  # every call gets the model and the method
    # every call records its decode paths in the one info record
    assert info == {"calls": ["greedy_batch", "forced_batch", "greedy", "forced"]}
    # batches [0, 1] and [2]; greedy continuations are the prompt id repeated
    assert [g.tolist() for g in gens] == [[1, 1], [2, 2], [3, 3]]
    forced = refs if with_refs else gens
    assert calls == [
        ("greedy_batch", [1, 2], 2, "reference"),
        ("forced_batch", [1, 2], [forced[0].tolist(), forced[1].tolist()], "reference"),
        ("greedy", 3, 2, "reference"),
        ("forced", 3, forced[2].tolist(), "reference"),
    ]
    assert [float(x[0, 0]) for x in lps] == [100 + forced[0][0], 200 + forced[1][0],
                                             300 + forced[2][0]]  # fmt: skip
    # the ledger: batch [3, 5] has 2 pads, the lone prompt of 4 none
    info = ledger.info()
    assert (info["batches"], info["prompt_tokens"], info["pad_tokens"]) == (2, 12, 2)
    assert info["padded_batches"] == 1


def test_generation_batched_run_pads_and_refuses_methods_without_padding(monkeypatch) -> None:
    calls = []
    _fake_model_calls(monkeypatch, calls)
    spec = {"type": "generation", "new_tokens": 2, "bucket": 1, "batch_size": 2}
    wl = Generation(Generation.validate(spec))
    prompts = [torch.tensor([[p] * n]) for p, n in ((1, 3), (2, 5))]
    refs = [torch.tensor([1, 4]), torch.tensor([2, 2])]
    ref_lps = [torch.full((2, 3), 0.0), torch.full((2, 3), 0.0)]
    wl.items = list(zip(prompts, refs, ref_lps))
    m = wl.run(_ctx(), get_method("full"))
    assert m.metrics["gen_first_divergence"] == (1 + 2) / 2
    assert m.info["padding"]["pad_tokens"] == 2 and m.info["padding"]["batch_size"] == 2
    assert calls[0][0] == "greedy_batch"
    no_pad = get_method("full")
    no_pad.capabilities = dataclasses.replace(no_pad.capabilities, padding=False)
    with pytest.raises(ValueError, match="padding"):
        wl.run(_ctx(), no_pad)
    # batch 1 takes a method without padding
    wl1 = Generation(Generation.validate({**spec, "batch_size": 1}))
    wl1.items = wl.items
    assert wl1.run(_ctx(), no_pad).info["padding"]["pad_tokens"] == 0


# ------------------------------------------------------------------------------ plumbing
def _bootstrap_by_hand(values, seed, n_boot=1000):
    """Percentile bootstrap of the mean (Efron & Tibshirani 1993, ch. 13) with the documented
    seeding (a torch generator seeded ``seed`` draws the resample indices), float64 numpy."""
    x = np.asarray(values, dtype=np.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(x), (n_boot, len(x)), generator=g).numpy()
    return tuple(np.quantile(x[idx].mean(-1), [0.025, 0.975]))


@pytest.mark.parametrize("head_dim", [64, None])
def test_perplexity_run_passes_each_window_its_prompt_and_reports_what_it_measured(
    monkeypatch, head_dim, block_bootstrap_ref
) -> None:
    prefill, t, n = 4, 12, 6
    g = torch.Generator().manual_seed(3)
    windows = [torch.randint(0, V, (t,), generator=g) for _ in range(n)]
    refs = [_logprobs(t - prefill, 50 + w) for w in range(n)]
    lps = [torch.log_softmax(r + _logprobs(t - prefill, 60 + w), -1) for w, r in enumerate(refs)]
    method = get_method("per-head", bits=2, residual_length=4)
    model = SimpleNamespace(dtype=torch.bfloat16)  # what run reads of the model itself
    prompts, calls = [object() for _ in range(n)], []

    def fake(*args, info=None, protocol=None):
        calls.append(args)
        info["paths"] = {"code-domain": len(calls)}
        k = len(calls)  # window k's states: after the prefill (1 position), after 2 chunks
        states = [
            ScoredState(n, {"key_total": 10 * k * i, "value_total": 5 * k, "total": 0}, 10 + 10 * i)
            for i, n in ((1, 1), (2, 3), (3, 4))
        ]
        return lps[k - 1], states

    monkeypatch.setattr(ppl_mod, "chunked_logits", fake)
    spec = {"type": "perplexity", "tokens": t, "prefill": prefill, "chunk": 3, "windows": n,
            "path": "reference"}  # fmt: skip
    wl = Perplexity(Perplexity.validate(spec))
    wl.windows, wl.ref, wl.prompts, wl.info = windows, refs, prompts, {"dataset": "d"}
    info = {} if head_dim is None else {"head_dim": head_dim}
    ctx = RunContext(model=model, seed=5, model_info=info)
    res = wl.run(ctx, method)
    for (m_, ids, meth, p, c, path, prompt), w, pr in zip(calls, windows, prompts):
        assert m_ is model and meth is method and prompt is pr
        assert ids.tolist() == [w.tolist()] and (p, c, path) == (prefill, 3, "reference")
    assert len(calls) == n
    m = res.metrics
    # the last state of window k holds 30 k + 5 k bytes for 40 elements; mean over windows
    ks = range(1, n + 1)
    assert m["bytes_total"] == pytest.approx(sum(35 * k for k in ks) / n)
    assert m["bytes_key_total"] == pytest.approx(sum(30 * k for k in ks) / n)
    assert m["effective_key_bits"] == pytest.approx(sum(8 * 30 * k / 40 for k in ks) / n)
    # per window, states weighted by the positions they scored (1, 3, 4 of 8)
    want = [(1 * 15 * k + 3 * 25 * k + 4 * 35 * k) / 8 for k in ks]
    assert m["bytes_total_mean_scored"] == pytest.approx(sum(want) / n)
    assert res.per_layer["window_bytes_total_mean_scored"] == pytest.approx(want)
    bits = [(8 * 10 * k / 20 + 3 * 8 * 20 * k / 30 + 4 * 8 * 30 * k / 40) / 8 for k in ks]
    assert m["effective_key_bits_mean_scored"] == pytest.approx(sum(bits) / n)
    # nominal bits by hand: 2 bits + an fp16 (scale, zero) per flush of R = 4 tokens x
    # head_dim channels (128 when the model does not say)
    d = head_dim or 128
    assert m["nominal_key_bits"] == 2 + 32 / (4 * d) and m["nominal_value_bits"] == 16
    # per-window values and their intervals, by float64 loops and a bootstrap by hand
    nll, nll_ref, kls, agree = [], [], [], []
    for w, ref, lp in zip(windows, refs, lps):
        tgt = w[prefill:].tolist()
        nll.append(-sum(lp[i, k].double().item() for i, k in enumerate(tgt)) / len(tgt))
        nll_ref.append(-sum(ref[i, k].double().item() for i, k in enumerate(tgt)) / len(tgt))
        kls.append(sum(_kl_loop(ref, lp)) / len(tgt))
        agree.append(sum(_agree_loop(ref, lp)) / len(tgt))
    per = res.per_layer
    assert per["window_nll"] == pytest.approx(nll, rel=1e-5)
    assert per["window_nll_ref"] == pytest.approx(nll_ref, rel=1e-5)
    assert per["window_kl"] == pytest.approx(kls, rel=1e-5)
    assert per["window_top1"] == pytest.approx(agree, abs=1e-7)
    # intervals: the block bootstrap (blocks of 32 scored tokens; 8 per window here, so one
    # block per window) of the per-token values by float64 loops, against the numpy reference
    toks = [
        np.array([_kl_loop(ref, lp), [float(ref[i].argmax() == lp[i].argmax()) for i in range(
            len(lp))], [-lp[i, k].double().item() for i, k in enumerate(w[prefill:].tolist())],
            [-ref[i, k].double().item() for i, k in enumerate(w[prefill:].tolist())]]).T
        for w, ref, lp in zip(windows, refs, lps)
    ]  # fmt: skip
    stats = {
        "next_token_kl": lambda c: c[0],
        "top1_agreement": lambda c: c[1],
        "ppl_delta": lambda c: math.exp(c[2]) - math.exp(c[3]),
    }
    for name, stat in stats.items():
        lo, hi = block_bootstrap_ref(toks, 32, seed=5, stat=stat)
        assert m[f"{name}_ci_low"] == pytest.approx(lo, rel=1e-5, abs=1e-7), name
        assert m[f"{name}_ci_high"] == pytest.approx(hi, rel=1e-5, abs=1e-7), name
        if name != "top1_agreement":  # continuous values: another seed, another interval
            assert block_bootstrap_ref(toks, 32, seed=0, stat=stat) != pytest.approx((lo, hi))
    assert res.info["decode_attention"] == {"paths": {"code-domain": 6}}
    assert res.info["dataset"] == "d" and res.info["storage"]["dtype"] == "bfloat16"
    assert res.info["intervals"] == ppl_mod.interval_rule(n)[1]
    assert "blocks of 32 consecutive scored tokens" in res.info["intervals"]
    assert wl.info == {"dataset": "d"}  # the workload's shared info is not changed


def test_perplexity_one_window_has_block_intervals(monkeypatch, block_bootstrap_ref) -> None:
    """One window of 66 scored tokens: three blocks (32, 32, 2), so an interval where a
    bootstrap over windows had none, equal to the numpy reference over those blocks."""
    t, prefill = 70, 4
    ref, lp = _logprobs(t - prefill, 7), _logprobs(t - prefill, 8)
    state = [ScoredState(t - prefill, {"key_total": 1, "value_total": 1}, 1)]
    monkeypatch.setattr(ppl_mod, "chunked_logits", lambda *a, info=None, protocol=None: (lp, state))
    wl = Perplexity(Perplexity.validate({"type": "perplexity", "tokens": t, "prefill": prefill,
                                         "windows": 1}))  # fmt: skip
    wl.windows, wl.ref, wl.info = [torch.arange(t) % V], [ref], {}
    m = wl.run(_ctx(seed=2), get_method("full")).metrics
    kl = [_kl_loop(ref, lp)]
    lo, hi = block_bootstrap_ref(kl, 32, seed=2)
    assert (m["next_token_kl_ci_low"], m["next_token_kl_ci_high"]) == pytest.approx((lo, hi))
    assert lo < m["next_token_kl"] < hi


def test_perplexity_run_without_prompts_prefills_through_the_model(monkeypatch) -> None:
    seen = []

    def fake(*args, info=None, protocol=None):
        seen.append(args[6])  # the prompt state handed to chunked_logits
        return _logprobs(6, 1), [ScoredState(6, {"key_total": 1, "value_total": 1}, 1)]

    monkeypatch.setattr(ppl_mod, "chunked_logits", fake)
    wl = Perplexity(
        Perplexity.validate({"type": "perplexity", "tokens": 10, "prefill": 4, "chunk": 6})
    )
    wl.windows, wl.ref, wl.info = [torch.arange(10) % V] * 2, [_logprobs(6, 2)] * 2, {}
    res = wl.run(_ctx(), get_method("full"))
    assert seen == [None, None]  # no captured prompt: each window's prefill runs the model
    assert "decode_attention" not in res.info


def test_generation_run_teacher_forces_the_reference_and_reports_per_prompt(monkeypatch) -> None:
    calls, seen = [], []
    _fake_model_calls(monkeypatch, calls, seen)
    spec = {"type": "generation", "new_tokens": 2, "bucket": 1, "path": "reference"}
    wl = Generation(Generation.validate(spec))
    prompts = [torch.tensor([[1] * 3]), torch.tensor([[2] * 2]), torch.tensor([[3] * 4])]
    refs = [torch.tensor([1, 4]), torch.tensor([2, 2]), torch.tensor([0, 3])]
    ref_lps = [torch.log_softmax(_logprobs(2, 70 + i)[:, :3], -1) for i in range(3)]
    wl.items = list(zip(prompts, refs, ref_lps))
    model, method = object(), get_method("full")
    res = wl.run(RunContext(model=model, seed=5, model_info={}), method)
    # one prompt at a time: its greedy continuation, then its *reference* teacher-forced
    assert calls == [
        c for i, r in zip((1, 2, 3), refs)
        for c in (("greedy", i, 2, "reference"), ("forced", i, r.tolist(), "reference"))
    ]  # fmt: skip
    assert all(m_ is model and meth is method for m_, meth in seen) and len(seen) == 6
    # greedy continuations [1, 1], [2, 2], [3, 3] against the references, by hand
    first, match = [1, 2, 0], [0.5, 1.0, 0.5]
    per = res.per_layer
    assert per["first_divergence"] == first and per["match_rate"] == match
    # the forced log-probs are constants 100 * prompt + first token, so one per prompt
    lps = [torch.full((2, 3), float(100 * i + int(r[0]))) for i, r in zip((1, 2, 3), refs)]
    assert len(per["next_token_kl"]) == 3
    for r, q, want in zip(ref_lps, lps, per["next_token_kl"]):  # sum_v p_ref (log p_ref - lp)
        steps = [sum(math.exp(a) * (a - b) for a, b in zip(r[i].tolist(), q[i].tolist()))
                 for i in range(2)]  # fmt: skip
        assert want == pytest.approx(sum(steps) / 2, rel=1e-5)
    m = res.metrics
    assert m["gen_first_divergence"] == 1 and m["gen_match_rate"] == pytest.approx(2 / 3)
    for name, vals in (("gen_first_divergence", first), ("gen_match_rate", match)):
        lo, hi = _bootstrap_by_hand(vals, seed=5)
        assert m[f"{name}_ci_low"] == pytest.approx(lo, rel=1e-9, abs=1e-12), name
        assert m[f"{name}_ci_high"] == pytest.approx(hi, rel=1e-9, abs=1e-12), name
    assert res.info["prompts"] == 3 and res.info["bucket"] == 1
    assert res.info["decode_attention"] == {"calls": ["greedy", "forced"] * 3}
    pad = res.info["padding"]
    assert (pad["batch_size"], pad["batches"], pad["prompt_tokens"], pad["pad_tokens"]) == (
        1, 3, 9, 0,
    )  # fmt: skip


def test_generation_intervals_resample_with_the_run_seed(monkeypatch) -> None:
    _fake_model_calls(monkeypatch, [])
    firsts = [0, 3, 7, 1, 10]  # prompt i's greedy run ([i] * 10) leaves its reference there
    refs = [torch.tensor([i] * k + [99] * (10 - k)) for i, k in enumerate(firsts)]
    wl = Generation(Generation.validate({"type": "generation", "new_tokens": 10, "bucket": 5}))
    wl.items = [(torch.tensor([[i]]), r, torch.zeros(10, 3)) for i, r in enumerate(refs)]
    m = wl.run(RunContext(model=None, seed=7, model_info={}), get_method("full"))
    assert m.per_layer["first_divergence"] == firsts
    for name, vals in (
        ("gen_first_divergence", firsts),
        ("gen_match_rate", [k / 10 for k in firsts]),
    ):
        lo, hi = _bootstrap_by_hand(vals, seed=7)
        assert (m.metrics[f"{name}_ci_low"], m.metrics[f"{name}_ci_high"]) == pytest.approx(
            (lo, hi)
        )
        assert _bootstrap_by_hand(vals, seed=0) != pytest.approx((lo, hi))  # the seed matters here


def test_fidelity_run_of_a_one_layer_synthetic_source() -> None:
    spec = {"type": "fidelity", "source": "synthetic", "tokens": 12, "prefill": 8,
            "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8}  # fmt: skip
    wl = Fidelity(Fidelity.validate(spec))
    wl.prepare(_ctx(seed=3))
    method = get_method("per-head", bits=2, residual_length=4)
    res = wl.run(_ctx(seed=3), method)
    c = wl.captured
    want = _fidelity_by_hand(method, c.queries[0], c.keys[0], c.values[0], 8, None)
    # 2 bits + an fp16 (scale, zero) per flush of 4 tokens x 8 channels: 3 bits
    want |= {"nominal_key_bits": 3.0, "nominal_value_bits": 16.0}
    _check_close(res.metrics, want)
    assert res.per_layer["layers"] == [0]
