"""PN-Mix (docs/methods.md#pn-mix [RECON]): Examples 8-10, the Table 10 budget (2.263), a hand byte count, the
fixed selection in every page, capabilities, bad input, and float64 properties.

Right values: docs/methods.md#worked-examples (numpy float64) and independent numpy recomputations of the formulas.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvbench
from kvbench.methods.pn_mix import PNMix, PNMixConfig, pair_channels, pair_scores

EX8_K = [[1.0, 0.2, 0.0, 0.13], [0.8, 0.1, 0.6, 0.0], [-0.6, 0.33, 0.8, 0.2]]
EX8_Q0 = [[0.1, 2.0, 0.0, 1.0], [0.2, 1.5, 0.1, 2.0], [0.0, 1.0, 0.3, 1.5]]
EX8_Q1 = [[0.0, 1.5, 0.1, 1.0], [0.1, 1.2, 0.0, 1.4], [0.0, 1.6, 0.2, 0.9]]
EX9_K = [[0.6, 0.198571, 0.2, 0.142857], [0.6, 0.1, 0.6, 0.0], [-0.2, 0.33, 0.6, 0.2]]


def _ex8():
    k = torch.tensor(EX8_K, dtype=torch.float64)[None, None]  # [1, 1, 3, 4]
    q = torch.tensor([EX8_Q0, EX8_Q1], dtype=torch.float64)[None]  # [1, 2, 3, 4]
    return k, q


def _small(**cfg) -> PNMix:
    base = {"group_size": 3, "residual_length": 3, "num_sink_tokens": 0, "scale_dtype": "float32"}
    return PNMix(**(base | cfg))


def _kl(q: np.ndarray, k: np.ndarray, k2: np.ndarray) -> float:
    """mean KL(A || A') of softmax(q k^T / sqrt(d)) over queries (float64)."""
    d = q.shape[-1]

    def soft(kk):
        z = q @ kk.swapaxes(-1, -2) / math.sqrt(d)
        z = np.exp(z - z.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)

    a, b = soft(k), soft(k2)
    return float((a * np.log(a / b)).sum(-1).mean())


# ------------------------------------------------------------------------------ Examples 8-10


def test_example8_pair_scores():
    k, q = _ex8()
    sep = pair_scores(k, q, "qk-pair-norm")[0, 0].tolist()
    # mean||k_i|| = [1.0, 0.241471] x mean||q_i|| = [0.170601, 2.003547]
    assert sep == pytest.approx([0.170601, 0.483798], abs=1e-6)
    causal = pair_scores(k, q, "qk-pair-norm-causal")[0, 0].tolist()
    assert causal == pytest.approx([1.173607, 2.534894], abs=1e-6)
    assert pair_scores(k, None, "k-pair-norm")[0, 0].tolist() == pytest.approx(
        [1.0, 0.241471], abs=1e-6
    )
    # channel range [1.6, 0.23, 0.8, 0.2] and magnitude [0.8, 0.21, 0.466667, 0.11], pair sums
    rng = pair_scores(k, None, "k-range")[0, 0].tolist()
    assert rng == pytest.approx([2.4, 0.43], abs=1e-9)
    mag = pair_scores(k, None, "k-magnitude")[0, 0].tolist()
    assert mag == pytest.approx([0.8 + 0.466667, 0.21 + 0.11], abs=1e-6)


@pytest.mark.parametrize("score", ["qk-pair-norm", "qk-pair-norm-causal"])
def test_example8_query_scores_select_pair_1(score):
    k, q = _ex8()
    layer = _small(score=score).new_layer(0, 1, 4, dtype=torch.float64)
    layer.prefill(k, k.clone(), q)
    assert layer.k.codec.selected_pairs.tolist() == [[[1]]]
    assert layer.k.block.channel_bits()[0, 0, 0].tolist() == [1, 3, 1, 3]


@pytest.mark.parametrize("score", ["k-range", "k-magnitude", "k-pair-norm"])
def test_example8_key_only_scores_select_pair_0(score):
    k, _ = _ex8()
    layer = _small(score=score).new_layer(0, 1, 4, dtype=torch.float64)
    layer.prefill(k, k.clone())  # no queries needed
    assert layer.k.codec.selected_pairs.tolist() == [[[0]]]
    assert layer.k.block.channel_bits()[0, 0, 0].tolist() == [3, 1, 3, 1]


def test_example9_reconstruction_and_example10_attention_kl():
    k, q = _ex8()
    layer = _small().new_layer(0, 1, 4, dtype=torch.float64)
    layer.prefill(k, k.clone(), q)
    assert layer.quantized_tokens() == (3, 0)
    kq = layer.keys_values()[0][0, 0].numpy()
    np.testing.assert_allclose(kq, EX9_K, atol=2e-6)
    assert ((kq - np.array(EX8_K)) ** 2).mean() == pytest.approx(0.036681, abs=2e-6)
    # Example 10: one query, scale 1/sqrt(4)
    qv = np.array([1.0, 0.5, -0.5, 2.0])
    a = np.exp(qv @ np.array(EX8_K).T / 2)
    a2 = np.exp(qv @ kq.T / 2)
    np.testing.assert_allclose(a / a.sum(), [0.482029, 0.321502, 0.196469], atol=1e-6)
    np.testing.assert_allclose(a2 / a2.sum(), [0.411702, 0.315072, 0.273226], atol=1e-6)
    assert _kl(qv[None], np.array(EX8_K), kq) == pytest.approx(0.017719, abs=2e-6)


def test_average_bits_table10():
    bits = kvbench.get_method("pn-mix").average_bits(128, 32768)
    # b_eff = 3 * 0.5 + 1 * 0.5 = 2; (512 + 32768 * 2.25) / 32800 = 2.2634 (docs/methods.md#pn-mix)
    assert bits["key_bits"] == pytest.approx(2.263, abs=0.005)
    assert bits["key_bits"] == pytest.approx((512 + 32768 * 2.25) / 32800, rel=1e-12)
    # fractional r * D/2 is floored: r = 0.3, D = 8 -> 1 pair -> r_eff = 0.25
    t = PNMix(high_ratio=0.3).key_bit_terms(8)
    assert t["b_eff"] == pytest.approx(0.25 * 3 + 0.75 * 1)


# ------------------------------------------------------------------------------ the cache


def _np_selection(k: np.ndarray, q: np.ndarray, n_high: int) -> np.ndarray:
    """Independent Eq. 5 (separable) selection, rotate-half pairs, GQA by g // (H_q/H_kv)."""
    b, hkv, _, d = k.shape
    h = d // 2
    kn = np.hypot(k[..., :h], k[..., h:]).mean(2)  # [B, H_kv, D/2]
    qn = np.hypot(q[..., :h], q[..., h:]).mean(2)  # [B, H_q, D/2]
    rep = q.shape[1] // hkv
    qbar = np.stack([qn[:, g * rep : (g + 1) * rep].mean(1) for g in range(hkv)], 1)
    score = qbar * kn
    order = np.argsort(-score, axis=-1, kind="stable")[..., :n_high]
    return np.sort(order, axis=-1)


def test_selected_pairs_high_in_every_page_and_sinks_exact():
    g = torch.Generator().manual_seed(4)
    b, hkv, hq, d, ns = 2, 2, 4, 16, 4
    k = torch.randn(b, hkv, 51, d, generator=g)
    q = torch.randn(b, hq, 31, d, generator=g) * torch.linspace(0.2, 3, d)
    m = PNMix(group_size=8, residual_length=8, num_sink_tokens=ns)
    layer = m.new_layer(0, hkv, d)
    layer.prefill(k[:, :, :31], k[:, :, :31].clone(), q)
    expect = _np_selection(k[:, :, :31].double().numpy(), q.double().numpy(), 4)
    assert layer.k.codec.selected_pairs.tolist() == expect.tolist()
    for t in range(31, 51):
        layer.append(k[:, :, t : t + 1], k[:, :, t : t + 1].clone())
    layer.end_step()
    assert layer.quantized_tokens()[0] == 40  # 47 non-sink tokens, KIVI blocks of 8
    block = layer.k.block
    bits = block.channel_bits()  # [B, H, 1, D]: one fixed assignment for all 5 pages
    assert bits.shape == (b, hkv, 1, d)
    hi = np.zeros((b, hkv, d), dtype=int) + 1
    for bb in range(b):
        for hh in range(hkv):
            for p in expect[bb, hh]:
                hi[bb, hh, [p, p + d // 2]] = 3
    assert bits[:, :, 0].tolist() == hi.tolist()
    codes = block.unpacked_codes()  # [B, H, 40, D]
    hi_t = torch.tensor(hi)[:, :, None].expand_as(codes)
    assert int(codes[hi_t == 1].max()) == 1 and int(codes[hi_t == 3].max()) == 7
    np.testing.assert_array_equal(layer.k.sinks.numpy(), k[:, :, :ns].numpy())
    np.testing.assert_array_equal(layer.keys_values()[0][:, :, :ns].numpy(), k[:, :, :ns].numpy())


def test_bytes_hand_count():
    # B=1, H_kv=2, D=8, G=R=4, N_s=2, r=0.5 -> 2 of 4 pairs at 3 bits: 4x3 + 4x1 = 16 bits
    m = PNMix(group_size=4, residual_length=4, num_sink_tokens=2)
    layer = m.new_layer(0, 2, 8)
    x = torch.randn(1, 2, 14, 8)
    q = torch.randn(1, 2, 13, 8)
    layer.prefill(x[:, :, :13], x[:, :, :13].clone(), q)
    # 11 non-sink tokens -> 8 quantized (2 pages), 3 residual
    assert layer.quantized_tokens() == (8, 0)
    nb = layer.nbytes()
    assert nb["codes"] == 8 * 2 * 2  # tokens x heads x 2 bytes
    assert nb["scales"] == 2 * 2 * 8 * 2 * 2  # pages x heads x channels x (scale, zero) x fp16
    assert nb["metadata"] == 2 * 8  # one uint8 permutation per head, stored once
    assert nb["sinks"] == 2 * (2 * 2 * 8 * 4)  # K and V sinks, float32
    assert nb["residual"] == 3 * 2 * 8 * 4 + 11 * 2 * 8 * 4  # key residual 3, values 11
    assert nb["key_total"] == 32 + 128 + 16 + 128 + 192
    assert nb["total"] == nb["key_total"] + 128 + 704
    layer.append(x[:, :, 13:], x[:, :, 13:].clone())
    layer.end_step()  # residual reaches R = 4: one more page
    nb2 = layer.nbytes()
    assert nb2["codes"] == 12 * 2 * 2 and nb2["scales"] == 3 * 2 * 8 * 2 * 2
    assert nb2["metadata"] == 16  # still counted once


def test_needs_queries_capability_and_pending_prefill():
    assert PNMix.capabilities.needs_queries and PNMix.capabilities.reconstruction
    assert PNMix().needs_queries and PNMix(score="qk-pair-norm-causal").needs_queries
    assert not PNMix(score="k-range").needs_queries
    k, q = _ex8()
    layer = _small().new_layer(0, 1, 4, dtype=torch.float64)
    assert layer.needs_queries
    layer.prefill(k, k.clone())  # no queries: stays pending
    assert layer.quantized_tokens() == (0, 0) and layer.k.codec.selected_pairs is None
    with pytest.raises(ValueError, match="needs_queries"):
        layer.append(k[:, :, :1], k[:, :, :1].clone())
    layer.provide_queries(q)
    assert layer.k.codec.selected_pairs.tolist() == [[[1]]] and layer.quantized_tokens()[0] == 3
    assert not _small(score="k-magnitude").new_layer(0, 1, 4).needs_queries
    with pytest.raises(ValueError, match="needs the post-RoPE prefill queries"):
        pair_scores(k, None, "qk-pair-norm")


def test_fewer_prefill_tokens_than_sinks():
    g = torch.Generator().manual_seed(7)
    k = torch.randn(1, 1, 9, 8, generator=g, dtype=torch.float64)
    q = torch.randn(1, 1, 2, 8, generator=g, dtype=torch.float64)
    m = PNMix(group_size=4, residual_length=4, num_sink_tokens=4, high_ratio=0.25)
    layer = m.new_layer(0, 1, 8, dtype=torch.float64)
    layer.prefill(k[:, :, :2], k[:, :, :2].clone(), q)
    assert layer.k.sinks.shape[2] == 2 and layer.quantized_tokens() == (0, 0)
    # the selection is made from the 2 prompt tokens
    assert (
        layer.k.codec.selected_pairs.tolist()
        == _np_selection(k[:, :, :2].numpy(), q.numpy(), 1).tolist()
    )
    for t in range(2, 9):
        layer.append(k[:, :, t : t + 1], k[:, :, t : t + 1].clone())
    layer.end_step()
    # sinks fill from the first tokens that arrive (2 prompt + 2 decode); then one page of 4
    np.testing.assert_array_equal(layer.k.sinks.numpy(), k[:, :, :4].numpy())
    assert layer.quantized_tokens()[0] == 4 and layer.k.residual.shape[2] == 1


def test_interleaved_pairing():
    assert pair_channels(6).tolist() == [[0, 3], [1, 4], [2, 5]]
    assert pair_channels(6, "interleaved").tolist() == [[0, 1], [2, 3], [4, 5]]
    k, q = _ex8()
    perm = [0, 2, 1, 3]  # rotate-half (0,2),(1,3) -> interleaved (0,1),(2,3)
    layer = _small(pairing="interleaved").new_layer(0, 1, 4, dtype=torch.float64)
    layer.prefill(k[..., perm], k[..., perm].clone(), q[..., perm])
    assert layer.k.codec.selected_pairs.tolist() == [[[1]]]
    np.testing.assert_allclose(
        layer.keys_values()[0][0, 0].numpy(), np.array(EX9_K)[:, perm], atol=2e-6
    )


def test_beam_reorder_keeps_selection_with_its_sequence():
    g = torch.Generator().manual_seed(9)
    k = torch.randn(2, 1, 24, 8, generator=g)
    k[0, :, :, [0, 4]] *= 8  # sequence 0 favours pair 0, sequence 1 pair 2
    k[1, :, :, [2, 6]] *= 8
    m = PNMix(
        group_size=4, residual_length=4, num_sink_tokens=0, high_ratio=0.25, score="k-pair-norm"
    )
    layer = m.new_layer(0, 1, 8)
    layer.prefill(k[:, :, :8], k[:, :, :8].clone())
    assert layer.k.codec.selected_pairs.tolist() == [[[0]], [[2]]]
    layer.index_batch(torch.tensor([1, 0]))
    assert layer.k.codec.selected_pairs.tolist() == [[[2]], [[0]]]
    ref = m.new_layer(0, 1, 8)
    ref.prefill(k[[1, 0], :, :8], k[[1, 0], :, :8].clone())
    for t in range(8, 24):
        for lc, x in ((layer, k[[1, 0], :, t : t + 1]), (ref, k[[1, 0], :, t : t + 1])):
            lc.append(x, x.clone())
    layer.end_step()
    ref.end_step()
    np.testing.assert_array_equal(layer.keys_values()[0].numpy(), ref.keys_values()[0].numpy())
    layer.repeat_batch(2)
    assert layer.k.codec.selected_pairs.tolist() == [[[2]], [[2]], [[0]], [[0]]]
    assert layer.keys_values()[0].shape == (4, 1, 24, 8)


def test_high_ratio_zero_is_low_bits_everywhere_and_kitty_flush():
    x = torch.randn(1, 1, 9, 8)
    layer = PNMix(group_size=4, residual_length=4, num_sink_tokens=1, high_ratio=0.0).new_layer(
        0, 1, 8
    )
    layer.prefill(x, x.clone(), torch.randn(1, 1, 9, 8))
    assert layer.k.codec.selected_pairs.shape[-1] == 0
    assert bool((layer.k.block.channel_bits() == 1).all()) and layer.nbytes()["metadata"] == 0
    kitty = PNMix(group_size=4, residual_length=4, num_sink_tokens=0, flush="kitty").new_layer(
        0, 1, 8
    )
    kitty.prefill(x[:, :, :4], x[:, :, :4].clone(), torch.randn(1, 1, 4, 8))
    assert kitty.quantized_tokens() == (0, 0)  # all-but-newest: n <= R stays full precision


def test_score_sink_tokens_switch():
    k = torch.randn(1, 1, 12, 8, dtype=torch.float64) * 0.1
    k[:, :, :2, [0, 4]] = 50.0  # huge sinks in pair 0
    k[:, :, 2:, [1, 5]] *= 30.0  # pair 1 largest after the sinks
    base = {"group_size": 4, "residual_length": 4, "num_sink_tokens": 2, "high_ratio": 0.25,
            "score": "k-pair-norm"}  # fmt: skip
    with_sinks = PNMix(**base).new_layer(0, 1, 8, dtype=torch.float64)
    with_sinks.prefill(k, k.clone())
    without = PNMix(**base, score_sink_tokens=False).new_layer(0, 1, 8, dtype=torch.float64)
    without.prefill(k, k.clone())
    assert with_sinks.k.codec.selected_pairs.tolist() == [[[0]]]
    assert without.k.codec.selected_pairs.tolist() == [[[1]]]


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("high_ratio", -0.01, "high_ratio"),
        ("high_ratio", 1.01, "high_ratio"),
        ("low_bits", 3, "field 'low_bits': 3 is not allowed; allowed: integers below high_bits=3"),
        ("low_bits", 5, "field 'low_bits': 5 is not allowed"),
        ("score", "qk-dot", "score"),
        ("pairing", "halves", "pairing"),
        ("flush", "hf", "flush"),
        ("midpoint_correction", "yes", "midpoint_correction"),
    ],
)
def test_bad_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        PNMixConfig(**{field: value})


def test_bad_shapes():
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        PNMix().new_layer(0, 1, 7)
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        PNMix().average_bits(7)
    k, q = _ex8()
    with pytest.raises(ValueError, match="do not fit"):
        pair_scores(k.expand(1, 2, 3, 4), q[:, :1].expand(1, 3, 3, 4))  # H_q=3, H_kv=2
    with pytest.raises(ValueError, match="at least one"):
        pair_scores(k[:, :, :0], q[:, :, :0])


# ------------------------------------------------------------------------------ properties


def _key_mse(method, k, q=None, relative=False):
    layer = method.new_layer(0, k.shape[1], k.shape[-1], dtype=torch.float64)
    layer.prefill(k, k.clone(), q)
    assert layer.quantized_tokens()[0] == k.shape[2]
    err = ((layer.keys_values()[0] - k) ** 2).mean().item()
    return err / (k**2).mean().item() if relative else err


def test_planted_channels_beat_uniform_two_bit():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 256, 128, generator=g, dtype=torch.float64)
    k[..., [5, 40, 77, 100]] *= 20.0
    q = torch.randn(1, 6, 256, 128, generator=g, dtype=torch.float64)
    pn = _key_mse(PNMix(num_sink_tokens=0), k, q)
    uni = _key_mse(kvbench.get_method("per-channel", bits=2), k)
    # planted channels at 3 instead of 2 bits dominate: about 0.9 vs 3.4 (range^2 / 12 sums)
    assert pn < 0.5 * uni


