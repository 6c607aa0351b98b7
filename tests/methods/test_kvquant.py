"""KVQuant-lite (methods/kvquant.py): right values from hand counts and float64 numpy references.

References used here, none computed by the code under test:
* RoPE: the rotate-half / interleaved formulas in float64 numpy (``rope`` also matched
  transformers' ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb`` bit for bit when checked by
  hand; that import takes ~10 s, too slow for this file).
* thresholds: ``np.percentile`` at 100 t and 100 (1 - t), t = 1 - (1 - tau) / 2 (docs/methods.md#kvquant).
* bits: docs/methods.md#average-bits written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbench
from kvbench.cache.finite import nonfinite
from kvbench.cache.rope import rope
from kvbench.methods.kvquant import KVQuant, lloyd_levels

THETA = 1e4


def np_rope(
    x: np.ndarray,
    start: int,
    theta: float = THETA,
    inverse: bool = False,
    layout: str = "rotate_half",
) -> np.ndarray:
    """Float64 RoPE of ``x [..., n, D]`` at positions start..start+n-1."""
    x = np.asarray(x, dtype=np.float64)
    n, d = x.shape[-2:]
    ang = np.arange(start, start + n)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(ang), np.sin(ang) * (-1.0 if inverse else 1.0)
    if layout == "rotate_half":
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    out = np.empty_like(x)
    a, b = x[..., 0::2], x[..., 1::2]
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def make(**kw) -> KVQuant:
    return KVQuant(**{"rope_theta": THETA, **kw})


# ------------------------------------------------------------------------------------ RoPE


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_rope_matches_float64_formula(layout):
    x = torch.randn(2, 3, 40, 8, generator=torch.Generator().manual_seed(1))
    want = np_rope(x.numpy(), 7, layout=layout)
    got = rope(x, 7, THETA, layout).double().numpy()
    assert np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_unrotate_after_rotate_is_identity(layout):
    x = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(3))
    for start in (0, 1000, 8000):
        back = rope(rope(x, start, 1e5, layout), start, 1e5, layout, inverse=True)
        assert (back - x).abs().max() < 1e-5
        assert (rope(x, start, 1e5, layout) - x).abs().max() > 0.1  # it did rotate


# ------------------------------------------------------------------------------------ calibration


def calib_keys(seed: int, n: int = 2, h: int = 2, t: int = 101, d: int = 8) -> torch.Tensor:
    """Post-RoPE calibration keys (pre-RoPE N(0, 1) scaled per channel, then rotated)."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(n, h, t, d, generator=g) * torch.linspace(0.5, 3.0, d)
    return torch.from_numpy(np_rope(pre.numpy(), 0)).float()


def np_thresholds(k_post: np.ndarray, tau: float, sinks: int, pre_rope: bool):
    x = np_rope(k_post, 0, inverse=True) if pre_rope else np.asarray(k_post, np.float64)
    x = x[:, :, sinks:].transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])  # [H, N*T, D]
    t = 1 - (1 - tau) / 2
    up, lo = np.percentile(x, 100 * t, axis=1), np.percentile(x, 100 * (1 - t), axis=1)
    return (up + lo) / 2, (up - lo) / 2, x


def test_thresholds_post_rope_equal_numpy_percentiles_exactly():
    k = calib_keys(0)
    m = make(pre_rope=False, nuq=False, num_sink_tokens=1)
    m.calibrate({3: k})
    center, half, _ = np_thresholds(k.numpy(), 0.99, 1, pre_rope=False)
    c, h, _ = m.calibration[3]
    assert c.dtype == h.dtype == torch.float16
    assert torch.equal(c, torch.from_numpy(center).half())
    assert torch.equal(h, torch.from_numpy(half).half())


def test_thresholds_pre_rope_from_unrotated_calibration_keys():
    k = calib_keys(1)
    m = make(nuq=False, num_sink_tokens=1)
    m.calibrate({0: k})
    center, half, _ = np_thresholds(k.numpy(), 0.99, 1, pre_rope=True)
    c, h, _ = m.calibration[0]
    np.testing.assert_allclose(c.double().numpy(), center, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(h.double().numpy(), half, rtol=2e-3)
    # the pre-RoPE per-channel spread was 0.5..3.0 (post-RoPE mixes pairs): half tracks it
    assert h[:, 0].float().mean() < h[:, -1].float().mean()


def test_thresholds_come_from_calibration_only_not_the_evaluation_text():
    k = calib_keys(2)
    m = make(nuq=True)
    assert m.calibrate({0: k}, {0: k}, source="calib[:101]") is m  # the runner's call
    assert m.calibration_source == "calib[:101]"
    c0, h0, lut0 = (t.clone() for t in m.calibration[0])
    seen = []
    for seed, scale in ((10, 1.0), (11, 50.0)):  # two very different evaluation texts
        ev = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(seed)) * scale
        layer = m.new_layer(0, 2, 8)
        layer.prefill(ev, ev)
        seen.append((layer.k.codec.center, layer.k.codec.half, layer.k.block.lut))
    for c, h, lut in seen:
        assert torch.equal(c, c0) and torch.equal(h, h0) and torch.equal(lut, lut0)
    assert torch.equal(m.calibration[0][0], c0)  # calibration untouched by the caches


