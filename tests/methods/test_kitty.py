"""Kitty (docs/methods.md#kitty): Example 7 (selection, codes, dequant, MSE), Example 16 (flush schedule),
the Table 10 bit budget (2.388), a hand byte count, and float64 properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbench
from kvbench.methods.kitty import Kitty, KittyConfig

# docs/methods.md#worked-example-7, layout [D=4 channels, T=4 tokens]
EX7_K = [
    [0.1, 0.3, -0.2, 0.0],
    [4.0, -3.5, 3.8, -4.2],
    [-1.0, 0.5, 1.5, -0.5],
    [0.7, 0.6, -0.9, 0.2],
]
EX7_CODES = [[2, 3, 0, 1], [15, 1, 15, 0], [0, 2, 3, 1], [3, 3, 0, 2]]
EX7_DEQ = [
    [0.133333, 0.3, -0.2, -0.033333],
    [4.0, -3.653333, 4.0, -4.2],
    [-1.0, 0.666667, 1.5, -0.166667],
    [0.7, 0.7, -0.9, 0.166667],
]


def _keys_ex7() -> torch.Tensor:
    return torch.tensor(EX7_K, dtype=torch.float64).T.reshape(1, 1, 4, 4)  # [B, H, T, D]


def test_example7_selection_codes_dequant_mse():
    m = Kitty(high_ratio=0.25, group_size=4, residual_length=4, scale_dtype="float32")
    block = m.key_codec(0, 4).encode(_keys_ex7())
    # mean|K| = [0.15, 3.875, 0.875, 0.6], k_chan = int(4 * 0.25 + 1e-6) = 1 -> channel 1
    assert block.channel_bits()[0, 0, 0].tolist() == [2, 4, 2, 2]
    assert block.unpacked_codes()[0, 0].T.tolist() == EX7_CODES
    deq = block.dequantize(torch.float64)[0, 0].T.numpy()
    np.testing.assert_allclose(deq, EX7_DEQ, atol=2e-6)
    mse = ((deq - np.array(EX7_K)) ** 2).mean()
    assert mse == pytest.approx(0.013483, abs=2e-6)


def test_average_bits_table10():
    bits = kvbench.get_method("kitty").average_bits(128, 32768)
    # (512 + 32768 * (2.0625 + 0.25 + 0.0625)) / 32800 = 2.388 (docs/methods.md#kitty and docs/methods.md#average-bits)
    assert bits["key_bits"] == pytest.approx(2.388, abs=0.005)
    assert bits["key_bits"] == pytest.approx((512 + 32768 * 2.375) / 32800, rel=1e-12)
    assert bits["key_terms"]["m_sal"] == 0.0625 and bits["value_bits"] == 16.0
    # r = 0: KIVI at 2 bits with 32 sinks and no channel index
    k0 = Kitty(high_ratio=0.0).average_bits(128, 32768)["key_bits"]
    assert k0 == pytest.approx((512 + 32768 * 2.25) / 32800, rel=1e-12)


def test_example16_schedule():
    m = Kitty(num_sink_tokens=32, value_bits=2, value_group_size=8)
    layer = m.new_layer(0, 1, 8)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 600, 8, generator=g)
    layer.prefill(x[:, :, :300], x[:, :, :300].clone())
    assert layer.quantized_tokens() == (256, 140)
    assert layer.k.residual.shape[2] == 12 and layer.v.residual.shape[2] == 128
    flushes = []
    for s in range(1, 301):
        t = x[:, :, 299 + s : 300 + s]
        before = layer.quantized_tokens()[0]
        layer.append(t, t.clone())
        layer.end_step()
        if layer.quantized_tokens()[0] != before:
            flushes.append(s)
    assert flushes == [117, 245]
    assert layer.quantized_tokens() == (512, 440)
    assert layer.k.residual.shape[2] == 56
    np.testing.assert_array_equal(layer.k.sinks.numpy(), x[:, :, :32].numpy())  # bit-exact


def test_bytes_hand_count():
    # B=1, H=1, D=8, G=R=4, N_s=2, r=0.25 -> 2 channels at 4 bits, 6 at 2 bits: 20 bits = 3 B/token
    m = Kitty(group_size=4, residual_length=4, num_sink_tokens=2, high_ratio=0.25)
    layer = m.new_layer(0, 1, 8)
    x = torch.randn(1, 1, 11, 8)
    layer.prefill(x, x.clone())
    # non-sink 9 > R: 8 quantized (2 pages), 1 residual
    assert layer.quantized_tokens() == (8, 0)
    nb = layer.nbytes()
    assert nb["codes"] == 8 * 3
    assert nb["scales"] == 2 * 8 * 2 * 2  # pages x channels x (scale, zero) x fp16
    assert nb["metadata"] == 2 * 8  # one uint8 ch_idx per channel per page
    assert nb["sinks"] == 2 * (2 * 8 * 4)  # K and V sinks, float32
    assert nb["residual"] == 1 * 8 * 4 + 9 * 8 * 4  # key residual 1, values 9 (value_bits 16)
    assert nb["total"] == 24 + 64 + 16 + 128 + 320


def test_selection_modes():
    x = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    x[..., 0] = 5.0 + torch.tensor([0.0, 0.01, 0.02, 0.03], dtype=torch.float64)  # big, steady
    x[..., 1] = torch.tensor([-2.0, 2.0, -2.0, 2.0], dtype=torch.float64)  # variance 4
    x[..., 2] = 0.1
    x[..., 3] = torch.tensor([0.0, 0.2, 0.0, 0.2], dtype=torch.float64)
    cfg = {"high_ratio": 0.25, "group_size": 4, "residual_length": 4}
    mag = Kitty(**cfg).key_codec(0, 4).encode(x)
    var = Kitty(**cfg, channel_selection="variance").key_codec(0, 4).encode(x)
    assert mag.channel_bits()[0, 0, 0].tolist() == [4, 2, 2, 2]
    assert var.channel_bits()[0, 0, 0].tolist() == [2, 4, 2, 2]
    pages = torch.randn(2, 3, 64, 16)
    rnd = Kitty(high_ratio=0.25, group_size=8, residual_length=8, channel_selection="random")
    a = rnd.key_codec(0, 16).encode(pages).channel_bits()
    b = rnd.key_codec(0, 16).encode(pages).channel_bits()
    assert torch.equal(a, b)  # seeded
    assert bool(((a == 4).sum(-1) == 4).all())  # floor(16 * 0.25) per page
    assert not torch.equal(a, rnd.key_codec(1, 16).encode(pages).channel_bits())


def test_fewer_prefill_tokens_than_sinks():
    m = Kitty(group_size=4, residual_length=4, num_sink_tokens=4)
    layer = m.new_layer(0, 1, 8)
    x = torch.randn(1, 1, 6, 8)
    layer.prefill(x[:, :, :3], x[:, :, :3].clone())
    assert layer.k.sinks.shape[2] == 3 and layer.seq_length == 3
    for t in range(3, 6):
        layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1].clone())
    layer.end_step()
    # sinks fill from the first tokens that arrive: 3 prompt + 1 decode token
    np.testing.assert_array_equal(layer.k.sinks.numpy(), x[:, :, :4].numpy())
    assert layer.k.residual.shape[2] == 2 and layer.seq_length == 6


def test_planted_channels_beat_uniform_two_bit():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 256, 128, generator=g, dtype=torch.float64)
    k[..., [5, 40, 77, 100]] *= 20.0
    errs = {}
    for name, method in [
        ("kitty", Kitty(num_sink_tokens=0)),
        ("uniform", kvbench.get_method("per-channel", bits=2)),
    ]:
        layer = method.new_layer(0, 2, 128, dtype=torch.float64)
        layer.prefill(k, k.clone())
        assert layer.quantized_tokens()[0] == 256
        errs[name] = ((layer.keys_values()[0] - k) ** 2).mean().item()
    # 4 promoted channels = the planted ones: their error drops by (3/15)^2
    assert errs["kitty"] < 0.5 * errs["uniform"]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("high_ratio", -0.1, "high_ratio"),
        ("high_ratio", 1.5, "high_ratio"),
        ("high_ratio", "0.5", "high_ratio"),
        ("low_bits", 4, "field 'low_bits': 4 is not allowed; allowed: integers below high_bits=4"),
        ("high_bits", 16, "high_bits"),
        ("channel_selection", "entropy", "channel_selection"),
        ("residual_length", 100, "residual_length"),
    ],
)
def test_bad_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        KittyConfig(**{field: value})
