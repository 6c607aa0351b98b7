"""kvbench.cache.quant: docs/methods.md#worked-examples and property tests of the min-max quantizer.

Right values come from docs/methods.md#worked-examples (numpy float64, round-half-to-even) or from the float64
reference in conftest.py; bounds are derived in the docstring of ``_error_bound``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.cache.blocks import PerChannelCodec, PerHeadCodec, PerTensorCodec, PerTokenCodec
from kvbench.cache.quant import dequantize_groups, fake_quantize, quantize_groups

F32 = torch.float32
# docs/methods.md#worked-example-1 input, KIVI's transposed layout [D=2 channels, T=4 tokens]
EX1 = [[0.12, 0.9, -0.7, 0.35], [2.0, -1.0, 0.4, 1.1]]


def _deq(g, dtype=torch.float64):
    return dequantize_groups(
        g.codes,
        g.scale,
        g.zero,
        g.bits,
        symmetric=g.symmetric,
        midpoint=g.midpoint,
        dtype=dtype,
    )


# ------------------------------------------------------------------ docs/methods.md#worked-examples


def test_example1_per_channel_primitive() -> None:
    x = torch.tensor(EX1, dtype=torch.float64)
    g = quantize_groups(x, 2, scale_dtype=F32)
    assert g.codes.tolist() == [[2, 3, 0, 2], [3, 0, 1, 2]]
    assert g.zero.flatten().tolist() == pytest.approx([-0.7, -1.0], abs=1e-7)
    assert g.scale.flatten().tolist() == pytest.approx([0.533333, 1.0], abs=1e-6)
    xh = _deq(g)
    want = [[0.366667, 0.9, -0.7, 0.366667], [2.0, -1.0, 0.0, 1.0]]
    np.testing.assert_allclose(xh.numpy(), want, atol=1e-6)
    assert ((x - xh) ** 2).mean().item() == pytest.approx(0.028890, abs=1e-6)


@pytest.mark.parametrize("codec", [PerChannelCodec(2, F32, group_size=2),
                                   PerTokenCodec(2, F32, channel_group=4),
                                   PerHeadCodec(2, F32), PerTensorCodec(2, F32)])  # fmt: skip
def test_affine_path_runs_the_path_it_names(affine_path, monkeypatch, codec) -> None:
    # the fixture's two runs of a codec test really take the two paths: the native quantizer
    # serves the input (and quantize_groups is not called), or it declines and the torch path runs
    import kvbench.cache.blocks as blocks
    from kvbench.cache import native_quant

    calls, groups, pack = [], blocks.quantize_groups, native_quant.quantize_pack

    def torch_spy(*args, **kw):
        calls.append("torch")
        return groups(*args, **kw)

    def native_spy(*args, **kw):
        got = pack(*args, **kw)
        calls.extend(["native"] if got is not None else [])
        return got

    monkeypatch.setattr(blocks, "quantize_groups", torch_spy)
    monkeypatch.setattr(native_quant, "quantize_pack", native_spy)
    codec.encode(torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(0)))
    assert calls == [affine_path]


@pytest.mark.usefixtures("affine_path")
def test_example1_through_codecs() -> None:
    # tokens x channels = K^T: per-channel (KIVI keys), one group of the 4 tokens
    k = torch.tensor(EX1, dtype=F32).T.reshape(1, 1, 4, 2)
    blk = PerChannelCodec(2, F32, group_size=4).encode(k)
    assert blk.unpacked_codes().reshape(4, 2).T.tolist() == [[2, 3, 0, 2], [3, 0, 1, 2]]
    xh = blk.dequantize(torch.float64).reshape(4, 2).T
    assert ((xh - torch.tensor(EX1, dtype=torch.float64)) ** 2).mean().item() == pytest.approx(
        0.028890, abs=1e-6
    )
    # reading the same 2x4 as [T=2, D=4] with groups along D is per-token: identical math
    v = torch.tensor(EX1, dtype=F32).reshape(1, 1, 2, 4)
    vb = PerTokenCodec(2, F32, channel_group=4).encode(v)
    assert vb.unpacked_codes().reshape(2, 4).tolist() == [[2, 3, 0, 2], [3, 0, 1, 2]]
    np.testing.assert_allclose(
        vb.dequantize(torch.float64).reshape(2, 4).numpy(),
        [[0.366667, 0.9, -0.7, 0.366667], [2.0, -1.0, 0.0, 1.0]],
        atol=1e-6,
    )


@pytest.mark.usefixtures("affine_path")
def test_example3_per_tensor() -> None:
    x = torch.tensor(EX1, dtype=torch.float64)
    g = quantize_groups(x.reshape(1, 8), 2, scale_dtype=F32)
    assert g.zero.item() == -1.0 and g.scale.item() == 1.0
    assert g.codes.reshape(2, 4).tolist() == [[1, 2, 0, 1], [3, 0, 1, 2]]
    xh = _deq(g).reshape(2, 4)
    assert xh.tolist() == [[0, 1, -1, 0], [2, -1, 0, 1]]
    mse = ((x - xh) ** 2).mean().item()
    assert mse == pytest.approx(0.050863, abs=1e-6)
    assert mse > 0.028890  # per-tensor is worse than per-channel (Example 1)
    blk = PerTensorCodec(2, F32).encode(x.float().reshape(1, 1, 2, 4))
    assert blk.unpacked_codes().reshape(2, 4).tolist() == [[1, 2, 0, 1], [3, 0, 1, 2]]
    assert blk.dequantize(F32).reshape(2, 4).tolist() == [[0, 1, -1, 0], [2, -1, 0, 1]]


@pytest.mark.parametrize(
    ("t", "even", "half_up"),
    [([0, 0.5, 1, 3], [0, 0, 1, 3], [0, 1, 1, 3]), ([0, 1.5, 2.5, 3], [0, 2, 2, 3], [0, 2, 3, 3])],
)
def test_example4_round_half_to_even(t, even, half_up) -> None:
    # b = 2, min 0, max 3: scale exactly 1, so (x - min)/s = t with exact .5 ties
    g = quantize_groups(torch.tensor([t], dtype=F32), 2, scale_dtype=F32)
    assert g.scale.item() == 1.0 and g.zero.item() == 0.0
    assert g.codes.flatten().tolist() == even
    assert even != half_up  # the example distinguishes the conventions


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_example5_constant_group_exact(dtype, scale_dtype, bits) -> None:
    x = torch.full((3, 4), 0.5, dtype=dtype)
    g = quantize_groups(x, bits, scale_dtype=scale_dtype)
    assert g.codes.eq(0).all()
    assert g.scale.eq(0).all()  # zero range: no 0/0
    assert torch.equal(_deq(g, dtype), x)
    assert torch.equal(fake_quantize(x, bits, scale_dtype=scale_dtype), x)


@pytest.mark.usefixtures("affine_path")
def test_example6_one_bit_plain_and_midpoint() -> None:
    x = torch.tensor([[0, 0.2, 0.6, 0.9, 1.0, 0.4]], dtype=torch.float64)
    plain = quantize_groups(x, 1, scale_dtype=F32)
    assert plain.codes.flatten().tolist() == [0, 0, 1, 1, 1, 0]
    xp = _deq(plain)
    assert xp.flatten().tolist() == [0, 0, 1, 1, 1, 0]
    assert ((x - xp) ** 2).mean().item() == pytest.approx(0.061667, abs=1e-6)
    mid = quantize_groups(x, 1, midpoint=True, scale_dtype=F32)
    assert mid.codes.flatten().tolist() == [0, 0, 1, 1, 1, 0]
    xm = _deq(mid)
    np.testing.assert_allclose(
        xm.flatten().numpy(), [0.25, 0.25, 0.75, 0.75, 0.75, 0.25], atol=1e-7
    )
    assert ((x - xm) ** 2).mean().item() == pytest.approx(0.032500, abs=1e-6)
    # the same through a codec (1-bit per-token group of 6 channels)
    blk = PerTokenCodec(1, F32, midpoint=True, channel_group=6).encode(
        x.float().reshape(1, 1, 1, 6)
    )
    np.testing.assert_allclose(
        blk.dequantize(torch.float64).flatten().numpy(),
        [0.25, 0.25, 0.75, 0.75, 0.75, 0.25],
        atol=1e-7,
    )


def test_example6_uniform_data_mse() -> None:
    # docs/methods.md#worked-example-6: on uniform[0,1], 1-bit MSE 1/12 (plain) vs 1/48 (midpoint)
    x = torch.rand(1, 200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for midpoint, want in ((False, 1 / 12), (True, 1 / 48)):
        g = quantize_groups(x, 1, midpoint=midpoint, scale_dtype=F32)
        mse = ((x - _deq(g)) ** 2).mean().item()
        assert mse == pytest.approx(want, rel=0.02)


@pytest.mark.parametrize(
    ("bits", "scale", "codes"),
    [(2, 1.0, [0, 1, 2, 3]), (4, 0.2, [0, 5, 10, 15]), (8, 3 / 255, [0, 85, 170, 255])],
)
def test_kvq02_zero_point_sign(bits, scale, codes) -> None:
    # zero-point vs shift convention after a backend API change: huggingface/transformers#34848, docs/methods.md#zero-point-versus-shift-convention: [-1, 0, 1, 2], offset = min = -1; a flipped sign gives [1, 2, 3, 4]
    x = torch.tensor([[[[-1.0, 0.0, 1.0, 2.0]]]])
    g = quantize_groups(x, bits, scale_dtype=F32)
    assert g.codes.flatten().tolist() == codes
    assert g.zero.item() == -1.0
    assert g.scale.item() == pytest.approx(scale, rel=1e-7)
    assert _deq(g, F32).flatten().tolist() == [-1.0, 0.0, 1.0, 2.0]  # exact round trip
    if bits == 2:  # fp16 storage of scale 1 and min -1 is exact too
        assert fake_quantize(x, 2).flatten().tolist() == [-1.0, 0.0, 1.0, 2.0]


# ------------------------------------------------------------------ non-finite input


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_non_finite_group_becomes_nan(bad, symmetric, dtype) -> None:
    # documented in kvbench/quant.py: a group holding NaN/Inf dequantizes to NaN entirely;
    # other groups are unaffected
    x = torch.tensor([[1.0, bad, 2.0, 3.0], [-1.0, 0.0, 1.0, 2.0]], dtype=dtype)
    g = quantize_groups(x, 2, symmetric=symmetric, scale_dtype=F32)
    assert g.codes.min() >= 0 and g.codes.max() <= 3
    xh = _deq(g, dtype)
    assert torch.isnan(xh[0]).all()
    assert torch.isfinite(xh[1]).all()
    if not symmetric:
        assert xh[1].tolist() == [-1.0, 0.0, 1.0, 2.0]


# ------------------------------------------------------------------ properties

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
MANT = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24}  # significand bits
TINY = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133, torch.float32: 2.0**-149}


@st.composite
def groups(draw):
    """Random ``x [..., n]`` (fp16/bf16/fp32), with magnitudes storable in fp16 metadata."""
    dtype = draw(st.sampled_from(DTYPES))
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    n = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "uniform", "integers", "constant", "one-outlier"]))
    mag = 10.0 ** draw(st.integers(-6, 3))
    offset = draw(st.sampled_from([0.0, 1.0, -3.0, 100.0]))
    shape = (*lead, n)
    if kind == "normal":
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * mag + offset
    elif kind == "uniform":
        x = torch.rand(shape, generator=gen, dtype=torch.float64) * mag + offset
    elif kind == "integers":
        x = torch.randint(-8, 8, shape, generator=gen).double() * mag + offset
    elif kind == "constant":
        x = torch.full(shape, mag + offset, dtype=torch.float64)
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * mag
        x[..., 0] = 30 * mag + offset
    return x.to(dtype)


def _error_bound(x, g, bits: int, out_dtype) -> torch.Tensor:
    """Largest admissible ``|x - x^|`` per element, in float64.

    Stored scale ``s`` (float32 value of the stored, rounded-up scale) and stored min ``m``
    (rounded to nearest in ``scale_dtype``); exact group min ``mn``.  For ``x >= m`` the code is
    ``round(t)`` with ``t = (x - m)/s`` in ``[0, qmax]`` (``s`` is rounded *up*, so the max stays
    covered): error ``s/2``.  For ``x < m`` (``m`` rounded up) the code is 0: error
    ``m - x <= m - mn``.  Plus float32 rounding of ``(x - m)/s`` and of ``q*s + m``
    (``<= 2^-22 * (|x| + |m| + qmax*s)``), plus the cast of the float32 result to the input
    dtype (half an ulp: ``2^-p * |x^|`` with ``p`` significand bits, and half the smallest
    subnormal).
    """
    xd = x.double()
    s = g.scale.double()
    qmax = 2**bits - 1
    if g.symmetric:
        lin = s / 2
        fp = 2.0**-22 * (xd.abs() + qmax * s)
    else:
        m = g.zero.double()
        mn = xd.amin(-1, keepdim=True)
        lin = torch.maximum(s / 2, (m - mn).clamp_min(0))
        fp = 2.0**-22 * (xd.abs() + m.abs() + qmax * s)
    return lin + fp + 2.0 ** -MANT[out_dtype] * (xd.abs() + lin) + TINY[out_dtype]


@settings(max_examples=80, deadline=None)
@given(
    x=groups(),
    bits=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 16]),
    scale_dtype=st.sampled_from(SCALE_DTYPES),
    symmetric=st.booleans(),
)
def test_property_codes_range_and_error_bound(x, bits, scale_dtype, symmetric) -> None:
    symmetric = symmetric and bits >= 2
    g = quantize_groups(x, bits, symmetric=symmetric, scale_dtype=scale_dtype)
    assert g.codes.dtype == torch.int32 and g.codes.shape == x.shape
    assert g.scale.dtype == scale_dtype and g.scale.shape == (*x.shape[:-1], 1)
    assert int(g.codes.min()) >= (1 if symmetric else 0)
    assert int(g.codes.max()) <= 2**bits - 1
    xh = _deq(g, x.dtype)
    assert xh.dtype == x.dtype and xh.shape == x.shape
    assert torch.isfinite(xh).all()  # finite input -> finite output
    err = (x.double() - xh.double()).abs()
    bound = _error_bound(x, g, bits, x.dtype)
    assert (err <= bound).all(), float((err - bound).max())
    # the stored scale is rounded *up*: the range is covered
    xd = x.double()
    if symmetric:
        need = xd.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    else:
        need = (xd.amax(-1, keepdim=True) - g.zero.double()).clamp_min(0) / (2**bits - 1)
    assert (g.scale.double() >= need * (1 - 2.0**-22)).all()


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    scale_dtype=st.sampled_from(SCALE_DTYPES),
    bits=st.sampled_from([1, 2, 4, 8, 16]),
    n=st.integers(1, 33),
    value=st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False),
)
def test_property_constant_groups(dtype, scale_dtype, bits, n, value) -> None:
    x = torch.full((2, n), value, dtype=dtype)
    v = x[0, 0].double().item()
    g = quantize_groups(x, bits, scale_dtype=scale_dtype)
    xh = _deq(g, dtype)
    stored_min = torch.tensor(v, dtype=torch.float64).to(scale_dtype).double().item()
    if scale_dtype == torch.float32 or stored_min == v:
        assert torch.equal(xh, x)  # exact when the min is representable in scale_dtype
        assert g.codes.eq(0).all()
    else:  # only the storage rounding of the min, plus the cast back to dtype
        tol = abs(stored_min - v) + 2.0 ** -MANT[dtype] * abs(v) + TINY[dtype]
        assert (xh.double() - v).abs().max().item() <= tol


@settings(max_examples=40, deadline=None)
@given(x=groups(), bits=st.sampled_from([2, 3, 4, 8]))
def test_property_dequant_is_code_times_scale_plus_min(x, bits) -> None:
    # dequantized values within one ulp of code * scale + min computed separately in float64
    # from the stored tensors (ulp of the float32 intermediate at max(|c*s|, |m|), then the
    # cast to the input dtype)
    g = quantize_groups(x, bits, scale_dtype=torch.float16)
    c, s, m = g.codes.double(), g.scale.double(), g.zero.double()
    want = c * s + m
    xh = _deq(g, x.dtype).double()
    mag = torch.maximum((c * s).abs(), m.abs())
    ulp = 2.0**-23 * mag + 2.0 ** -(MANT[x.dtype] - 1) * want.abs() + 2 * TINY[x.dtype]
    assert ((xh - want).abs() <= ulp).all()


def test_stats_in_float32_for_half_inputs() -> None:
    # fp16 overflow in stored block metadata and in the scale range: ggml-org/llama.cpp PR#21652, docs/methods.md#float16-overflow-in-block-metadata-and-range (b): the range 120000 overflows fp16; computed in fp32 it gives 8000
    x = torch.tensor([[-60000.0, 60000.0, 0.0, 1.0]], dtype=torch.float16)
    g = quantize_groups(x, 4)
    assert g.scale.item() == 8000.0 and g.zero.item() == -60000.0
    # (0 + 60000)/8000 = 7.5 is a tie: half-to-even gives 8; 60001/8000 rounds to 8
    assert g.codes.flatten().tolist() == [0, 15, 8, 8]
    xh = _deq(g, torch.float16)
    assert xh.flatten().tolist() == [-60000.0, 60000.0, 4000.0, 4000.0]
    assert math.isfinite(float(xh.float().abs().max()))


# ------------------------------------------------------------------ fake_quantize, by hand
def test_fake_quantize_symmetric_by_hand() -> None:
    # absmax 3-bit: qmax = 2^2 - 1 = 3, s = 1/3 (float32 storage, no rounding up);
    # round([-1, 0.3, 0.9] / s) = [-3, 1, 3] (0.9 and 2.7 round to 1 and 3): x^ = q * s
    x = torch.tensor([[-1.0, 0.3, 0.9]], dtype=torch.float16)
    out = fake_quantize(x, 3, symmetric=True, scale_dtype=torch.float32)
    assert out.dtype == torch.float16 and out.shape == x.shape
    want = torch.tensor([[-1.0, 1 / 3, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(out.double(), want, atol=1e-3, rtol=0)  # float16 output


def test_fake_quantize_one_bit_midpoint_by_hand() -> None:
    # mn = 0, mx = 4, s = 4: midpoint codes 1[x >= 2] = [0, 1, 1], bin centres mn + (q + 1/2) s/2
    # = [1, 3, 3]; plain rounding would give round-half-even [0, 0, 1] -> [0, 0, 4]
    x = torch.tensor([[0.0, 2.0, 4.0]])
    assert fake_quantize(x, 1, midpoint=True).tolist() == [[1.0, 3.0, 3.0]]
    assert fake_quantize(x, 1).tolist() == [[0.0, 0.0, 4.0]]
    half = fake_quantize(x.half(), 1, midpoint=True)
    assert half.dtype == torch.float16 and half.tolist() == [[1.0, 3.0, 3.0]]


def test_fake_quantize_keeps_the_scale_dtype() -> None:
    # 2-bit, mn = 0, mx = 3.1: s = 3.1 / 3 in float32; float16 storage would round it up to
    # the next float16 (1.0342 > 1.03333), 1e-3 off at the top code
    x = torch.tensor([[0.0, 1.0, 2.0, 3.1]])
    s = float(torch.tensor(3.1)) / 3  # float64 of the float32 range / qmax
    out = fake_quantize(x, 2, scale_dtype=torch.float32).double()
    torch.testing.assert_close(
        out, torch.tensor([[0.0, s, 2 * s, 3 * s]]).double(), atol=1e-6, rtol=0
    )
    s16 = fake_quantize(x, 2).double()[0, 3].item()
    assert s16 - 3 * s > 1e-4  # the default float16 scale is a different, rounded-up number


def test_float8_scale_storage_rejects_a_min_beyond_its_range() -> None:
    # float8 e4m3 casts saturate at 448 instead of overflowing to inf: the check uses the exact min
    x = torch.tensor([[-1000.0, -999.0, -998.5]])
    with pytest.raises(ValueError, match=r"zero \(group min\) overflows scale_dtype=torch.float8"):
        quantize_groups(x, 4, scale_dtype=torch.float8_e4m3fn)
    # its largest finite value, 448, is storable: min -448, max 0, scale 448 / 15 = 29.87 (-> 30)
    g = quantize_groups(torch.tensor([[-448.0, 0.0]]), 4, scale_dtype=torch.float8_e4m3fn)
    assert g.zero.float().item() == -448.0 and g.scale.float().item() == 30.0


def test_round_up_to_dtype_by_hand() -> None:
    from kvbench.cache.quant import round_up_to_dtype

    # float16 spacing in [0.25, 0.5) is 2^-12: 1/3 rounds down to 0.333251953125, so the stored
    # scale steps one code up; 0.5 is exact
    got = round_up_to_dtype(torch.tensor([1 / 3, 0.5]), torch.float16)
    assert got.dtype == torch.float16
    assert got.float().tolist() == [0.333251953125 + 2**-12, 0.5]
    # float8 e4m3 (1 byte, 3 mantissa bits): spacing 2^-5 in [0.25, 0.5); 0.29 rounds down to
    # 0.28125 -> 0.3125, 0.3 rounds up to 0.3125 already, 1.0 is exact
    got = round_up_to_dtype(torch.tensor([0.29, 0.3, 1.0]), torch.float8_e4m3fn)
    assert got.dtype == torch.float8_e4m3fn
    assert got.float().tolist() == [0.3125, 0.3125, 1.0]


# ------------------------------------------------------------------ codes vs a per-group loop


def _loop_reference(x, bits, symmetric, midpoint, scale_dtype):
    """The documented min-max / absmax quantizer one group at a time, each step on float32
    scalars of the group (stats, stored-min-relative range, scale rounded up to the next
    ``scale_dtype`` value, round half to even): codes ``[G, n]`` int, scales, zeros (or None)."""
    rows = x.reshape(-1, x.shape[-1])
    codes, scales, zeros = [], [], []
    for r in rows:
        r = r.float()
        if not bool(torch.isfinite(r).all()):  # a non-finite group: NaN metadata (codes unused)
            codes.append(None)
            scales.append(float("nan"))
            zeros.append(float("nan"))
            continue

        def up(v):  # float32 scalar v >= 0 -> smallest scale_dtype value >= v
            st_ = v.to(scale_dtype)
            if scale_dtype != F32 and st_.float() < v:
                st_ = (st_.view(torch.int16) + 1).view(scale_dtype)
            return st_

        if symmetric:
            half = 1 << (bits - 1)
            sc = up(r.abs().max() / (half - 1))
            s = sc.float()
            q = torch.round(r / s) if s > 0 else torch.zeros_like(r)
            codes.append((q.clamp(-(half - 1), half - 1) + half).to(torch.int64))
            scales.append(float(sc))
            continue
        mn = r.min().to(scale_dtype)
        mnf = mn.float()
        sc = up((r.max() - mnf).clamp_min(0) / ((1 << bits) - 1))
        s = sc.float()
        if midpoint:
            q = (((r - mnf) >= 0.5 * s) & (s > 0)).float()
        else:
            q = torch.round((r - mnf) / s) if s > 0 else torch.zeros_like(r)
        codes.append(q.clamp(0, (1 << bits) - 1).to(torch.int64))
        scales.append(float(sc))
        zeros.append(float(mn))
    return codes, scales, None if symmetric else zeros


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "bits,symmetric,midpoint", [(1, False, False), (1, False, True), (2, False, False),
                                (3, True, False), (4, False, False), (8, True, False)],
)  # fmt: skip
@pytest.mark.parametrize("scale_dtype", [torch.float16, F32])
def test_codes_equal_a_per_group_loop(dtype, bits, symmetric, midpoint, scale_dtype) -> None:
    # quantize_groups works in place on its float32 working copy and takes finiteness from the
    # group min/max; its codes and metadata must equal a plain per-group loop, a non-finite
    # group must still come out NaN, and a float32 input (no copy made) must stay unchanged
    gen = torch.Generator().manual_seed(bits * 31 + int(symmetric) + 7 * int(midpoint))
    x = torch.randn(3, 4, 33, generator=gen) * torch.exp(torch.randn(3, 4, 1, generator=gen))
    x[0, 1] = 0.25  # constant group: scale 0 for absmax-free min-max, codes 0
    x[1, 2, :] = 0.0  # all-zero group (scale 0 for both kinds)
    x[2, 3, 5] = float("nan")  # a non-finite group
    x[2, 0, 7] = float("-inf")
    x0 = x.to(dtype).transpose(0, 1)  # a non-contiguous view, as the per-channel codec passes
    # all groups finite (the path without a mask) and with the non-finite groups
    for x in (x0.nan_to_num(0.0, 0.0, 0.0), x0):
        before = x.clone()
        q = quantize_groups(
            x, bits, symmetric=symmetric, midpoint=midpoint, scale_dtype=scale_dtype
        )
        assert torch.equal(x.isnan(), before.isnan())
        assert torch.equal(x.nan_to_num(), before.nan_to_num())
        assert (q.bits, q.symmetric, q.midpoint) == (bits, symmetric, midpoint)
        _check_against_loop(q, x, bits, symmetric, midpoint, scale_dtype)


def _check_against_loop(g, x, bits, symmetric, midpoint, scale_dtype) -> None:
    codes, scales, zeros = _loop_reference(x, bits, symmetric, midpoint, scale_dtype)
    got_c = g.codes.reshape(len(codes), -1)
    got_s = g.scale.float().flatten().tolist()
    got_z = None if g.zero is None else g.zero.float().flatten().tolist()
    assert (got_z is None) == (zeros is None)
    for i, c in enumerate(codes):
        if c is None:
            assert math.isnan(got_s[i]) and (got_z is None or math.isnan(got_z[i]))
            continue
        assert torch.equal(got_c[i].long(), c), i
        assert got_s[i] == scales[i], i
        if zeros is not None:
            assert got_z[i] == zeros[i], i


@pytest.mark.parametrize("n", [1, 3, 7, 15, 16, 40])
def test_bucket_index_is_bucketize(n) -> None:
    # equal to torch.bucketize (right=False) including elements equal to a boundary, the
    # comparison passes (<= 15 boundaries) and the fallback alike; non-finite x falls back
    from kvbench.cache.quant import bucket_index

    gen = torch.Generator().manual_seed(n)
    bnd = torch.sort(torch.randn(n, generator=gen)).values
    x = torch.randn(4, 3, 257, generator=gen) * 2
    x.view(-1)[: 3 * n : 3] = bnd.repeat(1)  # ties with every boundary
    got = bucket_index(x, bnd)
    assert torch.equal(got.long(), torch.bucketize(x, bnd))
    assert got.dtype == (torch.uint8 if n <= 15 else torch.int64)
    x[0, 0, 0] = float("nan")
    assert torch.equal(bucket_index(x, bnd), torch.bucketize(x, bnd))


def test_stored_min_above_the_true_min_clamps_codes_at_zero() -> None:
    # float16 stores the min 4099 as 4100 (the float16 step is 4 there and 4099 is nearer
    # 4100), so (x - 4100) / s = -15 for the elements below the stored min: they must come out
    # as code 0 (dequantizing to the stored min), never as a negative code
    x = torch.tensor([[4099.0, 4099.0, 4101.0, 4100.5]])
    g = quantize_groups(x, 4)
    assert float(np.float16(4099.0)) == 4100.0 and g.zero.item() == 4100.0
    # s = (4101 - 4100) / 15 rounded up to float16: float16(1/15) = 0.06665 is below it, the
    # next float16 up is 0.06671142578125 (the step is 2^-14 there)
    assert float(np.float16(np.float32(1) / 15)) < 1 / 15
    assert g.scale.item() == float(np.float16(np.float32(1) / 15)) + 2.0**-14
    assert g.codes.tolist() == [[0, 0, 15, 7]]  # 1 / s = 14.99, 0.5 / s = 7.495


# ------------------------------------------------------------------ codec layouts (kv.blocks)
def _affine(bits, d, dtype, names, tokens, channels, packing="lsb-first"):
    """The layout of docs/methods.md#common-conventions written out: ``bits``-bit codes of
    ``d`` channels, one of each of ``names`` per ``tokens`` x ``channels`` rectangle."""
    from kvbench.cache.layout import BlockLayout, Codes, GroupTerms

    terms = GroupTerms(names, dtype, tokens, channels)
    return BlockLayout(Codes.uniform(bits, d, packing), terms, page_len=tokens)


SZ = ("scale", "zero")


@pytest.mark.parametrize(
    "codec, args, want",
    [
        # KIVI per-channel: one fp16 (scale, zero) per channel per G tokens
        (PerChannelCodec(2, torch.float16, group_size=4), (16,), _affine(2, 16, "float16", SZ, 4, 1)),
        (PerChannelCodec(2, torch.float16, group_size=4), (16, 64), _affine(2, 16, "float16", SZ, 4, 1)),
        # 16-bit codes are stored as int16; symmetric codes keep no zero
        (PerChannelCodec(16, F32, symmetric=True, group_size=2), (8,),
         _affine(16, 8, "float32", ("scale",), 2, 1, "int16")),
        # per-token: one (scale, zero) per token per channel group
        (PerTokenCodec(4, torch.bfloat16, channel_group=8), (16,), _affine(4, 16, "bfloat16", SZ, 1, 8)),
        (PerTokenCodec(8, torch.float16, symmetric=True, channel_group=4), (8, 32),
         _affine(8, 8, "float16", ("scale",), 1, 4)),
        # whole-flush groups: one per flush of `flush_tokens` tokens x all channels; a flush of
        # 1 token when not given, at least 1 token when 0
        (PerHeadCodec(3), (16, 5), _affine(3, 16, "float16", SZ, 5, 16)),
        (PerHeadCodec(3), (16,), _affine(3, 16, "float16", SZ, 1, 16)),
        (PerHeadCodec(3), (16, 0), _affine(3, 16, "float16", SZ, 1, 16)),
        (PerTensorCodec(5, F32), (8, 3), _affine(5, 8, "float32", SZ, 3, 8)),
        (PerTensorCodec(5, F32), (8,), _affine(5, 8, "float32", SZ, 1, 8)),
    ],
)  # fmt: skip
def test_codec_layout_by_hand(codec, args, want) -> None:
    assert codec.layout(*args) == want


@pytest.mark.usefixtures("affine_path")
@pytest.mark.parametrize(
    "codec, n",
    [
        (PerChannelCodec(2, torch.float16, group_size=4), 8),
        (PerChannelCodec(16, F32, symmetric=True, group_size=2), 4),
        (PerTokenCodec(3, torch.bfloat16, channel_group=4), 3),
        (PerTokenCodec(8, torch.float16, symmetric=True, channel_group=8), 2),
        (PerHeadCodec(4, F32), 6),
    ],
)
def test_codec_layout_bits_are_the_bytes_its_blocks_hold(codec, n) -> None:
    # bytes actually stored by a block of n tokens = elements x the layout's bits / 8
    from kvbench.cache.layout import layout_bits

    b, h, d = 2, 3, 8
    x = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(n))
    blk = codec.encode(x)
    held = sum(t.numel() * t.element_size() for _, t in blk.tensors())
    assert held * 8 == b * h * n * d * layout_bits(codec.layout(d, n))


def test_per_token_layout_rejects_a_channel_group_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match=r"value_group_size=8 does not divide head_dim=12; "
                                          r"choose a divisor of 12"):  # fmt: skip
        PerTokenCodec(2, channel_group=8).layout(12)
    with pytest.raises(ValueError, match=r"value_group_size=8 does not divide head_dim=12; "
                                          r"choose a divisor of 12"):  # fmt: skip
        PerTokenCodec(2, channel_group=8).encode(torch.zeros(1, 1, 2, 12))


@pytest.mark.usefixtures("affine_path")
@pytest.mark.parametrize("which", ["per-channel", "per-token", "per-head", "per-tensor"])
def test_codecs_with_codes_not_filling_whole_bytes(ref, which) -> None:
    # 3-bit codes of D = 6 channels: 18 bits in 3 bytes, so unpacking must trim to head_dim
    b, h, n, d, bits = 2, 2, 4, 6, 3
    x = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(5))
    xn = x.double().numpy()
    if which == "per-channel":
        codec, want = PerChannelCodec(bits, F32, group_size=2), ref.per_channel(xn, bits, 2)["xhat"]
    elif which == "per-token":
        codec, want = PerTokenCodec(bits, F32, channel_group=3), ref.per_token(xn, bits, 3)["xhat"]
    elif which == "per-head":
        codec, want = PerHeadCodec(bits, F32), ref.minmax(xn.reshape(b, h, n * d), bits)["xhat"]
    else:
        codec, want = PerTensorCodec(bits, F32), ref.minmax(xn.reshape(-1), bits)["xhat"]
    blk = codec.encode(x)
    assert blk.codes.shape == (b, h, n, 3)
    for dtype in (torch.float16, torch.float64):  # read in the dtype asked for
        assert blk.dequantize(dtype).dtype == dtype
    np.testing.assert_allclose(blk.dequantize(torch.float64).numpy(), want.reshape(b, h, n, d),
                               atol=1e-5)  # fmt: skip
    assert blk.layout == codec.layout(d, n)


@pytest.mark.usefixtures("affine_path")
@pytest.mark.parametrize("keep, lens", [(0, []), (1, [1]), (2, [2]), (3, [2, 1]), (4, [2, 2]),
                                        (6, [2, 2, 2])])  # fmt: skip
def test_block_crop_keeps_the_groups_it_covers(ref, keep, lens) -> None:
    x = torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(keep))
    blk = PerChannelCodec(2, F32, group_size=2).encode(x)
    cut = blk.crop(keep)
    # a group cut in two keeps its (scale, zero); no group beyond the kept tokens is stored
    assert cut.group_len == lens and cut.scale.shape[2] == cut.zero.shape[2] == len(lens)
    assert all(ref.own(t) for _, t in cut.tensors())
    held = sum(t.numel() * t.element_size() for _, t in cut.tensors())
    assert held == keep * 2 * 1 + len(lens) * 2 * 4 * 2 * 4  # 2-bit codes; fp32 (scale, zero)
    if keep:
        want = ref.per_channel(x.double().numpy(), 2, 2)["xhat"][:, :, :keep]
        np.testing.assert_allclose(cut.dequantize(torch.float64).numpy(), want, atol=1e-5)


@pytest.mark.usefixtures("affine_path")
def test_block_crop_of_symmetric_codes_keeps_no_zero() -> None:
    x = torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(9))
    blk = PerChannelCodec(2, F32, symmetric=True, group_size=2).encode(x)
    cut = blk.crop(3)
    assert cut.zero is None and cut.group_len == [2, 1] and cut.scale.shape[2] == 2
    torch.testing.assert_close(cut.dequantize(F32), blk.dequantize(F32)[:, :, :3])


@pytest.mark.usefixtures("affine_path")
@pytest.mark.parametrize("symmetric", [False, True])
def test_block_cat_appends_tokens_and_groups(symmetric) -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 2, 4, 4, generator=g), torch.randn(2, 2, 2, 4, generator=g)
    codec = PerChannelCodec(2, F32, symmetric=symmetric, group_size=2)
    ba, bb = codec.encode(a), codec.encode(b)
    both = ba.cat(bb)
    assert both.group_len == [2, 2, 2] and both.ntokens == 6 and both.scale.shape[2] == 3
    assert (both.zero is None) == symmetric
    torch.testing.assert_close(
        both.dequantize(F32), torch.cat([ba.dequantize(F32), bb.dequantize(F32)], dim=2)
    )
    # the codes and metadata of the two parts, in order, nothing else
    held = sum(t.numel() * t.element_size() for _, t in both.tensors())
    assert held == sum(t.numel() * t.element_size() for blk in (ba, bb) for _, t in blk.tensors())


@pytest.mark.usefixtures("affine_path")
@pytest.mark.parametrize(
    "other",
    [
        PerTokenCodec(3, F32, channel_group=4),  # bits
        PerTokenCodec(2, F32, symmetric=True, channel_group=4),  # symmetric
        PerTokenCodec(2, F32, channel_group=2),  # channel groups
    ],
)
def test_block_cat_refuses_other_settings(other) -> None:
    x = torch.randn(1, 1, 2, 4, generator=torch.Generator().manual_seed(0))
    blk = PerTokenCodec(2, F32, channel_group=4).encode(x)
    msg = "cannot concatenate blocks of different quantizer settings"
    with pytest.raises(ValueError, match=msg):
        blk.cat(other.encode(x))
    with pytest.raises(ValueError, match=msg):
        other.encode(x).cat(blk)


@pytest.mark.usefixtures("affine_path")
def test_block_cat_refuses_one_bit_midpoint_with_plain() -> None:
    x = torch.randn(1, 1, 2, 4, generator=torch.Generator().manual_seed(1))
    mid = PerTokenCodec(1, F32, midpoint=True, channel_group=4).encode(x)
    plain = PerTokenCodec(1, F32, channel_group=4).encode(x)
    with pytest.raises(ValueError, match="different quantizer settings"):
        mid.cat(plain)
    assert mid.cat(mid).ntokens == 4


@pytest.mark.usefixtures("affine_path")
@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_per_token_block_by_hand(bits) -> None:
    # symmetric codes: s = max|x| / (2^(b-1) - 1) per group, x^ = round(x / s) * s
    x = torch.randn(2, 1, 3, 8, generator=torch.Generator().manual_seed(bits))
    blk = PerTokenCodec(bits, F32, symmetric=True, channel_group=4).encode(x)
    g = x.double().numpy().reshape(2, 1, 3, 2, 4)
    s = np.abs(g).max(-1, keepdims=True) / (2 ** (bits - 1) - 1)
    want = (np.round(g / s) * s).reshape(2, 1, 3, 8)
    assert blk.zero is None
    np.testing.assert_allclose(blk.dequantize(torch.float64).numpy(), want, rtol=0, atol=1e-6)


def test_per_channel_encode_needs_whole_groups() -> None:
    with pytest.raises(
        ValueError, match="per-channel groups need a multiple of group_size=4 tokens, got 6"
    ):
        PerChannelCodec(2, group_size=4).encode(torch.zeros(1, 1, 6, 2))


@pytest.mark.usefixtures("affine_path")
def test_one_bit_midpoint_codec_thresholds_at_the_midpoint() -> None:
    # PN-Mix Eq. 7: q = 1[x - mn >= (mx - mn) / 2]; 0.5 lies on the midpoint, where plain
    # rounding (half to even) gives 0; reconstruction mn + (q + 1/2) * s / 2 with s = 1
    x = torch.tensor([0.0, 0.5, 1.0, 0.25]).reshape(1, 1, 1, 4)
    blk = PerTokenCodec(1, F32, midpoint=True, channel_group=4).encode(x)
    assert blk.unpacked_codes().flatten().tolist() == [0, 1, 1, 0]
    assert blk.dequantize(F32).flatten().tolist() == [0.25, 0.75, 0.75, 0.25]
    # a plain 1-bit codec rounds (x - mn) / s: 0.5 goes to the even code 0
    plain = PerTokenCodec(1, F32, channel_group=4).encode(x)
    assert plain.unpacked_codes().flatten().tolist() == [0, 0, 1, 0]
    assert plain.dequantize(F32).flatten().tolist() == [0.0, 0.0, 1.0, 0.0]


def test_own_storage_keeps_an_owning_tensor_and_compacts_a_view() -> None:
    from kvbench.cache.blocks import own_storage

    t = torch.randn(2, 4, 3)
    assert own_storage(t) is t  # spans its whole allocation: no copy
    view = t[0].t()  # [3, 4], strides (1, 3): dense, but a third of a 24-float allocation
    kept = own_storage(view)
    assert torch.equal(kept, view) and kept.is_contiguous()
    assert kept.untyped_storage().nbytes() == 12 * 4


# ------------------------------------------- stored terms by hand, on both quantizer paths


def _up16(v: np.ndarray) -> np.ndarray:
    """The smallest float16 >= ``v`` (float64, finite, >= 0), as float64."""
    h = v.astype(np.float16)
    bump = h.astype(np.float64) < v
    return np.where(bump, np.nextafter(h, np.float16(np.inf)), h).astype(np.float64)


def _grouped(x: np.ndarray, which: str, size: int) -> tuple[np.ndarray, object]:
    """``x [B, H, T, D]`` as ``[..., n]`` groups of the codec ``which``, and the inverse map of
    per-element values of that shape back to ``[B, H, T, D]``."""
    b, h, t, d = x.shape
    if which == "per-channel":  # `size` tokens of one channel
        g = x.reshape(b, h, t // size, size, d).swapaxes(-1, -2)
        return g, lambda v: v.swapaxes(-1, -2).reshape(b, h, t, d)
    if which == "per-token":  # `size` channels of one token
        return x.reshape(b, h, t, d // size, size), lambda v: v.reshape(b, h, t, d)
    if which == "per-head":
        return x.reshape(b, h, 1, 1, t * d), lambda v: v.reshape(b, h, t, d)
    return x.reshape(1, 1, 1, 1, -1), lambda v: v.reshape(b, h, t, d)


@pytest.mark.usefixtures("affine_path")
@pytest.mark.parametrize("which", ["per-channel", "per-token", "per-head", "per-tensor"])
@pytest.mark.parametrize("symmetric, bits", [(False, 3), (True, 4)])
def test_float16_terms_and_codes_by_hand(which, symmetric, bits) -> None:
    # float16 terms (the codecs' default): zero = the group min rounded to the nearest
    # float16, scale = (max - zero) / (2^b - 1) rounded *up* to a float16 (symmetric:
    # max |x| / (2^(b-1) - 1) rounded up), codes = round-half-even((x - zero) / scale)
    # clamped to [0, 2^b - 1] (symmetric: round(x / scale) + 2^(b-1)); docs/methods.md
    b, h, t, d, size = 2, 3, 8, 8, 4
    x = torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(bits)) * 3
    codec = {
        "per-channel": PerChannelCodec(bits, symmetric=symmetric, group_size=size),
        "per-token": PerTokenCodec(bits, symmetric=symmetric, channel_group=size),
        "per-head": PerHeadCodec(bits, symmetric=symmetric),
        "per-tensor": PerTensorCodec(bits, symmetric=symmetric),
    }[which]
    blk = codec.encode(x)
    g, back = _grouped(x.double().numpy(), which, size)
    if symmetric:
        half = 2 ** (bits - 1) - 1
        s = _up16(np.abs(g).max(-1, keepdims=True) / half)
        codes = np.clip(np.rint(g / s), -half, half) + half + 1
        assert blk.zero is None
    else:
        qmax = 2**bits - 1
        z = g.min(-1, keepdims=True).astype(np.float16).astype(np.float64)
        s = _up16((g.max(-1, keepdims=True) - z) / qmax)
        codes = np.clip(np.rint((g - z) / s), 0, qmax)
        assert blk.zero.dtype == torch.float16
        np.testing.assert_array_equal(blk.zero.double().numpy().ravel(), z.ravel())
    assert blk.scale.dtype == torch.float16
    np.testing.assert_array_equal(blk.scale.double().numpy().ravel(), s.ravel())
    want = back(np.broadcast_to(codes, g.shape))
    np.testing.assert_array_equal(blk.unpacked_codes().numpy(), want)
    assert blk.codes.shape == (b, h, t, d * bits // 8) and blk.codes.dtype == torch.uint8
    assert blk.group_len == {"per-channel": [size] * (t // size), "per-token": [1] * t}.get(
        which, [t]
    )
    assert (blk.bits, blk.head_dim, blk.symmetric, blk.midpoint) == (bits, d, symmetric, False)
    assert blk.batch_shared == (which == "per-tensor")


def test_native_rows_split_across_threads(ref, monkeypatch) -> None:
    # rows (batch row, KV head) are split into min(threads, rows, elements // MIN_PER_THREAD)
    # consecutive parts (at least one), each quantized by its own call: every row's codes and
    # terms must be there, as the float64 reference has them
    from kvbench.cache import native_quant as nq

    if not nq.available():
        pytest.skip(f"native quantizer: {nq.unavailable_reason()}")
    monkeypatch.setattr(nq, "MIN_PER_THREAD", 16)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert nq._split(6, 32) == [(0, 2), (2, 4), (4, 6)]
        assert nq._split(5, 32) == [(0, 1), (1, 3), (3, 5)]
        assert nq._split(2, 32) == [(0, 1), (1, 2)]  # fewer rows than threads
        assert nq._split(6, 6) == [(0, 3), (3, 6)]  # 36 elements: 2 parts of 16
        assert nq._split(6, 5) == [(0, 6)]  # 30 elements: one part of 16
        assert nq._split(6, 2) == [(0, 6)]  # 12 elements: at least one part
        x = torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(7)).half()
        xn = x.double().numpy()
        for codec, want in (
            (PerChannelCodec(2, F32, group_size=4), ref.per_channel(xn, 2, 4)),
            (PerTokenCodec(3, F32, channel_group=4), ref.per_token(xn, 3, 4)),
        ):
            blk = codec.encode(x)
            np.testing.assert_array_equal(blk.unpacked_codes().numpy(), want["codes"])
            np.testing.assert_allclose(blk.dequantize(torch.float64).numpy(), want["xhat"],
                                       atol=1e-5)  # fmt: skip
        served = nq.quantize_pack(x, 2, 4, 1, scale_dtype=F32)
        assert served is not None and served[0].shape == (2, 3, 8, 1)
    finally:
        torch.set_num_threads(before)


def test_native_quantize_pack_defaults_and_what_it_declines(ref) -> None:
    # called as the mixed-precision codecs and semkv call it: asymmetric, per row (not shared),
    # float16 terms, packed codes by default; None (the caller's torch path runs) for what it
    # does not serve
    from kvbench.cache import native_quant as nq

    if not nq.available():
        pytest.skip(f"native quantizer: {nq.unavailable_reason()}")
    x = torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(11))
    codes, scale, zero = nq.quantize_pack(x, 3, 4, 1)
    g = x.double().numpy().reshape(2, 3, 2, 4, 4).swapaxes(-1, -2)  # 4 tokens of a channel
    z = g.min(-1).astype(np.float16).astype(np.float64)
    s = _up16((g.max(-1) - z) / 7)
    want = np.clip(np.rint((g - z[..., None]) / s[..., None]), 0, 7).swapaxes(-1, -2)
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == zero.shape == (2, 3, 2, 4)
    np.testing.assert_array_equal(zero.double().numpy(), z)
    np.testing.assert_array_equal(scale.double().numpy(), s)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 8, 2)  # 4 x 3 bits in 2 bytes
    from kvbench.cache.quant import unpack_bits

    np.testing.assert_array_equal(unpack_bits(codes, 3, 4).numpy(), want.reshape(2, 3, 8, 4))
    loose, _, _ = nq.quantize_pack(x, 3, 4, 1, packed=False)  # one code per byte
    np.testing.assert_array_equal(loose.numpy(), want.reshape(2, 3, 8, 4))
    declined = [
        x.double(),  # float64
        x[0],  # not [B, H_kv, T, D]
        x[:, :, :0],  # no tokens
        x.transpose(-1, -2),  # channels not contiguous
    ]
    assert all(nq.quantize_pack(v, 2, 4, 1) is None for v in declined)
    assert all(nq.quantize_pack(x, b, 4, 1) is None for b in (0, 9, 16))  # 16: int16 codes
    assert nq.quantize_pack(x, 1, 4, 1, symmetric=True) is None  # symmetric 1-bit
    assert nq.quantize_pack(x, 2, 4, 1, midpoint=True) is None  # midpoint: 1-bit only
    assert nq.quantize_pack(x, 1, 4, 1, midpoint=True, symmetric=True) is None
    assert nq.quantize_pack(x, 2, 4, 1, symmetric=True) is not None  # the smallest symmetric
    assert nq.quantize_pack(x, 1, 4, 1, midpoint=True) is not None
    assert nq.quantize_pack(x.half(), 8, 4, 1) is not None
    assert nq.quantize_pack(x.transpose(-1, -2)[..., :1], 2, 4, 1) is not None  # D = 1: any stride
    with pytest.raises(ValueError, match=r"groups of 3 tokens x 1 channels do not tile "
                                         r"\[T, D\] = \[8, 4\]"):  # fmt: skip
        nq.quantize_pack(x, 2, 3, 1)
    with pytest.raises(ValueError, match=r"groups of 4 tokens x 3 channels do not tile"):
        nq.quantize_pack(x, 2, 4, 3)