def test_uncalibrated_layer_raises_and_head_mismatch_raises():
    m = make()
    with pytest.raises(RuntimeError, match="not calibrated"):
        m.new_layer(0, 2, 8)
    m.calibrate({0: calib_keys(3)})
    with pytest.raises(RuntimeError, match="layer 1 is not calibrated"):
        m.new_layer(1, 2, 8)
    with pytest.raises(ValueError, match="calibrated for"):
        m.new_layer(0, 4, 8)
    assert m.capabilities.needs_calibration


# ------------------------------------------------------------------------------------ NUQ


def test_nuq_lut_is_the_four_calibration_levels_when_data_has_four_values():
    # every channel cycles through {-2, -1, 0.5, 2}; tau = 1: thresholds = min/max, so
    # center 0, half 2, normalized levels {-1, -0.5, 0.25, 1}: 2-bit k-means finds them exactly
    vals = torch.tensor([-2.0, -1.0, 0.5, 2.0]).repeat(25)
    k = vals.view(1, 1, 100, 1).expand(1, 2, 100, 4).contiguous()
    m = make(bits=2, nuq=True, pre_rope=False, sparsity_threshold=1.0, num_sink_tokens=0)
    m.calibrate({0: k})
    c, h, lut = m.calibration[0]
    assert torch.equal(c, torch.zeros(2, 4, dtype=torch.float16))
    assert torch.equal(h, torch.full((2, 4), 2.0, dtype=torch.float16))
    assert lut.tolist() == [-1.0, -0.5, 0.25, 1.0]
    layer = m.new_layer(0, 2, 4)
    ev = torch.tensor([-1.9, 0.4, 1.0, 5.0]).view(1, 1, 4, 1).expand(1, 2, 4, 4).contiguous()
    layer.prefill(ev, ev)
    # nearest levels -2, 0.5, 0.5 (1.0 is nearer 0.5 than 2), 5.0 clamps to 2 (tau = 1)
    want = torch.tensor([-2.0, 0.5, 0.5, 2.0]).view(1, 1, 4, 1).expand(1, 2, 4, 4)
    assert torch.equal(layer.keys_values()[0], want)


def np_lloyd(x: np.ndarray, k: int, iters: int = 2000) -> np.ndarray:
    """A separate float64 1-D k-means: every value assigned to its nearest centroid by argmin,
    centroids moved to the means, from the order statistics at quantiles (i + 1/2) / k."""
    x = np.sort(np.asarray(x, np.float64).ravel())
    c = x[((np.arange(k) + 0.5) * x.size / k).astype(np.int64)]
    for _ in range(iters):
        near = np.abs(x[:, None] - c[None, :]).argmin(1)
        c = np.array([x[near == i].mean() if np.any(near == i) else c[i] for i in range(k)])
    return np.sort(c)


def test_lloyd_levels_equal_a_separate_argmin_kmeans():
    g = torch.Generator().manual_seed(3)
    u = (torch.randn(4000, generator=g, dtype=torch.float64) * 0.4).clamp(-1, 1)
    for k in (4, 8):
        got = lloyd_levels(u, k, 1000).numpy()
        np.testing.assert_allclose(got, np_lloyd(u.numpy(), k), rtol=0, atol=1e-9)
        # a fixed point: each level is the mean of the values nearest to it
        near = np.abs(u.numpy()[:, None] - got[None, :]).argmin(1)
        means = np.array([u.numpy()[near == i].mean() for i in range(k)])
        np.testing.assert_allclose(got, means, rtol=0, atol=1e-9)


