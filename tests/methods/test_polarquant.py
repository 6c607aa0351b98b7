"""PolarQuant (Wu et al., arXiv 2502.00527; docs/methods.md#polarquant [RECON]): right values from docs/methods.md#worked-examples
Example 15, hand byte counts, and float64 numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvbench
from kvbench.cache.finite import nonfinite
from kvbench.methods.polarquant import PolarQuant, PolarQuantConfig, unwrap_angles


def _layer(head_dim: int = 2, heads: int = 1, **cfg):
    cfg = {"group_size": 4, "residual_length": 4, "scale_dtype": "float32"} | cfg
    return PolarQuant(**cfg).new_layer(0, heads, head_dim)


def _keys_from_pair(x, y) -> torch.Tensor:
    """One pair over tokens: channel 0 = x, channel 1 = y (rotate-half with D = 2)."""
    return torch.stack([torch.tensor(x), torch.tensor(y)], dim=-1)[None, None].float()


EX15_X, EX15_Y = [1.0, 0.0, -0.5, 0.3], [0.0, 1.0, 0.5, -0.4]


def test_example15_codes_reconstruction_and_mse():
    k = _keys_from_pair(EX15_X, EX15_Y)
    layer = _layer()
    layer.prefill(k, k.clone())
    assert layer.quantized_tokens() == (
        4,
        0,
    )  # 4 % R == 0: all keys quantized (docs/methods.md#kivi)
    block = layer.k.block
    assert block.radius.unpacked_codes().flatten().tolist() == [3, 3, 1, 0]
    assert block.angle.unpacked_codes().flatten().tolist() == [1, 2, 3, 0]
    keys, values = layer.keys_values()
    expect_x = [0.986054, 0.304200, -0.471405, 0.3]
    expect_y = [0.166423, 0.952608, 0.471405, -0.4]
    np.testing.assert_allclose(keys[0, 0, :, 0].numpy(), expect_x, atol=2e-6)
    np.testing.assert_allclose(keys[0, 0, :, 1].numpy(), expect_y, atol=2e-6)
    assert float(((keys - k) ** 2).mean()) == pytest.approx(0.015539, abs=1e-6)
    assert torch.equal(values, k)  # value_bits=16: values untouched


def test_circular_equals_minmax_when_largest_gap_is_the_wrap():
    # Example 15's angles: gaps 0.93, 1.57, 0.79 and the wrap gap 3.0 (largest): no change
    k = _keys_from_pair(EX15_X, EX15_Y)
    a, b = _layer(), _layer(angle_wrap="circular")
    a.prefill(k, k)
    b.prefill(k, k)
    assert torch.equal(a.keys_values()[0], b.keys_values()[0])


def _np_polar(x, y, rb, ab, circular):
    """float64 reference: per-pair polar min-max over one group (round half to even)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    r, t = np.hypot(x, y), np.arctan2(y, x)
    if circular:  # brute force: the start angle whose unwrapped span is smallest
        spans = [((t - a) % (2 * np.pi)).max() for a in t]
        a = t[int(np.argmin(spans))]
        t = a + (t - a) % (2 * np.pi)

    def q(v, bits):
        s = (v.max() - v.min()) / (2**bits - 1)
        return np.round((v - v.min()) / s) * s + v.min()

    rq, tq = q(r, rb), q(t, ab)
    return rq * np.cos(tq), rq * np.sin(tq)


def test_circular_wrap_matches_numpy_and_beats_minmax_across_pi():
    ang = np.array([2.6, -3.1, 3.1, -2.6])
    rad = np.array([1.05, 0.8, 1.2, 0.9])  # no .5 ties in the radius codes
    x, y = (rad * np.cos(ang)).tolist(), (rad * np.sin(ang)).tolist()
    k = _keys_from_pair(x, y)
    out = {}
    for wrap in ("minmax", "circular"):
        layer = _layer(angle_wrap=wrap)
        layer.prefill(k, k)
        out[wrap] = layer.keys_values()[0][0, 0].double().numpy()
        ex, ey = _np_polar(x, y, 2, 2, wrap == "circular")
        np.testing.assert_allclose(out[wrap][:, 0], ex, atol=1e-5)
        np.testing.assert_allclose(out[wrap][:, 1], ey, atol=1e-5)
    ang_err = {w: np.abs(np.arctan2(o[:, 1], o[:, 0]) - ang).max() for w, o in out.items()}
    # minmax: levels -3.1, -1.03, 1.03, 3.1 -> +-2.6 err 0.5; circular: span 1.083, err <= 0.14
    assert ang_err["circular"] < 0.15 and ang_err["minmax"] == pytest.approx(0.5, abs=1e-5)


