"""The ``exact-chunked`` decode protocol (docs/design.md#protocols) on a tiny float64 Llama.

A chunk of C tokens is cut into calls where the cache announces a change of the stored form of a
token it already holds (``LayerCache.steady_appends``: a flush of older tokens, a budget
halving), so every query reads what one-token decode shows it.  Right value: write-then-attend
at C = 1 (one token per call: exact decode by definition), the same cache and model, another
schedule of model calls and of kernels (n_q up to C vs 1).  The model runs in float64, where
those differ by ~1e-14, but ``chunked_logits`` returns float32 log-probabilities (its logits
are cast to float32, as every workload records them), so such a difference shows only where it
moves a float32 rounding: by a few float32 ulps of |log p| (2^-21 ~ 4.8e-7 for |log p| in
[4, 8); this vocabulary of 96 gives |log p| < 8).  ATOL = 4e-6 is 8 such ulps; the largest
difference measured here is 9.5e-7 (2 ulps, PM-KVQ), and ATOL is still four orders of
magnitude below the protocol effect (write-then-attend at C = 256 misses by 2e-2 here,
:func:`test_write_then_attend_is_not_exact`), and 100 x ATOL below what announcing one token
too many does (:func:`test_one_token_too_many_breaks_equality`).
"""

from __future__ import annotations

import pytest
import torch
from tiny_lm import toy_llama

from kvbench.bench.workloads.perplexity import chunked_logits
from kvbench.cache.layer import LayerCache
from kvbench.cache.method import Method
from kvbench.cache.registry import METHODS, get_method
from kvbench.methods.pm_kvq import ProgressiveLayerCache

pytestmark = pytest.mark.usefixtures("one_thread")

EXACT = "exact-chunked"
ATOL = 4e-6  # 8 float32 ulps of |log p| < 8 (module docstring)
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
    "polarquant": dict(group_size=16, residual_length=16, value_bits=2),
    "snapkv": dict(window_size=16),  # its observation window fits the 40-token prompt
    "semkv": dict(residual_length=16),
    "kvquant": dict(bits=2, value_bits=2, residual_length=16),  # calibrated by _method
    "turboquant-mse": dict(residual_length=16),
}
#: transformers peers: their own cache's update, one call per chunk (recorded so)
PEERS = {"hf-dynamic", "hf-fp8", "hf-hqq", "hf-quanto"}


def _method(name: str) -> Method:
    """``name`` at its settings here; KVQuant calibrated on keys of the model's shape (layers 0
    and 1, H_kv = 2, D = 16), drawn apart from the evaluation ids."""
    method = get_method(name, **{**NAMED, **OTHER}.get(name, {}))
    if method.needs_calibration:
        g = torch.Generator().manual_seed(7)
        method = method.calibrate({i: torch.randn(2, 2, 64, 16, generator=g) for i in (0, 1)})
    return method


@pytest.fixture(scope="module")
def model():
    return toy_llama(max_positions=512, dtype=torch.float64)


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
    calls = _exact_everywhere(model, ids, _method(name))
    assert all(n <= 1 + 259 for n in calls.values())


def test_pm_kvq_budget_halves_inside_the_scored_range(model, ids) -> None:
    """The budget of the PM-KVQ case above shrinks the codes while the scored tokens decode
    (so its equality covers a re-encode inside a chunk), and the cuts stay few: the C = 256
    chunk takes far fewer calls than 259."""
    from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

    method = _method("pm-kvq")
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
    _exact_everywhere(model, ids, _method(name))


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
    method = _method("kivi")
    one, _ = chunked_logits(model, ids, method, PREFILL, 1)
    wta, _ = chunked_logits(model, ids, method, PREFILL, 256)
    assert (wta.double() - one.double()).abs().max() > 1e-4


def _layer_class(method: Method) -> type[LayerCache]:
    return type(method.new_layer(0, 2, 16, torch.float64, "cpu"))


#: (method, the function a mutation announces one token more than): the schedules' answer
#: (KIVI: its sliding values cut every token; per-channel: its keys' block of R), PM-KVQ's
#: whole answer, and its budget's part alone (a halving between flushes)
MUTATIONS = [
    ("kivi", LayerCache.steady_appends),
    ("per-channel", LayerCache.steady_appends),
    ("pm-kvq", ProgressiveLayerCache.steady_appends),
    ("pm-kvq", ProgressiveLayerCache.budget_appends),
]


@pytest.mark.parametrize(("name", "honest"), MUTATIONS, ids=lambda x: getattr(x, "__name__", x))
def test_one_token_too_many_breaks_equality(monkeypatch, model, ids, name, honest) -> None:
    """Mutation: a cache that announces one token more than it may (the next change of held
    tokens falls inside the call) no longer gives C = 1's logits, by far more than ATOL.  The
    schedules' answer is the one without per-query views (``viewable`` False: the reference
    route's, and every layer's before views): with views the call's queries would read the
    extra flush's tokens in full precision (``append_viewed`` replays every flush), so the
    views' own mutation is :func:`test_calls_without_their_views_break_equality`."""
    method = _method(name)
    one, _ = chunked_logits(model, ids, method, PREFILL, 1)
    owner = ProgressiveLayerCache if name == "pm-kvq" else LayerCache
    monkeypatch.setattr(LayerCache, "viewable", lambda self: False)

    def mutant(self: LayerCache, limit: int) -> int:
        return min(honest(self, limit) + 1, limit)

    monkeypatch.setattr(owner, honest.__name__, mutant)
    lp, _ = chunked_logits(model, ids, method, PREFILL, 256, protocol=EXACT)
    assert (lp.double() - one.double()).abs().max() > 100 * ATOL


