"""QJL: docs/methods.md#worked-example-14, unbiasedness over seeds, attention against a float64 numpy
re-implementation of the estimator and against exact attention for large m, byte counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvbench
from kvbench.attention.reference import reference_attention
from kvbench.cache.finite import nonfinite
from kvbench.methods.qjl import QJL, QJLConfig, QJLKeyCodec, qjl_sketch_matrix


def _estimate(codec: QJLKeyCodec, q: torch.Tensor, k: torch.Tensor) -> float:
    block = codec.encode(k.reshape(1, 1, -1, k.shape[-1]))
    return block.scores(q.reshape(1, 1, 1, -1))[0, 0, 0, -1].item()


def test_example14_estimate():
    rng = np.random.default_rng(0)
    s_mat = rng.standard_normal((4096, 8))
    k, q = rng.standard_normal(8), rng.standard_normal(8)
    assert q @ k == pytest.approx(-1.205852, abs=1e-6)
    codec = QJLKeyCodec(torch.tensor(s_mat, dtype=torch.float32), norm_dtype=torch.float32)
    est = _estimate(codec, torch.tensor(q, dtype=torch.float32), torch.tensor(k).float())
    assert est == pytest.approx(-1.103953, abs=2e-5)


@pytest.mark.parametrize(("outliers", "seeds"), [(0, 2000), (2, 1000)])
def test_estimator_is_unbiased_over_seeds(outliers, seeds):
    rng = np.random.default_rng(0)
    k, q = rng.standard_normal(8), rng.standard_normal(8)
    k[3] *= 6.0  # a clear outlier channel
    kt, qt = torch.tensor(k).float(), torch.tensor(q).float()
    ests = []
    for seed in range(seeds):
        s_mat = qjl_sketch_matrix(64, 8, seed)
        codec = QJLKeyCodec(s_mat, 1, outliers, 32, torch.float32)
        ests.append(_estimate(codec, qt, kt))
    qjl_sketch_matrix.cache_clear()
    ests = np.array(ests)
    se = ests.std(ddof=1) / math.sqrt(len(ests))
    assert abs(ests.mean() - q @ k) <= 3 * se
    assert se < 0.05 * abs(q @ k)  # the test has power: a biased constant would show


def test_outlier_estimate_matches_the_repo_formula():
    """qjl_gqa_score_kernel.cu: sqrt(pi/2)/m ||k_in|| <S (q - q_out), sign(S k_in)> +
    sqrt(pi/2)/m_o ||k_out|| <S_o q_out, sign(S_o k_out)>, S_o = the first m_o rows of S,
    outlier channels = the o largest norms over the group's tokens (here 3 and 5)."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((4, 8))
    k[:, 3] *= 10.0
    k[:, 5] *= 8.0
    q = rng.standard_normal(8)
    s = rng.standard_normal((32, 8))
    codec = QJLKeyCodec(torch.tensor(s).float(), 4, 2, 16, torch.float32)
    block = codec.encode(torch.tensor(k).float().reshape(1, 1, 4, 8))
    assert sorted(block.outlier_idx.flatten().tolist()) == [3, 5]
    s, k, q = (np.asarray(t, dtype=np.float32).astype(np.float64) for t in (s, k, q))
    out = np.zeros(8)
    out[[3, 5]] = 1.0
    k_in, k_out, q_in, q_out = k * (1 - out), k * out, q * (1 - out), q * out
    c = math.sqrt(math.pi / 2)
    ref = c / 32 * np.linalg.norm(k_in, axis=-1) * (np.sign(k_in @ s.T) @ (s @ q_in))
    ref += c / 16 * np.linalg.norm(k_out, axis=-1) * (np.sign(k_out @ s[:16].T) @ (s[:16] @ q_out))
    got = block.scores(torch.tensor(q).float().reshape(1, 1, 1, 8)).flatten().numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def _np_attention(layer_q, k, v, s_mat, n_sketched, n_rep, scale):
    """float64 numpy: QJL estimate for the first ``n_sketched`` keys (fp16 norms), exact dot
    products for the rest, softmax, values exact (value_bits=16)."""
    q, k, v, s = (np.asarray(t, dtype=np.float64) for t in (layer_q, k, v, s_mat))
    b, hq, nq, d = q.shape
    m = s.shape[0]
    out = np.zeros_like(q)
    for h in range(hq):
        kh, vh = k[0, h // n_rep], v[0, h // n_rep]
        for i in range(nq):
            qi = q[0, h, i]
            norms = np.linalg.norm(kh[:n_sketched], axis=-1).astype(np.float16).astype(float)
            signs = np.where(kh[:n_sketched] @ s.T > 0, 1.0, -1.0)
            est = math.sqrt(math.pi / 2) / m * norms * (signs @ (s @ qi))
            logits = np.concatenate([est, kh[n_sketched:] @ qi]) * scale
            p = np.exp(logits - logits.max())
            out[0, h, i] = (p / p.sum()) @ vh
    return out


def test_attend_matches_numpy_estimator_with_gqa():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 44, 16, generator=g), torch.randn(1, 2, 44, 16, generator=g)
    layer = QJL(sketch_dim=64, group_size=8, residual_length=32, value_bits=16).new_layer(0, 2, 16)
    layer.prefill(k[:, :, :40], v[:, :, :40])
    assert layer.quantized_tokens() == (32, 0)  # 40 - 40 mod 32 keys sketched, 8 exact
    layer.append(k[:, :, 40:], v[:, :, 40:])  # 4 decode tokens in one chunk (causal)
    q = torch.randn(1, 6, 4, 16, generator=g)  # 3 query heads per KV head
    got = layer.attend(q).numpy()
    s_mat = qjl_sketch_matrix(64, 16, 0)
    for i in range(4):  # query i sees keys 0 .. 40 + i
        ref = _np_attention(
            q[:, :, i : i + 1], k[:, :, : 41 + i], v[:, :, : 41 + i], s_mat, 32, 3, 0.25
        )
        np.testing.assert_allclose(got[:, :, i : i + 1], ref, atol=2e-5)


