"""SemKV (methods/semkv.py, a [RECON] method): right values from hand-built data and counts.

Data are built so that the attention each key receives is known by construction (queries along
channel 0, "important" keys along channel 0, "unimportant" keys along channel 1 with a larger
norm), so the attention ranking and the key-norm ranking are known and opposite.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import kvbench
from kvbench.attention.reference import reference_attention
from kvbench.kernels.cpu.native import available as native_available
from kvbench.methods.semkv import SemKV, SemKVLayer


def np_per_token(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 per-token min-max (one group = the last axis): (xhat, scale)."""
    mn, mx = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    s = (mx - mn) / (2**bits - 1)
    q = np.clip(np.round((x - mn) / np.where(s > 0, s, 1)), 0, 2**bits - 1)
    return q * s + mn, s


def keys_known_ranking(alpha, beta) -> torch.Tensor:
    """Keys ``[1, 1, T, 4]``: ``[alpha_t, beta_t, 0.1 t, -0.05]`` (the last two small)."""
    t = len(alpha)
    k = torch.zeros(1, 1, t, 4)
    k[0, 0, :, 0], k[0, 0, :, 1] = torch.tensor(alpha), torch.tensor(beta)
    k[0, 0, :, 2], k[0, 0, :, 3] = 0.01 * torch.arange(t), -0.05
    return k


ALPHA = [0.1, 2.0, 0.3, 1.5, 0.2, 1.8, 0.0, 1.2, 0.5, 0.5, 0.5, 0.5]
BETA = [3.0, 0.0, 2.9, 0.0, 2.8, 0.0, 2.7, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("score, want", [("attention", {1, 3, 5, 7}), ("key-norm", {0, 2, 4, 6})])
def test_prefill_highest_ranked_tokens_get_high_bits(score, want):
    # 12 prompt tokens, R = 4: tokens 0..7 are quantized, f = 0.5 -> 4 high.  Queries are
    # 10 * e0 for both query heads: attention ~ exp(10 * alpha / 2), so by attention the top 4
    # are alpha = 2.0, 1.8, 1.5, 1.2 -> {1, 5, 3, 7}; by norm sqrt(alpha^2 + beta^2 + ...) the
    # top 4 are the beta ~ 3 tokens {0, 2, 4, 6}.
    k = keys_known_ranking(ALPHA, BETA)
    q = torch.zeros(1, 2, 12, 4)
    q[..., 0] = 10.0
    m = SemKV(score=score, residual_length=4, score_window=2, value_group_size=4)
    layer = m.new_layer(0, 1, 4)
    layer.prefill(k, k.clone(), q)
    high = layer.k.block.high()[0, 0]
    assert {i for i in range(8) if high[i]} == want
    assert torch.equal(layer.v.block.high(), layer.k.block.high())  # values follow their key
    # each token quantized per token at its own width: within half a step of its width, and
    # equal to the float64 reference up to the fp16 scale rounding
    x = k[0, 0, :8].double().numpy()
    got = layer.keys_values()[0][0, 0, :8].double().numpy()
    for i in range(8):
        bits = 3 if i in want else 2
        xhat, s = np_per_token(x[i], bits)
        assert np.abs(got[i] - x[i]).max() <= s[0] / 2 * (1 + 2e-3) + 1e-6
        np.testing.assert_allclose(got[i], xhat, atol=4e-3 * (x[i].max() - x[i].min()))


def test_decode_attention_from_attend_decides_and_key_norm_is_the_fallback():
    # R = 1: each step flushes the older of two residual tokens.  Tokens 6 and 10 are attended
    # (alpha = 3 along the query), 9 too; 7, 8 and 11 are not (beta = 5: larger norm).
    # Budget after the 4-token prefill (2 high): totals 5..11 allow [floor(N/2), ceil(N/2)],
    # so the flushes of tokens 6, 8, 10 are free and 5, 7, 9 forced.  By hand:
    # attention -> tokens 6..10 = H L L H H; key-norm (no attend) -> L H H L L.
    alpha = [0.2, 0.1, 0.3, 0.0, 0.1, 0.2, 3.0, 0.0, 0.0, 3.0, 3.0, 0.0]
    beta = [0.0] * 6 + [0.0, 5.0, 5.0, 0.0, 0.0, 5.0]
    k = keys_known_ranking(alpha, beta)
    q = torch.zeros(1, 2, 12, 4)
    q[..., 0] = 4.0
    for use_attend, want in ((True, [1, 0, 0, 1, 1]), (False, [0, 1, 1, 0, 0])):
        layer = SemKV(residual_length=1, score_window=2, value_group_size=4).new_layer(0, 1, 4)
        layer.prefill(k[:, :, :5], k[:, :, :5], q[:, :, :5])
        for t in range(5, 12):
            layer.append(k[:, :, t : t + 1], k[:, :, t : t + 1])
            if use_attend:
                layer.attend(q[:, :, t : t + 1])
        layer.end_step()
        high = layer.k.block.high()[0, 0].int().tolist()
        assert layer.k.block.ntokens == 11
        assert high[6:11] == want, (use_attend, high)


@pytest.mark.parametrize("high_bits, low_bits, target", [(3, 2, 2.5), (4, 2, 2.25), (3, 2, 2.8)])
def test_average_code_bits_reach_the_target_within_one_token(high_bits, low_bits, target):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 90, 8, generator=g), torch.randn(2, 3, 90, 8, generator=g)
    q = torch.randn(2, 6, 90, 8, generator=g)
    m = SemKV(
        high_bits=high_bits,
        low_bits=low_bits,
        target_bits=target,
        residual_length=5,
        value_group_size=8,
    )
    layer = m.new_layer(0, 3, 8)
    layer.prefill(k[:, :, :37], v[:, :, :37], q[:, :, :37])
    f = (target - low_bits) / (high_bits - low_bits)
    for t in range(37, 90):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        if t % 3:  # attention on some steps only: both score paths are exercised
            layer.attend(q[:, :, t : t + 1])
        layer.end_step()
        blk = layer.k.block
        n = blk.ntokens
        assert n == t + 1 - 5
        nh = blk.high().sum(-1)
        assert bool(((nh >= math.floor(f * n)) & (nh <= math.ceil(f * n))).all())
        avg = low_bits + (high_bits - low_bits) * blk.high().double().mean(-1)
        assert bool(((avg - target).abs() <= (high_bits - low_bits) / n + 1e-9).all())


