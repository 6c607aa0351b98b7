"""Decode protocols and prefill attention (docs/design.md#protocols) on tiny seeded Llamas.

* ``write-then-attend`` (default): a decode call's K/V are stored through the method's update
  (its deferred flush included) before the call's queries attend.  For a method whose stored
  form of a token does not depend on later tokens (llama.cpp q4_0 / q8_0, fp8, per-token
  without a residual), chunks of 64 must give the numbers of exact one-token decode, on both
  attention routes.  Right value: the same cache fed one token per call, a different schedule
  of model calls and of kernels (n_q = 64 vs 1).
* ``in-chunk-full``: a chunk's tokens attend to each other in full precision; for q4_0 it reads
  fewer quantized tokens, hence less KL than write-then-attend.
* ``prefill_attention: stored``: the prompt's queries attend to the stored cache.  Right value:
  a hand-written float64 forward of the Llama that stores each layer's K/V in a fresh layer
  cache and attends over its ``keys_values()``; for ``full`` the stored cache is the prompt
  itself; a left-padded batch equals each prompt alone.
* the perplexity record's storage metrics are those of the cache the scored tokens attended
  to: PM-KVQ under a budget narrows its codes as the cache grows, and the record's bits are
  those after the last chunk (bytes summed by hand from the stored tensors), not another
  length's.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_padded_batch import LENS, generate, left_pad, prompts, toy
from tiny_lm import toy_llama

import kvbench.data.loaders as loaders
from kvbench.bench.context import RunContext
from kvbench.bench.decoding import decode_info
from kvbench.bench.workloads import WORKLOADS
from kvbench.bench.workloads.perplexity import chunked_logits
from kvbench.cache.registry import get_method, get_method_class
from kvbench.hf.cache import QuantizedKVCache, cache_kwarg, make_hf_cache
from kvbench.hf.capture import capture_prompt

# tiny models gain nothing from intra-op threads (tests/conftest.py: one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

#: methods whose stored form of a token does not depend on later tokens (head_dim 16 here)
TOKENWISE = [
    ("int4-block", {"block_size": 16}),  # llama.cpp q4_0
    ("int8-block", {"block_size": 16}),  # llama.cpp q8_0
    ("fp8", {}),
    ("per-token", {"bits": 2, "value_bits": 2, "residual_length": 0}),
]
ROUTES = ["attend", "reference"]


@pytest.fixture(scope="module")
def model():
    return toy_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (1, 160), generator=torch.Generator().manual_seed(3))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def kl(ref: torch.Tensor, lp: torch.Tensor) -> float:
    return (ref.double().exp() * (ref.double() - lp.double())).sum(-1).mean().item()


# ------------------------------------------------------------------ write-then-attend
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name, cfg", TOKENWISE, ids=[m[0] for m in TOKENWISE])
def test_write_then_attend_chunks_equal_exact_decode(model, ids, name, cfg, route) -> None:
    method = get_method(name, **cfg)
    exact, s1 = chunked_logits(model, ids, method, 32, 1, route)
    chunked, s64 = chunked_logits(model, ids, method, 32, 64, route)
    # float32 rounding of other kernels and projections (n_q = 64 vs 1; here up to 2e-6,
    # where it moved a 2-bit per-token code across a rounding boundary)
    assert rel(chunked, exact) <= 5e-6
    assert (s64[-1].nbytes, s64[-1].elements) == (s1[-1].nbytes, s1[-1].elements)
    # the protocol is what makes them equal: in-chunk-full reads its chunk in full precision
    loose, _ = chunked_logits(model, ids, method, 32, 64, route, protocol="in-chunk-full")
    assert rel(loose, exact) > 5e-5  # measured 9e-5 (q8_0) to 6e-3 (2-bit per-token)


def test_in_chunk_full_flatters_q4_0(model, ids) -> None:
    """q4_0 has no residual: under in-chunk-full each token of a 64-token chunk reads up to 63
    tokens unquantized, so its KL to the full cache is lower than under write-then-attend."""
    full, _ = chunked_logits(model, ids, get_method("full"), 32, 64)
    q4 = get_method("int4-block", block_size=16)
    wta, _ = chunked_logits(model, ids, q4, 32, 64)
    icf, _ = chunked_logits(model, ids, q4, 32, 64, protocol="in-chunk-full")
    assert kl(full, wta) > 1.3 * kl(full, icf) > 1e-7


def _perplexity(monkeypatch, model, ids, **params):
    monkeypatch.setattr(loaders, "load_text", lambda name: ("", {"name": name}))
    monkeypatch.setattr(loaders, "token_windows", lambda tok, text, n, k: (ids[:, :n], {}))
    cls = WORKLOADS.get("perplexity")
    spec = {"type": "perplexity", "tokens": 72, "prefill": 32, "chunk": 8, "windows": 1}
    wl = cls(cls.validate({**spec, **params}))
    ctx = RunContext(model=model, seed=0, model_info={"head_dim": 16})
    wl.prepare(ctx)
    return wl, ctx


#: (tokens held, positions scored) per call of the 72-token window: the prefill of 32 (its last
#: logit), then chunks of 8 over tokens 32..70 (the last token is only a target)
CALLS = [(32, 1), (40, 8), (48, 8), (56, 8), (64, 8), (71, 7)]


@pytest.mark.parametrize("protocol", ["write-then-attend", "in-chunk-full"])
def test_full_scores_zero_under_every_protocol(monkeypatch, model, ids, protocol) -> None:
    wl, ctx = _perplexity(monkeypatch, model, ids, protocol=protocol)
    for prefill in ("full", "stored"):
        res = wl.run(ctx, get_method("full", prefill_attention=prefill))
        m = res.metrics
        assert m["next_token_kl"] == pytest.approx(0, abs=1e-7)
        assert m["top1_agreement"] == 1.0
        assert res.info["decode_attention"]["protocol"] == protocol
        assert res.info["decode_attention"]["prefill_attention"] == prefill
        # float32 K and V: 2 layers x 2 KV heads x 16 channels x 4 bytes per token and side
        per_token = 2 * 2 * 16 * 4
        assert m["bytes_total"] == 2 * per_token * 71
        assert m["effective_bits"] == m["effective_key_bits"] == 32.0
        mean = sum(n * held for held, n in CALLS) / sum(n for _, n in CALLS)
        assert m["bytes_total_mean_scored"] == pytest.approx(2 * per_token * mean, rel=1e-12)
        assert m["effective_bits_mean_scored"] == pytest.approx(32.0, rel=1e-12)


def test_protocol_is_validated_and_recorded(monkeypatch, model, ids) -> None:
    cls = WORKLOADS.get("perplexity")
    with pytest.raises(ValueError, match=r"field 'protocol': 'fast' is not allowed; allowed: "):
        cls.validate({"type": "perplexity", "protocol": "fast"}, "s.yaml")
    assert cls.validate({"type": "perplexity"})["protocol"] == "write-then-attend"
    with pytest.raises(ValueError, match=r"QuantizedKVCache: field 'protocol': 'x'"):
        QuantizedKVCache("full", model, protocol="x")
    with pytest.raises(ValueError, match=r"make_hf_cache: field 'protocol'"):
        make_hf_cache(get_method("full"), model, protocol="in-chunk")
    # a peer runs its own transformers cache's update, and says so
    info: dict = {}
    chunked_logits(model, ids[:, :48], get_method("hf-dynamic"), 32, 8, info=info)
    assert info["protocol"] == "transformers-update" and info["prefill_attention"] == "full"
    cache = QuantizedKVCache("full", model, protocol="in-chunk-full")
    assert decode_info([cache], False, "")["protocol"] == "in-chunk-full"


# ------------------------------------------------------------------ storage metrics
def _bytes(cache: QuantizedKVCache, side: str) -> int:
    """Bytes of one side, summed by hand from every stored tensor of every layer."""
    return sum(
        t.numel() * t.element_size()
        for lc in cache.layer_caches()
        for s, _, t in lc.tensors()
        if s == side
    )


def test_storage_is_that_of_the_last_scored_state(monkeypatch, model, ids) -> None:
    """PM-KVQ under a budget shrinks 16 -> 8 bits as the cache grows; the record's bits are
    those after the last chunk, and *_mean_scored the position-weighted mean of the states."""
    # 4 bits x 125 tokens: 4000 bytes of codes per layer (window and sink at 16 bits)
    cfg = dict(residual_length=8, num_sink_tokens=1, budget_bits=4, budget_tokens=125)
    cfg["on_overflow"] = "allow"
    method = get_method("pm-kvq", channel_group_size=16, **cfg)
    wl, ctx = _perplexity(monkeypatch, model, ids)
    m = wl.run(ctx, method).metrics
    # the same run by hand: prefill, then chunks of 8; bytes and elements after each call
    cache = QuantizedKVCache(method, model)
    kw = cache_kwarg(cache, model)
    states = []
    with torch.no_grad():
        for start, (held, n) in zip([0, 32, 40, 48, 56, 64], CALLS):
            model(input_ids=ids[:, start:held], use_cache=True, **kw)
            elements = 2 * 2 * 16 * held  # layers x KV heads x head_dim x tokens
            states.append((n, 8 * _bytes(cache, "key") / elements, _bytes(cache, "value")))
    assert m["effective_key_bits"] == pytest.approx(states[-1][1], rel=1e-12)
    assert m["bytes_value_total"] == states[-1][2]
    mean = sum(n * b for n, b, _ in states) / 40
    assert m["effective_key_bits_mean_scored"] == pytest.approx(mean, rel=1e-12)
    # the width depends on the length: another state's bits would be another number
    assert states[0][1] - states[-1][1] > 4 and abs(mean - states[-1][1]) > 1


def test_quantized_key_fraction_is_that_of_the_last_scored_state(monkeypatch, model, ids) -> None:
    """KIVI keys flush whole blocks of R: with R = G = 32 the 32-token prefill is quantized and
    the residual flushes again at 64 tokens, so 64 of the 71 tokens held after the last chunk
    are quantized in every layer; with KIVI's default R = G = 128 none is (the runner flags such
    a run); a transformers peer's cache reports no fraction."""
    wl, ctx = _perplexity(monkeypatch, model, ids)
    kivi = get_method("kivi", bits=2, group_size=32, residual_length=32)
    assert wl.run(ctx, kivi).metrics["quantized_key_fraction"] == pytest.approx(64 / 71, abs=0)
    assert wl.run(ctx, get_method("kivi", bits=2)).metrics["quantized_key_fraction"] == 0.0
    assert "quantized_key_fraction" not in wl.run(ctx, get_method("hf-dynamic")).metrics


