"""fp8 KV cache: fp16 scale underflow to a subnormal, reciprocal overflow, 0*inf = NaN: pytorch/ao#1766 (PR#1770), docs/methods.md#half-precision-scale-underflow-and-reciprocal-overflow; large outlier channel vs per-tensor fp8 with default scale 1.0: vllm-project/vllm#41343 (and PR#2279 review), docs/methods.md#large-outlier-channel-with-per-tensor-fp8-and-unit-scale; uint8 buffer holding fp8 bits must be reinterpreted, not value-cast: vllm-project/vllm PR#3234 (fixes #3156), docs/methods.md#uint8-storage-reinterpreted-as-fp8; fp8 rounding (RTNE) and inf handling: triton-lang/triton#5925 (+ #5927, PR#11753), docs/methods.md#fp8-rounding-and-infinity-handling; negative zero and tiny negatives in FNUZ fp8 formats: triton-lang/triton PR#3997, docs/methods.md#negative-zero-and-tiny-negatives-in-fnuz-formats with their right values, hand byte counts and
the documented inf / NaN / overflow behaviour."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import kvbench
from kvbench.methods.fp8 import FP8, FP8Block, FP8Codec, FP8Config, fp8_decode, fp8_encode


def _layer(**cfg):
    return FP8(**cfg).new_layer(0, 1, 4)


def _bytes(x: torch.Tensor) -> list[int]:
    return x.view(torch.uint8).flatten().tolist()


# --------------------------------------------------------------------------- fp16 scale underflow to a subnormal, reciprocal overflow, 0*inf = NaN: pytorch/ao#1766 (PR#1770), docs/methods.md#half-precision-scale-underflow-and-reciprocal-overflow
def test_kvq14_fp16_row_scale_to_e5m2_has_no_nan():
    x = torch.tensor([0.0, 0.0, 0.1, 0.1], dtype=torch.float16).reshape(1, 1, 1, 4)
    layer = FP8(format="e5m2", scale="amax", scale_granularity="per-token").new_layer(0, 1, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no saturation: amax / s lands exactly on the max
        layer.prefill(x, x)
    block = layer.k.block
    assert block.codes.dtype == torch.float8_e5m2
    assert block.codes.float().flatten().tolist() == [0.0, 0.0, 57344.0, 57344.0]
    # the fp32 scale is fp16(0.1) / 57344 = 1.7434e-6 (an fp16 subnormal, kept in fp32)
    s_ref = float(np.float16(0.1)) / 57344.0
    assert block.scale.dtype == torch.float32
    assert math.isclose(block.scale.item(), s_ref, rel_tol=1e-6)
    keys, _ = layer.keys_values(torch.float32)
    assert not torch.isnan(keys).any()
    np.testing.assert_allclose(keys.flatten().numpy(), [0, 0, 0.1, 0.1], rtol=1e-3, atol=0)
    # fp16 scale: 1.7434e-6 is subnormal, rounded up to 30 * 2^-24; 0.09998 / s = 55911 still
    # rounds to 57344 in e5m2, so the dequantized 0.1 comes back as 57344 * 30 * 2^-24
    half = FP8(format="e5m2", scale="amax", scale_granularity="per-token", scale_dtype="float16")
    layer = half.new_layer(0, 1, 4)
    layer.prefill(x, x)
    assert layer.k.block.scale.item() == 30 * 2.0**-24
    assert layer.k.block.codes.float().flatten().tolist() == [0.0, 0.0, 57344.0, 57344.0]
    deq = layer.keys_values(torch.float32)[0].flatten().tolist()
    assert deq == [0.0, 0.0, 0.1025390625, 0.1025390625]


# --------------------------------------------------------------------------- large outlier channel vs per-tensor fp8 with default scale 1.0: vllm-project/vllm#41343 (and PR#2279 review), docs/methods.md#large-outlier-channel-with-per-tensor-fp8-and-unit-scale
def _kvq19_keys() -> torch.Tensor:
    k = torch.zeros(1, 1, 4, 8, dtype=torch.float16)
    k[..., 0] = 60000.0
    k[..., 1:] = 0.01 * torch.arange(1, 8, dtype=torch.float16)
    return k


@pytest.mark.parametrize(("fmt", "top"), [("e4m3fn", 448.0), ("e5m2", 57344.0)])
def test_kvq19a_unit_scale_saturates_with_warning_or_raises(fmt, top):
    k = _kvq19_keys()
    layer = FP8(format=fmt).new_layer(0, 1, 8)
    with pytest.warns(RuntimeWarning, match="saturated"):
        layer.prefill(k, k)
    keys, _ = layer.keys_values(torch.float32)
    assert torch.isfinite(keys).all()
    assert keys[..., 0].flatten().tolist() == [top] * 4
    strict = FP8(format=fmt, overflow="raise").new_layer(0, 1, 8)
    with pytest.raises(ValueError, match="overflow='raise'"):
        strict.prefill(k, k)


@pytest.mark.parametrize(("fmt", "tol"), [("e4m3fn", 2**-4), ("e5m2", 2**-3)])
def test_kvq19b_per_tensor_amax_scale_keeps_the_outlier(fmt, tol):
    k = _kvq19_keys()
    layer = FP8(format=fmt, scale="amax", scale_granularity="per-tensor").new_layer(0, 1, 8)
    layer.prefill(k, k)
    keys, _ = layer.keys_values(torch.float32)
    assert torch.isfinite(keys).all()
    rel = (keys[..., 0] - 60000.0).abs() / 60000.0
    assert rel.max() <= tol
    if fmt == "e4m3fn":
        # documented limit: s = 60000/448 = 133.9, so 0.07/s = 5.2e-4 < 2^-10 (half the least
        # e4m3 subnormal 2^-9) and every small channel underflows to 0
        assert keys[..., 1:].abs().max() == 0
    else:  # e5m2: s = 1.046, the small channels stay normal numbers
        small = k[..., 1:].float()
        assert ((keys[..., 1:] - small).abs() / small).max() <= tol


@pytest.mark.parametrize(("fmt", "tol"), [("e4m3fn", 2**-4), ("e5m2", 2**-3)])
def test_kvq19c_per_channel_scale_reference(fmt, tol):
    """Per-channel scaling is not a granularity of the method (a 1-token flush would give one
    scale per element); the reference here uses the module's fp8 encode/decode per channel."""
    k = _kvq19_keys().float()
    top = torch.finfo(kvbench.methods.fp8.FORMATS[fmt]).max
    s = k.abs().amax(dim=2, keepdim=True) / top  # one scale per channel over the 4 tokens
    back = fp8_decode(fp8_encode(k / s, fmt), fmt) * s
    assert ((back - k).abs() / k.abs()).max() <= tol