def test_bytes_hand_count():
    # B=1, H=2, D=8, one channel group of 8, R=2: prefill 8 tokens -> 6 quantized, 3 high per
    # head.  Per side: low plane 2*6*ceil(8*2/8) = 24 B, extra plane 6 high rows * 1 B = 6 B,
    # mask 2 heads * ceil(6/8) = 2 B, scale + zero 2*6*1 fp16 each = 48 B, residual 2 tokens
    # fp32 2*2*8*4 = 128 B; keys also hold the attention stats 2*2*2 fp32 = 32 B.
    g = torch.Generator().manual_seed(1)
    k, v, q = (torch.randn(1, h, 8, 8, generator=g) for h in (2, 2, 4))
    layer = SemKV(residual_length=2, group_size=8).new_layer(0, 2, 8)
    layer.prefill(k, v, q)
    nb = layer.nbytes()
    assert (nb["codes"], nb["scales"], nb["metadata"], nb["residual"]) == (60, 96, 36, 256)
    assert (nb["key_total"], nb["value_total"], nb["total"]) == (240, 208, 448)
    assert layer.k.block.high().sum().item() == 6


def test_nominal_bits_by_hand():
    # docs/methods.md#average-bits: b_eff = target, (scale, min) 32 bits per group of min(G, D) channels, 1 mask bit
    # per token and head (1/D per element)
    assert SemKV().average_bits(64, 32768)["key_bits"] == pytest.approx(2.5 + 32 / 64 + 1 / 64)
    bits = SemKV(num_sink_tokens=4, value_group_size=32).average_bits(128, 1000)
    per = 2.5 + 32 / 32 + 1 / 128
    assert bits["key_bits"] == pytest.approx((4 * 16 + 1000 * per) / 1004)
    assert bits["value_bits"] == bits["key_bits"]
    assert SemKV(mixed_values=False).average_bits(64)["value_bits"] == 16.0


def test_attend_equals_reference_attention_and_values_can_stay_full_precision():
    g = torch.Generator().manual_seed(2)
    k, v, q = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g), None
    q = torch.randn(1, 4, 20, 8, generator=g)
    layer = SemKV(residual_length=3, mixed_values=False).new_layer(0, 2, 8)
    layer.prefill(k[:, :, :16], v[:, :, :16], q[:, :, :16])
    for t in range(16, 20):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        keys, values = layer.keys_values()
        want = reference_attention(q[:, :, t : t + 1], keys, values)
        assert torch.allclose(layer.attend(q[:, :, t : t + 1]), want, atol=1e-6)
    layer.end_step()
    assert layer.v.block is None and torch.equal(layer.keys_values()[1], v)
    assert layer.quantized_tokens() == (17, 0)