def test_attention_approaches_exact_for_large_m():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    exact = reference_attention(q, k, v)
    errs = []
    for m in (16, 1024, 65536):  # the estimator's error shrinks like 1/sqrt(m)
        layer = QJL(
            sketch_dim=m, group_size=8, residual_length=32, value_bits=16, num_sink_tokens=2
        ).new_layer(0, 2, 16)
        layer.prefill(k, v)
        assert layer.quantized_tokens() == (32, 0)  # 2 sinks, 32 sketched, 6 exact
        errs.append((layer.attend(q) - exact).abs().max().item())
    assert errs[2] < errs[1] / 4 < errs[0] / 16 and errs[2] < 0.02


def test_keys_values_raises_naming_the_capability():
    layer = QJL().new_layer(0, 1, 16)
    x = torch.randn(1, 1, 4, 16)
    layer.prefill(x, x)
    from kvbench.attention.reference import NoDequantizedForm

    with pytest.raises(NoDequantizedForm, match="keys_values"):
        layer.keys_values()
    sketched = QJL(group_size=8, residual_length=8).new_layer(0, 1, 16)
    y = torch.randn(1, 1, 24, 16)
    sketched.prefill(y, y)
    assert sketched.k.block is not None  # 16 of the 24 keys are sketched
    with pytest.raises(NoDequantizedForm, match="keys_values"):
        sketched.k.block.dequantize(torch.float32)
    assert QJL.capabilities.keys_values is False
    assert not QJL.capabilities.needs_queries


def test_bytes_by_hand():
    cfg = {"sketch_dim": 64, "group_size": 8, "residual_length": 8, "value_bits": 2}
    layer = QJL(**cfg).new_layer(0, 2, 16)
    x = torch.randn(1, 2, 20, 16)
    layer.prefill(x, x.clone())
    assert layer.quantized_tokens() == (16, 12)
    nb = layer.nbytes()
    # keys: 2 heads x 16 tokens x 64/8 sign bytes; fp16 norms 2 x 16 x 2; 4 fp32 residual tokens
    # values: 2 x 12 x 16 x 2 bits; (scale, zero) fp16 per 8 channels; 8 fp32 residual tokens
    assert nb["codes"] == 2 * 16 * 8 + 2 * 12 * 16 * 2 // 8
    assert nb["scales"] == 2 * 16 * 2 + 2 * 12 * 2 * 2 * 2
    assert nb["residual"] == 2 * 4 * 16 * 4 + 2 * 8 * 16 * 4
    out = QJL(**cfg, outlier_channels=2).new_layer(0, 2, 16)
    out.prefill(x, x.clone())
    extra = {k: out.nbytes()[k] - nb[k] for k in ("codes", "scales", "metadata")}
    # outlier signs 2 x 16 x 32/8, outlier norms 2 x 16 x 2, indices 2 heads x 2 groups x 2
    assert extra == {"codes": 128, "scales": 64, "metadata": 8}


