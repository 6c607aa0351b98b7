"""Functional tests of the transformers bridge (kvbench.hf.cache, kvbench.hf.attention,
kvbench.hf.capture) on tiny random-weight models built offline from configs.

These are functional tests only: the models are random (2 layers, hidden 64, 4 query heads,
2 KV heads, vocab 128), so they check plumbing and protocol (docs/design.md#protocols), not accuracy.
Right values come from transformers' own DynamicCache + sdpa path (the stock reference), from
docs/methods.md#flush-schedules, and from caller's config mutated between calls: huggingface/transformers PR#48700, docs/methods.md#callers-config-mutated-between-calls; untested path seq_len > residual_length; 8-bit cache must track full precision: huggingface/transformers PR#39106, docs/methods.md#sequences-longer-than-the-residual-untested.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import warnings

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kvbench
from kvbench.cache.blocks import PerChannelCodec
from kvbench.cache.method import Capabilities
from kvbench.hf.attention import use_kvbench_attention
from kvbench.hf.cache import QuantizedKVCache, cache_kwarg
from kvbench.hf.capture import capture_qkv

KIVI = kvbench.get_method_class("kivi")

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    # a short window so that the sliding-window mask really acts within 27 tokens
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
}
PROMPT_LEN, NEW = 7, 20
KIVI2 = dict(bits=2, group_size=4, residual_length=4, value_bits=2)
PC8 = dict(bits=8, group_size=4, residual_length=4, value_bits=8)


# tiny models gain nothing from intra-op threads (tests/conftest.py: one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _model(arch: str, head_dim: int = 16, layers: int = 2):
    cfg_cls, model_cls, extra = ARCHS[arch]
    cfg = cfg_cls(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        vocab_size=128,
        intermediate_size=128,
        **extra,
    )
    torch.manual_seed(0)
    return model_cls(cfg).eval()


def model(arch: str = "llama", head_dim: int = 16, attn: str = "kvbench", layers: int = 2):
    m = _model(arch, head_dim, layers)
    if attn == "kvbench":
        use_kvbench_attention(m)
    else:
        m.set_attn_implementation(attn)
    return m


def prompt(batch: int = 1, n: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def greedy(m, ids, cache=None, new=NEW, **kw):
    extra = {} if cache is None else cache_kwarg(cache, m)
    with torch.no_grad():
        return m.generate(
            ids,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
            **kw,
        )


def reference(arch="llama", head_dim=16, ids=None, **kw):
    """Stock transformers: sdpa attention, the cache generate builds itself (DynamicCache)."""
    return greedy(model(arch, head_dim, attn="sdpa"), prompt() if ids is None else ids, **kw)


def forward(m, ids, cache):
    with torch.no_grad():
        return m(input_ids=ids, use_cache=True, **cache_kwarg(cache, m)).logits


def teacher_forced(m, cache, ids, tokens):
    """Logits [steps, vocab] of the prefill then of each token of ``tokens`` fed one by one."""
    out = [forward(m, ids, cache)[0, -1]]
    for t in tokens[:-1]:
        out.append(forward(m, t.view(1, 1), cache)[0, -1])
    return torch.stack(out)


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# --------------------------------------------------------------------------------- full method
@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_full_method_equals_dynamic_cache(arch, head_dim):
    ref = reference(arch, head_dim)
    m = model(arch, head_dim)
    cache = QuantizedKVCache(kvbench.get_method("full"), m)
    out = greedy(m, prompt(), cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == NEW
    assert max_diff(out.logits, ref.logits) <= 1e-5
    assert cache.get_seq_length() == PROMPT_LEN + NEW - 1


# --------------------------------------------------------------------------------- kivi generate
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_with_kivi_quantizes_per_spec_schedule(arch):
    m = model(arch)
    cache = QuantizedKVCache("kivi", m, method_config=KIVI2)
    out = greedy(m, prompt(), cache, new=12)
    assert out.sequences.shape == (1, PROMPT_LEN + 12)
    total = PROMPT_LEN + 12 - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == total
    # docs/methods.md#kivi with R = G = 4: keys quantize whole blocks of R (residual cycles 0..R-1), values
    # keep a sliding window of exactly R tokens; each step's flush ran before its attention
    # (write-then-attend, the default): between steps the counts equal in-chunk-full's
    for i in range(len(cache.layers)):
        assert cache.quantized_tokens(i) == (total - total % 4, total - 4)
    nb = cache.nbytes()
    assert nb["codes"] > 0 and nb["scales"] > 0


def test_flush_runs_when_attention_finishes():
    """protocol="in-chunk-full": the flush waits for the end of the step's attention."""
    m = model()
    ids = prompt(n=7)
    cache = QuantizedKVCache("kivi", m, method_config=KIVI2, protocol="in-chunk-full")
    forward(m, ids, cache)  # prefill 7: keys 4 quantized (7 - 7 mod 4), values 3 (7 - R)
    assert cache.quantized_tokens(0) == (4, 3)
    forward(m, prompt(n=1, seed=5), cache)  # 8 tokens: the flush ran after this step's attention
    assert cache.quantized_tokens(0) == (8, 4)
    # with stock sdpa attention the flush waits for the next append (and a warning says so)
    m2 = model(attn="sdpa")
    cache2 = QuantizedKVCache("kivi", m2, method_config=KIVI2, protocol="in-chunk-full")
    forward(m2, ids, cache2)
    with pytest.warns(UserWarning, match="attn_implementation='kvbench'"):
        forward(m2, prompt(n=1, seed=5), cache2)
    assert cache2.quantized_tokens(0) == (4, 3)  # 8 held, the step-8 flush still pending
    # write-then-attend (the default): update stores the step, its flush included, before any
    # attention function reads it
    cache3 = QuantizedKVCache("kivi", m2, method_config=KIVI2)
    assert cache3.protocol == "write-then-attend"
    forward(m2, ids, cache3)
    with pytest.warns(UserWarning, match="attn_implementation='kvbench'"):
        forward(m2, prompt(n=1, seed=5), cache3)
    assert cache3.quantized_tokens(0) == (8, 4)


