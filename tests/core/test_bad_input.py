"""Bad input: every case is a ValueError that names the field (or the tensor) and what is allowed.

Covers the quantizer primitives, the method configs (kivi, per-channel, per-token, uniform,
per-head) and LayerCache inputs (rank, layout, shapes, dtypes, order of calls).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import kvbench
from kvbench.cache.quant import (
    dequantize_groups,
    fake_quantize,
    pack_bits,
    quantize_groups,
    resolve_scale_dtype,
    unpack_bits,
)

ALLOWED_BITS = r"allowed: 1\.\.8 or 16"
BAD_BITS = [0, -1, 9, 12, 15, 17, 32, 2.0, True, "2", None]


# ------------------------------------------------------------------ primitives


@pytest.mark.parametrize("bits", BAD_BITS)
def test_primitives_reject_bits(bits) -> None:
    x = torch.randn(2, 8)
    for call in (
        lambda: quantize_groups(x, bits),
        lambda: fake_quantize(x, bits),
        lambda: pack_bits(torch.zeros(8, dtype=torch.int32), bits),
        lambda: unpack_bits(torch.zeros(2, dtype=torch.uint8), bits, 8),
    ):
        with pytest.raises(ValueError, match=rf"bits={bits!r} is not supported; {ALLOWED_BITS}"):
            call()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.complex64,
    ],
)
def test_quantize_rejects_non_float_dtypes(dtype) -> None:
    x = torch.zeros(2, 8).to(dtype)
    with pytest.raises(ValueError, match=r"input dtype .* is not supported; allowed: .*float16"):
        quantize_groups(x, 4)


def test_quantize_mode_combinations() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"symmetric .* needs bits >= 2"):
        quantize_groups(x, 1, symmetric=True)
    with pytest.raises(ValueError, match=r"midpoint .* 1-bit .* bits=4"):
        quantize_groups(x, 4, midpoint=True)


def test_metadata_overflowing_scale_dtype() -> None:
    # a finite group whose min (or scale) does not fit fp16 metadata: refuse, name the fix
    x = torch.tensor([[-1e6, 0.0, 1.0, 2.0]])
    with pytest.raises(ValueError, match=r"overflows scale_dtype=torch.float16; use scale_dtype"):
        quantize_groups(x, 4)
    with pytest.raises(ValueError, match=r"scale overflows scale_dtype"):
        quantize_groups(torch.tensor([[-60000.0, 60000.0]], dtype=torch.float16), 1)
    g = quantize_groups(x, 4, scale_dtype=torch.float32)  # the suggested fix works
    xh = dequantize_groups(g.codes, g.scale, g.zero, 4)
    assert torch.isfinite(xh).all() and xh[0, 0].item() == -1e6


def test_symmetric_scale_overflowing_scale_dtype() -> None:
    # absmax 1e6 at 4 bits: s = 1e6 / 7 = 142857 > 65504, the largest float16
    x = torch.tensor([[-1e6, 0.0, 2.0]])
    with pytest.raises(
        ValueError,
        match=r"^the group scale overflows scale_dtype=torch\.float16; use scale_dtype='float32' "
        r"for inputs of this range$",
    ):
        quantize_groups(x, 4, symmetric=True)
    g = quantize_groups(x, 4, symmetric=True, scale_dtype=torch.float32)  # the suggested fix
    assert g.scale.item() == float(np.float32(1e6) / np.float32(7))
    assert g.codes.tolist() == [[1, 8, 8]]  # round(x / s) + 2^3: -7, 0, 0 (2 / s rounds to 0)


def test_overflow_names_the_min_first_and_non_finite_groups_are_not_overflows() -> None:
    # both checks share one host sync; the message still names the min when it overflows
    with pytest.raises(ValueError, match=r"zero \(group min\) overflows scale_dtype"):
        quantize_groups(torch.tensor([[-1e6, 0.0, 1.0, 2.0]]), 4)
    # a group holding NaN is stored as NaN (its huge scale is not an overflow error); the
    # finite group beside it is quantized as alone
    y = torch.tensor([[float("nan"), 1e6, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]])
    for sym in (False, True):
        g = quantize_groups(y, 4, symmetric=sym)
        alone = quantize_groups(y[1:], 4, symmetric=sym)
        assert torch.isnan(g.scale[0]).all() and torch.equal(g.scale[1:], alone.scale)
        assert torch.equal(g.codes[1:], alone.codes)
        assert sym or (torch.isnan(g.zero[0]).all() and torch.equal(g.zero[1:], alone.zero))


def test_overflow_error_names_the_finite_group_that_overflows() -> None:
    # row 0 holds NaN (stored as NaN), so its min -1e6 is no overflow; row 1 is finite and its
    # 1-bit scale (60000 - -60000) / 1 = 120000 overflows float16 (max 65504) while its min fits:
    # the error names the scale, not the NaN group's min
    x = torch.tensor([[float("nan"), -1e6, 0.0, 1.0], [-60000.0, 60000.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"^the group scale overflows scale_dtype=torch\.float16"):
        quantize_groups(x, 1)
    g = quantize_groups(x[:1], 1)  # the NaN group alone: no error, NaN metadata
    assert torch.isnan(g.scale).all() and torch.isnan(g.zero).all()


@pytest.mark.usefixtures("affine_path")
@pytest.mark.parametrize(
    "row, bits, symmetric, what",
    [
        ([-1e5, 0.0, 1.0, 2.0], 4, False, r"zero \(group min\)"),  # the min beyond 65504
        ([-6e4, 6e4, 0.0, 0.0], 1, False, "scale"),  # (6e4 - -6e4) / 1 > 65504, the min fits
        ([-1e6, 0.0, 1.0, 2.0], 4, True, "scale"),  # 1e6 / 7 > 65504
    ],
)
def test_codec_overflowing_float16_terms_raise_on_both_paths(row, bits, symmetric, what) -> None:
    # through a codec (float16 terms by default), on the native path and the torch path alike
    from kvbench.cache.blocks import PerTokenCodec

    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], row]).reshape(1, 1, 2, 4)
    codec = PerTokenCodec(bits, symmetric=symmetric, channel_group=4)
    with pytest.raises(
        ValueError, match=rf"^the group {what} overflows scale_dtype=torch\.float16"
    ):
        codec.encode(x)
    fits = PerTokenCodec(bits, torch.float32, symmetric=symmetric, channel_group=4).encode(x)
    assert bool(torch.isfinite(fits.scale).all())  # the suggested fix: float32 terms


@pytest.mark.parametrize("name", ["float64", "fp16", "float8_e4m3fn", "half", torch.float64, 16])
def test_resolve_scale_dtype(name) -> None:
    with pytest.raises(
        ValueError,
        match=r"scale_dtype=.* is not supported; allowed: "
        r"\['bfloat16', 'float16', 'float32'\]",
    ):
        resolve_scale_dtype(name)


# ------------------------------------------------------------------ method configs

QUANT_METHODS = ["kivi", "per-channel", "per-token", "uniform", "per-head"]


@pytest.mark.parametrize("name", QUANT_METHODS)
@pytest.mark.parametrize("field", ["bits", "value_bits"])
@pytest.mark.parametrize("bits", [0, 9, 3.0, True, "4"])
def test_config_bits(name, field, bits) -> None:
    want = rf"Config: field '{field}': {re.escape(repr(bits))} is not allowed; {ALLOWED_BITS}$"
    with pytest.raises(ValueError, match=want):
        kvbench.get_method(name, **{field: bits})


@pytest.mark.parametrize("name", QUANT_METHODS)
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("group_size", 0),
        ("group_size", 32.0),
        ("group_size", "32"),
        ("residual_length", -1),
        ("residual_length", "128"),
        ("residual_length", 128.0),
        ("num_sink_tokens", -1),
        ("num_sink_tokens", 1.5),
        ("num_sink_tokens", True),
        ("value_group_size", 0),
        ("value_group_size", 16.0),
    ],
)
def test_config_non_integer_or_negative(name, field, value) -> None:
    want = rf"field '{field}': {re.escape(repr(value))} is not allowed; allowed: "
    with pytest.raises(ValueError, match=want + r"(None or )?integers >= [01]$"):
        kvbench.get_method(name, **{field: value})


@pytest.mark.parametrize("name", ["full", "kivi", "pn-mix", "kvquant", "pm-kvq", "semkv"])
@pytest.mark.parametrize("value", ["float8_e4m3fn", "int8", "float32", torch.float16, ""])
def test_config_storage_dtype(name, value) -> None:
    """docs/design.md#storage-dtype: only float16 and bfloat16 (or None) are stored."""
    with pytest.raises(
        ValueError,
        match=r"field 'storage_dtype': .* is not allowed; allowed: None \(the compute dtype\), "
        r"float16 or bfloat16$",
    ):
        kvbench.get_method(name, storage_dtype=value)