# ------------------------------------------------------------------ prefill attention
def _hand_logits(model, ids: torch.Tensor, method) -> torch.Tensor:
    """Logits ``[P, V]`` of a float64 Llama forward over ``ids [1, P]`` written out here: each
    layer's post-RoPE K/V are prefilled into a fresh layer cache of ``method`` (its prefill
    flush included), then the queries attend causally to its ``keys_values()``."""
    c = model.config
    w = dict(model.named_parameters())
    hd, hq, hk, p = c.head_dim, c.num_attention_heads, c.num_key_value_heads, ids.shape[1]
    inv = 1.0 / c.rope_parameters["rope_theta"] ** (torch.arange(0, hd, 2).double() / hd)
    ang = torch.arange(p).double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x):
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    def norm(x, g):
        return g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    causal = torch.ones(p, p).tril().bool()
    h = w["model.embed_tokens.weight"][ids[0]]
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        x = norm(h, w[pre + "input_layernorm.weight"])
        q, k, v = (
            (x @ w[f"{pre}self_attn.{n}_proj.weight"].T).view(p, heads, hd).transpose(0, 1)
            for n, heads in (("q", hq), ("k", hk), ("v", hk))
        )
        q, k = rope(q), rope(k)
        lc = method.new_layer(i, hk, hd, torch.float64)
        lc.prefill(k[None].contiguous(), v[None].contiguous())
        k, v = (t[0].repeat_interleave(hq // hk, 0) for t in lc.keys_values(torch.float64))
        a = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~causal, -math.inf)
        o = (torch.softmax(a, -1) @ v).transpose(0, 1).reshape(p, hq * hd)
        h = h + o @ w[pre + "self_attn.o_proj.weight"].T
        x = norm(h, w[pre + "post_attention_layernorm.weight"])
        gate, up = x @ w[pre + "mlp.gate_proj.weight"].T, x @ w[pre + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[pre + "mlp.down_proj.weight"].T
    return norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("attend", [False, True], ids=["sdpa", "attend"])
def test_stored_prefill_q4_0_equals_hand_written_loop(ids, attend) -> None:
    model = toy_llama().double()
    prompt = ids[:, :40]
    q4 = get_method("int4-block", block_size=16, prefill_attention="stored")
    with torch.no_grad():
        hand = _hand_logits(model, prompt, q4)
        assert (hand - _hand_logits(model, prompt, get_method("full"))).abs().max() > 1e-3
        cache = QuantizedKVCache(q4, model, attend=attend)
        got = model(input_ids=prompt, use_cache=True, **cache_kwarg(cache, model)).logits[0]
    # float64 both; transformers' RoPE frequencies are computed in float32 (~1e-8 here)
    assert (got - hand).abs().max().item() <= 1e-6


@pytest.mark.parametrize("route", ROUTES)
def test_stored_prefill_of_full_equals_full(model, ids, route) -> None:
    full, _ = chunked_logits(model, ids, get_method("full"), 32, 64, route)
    stored = get_method("full", prefill_attention="stored")
    got, _ = chunked_logits(model, ids, stored, 32, 64, route)
    assert (got - full).abs().max().item() <= 1e-6


def test_stored_prefill_runs_the_prompt_through_the_model(monkeypatch, model, ids) -> None:
    """A ``stored`` method cannot reuse the shared full-precision prompt capture: its record is
    the model's own prefill through its cache, and ``prefill_from`` refuses it."""
    q4 = get_method("int4-block", block_size=16, prefill_attention="stored")
    with pytest.raises(ValueError, match="prefill_attention='stored'"):
        QuantizedKVCache(q4, model).prefill_from(capture_prompt(model, ids[:, :32]).captured)
    wl, ctx = _perplexity(monkeypatch, model, ids)
    got = wl.run(ctx, q4).metrics["next_token_kl"]
    own, _ = chunked_logits(model, ids[:, :72], q4, 32, 8)
    assert got == pytest.approx(kl(wl.ref[0], own), rel=1e-3)
    kept = wl.run(ctx, get_method("int4-block", block_size=16)).metrics["next_token_kl"]
    assert got > kept  # the prompt read its q4_0 form too


def test_peers_refuse_stored_prefill() -> None:
    with pytest.raises(ValueError, match=r"field 'prefill_attention': 'stored' is not allowed"):
        get_method("hf-dynamic", prefill_attention="stored")
    with pytest.raises(ValueError, match=r"allowed: \['full', 'stored'\]"):
        get_method("kivi", prefill_attention="quantized")


@pytest.mark.parametrize("attend", [False, True], ids=["sdpa", "attend"])
@pytest.mark.parametrize("name", ["int4-block", "kivi", "pn-mix"])
def test_stored_prefill_of_a_padded_batch_equals_each_prompt_alone(name, attend) -> None:
    """Left-padded rows (one cache per row) attend to their own stored prompt, as alone;
    pn-mix waits for its queries before it stores (the attention function reads after)."""
    small = dict(group_size=4, residual_length=4, num_sink_tokens=0, bits=2, value_bits=2)
    known = {f.name for f in dataclasses.fields(get_method_class(name).Config)}
    cfg = {k: v for k, v in small.items() if k in known}

    def method():
        return get_method(name, prefill_attention="stored", **cfg)

    m = toy()
    rows = prompts()
    ids, mask = left_pad(rows)
    batch = generate(m, ids, mask, QuantizedKVCache(method(), m, attend=attend))
    for b, r in enumerate(rows):
        one = torch.ones(1, len(r), dtype=torch.long)
        alone = generate(m, r.view(1, -1), one, QuantizedKVCache(method(), m, attend=attend))
        assert torch.equal(batch.sequences[b, max(LENS) :], alone.sequences[0, len(r) :])
        diff = max((x[b] - y[0]).abs().max().item() for x, y in zip(batch.logits, alone.logits))
        assert diff <= 1e-5, (name, b, diff)
    kept = get_method(name, **cfg)
    full = generate(m, ids, mask, QuantizedKVCache(kept, m, attend=attend))
    assert (full.logits[0] - batch.logits[0]).abs().max() > 1e-4  # the prompt read its codes
