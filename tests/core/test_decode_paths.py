"""Decode attention routes of the model-driven workloads (``path: attend | reference``).

The ``attend`` route (default) runs a kvbench cache's decode steps through
``LayerCache.attend`` (the attention-backend registry: code-domain kernels on the CPU); the
``reference`` route through sdpa over the dequantized ``keys_values()``.  On a seeded toy Llama
(GQA, two layers) the workloads' metrics must be those of the reference route within the
registry's agreement tolerance (1e-5 relative per attention row, tests/attention), the record must
name the path that ran, and the shared full-precision prefill (``capture_prompt`` +
``QuantizedKVCache.prefill_from``) must give what the model's own prefill through the cache
gives.  Right values: the reference route, i.e. transformers' sdpa over ``keys_values()``, a
separate code path from the code-domain kernels.
"""

from __future__ import annotations

import pytest
import torch
from tiny_lm import toy_llama

import kvbench.data.loaders as loaders
from kvbench.bench.context import RunContext
from kvbench.bench.decoding import decode_route
from kvbench.bench.workloads import WORKLOADS
from kvbench.bench.workloads.generation import forced_logprobs
from kvbench.bench.workloads.perplexity import chunked_logits
from kvbench.cache.registry import get_method
from kvbench.hf.attention import kvbench_attention
from kvbench.hf.capture import capture_prompt
from kvbench.kernels.cpu import codedomain as cpu