def test_lloyd_levels_by_hand_and_errors():
    # two tight pairs of clusters: 2-means = the two pair means; 4-means = the four values
    u = torch.tensor([-1.0, -0.9, 0.9, 1.0], dtype=torch.float64).repeat_interleave(50)
    assert lloyd_levels(u, 2, 100).tolist() == pytest.approx([-0.95, 0.95], abs=1e-12)
    assert lloyd_levels(u, 4, 100).tolist() == pytest.approx([-1.0, -0.9, 0.9, 1.0], abs=1e-12)
    # no step: the quantile start, sorted values at ranks 50 and 150 of 200 (-0.9 and 1.0)
    assert lloyd_levels(u, 2, 0).tolist() == [-0.9, 1.0]
    # an empty cell keeps its level: 3-means of ten 0s and ten 1s start at ranks 3, 10, 16
    # (0, 1, 1); the cell between the two levels at 1 holds no value, so they stay
    two = torch.tensor([0.0] * 10 + [1.0] * 10, dtype=torch.float64)
    assert lloyd_levels(two, 3, 100).tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="k-means needs >= 8 .* got 5"):
        lloyd_levels(torch.zeros(5), 8, 10)


def test_lloyd_levels_move_continuously_with_their_data():
    """Float noise (another instruction set, another thread count) or one value crossing an
    outlier threshold moves the table by about its own size, never to another optimum."""
    g = torch.Generator().manual_seed(4)
    u = (torch.randn(200_000, generator=g, dtype=torch.float64) * 0.35).clamp(-1, 1)
    base = lloyd_levels(u, 16, 1000)
    noisy = lloyd_levels(
        u * (1 + 1e-6 * torch.randn(u.shape, generator=g, dtype=u.dtype)), 16, 1000
    )
    dropped = lloyd_levels(u[1:], 16, 1000)
    assert (noisy - base).abs().max() < 1e-5 and (dropped - base).abs().max() < 1e-4


def test_nuq_lut_is_lloyd_levels_of_the_normalized_non_outliers_and_reproducible():
    k = calib_keys(4, n=2, t=301, d=8)
    luts = []
    for _ in range(2):
        m = make(bits=3, nuq=True, pre_rope=False)
        m.calibrate({0: k})
        luts.append(m.calibration[0][2])
    assert torch.equal(luts[0], luts[1])
    lut = luts[0].double().numpy()
    assert lut.shape == (8,) and np.all(np.diff(lut) > 0) and -1 <= lut[0] and lut[-1] <= 1
    # independent: numpy percentiles for the thresholds (float16 as stored), the separate
    # k-means above on the non-outliers
    center, half, x = np_thresholds(k.numpy(), 0.99, 1, pre_rope=False)
    center, half = center.astype(np.float16).astype(np.float64), half.astype(np.float16)
    u = (x - center[:, None, :]) / half.astype(np.float64)[:, None, :]
    want = np_lloyd(u[np.abs(u) <= 1], 8).astype(np.float16)
    np.testing.assert_array_equal(luts[0].numpy(), want)


# -------------------------------------------------------------------------------- outliers, bytes


def grid_calibration(d: int = 4, h: int = 2) -> torch.Tensor:
    """Channels take linspace(-1, 1, 201) (after 1 sink token): at tau = 0.99 the thresholds
    are percentile(99.5) = 0.99 and percentile(0.5) = -0.99: center 0, half 0.99."""
    col = torch.cat([torch.zeros(1), torch.linspace(-1, 1, 201)])
    return col.view(1, 1, 202, 1).expand(1, h, 202, d).contiguous()


def test_outliers_restored_exactly_and_bytes_hand_count():
    m = make(bits=4, nuq=False, pre_rope=False, num_sink_tokens=1, residual_length=0)
    m.calibrate({0: grid_calibration()})
    c, h, lut = m.calibration[0]
    assert torch.equal(c, torch.zeros(2, 4, dtype=torch.float16))
    assert torch.equal(h, torch.full((2, 4), 0.99, dtype=torch.float16))
    g = torch.Generator().manual_seed(7)
    k = torch.rand(1, 2, 6, 4, generator=g) * 1.6 - 0.8  # inside (-0.99, 0.99)
    k[0, 0, 2, 1], k[0, 1, 4, 3], k[0, 1, 5, 0] = 5.0, -3.25, 1.5  # fp16-exact outliers
    k[0, 0, 0, 0] = 7.0  # in the sink token: stored full precision, not an outlier
    layer = m.new_layer(0, 2, 4)
    layer.prefill(k, k.clone())
    keys, _ = layer.keys_values()
    assert keys[0, 0, 2, 1] == 5.0 and keys[0, 1, 4, 3] == -3.25 and keys[0, 1, 5, 0] == 1.5
    assert torch.equal(keys[:, :, 0], k[:, :, 0])
    # the rest: uniform 16 levels on [-0.99, 0.99] (stored half 0.98974609375), error <= step/2
    step = 2 * 0.98974609375 / 15
    assert (keys - k).abs().max() <= step / 2 + 1e-6
    blk = layer.k.block
    assert blk.out_idx.dtype == torch.int32 and blk.out_val.dtype == torch.float16
    assert sorted(blk.out_val.tolist()) == [-3.25, 1.5, 5.0]
    # hand count, 5 quantized tokens x 2 heads x 4 channels at 4 bits:
    # codes 2*5*ceil(16/8) = 20 B; center + half 2*(2*4*2) = 32 B; LUT 16 fp16 = 32 B;
    # 3 outliers x (4 B index + 2 B value) = 18 B; key sink 1 token fp32 2*4*4 = 32 B;
    # values full precision: sink 32 B + residual 5 tokens 2*5*4*4 = 160 B
    nb = layer.nbytes()
    assert (nb["codes"], nb["scales"], nb["metadata"]) == (20, 32, 50)
    assert (nb["sinks"], nb["residual"], nb["key_total"], nb["total"]) == (64, 160, 134, 326)