def test_unwrap_angles_hand_values():
    t = torch.tensor([[3.0, -3.0, 3.1, -3.1], [0.0, 1.0, 2.0, -1.0]], dtype=torch.float64)
    u = unwrap_angles(t)
    two_pi = 2 * math.pi
    expect = [[3.0, two_pi - 3.0, 3.1, two_pi - 3.1], [0.0, 1.0, 2.0, -1.0]]
    np.testing.assert_allclose(u.numpy(), expect, atol=1e-12)


def test_interleaved_equals_permuted_rotate_half():
    g = torch.Generator().manual_seed(0)
    k_rh = torch.randn(2, 3, 8, 8, generator=g)
    perm = [0, 4, 1, 5, 2, 6, 3, 7]  # interleaved channel 2i <- i, 2i+1 <- i + D/2
    k_il = k_rh[..., perm]
    a, b = _layer(8, 3), _layer(8, 3, pairing="interleaved")
    a.prefill(k_rh, k_rh)
    b.prefill(k_il, k_il)
    assert torch.equal(b.keys_values()[0], a.keys_values()[0][..., perm])


def test_average_bits_defaults_and_other_widths():
    bits = PolarQuant().average_bits(128, 32768)
    assert bits["key_bits"] == pytest.approx(2.25, abs=0.005)  # docs/methods.md#table-10-check
    assert bits["value_bits"] == 16
    wide = PolarQuant(radius_bits=4, angle_bits=4).average_bits(128, 32768)
    assert wide["key_bits"] == pytest.approx(4 + 32 / 128)
    g64 = PolarQuant(group_size=64, residual_length=128).average_bits(128, 32768)
    assert g64["key_bits"] == pytest.approx(2.5)


def test_bytes_hand_count():
    # B=2, H=3, D=8 (4 pairs), G=R=4, 8 prompt tokens, fp16 inputs and scales
    k = torch.randn(2, 3, 8, 8).half()
    layer = PolarQuant(group_size=4, residual_length=4).new_layer(0, 3, 8)
    layer.prefill(k, k)
    nb = layer.nbytes()
    # per token: r codes 4 pairs x 2 bits = 1 byte, theta 1 byte -> 2 bytes x 8 tokens x 6 heads
    assert nb["codes"] == 96
    # per group and pair: (scale, zero) for r and theta = 4 fp16 = 8 bytes; 2 groups x 4 pairs x 6
    assert nb["scales"] == 384
    assert nb["residual"] == 8 * 8 * 2 * 6 and nb["key_total"] == 480  # values fp16, keys none


def test_flushes_hand_groups_of_g_tokens():
    k = torch.randn(1, 1, 8, 4)
    layer = _layer(4)
    layer.prefill(k[:, :, :6], k[:, :, :6])
    assert layer.quantized_tokens()[0] == 4 and layer.k.residual.shape[2] == 2
    layer.append(k[:, :, 6:7], k[:, :, 6:7])
    layer.end_step()
    assert layer.quantized_tokens()[0] == 4
    layer.append(k[:, :, 7:8], k[:, :, 7:8])
    layer.end_step()
    assert layer.quantized_tokens()[0] == 8 and layer.k.residual is None
    assert layer.k.block.radius.group_len == [4, 4]


def test_crop_index_batch_and_nan_group():
    k = torch.randn(2, 1, 8, 4)
    k[1, 0, 5, 0] = float("nan")  # pair 0 = channels (0, 2), second group of 4 tokens
    layer = _layer(4)
    with nonfinite("propagate"):  # the opt-out of kvbench.cache.finite
        layer.prefill(k, k)
    full = layer.keys_values()[0]
    assert torch.isnan(full[1, 0, 4:8][:, [0, 2]]).all()  # the NaN group propagates NaN
    assert torch.isfinite(full[1, 0, 4:8][:, [1, 3]]).all() and torch.isfinite(full[1, :, :4]).all()
    assert torch.isfinite(full[0]).all()
    layer.index_batch(torch.tensor([0]))
    assert torch.equal(layer.keys_values()[0], full[:1])
    layer.crop(5)
    assert layer.seq_length == 5 and torch.equal(layer.keys_values()[0], full[:1, :, :5])


def test_registry_builds_polarquant():
    m = kvbench.get_method("polarquant", angle_wrap="circular")
    assert isinstance(m, PolarQuant) and m.capabilities.reconstruction


@pytest.mark.parametrize(
    "cfg",
    [
        {"radius_bits": 0},
        {"radius_bits": 9},
        {"radius_bits": 16},
        {"angle_bits": True},
        {"angle_bits": 2.0},
        {"pairing": "gptj"},
        {"angle_wrap": "unwrap"},
        {"residual_length": 100},
    ],
)
def test_bad_config(cfg):
    with pytest.raises(ValueError):
        PolarQuantConfig(**cfg)


def test_odd_head_dim_rejected():
    with pytest.raises(ValueError, match="even"):
        PolarQuant().new_layer(0, 1, 7)
    with pytest.raises(ValueError, match="even"):
        PolarQuant().average_bits(head_dim=7)
