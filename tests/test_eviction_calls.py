"""Eviction in the transformers bridge (docs/design.md#eviction), on tiny Llamas.

- Multi-token decode calls: a decode budget applies after every token, as one-token decode
  applies it, so callers cut a call where a budget drops a token
  (``QuantizedKVCache.eviction_appends``) and ``update`` refuses a longer call before storing
  it.  Right value: the same protocol at one token per call, in float64; a call that evicted
  once before its queries attended gave NaN logits (a query left without a key) or fewer
  tokens than one-token decode reads.
- ``attn_implementation``: a method that needs the prompt's queries or each decode step's
  attention on a model bound to another attention function is refused at the prefill, before
  the model's layers run.
"""

from __future__ import annotations

import pytest
import torch
from tiny_lm import tiny_lm, toy_llama

from kvbench.bench.decoding import decode_route, eos_ids, greedy_generate
from kvbench.bench.workloads.perplexity import chunked_logits
from kvbench.cache.method import Method
from kvbench.cache.registry import get_method
from kvbench.hf.attention import kvbench_attention
from kvbench.hf.cache import PROTOCOLS, QuantizedKVCache, cache_kwarg
from kvbench.methods.h2o import H2O
from kvbench.methods.snapkv import SnapKV
from kvbench.methods.streamingllm import StreamingLLM
from kvbench.methods.tova import TOVA

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 4e-6  # float32 log-probs of a float64 model (tests/test_exact_chunked.py's bound)
PREFILL = 24  # prompt tokens, then FED tokens scored in chunks
FED = 41
KIVI4 = {
    "name": "kivi",
    "config": {"bits": 4, "value_bits": 4, "group_size": 8, "residual_length": 8},
}


@pytest.fixture(scope="module")
def model():
    return toy_llama(dtype=torch.float64)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (1, PREFILL + FED), generator=torch.Generator().manual_seed(5))


#: decode budgets: full after the prefill (window of 10 < the chunk: a call evicted its own
#: earliest tokens), room for 5 tokens first, attention-scored ones, and one with a quantizer
EVICTORS = {
    "streaming-12": lambda: StreamingLLM(budget_tokens=12, n_sink=2),
    "streaming-room": lambda: StreamingLLM(budget_tokens=PREFILL + 5, n_sink=2),
    "h2o-12": lambda: H2O(budget_tokens=12),
    "tova-12": lambda: TOVA(budget_tokens=12),
    "streaming-kivi": lambda: StreamingLLM(budget_tokens=20, n_sink=2, quantizer=KIVI4),
}