def test_average_bits():
    ab = QJL().average_bits(128, 32768)
    assert ab["key_bits"] == pytest.approx(256 / 128 + 16 / 128)  # 2.125
    assert ab["value_bits"] == pytest.approx(2 + 32 / 32)  # 2 bits, fp16 (s, z) per 32
    assert QJL().average_bits(64)["key_bits"] == pytest.approx(4.25)
    o = QJL(outlier_channels=8).average_bits(128)["key_bits"]
    assert o == pytest.approx((256 + 128) / 128 + 32 / 128 + 8 * 8 / (32 * 128))


def test_decode_flush_crop_and_batch_ops():
    x = torch.randn(1, 2, 30, 16)
    layer = QJL(
        sketch_dim=32, group_size=4, residual_length=8, outlier_channels=2, value_bits=16
    ).new_layer(0, 2, 16)
    layer.prefill(x[:, :, :20], x[:, :, :20])
    assert layer.quantized_tokens()[0] == 16
    for t in range(20, 24):
        layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        layer.end_step()
    assert layer.quantized_tokens()[0] == 24 and layer.seq_length == 24
    q = torch.randn(1, 2, 1, 16)
    full = layer.attend(q)
    layer.repeat_batch(2)
    two = layer.attend(q.expand(2, -1, -1, -1))
    np.testing.assert_allclose(two.numpy(), full.expand(2, -1, -1, -1).numpy(), atol=1e-6)
    layer.index_batch(torch.tensor([1]))
    layer.crop(18)  # cuts an outlier group in two
    assert layer.k.block.group_len[-1] == 2 and layer.k.block.outlier_idx.shape[2] == 5
    ref = QJL(
        sketch_dim=32, group_size=4, residual_length=8, outlier_channels=2, value_bits=16
    ).new_layer(0, 2, 16)
    ref.prefill(x[:, :, :24], x[:, :, :24])  # the same 4-token groups, sketched at prefill
    ref.crop(18)
    np.testing.assert_allclose(layer.attend(q).numpy(), ref.attend(q).numpy(), atol=1e-6)


def test_orthogonal_sketch_and_registry():
    s = qjl_sketch_matrix(40, 16, 1, "orthogonal").double()
    np.testing.assert_allclose((s[:16] @ s[:16].T).numpy(), 16 * np.eye(16), atol=1e-4)
    assert isinstance(kvbench.get_method("qjl", sketch="orthogonal"), QJL)
    with pytest.raises(ValueError, match="outlier_channels"):
        QJL(outlier_channels=16).new_layer(0, 1, 16)


def test_nan_key_gives_nan_and_norm_overflow_raises():
    x = torch.randn(1, 1, 8, 16)
    x[0, 0, 0, 0] = float("nan")
    layer = QJL(group_size=8, residual_length=8, value_bits=16).new_layer(0, 1, 16)
    with nonfinite("propagate"):  # the opt-out of kvbench.cache.finite
        layer.prefill(x, torch.randn(1, 1, 8, 16))
    assert torch.isnan(layer.attend(torch.randn(1, 1, 1, 16))).all()
    big = torch.full((1, 1, 8, 16), 2e4)
    with pytest.raises(ValueError, match="norm_dtype"):
        QJL(group_size=8, residual_length=8).new_layer(0, 1, 16).prefill(big, big)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sketch_dim", 0),
        ("outlier_channels", -1),
        ("outlier_sketch_dim", 0),
        ("outlier_sketch_dim", 512),
        ("sketch", "hadamard"),
        ("seed", -2),
        ("norm_dtype", "float64"),
        ("residual_length", 48),
        ("value_bits", 9),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        QJLConfig(**{field: value})