@pytest.mark.parametrize(
    "name, why",
    [
        ("hf-quanto", "wraps a transformers cache"),
        ("hf-dynamic", "wraps a transformers cache"),
    ],
)
def test_storage_dtype_refused_where_not_honoured(name, why) -> None:
    with pytest.raises(ValueError, match=rf"field 'storage_dtype': 'float16' .*{why}"):
        kvbench.get_method(name, storage_dtype="float16")


@pytest.mark.parametrize("name", QUANT_METHODS)
@pytest.mark.parametrize("value", ["float64", "fp8", "int8", torch.float16])
def test_config_scale_dtype(name, value) -> None:
    with pytest.raises(
        ValueError,
        match=r"field 'scale_dtype': .* is not allowed; allowed: \['bfloat16', 'float16', "
        r"'float32'\]$",
    ):
        kvbench.get_method(name, scale_dtype=value)


@pytest.mark.parametrize("name", ["kivi", "per-channel"])
@pytest.mark.parametrize(("group", "residual"), [(32, 100), (128, 64), (32, 0), (3, 10)])
def test_residual_not_multiple_of_group(name, group, residual) -> None:
    with pytest.raises(
        ValueError,
        match=rf"field 'residual_length': {residual} is not allowed; allowed: a positive "
        rf"multiple of group_size={group} ",
    ):
        kvbench.get_method(name, group_size=group, residual_length=residual)