def test_iid_keys_pn_mix_worse_than_uniform_two_bit():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 256, 128, generator=g, dtype=torch.float64)
    q = torch.randn(1, 6, 256, 128, generator=g, dtype=torch.float64)
    pn = _key_mse(PNMix(num_sink_tokens=0), k, q, relative=True)
    uni = _key_mse(kvbench.get_method("per-channel", bits=2), k, relative=True)
    # N(0,1), 128-token groups, expected range ~5.16: 2-bit (5.16/3)^2/12 = 0.246; 3-bit 0.045;
    # 1-bit midpoint (reconstruct at +-5.16/4) 1 - 2*1.29*sqrt(2/pi) + 1.29^2 = 0.606 -> 0.326
    assert uni == pytest.approx(0.246, abs=0.03)
    assert pn == pytest.approx(0.326, abs=0.035)
    assert pn > uni


def test_query_weighted_pairs_qk_score_beats_key_only_scores():
    d = 32
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 256, d, generator=g, dtype=torch.float64)  # equal magnitude
    w = torch.full((d,), 0.3, dtype=torch.float64)
    for p in (1, 6, 9, 13):
        w[p] = w[p + d // 2] = 3.0
    q_prefill = torch.randn(1, 2, 256, d, generator=g, dtype=torch.float64) * w
    q_decode = torch.randn(1, 2, 64, d, generator=g, dtype=torch.float64) * w
    kl = {}
    for score in ("qk-pair-norm", "k-range", "k-magnitude", "k-pair-norm"):
        layer = PNMix(num_sink_tokens=0, score=score).new_layer(0, 1, d, dtype=torch.float64)
        layer.prefill(k, k.clone(), q_prefill)
        kq = layer.keys_values()[0]
        kl[score] = _kl(q_decode[0].numpy(), k[0].numpy(), kq[0].numpy())
    assert layer.k.codec.selected_pairs.shape == (1, 1, 8)  # same bits for every score
    assert kl["qk-pair-norm"] < 0.5 * min(kl["k-range"], kl["k-magnitude"], kl["k-pair-norm"])


@pytest.mark.parametrize("pairing", ["rotate-half", "interleaved"])
@pytest.mark.parametrize("chunk", [1 << 23, 7 * 16])
def test_pair_scores_gather_then_cast_is_bit_for_bit(pairing, chunk, monkeypatch):
    """The pair norms read each half in the input dtype and then cast (no float32 copy of
    the whole queries), chunk by chunk along T (``chunk`` elements: one chunk, or 7 tokens of
    one row at a time with a shorter last chunk): equal bit for bit to casting everything
    first and gathering the pairs."""
    monkeypatch.setattr("kvbench.cache.chunks.CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(2, 2, 24, 16, generator=g) * 4).half()
    q = (torch.randn(2, 4, 24, 16, generator=g) * 4).half()
    pc = pair_channels(16, pairing)
    kf, qf = k.float(), q.float()
    kn = torch.hypot(kf[..., pc[:, 0]], kf[..., pc[:, 1]])
    qn = torch.hypot(qf[..., pc[:, 0]], qf[..., pc[:, 1]]).reshape(2, 2, 2, 24, 8)
    got = pair_scores(k, q, "qk-pair-norm", pairing)
    assert torch.equal(got, qn.mean(dim=(2, 3)) * kn.mean(dim=2))
    causal = (qn * kn.cumsum(dim=2).unsqueeze(2)).sum(dim=3).mean(dim=2)
    assert torch.equal(pair_scores(k, q, "qk-pair-norm-causal", pairing), causal)
    assert torch.equal(pair_scores(k, None, "k-pair-norm", pairing), kn.mean(dim=2))