# --------------------------------------------------------------------------------- prefill
def test_prefill_attention_uses_full_precision_kivi_2bit():
    ids, nxt = prompt(n=8), prompt(n=1, seed=9)  # 8 % R == 0: every prompt key quantized
    ref_model = model(attn="sdpa")
    ref_cache = DynamicCache(config=ref_model.config)
    ref0, ref1 = forward(ref_model, ids, ref_cache), forward(ref_model, nxt, ref_cache)
    m = model()
    cache = QuantizedKVCache("kivi", m, method_config=KIVI2)
    got0 = forward(m, ids, cache)
    assert cache.quantized_tokens(0) == (
        8,
        4,
    )  # docs/methods.md#kivi: keys 8 - 8 mod 4, values 8 - R
    assert torch.equal(ref0, got0)
    # the next step reads the 2-bit past, so it must differ from the full-precision one
    assert (forward(m, nxt, cache) - ref1).abs().max() > 1e-4


# --------------------------------------------------------------------------------- untested path seq_len > residual_length; 8-bit cache must track full precision: huggingface/transformers PR#39106, docs/methods.md#sequences-longer-than-the-residual-untested
@pytest.mark.parametrize("arch,head_dim", [("llama", 16), ("qwen3", 128)])
def test_8bit_per_channel_tracks_full_precision(arch, head_dim):
    """untested path seq_len > residual_length; 8-bit cache must track full precision: huggingface/transformers PR#39106, docs/methods.md#sequences-longer-than-the-residual-untested (model level): per-step logits within 1e-2 x max |logit|, same greedy
    tokens wherever the reference top-2 margin exceeds twice that bound."""
    ref = reference(arch, head_dim)
    ref_logits = torch.stack([x[0] for x in ref.logits])
    tokens = ref.sequences[0, PROMPT_LEN:]
    m = model(arch, head_dim)
    method = kvbench.get_method("per-channel", **PC8)
    cache = QuantizedKVCache(method, m)
    got = teacher_forced(m, cache, prompt(), tokens)
    assert cache.quantized_tokens(0)[0] > 0
    bound = 1e-2 * ref_logits.abs().amax(-1)
    diff = (got - ref_logits).abs().amax(-1)
    assert (diff <= bound).all(), (diff / ref_logits.abs().amax(-1)).max()
    assert diff.max() > 0  # 8-bit codes really are read back (not a full-precision copy)
    out = greedy(m, prompt(), QuantizedKVCache(method, m))
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    for t in range(NEW):
        if out.sequences[0, PROMPT_LEN + t] != tokens[t]:
            assert margin[t] <= 2 * bound[t], f"step {t}: clear margin but different token"
            break


