"""``rotation: hadamard`` applied by the layer cache for every method and backend
(docs/design.md#rotation, kvbench/cache/rotation.py).

Right values: the Walsh-Hadamard matrix from its closed form ``H[i, j] = (-1)^popcount(i & j) /
sqrt(b)`` (an identity of the Sylvester construction, computed here without kvbench); the
block-diagonal rotation as ``kron(I, H)``; attention in float64 over keys/values rotated back
with that matrix; the q4_0 error of a key with one outlier channel derived below by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvbench
from kvbench.cache.rotation import ChannelRotation, hadamard
from kvbench.kernels.cpu import codedomain as cpu
from kvbench.kernels.cpu import native

B, HKV, HQ, D = 2, 2, 4, 64
SMALL = dict(group_size=16, residual_length=16)


def sylvester(b: int) -> torch.Tensor:
    """``[b, b]`` float64 from the closed form ``(-1)^popcount(i & j) / sqrt(b)``."""
    i = torch.arange(b)
    bits = (i[:, None] & i[None, :]).tolist()
    sign = torch.tensor([[(-1.0) ** bin(x).count("1") for x in row] for row in bits])
    return sign.double() / math.sqrt(b)


def block_diag(d: int, b: int) -> torch.Tensor:
    """``[d, d]`` float64: ``d / b`` copies of :func:`sylvester` on the diagonal."""
    return torch.kron(torch.eye(d // b, dtype=torch.float64), sylvester(b))


def modes() -> list[str]:
    """The CPU attention modes to force (cpu_attention_mode); native where it is built."""
    return ["eager", "reference", *(["native"] if native.available() else [])]


def data(d: int = D, t: int = 40, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, HKV, t, d, generator=g, dtype=torch.float64) * 1.5 + 0.3
    k[..., 3] *= 6  # an outlier channel
    v = torch.randn(B, HKV, t, d, generator=g, dtype=torch.float64)
    q = torch.randn(B, HQ, t, d, generator=g, dtype=torch.float64)
    return k.to(dtype), v.to(dtype), q.to(dtype)


def run(method, k, v, q, prompt: int, mode: str = "eager", device: str = "cpu"):
    """Prefill ``prompt`` tokens, then one decode step per further token; the outputs."""
    k, v, q = k.to(device), v.to(device), q.to(device)
    lc = method.new_layer(0, k.shape[1], k.shape[3], k.dtype, device)
    lc.prefill(
        k[:, :, :prompt], v[:, :, :prompt], q[:, :, :prompt] if method.needs_queries else None
    )
    outs = []
    with cpu.cpu_attention_mode(mode):
        for t in range(prompt, k.shape[2]):
            lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(lc.attend(q[:, :, t : t + 1]))
            lc.end_step()
    return lc, torch.cat(outs, 2)


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 attention of the newest ``n_q`` positions (causal, GQA by repeat)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    t, nq = k.shape[2], q.shape[2]
    lg = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.arange(t)[None] > torch.arange(t - nq, t)[:, None]
    return torch.softmax(lg.masked_fill(mask, float("-inf")), -1) @ v


# ------------------------------------------------------------------ the matrix


@pytest.mark.parametrize("b", [1, 2, 4, 8, 16, 32, 64, 128])
def test_hadamard_is_orthonormal_and_the_sylvester_matrix(b):
    h = hadamard(b)
    assert h.dtype == torch.float64
    assert torch.allclose(h @ h.T, torch.eye(b, dtype=torch.float64), atol=1e-14, rtol=0)
    assert torch.equal(h, sylvester(b))


@pytest.mark.parametrize("b", [0, 3, 48, 96])
def test_hadamard_refuses_a_block_that_is_not_a_power_of_two(b):
    with pytest.raises(ValueError, match="power of two"):
        hadamard(b)


def test_rotation_is_x_times_block_diagonal_h_and_back():
    x = data()[0].double()
    r = ChannelRotation(D, 16)
    m = block_diag(D, 16)
    assert torch.allclose(r.forward(x, "keys"), x @ m, atol=1e-12, rtol=0)
    assert torch.allclose(r.forward(x, "values"), x @ m, atol=1e-12, rtol=0)
    assert torch.allclose(r.back(x @ m, "keys"), x, atol=1e-12, rtol=0)
    assert r.forward(x.half(), "keys").dtype == torch.float16


def test_seeded_signs_are_reproducible_and_differ_from_the_plain_rotation():
    eye = torch.eye(D, dtype=torch.float64)
    plain = ChannelRotation(D, 64).forward(eye, "keys")
    s3 = ChannelRotation(D, 64, seed=3).forward(eye, "keys")
    assert torch.equal(s3, ChannelRotation(D, 64, seed=3).forward(eye, "keys"))
    assert not torch.allclose(s3, ChannelRotation(D, 64, seed=4).forward(eye, "keys"))
    # seeded = diag(s) @ plain with s = +-1, not all +1 (QuaRot's randomized Hadamard)
    s = s3 @ plain.T
    assert torch.allclose(s, torch.diag(torch.diagonal(s)), atol=1e-12)
    assert set(torch.diagonal(s).round().tolist()) == {-1.0, 1.0}
    assert torch.allclose(s3 @ s3.T, eye, atol=1e-12)
    # through a method: two layers of one config store the same rotated keys
    k, v, _ = data()
    stored = []
    for seed in (3, 3, None):
        lc = kvbench.get_method("full", rotation="hadamard", rotation_seed=seed).new_layer(
            0, HKV, D
        )
        lc.prefill(k, v)
        stored.append(lc.k.residual)
    assert torch.equal(stored[0], stored[1]) and not torch.allclose(stored[0], stored[2])


# ------------------------------------------------------------------ exactness of `full`


@pytest.mark.parametrize("block,seed", [(64, None), (16, None), (32, 5)])
@pytest.mark.parametrize("mode", modes())
def test_full_with_rotation_equals_full_without(mode, block, seed):
    k, v, q = data(t=24)
    plain_lc, plain = run(kvbench.get_method("full"), k, v, q, 16, mode)
    rot = kvbench.get_method("full", rotation="hadamard", rotation_block=block, rotation_seed=seed)
    lc, out = run(rot, k, v, q, 16, mode)
    assert lc.attend_path == plain_lc.attend_path
    assert (lc.attend_path == "reference") == (mode == "reference")
    assert torch.allclose(out, plain, atol=2e-6, rtol=1e-5)
    # stored: x @ H (rotated; seeded: signs first), read back: x
    m = block_diag(D, block)
    if seed is not None:
        m = rot.rotation(D).forward(torch.eye(D, dtype=torch.float64), "keys")
    assert torch.allclose(lc.k.residual.double(), k.double() @ m, atol=1e-5)
    assert torch.allclose(lc.v.residual.double(), v.double() @ m, atol=1e-5)
    kk, vv = lc.keys_values()
    assert torch.allclose(kk, k, atol=1e-5) and torch.allclose(vv, v, atol=1e-5)
    assert lc.nbytes() == plain_lc.nbytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_with_rotation_equals_full_without_on_cuda():
    k, v, q = data(t=24, dtype=torch.float16)
    _, plain = run(kvbench.get_method("full"), k, v, q, 16, device="cuda")
    lc, out = run(kvbench.get_method("full", rotation="hadamard"), k, v, q, 16, device="cuda")
    assert torch.allclose(out.float(), plain.float(), atol=3e-3, rtol=3e-3), lc.attend_path


# ------------------------------------------------------------------ quantized methods


CASES = [
    ("int4-block", dict(num_sink_tokens=2, residual_length=8)),
    ("int8-block", dict()),
    ("kivi", dict(SMALL, bits=2, value_bits=2, num_sink_tokens=2)),
    ("per-token", dict(SMALL, bits=2, value_bits=4)),
    ("fp8", dict()),
    ("turboquant-mse", dict(bits=3, residual_length=8)),
    ("pm-kvq", dict(residual_length=16, init_bits=4)),
    ("semkv", dict(SMALL, num_sink_tokens=2)),
    ("pn-mix", dict(SMALL, value_bits=2, num_sink_tokens=2)),
    ("kitty", dict(SMALL, value_bits=2, num_sink_tokens=2)),
    ("polarquant", dict(SMALL, value_bits=2, num_sink_tokens=2)),
]


@pytest.mark.parametrize("mode", modes())
@pytest.mark.parametrize("name,cfg", CASES, ids=lambda x: str(x)[:30])
def test_quantized_attention_is_dequantized_stored_rotated_back(name, cfg, mode):
    """attend() with rotation == float64 attention over the stored blocks dequantized, rotated
    back by kron(I, H) (written here), with the unrotated query."""
    k, v, q = data(t=44)
    method = kvbench.get_method(name, **cfg, rotation="hadamard", rotation_block=32)
    lc, _ = run(method, k, v, q, 40, mode)
    assert lc.quantized_tokens()[0] > 0
    m = block_diag(D, 32)
    ks, vs = lc.k.read(torch.float64) @ m.T, lc.v.read(torch.float64) @ m.T
    qq = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(9))
    with cpu.cpu_attention_mode(mode):
        out = lc.attend(qq)
    assert (lc.attend_path == "reference") == (mode == "reference"), lc.attend_path_reason
    ref = attention64(qq, ks, vs)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    kk, vv = lc.keys_values(torch.float64)
    assert torch.allclose(kk, ks, atol=1e-9) and torch.allclose(vv, vs, atol=1e-9)


def assert_rotating_is_plain_fed_rotated(name: str, cfg: dict, **rotation) -> None:
    """The layer of ``name`` with ``rotation="hadamard"`` (and ``rotation``'s fields) stores
    exactly what the plain layer stores when fed the rotated tensors, and outputs its output
    rotated back.

    Bit equality holds only because both sides run the same arithmetic: the layer rotates each
    call's tensor (LayerCache.prefill / append / attend call ``rotation.forward`` on the prompt
    slice ``[B, H, 40, D]`` and on each ``[B, H, 1, D]`` step, attend rotates its step's output
    back), so the plain layer is fed ``forward`` of exactly those slices (the same tensors,
    shapes and strides) and the step outputs are rotated back one at a time.  Rotating the
    whole ``[B, H, 44, D]`` at once picks other matmul kernels on some CPUs (Intel AVX-512)
    and rounds differently, so it must not be compared bit for bit."""
    k, v, q = data(t=44)
    rot = kvbench.get_method(name, **cfg, rotation="hadamard", **rotation)
    r = rot.rotation(D)
    lc, out = run(rot, k, v, q, 40)
    assert lc.rotation is not None
    plain = kvbench.get_method(name, **cfg).new_layer(0, HKV, D, k.dtype, "cpu")
    plain.prefill(
        r.forward(k[:, :, :40], "keys"),
        r.forward(v[:, :, :40], "values"),
        r.forward(q[:, :, :40], "keys") if rot.needs_queries else None,
    )
    ref = []
    with cpu.cpu_attention_mode("eager"):  # as run()
        for t in range(40, 44):
            kt, vt = r.forward(k[:, :, t : t + 1], "keys"), r.forward(v[:, :, t : t + 1], "values")
            plain.append(kt, vt)
            ref.append(r.back(plain.attend(r.forward(q[:, :, t : t + 1], "keys")), "values"))
            plain.end_step()
    assert plain.rotation is None and plain.attend_path == lc.attend_path
    assert lc.quantized_tokens()[0] > 0
    assert [(s, c) for s, c, _ in lc.tensors()] == [(s, c) for s, c, _ in plain.tensors()]
    for (_, _, a), (_, _, b) in zip(lc.tensors(), plain.tensors()):
        assert torch.equal(a, b)
    assert torch.equal(out, torch.cat(ref, 2))


@pytest.mark.parametrize("name,cfg", [*CASES, ("qjl", dict(value_bits=2, residual_length=32))])
def test_a_rotating_layer_is_the_plain_layer_fed_rotated_tensors(name, cfg):
    """Every LayerCache subclass (SemKV's scores, PM-KVQ's budget, QJL's sketches, PN-Mix's
    query selection) stores exactly what the unrotated method stores for pre-rotated K, V and
    queries, and its output is that one's rotated back."""
    assert_rotating_is_plain_fed_rotated(name, cfg)


