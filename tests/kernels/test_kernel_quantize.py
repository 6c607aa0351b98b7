"""Quantize-and-pack kernels (interpreter): codes, scales and zeros bit-identical to the core
codecs (kvbench.cache.blocks / kvbench.cache.mixed_channel), and right values from docs/methods.md#worked-examples."""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.blocks import PerChannelCodec, PerTokenCodec
from kvbench.cache.mixed_channel import MixedChannelCodec
from kvbench.kernels import quantize as Q
from kvbench.kernels.decode_attention import QuantKeys, dequantize_keys_reference
from kvbench.kernels.pack import unpack_bits
from kvbench.methods.kitty import KittySelector


def _keys(gen, b=2, h=2, n=32, d=16, dtype=torch.float16):
    # channels of different magnitudes, so that selections are not ties
    x = torch.randn(b, h, n, d, generator=gen) * torch.linspace(0.2, 3.0, d)
    return x.to(dtype)


def _same(got, blk):
    return all(torch.equal(a, r) for a, r in zip(got, (blk.codes, blk.scale, blk.zero)))


def test_spec_example_1_per_channel(poison):
    # docs/methods.md#worked-example-1: channel 0 = [0.12, 0.9, -0.7, 0.35], channel 1 = [2, -1, 0.4, 1.1]
    # (G = 4 tokens), 2 bits: codes [[2,3,0,2],[3,0,1,2]], min [-0.7, -1], scale [0.5333, 1]
    k = torch.tensor([[0.12, 0.9, -0.7, 0.35], [2.0, -1.0, 0.4, 1.1]], dtype=torch.float32)
    x = torch.zeros(1, 1, 4, 8)
    x[0, 0, :, :2] = k.T
    codes, scale, zero = Q.quantize_keys(x, 4, (2,), scale_dtype=torch.float32)
    c = unpack_bits(codes, 2, 8)[0, 0, :, :2].T
    assert c.tolist() == [[2, 3, 0, 2], [3, 0, 1, 2]]
    assert zero[0, 0, 0, :2].tolist() == pytest.approx([-0.7, -1.0], abs=1e-7)
    assert scale[0, 0, 0, :2].tolist() == pytest.approx([1.6 / 3, 1.0], abs=1e-7)


def test_ties_round_half_to_even(poison):
    # rounding ties: kernel vs reference (half-to-even): triton-lang/triton#2923 (+ #4449), docs/methods.md#rounding-ties-between-kernel-and-reference / docs/methods.md#worked-example-4: (x - min)/scale = [0, 0.5, 1.5, 2.5, 3] with scale 1 gives
    # half-to-even codes [0, 0, 2, 2, 3]; half-up would give [0, 1, 2, 3, 3]
    col = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0] + [0.0] * 11)
    x = col.view(1, 1, 16, 1).expand(1, 1, 16, 8).contiguous().half()
    codes, scale, zero = Q.quantize_keys(x, 16, (2,))
    assert scale[0, 0, 0, 0].item() == 1.0 and zero[0, 0, 0, 0].item() == 0.0
    assert unpack_bits(codes, 2, 8)[0, 0, :5, 0].tolist() == [0, 0, 2, 2, 3]