# --------------------------------------------------------------------------------- cache ops
def test_crop_full_matches_dynamic_cache_and_kivi_runs():
    ids, tokens, nxt = prompt(), prompt(n=6, seed=3), prompt(n=1, seed=4)

    def run(m, c):
        forward(m, ids, c)
        for t in tokens[0]:
            forward(m, t.view(1, 1), c)
        c.crop(0)  # transformers: remove 0 tokens
        assert c.get_seq_length() == PROMPT_LEN + 6
        c.crop(-3)
        assert c.get_seq_length() == PROMPT_LEN + 3
        return forward(m, nxt, c)

    ref_model = model(attn="sdpa")
    ref = run(ref_model, DynamicCache(config=ref_model.config))
    m = model()
    assert max_diff(run(m, QuantizedKVCache("full", m)), ref) <= 1e-5

    kc = QuantizedKVCache("kivi", m, method_config=KIVI2)
    greedy(m, ids, kc, new=10)
    n = kc.get_seq_length()
    kc.crop(-3)
    assert kc.get_seq_length() == n - 3
    k, v = kc.layer_caches()[0].keys_values()
    assert k.shape == v.shape == (1, 2, n - 3, 16)
    assert forward(m, nxt, kc).shape == (1, 1, 128)
    assert kc.get_seq_length() == n - 2


