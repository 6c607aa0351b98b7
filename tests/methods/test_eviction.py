"""Eviction methods (docs/design.md#eviction): kept tokens equal independent float64 references
of the papers' / kvpress's scores, composition with a quantizer, refusals, the plugin contract
and a tiny Llama end to end."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from kvbench.cache.layer import LayerCache
from kvbench.methods.full import FullPrecision
from kvbench.methods.h2o import H2O
from kvbench.methods.knorm import Knorm
from kvbench.methods.snapkv import SnapKV
from kvbench.methods.streamingllm import StreamingLLM
from kvbench.methods.tova import TOVA
from kvbench.testing import check_method

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_lm import toy_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KIVI4 = {
    "name": "kivi",
    "config": {"bits": 4, "value_bits": 4, "group_size": 8, "residual_length": 8},
}


def data(b=2, hkv=2, hq=4, t=40, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    return k.to(dtype), v.to(dtype), q.to(dtype)


def kept_indices(layer: LayerCache, keys: torch.Tensor) -> list[list[list[int]]]:
    """The input token index of every held key, per row and head (keys are distinct)."""
    held = layer.keys_values()[0]
    out = []
    for b in range(keys.shape[0]):
        row = []
        for h in range(keys.shape[1]):
            same = (held[b, h][:, None, :] == keys[b, h][None, :, :]).all(-1)
            row.append(same.int().argmax(-1).tolist())
        out.append(row)
    return out


def top_kept(scores: torch.Tensor, keep: int) -> list[list[list[int]]]:
    """Indices of the ``keep`` largest scores per row and head, ascending."""
    return torch.topk(scores, keep, dim=-1).indices.sort(-1).values.tolist()


# ------------------------------------------------------------------ float64 references
def ref_streaming(t: int, keep: int, n_sink: int) -> list[int]:
    return list(range(n_sink)) + list(range(t - (keep - n_sink), t))


def ref_knorm(keys: torch.Tensor) -> torch.Tensor:
    return -keys.double().pow(2).sum(-1).sqrt()


def ref_snapkv(keys: torch.Tensor, queries: torch.Tensor, window: int, kernel: int):
    """SnapKV written loop by loop in float64: per query head, softmax of the last ``window``
    queries over every key (causal in the window), mean over those queries of the weights of
    the keys before the window, zero-padded average pool of ``kernel``, mean over the KV head's
    query heads; the window scores above every other."""
    b, hkv, t, d = keys.shape
    group = queries.shape[1] // hkv
    out = torch.empty(b, hkv, t, dtype=torch.float64)
    for i in range(b):
        for h in range(hkv):
            acc = torch.zeros(t - window, dtype=torch.float64)
            for j in range(h * group, (h + 1) * group):
                mean = torch.zeros(t - window, dtype=torch.float64)
                for w in range(window):
                    pos = t - window + w
                    logits = keys[i, h, : pos + 1].double() @ queries[i, j, pos].double()
                    probs = torch.softmax(logits / math.sqrt(d), dim=0)
                    mean += probs[: t - window] / window
                pooled = torch.zeros_like(mean)
                for x in range(t - window):
                    lo, hi = max(x - kernel // 2, 0), min(x + kernel // 2 + 1, t - window)
                    pooled[x] = mean[lo:hi].sum() / kernel
                acc += pooled / group
            out[i, h, : t - window] = acc
            out[i, h, t - window :] = math.inf
    return out


def softmax64(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Float64 softmax of one query ``[D]`` over ``keys [T, D]``."""
    return torch.softmax(keys.double() @ q.double() / math.sqrt(keys.shape[-1]), dim=0)