@pytest.mark.parametrize("name", ["per-token", "uniform", "per-head"])
def test_residual_free_for_channel_or_flush_groups(name) -> None:
    # these methods' groups do not run along tokens: any R >= 0 is valid (docs/methods.md#uniform and docs/methods.md#flush-schedules)
    m = kvbench.get_method(name, group_size=32, residual_length=100)
    assert m.config.residual_length == 100


@pytest.mark.parametrize("name", ["kivi", "per-token"])
@pytest.mark.parametrize(("vgs", "head_dim"), [(48, 128), (256, 128), (5, 64)])
def test_value_group_size_must_divide_head_dim(name, vgs, head_dim) -> None:
    m = kvbench.get_method(name, value_bits=2, value_group_size=vgs)
    with pytest.raises(
        ValueError,
        match=rf"value_group_size={vgs} does not divide "
        rf"head_dim={head_dim}",
    ):
        m.new_layer(0, 2, head_dim)


def test_default_value_group_size_is_min_of_g_and_head_dim() -> None:
    m = kvbench.get_method("kivi", value_bits=2, group_size=128, residual_length=128)
    layer = m.new_layer(0, 1, 64)  # min(128, 64) = 64 divides 64: no error
    assert layer.v.codec.channel_group == 64


@pytest.mark.parametrize("name", QUANT_METHODS + ["full"])
def test_unknown_config_field(name) -> None:
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['bitz'\].*allowed: \["):
        kvbench.get_method(name, bitz=2)


def test_unknown_override_on_a_config() -> None:
    kivi_cls = kvbench.get_method_class("kivi")
    cfg = kvbench.get_method("kivi").config
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['foo'\].*'bits'"):
        kivi_cls(cfg, foo=1)
    with pytest.raises(ValueError, match=r"field 'bits': 9 is not allowed; allowed: 1\.\.8 or 16"):
        kivi_cls(cfg, bits=9)
    assert kivi_cls(cfg, bits=3).config.bits == 3


def test_config_is_frozen() -> None:
    cfg = kvbench.get_method("kivi").config
    with pytest.raises(AttributeError):
        cfg.bits = 4  # frozen dataclass


# ------------------------------------------------------------------ LayerCache inputs


@pytest.fixture
def layer():
    m = kvbench.get_method(
        "kivi", bits=2, group_size=4, residual_length=4, value_bits=2, value_group_size=4
    )
    return m.new_layer(0, 2, 8)


@pytest.mark.parametrize("shape", [(2, 10, 8), (1, 1, 2, 10, 8), (8,)])
def test_wrong_rank(layer, shape) -> None:
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=r"must be \[B, H_kv, T, D\]"):
        layer.prefill(x, x)
    with pytest.raises(ValueError, match=r"must be \[B, H_kv, T, D\]"):
        layer.append(x, x)


