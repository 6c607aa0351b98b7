"""kvbench.cache.mixed_channel: mixed-width packing, the MixedChannelBlock protocol and MixedChannelCodec.

Right values come from hand-worked bit streams, a pure-Python bit-stream reference and a float64
numpy min-max reference (docs/methods.md#common-conventions), never from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.cache.blocks import PerChannelCodec
from kvbench.cache.mixed_channel import (
    MixedChannelBlock,
    MixedChannelCodec,
    channel_scores,
    pack_mixed,
    perm_from_classes,
    rank_classes,
    unpack_mixed,
)
from kvbench.cache.quant import quantize_groups


def _stream_ref(rows: list[list[list[int]]], bits: list[int]) -> list[list[int]]:
    """Pure-Python LSB-first stream: rows[r][c] = codes of class c in row r."""
    out = []
    for row in rows:
        acc, nbit = 0, 0
        for codes, b in zip(row, bits):
            for v in codes:
                acc |= v << nbit
                nbit += b
        out.append([(acc >> (8 * i)) & 0xFF for i in range((nbit + 7) // 8)])
    return out


def _np_minmax(x: np.ndarray, bits: int, midpoint: bool = False) -> np.ndarray:
    """float64 reconstruction of min-max groups along the last axis (docs/methods.md#min-max-affine-quantizer and docs/methods.md#one-bit-midpoint-reconstruction)."""
    mn, mx = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    s = (mx - mn) / (2**bits - 1)
    if midpoint:
        q = (x - mn >= s / 2).astype(float)
        return mn + s / 4 + q * s / 2
    return np.round((x - mn) / np.where(s > 0, s, 1)) * s + mn


# ------------------------------------------------------------------------------ packing


def test_pack_mixed_hand_stream_unaligned():
    # class 0 (3 bits): 5 = b101, 2 = b010 -> bits 1,0,1,0,1,0; class 1 (1 bit): 1,0,1
    # stream 1,0,1,0,1,0,1,0 | 1 -> bytes 0b01010101 = 85, 1
    packed = pack_mixed([torch.tensor([[5, 2]]), torch.tensor([[1, 0, 1]])], [3, 1])
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[85, 1]]
    c0, c1 = unpack_mixed(packed, [3, 1], [2, 3])
    assert c0.tolist() == [[5, 2]] and c1.tolist() == [[1, 0, 1]]


def test_pack_mixed_hand_stream_aligned():
    # class 0 (4 bits): 3 | 12 << 4 = 195; class 1 (2 bits): 1 | 2<<2 | 3<<4 | 0<<6 = 57
    packed = pack_mixed([torch.tensor([[3, 12]]), torch.tensor([[1, 2, 3, 0]])], [4, 2])
    assert packed.tolist() == [[195, 57]]


@pytest.mark.parametrize(
    ("bits", "counts"),
    [([4, 2], [4, 124]), ([3, 1], [64, 64]), ([4, 3, 2, 1], [12, 12, 92, 12]),
     ([4, 3, 2, 1], [13, 13, 89, 13]), ([4, 2], [0, 8]), ([3, 1], [2, 6]), ([5, 7], [3, 1])],
)  # fmt: skip
def test_pack_mixed_matches_python_stream(bits, counts):
    g = torch.Generator().manual_seed(sum(counts))
    codes = [torch.randint(0, 2**b, (3, n), generator=g) for b, n in zip(bits, counts)]
    packed = pack_mixed(codes, bits)
    ref = _stream_ref([[c[r].tolist() for c in codes] for r in range(3)], bits)
    assert packed.tolist() == ref
    assert packed.shape[-1] == (sum(b * n for b, n in zip(bits, counts)) + 7) // 8
    back = unpack_mixed(packed, bits, counts)
    for a, b in zip(back, codes):
        assert a.long().tolist() == b.tolist()


# ------------------------------------------------------------------------------ helpers


def test_rank_classes_ties_go_to_lower_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0]])
    # ranks: ch1, ch2, ch4 (tied, by index), ch0, ch3 -> counts [2, 2, 1]
    assert rank_classes(scores, [2, 2, 1]).tolist() == [[1, 0, 0, 2, 1]]
    with pytest.raises(ValueError, match="sum to 5"):
        rank_classes(scores, [2, 2])


