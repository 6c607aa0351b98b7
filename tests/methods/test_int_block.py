"""llama.cpp-style int8/int4 blocks: hand-computed blocks of 32, llama.cpp's q4_0 rule in float32
numpy, bit budgets 8.5 / 4.5, byte counts, and zero or near-zero range group: division by zero, NaN: ggml-org/llama.cpp PR#7313 (fixes #7311), docs/methods.md#zero-or-near-zero-range-groups; fp16 scale underflow to a subnormal, reciprocal overflow, 0*inf = NaN: pytorch/ao#1766 (PR#1770), docs/methods.md#half-precision-scale-underflow-and-reciprocal-overflow; negative zero and tiny negatives in FNUZ fp8 formats: triton-lang/triton PR#3997, docs/methods.md#negative-zero-and-tiny-negatives-in-fnuz-formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbench
from kvbench.cache.finite import nonfinite
from kvbench.methods.int_block import Int4Block, Int4BlockConfig, Int8Block, Int8BlockConfig


def _roundtrip(method, block: np.ndarray):
    """Quantize one token ``[D]`` as keys; return (signed codes, scales, dequantized keys)."""
    x = torch.tensor(block, dtype=torch.float32).reshape(1, 1, 1, -1)
    layer = method.new_layer(0, 1, x.shape[-1])
    layer.prefill(x, x.clone())
    blk = layer.k.block
    codes = blk.unpacked_codes().flatten().to(torch.int64) - (1 << (blk.bits - 1))
    return codes.numpy(), blk.scale.flatten(), layer.keys_values()[0].flatten().numpy()


def _block32(amax: float, sign: float = -1.0) -> np.ndarray:
    """32 values: element 0 = sign * amax, the rest strictly inside (no .5 ties)."""
    j = np.arange(1, 32)
    x = np.concatenate([[sign * amax], 0.97 * amax * np.sin(1.7 * j + 0.3)])
    return x.astype(np.float32).astype(np.float64)  # the values the float32 cache receives


def test_q8_0_hand_block_of_32():
    x = _block32(7.9375)  # d = 7.9375 / 127 = 0.0625, exact in fp16
    codes, scale, deq = _roundtrip(Int8Block(), x)
    assert scale.dtype == torch.float16 and scale.tolist() == [0.0625]
    expect = np.round(x / 0.0625)
    assert codes.tolist() == expect.astype(int).tolist()
    assert codes.min() >= -127 and codes.max() <= 127 and codes[0] == -127
    np.testing.assert_array_equal(deq, (expect * 0.0625).astype(np.float32))
    assert np.abs(deq - x).max() <= 0.0625 / 2


def test_q4_0_absmax7_hand_block_of_32():
    x = _block32(1.75, sign=1.0)  # d = 1.75 / 7 = 0.25
    codes, scale, deq = _roundtrip(Int4Block(q4_rule="absmax7"), x)
    assert scale.tolist() == [0.25]
    expect = np.round(x / 0.25)
    assert codes.tolist() == expect.astype(int).tolist()
    assert codes.min() >= -7 and codes.max() <= 7 and codes[0] == 7
    np.testing.assert_array_equal(deq, (expect * 0.25).astype(np.float32))


def _llamacpp_q4_ref(x: np.ndarray):
    """``quantize_row_q4_0_ref`` in float32 numpy: d = max/-8, q = min(15, (int)(x*id + 8.5))."""
    x = x.astype(np.float32)
    m = x[np.argmax(np.abs(x))]  # first element of largest magnitude (strict '<' in C)
    d = np.float32(m) / np.float32(-8.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    q = np.minimum(15, np.trunc(x * inv + np.float32(8.5))).astype(np.int64)
    d16 = np.float16(d)
    return q, d16, ((q - 8) * np.float32(d16)).astype(np.float32)


@pytest.mark.parametrize("amax", [2.0, 0.3, 0.07])
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_q4_0_llamacpp_rule_matches_ggml_reference(amax, sign):
    x = _block32(amax, sign)
    q_ref, d16, deq_ref = _llamacpp_q4_ref(x)
    codes, scale, deq = _roundtrip(Int4Block(q4_rule="llamacpp"), x)
    assert codes.tolist() == (q_ref - 8).tolist()
    assert scale.item() == float(d16)
    np.testing.assert_array_equal(deq, deq_ref)


@pytest.mark.parametrize("chunk", [1 << 23, 2 * 3 * 64 * 5])
def test_q4_0_llamacpp_chunked_encode_matches_ggml_reference_per_block(chunk, monkeypatch):
    # the encoder runs chunk by chunk along T (here also 5 tokens at a time, last chunk 2):
    # every 32-channel block of every token equals the ggml reference run on that block alone
    monkeypatch.setattr("kvbench.cache.chunks.CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 17, 64, generator=g) * 3).half()
    layer = Int4Block(q4_rule="llamacpp").new_layer(0, 3, 64, torch.float16)
    layer.prefill(x, x.clone())
    blk = layer.k.block
    codes = blk.unpacked_codes().to(torch.int64).reshape(2, 3, 17, 2, 32)
    blocks = x.float().reshape(2, 3, 17, 2, 32).numpy().astype(np.float64)
    for idx in np.ndindex(2, 3, 17, 2):
        q_ref, d16, _ = _llamacpp_q4_ref(blocks[idx])
        assert codes[idx].tolist() == q_ref.tolist(), idx
        assert blk.scale[idx].item() == float(d16), idx


def test_q4_0_llamacpp_hand_values():
    # max-magnitude element first and negative: d = -2 / -8 = 0.25, codes floor(4x + 8.5)
    x = np.zeros(32)
    # 0.125 and -0.375 are exact ties (4x = 0.5, -1.5): (int)(4x + 8.5) rounds them half up
    x[:7] = [-2.0, 1.0, 0.3, -0.6, 1.8, 0.125, -0.375]
    codes, scale, deq = _roundtrip(Int4Block(q4_rule="llamacpp"), x)
    assert scale.tolist() == [0.25]
    assert (codes[:7] + 8).tolist() == [0, 12, 9, 6, 15, 9, 7]
    assert deq[:7].tolist() == [-2.0, 1.0, 0.25, -0.5, 1.75, 0.25, -0.25]
    # a tie on |x|: the first (+2) sets d = -0.25, so -2 saturates at code 15 = -1.75
    x[:2] = [2.0, -2.0]
    codes, scale, deq = _roundtrip(Int4Block(q4_rule="llamacpp"), x)
    assert scale.tolist() == [-0.25] and (codes[:2] + 8).tolist() == [0, 15]
    assert deq[:2].tolist() == [2.0, -1.75]


def test_average_bits_8_5_and_4_5():
    for m, bits in ((Int8Block(), 8.5), (Int4Block(), 4.5), (Int4Block(q4_rule="llamacpp"), 4.5)):
        ab = m.average_bits(128, 32768)
        assert ab["key_bits"] == bits and ab["value_bits"] == bits
    mixed = Int8Block(value_type="f16").average_bits(128, 32768)
    assert (mixed["key_bits"], mixed["value_bits"]) == (8.5, 16.0)
    mixed = Int4Block(key_type="q8_0").average_bits(64, 1000)
    assert (mixed["key_bits"], mixed["value_bits"]) == (8.5, 4.5)


@pytest.mark.parametrize(("cls", "code_bytes"), [(Int8Block, 384), (Int4Block, 192)])
def test_bytes_by_hand(cls, code_bytes):
    layer = cls().new_layer(0, 2, 64)
    x = torch.randn(1, 2, 3, 64)
    layer.prefill(x, x.clone())
    nb = layer.nbytes()
    # per side: 2 heads x 3 tokens x 64 channels at 8 / 4 bits; 2 x 3 x 2 blocks x 2-byte scale
    assert nb["codes"] == 2 * code_bytes and nb["scales"] == 2 * 24
    assert nb["residual"] == nb["metadata"] == 0 and nb["total"] == 2 * (code_bytes + 24)


def test_f16_side_stays_exact_and_window():
    layer = Int8Block(key_type="f16", residual_length=2).new_layer(0, 1, 32)
    x = torch.randn(1, 1, 5, 32)
    layer.prefill(x, x.clone())
    assert layer.quantized_tokens() == (0, 3)  # values: all but the R = 2 newest
    keys, values = layer.keys_values()
    assert torch.equal(keys, x) and torch.equal(values[:, :, 3:], x[:, :, 3:])
    assert not torch.equal(values[:, :, :3], x[:, :, :3])


@pytest.mark.parametrize("rule", ["absmax7", "llamacpp"])
def test_kvq14_and_kvq13_tiny_and_zero_blocks(rule):
    m4 = Int4Block(q4_rule=rule, block_size=4)
    for method in (Int8Block(block_size=4), m4):
        x16 = np.array([0.0, 0.0, 0.1, 0.1], dtype=np.float16).astype(np.float64)
        codes, scale, deq = _roundtrip(method, x16)
        assert np.isfinite(deq).all() and deq[0] == deq[1] == 0
        np.testing.assert_allclose(deq[2:], x16[2:], atol=abs(scale.item()) / 2)
        for block in (
            np.zeros(4),
            np.full(4, 1e-30),
        ):  # zero or near-zero range group: division by zero, NaN: ggml-org/llama.cpp PR#7313 (fixes #7311), docs/methods.md#zero-or-near-zero-range-groups (a), (b)
            _, scale, deq = _roundtrip(method, block)
            assert np.isfinite(deq).all() and np.abs(deq - block).max() <= 1e-30


def test_kvq24_large_blocks_no_inf_and_overflow_raises():
    x = np.zeros(32)
    x[:4] = [
        -60000.0,
        60000.0,
        0.0,
        1.0,
    ]  # fp16 overflow in stored block metadata and in the scale range: ggml-org/llama.cpp PR#21652, docs/methods.md#float16-overflow-in-block-metadata-and-range (b): fp16-range values, scales stay finite
    for method in (Int8Block(), Int4Block(), Int4Block(q4_rule="llamacpp")):
        _, scale, deq = _roundtrip(method, x)
        assert torch.isfinite(scale).all() and np.isfinite(deq).all()
        assert abs(deq[1] - 60000.0) <= abs(scale.item())
        with pytest.raises(ValueError, match="float16"):  # d = 1e7/127 or /7 or /8 > 65504
            _roundtrip(method, np.full(32, 1e7))


@pytest.mark.parametrize("rule", ["absmax7", "llamacpp"])
def test_kvq23_int4_negative_zero_has_the_zero_code(rule):
    x = np.zeros(32)
    x[:4] = [-0.0, 0.0, 1.0, -1.0]
    codes, _, deq = _roundtrip(Int4Block(q4_rule=rule), x)
    assert codes[0] == codes[1] == 0  # stored code 8, the zero-point
    assert deq[0] == 0 and deq[1] == 0 and not np.isnan(deq).any()


def test_nan_block_is_nan_other_blocks_fine():
    x = torch.randn(1, 1, 1, 64)
    x[0, 0, 0, 3] = float("nan")
    for method in (Int8Block(), Int4Block(), Int4Block(q4_rule="llamacpp")):
        layer = method.new_layer(0, 1, 64)
        with nonfinite("propagate"):  # the opt-out of kvbench.cache.finite
            layer.prefill(x, x.clone())
        keys = layer.keys_values()[0].flatten()
        assert torch.isnan(keys[:32]).all() and torch.isfinite(keys[32:]).all()


def test_registry_capabilities_and_head_dim_check():
    assert isinstance(kvbench.get_method("int8-block"), Int8Block)
    m = kvbench.get_method("int4-block")
    assert isinstance(m, Int4Block) and m.config.key_type == m.config.value_type == "q4_0"
    caps = Int8Block.capabilities
    assert caps.keys_values and not caps.needs_calibration
    with pytest.raises(ValueError, match="block_size"):
        Int8Block().new_layer(0, 1, 48)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("key_type", "q5_0"),
        ("value_type", "int8"),
        ("q4_rule", "max8"),
        ("block_size", 0),
        ("residual_length", -1),
        ("num_sink_tokens", "2"),
    ],
)
def test_config_errors_name_the_field(field, value):
    for cfg in (Int8BlockConfig, Int4BlockConfig):
        with pytest.raises(ValueError, match=field):
            cfg(**{field: value})