def fake_q8_0(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """llama.cpp q8_0 quantize-dequantize of ``x`` [..., D], written out independently of
    kvbench: per block of ``block`` channels ``d = absmax / 127`` stored in float16 rounded up
    (so no code leaves [-127, 127]), ``q = round(x / d)`` half-to-even, ``x^ = q d``."""
    xb = x.float().unflatten(-1, (-1, block))
    d = xb.abs().amax(-1, keepdim=True) / 127
    d16 = d.to(torch.float16)
    d16 = torch.where(d16.float() < d, torch.nextafter(d16, torch.tensor(torch.inf).half()), d16)
    q = torch.where(d16 > 0, torch.round(xb / d16.float().clamp_min(1e-30)), torch.zeros_like(xb))
    return (q.clamp(-127, 127) * d16.float()).flatten(-2).to(x.dtype)


class FakeQ8Cache(DynamicCache):
    """Stock DynamicCache that stores every written K/V token q8_0 quantize-dequantized (what a
    llama.cpp ``-ctk q8_0 -ctv q8_0`` cache holds), in transformers' own cache and beam logic,
    under kvbench's protocols (docs/design.md#protocols): prefill attends the original prompt
    K/V; a decode step attends what is stored, its own new token quantized
    (``write-then-attend``), or its own new token before that token is quantized
    (``in-chunk-full``: it is flushed after the step's attention)."""

    protocol = "write-then-attend"

    def update(self, key_states, value_states, layer_idx, *args, **kw):
        k, v = super().update(
            fake_q8_0(key_states), fake_q8_0(value_states), layer_idx, *args, **kw
        )
        n = key_states.shape[2]
        if k.shape[2] == n:  # prefill
            return key_states, value_states
        if self.protocol == "write-then-attend":
            return k, v
        return torch.cat([k[:, :, :-n], key_states], 2), torch.cat([v[:, :, :-n], value_states], 2)


def beams(m, cache, **kw):
    return greedy(
        m, prompt(), cache, num_beams=2, num_return_sequences=2, output_scores=True,
        length_penalty=0.0, **kw,
    )  # fmt: skip


def test_beam_search():
    ref = reference(num_beams=2)
    m = model()
    out = greedy(m, prompt(), QuantizedKVCache("full", m), num_beams=2)
    assert torch.equal(out.sequences, ref.sequences)  # reorder_cache keeps beams exact


@pytest.mark.parametrize("protocol", ["write-then-attend", "in-chunk-full"])
def test_beam_search_int8_block_equals_fake_q8_0_dynamic_cache(protocol):
    """Beams and their scores through kvbench's int8-block cache (block 16 = the model's
    head_dim) equal those of a stock DynamicCache holding q8_0-rounded K/V (independent
    quantizer above) under each protocol: the quantized store, the order of storing and
    attending, and the beam reordering are right."""
    m = model()
    cfg = dict(block_size=16)
    got = beams(m, QuantizedKVCache("int8-block", m, method_config=cfg, protocol=protocol))
    fake = FakeQ8Cache(config=m.config)
    fake.protocol = protocol
    ref = beams(m, fake)
    assert torch.equal(got.sequences, ref.sequences)
    assert torch.allclose(got.sequences_scores, ref.sequences_scores, atol=1e-6, rtol=0)
    plain = beams(m, None)  # the quantization is visible: scores differ from full precision
    assert (plain.sequences_scores - ref.sequences_scores).abs().min() > 1e-3


def test_beam_search_kivi_scores_equal_teacher_forced_rescoring():
    """KIVI's statistics are per sequence, so each returned beam, rescored alone through a
    fresh KIVI cache with its tokens fed one by one (the same prefill/decode schedule), must
    give the beam's score (sum of log-probabilities, length_penalty 0): a reorder that mixed
    the beams' quantized blocks or residuals would not."""
    m = model()
    out = beams(m, QuantizedKVCache("kivi", m, method_config=KIVI2))
    assert out.sequences.shape == (2, PROMPT_LEN + NEW)
    for b in range(2):
        toks = out.sequences[b, PROMPT_LEN:]
        cache = QuantizedKVCache("kivi", m, method_config=KIVI2)
        logits = teacher_forced(m, cache, out.sequences[b : b + 1, :PROMPT_LEN], toks)
        logp = torch.log_softmax(logits.double(), -1).gather(1, toks[:, None]).sum()
        assert logp.item() == pytest.approx(out.sequences_scores[b].item(), abs=1e-4)


def test_batch_of_two_equal_length_prompts():
    ids = prompt(batch=2)
    ref = reference(ids=ids)
    m = model()
    out = greedy(m, ids, QuantizedKVCache("full", m))
    assert torch.equal(out.sequences, ref.sequences)
    assert max_diff(out.logits, ref.logits) <= 1e-5
    # quantization statistics are per sequence: each row matches its own single-row run
    method = kvbench.get_method("per-channel", **PC8)
    both = greedy(m, ids, QuantizedKVCache(method, m), new=8)
    for b in range(2):
        one = greedy(m, ids[b : b + 1], QuantizedKVCache(method, m), new=8)
        assert torch.equal(both.sequences[b], one.sequences[0])
        assert (
            max((x[b] - y[0]).abs().max().item() for x, y in zip(both.logits, one.logits)) <= 1e-4
        )


def test_left_padding_with_a_stock_cache_is_plain_sdpa():
    """Padded batches through kvbench caches: tests/test_padded_batch.py.  Without a kvbench
    cache the kvbench attention function is transformers' sdpa, mask included."""
    m = model()
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of the first row
    out = m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    ref = model(attn="sdpa").generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref)


def test_reset_gives_a_fresh_cache():
    m = model()
    cache = QuantizedKVCache("kivi", m, method_config=KIVI2)
    first = greedy(m, prompt(), cache, new=6)
    cache.reset()
    assert cache.get_seq_length() == 0
    again = greedy(m, prompt(), cache, new=6)
    assert torch.equal(first.sequences, again.sequences)
    assert max_diff(first.logits, again.logits) == 0