@pytest.mark.parametrize("pre_rope", [False, True])
def test_block_ops_keep_outliers_crop_and_batch(pre_rope):
    m = make(bits=3, nuq=False, pre_rope=pre_rope, num_sink_tokens=1)
    m.calibrate({0: grid_calibration(d=4)})
    g = torch.Generator().manual_seed(8)
    k = torch.rand(2, 2, 9, 4, generator=g) - 0.5
    k[0, 1, 3, 2], k[1, 0, 6, 1] = 9.0, -8.0
    layer = m.new_layer(0, 2, 4)
    layer.prefill(k, k)
    full, _ = layer.keys_values()
    n_out = layer.k.block.out_idx.numel()
    assert n_out == 2 or pre_rope  # un-rotation spreads the two outliers over their pairs
    layer.repeat_batch(2)  # rows 0, 0, 1, 1
    rep, _ = layer.keys_values()
    assert torch.equal(rep[0], full[0]) and torch.equal(rep[3], full[1])
    layer.index_batch(torch.tensor([3]))
    assert torch.equal(layer.keys_values()[0][0], full[1])
    layer.crop(5)
    assert layer.seq_length == 5 and torch.equal(layer.keys_values()[0][0], full[1, :, :5])
    if not pre_rope:  # row 1's outlier sat at token 6: cropped away
        assert layer.k.block.out_idx.numel() == 0


def test_pre_rope_quantize_then_rerotate_is_within_quantization_error():
    m = make(bits=4, nuq=False, pre_rope=True, num_sink_tokens=1, residual_length=0)
    m.calibrate({0: calib_keys(5, t=201)})
    c, h, _ = (t.double().numpy() for t in m.calibration[0])
    g = torch.Generator().manual_seed(9)
    hh, cc = torch.from_numpy(h).float()[:, None, :], torch.from_numpy(c).float()[:, None, :]
    pre = (torch.rand(1, 2, 30, 8, generator=g) * 2 - 1) * 0.9 * hh + cc  # no outliers
    post = torch.from_numpy(np_rope(pre.numpy(), 0)).float()
    layer = m.new_layer(0, 2, 8)
    layer.prefill(post[:, :, :20], post[:, :, :20])
    for t in range(20, 30):
        layer.append(post[:, :, t : t + 1], post[:, :, t : t + 1])
    layer.end_step()
    assert layer.quantized_tokens() == (29, 0)
    got = layer.keys_values()[0].double().numpy()
    # per RoPE pair (i, i + 4), the rotation keeps the error norm: <= half the two steps
    step = 2 * h / 15  # [H, D]
    bound = 0.5 * np.sqrt(step[:, :4] ** 2 + step[:, 4:] ** 2)  # [H, 4]
    err = got - post.double().numpy()
    pair_err = np.sqrt(err[..., :4] ** 2 + err[..., 4:] ** 2)[0]  # [H, T, 4]
    assert np.all(pair_err[:, 1:] <= bound[:, None, :] + 1e-5)
    assert np.abs(err[0, :, 0]).max() == 0  # sink exact
    # the stored codes are the pre-RoPE ones: nearest uniform level of the unrotated keys
    pre_np = np_rope(post.numpy(), 0, inverse=True)[:, :, 1:]
    want_codes = np.clip(np.round((pre_np - (c - h)[:, None, :]) / step[:, None, :]), 0, 15)
    blk = layer.k.block
    from kvbench.cache.quant import unpack_bits

    got_codes = unpack_bits(blk.codes, 4, 8).numpy()
    assert (got_codes == want_codes).mean() > 0.99  # float32 vs float64 near-ties only