SMALL = dict(group_size=16, residual_length=16)
#: layouts with different code-domain kernels, one needing prefill queries (pn-mix), one with no
#: dequantized form (qjl: its estimator is its own reference, so both routes attend)
METHODS = [
    ("full", {}),
    ("kivi", dict(SMALL, bits=2, value_bits=2)),
    ("per-token", dict(SMALL, bits=2, value_bits=2)),
    ("int4-block", dict(block_size=16, residual_length=16)),
    ("pn-mix", dict(SMALL, value_bits=2)),
    ("polarquant", dict(SMALL, value_bits=2)),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(scope="module")
def model():
    return toy_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (1, 72), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name, cfg", METHODS, ids=[m[0] for m in METHODS])
def test_chunk_logprobs_attend_equal_reference(model, ids, name, cfg) -> None:
    method = get_method(name, **cfg)
    info_a, info_r = {}, {}
    a, nb_a = chunked_logits(model, ids, method, 32, 5, "attend", info=info_a)
    r, nb_r = chunked_logits(model, ids, method, 32, 5, "reference", info=info_r)
    assert rel(a, r) <= 1e-5
    assert nb_a == nb_r  # the same bytes stored either way
    steps = 8 * 2  # ceil((72 - 1 - 32) / 5) chunks x 2 layers
    assert info_a["route"] == "attend" and sum(info_a["paths"].values()) == steps
    assert all(p == "reference" or cpu.path_kinds(p) for p in info_a["paths"]), info_a["paths"]
    assert info_r == {
        "route": "reference",
        "route_reason": "path=reference (sdpa over keys_values())",
        "protocol": "write-then-attend",
        "prefill_attention": "full",
        "paths": {"sdpa-keys-values": steps},
        "path_reasons": [],
    }
    if name != "full":  # the cache is read: 2-bit codes change the distributions
        full, _ = chunked_logits(model, ids, get_method("full"), 32, 5, "attend")
        assert (full - a).abs().max() > 1e-3


@pytest.mark.parametrize("name, cfg", METHODS, ids=[m[0] for m in METHODS])
def test_shared_prefill_equals_the_model_prefill(model, ids, name, cfg) -> None:
    method = get_method(name, **cfg)
    prompt = capture_prompt(model, ids[:, :32])
    for path in ("attend", "reference"):
        shared, nb_s = chunked_logits(model, ids, method, 32, 5, path, prompt)
        own, nb_o = chunked_logits(model, ids, method, 32, 5, path)
        assert rel(shared, own) <= 1e-5 and nb_s == nb_o


def _perplexity(monkeypatch, model, ids, path):
    monkeypatch.setattr(loaders, "load_text", lambda name: ("", {"name": name}))
    monkeypatch.setattr(loaders, "token_windows", lambda tok, text, n, k: (ids[:, :n], {}))
    cls = WORKLOADS.get("perplexity")
    spec = {"type": "perplexity", "tokens": 72, "prefill": 32, "chunk": 8, "windows": 1}
    wl = cls(cls.validate({**spec, "path": path}))
    ctx = RunContext(model=model, seed=0, model_info={"head_dim": 16})
    wl.prepare(ctx)
    return wl, ctx


@pytest.mark.parametrize("name, cfg", METHODS[1:4], ids=[m[0] for m in METHODS[1:4]])
def test_perplexity_metrics_attend_equal_reference(monkeypatch, model, ids, name, cfg) -> None:
    method = get_method(name, **cfg)
    wa, ca = _perplexity(monkeypatch, model, ids, "attend")
    wr, cr = _perplexity(monkeypatch, model, ids, "reference")
    ra, rr = wa.run(ca, method), wr.run(cr, method)
    ma, mr = ra.metrics, rr.metrics
    assert ma["next_token_kl"] > 1e-6  # a real difference from full to agree on
    for k in ("ppl", "ppl_ref", "next_token_kl"):
        assert ma[k] == pytest.approx(mr[k], rel=1e-5, abs=1e-7), k
    # a difference of two perplexities that each agree to 1e-5 relative
    assert ma["ppl_delta"] == pytest.approx(mr["ppl_delta"], abs=1e-5 * (mr["ppl"] + mr["ppl_ref"]))
    assert ma["top1_agreement"] == mr["top1_agreement"]
    assert ma["bytes_total"] == mr["bytes_total"]
    assert ra.info["decode_attention"]["route"] == "attend"
    assert rr.info["decode_attention"]["paths"] == {"sdpa-keys-values": 10}  # 5 chunks x 2
    # the full baseline scores exactly 0 against its own route's reference
    assert wa.run(ca, get_method("full")).metrics["next_token_kl"] == pytest.approx(0, abs=1e-9)


def test_generation_forced_logprobs_attend_equal_reference(model, ids) -> None:
    method = get_method("kivi", **SMALL, bits=2, value_bits=2)
    cont = ids[0, 40:56]
    info = {}
    a = forced_logprobs(model, ids[:, :40], cont, method, "attend", info)
    r = forced_logprobs(model, ids[:, :40], cont, method, "reference")
    assert rel(a, r) <= 1e-5
    assert info["route"] == "attend" and sum(info["paths"].values()) == 15 * 2


def test_attention_implementation_is_set_for_the_run_and_restored(ids) -> None:
    model = toy_llama()
    model.set_attn_implementation("sdpa")
    method = get_method("kivi", **SMALL, bits=2, value_bits=2)
    info = {}
    a, _ = chunked_logits(model, ids, method, 32, 5, "attend", info=info)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert info["route"] == "attend" and "sdpa-keys-values" not in info["paths"]
    with pytest.raises(RuntimeError):
        with kvbench_attention(model):
            assert model.config._attn_implementation == "kvbench"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"  # restored after an error too


def test_decode_route_declines_what_attend_cannot_serve(model) -> None:
    assert decode_route(get_method("kivi"), model) == (True, "")
    assert decode_route(get_method("kivi"), model, "reference")[0] is False
    attend, why = decode_route(get_method("hf-dynamic"), model)
    assert not attend and "transformers cache" in why
    from transformers import MistralConfig

    cfg = MistralConfig(num_hidden_layers=2, sliding_window=8)
    attend, why = decode_route(get_method("kivi"), cfg)
    assert not attend and "sliding" in why
    with pytest.raises(ValueError, match="allowed"):
        decode_route(get_method("kivi"), model, "fast")