def test_perm_from_classes_and_errors():
    perm, counts = perm_from_classes(torch.tensor([[1, 0, 1, 0]]), 2)
    assert perm.tolist() == [[1, 3, 0, 2]] and counts == [2, 2]
    with pytest.raises(ValueError, match="same number"):
        perm_from_classes(torch.tensor([[1, 0, 1, 0], [0, 0, 0, 1]]), 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        perm_from_classes(torch.tensor([[2, 0]]), 2)


def test_channel_scores_hand_values():
    x = torch.tensor([[1.0, -2.0], [3.0, 0.0], [-1.0, 2.0]])  # [T=3, D=2]
    assert channel_scores(x, "magnitude").tolist() == pytest.approx([5 / 3, 4 / 3])
    assert channel_scores(x, "range").tolist() == [4.0, 4.0]
    assert channel_scores(x, "absmax").tolist() == [3.0, 2.0]
    assert channel_scores(x, "variance").tolist() == pytest.approx([8 / 3, 8 / 3])
    with pytest.raises(ValueError, match="allowed"):
        channel_scores(x, "median")


# ------------------------------------------------------------------------------ codec + block


def _fixed_codec(classes, bits=(4, 1), g=4, midpoint=False, scale_dtype=torch.float32):
    codec = MixedChannelCodec(
        list(bits), lambda k, q: classes, group_size=g, midpoint=midpoint, scale_dtype=scale_dtype
    )
    return codec


def _by_magnitude(k):
    def sel(pages, q):
        s = pages.float().abs().mean(-2)
        return rank_classes(s, [k, pages.shape[-1] - k])

    return sel


def test_encode_restores_channel_order_and_per_class_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 8, 6, generator=g, dtype=torch.float64)
    classes = torch.tensor([0, 1, 1, 0, 1, 1]).expand(2, 2, 6)
    codec = _fixed_codec(classes, bits=(4, 1), midpoint=True)
    codec.prepare(x, None)
    block = codec.encode(x)
    # reference: channels 0 and 3 at 4 bits, others 1-bit midpoint, per page of 4 tokens
    xn = x.numpy().reshape(2, 2, 2, 4, 6).swapaxes(-1, -2)  # [B, H, NP, D, G]
    ref = np.empty_like(xn)
    for c in range(6):
        ref[..., c, :] = _np_minmax(
            xn[..., c, :], 4 if c in (0, 3) else 1, midpoint=c not in (0, 3)
        )
    ref = ref.swapaxes(-1, -2).reshape(2, 2, 8, 6)
    np.testing.assert_allclose(block.dequantize(torch.float64).numpy(), ref, atol=1e-6)
    assert block.channel_bits()[0, 0, 0].tolist() == [4, 1, 1, 4, 1, 1]
    # stream per token: 2 x 4 + 4 x 1 = 12 bits -> 2 bytes; fp32 scale + zero per channel/page
    assert block.codes.shape == (2, 2, 8, 2)
    assert block.scale.shape == (2, 2, 2, 6) and block.scale.dtype == torch.float32
    assert [c for c, _ in block.tensors()] == ["codes", "scales", "scales", "metadata"]


def test_fixed_assignment_shared_with_codec_and_cat_checks():
    x = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    codec = _fixed_codec(torch.tensor([[[0, 1, 1, 0], [1, 0, 0, 1]]]))
    codec.prepare(x, None)
    a, b = codec.encode(x[:, :, :4]), codec.encode(x[:, :, 4:])
    assert a.perm is b.perm is codec.perm  # one tensor, held once
    ab = a.cat(b)
    assert ab.perm.shape == (1, 2, 1, 4) and ab.perm.dtype == torch.uint8
    np.testing.assert_array_equal(
        ab.dequantize(torch.float64).numpy(), codec.encode(x).dequantize(torch.float64).numpy()
    )
    other = _fixed_codec(torch.tensor([[[1, 0, 1, 0], [1, 0, 0, 1]]]))
    other.prepare(x, None)
    with pytest.raises(ValueError, match="different channel classes"):
        a.cat(other.encode(x[:, :, :4]))
    per_page = MixedChannelCodec([3, 1], _by_magnitude(2), group_size=4, per_page=True)
    with pytest.raises(ValueError, match="class layouts"):
        a.cat(per_page.encode(x[:, :, :4]))


def test_per_page_cat_crop_index_batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1, 12, 8, generator=g, dtype=torch.float64)
    x[:, :, :4, 2] *= 10  # page 0 promotes channel 2, pages 1-2 another one
    codec = MixedChannelCodec(
        [4, 2], _by_magnitude(1), group_size=4, scale_dtype=torch.float32, per_page=True
    )
    whole = codec.encode(x)
    parts = codec.encode(x[:, :, :4]).cat(codec.encode(x[:, :, 4:]))
    full = whole.dequantize(torch.float64)
    np.testing.assert_array_equal(parts.dequantize(torch.float64).numpy(), full.numpy())
    assert whole.perm.shape == (3, 1, 3, 8)  # one uint8 index per channel per page
    assert bool((whole.channel_bits()[:, 0, 0, 2] == 4).all())
    # crop inside page 1: 6 tokens kept, pages 0-1 kept with their metadata
    cropped = whole.crop(6)
    assert cropped.ntokens == 6 and cropped.group_len == [4, 2] and cropped.perm.shape[2] == 2
    np.testing.assert_array_equal(cropped.dequantize(torch.float64).numpy(), full[:, :, :6].numpy())
    for _, t in cropped.tensors():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    idx = torch.tensor([2, 0])
    sel = whole.index_batch(idx)
    np.testing.assert_array_equal(sel.dequantize(torch.float64).numpy(), full[idx].numpy())
    # repeat a batch-1 block
    one = whole.index_batch(torch.tensor([1]))
    rep = one.index_batch(torch.tensor([0, 0]))
    assert rep.perm.shape[0] == rep.scale.shape[0] == 2
    np.testing.assert_array_equal(rep.dequantize(torch.float64)[1].numpy(), full[1].numpy())