# --------------------------------------------------------------------------- uint8 buffer holding fp8 bits must be reinterpreted, not value-cast: vllm-project/vllm PR#3234 (fixes #3156), docs/methods.md#uint8-storage-reinterpreted-as-fp8
def test_kvq20_uint8_buffer_is_reinterpreted_not_value_cast():
    buf = torch.tensor([0x3C, 0xC0, 0x38, 0x00], dtype=torch.uint8)
    assert fp8_decode(buf, "e5m2").tolist() == [1.0, -2.0, 0.5, 0.0]
    assert buf.float().tolist() == [60.0, 192.0, 56.0, 0.0]  # what a value cast would give
    block = FP8Block(buf.reshape(1, 1, 1, 4), None, [1], "e5m2")
    assert block.dequantize(torch.float32).flatten().tolist() == [1.0, -2.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="uint8"):
        fp8_decode(buf.to(torch.int8), "e5m2")


# --------------------------------------------------------------------------- fp8 rounding (RTNE) and inf handling: triton-lang/triton#5925 (+ #5927, PR#11753), docs/methods.md#fp8-rounding-and-infinity-handling
def test_kvq22_e5m2_rtne_reference_and_codec():
    x = torch.tensor([9.0, 11.0, 1.125, 57344.0, float("inf"), -0.0], dtype=torch.float16)
    ref = x.to(torch.float8_e5m2).float()  # the reference side: torch's RTNE cast
    assert ref[:4].tolist() == [8.0, 12.0, 1.0, 57344.0]
    assert ref[4] == float("inf") and ref[5] == 0 and torch.signbit(ref[5])
    # the codec (unit scale) agrees bit for bit on the finite inputs and saturates inf to the
    # max with a warning (documented; vLLM/TensorRT-LLM casts are satfinite)
    with pytest.warns(RuntimeWarning, match="saturated"):
        block = FP8Codec("e5m2").encode(x.reshape(1, 1, 1, 6))
    got = block.codes.flatten()
    assert _bytes(got[[0, 1, 2, 3, 5]]) == _bytes(x[[0, 1, 2, 3, 5]].to(torch.float8_e5m2))
    assert got.float()[4] == 57344.0


# --------------------------------------------------------------------------- negative zero and tiny negatives in FNUZ fp8 formats: triton-lang/triton PR#3997, docs/methods.md#negative-zero-and-tiny-negatives-in-fnuz-formats
def test_kvq23_fnuz_negative_zero_and_tiny_values():
    x = torch.tensor([-0.0, -1e-9, 1e-9, -0.001]).reshape(1, 1, 1, 4)
    block = FP8Codec("e4m3fnuz").encode(x)
    assert _bytes(block.codes) == [0x00, 0x00, 0x00, 0x81]
    out = block.dequantize(torch.float32).flatten()
    assert out[:3].tolist() == [0.0, 0.0, 0.0] and not torch.isnan(out).any()
    assert out[3].item() == -(2.0**-10)
    assert torch.isnan(fp8_decode(torch.tensor([0x80], dtype=torch.uint8), "e4m3fnuz")).all()