def ref_tova(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """TOVA at prefill: the last query's weights, averaged over every query head (one score
    per token for all KV heads); the last token scores above all."""
    b, hkv, t, _ = keys.shape
    hq = queries.shape[1]
    out = torch.zeros(b, hkv, t, dtype=torch.float64)
    for i in range(b):
        mean = sum(softmax64(queries[i, j, -1], keys[i, j // (hq // hkv)]) for j in range(hq)) / hq
        out[i, :, :] = mean
        out[i, :, -1] = math.inf
    return out


def ref_observed(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """kvpress's observed attention: each key's causal weights summed over the prompt's
    queries, over the number of queries that see it, averaged over the KV head's query heads."""
    b, hkv, t, _ = keys.shape
    group = queries.shape[1] // hkv
    out = torch.zeros(b, hkv, t, dtype=torch.float64)
    for i in range(b):
        for h in range(hkv):
            for j in range(h * group, (h + 1) * group):
                total = torch.zeros(t, dtype=torch.float64)
                for pos in range(t):
                    total[: pos + 1] += softmax64(queries[i, j, pos], keys[i, h, : pos + 1])
                out[i, h] += total / torch.arange(t, 0, -1) / group
    return out


# ------------------------------------------------------------------ kept indices
@pytest.mark.parametrize("quantizer", ["full", KIVI4])
def test_streamingllm_keeps_sinks_and_the_newest(quantizer) -> None:
    k, v, q = data(t=40)
    m = StreamingLLM(budget_tokens=12, n_sink=4, quantizer=quantizer)
    lc = m.new_layer(0, 2, 16)
    lc.prefill(k[:, :, :30], v[:, :, :30])
    want = ref_streaming(30, 12, 4)
    if quantizer == "full":
        assert kept_indices(lc, k) == [[want] * 2] * 2
    assert (lc.seq_length, lc.seen_tokens) == (12, 30)
    for t in range(30, 40):  # decode: the budget holds, the oldest after the sinks go
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lc.end_step()
        assert (lc.seq_length, lc.seen_tokens) == (12, t + 1)
        if quantizer == "full":
            assert kept_indices(lc, k) == [[ref_streaming(t + 1, 12, 4)] * 2] * 2


@pytest.mark.parametrize("seed", [0, 1])
def test_knorm_keeps_the_smallest_norms(seed: int) -> None:
    k, v, _ = data(t=33, seed=seed)
    lc = Knorm(keep_ratio=0.4).new_layer(0, 2, 16)
    lc.prefill(k, v)
    keep = int(33 * 0.4)
    assert kept_indices(lc, k) == top_kept(ref_knorm(k), keep)
    assert (lc.seq_length, lc.seen_tokens) == (keep, 33)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_snapkv_keeps_the_window_and_the_voted(seed: int) -> None:
    k, v, q = data(t=40, seed=seed)
    lc = SnapKV(budget_tokens=20, window_size=8, kernel_size=5).new_layer(0, 2, 16)
    lc.prefill(k, v, q)
    assert kept_indices(lc, k) == top_kept(ref_snapkv(k, q, 8, 5), 20)


@pytest.mark.parametrize("seed", [0, 1])
def test_tova_and_h2o_keep_what_the_references_keep_at_prefill(seed: int) -> None:
    k, v, q = data(t=30, seed=seed)
    for method, ref in ((TOVA(budget_tokens=12), ref_tova), (H2O(budget_tokens=12), ref_observed)):
        lc = method.new_layer(0, 2, 16)
        lc.prefill(k, v, q)
        assert kept_indices(lc, k) == top_kept(ref(k, q), 12), type(method).__name__


def test_tova_decode_drops_what_the_last_query_attended_least() -> None:
    """Each decode step stores its token, drops the held token the previous step's query (the
    prefill's last query at the first step) attended least, averaged over every query head,
    then attends; the float64 simulation keeps the same tokens."""
    k, v, q = data(b=1, t=40, seed=3)
    budget, prompt = 12, 30
    lc = TOVA(budget_tokens=budget).new_layer(0, 2, 16)
    lc.prefill(k[:, :, :prompt], v[:, :, :prompt], q[:, :, :prompt])
    held = top_kept(ref_tova(k[:, :, :prompt], q[:, :, :prompt]), budget)[0][0]
    last = q[0, :, prompt - 1]  # the query whose attention scores the next drop
    for t in range(prompt, 40):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lc.end_step()
        weights = sum(softmax64(last[j], k[0, j // 2, held]) for j in range(4)) / 4
        if t == prompt:  # the first drop uses the prefill's scores of the kept tokens
            weights = ref_tova(k[:, :, :prompt], q[:, :, :prompt])[0, 0, held]
        held = sorted([p for p, w in zip(held, weights.tolist(), strict=True) if w != min(weights)])
        held.append(t)
        assert kept_indices(lc, k) == [[held, held]], t
        lc.attend(q[:, :, t : t + 1])
        last = q[0, :, t]


@pytest.mark.parametrize("cls", [H2O, TOVA])
def test_attention_scored_decode_without_attention_is_refused(cls) -> None:
    k, v, q = data(t=32)
    lc = cls(budget_tokens=12).new_layer(0, 2, 16)
    lc.prefill(k[:, :, :30], v[:, :, :30], q[:, :, :30])
    lc.append(k[:, :, 30:31], v[:, :, 30:31])
    lc.end_step()  # the first drop: the prefill's scores
    lc.append(k[:, :, 31:32], v[:, :, 31:32])  # no attend() between: no scores
    with pytest.raises(ValueError, match="LayerCache.attend"):
        lc.end_step()


def test_an_evictor_that_observes_refuses_a_layer_that_observes_for_itself() -> None:
    with pytest.raises(ValueError, match="quantizer"):
        H2O(quantizer={"name": "semkv", "config": {"score": "attention"}}).new_layer(0, 2, 16)


def test_snapkv_waits_for_queries_then_evicts() -> None:
    k, v, q = data(t=40)
    lc = SnapKV(keep_ratio=0.5, window_size=8).new_layer(0, 2, 16)
    lc.prefill(k, v)
    assert lc.awaiting_queries and lc.seq_length == 40
    with pytest.raises(ValueError, match="provide_queries"):
        lc.append(k[:, :, :1], v[:, :, :1])
    lc.provide_queries(q)
    assert kept_indices(lc, k) == top_kept(ref_snapkv(k, q, 8, 5), 20)


def test_a_quantizer_stores_the_same_kept_tokens() -> None:
    """Prefill eviction runs before the flush: the quantizer quantizes only kept tokens, and
    the kept tokens are those of the evictor alone."""
    k, v, q = data(t=40)
    alone = SnapKV(keep_ratio=0.5, window_size=8).new_layer(0, 2, 16)
    both = SnapKV(keep_ratio=0.5, window_size=8, quantizer=KIVI4).new_layer(0, 2, 16)
    for lc in (alone, both):
        lc.prefill(k, v, q)
    assert both.quantized_tokens() == (16, 12)
    assert both.nbytes()["total"] < alone.nbytes()["total"]
    got = both.keys_values()[0][:, :, 16:]  # the residual: exact
    assert torch.equal(got, alone.keys_values()[0][:, :, 16:])


def test_per_head_decisions_over_quantized_tokens_keep_their_codes() -> None:
    """Different tokens per head dropped from a quantized block: every kept token reads back
    exactly what it read before."""
    k, v, _ = data(t=32)
    from kvbench.methods.kivi import KIVI

    lc = KIVI(bits=4, value_bits=4, group_size=8, residual_length=8).new_layer(0, 2, 16)
    lc.prefill(k, v)
    before = lc.keys_values()
    drop = torch.tensor([[[1, 5, 30], [2, 9, 17]], [[0, 4, 8], [3, 25, 31]]])
    bounds = lc.part_bounds()
    assert bounds == [0, 24, 32]
    with pytest.raises(ValueError, match="same number"):
        lc.evict(drop)  # 2 vs 1 block tokens across heads: refused
    drop = torch.tensor([[[1, 5, 30], [2, 9, 31]], [[0, 4, 26], [3, 20, 27]]])
    lc.evict(drop)
    after = lc.keys_values()
    for b in range(2):
        for h in range(2):
            keep = [i for i in range(32) if i not in drop[b, h].tolist()]
            for side in range(2):
                assert torch.equal(after[side][b, h], before[side][b, h, keep])
    assert (lc.seq_length, lc.seen_tokens, lc.evicted_tokens) == (29, 32, 3)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "cls, config, field",
    [
        (Knorm, {"keep_ratio": 1.0}, "keep_ratio"),
        (Knorm, {"keep_ratio": 0.0}, "keep_ratio"),
        (Knorm, {"keep_ratio": 1.5}, "keep_ratio"),
        (Knorm, {"keep_ratio": 0.5, "budget_tokens": 8}, "budget_tokens"),
        (Knorm, {"budget_tokens": 0}, "budget_tokens"),
        (Knorm, {"keep_ratio": 0.5, "quantizer": "no-such-method"}, "quantizer"),
        (Knorm, {"keep_ratio": 0.5, "quantizer": {"name": "streamingllm"}}, "quantizer"),
        (
            Knorm,
            {"keep_ratio": 0.5, "quantizer": {"name": "kivi", "config": {"bits": 9}}},
            "quantizer",
        ),
        (Knorm, {"keep_ratio": 0.5, "rotation": "hadamard"}, "rotation"),
        (SnapKV, {"keep_ratio": 0.5, "kernel_size": 4}, "kernel_size"),
        (StreamingLLM, {"keep_ratio": 0.5, "n_sink": -1}, "n_sink"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(cls, config, field) -> None:
    with pytest.raises(ValueError, match=rf"'?{re.escape(field)}'?"):
        cls.Config.from_dict(config)


def test_configs_hash_and_round_trip() -> None:
    import json

    for m in (StreamingLLM(), Knorm(quantizer="kivi"), SnapKV(quantizer=KIVI4)):
        again = type(m.config).from_dict(json.loads(json.dumps(m.config.to_dict())))
        assert again == m.config and hash(again) == hash(m.config)


def test_the_default_budget_keeps_half() -> None:
    k, v, _ = data(t=31)
    lc = Knorm().new_layer(0, 2, 16)
    lc.prefill(k, v)
    assert (lc.seq_length, lc.seen_tokens) == (15, 31)


def test_budgets_a_prompt_cannot_meet_are_refused_before_storing() -> None:
    k, v, q = data(t=20)
    lc = Knorm(budget_tokens=21).new_layer(0, 2, 16)
    with pytest.raises(ValueError, match="budget_tokens.*at most the prompt's 20"):
        lc.prefill(k, v)
    assert lc.seq_length == 0
    lc = SnapKV(keep_ratio=0.5, window_size=20).new_layer(0, 2, 16)
    with pytest.raises(ValueError, match="window_size"):
        lc.prefill(k, v, q)
    lc = StreamingLLM(budget_tokens=4, n_sink=4).new_layer(0, 2, 16)
    with pytest.raises(ValueError, match="budget_tokens.*above n_sink"):
        lc.prefill(k, v)
    lc = StreamingLLM(budget_tokens=64).new_layer(0, 2, 16)  # a decode budget: a cap
    lc.prefill(k, v)
    assert lc.seq_length == 20


def test_snapkv_without_kvbench_attention_is_refused_naming_it() -> None:
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

    plain = toy_llama()
    plain.set_attn_implementation("sdpa")
    ids = torch.arange(12)[None]
    # bound to the model: refused at the prefill, before anything is stored
    cache = QuantizedKVCache(SnapKV(keep_ratio=0.5, window_size=4), plain)
    with torch.no_grad(), pytest.raises(ValueError, match="attn_implementation='kvbench'"):
        plain(ids, **cache_kwarg(cache, plain), use_cache=True)
    assert cache.get_seq_length() == 0
    # bound to a config only: the prefill waits for queries, the first decode step is refused
    cache = QuantizedKVCache(SnapKV(keep_ratio=0.5, window_size=4), plain.config)
    with torch.no_grad(), pytest.warns(UserWarning):
        out = plain(ids, **cache_kwarg(cache, plain), use_cache=True)
        with pytest.raises(ValueError, match="attn_implementation='kvbench'"):
            plain(out.logits[:, -1:].argmax(-1), **cache_kwarg(cache, plain), use_cache=True)


# ------------------------------------------------------------------ the plugin contract
@pytest.mark.parametrize(
    "method",
    [
        StreamingLLM(budget_tokens=12),
        StreamingLLM(budget_tokens=20, quantizer=KIVI4),
        Knorm(keep_ratio=0.5),
        Knorm(keep_ratio=0.5, quantizer=KIVI4),
        SnapKV(keep_ratio=0.5, window_size=8),
        SnapKV(keep_ratio=0.5, window_size=8, quantizer=KIVI4),
        H2O(budget_tokens=12),
        H2O(keep_ratio=0.5, quantizer=KIVI4),
        TOVA(budget_tokens=12),
        TOVA(keep_ratio=0.5, quantizer=KIVI4),
    ],
    ids=lambda m: f"{type(m).__name__}-{m.config.quantizer['name']}",
)
def test_check_method(method) -> None:
    prompt = 30
    r = check_method(method, prompt_tokens=prompt, decode_tokens=9, bad_configs=[{"keep_ratio": 2}])
    assert not r.padding_checked


def test_check_method_catches_shifted_positions(monkeypatch) -> None:
    """A layer whose token count forgets the evicted tokens fails the positions check."""
    monkeypatch.setattr(LayerCache, "seen_tokens", property(lambda self: self.seq_length))
    with pytest.raises(AssertionError, match="positions"):
        check_method(StreamingLLM(budget_tokens=12), prompt_tokens=30, decode_tokens=3)


# ------------------------------------------------------------------ tiny Llama end to end
def _greedy(model, method, ids: torch.Tensor, steps: int):
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

    cache = QuantizedKVCache(method, model)
    logits = []
    with torch.no_grad():
        out = model(ids, **cache_kwarg(cache, model), use_cache=True)
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, **cache_kwarg(cache, model), use_cache=True)
    return torch.stack(logits, 1), cache


def test_a_streamingllm_that_never_evicts_is_full_exactly() -> None:
    model = toy_llama()
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    full, _ = _greedy(model, FullPrecision(), ids, 8)
    never, cache = _greedy(model, StreamingLLM(budget_tokens=64), ids, 8)
    assert torch.equal(full, never)
    assert cache.get_seq_length() == 24 + 8


def test_decode_after_eviction_keeps_positions() -> None:
    """StreamingLLM drops the same tokens in every head, so a full-precision model that masks
    the dropped tokens out (positions unchanged) gives the same logits: positions count tokens
    seen, attention reads the tokens held."""
    from transformers import DynamicCache

    from kvbench.hf.cache import cache_kwarg

    model = toy_llama()
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    budget, sinks, steps = 10, 2, 6
    got, cache = _greedy(model, StreamingLLM(budget_tokens=budget, n_sink=sinks), ids, steps)
    lc = cache.layer_caches()[0]
    assert (lc.seq_length, lc.seen_tokens) == (budget, 24 + steps)
    ref = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        out = model(ids, **cache_kwarg(ref, model), use_cache=True)
        seen = ids.shape[1]
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.zeros(1, seen + 1, dtype=torch.long)
            mask[:, :sinks] = 1
            mask[:, seen + 1 - (budget - sinks) :] = 1  # held after this step's eviction
            out = model(nxt, attention_mask=mask, **cache_kwarg(ref, model), use_cache=True)
            seen += 1
    want = torch.stack(logits, 1)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:, 1:], _greedy(model, FullPrecision(), ids, steps)[0][:, 1:])


@pytest.mark.parametrize(
    "method",
    [
        H2O(budget_tokens=10),
        TOVA(budget_tokens=10, quantizer=KIVI4),
        H2O(keep_ratio=0.5, quantizer=KIVI4),
    ],
    ids=["h2o", "tova-kivi", "h2o-kivi"],
)
def test_attention_scored_evictors_generate_on_the_attend_path(method) -> None:
    model = toy_llama()
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    _, cache = _greedy(model, method, ids, 6)
    assert cache.attend and sum(cache.decode_paths.values()) == 2 * 6
    lc = cache.layer_caches()[1]
    assert lc.seen_tokens == 30 and lc.seq_length == (10 if method.config.budget_tokens else 12)


def test_entry_points_register_each_evictor_once() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for name, target in (
        ("streamingllm", "kvbench.methods.streamingllm:StreamingLLM"),
        ("knorm", "kvbench.methods.knorm:Knorm"),
        ("snapkv", "kvbench.methods.snapkv:SnapKV"),
        ("h2o", "kvbench.methods.h2o:H2O"),
        ("tova", "kvbench.methods.tova:TOVA"),
    ):
        assert text.count(f'{name} = "{target}"') == 1


def test_rows_cached_apart_keep_positions() -> None:
    """A batch whose rows are cached apart (batched workloads) counts the rows' evictions."""
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

    model = toy_llama()
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(4))
    cache = QuantizedKVCache(StreamingLLM(budget_tokens=8), model, rows_apart=True)
    alone = QuantizedKVCache(StreamingLLM(budget_tokens=8), model)
    with torch.no_grad():
        out = model(ids, **cache_kwarg(cache, model), use_cache=True)
        one = model(ids[:1], **cache_kwarg(alone, model), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(nxt, **cache_kwarg(cache, model), use_cache=True)
        one = model(nxt[:1], **cache_kwarg(alone, model), use_cache=True)
    assert cache.get_seq_length() == 21 and cache.layer_caches()[0].seq_length == 8
    assert torch.allclose(out.logits[:1], one.logits, atol=1e-5)


def test_indexed_block_keeps_codes_and_counts_its_index() -> None:
    """A per-head gather from per-channel groups: values unchanged, the group rows kept
    once, an int16 row index per token counted as metadata; it concatenates with a new
    flush, crops and selects batch rows."""
    from kvbench.cache.blocks import IndexedAffineBlock, PerChannelCodec

    k, _, _ = data(t=24)
    codec = PerChannelCodec(4, group_size=8)
    block = codec.encode(k)
    before = block.dequantize(torch.float32)
    keep = torch.tensor([[[0, 3, 9, 17], [1, 2, 20, 23]], [[4, 5, 6, 7], [8, 9, 10, 16]]])
    got = block.gather(keep)
    assert isinstance(got, IndexedAffineBlock)
    want = torch.gather(before, 2, keep[..., None].expand(2, 2, 4, 16))
    assert torch.equal(got.dequantize(torch.float32), want)
    meta = [t for c, t in got.tensors() if c == "metadata"]
    assert len(meta) == 1 and meta[0].dtype == torch.int16 and meta[0].shape == (2, 2, 4)
    assert got.scale.shape[2] == 3  # the groups some row and head still uses
    new = codec.encode(k[:, :, :8])
    both = got.cat(new)
    assert torch.equal(
        both.dequantize(torch.float32), torch.cat([want, new.dequantize(torch.float32)], 2)
    )
    assert torch.equal(both.crop(4).dequantize(torch.float32), want)
    assert torch.equal(
        both.index_batch(torch.tensor([1])).dequantize(torch.float32)[0, :, :4], want[1]
    )
    same = block.gather(torch.tensor([2, 3, 12]).expand(2, 2, 3))  # one set for all: groups stay
    assert type(same) is type(block) and same.group_len == [2, 1]


def test_evictor_hooks_are_required_when_a_subclass_is_built() -> None:
    """The evictor bases' hooks are abstract: a subclass that lacks one is refused when it is
    built (TypeError naming the hook), not when the hook is first called mid-run."""
    from kvbench.cache.eviction import DecodeEvictor, EvictionConfig, EvictionMethod, ScoreEvictor

    class NoScores(ScoreEvictor):
        pass

    class NoStepScores(DecodeEvictor):
        def prefill_scores(self, keys, queries):
            return keys[..., 0]

    class NoEvictor(EvictionMethod):
        pass

    for cls, hook in ((NoScores, "prefill_scores"), (NoStepScores, "step_scores")):
        with pytest.raises(TypeError, match=hook):
            cls(EvictionConfig())
    with pytest.raises(TypeError, match="evictor"):
        NoEvictor()

    class Complete(NoStepScores):
        def step_scores(self, layer):
            return None

    assert Complete(EvictionConfig()).evicts_at_decode
