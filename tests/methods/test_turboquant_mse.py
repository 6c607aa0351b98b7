"""TurboQuant-MSE: Lloyd-Max codebooks against docs/methods.md#worked-example-12 (and the d = 3 uniform law by
hand), measured MSE on random unit vectors, a float64 numpy reference of the quantizer, bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvbench
from kvbench.cache.finite import nonfinite
from kvbench.cache.quant import unpack_bits
from kvbench.methods.turboquant_mse import (
    TurboQuantMSE,
    TurboQuantMSEConfig,
    haar_rotation,
    lloyd_max_codebook,
)

# Example 12, N(0, 1): positive centroids and D_mse (b = 4: innermost and outermost only)
EX12_GAUSS = {
    1: ([0.797885], 0.363380),
    2: ([0.452780, 1.510418], 0.117482),
    3: ([0.245094, 0.756005, 1.343909, 2.151946], 0.034548),
    4: ([0.128395, 2.732590], 0.009501),
}
# Example 12, exact law of a coordinate of a random unit vector in d = 128 (centroids * sqrt(d))
EX12_D128 = {1: ([0.799444], 0.360889), 2: ([0.452453, 1.505193], 0.116000)}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_example12_gaussian_codebook(bits):
    c, dist = lloyd_max_codebook(bits)
    assert len(c) == 2**bits
    np.testing.assert_allclose(c, -c[::-1], atol=1e-12)  # symmetric
    pos = c[c > 0]
    expect, d_expect = EX12_GAUSS[bits]
    got = pos if bits < 4 else pos[[0, -1]]
    np.testing.assert_allclose(got, expect, atol=1e-4)
    assert abs(dist - d_expect) < 1e-4
    assert dist <= math.sqrt(3) * math.pi / 2 * 4.0**-bits  # Theorem 1's upper bound


@pytest.mark.parametrize("bits", [1, 2])
def test_example12_exact_law_d128(bits):
    c, dist = lloyd_max_codebook(bits, 128)
    expect, d_expect = EX12_D128[bits]
    np.testing.assert_allclose(c[c > 0] * math.sqrt(128), expect, atol=1e-4)
    assert abs(dist - d_expect) < 1e-4


def test_exact_law_d3_is_uniform_by_hand():
    # in R^3 a coordinate of a random unit vector is uniform on [-1, 1] (Archimedes): the b-bit
    # Lloyd-Max quantizer is uniform with cells 2/2^b, MSE (2/2^b)^2/12 per coordinate
    c, dist = lloyd_max_codebook(2, 3)
    np.testing.assert_allclose(c, [-0.75, -0.25, 0.25, 0.75], atol=1e-9)
    assert dist == pytest.approx(3 * 0.5**2 / 12, abs=1e-9)
    c, dist = lloyd_max_codebook(1, 3)
    np.testing.assert_allclose(c, [-0.5, 0.5], atol=1e-9)
    assert dist == pytest.approx(3 / 12, abs=1e-9)


def _unit_vectors(n: int, d: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(1, 1, n, d, generator=torch.Generator().manual_seed(seed))
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_measured_mse_on_random_unit_vectors(bits):
    x = _unit_vectors(2000, 128)
    layer = TurboQuantMSE(bits=bits).new_layer(0, 1, 128)
    layer.prefill(x, x.clone())
    keys, _ = layer.keys_values(torch.float32)
    mse = ((keys - x) ** 2).sum(-1).mean().item()  # E||x - x~||^2 for unit x
    assert mse == pytest.approx(lloyd_max_codebook(bits, 128)[1], rel=0.02)
    if bits in EX12_D128:
        assert mse == pytest.approx(EX12_D128[bits][1], rel=0.02)
    else:  # Example 12 gives the N(0, 1) law only; at d = 128 they differ by < 2%
        assert mse == pytest.approx(EX12_GAUSS[bits][1], rel=0.03)


def test_quantizer_matches_a_float64_numpy_reference():
    x = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(5)) * 3
    method = TurboQuantMSE(bits=3)
    layer = method.new_layer(2, 3, 16)
    layer.prefill(x, x.clone())
    keys, _ = layer.keys_values(torch.float64)
    rot = haar_rotation(16, 0 + 2 * 2).double().numpy()  # keys of layer 2: seed + 2 * layer
    c, _ = lloyd_max_codebook(3, 16)
    xn = x.double().numpy()
    norm = np.linalg.norm(xn, axis=-1, keepdims=True)
    y = (xn / norm) @ rot.T
    idx = np.abs(y[..., None] - c).argmin(-1)
    ref = (c[idx] @ rot) * norm.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(keys.numpy(), ref, atol=1e-5)


def test_rotation_is_orthogonal_seeded_and_distinct_per_side_and_layer():
    r = haar_rotation(32, 7)
    np.testing.assert_allclose((r @ r.T).numpy(), np.eye(32), atol=1e-5)
    g = torch.Generator().manual_seed(7)
    q, rr = torch.linalg.qr(torch.randn(32, 32, generator=g, dtype=torch.float64))
    assert torch.equal(r, (q * torch.sign(torch.diagonal(rr))).float())
    m = TurboQuantMSE(seed=7)
    k0, v0, k1 = m.key_codec(0, 32), m.value_codec(0, 32), m.key_codec(1, 32)
    assert torch.equal(k0.rotation, r) and torch.equal(v0.rotation, haar_rotation(32, 8))
    assert torch.equal(k1.rotation, haar_rotation(32, 9))


@pytest.mark.parametrize("store", [False, True])
def test_bytes_by_hand(store):
    layer = TurboQuantMSE(bits=3, store_rotation=store).new_layer(0, 2, 16)
    x = torch.randn(1, 2, 5, 16)
    layer.prefill(x, x.clone())
    nb = layer.nbytes()
    # per side: 2 heads x 5 tokens x ceil(16 * 3 / 8) = 6 bytes; fp16 norm 2 x 5 x 2 bytes
    assert nb["codes"] == 2 * 60 and nb["scales"] == 2 * 20
    assert nb["metadata"] == (2 * 16 * 16 * 4 if store else 0)
    assert nb["residual"] == nb["sinks"] == 0


def test_average_bits_b_plus_16_over_d():
    assert TurboQuantMSE(bits=2).average_bits(128)["key_bits"] == pytest.approx(2.125)
    assert TurboQuantMSE(bits=3).average_bits(64)["value_bits"] == pytest.approx(3.25)
    f32 = TurboQuantMSE(bits=1, norm_dtype="float32").average_bits(128)
    assert f32["key_bits"] == pytest.approx(1.25)
    keys_only = TurboQuantMSE(bits=4, apply_to="keys").average_bits(128)
    assert (keys_only["key_bits"], keys_only["value_bits"]) == (4.125, 16.0)


def test_apply_to_values_only_and_window():
    x = torch.randn(1, 2, 6, 16)
    layer = TurboQuantMSE(apply_to="values", residual_length=2).new_layer(0, 2, 16)
    layer.prefill(x, x.clone())
    assert layer.quantized_tokens() == (0, 4)
    keys, values = layer.keys_values()
    assert torch.equal(keys, x) and torch.equal(values[:, :, 4:], x[:, :, 4:])


def test_gaussian_codebook_option():
    codec = TurboQuantMSE(bits=2, codebook="gaussian").key_codec(0, 64)
    expect = np.array([-1.510418, -0.452780, 0.452780, 1.510418]) / 8.0
    np.testing.assert_allclose(codec.centroids.numpy(), expect, atol=1e-6)


def test_zero_nan_and_norm_overflow():
    x = torch.randn(1, 1, 3, 8)
    x[0, 0, 0] = 0.0
    x[0, 0, 1, 2] = float("nan")
    layer = TurboQuantMSE().new_layer(0, 1, 8)
    with nonfinite("propagate"):  # the opt-out of kvbench.cache.finite
        layer.prefill(x, x.clone())
    keys = layer.keys_values()[0][0, 0]
    assert keys[0].abs().max() == 0 and torch.isnan(keys[1]).all() and torch.isfinite(keys[2]).all()
    big = torch.zeros(1, 1, 1, 8)
    big[..., 0] = 1e5
    with pytest.raises(ValueError, match="norm_dtype"):
        TurboQuantMSE().new_layer(0, 1, 8).prefill(big, big)
    ok = TurboQuantMSE(norm_dtype="float32").new_layer(0, 1, 8)
    ok.prefill(big, big)
    assert ok.k.block.norms.dtype == torch.float32 and ok.k.block.norms.item() == 1e5


def dequantize_roundoff(block) -> torch.Tensor:
    """Bound on how far two float32 ``block.dequantize`` results ``(y @ Pi) * norm`` can differ
    when BLAS sums the D products of ``y @ Pi`` in other orders (another batch shape picks
    another kernel): each order is within ``gamma_D sum_i |y_i Pi_ij|`` of the exact product
    (``u = 2^-24``, ``gamma_D = D u / (1 - D u)``), so two differ by twice that, times
    ``|norm|``, plus each side's rounding of the product by the norm (``u |out|``)."""
    d, u = block.rotation.shape[0], 2.0**-24
    y = block.centroids[unpack_bits(block.codes, block.bits, d).long()].double()
    pi, n = block.rotation.double(), block.norms.double().abs()
    gamma = d * u / (1 - d * u)
    return 2 * gamma * (y.abs() @ pi.abs()) * n + 2 * u * (y @ pi).abs() * n