# --------------------------------------------------------------------------- NaN, zeros
def test_nan_stays_nan_and_does_not_spoil_the_scale():
    x = torch.tensor([1.0, float("nan"), 2.0, 0.0]).reshape(1, 1, 1, 4)
    block = FP8Codec("e4m3fn", "amax", "per-token").encode(x)
    assert block.scale.item() == pytest.approx(2.0 / 448.0, rel=1e-6)
    out = block.dequantize(torch.float32).flatten()
    assert torch.isnan(out[1])
    assert out[[0, 2, 3]].tolist() == pytest.approx([1.0, 2.0, 0.0], rel=2**-4)


def test_nan_survives_the_saturation_path():
    x = torch.tensor([float("nan"), 1000.0, -float("inf"), 3.0]).reshape(1, 1, 1, 4)
    with pytest.warns(RuntimeWarning, match="2 value"):
        out = FP8Codec("e4m3fn").encode(x).dequantize(torch.float32).flatten()
    assert torch.isnan(out[0]) and out[1:].tolist() == [448.0, -448.0, 3.0]


def test_all_zero_granule_stores_unit_scale_and_is_exact():
    x = torch.zeros(1, 1, 2, 4)
    block = FP8Codec("e4m3fn", "amax", "per-token").encode(x)
    assert block.scale.flatten().tolist() == [1.0, 1.0]
    assert block.dequantize(torch.float32).abs().max() == 0


def test_amax_per_token_matches_a_float64_reference():
    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    block = FP8Codec("e4m3fn", "amax", "per-token").encode(x.float())
    s = x.abs().amax(-1, keepdim=True) / 448.0
    np.testing.assert_allclose(block.scale.double().numpy(), s.numpy(), rtol=1e-6)
    y = (x.float() / block.scale).to(torch.float8_e4m3fn).double() * block.scale.double()
    np.testing.assert_allclose(block.dequantize(torch.float64).numpy(), y.numpy(), rtol=1e-6)
    assert ((y - x).abs() <= 2**-4 * x.abs() + 2**-9 * s).all()  # half ulp, or subnormal step


# --------------------------------------------------------------------------- bytes, windows
@pytest.mark.parametrize(
    ("cfg", "scale_bytes"),
    [
        ({}, 0),  # unit: nothing stored
        ({"scale": "amax", "scale_granularity": "per-token"}, 2 * 3 * 5 * 4),
        ({"scale": "amax", "scale_granularity": "per-head"}, 2 * 3 * 4),
        ({"scale": "amax", "scale_granularity": "per-tensor"}, 4),
        ({"scale": "amax", "scale_granularity": "per-token", "scale_dtype": "float16"}, 60),
    ],
)
def test_bytes_by_hand(cfg, scale_bytes):
    layer = FP8(**cfg).new_layer(0, 3, 8)
    x = torch.randn(2, 3, 5, 8)
    layer.prefill(x, x.clone())
    nb = layer.nbytes()
    assert nb["codes"] == 2 * (2 * 3 * 5 * 8)  # one byte per element, keys and values
    assert nb["scales"] == 2 * scale_bytes
    assert nb["residual"] == nb["sinks"] == nb["metadata"] == 0
    assert nb["total"] == 2 * (240 + scale_bytes)


def test_windows_and_decode_flushes():
    x = torch.randn(1, 2, 10, 8)
    tok = FP8(scale="amax", scale_granularity="per-token", residual_length=4).new_layer(0, 2, 8)
    tok.prefill(x, x)
    assert tok.quantized_tokens() == (6, 6)  # sliding window of the R = 4 newest
    ten = FP8(scale="amax", residual_length=4).new_layer(0, 2, 8)  # per-tensor: blocks of R
    ten.prefill(x, x)
    assert ten.quantized_tokens() == (8, 8)
    eng = FP8(scale="amax").new_layer(0, 2, 8)  # R = 0: prompt then each token on write
    eng.prefill(x, x)
    eng.append(x[:, :, :1], x[:, :, :1])
    eng.end_step()
    assert eng.quantized_tokens() == (11, 11) and eng.nbytes()["scales"] == 2 * 2 * 4
    assert eng.k.block.group_len == [10, 1]


