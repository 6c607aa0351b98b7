"""ChanMix [RECON] (docs/methods.md#chanmix and docs/methods.md#average-bits): the 2.32-bit budget, class sizes, FP8 e4m3 scale/zero storage,
classification by a key statistic, calibration, hand byte counts and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbench
from kvbench.methods.chanmix import ChanMix, ChanMixConfig


def test_average_bits_table10():
    bits = kvbench.get_method("chanmix").average_bits(128, 32768)
    # floor: 12 channels each at 4, 3, 1 bits, 92 at 2: b_eff = 280/128 = 2.1875; + 16/128 (fp8)
    assert bits["key_bits"] == pytest.approx(2.3125, rel=1e-12)
    assert bits["key_bits"] == pytest.approx(2.32, abs=0.01)
    assert bits["key_terms"]["m_q"] == 16
    # round: 13 each, 89 at 2: 282/128 + 0.125 = 2.328125
    r = ChanMix(class_rounding="round").average_bits(128, 32768)["key_bits"]
    assert r == pytest.approx(2.328125, rel=1e-12) and r == pytest.approx(2.32, abs=0.01)
    assert ChanMix(key_scale_dtype="float16").key_bit_terms(128)["m_q"] == 32
    assert ChanMixConfig().class_counts(128) == [12, 12, 92, 12]
    assert ChanMixConfig(class_rounding="round").class_counts(128) == [13, 13, 89, 13]
    assert ChanMix.capabilities.reconstruction


def _grid_keys() -> torch.Tensor:
    """[1, 1, 4, 10]: channel c has a range that ranks it; all values on a grid where min and
    (max - min) / (2^b - 1) are exact in e4m3 for the class each channel falls in."""
    k = torch.zeros(4, 10, dtype=torch.float64)
    k[:, 3] = torch.tensor([-4.0, 11.0, 0.0, 7.0])  # range 15: highest -> 4 bits, scale 1
    k[:, 7] = torch.tensor([2.0, 9.0, 5.0, 3.0])  # range 7: second -> 3 bits, scale 1
    k[:, 0] = torch.tensor([0.5, 1.0, 0.5, 1.0])  # range 0.5: lowest -> 1 bit, scale 0.5
    for c in (1, 2, 4, 5, 6, 8, 9):  # range 3 (> 0.5, < 7): 2 bits, scale 1
        k[:, c] = torch.tensor([-1.0, 2.0, 0.0, 1.0]) + c
    return k[None, None]


def test_classification_fp8_storage_exact_grid_and_bytes():
    k = _grid_keys()
    m = ChanMix(group_size=4, residual_length=4)
    layer = m.new_layer(0, 1, 10, dtype=torch.float64)
    layer.prefill(k, k.clone())
    block = layer.k.block
    # D = 10: floor(0.1 * 10) = 1 channel each at 4, 3, 1 bits, 7 at 2 bits
    assert block.channel_bits()[0, 0, 0].tolist() == [1, 2, 2, 4, 2, 2, 2, 3, 2, 2]
    assert block.scale.dtype == block.zero.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(layer.keys_values()[0].numpy(), k.numpy())  # on the grid
    nb = layer.nbytes()
    assert nb["codes"] == 4 * 3  # 4 + 3 + 7*2 + 1 = 22 bits -> 3 bytes per token
    assert nb["scales"] == 10 * 2 * 1  # (scale, zero) per channel per page, 1 byte each
    assert nb["metadata"] == 10  # uint8 channel permutation, once per (b, h)


def test_score_options():
    k = torch.zeros(1, 1, 4, 10, dtype=torch.float64)
    k[..., 5] = 100.0 + torch.tensor([0.0, 0.1, 0.0, 0.1], dtype=torch.float64)  # big, narrow
    k[..., 2] = torch.tensor([-3.0, 3.0, -3.0, 3.0], dtype=torch.float64)  # wide
    k[..., 6] = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    for score, top in (("k-range", 2), ("k-magnitude", 5), ("k-absmax", 5)):
        layer = ChanMix(group_size=4, residual_length=4, score=score).new_layer(0, 1, 10)
        layer.prefill(k, k.clone())
        assert int(layer.k.block.channel_bits()[0, 0, 0, top]) == 4, score


def test_calibrate_api_and_record():
    g = torch.Generator().manual_seed(0)
    calib = torch.randn(2, 2, 8, 10, generator=g)
    calib[:, 0, :, 9] *= 50  # head 0: channel 9 widest in the calibration text
    calib[:, 1, :, 4] *= 50
    m = ChanMix(group_size=4, residual_length=4, classification="calibrated")
    assert m.needs_calibration and not ChanMix().needs_calibration
    with pytest.raises(ValueError, match="calibrate"):
        m.new_layer(0, 2, 10)
    assert m.calibrate({0: calib}, source="calib-text") is m
    assert m.calibration == {"source": "calib-text", "layers": [0], "tokens": {0: 16}}
    layer = m.new_layer(0, 2, 10)
    # evaluation keys favour other channels: the calibrated assignment is kept
    x = torch.randn(3, 2, 8, 10, generator=g)
    x[..., 0] *= 50
    layer.prefill(x, x.clone())
    bits = layer.k.block.channel_bits()
    assert bits.shape[0] == 1  # shared by the batch rows, stored once
    assert int(bits[0, 0, 0, 9]) == 4 and int(bits[0, 1, 0, 4]) == 4
    layer.repeat_batch(2)
    assert layer.keys_values()[0].shape == (6, 2, 8, 10)
    with pytest.raises(ValueError, match="layer 1 was not calibrated"):
        m.new_layer(1, 2, 10)
    with pytest.raises(ValueError, match="classification='calibrated'"):
        ChanMix().calibrate([calib])


def test_fp8_overflow_is_a_clear_error():
    layer = ChanMix(group_size=4, residual_length=4).new_layer(0, 1, 10)
    k = torch.randn(1, 1, 4, 10)
    k[..., 3] -= 1000.0
    with pytest.raises(ValueError, match="overflows"):
        layer.prefill(k, k.clone())
    ok = ChanMix(group_size=4, residual_length=4, key_scale_dtype="float16").new_layer(0, 1, 10)
    ok.prefill(k, k.clone())
    assert ok.quantized_tokens() == (4, 0)


def test_planted_channels_beat_uniform_two_bit():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 256, 128, generator=g, dtype=torch.float64)
    k[..., [5, 40, 77, 100]] *= 20.0
    errs = []
    for method in (ChanMix(key_scale_dtype="float16"), kvbench.get_method("per-channel", bits=2)):
        layer = method.new_layer(0, 2, 128, dtype=torch.float64)
        layer.prefill(k, k.clone())
        errs.append(((layer.keys_values()[0] - k) ** 2).mean().item())
    assert errs[0] < 0.5 * errs[1]


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"outlier_bits": 4}, "strictly decreasing"),
        ({"subnormal_bits": 2}, "strictly decreasing"),
        ({"retrieval_bits": 16}, "retrieval_bits"),
        ({"retrieval_ratio": 1.2}, "retrieval_ratio"),
        ({"subnormal_ratio": -0.1}, "subnormal_ratio"),
        ({"retrieval_ratio": 0.5, "outlier_ratio": 0.5, "subnormal_ratio": 0.1}, "<= 1"),
        ({"class_rounding": "ceil"}, "class_rounding"),
        ({"key_scale_dtype": "float8_e5m2"}, "key_scale_dtype"),
        ({"classification": "offline"}, "classification"),
        ({"score": "qk-pair-norm"}, "score"),
    ],
)
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        ChanMixConfig(**cfg)