def test_batch_ops_and_registry():
    x = torch.randn(1, 2, 6, 16, generator=torch.Generator().manual_seed(0))
    layer = kvbench.get_method("turboquant-mse").new_layer(0, 2, 16)
    layer.prefill(x, x.clone())
    assert layer.k.block is not None and layer.k.residual is None
    before, _ = layer.keys_values()
    stored = [t.clone() for _, _, t in layer.tensors()]
    layer.repeat_batch(2)
    # the stored parts are copied exactly; their dequantization runs a [2, ...] matmul instead
    # of a [1, ...] one, so it matches within float32 round-off (not bit for bit)
    for (_, _, t), s in zip(layer.tensors(), stored, strict=True):
        assert torch.equal(t, s.expand(2, *s.shape[1:]))
    tol = dequantize_roundoff(layer.k.block)
    assert ((layer.keys_values()[0] - before.expand(2, -1, -1, -1)).abs() <= tol).all()
    layer.crop(3)
    layer.index_batch(torch.tensor([1]))
    for (_, _, t), s in zip(layer.tensors(), stored, strict=True):
        assert torch.equal(t, s[:, :, :3])
    tol = dequantize_roundoff(layer.k.block)
    assert ((layer.keys_values()[0] - before[:, :, :3]).abs() <= tol).all()
    caps = TurboQuantMSE.capabilities
    assert caps.keys_values and not caps.needs_calibration


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bits", 5),
        ("bits", True),
        ("apply_to", "queries"),
        ("codebook", "uniform"),
        ("norm_dtype", "bfloat16"),
        ("store_rotation", 1),
        ("seed", -1),
        ("residual_length", -4),
        ("num_sink_tokens", None),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TurboQuantMSEConfig(**{field: value})


def test_codebook_argument_errors():
    with pytest.raises(ValueError, match="bits"):
        lloyd_max_codebook(0)
    with pytest.raises(ValueError, match="dim"):
        lloyd_max_codebook(2, 1)