@pytest.mark.parametrize("path", ["attend", "reference"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", sorted(EVICTORS))
def test_a_chunk_reads_what_one_token_decode_reads(model, ids, name, protocol, path) -> None:
    """Chunks of 16 (more than the budget's window) give the logits of one token per call,
    finite, under every protocol (exact-chunked: write-then-attend's one token per call) and
    on both decode routes (attention-scored evictors always attend)."""
    if name == "streaming-kivi" and protocol != "exact-chunked":
        pytest.skip("a quantizer's own chunk semantics differ by protocol (not eviction's)")
    method = EVICTORS[name]()
    one_protocol = "write-then-attend" if protocol == "exact-chunked" else protocol
    one, _ = chunked_logits(model, ids, method, PREFILL, 1, path, protocol=one_protocol)
    lp, states = chunked_logits(model, ids, method, PREFILL, 16, path, protocol=protocol)
    assert bool(torch.isfinite(lp).all()) and bool(torch.isfinite(one).all())
    assert torch.allclose(lp.double(), one.double(), rtol=0, atol=ATOL), (name, protocol)
    assert [s.positions for s in states[1:]] == [16, 16, FED - 1 - 32]  # one state per chunk


def _prefilled(model, method: Method, ids: torch.Tensor) -> QuantizedKVCache:
    cache = QuantizedKVCache(method, model)
    with torch.no_grad():
        model(input_ids=ids[:, :PREFILL], use_cache=True, **cache_kwarg(cache, model))
    return cache


def test_a_call_the_budget_would_cut_is_refused_before_it_is_stored(model, ids) -> None:
    full = _prefilled(model, StreamingLLM(budget_tokens=12, n_sink=2), ids)
    assert full.eviction_appends(8) == 0  # the budget is full: one token per call
    with torch.no_grad(), pytest.raises(ValueError, match="budget_tokens") as err:
        model(input_ids=ids[:, PREFILL : PREFILL + 4], use_cache=True, **cache_kwarg(full, model))
    assert "eviction_appends" in str(err.value) and "at most 1 fit" in str(err.value)
    lc = full.layer_caches()[0]
    assert (lc.seq_length, lc.seen_tokens, full.get_seq_length()) == (12, PREFILL, PREFILL)
    roomy = _prefilled(model, StreamingLLM(budget_tokens=PREFILL + 6, n_sink=2), ids)
    assert roomy.eviction_appends(10) == 5 and roomy.steady_appends(10) == 5
    with torch.no_grad(), pytest.raises(ValueError, match="at most 6 fit"):
        model(input_ids=ids[:, PREFILL : PREFILL + 7], use_cache=True, **cache_kwarg(roomy, model))
    with torch.no_grad():  # six fit: nothing is dropped inside the call
        model(input_ids=ids[:, PREFILL : PREFILL + 6], use_cache=True, **cache_kwarg(roomy, model))
    assert roomy.layer_caches()[0].evicted_tokens == 0 and roomy.eviction_appends(10) == 0
    # a method without a decode budget announces no cut
    assert _prefilled(model, get_method("full"), ids).eviction_appends(10) == 10


def test_the_question_after_a_compressed_context_is_cut() -> None:
    """``greedy_generate``'s question (ruler11 question-agnostic) is fed as calls cut at the
    budget: the tokens of feeding it one token per call, then greedy decoding."""
    model, tok, _ = tiny_lm()
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, len(tok), (1, 40), generator=g)
    context, steps = 28, 6

    def method() -> Method:
        return StreamingLLM(budget_tokens=10, n_sink=2)

    got = greedy_generate(model, tok, ids, method(), steps, context=context)
    cache = QuantizedKVCache(method(), model, attend=decode_route(method(), model)[0])
    kw = cache_kwarg(cache, model)
    new: list[int] = []
    with torch.no_grad(), kvbench_attention(model):
        out = model(input_ids=ids[:, :context], use_cache=True, **kw)
        for s in range(context, ids.shape[1]):
            out = model(input_ids=ids[:, s : s + 1], use_cache=True, **kw)
        for _ in range(steps):
            nxt = int(out.logits[0, -1].argmax())
            if nxt in eos_ids(model, tok):
                break
            new.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]]), use_cache=True, **kw)
    assert got["new_tokens"] == len(new)
    assert got["text"] == tok.decode(new, skip_special_tokens=True)


# ------------------------------------------------------------------ attn_implementation
NEEDS_ATTENTION = {
    "snapkv": lambda: SnapKV(keep_ratio=0.5, window_size=4),
    "h2o": lambda: H2O(budget_tokens=10),
    "tova": lambda: TOVA(budget_tokens=10),
    "pn-mix": lambda: get_method("pn-mix", group_size=8, residual_length=8, value_bits=2),
}


@pytest.mark.parametrize("name", sorted(NEEDS_ATTENTION))
def test_a_model_without_kvbench_attention_is_refused_before_its_layers_run(name) -> None:
    plain = toy_llama()
    plain.set_attn_implementation("sdpa")
    cache = QuantizedKVCache(NEEDS_ATTENTION[name](), plain)
    done = []
    mods = [*plain.model.layers, plain.lm_head]
    hooks = [m.register_forward_hook(lambda m, *a: done.append(m)) for m in mods]
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="attn_implementation='kvbench'"):
            plain(torch.arange(12)[None], use_cache=True, **cache_kwarg(cache, plain))
    finally:
        for h in hooks:
            h.remove()
    assert done == []  # no decoder layer (nor the head) finished a forward
    assert cache.get_seq_length() == 0
    # the same cache, bound before the model switches to kvbench's attention, runs
    with torch.no_grad(), kvbench_attention(plain):
        out = plain(torch.arange(12)[None], use_cache=True, **cache_kwarg(cache, plain))
        plain(out.logits[:, -1:].argmax(-1), use_cache=True, **cache_kwarg(cache, plain))
    assert cache.get_seq_length() == 13