def test_layers_that_update_otherwise_declare_it() -> None:
    """Every registered method whose layer overrides ``append`` or ``end_step`` (updates the
    base class cannot predict from the schedules) either clears ``steady_updates`` (one token
    per call) or overrides ``steady_appends`` with its own bound
    (docs/design.md#protocols)."""
    own = {}
    for name in sorted(set(METHODS) - PEERS):
        cls = _layer_class(_method(name))
        below = cls.__mro__[: cls.__mro__.index(LayerCache)]  # the subclasses, not the base
        overrides = {
            n for c in below for n in ("append", "end_step", "steady_appends") if n in vars(c)
        }
        if overrides & {"append", "end_step"}:
            own[name] = (not cls.steady_updates) or "steady_appends" in overrides
    assert own == {"pm-kvq": True, "semkv": True}


# ------------------------------------------------------------------ per-query views
def _per_query(query, keys, values, key_view, value_view):
    """The right value of :func:`view_attention`, built query by query: the keys and values
    query ``t`` reads (the view's tokens replaced where ``steps > t``), cut at its causal end,
    through :func:`reference_attention` (one query each)."""
    from kvbench.attention.reference import reference_attention

    nq, t = query.shape[2], keys.shape[2]
    rows = []
    for q in range(nq):
        k, v = keys.clone(), values.clone()
        for x, view in ((k, key_view), (v, value_view)):
            if view is not None:
                start, full, steps = view
                for i in range(full.shape[2]):
                    if int(steps[i]) > q:
                        x[:, :, start + i] = full[:, :, i]
        end = t - nq + q + 1
        rows.append(reference_attention(query[:, :, q : q + 1], k[:, :, :end], v[:, :, :end]))
    return torch.cat(rows, dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_view_attention_equals_each_query_own_cache(dtype) -> None:
    """Each query of :func:`view_attention` reads exactly its own view (keys and values of a
    window flushed at later steps in full precision), as a one-query reference attention over
    that view computes it; without the views the rows that read a replaced token differ."""
    from kvbench.attention.reference import view_attention

    g = torch.Generator().manual_seed(11)
    b, hkv, hq, t, d, nq = 1, 2, 6, 40, 16, 9
    keys, values = (torch.randn(b, hkv, t, d, generator=g, dtype=dtype) for _ in range(2))
    query = torch.randn(b, hq, nq, d, generator=g, dtype=dtype)
    full_k, full_v = (torch.randn(b, hkv, 7, d, generator=g, dtype=dtype) for _ in range(2))
    steps = torch.tensor([1, 2, 3, 4, 0, 5, 8])  # one token read as stored by every query
    kview, vview = (20, full_k, steps), (24, full_v, steps)
    got = view_attention(query, keys, values, None, kview, vview)
    want = _per_query(query, keys, values, kview, vview)
    assert got.dtype == dtype
    # the right value's logits and softmax are float32 (reference_attention) in both cases
    assert torch.allclose(got.double(), want.double(), rtol=0, atol=2e-6)
    plain = view_attention(query, keys, values)
    assert (plain - want).abs().amax(dim=(0, 1, 3)).gt(1e-3).sum() >= nq - 2


def test_sliding_windows_take_few_calls(model, ids) -> None:
    """With per-query views a sliding value window no longer cuts every token: KIVI (keys in
    blocks of R = 16, values sliding over R = 16) takes about one call per key block at
    C = 256 (it took 259 before) and records the views path; its logits still equal C = 1's
    (:func:`_exact_everywhere`)."""
    calls = _exact_everywhere(model, ids, _method("kivi"))
    assert calls[256] <= 1 + 2 * (259 // 16 + 2), calls
    info: dict = {}
    chunked_logits(model, ids, _method("kivi"), PREFILL, 256, protocol=EXACT, info=info)
    assert info["paths"].get("reference-views", 0) > 0, info["paths"]


@pytest.mark.parametrize("name", ["full", "int4-block", "per-channel", "pm-kvq"])
def test_methods_without_views_are_unchanged(monkeypatch, model, ids, name) -> None:
    """A method whose held tokens change only at the call's first step never reads through a
    view: its exact-chunked logits are bit-equal to the path without views (``viewable``
    answering False, the protocol as it was), and its calls the same."""
    from kvbench.cache.layer import LayerCache

    method = _method(name)
    (new, _), n_new = _calls(
        model, lambda: chunked_logits(model, ids, method, PREFILL, 256, protocol=EXACT)
    )
    monkeypatch.setattr(LayerCache, "viewable", lambda self: False)
    (old, _), n_old = _calls(
        model, lambda: chunked_logits(model, ids, method, PREFILL, 256, protocol=EXACT)
    )
    assert torch.equal(new, old) and n_new == n_old


def test_calls_without_their_views_break_equality(monkeypatch, model, ids) -> None:
    """Mutation: the cuts of the views (few calls) with every query reading the stored state
    (the views dropped) is write-then-attend inside a key block, and misses C = 1 by far more
    than ATOL."""
    from kvbench.attention import dispatch

    method = _method("kivi")
    one, _ = chunked_logits(model, ids, method, PREFILL, 1)
    honest = dispatch.attend_views
    monkeypatch.setattr(
        dispatch,
        "attend_views",
        lambda cache, q, s, views: honest(cache, q, s, dispatch.StepViews(None, None)),
    )
    lp, _ = chunked_logits(model, ids, method, PREFILL, 256, protocol=EXACT)
    assert (lp.double() - one.double()).abs().max() > 100 * ATOL
