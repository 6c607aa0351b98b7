"""The ``exact-chunked`` decode protocol (docs/design.md#protocols) on a tiny float64 Llama.

A chunk of C tokens is cut into calls where the cache announces a change of the stored form of a
token it already holds (``LayerCache.steady_appends``: a flush of older tokens, a budget
halving), so every query reads what one-token decode shows it.  Right value: write-then-attend
at C = 1 (one token per call: exact decode by definition), the same cache and model, another
schedule of model calls and of kernels (n_q up to C vs 1).  In float64 those differ by round-off
only: the log-probabilities are O(10) and a differently shaped matmul moves them by ~1e-14; a
stored code would move only if a value fell within ~1e-15 of a rounding boundary, so ATOL =
1e-9 leaves five orders of magnitude of margin and is still far below any protocol effect
(write-then-attend at C = 256 misses by > 1e-4, :func:`test_write_then_attend_is_not_exact`).
"""

from __future__ import annotations

import pytest
import torch

from kvbench.bench.workloads.perplexity import chunked_logits
from kvbench.cache.layer import LayerCache
from kvbench.cache.registry import METHODS, get_method
from kvbench.hf.attention import use_kvbench_attention

pytestmark = pytest.mark.usefixtures("one_thread")

EXACT = "exact-chunked"
ATOL = 4e-6  # float32 rounding of float64 logits (module docstring)
PREFILL = 40  # 40 prompt tokens, then 259 fed tokens (a C = 256 chunk and a 3-token rest)
SMALL = dict(group_size=8, residual_length=16)  # G and R of the residual methods here
#: the named methods' operating points for head_dim 16, sinks where the method has them
NAMED = {
    "kivi": dict(SMALL, bits=2, value_bits=2, num_sink_tokens=2),
    "pn-mix": dict(SMALL, value_bits=2, num_sink_tokens=2),
    "kitty": dict(SMALL, value_bits=2, num_sink_tokens=2),
    # the budget halves the main cache 16 -> 8 -> 4 bits inside the scored range
    "pm-kvq": dict(
        residual_length=8,
        num_sink_tokens=1,
        budget_bits=4,
        budget_tokens=125,
        on_overflow="allow",
        channel_group_size=16,
    ),
}
#: every other registered method's settings for head_dim 16 ({} = its defaults)
OTHER = {
    "per-channel": dict(SMALL, bits=2),
    "uniform": dict(SMALL, bits=4, value_bits=4),
    "per-head": dict(SMALL, bits=4, value_bits=2),
    "per-token": dict(SMALL, bits=2, value_bits=2, num_sink_tokens=2),
    "chanmix": dict(SMALL, value_bits=2),
    "int4-block": dict(block_size=16),
    "int8-block": dict(block_size=16),
    "polarquant": dict(residual_length=16, value_bits=2),
    "semkv": dict(residual_length=16),
    "kvquant": dict(bits=2, value_bits=2, residual_length=16),
    "turboquant-mse": dict(residual_length=16),
}
#: transformers peers: their own cache's update, one call per chunk (recorded so)
PEERS = {"hf-dynamic", "hf-fp8", "hf-hqq", "hf-quanto"}


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
        intermediate_size=96,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return use_kvbench_attention(LlamaForCausalLM(cfg).eval().double())


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (1, PREFILL + 260), generator=torch.Generator().manual_seed(3))


def _calls(model, fn):
    """``(fn(), model calls it made)``."""
    n = [0]
    hook = model.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    try:
        return fn(), n[0]
    finally:
        hook.remove()


def _exact_everywhere(model, ids, method) -> dict[int, int]:
    """C = 256, 16 and 12 (not a multiple of G = 8) under exact-chunked equal C = 1; returns the
    model calls each C made."""
    one, _ = chunked_logits(model, ids, method, PREFILL, 1)
    calls = {}
    for c in (256, 16, 12):
        (lp, states), calls[c] = _calls(
            model, lambda c=c: chunked_logits(model, ids, method, PREFILL, c, protocol=EXACT)
        )
        assert lp.dtype == torch.float32 and lp.shape == one.shape
        assert torch.allclose(lp.double(), one.double(), rtol=0, atol=ATOL), (c, method)
        # one scored state per chunk, whatever the cuts inside it
        assert [s.positions for s in states[1:]] == [
            min(c, PREFILL + 259 - s) for s in range(PREFILL, PREFILL + 259, c)
        ]
    return calls