def test_attend_path_agrees_with_sdpa_path():
    m = model()
    a = greedy(m, prompt(), QuantizedKVCache("kivi", m, method_config=KIVI2))
    b = greedy(m, prompt(), QuantizedKVCache("kivi", m, method_config=KIVI2, attend=True))
    assert torch.equal(a.sequences, b.sequences)
    assert max_diff(a.logits, b.logits) <= 1e-5
    m2 = model(attn="sdpa")
    c = QuantizedKVCache("kivi", m2, method_config=KIVI2, attend=True)
    forward(m2, prompt(), c)
    with pytest.raises(ValueError, match="attend path needs attn_implementation"):
        forward(m2, prompt(n=1), c)


def test_cache_kwarg_names_the_installed_keyword():
    m = model()
    cache = QuantizedKVCache("full", m)
    kw = cache_kwarg(cache, m)
    (name,) = kw
    assert name in inspect.signature(m.forward).parameters
    assert name == (
        "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
    )
    assert cache_kwarg(cache) == kw  # the default probe (LlamaForCausalLM) agrees
    forward(m, prompt(), cache)
    assert cache.get_seq_length() == PROMPT_LEN


# --------------------------------------------------------------------------------- queries
class _RecordingCodec(PerChannelCodec):
    def prepare(self, keys, queries):
        self.seen = (keys.clone(), None if queries is None else queries.clone())