def test_a_seeded_rotating_layer_is_the_plain_layer_fed_rotated_tensors():
    """With seeded signs ``forward`` (signs, then H) and ``back`` (H, then signs) differ, so a
    layer that rotated a side the wrong way would show here."""
    cfg = dict(SMALL, bits=2, value_bits=2, num_sink_tokens=2)
    assert_rotating_is_plain_fed_rotated("kivi", cfg, rotation_seed=5, rotation_block=32)


def test_queries_given_later_are_rotated_too():
    k, v, q = data(t=40)
    method = kvbench.get_method("pn-mix", **SMALL, num_sink_tokens=2, rotation="hadamard")
    now = method.new_layer(0, HKV, D)
    now.prefill(k, v, q)
    later = method.new_layer(0, HKV, D)
    later.prefill(k, v)
    assert later.awaiting_queries
    later.provide_queries(q)
    assert now.quantized_tokens()[0] > 0
    for (_, _, a), (_, _, b) in zip(now.tensors(), later.tensors()):
        assert torch.equal(a, b)


def test_padded_rows_rotate_as_each_row_alone():
    k, v, q = data(t=40)
    method = kvbench.get_method("int4-block", rotation="hadamard", rotation_block=32)
    lc = method.new_layer(0, HKV, D)
    lc.prefill(k[:, :, :32], v[:, :, :32], lengths=torch.tensor([32, 20]))
    lc.append(k[:, :, 32:33], v[:, :, 32:33])
    out = lc.attend(q[:, :, 32:33])
    alone = method.new_layer(0, HKV, D)
    alone.prefill(k[1:, :, 12:32], v[1:, :, 12:32])
    alone.append(k[1:, :, 32:33], v[1:, :, 32:33])
    for (_, _, a), (_, _, b) in zip(lc.rows[1].tensors(), alone.tensors()):
        assert torch.equal(a, b)
    assert torch.allclose(out[1:], alone.attend(q[1:, :, 32:33]), atol=1e-6)
    kk = lc.keys_values()[0]
    assert torch.equal(kk[1:, :, :12], torch.zeros_like(kk[1:, :, :12]))
    assert torch.allclose(kk[1:, :, 12:], alone.keys_values()[0], atol=1e-6)