@pytest.mark.parametrize("name", sorted(NAMED))
def test_exact_chunked_equals_one_token_decode(model, ids, name) -> None:
    calls = _exact_everywhere(model, ids, get_method(name, **NAMED[name]))
    assert all(n <= 1 + 259 for n in calls.values())


def test_pm_kvq_budget_halves_inside_the_scored_range(model, ids) -> None:
    """The budget of the PM-KVQ case above shrinks the codes while the scored tokens decode
    (so its equality covers a re-encode inside a chunk), and the cuts stay few: the C = 256
    chunk takes far fewer calls than 259."""
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

    method = get_method("pm-kvq", **NAMED["pm-kvq"])
    cache = QuantizedKVCache(method, model)
    with torch.no_grad():
        model(input_ids=ids[:, :PREFILL], use_cache=True, **cache_kwarg(cache, model))
        after_prefill = cache.layer_caches()[0].bits
        for s in range(PREFILL, PREFILL + 259):
            model(input_ids=ids[:, s : s + 1], use_cache=True, **cache_kwarg(cache, model))
    assert after_prefill > cache.layer_caches()[0].bits
    calls = _exact_everywhere(model, ids, method)
    assert calls[256] < 100


def test_block_schedules_need_few_calls(model, ids) -> None:
    """Methods whose held tokens change only at block flushes take about one call per block of
    R, not one per token: `full` one call per chunk, per-channel KIVI-style keys with full
    values (R = 16) about 259 / 16."""
    calls = _exact_everywhere(model, ids, get_method("full"))
    assert calls == {256: 1 + 2, 16: 1 + 17, 12: 1 + 22}  # the prefill, then the chunks
    calls = _exact_everywhere(model, ids, get_method("per-channel", bits=2, **SMALL))
    assert calls[256] <= 1 + 2 * (259 // 16 + 2)


@pytest.mark.parametrize("name", sorted(set(METHODS) - set(NAMED) - PEERS - {"full"}))
def test_every_method_is_exact(model, ids, name) -> None:
    _exact_everywhere(model, ids, get_method(name, **OTHER.get(name, {})))


def test_peers_run_their_own_update(model, ids) -> None:
    """A transformers peer's cache announces nothing: its chunk runs as one call, recorded as
    ``transformers-update``."""
    info: dict = {}
    (_, _), n = _calls(
        model,
        lambda: chunked_logits(
            model, ids[:, :72], get_method("hf-dynamic"), 32, 16, protocol=EXACT, info=info
        ),
    )
    assert info["protocol"] == "transformers-update" and n == 1 + 3


def test_write_then_attend_is_not_exact(model, ids) -> None:
    """The control: without the cuts, KIVI's chunk of 256 reads neighbours its own flush
    quantized, and misses C = 1 by far more than ATOL."""
    method = get_method("kivi", **NAMED["kivi"])
    one, _ = chunked_logits(model, ids, method, PREFILL, 1)
    wta, _ = chunked_logits(model, ids, method, PREFILL, 256)
    assert (wta.double() - one.double()).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["kivi", "pm-kvq"])
def test_one_token_too_many_breaks_equality(monkeypatch, model, ids, name) -> None:
    """Mutation: a cache that announces one token more than it may (the next change of held
    tokens falls inside the call) no longer gives C = 1's logits."""
    method = get_method(name, **NAMED[name])
    one, _ = chunked_logits(model, ids, method, PREFILL, 1)
    honest = LayerCache.steady_appends
    if name == "pm-kvq":
        honest = type(method.new_layer(0, 2, 16, torch.float64, "cpu")).steady_appends
    monkeypatch.setattr(
        type(method.new_layer(0, 2, 16, torch.float64, "cpu")),
        "steady_appends",
        lambda self, limit: min(honest(self, limit) + 1, limit),
    )
    lp, _ = chunked_logits(model, ids, method, PREFILL, 256, protocol=EXACT)
    assert (lp.double() - one.double()).abs().max() > 1e-6