def test_batch_ops_per_tensor_scale_is_shared_per_token_scale_follows_rows():
    x = torch.randn(1, 2, 6, 8)
    for gran, scales in (("per-tensor", 1), ("per-token", 3 * 2 * 6)):
        layer = FP8(scale="amax", scale_granularity=gran).new_layer(0, 2, 8)
        layer.prefill(x, x)
        before, _ = layer.keys_values()
        layer.repeat_batch(3)
        after, _ = layer.keys_values()
        assert torch.equal(after, before.expand(3, -1, -1, -1))
        assert layer.k.block.scale.numel() == scales
        layer.index_batch(torch.tensor([2]))
        layer.crop(4)
        assert torch.equal(layer.keys_values()[0], before[:, :, :4])


def test_average_bits():
    assert FP8().average_bits(128)["key_bits"] == 8.0
    tok = FP8(scale="amax", scale_granularity="per-token")
    assert tok.average_bits(128)["key_bits"] == pytest.approx(8 + 32 / 128)
    assert tok.average_bits(128)["value_bits"] == pytest.approx(8.25)
    half = FP8(scale="amax", scale_granularity="per-token", scale_dtype="float16")
    assert half.average_bits(64)["key_bits"] == pytest.approx(8 + 16 / 64)
    head = FP8(scale="amax", scale_granularity="per-head", residual_length=128)
    assert head.average_bits(128)["key_bits"] == pytest.approx(8 + 32 / (128 * 128))


def test_fp16_scale_overflow_raises():
    x = torch.full((1, 1, 1, 4), 1e10)
    with pytest.raises(ValueError, match="scale_dtype"):
        FP8Codec("e4m3fn", "amax", "per-token", torch.float16).encode(x)


def test_registry_and_capabilities():
    m = kvbench.get_method("fp8", format="e5m2")
    assert isinstance(m, FP8) and m.config.format == "e5m2"
    caps = FP8.capabilities
    assert caps.keys_values
    assert not (caps.needs_queries or caps.needs_calibration)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("format", "e4m3"),
        ("scale", "calibrated"),
        ("scale_granularity", "per-channel"),
        ("scale_dtype", "bfloat16"),
        ("overflow", "wrap"),
        ("residual_length", -1),
        ("num_sink_tokens", 1.5),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FP8Config(**{field: value})


# --------------------------------------------------------------------------- chunked encode
@pytest.mark.parametrize("granularity", ["per-token", "per-head", "per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_encode_equals_one_pass(granularity, dtype, monkeypatch):
    """Encoded chunk by chunk along T (a chunk of 3 tokens here, 7 chunks), the codes and
    scales equal one pass of the plain formula: s = amax / 448 (rounded up to the scale dtype,
    never below amax / 448), codes = (x / s) cast to e4m3; the input is left unchanged."""
    from kvbench.cache import chunks

    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 2 * 3 * 3 * 16)
    x = (4 * torch.randn(2, 3, 20, 16, generator=torch.Generator().manual_seed(1))).to(dtype)
    x[1, 2, 13, 5] = 900.0  # one token far above the rest: its chunk alone sets the maximum
    before = x.clone()
    block = FP8Codec("e4m3fn", "amax", granularity).encode(x)
    assert torch.equal(x, before)
    xd = x.double().abs()
    amax = {
        "per-token": xd.amax(-1, keepdim=True),
        "per-head": xd.amax((-1, -2), keepdim=True),
        "per-tensor": xd.amax().reshape(1, 1, 1, 1),
    }[granularity]
    s = block.scale.double()
    assert s.shape == amax.shape and (s * 448 >= amax).all()
    assert (s <= amax / 448 * (1 + 2**-22)).all()  # at most one float32 ulp above
    want = (x.float() / block.scale.float()).to(torch.float8_e4m3fn)
    assert torch.equal(block.codes.view(torch.uint8), want.view(torch.uint8))


def test_chunked_unit_encode_counts_saturation_over_all_chunks(monkeypatch):
    from kvbench.cache import chunks

    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 1 * 2 * 2 * 8)  # 2 tokens per chunk
    x = torch.zeros(1, 2, 9, 8)
    x[0, 0, 0, 0], x[0, 1, 4, 3], x[0, 0, 8, 7] = 500.0, -1e4, float("inf")
    before = x.clone()
    with pytest.warns(RuntimeWarning, match=r"3 value\(s\) beyond \+-448.*saturated") as rec:
        block = FP8Codec("e4m3fn", "unit").encode(x)
    assert len(rec) == 1 and torch.equal(x, before)
    got = fp8_decode(block.codes, "e4m3fn")
    assert got[0, 0, 0, 0] == 448 and got[0, 1, 4, 3] == -448 and got[0, 0, 8, 7] == 448
    with pytest.raises(ValueError, match=r"3 value\(s\) exceed the e4m3fn range"):
        FP8Codec("e4m3fn", "unit", overflow="raise").encode(x)