def test_calibration_sees_rotated_keys():
    """KVQuant's static per-channel thresholds are fitted on the space the cache stores."""
    k = data(t=64)[0]
    rot = kvbench.get_method("kvquant", rotation="hadamard", nuq=False).calibrate({0: k})
    r = rot.rotation(D)
    plain = kvbench.get_method("kvquant", nuq=False).calibrate({0: r.forward(k, "keys")})
    for a, b in zip(rot.calibration[0], plain.calibration[0]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ outliers


def test_one_outlier_channel_is_spread_and_q4_0_key_error_drops():
    """Keys N(0, 1) with channel 5 = 40.  Without rotation (q4_0, blocks of 32): the block
    holding channel 5 gets d = -40/8 = -5, so its other 31 channels round to 0 (|x| < 2.5) or
    +-5, error ~E[x^2] ~ 0.95 each: MSE ~ 31/64 * 0.95 ~ 0.46.  With a 64-channel Hadamard the
    outlier becomes +-40/8 = +-5 on every channel plus N(0, 1): |max| ~ 5 + 2.5, d ~ 0.94,
    MSE ~ d^2/12 ~ 0.07 on every channel (the rotation is orthonormal: the same MSE after
    rotating back)."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 256, D, generator=g, dtype=torch.float64)
    k[..., 5] = 40.0
    k = k.float()
    mse = {}
    for rot in ("none", "hadamard"):
        lc = kvbench.get_method("int4-block", rotation=rot).new_layer(0, 1, D)
        lc.prefill(k, k.clone())
        mse[rot] = float(((lc.keys_values(torch.float64)[0] - k.double()) ** 2).mean())
    assert 0.4 < mse["none"] < 0.55
    assert mse["hadamard"] < 0.1
    assert mse["hadamard"] < mse["none"] / 4


# ------------------------------------------------------------------ bytes and config


@pytest.mark.parametrize("name,cfg", CASES[:4])
def test_rotation_does_not_change_nbytes_or_layouts(name, cfg):
    k, v, q = data(t=44)
    plain, _ = run(kvbench.get_method(name, **cfg), k, v, q, 40)
    method = kvbench.get_method(name, **cfg, rotation="hadamard")
    lc, _ = run(method, k, v, q, 40)
    assert lc.nbytes() == plain.nbytes()
    assert method.average_bits(D) == kvbench.get_method(name, **cfg).average_bits(D)


def test_config_fields_and_refusals():
    m = kvbench.get_method("kivi", rotation="hadamard", rotation_block=32, rotation_seed=7)
    assert m.config.to_dict()["rotation"] == "hadamard"
    assert type(m.config).from_dict(m.config.to_dict()) == m.config
    # without rotation the record's config (and its run_id) is what it was before the fields
    assert not {"rotation", "rotation_block", "rotation_seed"} & set(
        kvbench.get_method("kivi").config.to_dict()
    )
    with pytest.raises(
        ValueError, match=r"field 'rotation_block': 48 is not allowed; allowed: powers of two"
    ):
        kvbench.get_method("kivi", rotation="hadamard", rotation_block=48)
    with pytest.raises(
        ValueError,
        match=r"field 'rotation': 'walsh' is not allowed; allowed: \['none', 'hadamard'\]",
    ):
        kvbench.get_method("full", rotation="walsh")
    with pytest.raises(
        ValueError, match=r"field 'rotation_seed': 1 is not allowed; allowed: None unless"
    ):
        kvbench.get_method("full", rotation_seed=1)
    with pytest.raises(ValueError, match=r"field 'rotation_block': 32 is not allowed; allowed: 64"):
        kvbench.get_method("full", rotation_block=32)


def test_a_block_that_does_not_divide_head_dim_is_refused_at_new_layer():
    method = kvbench.get_method("int4-block", rotation="hadamard", block_size=16)
    with pytest.raises(ValueError) as e:
        method.new_layer(0, HKV, 48)
    assert str(e.value) == (
        "Int4BlockConfig: field 'rotation_block': 64 is not allowed; allowed: powers of two "
        "that divide head_dim=48: [2, 4, 8, 16]"
    )
    with pytest.raises(ValueError, match="rotation_block"):  # subclass new_layer overrides too
        kvbench.get_method("qjl", rotation="hadamard").new_layer(0, HKV, 48)


@pytest.mark.parametrize("name", ["hf-dynamic", "hf-quanto", "hf-hqq", "hf-fp8"])
def test_peers_refuse_rotation(name):
    with pytest.raises(
        ValueError, match=r"field 'rotation': 'hadamard' is not allowed; allowed: 'none' \("
    ):
        kvbench.get_method(name, rotation="hadamard")
    assert kvbench.get_method(name).config.rotation == "none"
