"""Known fault cases of the core (quantizer, codecs, LayerCache), one test per case.

Each test names its row.  Right values are the rows' own numbers, values worked by hand in the
comments, or the float64 references of conftest.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbench
from kvbench.attention.reference import repeat_kv
from kvbench.cache.finite import nonfinite
from kvbench.cache.quant import dequantize_groups, quantize_groups

F32 = torch.float32


def rand(*shape, seed=0, dtype=F32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def kvq01_input(t0: int = 0, t1: int = 10) -> torch.Tensor:
    """``K[t, c] = t + c*c/10``: token rows ``[t, t+0.1, t+0.4, t+0.9]``, shape [1, 1, n, 4]."""
    t = torch.arange(t0, t1, dtype=torch.float64).view(1, 1, -1, 1)
    c = torch.arange(4, dtype=torch.float64).view(1, 1, 1, 4)
    return (t + c * c / 10).float()


# ------------------------------------------------------------------ residual (full-precision) window semantics; residual longer than the sequence: huggingface/transformers#34189, docs/methods.md#residual-window-semantics residual window


def test_kvq01_per_token_window() -> None:
    # 2 bits, group 4 along head_dim, R = 4.  By hand for a row [t, t+.1, t+.4, t+.9]: min t,
    # scale 0.9/3 = 0.3, (x - min)/s = [0, 1/3, 4/3, 3] -> codes [0, 0, 1, 3],
    # x^ = [t, t, t+0.3, t+0.9], error [0, 0.1, 0.1, 0] <= scale/2 = 0.15
    m = kvbench.get_method(
        "per-token",
        bits=2,
        value_bits=2,
        value_group_size=4,
        residual_length=4,
        scale_dtype="float32",
    )
    layer = m.new_layer(0, 1, 4)
    x = kvq01_input(0, 13)
    layer.prefill(x[:, :, :10], x[:, :, :10])
    assert layer.seq_length == 10 and layer.quantized_tokens() == (6, 6)
    for t in (10, 11, 12):
        layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        layer.end_step()
        n = t + 1
        assert layer.seq_length == n
        assert layer.quantized_tokens() == (n - 4, n - 4)
        for side, kv in zip((layer.k, layer.v), layer.keys_values()):
            assert torch.equal(kv[:, :, n - 4 :], x[:, :, n - 4 : n])  # newest R bit-exact
            q = kv[:, :, : n - 4].double()
            tt = torch.arange(n - 4, dtype=torch.float64).view(1, 1, -1, 1)
            want = tt + torch.tensor([0, 0, 0.3, 0.9], dtype=torch.float64)
            assert torch.allclose(q, want, atol=1e-6)
            assert (q - x[:, :, : n - 4].double()).abs().max() <= 0.15
            codes = side.block.unpacked_codes()
            assert codes.reshape(-1, 4).tolist() == [[0, 0, 1, 3]] * (n - 4)


def test_kvq01_variant_a_window_longer_than_sequence() -> None:
    m = kvbench.get_method(
        "per-token", bits=2, value_bits=2, value_group_size=4, residual_length=16
    )
    layer = m.new_layer(0, 1, 4)
    x = kvq01_input()
    layer.prefill(x, x)
    assert layer.quantized_tokens() == (0, 0) and layer.seq_length == 10
    k, v = layer.keys_values()
    assert torch.equal(k, x) and torch.equal(v, x)
    assert layer.nbytes()["codes"] == 0


def test_kvq01_kivi_keys_follow_their_own_schedule() -> None:
    # docs/methods.md#kivi: key residual holds T mod R after prefill, then cycles 0..R-1; values slide
    m = kvbench.get_method(
        "kivi",
        bits=2,
        group_size=4,
        residual_length=4,
        value_bits=2,
        value_group_size=4,
        scale_dtype="float32",
    )
    layer = m.new_layer(0, 1, 4)
    x = kvq01_input(0, 13)
    layer.prefill(x[:, :, :10], x[:, :, :10])
    assert layer.quantized_tokens() == (8, 6)
    states = []
    for t in (10, 11, 12):
        layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        layer.end_step()
        states.append((layer.seq_length, *layer.quantized_tokens()))
    # key residual 3, then 4 -> flushed to 0, then 1; value residual always 4
    assert states == [(11, 8, 7), (12, 12, 8), (13, 12, 9)]
    # per-channel groups of 4 tokens: channel c of tokens t0..t0+3 is t0 + c^2/10 + [0,1,2,3]:
    # scale 1, codes [0, 1, 2, 3] in every channel
    codes = layer.k.block.unpacked_codes()[0, 0]
    assert codes.tolist() == [[i] * 4 for i in (0, 1, 2, 3)] * 3
    assert layer.k.block.group_len == [4, 4, 4]
    k, _ = layer.keys_values()
    assert torch.allclose(k, x, atol=1e-5)


def test_kvq01_variant_b_decode_only_groups_hold_g_tokens(ref) -> None:
    # Variant B: keys fed one token at a time into an empty cache; every per-channel group
    # handed to the quantizer holds exactly G = 4 tokens (a 1-token group has min == max and
    # silently stays exact)
    m = kvbench.get_method("kivi", bits=2, group_size=4, residual_length=4, scale_dtype="float32")
    layer = m.new_layer(0, 1, 4)
    seen: list[int] = []
    encode = layer.k.codec.encode
    layer.k.codec.encode = lambda x: (seen.append(x.shape[2]), encode(x))[1]
    x = rand(1, 1, 14, 4)
    for t in range(14):
        layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        layer.end_step()
    assert seen == [4, 4, 4]
    assert layer.quantized_tokens() == (12, 0) and layer.seq_length == 14
    assert layer.k.block.scale.shape == (1, 1, 3, 4)  # 3 groups x 4 channels
    k, _ = layer.keys_values()
    want = ref.per_channel(x[:, :, :12].double().numpy(), 2, 4)
    np.testing.assert_allclose(k[:, :, :12].numpy(), want["xhat"], atol=1e-6)
    assert (k[:, :, :12] != x[:, :, :12]).any()  # really quantized
    assert torch.equal(k[:, :, 12:], x[:, :, 12:])


# ------------------------------------------------------------------ crop and batch ops (repeat_interleave, select) on the quantized region: huggingface/transformers PR#45510, docs/methods.md#crop-and-batch-operations-on-the-quantized-region crop / batch ops


def kvq04_input() -> torch.Tensor:
    t = torch.arange(12, dtype=torch.float64).view(1, 1, 12, 1)
    c = torch.arange(16, dtype=torch.float64).view(1, 1, 1, 16)
    return torch.sin(t + c).float()


CASES_04 = {
    # name: (method, config, tokens prefilled, key groups, value groups); 4 bits, R = 4
    "per-token": ("per-token", dict(value_group_size=16), 12, "token", "token"),
    "kivi": ("kivi", dict(group_size=4, value_group_size=16), 10, "channel", "token"),
    "uniform": ("uniform", {}, 10, "flush", "flush"),  # one scale shared by the batch
    "per-head": ("per-head", {}, 10, "flush", "flush"),
}


def _layer04(name):
    method, cfg, n, *_ = CASES_04[name]
    m = kvbench.get_method(
        method, bits=4, value_bits=4, residual_length=4, scale_dtype="float32", **cfg
    )
    layer = m.new_layer(0, 1, 16)
    x = kvq04_input()[:, :, :n]
    layer.prefill(x, x)
    return layer, x


def _scale04(kind: str, x: np.ndarray, ref) -> np.ndarray:
    """Per-element scale of the first 8 (quantized) tokens, computed independently."""
    if kind == "channel":  # per channel over groups of G = 4 tokens
        return ref.per_channel(x, 4, 4)["scale"]
    if kind == "token":  # per token over its 16 channels
        return ref.per_token(x, 4, 16)["scale"]
    return np.full(x.shape, (x.max() - x.min()) / 15)  # one group: the whole 8-token flush


@pytest.mark.parametrize("name", list(CASES_04))
def test_kvq04_crop(name, ref) -> None:
    layer, x = _layer04(name)
    before_k, before_v = layer.keys_values()
    assert layer.k.block is not None and layer.k.residual is not None  # both regions in play
    layer.crop(6)
    assert layer.seq_length == 6
    k, v = layer.keys_values()
    assert k.shape == v.shape == (1, 1, 6, 16)  # nothing later
    assert torch.equal(k, before_k[:, :, :6]) and torch.equal(v, before_v[:, :, :6])
    # within scale/2 of the originals, scales computed independently
    xv = x[:, :, :8].double().numpy()
    for kv, kind in ((k, CASES_04[name][3]), (v, CASES_04[name][4])):
        err = kv.double().numpy() - xv[:, :, :6]
        assert (np.abs(err) <= _scale04(kind, xv, ref)[:, :, :6] / 2 + 1e-6).all()
    # the cache keeps working after a crop
    layer.append(x[:, :, 6:7], x[:, :, 6:7])
    layer.end_step()
    assert layer.seq_length == 7
    assert torch.equal(layer.keys_values()[0][:, :, 6:], x[:, :, 6:7])


@pytest.mark.parametrize("name", list(CASES_04))
def test_kvq04_batch_repeat_and_select(name) -> None:
    layer, x = _layer04(name)
    k0, v0 = layer.keys_values()
    nb0 = layer.nbytes()
    layer.repeat_batch(3)
    assert layer.batch_size == 3
    shared = name == "uniform"  # per-tensor: one (scale, zero) for every row, stored once
    for _side, cat, t in layer.tensors():  # quantized part and residual alike
        assert t.shape[0] == (1 if shared and cat == "scales" else 3)
    nb3 = layer.nbytes()
    assert nb3["scales"] == (1 if shared else 3) * nb0["scales"]
    assert nb3["total"] - nb3["scales"] == 3 * (nb0["total"] - nb0["scales"])
    k3, v3 = layer.keys_values()
    assert k3.shape[0] == 3
    for b in range(3):
        assert torch.equal(k3[b : b + 1], k0) and torch.equal(v3[b : b + 1], v0)
    layer.index_batch(torch.tensor([2]))
    assert layer.batch_size == 1
    k1, v1 = layer.keys_values()
    assert torch.equal(k1, k0) and torch.equal(v1, v0)
    assert layer.nbytes() == nb0


@pytest.mark.parametrize("name", list(CASES_04))
def test_kvq04_decode_after_repeat_flushes(name) -> None:
    # after repeat_batch the cache keeps decoding a batch of 3 across flushes of both sides
    layer, _ = _layer04(name)
    layer.repeat_batch(3)
    new = rand(3, 1, 6, 16, seed=5)
    for t in range(6):
        layer.append(new[:, :, t : t + 1], new[:, :, t : t + 1])
        layer.end_step()
    k, v = layer.keys_values()
    assert k.shape == v.shape == (3, 1, layer.seq_length, 16)
    assert torch.allclose(k[:, :, -6:], new, atol=0.2)
    layer.index_batch(torch.tensor([1, 0]))  # reorder/select of distinct rows (beam search)
    k2, _ = layer.keys_values()
    assert torch.equal(k2[0], k[1]) and torch.equal(k2[1], k[0])


# ------------------------------------------------------------------ untested path seq_len > residual_length; 8-bit cache must track full precision: huggingface/transformers PR#39106, docs/methods.md#sequences-longer-than-the-residual-untested


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
def test_kvq07_past_the_residual_8bit(scale_dtype, ref) -> None:
    # 1 prefill token + 9 one-token updates, fp32 [1, 2, 1, 16], 8 bits, group 16, residual 2
    x = rand(1, 2, 10, 16, seed=0)
    m = kvbench.get_method(
        "per-token",
        bits=8,
        value_bits=8,
        value_group_size=16,
        residual_length=2,
        scale_dtype=scale_dtype,
    )
    layer = m.new_layer(0, 2, 16)
    layer.prefill(x[:, :, :1], x[:, :, :1])
    for t in range(1, 10):
        layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        layer.end_step()
    assert layer.seq_length == 10 and layer.quantized_tokens() == (8, 8)
    r = ref.per_token(x.double().numpy(), 8, 16)
    mn = x.double().amin(-1, keepdim=True).numpy()
    # error <= scale/2 (= range/510) per group, plus the storage rounding of scale and min in
    # scale_dtype (scale rounded up by < 2^-10 relative, min to nearest: 2^-11 relative)
    store = 0.0 if scale_dtype == "float32" else 1.0
    bound = r["scale"] / 2 * (1 + store * 2.0**-10) + store * 2.0**-11 * np.abs(mn) + 1e-6
    for kv in layer.keys_values():
        err = np.abs(kv.double().numpy() - x.double().numpy())
        assert (err[:, :, :8] <= bound[:, :, :8]).all()
        assert (err[:, :, :8] > 0).any()
        assert (err[:, :, 8:] == 0).all()  # the newest 2 are exact


# ------------------------------------------------------------------ GQA with num_kv_heads < num_heads: jy-yuan/KIVI#41 and #33, docs/methods.md#gqa-with-fewer-kv-heads-than-query-heads GQA


def test_kvq08_gqa_attention() -> None:
    q = rand(1, 8, 1, 16, seed=1)
    k, v = rand(1, 2, 40, 16, seed=2), rand(1, 2, 40, 16, seed=3)
    m = kvbench.get_method(
        "kivi", bits=2, group_size=32, residual_length=32, value_bits=2, value_group_size=16
    )
    layer = m.new_layer(0, 2, 16)
    layer.prefill(k, v)
    assert layer.quantized_tokens() == (32, 8)  # 40 mod 32 = 8 fp keys; 32 fp values
    kd, vd = (t.double() for t in layer.keys_values())
    out = layer.attend(q)
    assert out.shape == (1, 8, 1, 16)

    def sdpa(mapping):
        idx = torch.tensor(mapping)
        return torch.nn.functional.scaled_dot_product_attention(q.double(), kd[:, idx], vd[:, idx])

    want = sdpa([h // 4 for h in range(8)])  # repeat_interleave: head h reads KV head h // 4
    assert torch.allclose(out.double(), want, atol=1e-5)
    wrong = sdpa([h % 2 for h in range(8)])  # tile: must differ
    assert (out.double() - wrong).abs().max() > 1e-2
    assert torch.equal(repeat_kv(k, 4)[:, 5], k[:, 1])


# ------------------------------------------------------------------ memory not actually saved; average-bits / byte accounting: jy-yuan/KIVI#17; NVIDIA/kvpress PR#225, docs/methods.md#memory-not-actually-saved bytes stored


def test_kvq10_kivi_bytes_and_no_full_precision_copy(ref) -> None:
    m = kvbench.get_method("kivi", bits=2, group_size=32, residual_length=128, value_bits=2)
    layer = m.new_layer(0, 32, 128, dtype=torch.float16)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 32, 4096, 128, generator=gen).half()
    v = torch.randn(1, 32, 4096, 128, generator=gen).half()
    layer.prefill(k, v)
    del k, v
    assert layer.quantized_tokens() == (4096, 3968)
    nb = layer.nbytes()
    # by hand: keys 32*4096*128 codes at 2 bits; (scale, zero) fp16 per channel per 32 tokens;
    # values 3968 tokens quantized, (scale, zero) per 32 channels per token; 128 fp16 values
    assert nb["codes"] == 4_194_304 + 4_063_232
    assert nb["scales"] == 2_097_152 + 2_031_616
    assert nb["residual"] == 1_048_576
    assert nb["metadata"] == 0 and nb["sinks"] == 0
    assert nb["key_total"] == 4_194_304 + 2_097_152
    assert nb["total"] == 13_434_880
    held = layer.tensors()
    assert nb["total"] == sum(t.numel() * t.element_size() for _, _, t in held)
    effective = 8 * nb["total"] / (2 * 32 * 4096 * 128)
    assert effective == pytest.approx(3.203125)
    for side, cat, t in held:
        assert ref.own(t), (side, cat, t.shape)  # no larger allocation kept alive behind it
        if t.is_floating_point():
            assert cat in ("scales", "residual"), (side, cat)
            if cat == "residual":
                assert (side, tuple(t.shape)) == ("value", (1, 32, 128, 128))
            else:
                want = (1, 32, 128, 128) if side == "key" else (1, 32, 3968, 4)
                assert tuple(t.shape) == want and t.dtype == torch.float16
        else:
            assert cat == "codes" and t.dtype == torch.uint8


def test_views_of_the_prompt_are_not_kept_alive(ref) -> None:
    # the residual and sinks must not be views into the whole prompt: that keeps a
    # full-precision copy of the quantized tokens allocated while nbytes() says otherwise
    m = kvbench.get_method(
        "kivi",
        bits=2,
        group_size=4,
        residual_length=8,
        value_bits=2,
        value_group_size=4,
        num_sink_tokens=2,
    )
    layer = m.new_layer(0, 1, 4)
    x = rand(1, 1, 29, 4)
    layer.prefill(x.clone(), x.clone())
    for _side, _cat, t in layer.tensors():
        assert ref.own(t)
    layer.append(rand(1, 1, 3, 4), rand(1, 1, 3, 4))
    layer.end_step()
    layer.crop(20)
    for _side, _cat, t in layer.tensors():
        assert ref.own(t)


# ------------------------------------------------------------------ zero or near-zero range group: division by zero, NaN: ggml-org/llama.cpp PR#7313 (fixes #7311), docs/methods.md#zero-or-near-zero-range-groups zero range


def _no_nonfinite(g, xh):
    assert torch.isfinite(g.scale).all() and torch.isfinite(xh).all()
    if g.zero is not None:
        assert torch.isfinite(g.zero).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_kvq13_zero_and_tiny_ranges(bits, symmetric) -> None:
    def run(x):
        g = quantize_groups(x.view(1, -1), bits, symmetric=symmetric)  # fp16 scale (default)
        xh = dequantize_groups(g.codes, g.scale, g.zero, bits, symmetric=symmetric, dtype=x.dtype)
        _no_nonfinite(g, xh)
        assert g.codes.min() >= 0 and g.codes.max() <= 2**bits - 1
        return g, xh.view(-1)

    _, xh = run(torch.zeros(32))  # (a)
    assert (xh == 0).all()
    x = torch.full((32,), 1e-30)  # (b): error at most the value itself (float32 1e-30)
    _, xh = run(x)
    assert ((xh.double() - x.double()).abs() <= x.double()).all()
    x = torch.zeros(32, dtype=torch.float16)  # (c)
    x[-1] = 6e-8
    _, xh = run(x)
    assert ((xh.double() - x.double()).abs() <= 6e-8).all()
    x = torch.full((32,), 0.5, dtype=torch.float16)  # (d)
    g, xh = run(x)
    if symmetric:
        assert ((xh.double() - 0.5).abs() <= g.scale.double().item() / 2).all()
    else:
        assert (xh == 0.5).all()  # the min carries the value


# ------------------------------------------------------------------ fp16 scale underflow to a subnormal, reciprocal overflow, 0*inf = NaN: pytorch/ao#1766 (PR#1770), docs/methods.md#half-precision-scale-underflow-and-reciprocal-overflow (integer part)


@pytest.mark.parametrize(
    ("bits", "symmetric", "codes"),
    [
        (8, True, [128, 128, 255, 255]),
        (4, True, [8, 8, 15, 15]),
        (8, False, [0, 0, 255, 255]),
        (4, False, [0, 0, 15, 15]),
    ],
)
def test_kvq14_fp16_scale_no_nan(bits, symmetric, codes) -> None:
    # x = [0, 0, 0.1, 0.1] fp16, one scale per row stored in fp16; symmetric codes carry an
    # offset of 2^(b-1): 0 -> 2^(b-1), 0.1 = amax -> 2^b - 1
    x = torch.tensor([[0.0, 0.0, 0.1, 0.1]], dtype=torch.float16)
    g = quantize_groups(x, bits, symmetric=symmetric)
    assert g.codes.flatten().tolist() == codes
    xh = dequantize_groups(g.codes, g.scale, g.zero, bits, symmetric=symmetric, dtype=x.dtype)
    _no_nonfinite(g, xh)
    assert xh[0, :2].tolist() == [0.0, 0.0]
    assert torch.allclose(xh.double(), x.double(), atol=g.scale.double().item() / 2 + 1e-4)


@pytest.mark.parametrize("symmetric", [False, True])
def test_kvq14_subnormal_fp16_scale(symmetric) -> None:
    # 1e-4/255 = 3.9e-7 is an fp16 subnormal (the reported trigger); its fp16 reciprocal would
    # be inf and 0 * inf = NaN.  Zeros must come back exactly 0, the rest within scale/2.
    x = torch.tensor([[0.0, 0.0, 1e-4, 1e-4]], dtype=torch.float16)
    g = quantize_groups(x, 8, symmetric=symmetric)
    assert g.scale.abs().item() < 6.1e-5  # subnormal in fp16
    xh = dequantize_groups(g.codes, g.scale, g.zero, 8, symmetric=symmetric, dtype=torch.float32)
    _no_nonfinite(g, xh)
    assert xh[0, :2].tolist() == [0.0, 0.0]
    assert ((xh.double() - x.double()).abs() <= g.scale.double().item() / 2 + 1e-9).all()


# ------------------------------------------------------------------ bf16 rounding; scale clamped at eps instead of the smallest normal: pytorch/ao PR#4534, docs/methods.md#scale-clamp-at-the-wrong-floor bf16 small scale


def test_kvq15_bf16_small_scale_not_clamped_at_eps() -> None:
    x = torch.linspace(0, 0.01, 32).to(torch.bfloat16).view(1, 32)
    g = quantize_groups(x, 4, scale_dtype=torch.bfloat16)
    true_scale = x.double().max().item() / 15  # ~6.67e-4
    # stored in bf16, rounded up: within 2^-7 relative; far below bf16 eps 2^-7 = 0.0078
    assert true_scale <= g.scale.double().item() <= true_scale * (1 + 2.0**-7)
    xh = dequantize_groups(g.codes, g.scale, g.zero, 4, dtype=torch.bfloat16)
    err = (xh.double() - x.double()).abs().max().item()
    assert err < 5e-4  # ~3.2e-4 + bf16 rounding; an eps-clamped scale gives 3.9e-3


# ------------------------------------------------------------------ fp16 overflow in stored block metadata and in the scale range: ggml-org/llama.cpp PR#21652, docs/methods.md#float16-overflow-in-block-metadata-and-range (a)


def test_kvq24_large_constant_block() -> None:
    x = torch.full((1, 32), 3000.0)
    # symmetric 8-bit, d = 3000/127 = 23.622 -> rounded up in fp16 to 23.625 (spacing 2^-6);
    # code round(3000/23.625) = 127 -> 127 * 23.625 = 3000.375, sum 96012 (0.0125% off)
    g = quantize_groups(x, 8, symmetric=True)
    assert g.scale.item() == 23.625
    xh = dequantize_groups(g.codes, g.scale, None, 8, symmetric=True)
    _no_nonfinite(g, xh)
    assert xh @ torch.ones(32) == pytest.approx(96000, rel=1e-3)
    ga = quantize_groups(x, 8)  # asymmetric: constant group, fp16 min 3000 exact
    xa = dequantize_groups(ga.codes, ga.scale, ga.zero, 8)
    assert (xa == 3000.0).all() and xa.sum().item() == 96000.0


# ------------------------------------------------------------------ bf16 vs fp16 compute dtype mismatch: dropbox/hqq#7 (formerly mobiusml/hqq); same kind in a KV cache: NVIDIA/kvpress#27, docs/methods.md#compute-dtype-mismatch-between-bf16-and-fp16 bf16


def test_kvq28_bf16_cache_with_fp16_scales() -> None:
    k, v = (
        rand(1, 1, 32, 64, seed=1, dtype=torch.bfloat16),
        rand(1, 1, 32, 64, seed=2, dtype=torch.bfloat16),
    )
    m = kvbench.get_method(
        "kivi", bits=2, group_size=8, residual_length=8, value_bits=2, value_group_size=32
    )  # scale_dtype float16 (the default)
    layer = m.new_layer(0, 1, 64, dtype=torch.bfloat16)
    layer.prefill(k, v)
    kd, vd = layer.keys_values()
    assert kd.dtype == vd.dtype == torch.bfloat16
    q = rand(1, 1, 1, 64, seed=3, dtype=torch.bfloat16)
    out = layer.attend(q)  # no "mat1 and mat2 must have the same dtype"
    assert out.dtype == torch.bfloat16
    assert torch.matmul(q, kd.transpose(-1, -2)).dtype == torch.bfloat16
    k32, v32 = layer.keys_values(torch.float32)
    logits = (q.double() @ k32.double().transpose(-1, -2)) / 8
    want = torch.softmax(logits, -1) @ v32.double()
    assert torch.allclose(out.double(), want, atol=2.0**-7 * v32.abs().max().item())


# ------------------------------------------------------------------ NaN / Inf in a layer


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_in_layer_propagates_to_its_group(bad) -> None:
    m = kvbench.get_method(
        "kivi", bits=2, group_size=4, residual_length=4, value_bits=2, value_group_size=4
    )
    layer = m.new_layer(0, 1, 8)
    k, v = rand(1, 1, 10, 8, seed=1), rand(1, 1, 10, 8, seed=2)
    k[0, 0, 5, 3] = bad  # key group: channel 3 of tokens 4..7
    v[0, 0, 2, 6] = bad  # value group: channels 4..7 of token 2
    with pytest.raises(ValueError, match="layer 0: prefill got non-finite input"):
        layer.prefill(k, v)  # the default policy (kvbench.cache.finite) refuses them
    with nonfinite("propagate"):  # the opt-out stores them: NaN stays inside its group
        layer.prefill(k, v)
    kd, vd = layer.keys_values()
    nan_k = torch.zeros(10, 8, dtype=torch.bool)
    nan_k[4:8, 3] = True
    assert torch.equal(torch.isnan(kd[0, 0]), nan_k)
    nan_v = torch.zeros(10, 8, dtype=torch.bool)
    nan_v[2, 4:8] = True
    assert torch.equal(torch.isnan(vd[0, 0]), nan_v)
    assert torch.isfinite(kd[0, 0][~nan_k]).all() and torch.isfinite(vd[0, 0][~nan_v]).all()


def test_non_finite_decode_token_is_refused_naming_layer_and_operation() -> None:
    m = kvbench.get_method("kivi", bits=2, group_size=4, residual_length=4)
    layer = m.new_layer(3, 1, 8)
    layer.prefill(rand(1, 1, 4, 8, seed=1), rand(1, 1, 4, 8, seed=2))
    k, v = rand(1, 1, 1, 8, seed=3), rand(1, 1, 1, 8, seed=4)
    v[0, 0, 0, 5] = float("nan")
    with pytest.raises(ValueError, match="layer 3: append got non-finite input"):
        layer.append(k, v)
    assert layer.seq_length == 4  # nothing of the refused token is stored
