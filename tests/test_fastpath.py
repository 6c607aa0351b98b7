"""Tests of ``kvbench.kernels.cpu.codedomain``: code-domain attention over a ``LayerCache``.

Right values: attention computed here in float64 numpy-style torch over the cache's own
``keys_values(float64)`` (dequantized blocks, sinks, residual; GQA by ``repeat_interleave``,
causal mask aligned to the end), independently of ``kvbench.attention.reference``; GQA with num_kv_heads < num_heads: jy-yuan/KIVI#41 and #33, docs/methods.md#gqa-with-fewer-kv-heads-than-query-heads
(GQA, query head h reads KV head h // n_rep); at model level, the reference path
(``attend=False``: sdpa over the dequantized cache) of the same tiny random Llama.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvbench
from kvbench.cache.blocks import PerChannelCodec, PerHeadCodec, PerTokenCodec
from kvbench.cache.finite import nonfinite
from kvbench.cache.layer import LayerCache
from kvbench.cache.schedule import BlockSchedule, SlidingSchedule
from kvbench.hf.attention import use_kvbench_attention
from kvbench.hf.cache import QuantizedKVCache, cache_kwarg
from kvbench.kernels.cpu import codedomain as fastpath


@pytest.fixture(autouse=True)
def _without_native(monkeypatch):
    """These tests are about the eager kernels and the mode rules; the native C kernels, which
    ``auto`` mode prefers where built, are tested in tests/attention/test_native.py and
    tests/attention/test_attend_backends.py."""
    from kvbench.kernels.cpu import native

    monkeypatch.setattr(native, "available", lambda: False)


def ref64(lc: LayerCache, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """Float64 attention of ``query [B, H_q, n_q, D]`` over ``lc.keys_values(float64)``."""
    k, v = lc.keys_values(torch.float64)
    b, hq, nq, d = query.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = 1 / math.sqrt(d) if scaling is None else scaling
    lg = query.double() @ k.transpose(-1, -2) * s
    t = k.shape[2]
    pos = torch.arange(t - nq, t).unsqueeze(1)
    lg = lg.masked_fill(torch.arange(t).unsqueeze(0) > pos, float("-inf"))
    return torch.softmax(lg, -1) @ v


def close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """``|out - ref| <= rel * max|ref|`` elementwise (float32 rounding of a float64 result)."""
    err = (out.double() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err} vs scale {ref.abs().max()}"


def kivi_layer(bits=2, vbits=2, G=8, R=16, ns=0, vg=None, hkv=2, D=16, scale="float16"):
    m = kvbench.get_method(
        "kivi",
        bits=bits,
        value_bits=vbits,
        group_size=G,
        residual_length=R,
        num_sink_tokens=ns,
        value_group_size=vg,
        scale_dtype=scale,
    )
    return m.new_layer(0, hkv, D)


def fill(lc: LayerCache, B: int, hkv: int, prompt: int, steps: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, hkv, prompt + steps, D, generator=g) * 2 + 0.5
    v = torch.randn(B, hkv, prompt + steps, D, generator=g)
    lc.prefill(k[:, :, :prompt], v[:, :, :prompt])
    for t in range(prompt, prompt + steps):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lc.end_step()
    return lc


def query(B, hq, nq, D, seed=1):
    return torch.randn(B, hq, nq, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("vg", [None, 1, 2, 4, 16])
def test_bits_and_value_groups(bits, vg):
    # 101 tokens: pages of 8 with keys 96 quantized + 5 residual, values 85 + 16, 3 sinks
    lc = fill(kivi_layer(bits, bits, ns=3, vg=vg), 2, 2, 90, 11, 16)
    assert lc.quantized_tokens() == (96, 82)
    q = query(2, 6, 1, 16)
    ref = ref64(lc, q)
    close(fastpath.code_domain_attend(lc, q), ref)


@pytest.mark.parametrize(
    "hkv,rep,D,G,R,prompt,steps,ns,B",
    [
        (3, 3, 64, 128, 128, 300, 4, 0, 1),  # default model's geometry, GQA 9/3
        (1, 1, 8, 4, 4, 7, 9, 1, 3),  # MHA, residual cycling
        (2, 4, 24, 6, 12, 40, 30, 2, 2),  # D = 24: 3-bit words of 8 codes, cg 6
        (4, 2, 32, 16, 16, 16, 1, 0, 1),  # a single page, residual 1
        (2, 5, 16, 4, 8, 8, 0, 4, 1),  # everything in sinks + one page
        (1, 2, 12, 4, 4, 10, 3, 0, 1),  # D = 12: no whole 3-bit words (eager), cg 3
    ],
)
@pytest.mark.parametrize("bits", [2, 3])
def test_shapes(hkv, rep, D, G, R, prompt, steps, ns, B, bits):
    vg = D // 4 if D % 4 == 0 else None
    lc = fill(kivi_layer(bits, bits, G, R, ns, vg, hkv, D), B, hkv, prompt, steps, D)
    q = query(B, hkv * rep, 1, D)
    ref = ref64(lc, q, scaling=0.3)
    close(fastpath.code_domain_attend(lc, q, 0.3), ref)


def test_chunk_of_queries_is_causal():
    lc = kivi_layer(2, 2, G=4, R=8, ns=1)
    fill(lc, 1, 2, 21, 0, 16)
    g = torch.Generator().manual_seed(5)
    lc.append(torch.randn(1, 2, 6, 16, generator=g), torch.randn(1, 2, 6, 16, generator=g))
    q = query(1, 4, 6, 16)  # the 6 new positions, before the deferred flush
    ref = ref64(lc, q)
    close(fastpath.code_domain_attend(lc, q), ref)


def test_values_full_precision_and_fp32_scales():
    lc = fill(kivi_layer(2, 16, G=4, R=8, scale="float32"), 1, 2, 30, 5, 16)
    assert lc.v.block is None
    q = query(1, 2, 1, 16)
    close(fastpath.code_domain_attend(lc, q), ref64(lc, q))


def test_cropped_partial_page_and_batch_ops():
    lc = fill(kivi_layer(4, 4, G=8, R=8), 2, 2, 64, 0, 16)
    lc.crop(45)  # key block: 45 tokens, the last page cut to 5
    assert lc.k.block.group_len[-1] == 5
    lc.index_batch(torch.tensor([1, 0, 1]))
    q = query(3, 4, 1, 16)
    ref = ref64(lc, q)
    close(fastpath.code_domain_attend(lc, q), ref)


@pytest.mark.parametrize("kind", ["symmetric", "midpoint", "per-head"])
def test_other_affine_layouts(kind):
    if kind == "symmetric":
        kc = PerChannelCodec(3, symmetric=True, group_size=4)
        vc = PerTokenCodec(4, symmetric=True, channel_group=8)
    elif kind == "midpoint":
        kc = PerChannelCodec(1, midpoint=True, group_size=4)
        vc = PerTokenCodec(1, midpoint=True, channel_group=4)
    else:  # one page of the whole prompt
        kc, vc = PerHeadCodec(2), PerTokenCodec(2, channel_group=16)
    sk = BlockSchedule(4) if kind != "per-head" else SlidingSchedule(2)
    lc = LayerCache(kc, vc, sk, SlidingSchedule(4), num_kv_heads=2, head_dim=16)
    lc.prefill(
        *[torch.randn(1, 2, 18, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    )
    q = query(1, 4, 1, 16)
    ref = ref64(lc, q)
    close(fastpath.code_domain_attend(lc, q), ref)


def test_kvq08_gqa_head_mapping():
    # GQA with num_kv_heads < num_heads: jy-yuan/KIVI#41 and #33, docs/methods.md#gqa-with-fewer-kv-heads-than-query-heads: Q [1,8,1,16], K/V [1,2,40,16], G 32, value groups 16, 2 bits, R 32
    lc = kivi_layer(2, 2, G=32, R=32, vg=16, hkv=2, D=16)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    q = torch.randn(1, 8, 1, 16, generator=g)
    lc.prefill(k, v)
    assert lc.quantized_tokens() == (32, 8)
    out = lc.attend(q)
    assert out.shape == (1, 8, 1, 16) and lc.attend_path == fastpath.EAGER_PATH
    close(out, ref64(lc, q))
    kk, vv = lc.keys_values(torch.float64)
    tiled = torch.softmax(q.double() @ kk.repeat(1, 4, 1, 1).transpose(-1, -2) / 4, -1)
    assert (out.double() - tiled @ vv.repeat(1, 4, 1, 1)).abs().max() > 1e-3  # h % 2 differs


def test_attend_dispatch_and_paths(monkeypatch):
    lc = fill(kivi_layer(2, 2, G=4, R=8), 1, 2, 20, 3, 16)
    q = query(1, 4, 1, 16)
    held = [(s, c, t.data_ptr(), t.shape) for s, c, t in lc.tensors()]
    nbytes = lc.nbytes()
    out = lc.attend(q)
    assert lc.attend_path == fastpath.EAGER_PATH
    assert [(s, c, t.data_ptr(), t.shape) for s, c, t in lc.tensors()] == held
    assert lc.nbytes() == nbytes  # attention stores nothing
    with fastpath.cpu_attention_mode("reference"):
        ref = lc.attend(q)
    assert lc.attend_path == fastpath.REFERENCE_PATH
    close(out, ref64(lc, q))
    close(ref, ref64(lc, q))
    monkeypatch.setenv(fastpath.ENV_MODE, "reference")
    lc.attend(q)
    assert lc.attend_path_reason == f"{fastpath.ENV_MODE}=reference"


def test_unsupported_layouts_take_the_reference_path():
    class Rotated(LayerCache):  # a subclass that changes what is read, and says so
        reads_transformed = "keys negated on read"

        def keys_values(self, dtype=None):
            k, v = super().keys_values(dtype)
            return -k, v

    rc = Rotated(PerChannelCodec(2, group_size=4), None, BlockSchedule(4), num_kv_heads=2)
    fill(rc, 1, 2, 12, 0, 16)
    q = query(1, 2, 1, 16)
    close(rc.attend(q), ref64(rc, q))
    assert rc.attend_path == "reference" and rc.attend_path_reason == "keys negated on read"
    # per-token keys (groups of one token): code domain
    tk = LayerCache(PerTokenCodec(2, channel_group=8), None, SlidingSchedule(2))
    fill(tk, 1, 2, 9, 0, 16)
    close(tk.attend(q), ref64(tk, q))
    assert tk.attend_path == fastpath.EAGER_PATH
    # 16-bit codes (int16): eager code domain
    k16 = LayerCache(PerTokenCodec(16, channel_group=8), None, SlidingSchedule(2))
    fill(k16, 1, 2, 9, 0, 16)
    close(k16.attend(q), ref64(k16, q))
    assert k16.attend_path == fastpath.EAGER_PATH
    # shapes that do not fit: code_domain_attend says why
    with pytest.raises(ValueError, match="query heads"):
        fastpath.code_domain_attend(k16, query(1, 3, 1, 16))


def test_nan_group_propagates_like_the_reference():
    lc = kivi_layer(2, 2, G=4, R=4)
    k = torch.randn(1, 2, 12, 16)
    k[0, 0, 1, 3] = float("nan")
    with nonfinite("propagate"):  # the opt-out of kvbench.cache.finite
        lc.prefill(k, torch.randn(1, 2, 12, 16))
    q = query(1, 2, 1, 16)
    out = fastpath.code_domain_attend(lc, q)
    assert torch.isnan(out[0, 0]).all() and not torch.isnan(out[0, 1]).any()


def test_bad_modes(monkeypatch):
    with pytest.raises(ValueError, match="mode='fast'.*allowed"):
        with fastpath.cpu_attention_mode("fast"):
            pass
    monkeypatch.setenv(fastpath.ENV_MODE, "turbo")
    with pytest.raises(ValueError, match="KVBENCH_CPU_ATTENTION='turbo'"):
        fastpath.cpu_mode()


def test_code_layout():
    from kvbench.kernels.cpu.native import code_layout

    assert [code_layout(b) for b in range(1, 9)] == [
        (1, 8), (1, 4), (3, 8), (1, 2), (5, 8), (3, 4), (7, 8), (1, 1),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- model level
def tiny_llama():
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        intermediate_size=128,
    )
    torch.manual_seed(0)
    return use_kvbench_attention(LlamaForCausalLM(cfg).eval())


def greedy(model, attend: bool, n: int = 40):
    cfg = dict(bits=2, value_bits=2, group_size=4, residual_length=8, num_sink_tokens=1)
    cache = QuantizedKVCache("kivi", model, method_config=cfg, attend=attend)
    ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(3))
    toks, logits = [], []
    with torch.no_grad():
        for _ in range(n):
            out = model(input_ids=ids, **cache_kwarg(cache, model))
            logits.append(out.logits[0, -1])
            ids = out.logits[:, -1:].argmax(-1)
            toks.append(int(ids))
    return toks, torch.stack(logits), cache


def test_model_greedy_tokens_match_reference_path():
    model = tiny_llama()
    ref_toks, ref_logits, _ = greedy(model, attend=False)
    toks, logits, cache = greedy(model, attend=True)
    assert cache.layer_caches()[0].attend_path == fastpath.EAGER_PATH
    # 11 + 39 tokens, 1 sink: keys floor(49 / 8) * 8 = 48 (docs/methods.md#flush-schedules), values 49 - 8 = 41
    assert cache.quantized_tokens() == (48, 41)
    assert toks == ref_toks
    err = (logits - ref_logits).abs().max().item()
    assert err <= 1e-4 * ref_logits.abs().max().item()