def test_one_bit_midpoint_example_6(poison):
    # docs/methods.md#worked-example-6: x = [0, 0.2, 0.6, 0.9, 1.0, 0.4]: codes [0,0,1,1,1,0] and midpoint
    # dequant [0.25, 0.25, 0.75, 0.75, 0.75, 0.25]
    col = torch.tensor([0.0, 0.2, 0.6, 0.9, 1.0, 0.4, 0.5, 0.5])
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, :, 0] = col
    codes, scale, zero = Q.quantize_keys(x, 8, (1,), scale_dtype=torch.float32, midpoint=True)
    assert unpack_bits(codes, 1, 8)[0, 0, :6, 0].tolist() == [0, 0, 1, 1, 1, 0]
    kq = QuantKeys(codes, scale, zero, 8, (1,), (8,), midpoint=True)
    deq = dequantize_keys_reference(kq)[0, 0, :6, 0]
    assert deq.tolist() == pytest.approx([0.25, 0.25, 0.75, 0.75, 0.75, 0.25], abs=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_uniform_keys_match_kivi_codec(bits, gen, poison):
    x = _keys(gen, n=32, d=16)
    blk = PerChannelCodec(bits, torch.float16, group_size=16).encode(x)
    got = Q.quantize_keys(x, 16, (bits,))
    assert _same(got, blk)
    # dequantization of the kernel's codes equals the core's
    kq = QuantKeys(*got, 16, (bits,), (16,))
    assert torch.equal(dequantize_keys_reference(kq), blk.dequantize(torch.float32))


@pytest.mark.parametrize("bits,group", [(2, 16), (4, 8), (3, 16)])
def test_values_match_per_token_codec(bits, group, gen, poison):
    x = _keys(gen, n=21, d=16)  # 21 tokens: a partial token tile
    blk = PerTokenCodec(bits, torch.float16, channel_group=group).encode(x)
    assert _same(Q.quantize_values(x, bits, group), blk)


def test_kitty_layout_matches_mixed_codec(gen, poison):
    # per-page top-k by magnitude, 4 of 32 channels at 4 bits, the rest at 2 (2 pages)
    x = _keys(gen, n=32, d=32, dtype=torch.bfloat16)
    codec = MixedChannelCodec([4, 2], KittySelector(4, "magnitude"), group_size=16, per_page=True)
    blk = codec.encode(x)
    assert blk.perm.shape == (2, 2, 2, 32) and blk.codes.shape[-1] == (4 * 4 + 28 * 2) // 8
    assert _same(Q.quantize_keys(x, 16, blk.class_bits, blk.class_counts, blk.perm), blk)


def test_pn_mix_layout_matches_mixed_codec(gen, poison):
    # fixed classes per (b, h): 16 channels at 3 bits, 16 at 1 bit with the midpoint
    x = _keys(gen, n=32, d=32, dtype=torch.float32)
    cls = torch.stack([torch.randperm(32, generator=gen) for _ in range(4)]).view(2, 2, 32) >= 16
    codec = MixedChannelCodec([3, 1], None, group_size=16, midpoint=True, classes=cls.long())
    blk = codec.encode(x)
    got = Q.quantize_keys(x, 16, blk.class_bits, blk.class_counts, blk.perm, midpoint=True)
    assert _same(got, blk)
    kq = QuantKeys(*got, 16, blk.class_bits, blk.class_counts, blk.perm, midpoint=True)
    assert torch.equal(dequantize_keys_reference(kq), blk.dequantize(torch.float32))


def test_nonfinite_group_is_nan_like_core(poison):
    x = torch.randn(1, 1, 16, 8)
    x[0, 0, 3, 2] = float("inf")
    blk = PerChannelCodec(2, torch.float16, group_size=16).encode(x)
    codes, scale, zero = Q.quantize_keys(x, 16, (2,))
    assert torch.isnan(scale[0, 0, 0, 2]) and torch.isnan(zero[0, 0, 0, 2])
    assert torch.equal(codes, blk.codes)
    assert torch.isfinite(scale[0, 0, 0, [0, 1, 3]]).all()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_overflowing_scale_raises_like_core():
    x = torch.zeros(1, 1, 16, 8)
    x[0, 0, 0, 0] = 2e5  # range / 3 = 66667 > float16 max 65504
    with pytest.raises(ValueError, match="overflows"):
        PerChannelCodec(2, torch.float16, group_size=16).encode(x)
    with pytest.raises(ValueError, match="overflows"):
        Q.quantize_keys(x, 16, (2,))
    Q.quantize_keys(x, 16, (2,), scale_dtype=torch.float32)  # fits float32


def test_bad_inputs():
    x = torch.zeros(1, 1, 16, 16)
    with pytest.raises(ValueError, match="head_dim=12"):
        Q.quantize_keys(torch.zeros(1, 1, 16, 12), 16)
    with pytest.raises(ValueError, match="multiple of group_size"):
        Q.quantize_keys(x, 12)
    with pytest.raises(ValueError, match="byte boundary"):
        Q.quantize_keys(x, 16, (3, 1), (5, 11), torch.zeros(1, 1, 1, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1 or 2 non-empty"):
        Q.quantize_keys(x, 16, (4, 2, 1), (4, 4, 8), torch.zeros(1, 1, 1, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="sum to head_dim"):
        Q.quantize_keys(x, 16, (4, 2), (4, 4), torch.zeros(1, 1, 1, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1..8"):
        Q.quantize_keys(x, 16, (9,))
    with pytest.raises(ValueError, match="perm must be"):
        Q.quantize_keys(x, 16, (4, 2), (8, 8), torch.zeros(1, 1, 1, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale_dtype"):
        Q.quantize_keys(x, 16, scale_dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        Q.quantize_keys(x.double(), 16)
    with pytest.raises(ValueError, match="channel_group"):
        Q.quantize_values(x, 2, 6)
    with pytest.raises(ValueError, match="bits"):
        Q.quantize_values(x, 16)
    with pytest.raises(ValueError, match=r"\[B, H_kv, n, D\]"):
        Q.quantize_values(x[0], 2)