def test_queries_needed_only_for_the_attention_score():
    assert SemKV().needs_queries and not SemKV(score="key-norm").needs_queries
    g = torch.Generator().manual_seed(3)
    k, q = torch.randn(1, 1, 10, 4, generator=g), torch.randn(1, 2, 10, 4, generator=g)
    layer = SemKV(residual_length=2).new_layer(0, 1, 4)
    layer.prefill(k, k)  # waits for its queries
    assert layer.quantized_tokens() == (0, 0)
    layer.provide_queries(q)
    assert layer.quantized_tokens() == (8, 8)
    layer2 = SemKV(residual_length=2, score="key-norm").new_layer(0, 1, 4)
    layer2.prefill(k, k)
    assert layer2.quantized_tokens() == (8, 8)


def test_crop_and_batch_ops_follow_every_part():
    g = torch.Generator().manual_seed(4)
    k, v, q = (torch.randn(2, 2, 14, 8, generator=g) for _ in range(3))
    q = torch.cat([q, q], 1)
    layer = SemKV(residual_length=3).new_layer(0, 2, 8)
    layer.prefill(k, v, q)
    keys, values = layer.keys_values()
    high = layer.k.block.high().clone()
    layer.repeat_batch(2)  # rows 0, 0, 1, 1
    kr, vr = layer.keys_values()
    assert torch.equal(kr[1], keys[0]) and torch.equal(vr[2], values[1])
    assert layer.stats.shape == (4, 2, 3, 2)
    layer.index_batch(torch.tensor([2]))
    assert torch.equal(layer.keys_values()[0][0], keys[1])
    assert torch.equal(layer.k.block.high()[0], high[1])
    layer.crop(6)
    assert layer.seq_length == 6 and torch.equal(layer.keys_values()[0][0], keys[1, :, :6])
    assert layer.stats.shape[2] == 0
    layer.reset()
    assert layer.seq_length == 0 and layer.stats is None


def test_registered_and_reconstruction():
    m = kvbench.get_method("semkv")
    assert isinstance(m, SemKV) and isinstance(m.new_layer(0, 1, 8), SemKVLayer)
    c = m.config
    assert (c.high_bits, c.low_bits, c.target_bits, c.score, c.score_window) == (
        3,
        2,
        2.5,
        "attention",
        32,
    )
    assert m.capabilities.reconstruction and m.capabilities.needs_queries


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"high_bits": 2}, "high_bits"),
        ({"high_bits": 9}, "high_bits"),
        ({"low_bits": 0}, "low_bits"),
        ({"low_bits": 8, "high_bits": 8}, "low_bits"),
        ({"target_bits": 3.5}, "target_bits"),
        ({"target_bits": 1.9}, "target_bits"),
        ({"target_bits": "2.5"}, "target_bits"),
        ({"score": "h2o"}, "score"),
        ({"score_window": 0}, "score_window"),
        ({"score_window": True}, "score_window"),
        ({"mixed_values": "yes"}, "mixed_values"),
        ({"value_bits": 2}, "value_bits"),
    ],
)
def test_bad_config_values_raise_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SemKV(**kw)
    SemKV(mixed_values=False, value_bits=2)  # value_bits is fine when values are not mixed