class _NeedsQueries(KIVI):
    """Test-only method: KIVI keys whose codec records what ``prepare`` receives."""

    capabilities = Capabilities(needs_queries=True)

    def key_codec(self, layer_idx, head_dim):
        c = self.config
        return _RecordingCodec(c.bits, c.torch_scale_dtype, group_size=c.group_size)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_needs_queries_method_receives_post_rope_queries(arch):
    m = model(arch)
    ids = prompt()
    cap = capture_qkv(m, ids)
    cache = QuantizedKVCache(_NeedsQueries(**KIVI2), m)
    forward(m, ids, cache)
    for i, lc in enumerate(cache.layer_caches()):
        keys, queries = lc.k.codec.seen
        assert queries.shape == (1, 4, PROMPT_LEN, 16)
        assert torch.equal(queries, cap.queries[i])
        assert torch.equal(keys, cap.keys[i])
    assert cache.quantized_tokens(0) == (4, 3)  # the prefill finished once queries arrived
    forward(m, prompt(n=1), cache)
    assert cache.get_seq_length() == PROMPT_LEN + 1
    # without kvbench's attention function no queries arrive: a clear error, not silence;
    # a cache bound to the model refuses the prefill, one bound to its config the decode step
    m2 = model(arch, attn="sdpa")
    with pytest.raises(ValueError, match="attn_implementation='kvbench'"):
        forward(m2, ids, QuantizedKVCache(_NeedsQueries(**KIVI2), m2))
    c2 = QuantizedKVCache(_NeedsQueries(**KIVI2), m2.config)
    forward(m2, ids, c2)
    with pytest.raises(ValueError, match="needs post-RoPE queries"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forward(m2, prompt(n=1), c2)


# --------------------------------------------------------------------------------- caller's config mutated between calls: huggingface/transformers PR#48700, docs/methods.md#callers-config-mutated-between-calls
def test_callers_method_and_config_are_not_mutated():
    cfg = dict(KIVI2)
    snapshot = copy.deepcopy(cfg)
    m2, m3 = model(layers=2), model(layers=3)
    model_cfg = m2.config.to_dict()
    c2 = QuantizedKVCache("kivi", m2, method_config=cfg)
    greedy(m2, prompt(), c2, new=5)
    c3 = QuantizedKVCache("kivi", m3, method_config=cfg)
    greedy(m3, prompt(), c3, new=5)
    assert cfg == snapshot
    assert len(c2.layers) == 2 and len(c3.layers) == 3
    assert all(lc is not None for lc in c3.layer_caches())
    assert m2.config.to_dict() == model_cfg
    method = kvbench.get_method("kivi", **KIVI2)
    before = method.config.to_dict()
    for mm in (m2, m3):
        greedy(mm, prompt(), QuantizedKVCache(method, mm), new=5)
    assert method.config.to_dict() == before == {**before, **snapshot}


# --------------------------------------------------------------------------------- capture
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_capture_matches_dynamic_cache(arch):
    m = model(arch, attn="sdpa")
    ids = prompt(batch=2)
    cache = DynamicCache(config=m.config)
    forward(m, ids, cache)
    cap = capture_qkv(m, ids)
    assert m.config._attn_implementation == "sdpa"  # switched back
    assert len(cap) == 2 and cap.layer_ids == [0, 1]
    for i in range(2):
        assert cap.queries[i].shape == (2, 4, PROMPT_LEN, 16)
        assert cap.queries[i].dtype == torch.float32 and cap.queries[i].device.type == "cpu"
        assert torch.equal(cap.keys[i], cache.layers[i].keys)
        assert torch.equal(cap.values[i], cache.layers[i].values)
        assert cap.scaling[i] == pytest.approx(16**-0.5)
    only = capture_qkv(m, ids, layers=[1])
    assert only.layer_ids == [1] and torch.equal(only.keys[0], cap.keys[1])


# --------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    m = model()
    with pytest.raises(ValueError, match="unknown method"):
        QuantizedKVCache("kiwi", m)
    with pytest.raises(ValueError, match="unknown config field"):
        QuantizedKVCache("kivi", m, method_config={"bitz": 2})
    with pytest.raises(ValueError, match="only used with a method name"):
        QuantizedKVCache(kvbench.get_method("full"), m, method_config={"bits": 2})
    with pytest.raises(ValueError, match="must be a kvbench Method"):
        QuantizedKVCache(object(), m)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        QuantizedKVCache("full", object())
    odd = types.SimpleNamespace(num_hidden_layers=2, layer_types=["linear_attention"] * 2)
    with pytest.raises(ValueError, match="linear_attention"):
        QuantizedKVCache("full", odd)
    with pytest.raises(ValueError, match="sliding"):
        QuantizedKVCache("kivi", model("mistral"), method_config=KIVI2, attend=True)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        capture_qkv(m, prompt()[0])


# --------------------------------------------------------------------------------- chunks, dtype
def test_chunked_feeding_matches_dynamic_cache():
    """Perplexity protocol (docs/design.md#protocols): prefill P, then chunks of C > 1 tokens attending to
    the cached past plus causally within the chunk; the mask must align to the end."""
    ids = prompt(n=19, seed=7)
    chunks = ((0, 7), (7, 12), (12, 19))  # P = 7, C = 5, 7
    ref_model = model(attn="sdpa")
    ref_cache = DynamicCache(config=ref_model.config)
    ref = [forward(ref_model, ids[:, lo:hi], ref_cache) for lo, hi in chunks]
    m = model()
    cache = QuantizedKVCache("full", m)
    kc = QuantizedKVCache("kivi", m, method_config=KIVI2)
    for (lo, hi), r in zip(chunks, ref):
        assert (forward(m, ids[:, lo:hi], cache) - r).abs().max() <= 1e-5
        assert forward(m, ids[:, lo:hi], kc).shape == r.shape
    assert cache.get_seq_length() == kc.get_seq_length() == 19
    assert kc.quantized_tokens(0) == (16, 15)  # docs/methods.md#kivi after 19 tokens, R = G = 4


def test_bfloat16_model():
    m = copy.deepcopy(model()).to(torch.bfloat16)
    use_kvbench_attention(m)
    cache = QuantizedKVCache("kivi", m, method_config=KIVI2)
    out = greedy(m, prompt(), cache, new=6)
    assert out.sequences.shape == (1, PROMPT_LEN + 6)
    k, v = cache.layer_caches()[1].keys_values()
    assert k.dtype == v.dtype == torch.bfloat16
    assert cache.quantized_tokens(1) == (12, 8)