def test_single_class_equals_per_channel_codec_and_stores_no_perm():
    x = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    mixed = MixedChannelCodec([4, 2], _by_magnitude(0), group_size=4, per_page=True).encode(x)
    plain = PerChannelCodec(2, torch.float16, group_size=4).encode(x)
    assert mixed.perm is None and [c for c, _ in mixed.tensors()] == ["codes", "scales", "scales"]
    np.testing.assert_array_equal(
        mixed.dequantize(torch.float64).numpy(), plain.dequantize(torch.float64).numpy()
    )
    assert mixed.codes.numel() == plain.codes.numel()  # 16 x 2 bits = 4 bytes per token


def test_float8_scales_one_byte_and_round_up():
    # 2-bit group [0, 1, 2, 3.1]: min 0; scale 3.1/3 = 1.0333 -> next e4m3 value up 1.125;
    # codes round([0, 0.889, 1.778, 2.756]) = [0, 1, 2, 3]
    q = quantize_groups(torch.tensor([[0.0, 1.0, 2.0, 3.1]]), 2, scale_dtype=torch.float8_e4m3fn)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.element_size() == 1
    assert q.scale.float().item() == 1.125 and q.zero.float().item() == 0.0
    assert q.codes.tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="zero"):  # min -500 beyond e4m3's 448 (no saturation)
        quantize_groups(torch.tensor([[-500.0, 0.0]]), 2, scale_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale"):  # scale 2000/3 > 448
        quantize_groups(torch.tensor([[0.0, 2000.0]]), 2, scale_dtype=torch.float8_e4m3fn)
    codec = MixedChannelCodec(
        [4, 2], _by_magnitude(1), group_size=4, scale_dtype=torch.float8_e4m3fn, per_page=True
    )
    block = codec.encode(torch.randn(1, 1, 4, 8))
    assert block.scale.element_size() == block.zero.element_size() == 1
    assert block.dequantize(torch.float32).isfinite().all()


def test_codec_errors():
    x = torch.randn(1, 1, 6, 4)
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        MixedChannelCodec([4, 2], _by_magnitude(1), group_size=4, per_page=True).encode(x)
    with pytest.raises(ValueError, match="prefill"):
        _fixed_codec(torch.zeros(1, 1, 4, dtype=torch.long)).encode(x[:, :, :4])
    with pytest.raises(ValueError, match="class_bits"):
        MixedChannelCodec([16, 2], _by_magnitude(1))
    with pytest.raises(ValueError, match="selector or fixed classes"):
        MixedChannelCodec([4, 2])
    uneven = MixedChannelCodec(
        [4, 2], lambda p, q: torch.tensor([[[[0, 1, 1, 1]], [[0, 0, 1, 1]]]]), group_size=4,
        per_page=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="same number"):
        uneven.encode(torch.randn(1, 2, 4, 4))
    fixed = _fixed_codec(torch.tensor([[[0, 1, 1, 0]]]))
    fixed.prepare(x, None)
    with pytest.raises(ValueError, match="do not fit"):
        fixed.encode(torch.randn(2, 1, 4, 4))  # per-sequence classes for batch 1, keys batch 2


def test_shared_assignment_stays_on_index_batch():
    classes = torch.tensor([[[0, 1, 1, 0]]])
    codec = MixedChannelCodec([4, 2], None, group_size=4, classes=classes)
    assert codec.perm_shared
    x = torch.randn(3, 1, 4, 4, dtype=torch.float64)
    block = codec.encode(x)
    codec.index_batch(torch.tensor([0, 0, 1, 2]))
    assert codec.perm.shape[0] == 1
    sel = block.index_batch(torch.tensor([2, 1]))
    assert sel.perm.shape[0] == 1 and sel.codes.shape[0] == 2
    np.testing.assert_array_equal(
        sel.dequantize(torch.float64).numpy(), block.dequantize(torch.float64)[[2, 1]].numpy()
    )
    assert isinstance(block, MixedChannelBlock)


def test_nan_input_propagates_to_its_group_only():
    x = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    x[0, 0, 5, 2] = float("nan")  # page 1, channel 2
    codec = MixedChannelCodec([4, 2], _by_magnitude(1), group_size=4, per_page=True)
    out = codec.encode(x).dequantize(torch.float64)[0, 0]
    assert bool(out[4:, 2].isnan().all())  # the whole (channel, page) group is NaN
    out[4:, 2] = 0.0
    assert bool(out.isfinite().all())