@pytest.mark.parametrize("shape", [(1, 10, 2, 8), (1, 2, 8, 10), (1, 8, 10, 2)])
def test_wrong_layout(layer, shape) -> None:
    # [B, T, H, D] and other transpositions of a 2-head, head_dim-8 layer
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=r"not laid out \[B, H_kv, T, D\] with H_kv=2 and D=8"):
        layer.prefill(x, x)
    assert layer.seq_length == 0


def test_wrong_layout_full_method() -> None:
    layer = kvbench.get_method("full").new_layer(0, 3, 16)
    x = torch.randn(1, 7, 3, 16)
    with pytest.raises(ValueError, match=r"H_kv=3 and D=16"):
        layer.prefill(x, x)


def test_mismatched_key_value_shapes(layer) -> None:
    with pytest.raises(ValueError, match=r"keys \(1, 2, 10, 8\) and values \(1, 2, 11, 8\) must"):
        layer.prefill(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 11, 8))


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool]
)
def test_unsupported_cache_dtype(layer, dtype) -> None:
    x = torch.zeros(1, 2, 5, 8).to(dtype)
    with pytest.raises(ValueError, match=r"is not supported; allowed: one of .*torch.float16"):
        layer.prefill(x, x)


def test_key_value_dtype_mismatch(layer) -> None:
    with pytest.raises(ValueError, match=r"float32/torch.float16 is not supported"):
        layer.prefill(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8).half())


def test_append_must_match_cache(layer) -> None:
    layer.prefill(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    for shape in [(2, 2, 1, 8), (1, 1, 1, 8), (1, 2, 1, 4)]:
        x = torch.randn(shape)
        with pytest.raises(ValueError, match=r"do not match|not laid out"):
            layer.append(x, x)
    assert layer.seq_length == 5


def test_order_of_calls(layer) -> None:
    with pytest.raises(ValueError, match=r"the cache is empty"):
        layer.keys_values()
    layer.prefill(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match=r"prefill\(\) needs an empty cache; use append\(\)"):
        layer.prefill(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match=r"attention shapes do not fit"):
        layer.attend(torch.randn(1, 3, 1, 8))  # 3 query heads over 2 KV heads


def test_append_in_another_dtype(layer) -> None:
    layer.prefill(torch.randn(1, 2, 5, 8).half(), torch.randn(1, 2, 5, 8).half())
    x = torch.randn(1, 2, 1, 8)  # float32 into a float16 cache would be promoted silently
    with pytest.raises(
        ValueError,
        match=r"^new tokens are torch.float32 but the cache holds torch.float16; append tokens "
        r"in the cache's dtype$",  # what to do, in full
    ):
        layer.append(x, x)
    assert layer.seq_length == 5 and layer.k.residual.dtype == torch.float16
    layer.reset()  # an emptied cache takes the dtype of what arrives next
    layer.append(x, x)
    assert layer.keys_values()[0].dtype == torch.float32


def test_values_of_another_rank_are_refused_as_a_layout_error(layer) -> None:
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(
        ValueError, match=r"must be \[B, H_kv, T, D\]; got shapes \(1, 2, 5, 8\) and \(2, 5, 8\)"
    ):
        layer.prefill(k, k[0])


def test_append_of_another_batch_names_the_cache_layout(layer) -> None:
    layer.prefill(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    x = torch.randn(2, 2, 1, 8)
    want = r"^new tokens \(2, 2, 1, 8\) do not match the cache's \[B, H_kv, \*, D\] = \(1, 2, '\*', 8\)$"
    with pytest.raises(ValueError, match=want):
        layer.append(x, x)