@pytest.mark.parametrize("target, n_high", [(2.0, 0), (3.0, 6)])
def test_all_low_or_all_high_and_empty_planes(target, n_high):
    # f = 0: no token is high, the extra plane holds 0 rows (pack_bits of an empty [0, D]
    # tensor, a core fix); f = 1: all 6 quantized tokens are high, 1 extra byte per token
    g = torch.Generator().manual_seed(5)
    k, q = torch.randn(1, 1, 8, 8, generator=g), torch.randn(1, 1, 8, 8, generator=g)
    layer = SemKV(target_bits=target, residual_length=2).new_layer(0, 1, 8)
    layer.prefill(k, k, q)
    blk = layer.k.block
    assert int(blk.high().sum()) == n_high and tuple(blk.extra.shape) == (n_high, 1)
    bits = 3 if n_high else 2
    x = k[0, 0, :6].double().numpy()
    for i in range(6):
        xhat, s = np_per_token(x[i], bits)
        got = layer.keys_values()[0][0, 0, i].double().numpy()
        np.testing.assert_allclose(got, xhat, atol=4e-3 * (x[i].max() - x[i].min()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("b,hq,hkv,nq,t", [(2, 8, 2, 5, 300), (1, 3, 3, 1, 64), (3, 6, 1, 7, 7)])
def test_prefill_probabilities_equal_the_reference_to_round_off(dtype, b, hq, hkv, nq, t) -> None:
    """The prefill score's softmax runs one query head at a time against its KV head (no
    repeated float32 keys): reference_probabilities up to float32 round-off.  Not bit for bit:
    its matmuls are ``[B, n_q, D] @ [B, D, T]`` per head, the reference's one ``[B, H_q, n_q,
    D] @ [B, H_q, D, T]``, and BLAS may pick kernels (summation orders) by shape.

    Bound: each float32 logit ``s * q.k`` (D terms) is within ``gamma_D * s * sum |q_i k_i|
    + u |l|`` of the exact one on either side (``u = 2^-24``, ``gamma_D = D u / (1 - D u)``),
    so the two differ by ``d_j <= 2 (gamma_D s sum |q_i k_i| + u |l_j|)``; a softmax moves by
    ``p_j (exp(d_j + max d) - 1)`` under logit changes ``d``, plus each side's own exp / sum /
    divide round-off (``<= (T + 4) u p_j`` each; ``2^-126``: a result below float32's normal
    range)."""
    from kvbench.attention.reference import reference_probabilities
    from kvbench.methods.semkv import prefill_probabilities

    g = torch.Generator().manual_seed(b * 100 + hq + t)
    q = (3 * torch.randn(b, hq, nq, 16, generator=g)).to(dtype)
    k = (3 * torch.randn(b, hkv, t, 16, generator=g)).to(dtype)
    got, ref = prefill_probabilities(q, k), reference_probabilities(q, k)
    assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape
    u, d, s = 2.0**-24, q.shape[-1], 1 / math.sqrt(q.shape[-1])
    q64, k64 = q.double(), k.double().repeat_interleave(hq // hkv, 1)
    dots = s * q64.abs() @ k64.abs().transpose(-1, -2)  # s * sum |q_i k_i|, [B, H_q, n_q, T]
    delta = 2 * (d * u / (1 - d * u) * dots + u * (s * q64 @ k64.transpose(-1, -2)).abs())
    tol = ref.double() * (torch.expm1(delta + delta.amax(-1, keepdim=True)) + 2 * (t + 4) * u)
    assert ((got.double() - ref.double()).abs() <= tol + 2.0**-126).all()
    with pytest.raises(ValueError, match="do not fit"):
        prefill_probabilities(q[:, :, :, :8], k)


@pytest.mark.parametrize("bits", [(2, 4), (3, 8), (1, 3)])
def test_mixed_codec_native_pass_equals_torch_path(monkeypatch, bits):
    """The two-width per-token encode from the native one-pass quantizer is bit for bit the
    torch path's (quantize_groups at both widths): every stored tensor of the block."""
    from kvbench.cache import native_quant
    from kvbench.methods.semkv import MixedTokenCodec

    if not native_quant.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(sum(bits))
    x = (torch.randn(2, 3, 20, 16, generator=g) * 3).half()
    x[0, 1, 4] = 0.5  # a constant group (scale 0)
    x[1, 0, :, :8] = (torch.arange(20 * 8).reshape(20, 8) % 7).half() * 0.5  # ties
    high = torch.rand(2, 3, 20, generator=g) < 0.4
    codec = MixedTokenCodec(*bits, channel_group=8)
    fast = codec.encode(x, high)
    with monkeypatch.context() as m:
        m.setattr(native_quant, "_load", lambda: None)
        ref = codec.encode(x, high)
    for name in ("low", "extra", "mask", "scale", "zero"):
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("na", [1, 7, 8, 9, 16, 21])
@pytest.mark.parametrize("nb", [1, 3, 8, 11])
def test_cat_joins_the_mask_bit_streams_at_any_length(na, nb):
    """``MixedTokenBlock.cat`` joins the packed 1-bit masks at the tail of the first block's
    stream: the same tokens, high flags, mask bytes (zero past the last token) and extra rows
    as encoding the joined tokens at once; ``high_count`` counts each (row, head)'s flags."""
    from kvbench.cache.quant import unpack_bits
    from kvbench.methods.semkv import MixedTokenCodec

    g = torch.Generator().manual_seed(na * 100 + nb)
    codec = MixedTokenCodec(2, 3, 8)
    x = torch.randn(2, 3, na + nb, 16, generator=g)
    high = torch.rand(2, 3, na + nb, generator=g) < 0.5
    both = codec.encode(x[:, :, :na], high[:, :, :na]).cat(
        codec.encode(x[:, :, na:], high[:, :, na:])
    )
    once = codec.encode(x, high)
    for k in ("low", "extra", "mask", "scale", "zero"):
        assert torch.equal(getattr(both, k), getattr(once, k)), k
    assert torch.equal(both.high(), high)
    assert both.mask.shape[-1] == -(-(na + nb) // 8)
    assert not unpack_bits(both.mask, 1, both.mask.shape[-1] * 8)[..., na + nb :].any()
    assert torch.equal(both.high_count(), high.sum(-1))


def test_upper_plane_places_each_extra_row_at_its_token():
    """The upper plane read by the attention kernels: token ``t`` of (row ``b``, head ``h``)
    holds the ``i``-th extra row, ``i`` counting high tokens in ``[n, B, H]`` order, and zero
    bytes for low tokens (a loop over the tokens as the reference)."""
    from kvbench.kernels.cpu.mixed_tokens import MixedTokenAttention
    from kvbench.methods.semkv import MixedTokenCodec

    g = torch.Generator().manual_seed(5)
    b, h, n = 2, 3, 13
    high = torch.rand(b, h, n, generator=g) < 0.4
    blk = MixedTokenCodec(2, 4, 8).encode(torch.randn(b, h, n, 16, generator=g), high)
    up = MixedTokenAttention._upper(blk)
    ref, i = torch.zeros_like(up.codes), 0
    for t in range(n):
        for r in range(b):
            for k in range(h):
                if high[r, k, t]:
                    ref[r, k, t] = blk.extra[i]
                    i += 1
    assert i == blk.extra.shape[0] and torch.equal(up.codes, ref)
    assert up.bits == 2 and not up.zero.any()
    assert torch.equal(up.scale, torch.where(high[..., None], blk.scale.float() * 4, 0.0))


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
def test_native_decode_reads_the_upper_rows_where_they_are_stored(monkeypatch):
    """With the native kernels, a SemKV decode step reads both planes in one call per block
    (``kvbench.kernels.cpu.native.Upper``): the dense upper-plane transient of the two-pass route
    (``MixedTokenAttention._upper``) is never built (the step runs without a fallback
    warning), and the output equals the float64 attention over the dequantized cache."""
    from kvbench.kernels.cpu.mixed_tokens import MixedTokenAttention

    g = torch.Generator().manual_seed(2)
    lc = kvbench.get_method("semkv", residual_length=8, score="key-norm").new_layer(0, 2, 64)
    lc.prefill(torch.randn(1, 2, 70, 64, generator=g), torch.randn(1, 2, 70, 64, generator=g))
    lc.append(torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g))
    assert lc.k.block.extra.shape[0] and lc.v.block.extra.shape[0]

    def refuse(block):
        raise AssertionError("the two-pass route ran")

    monkeypatch.setattr(MixedTokenAttention, "_upper", staticmethod(refuse))
    q = torch.randn(1, 4, 1, 64, generator=g)
    with warnings.catch_warnings():  # a backend that raises is reported by a warning
        warnings.simplefilter("error")
        out = lc.attend(q)
    k, v = lc.keys_values(torch.float64)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = torch.softmax(q.double() @ k.transpose(-1, -2) / math.sqrt(64), -1) @ v
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("tiles", ["1", "tiled"])
def test_two_pass_route_keeps_low_tokens_out_of_the_upper_plane(tiles, monkeypatch):
    """The two-pass route (upper planes the one-call kernels do not take: here 7 upper bits)
    gives low tokens a zero upper scale: with their own 1-bit scale the centred kernels'
    ``(0 - h) a + h a`` (``h = 63.5``) left 9.3e-5 of float32 rounding in the output."""
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", tiles)
    g = torch.Generator().manual_seed(5)
    cfg = dict(low_bits=1, high_bits=8, target_bits=4.5, score="key-norm", residual_length=8)
    lc = kvbench.get_method("semkv", **cfg, value_group_size=32).new_layer(0, 2, 64)
    lc.prefill(torch.randn(1, 2, 70, 64, generator=g), torch.randn(1, 2, 70, 64, generator=g))
    lc.append(torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g))
    q = torch.randn(1, 2, 1, 64, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = lc.attend(q)
    k, v = lc.keys_values(torch.float64)
    ref = torch.softmax(q.double() @ k.transpose(-1, -2) / 8, -1) @ v
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