def test_nonfinite_keys_propagate_per_element():
    m = make(bits=4, nuq=False, pre_rope=False, num_sink_tokens=0)
    m.calibrate({0: grid_calibration()})
    k = torch.zeros(1, 2, 3, 4)
    k[0, 0, 1, 2], k[0, 1, 2, 0] = float("nan"), float("inf")
    layer = m.new_layer(0, 2, 4)
    with nonfinite("propagate"):  # the opt-out of kvbench.cache.finite
        layer.prefill(k, k)
    out = layer.keys_values()[0]
    assert torch.isnan(out[0, 0, 1, 2]) and out[0, 1, 2, 0] == float("inf")
    assert torch.isfinite(out).sum() == 22


# ------------------------------------------------------------------------------------ bits, config


def test_nominal_bits_add_the_outlier_cost():
    # docs/methods.md#average-bits: (N_s*16 + T_q*(b + (1 - tau)*(16 + 32))) / (T_q + N_s), no per-group scales
    got = make(num_sink_tokens=0).average_bits(128, 32768)["key_bits"]
    assert got == pytest.approx(4 + 0.01 * 48)
    got = make(bits=2, num_sink_tokens=1).average_bits(64, 32768)["key_bits"]
    assert got == pytest.approx((16 + 32768 * 2.48) / 32769)
    assert make(sparsity_threshold=1.0, num_sink_tokens=0).average_bits(64)["key_bits"] == 4.0


def test_registered_and_defaults():
    m = kvbench.get_method("kvquant")
    assert isinstance(m, KVQuant)
    c = m.config
    assert (c.bits, c.sparsity_threshold, c.nuq, c.pre_rope, c.num_sink_tokens) == (
        4,
        0.99,
        True,
        True,
        1,
    )
    assert (c.residual_length, c.rope_theta, c.value_bits) == (0, None, 16)
    assert m.capabilities.reconstruction
    # the runner fills the RoPE base from the model (SmolLM2: 1e5); an explicit value is kept
    assert m.for_model({"rope_theta": 100000.0}).config.rope_theta == 100000.0
    m2 = kvbench.get_method("kvquant", rope_theta=5e5)
    assert m2.for_model({"rope_theta": 100000.0}).config.rope_theta == 5e5


@pytest.mark.parametrize(
    "field, value",
    [
        ("bits", 5),
        ("bits", True),
        ("bits", 1),
        ("sparsity_threshold", 0.5),
        ("sparsity_threshold", 1.5),
        ("sparsity_threshold", "0.99"),
        ("nuq", 1),
        ("pre_rope", "yes"),
        ("rope_theta", 0),
        ("rope_theta", -5.0),
        ("rope_theta", True),
        ("rope_layout", "neox"),
    ],
)
def test_bad_config_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KVQuant(**{field: value})


def test_bad_calibration_inputs_raise():
    m = make(num_sink_tokens=2)
    with pytest.raises(ValueError, match="keys_by_layer"):
        m.calibrate({0: torch.randn(2, 10, 8)})  # 3-D
    with pytest.raises(ValueError, match="num_sink_tokens"):
        m.calibrate({0: torch.randn(1, 2, 2, 8)})  # only sink tokens
    with pytest.raises(ValueError, match="even D"):
        m.calibrate({0: torch.randn(1, 2, 10, 7)})
    with pytest.raises(ValueError, match="k-means"):
        make(bits=4, num_sink_tokens=0).calibrate({0: torch.randn(1, 1, 3, 2)})


def test_values_use_the_core_per_token_codec_when_quantized():
    m = make(pre_rope=False, nuq=False, value_bits=2, num_sink_tokens=0, value_group_size=4)
    m.calibrate({0: grid_calibration()})
    # docs/methods.md#average-bits for KIVI-style values: 2 code bits + 32 bits of (scale, min) per 4 channels
    assert m.average_bits(4, 1000)["value_bits"] == pytest.approx(2 + 32 / 4)
    v = (
        torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
        .view(1, 1, 2, 4)
        .repeat(1, 2, 1, 1)
    )
    layer = m.new_layer(0, 2, 4)
    layer.prefill(torch.zeros(1, 2, 2, 4), v)
    # per-token min-max at 2 bits: [0, 1, 2, 3] -> min 0, scale 1, exact; a constant token is
    # exact (zero range); bytes: codes 2 heads x 2 tokens x 1 B, fp16 scale + min 2 x 2 x 2 x 2 B
    assert layer.quantized_tokens() == (2, 2) and torch.equal(layer.keys_values()[1], v)
    assert layer.nbytes()["value_total"] == 4 + 16
