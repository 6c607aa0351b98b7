"""Stored layouts (kvbench.cache.layout): the nominal bits derived from a layout equal a hand
count of what the block stores, the layout a codec announces is the one its blocks report, and
the bytes a block actually holds match the layout's bits per element."""

from __future__ import annotations

import pytest
import torch

import kvbench
from kvbench.cache.blocks import (
    PerChannelCodec,
    PerHeadCodec,
    PerTensorCodec,
    PerTokenCodec,
    affine_layout,
    tensor_bytes,
)
from kvbench.cache.layout import (
    BlockLayout,
    CodeClass,
    Codes,
    GroupTerms,
    Permutation,
    SparseOutliers,
    bit_terms,
    layout_bits,
)
from kvbench.cache.method import CacheConfig, Method
from kvbench.cache.mixed_channel import MixedChannelCodec, mixed_layout


def test_kivi_2bit_g32_fp16_scale_zero_is_3_bits():
    # hand count: 2 code bits + one fp16 scale and one fp16 zero (32 bits) per 32 elements
    m = kvbench.get_method("kivi", bits=2, group_size=32, residual_length=32)
    assert m.average_bits(128, 32768)["key_bits"] == 2 + 32 / 32 == 3.0
    terms = bit_terms(m.key_layout(128))
    assert (terms.b_eff, terms.m_q, terms.group, terms.m_sal) == (2, 32, 32, 0)


def test_per_token_values_bf16_and_float32_scales():
    # 4 bits + (16 + 16) / 64 = 4.5; float32 scale and zero: 4 + 64 / 64 = 5.0
    lay = PerTokenCodec(4, torch.bfloat16, channel_group=64).layout(128)
    assert layout_bits(lay) == 4.5
    assert layout_bits(PerTokenCodec(4, torch.float32, channel_group=64).layout(128)) == 5.0
    # symmetric: a scale, no zero -> 8 + 16 / 32 = 8.5 (llama.cpp q8_0)
    q8 = PerTokenCodec(8, torch.float16, symmetric=True, channel_group=32).layout(128)
    assert q8.terms.names == ("scale",) and layout_bits(q8) == 8.5


def test_whole_flush_groups_count_the_flush():
    # one (scale, zero) per flush of 128 tokens x 64 channels: 2 + 32 / 8192
    assert layout_bits(PerHeadCodec(2).layout(64, flush_tokens=128)) == 2 + 32 / 8192
    assert layout_bits(PerTensorCodec(3).layout(64, flush_tokens=16)) == 3 + 32 / 1024


def test_mixed_channel_classes_hand_count():
    # 16 channels at 4 bits + 112 at 2 bits over 128: (64 + 224) / 128 = 2.25 code bits;
    # fp16 (scale, zero) per channel per 64-token page: 32 / 64 = 0.5;
    # per-page uint8 permutation, one index per channel per page: 8 / 64 = 0.125
    lay = mixed_layout([4, 2], [16, 112], 64, torch.float16, per_page=True)
    assert layout_bits(lay) == 2.25 + 0.5 + 0.125 == 2.875
    # a fixed (per-head) permutation is held once: 0 bits per element in the limit
    fixed = mixed_layout([4, 2], [16, 112], 64, torch.float16, per_page=False)
    assert layout_bits(fixed) == 2.75
    # one live class: identity order, no permutation stored
    assert mixed_layout([4, 2], [0, 128], 64, torch.float16, True).permutation is None


def test_sinks_and_outliers_hand_count():
    # KVQuant-style: 3-bit LUT indices + 1% outliers of (fp16 value, int32 index) = 3.48;
    # 32 sinks at 16 bits over 32768 quantized tokens
    lay = BlockLayout(
        Codes.uniform(3, 128, "index"), outliers=SparseOutliers(0.01, "float16", "int32")
    )
    per = 3 + 0.01 * 48
    assert layout_bits(lay) == pytest.approx(per, abs=1e-15)
    got = layout_bits(lay, n_sink=32, tokens=32768)
    assert got == pytest.approx((32 * 16 + 32768 * per) / (32768 + 32), abs=1e-12)


def test_sketch_norms_and_outlier_indices_hand_count():
    # QJL-style: 256 + 64 sign bits per 128-channel token = 2.5; two fp16 norms per token
    # 32 / 128 = 0.25; 8 uint8 outlier-channel indices per 32-token page: 64 / 4096
    lay = BlockLayout(
        Codes(128, (CodeClass(1, 256), CodeClass(1, 64)), "sign"),
        GroupTerms(("norm", "outlier-norm"), "float16", 1, 128),
        metadata=(GroupTerms(("outlier-index",), "uint8", 32, 128, count=8),),
    )
    assert layout_bits(lay) == 2.5 + 0.25 + 64 / 4096
    assert kvbench.get_method(
        "qjl", sketch_dim=256, outlier_channels=8, outlier_sketch_dim=64, group_size=32
    ).average_bits(128, 32768)["key_bits"] == pytest.approx(2.5 + 0.25 + 64 / 4096, abs=1e-12)


def test_token_share_classes():
    # SemKV-style: every token's 2-bit plane + a 1-bit upper plane for 25% of the tokens
    # = 2.25 code bits; fp16 (scale, zero) per 32 channels 1.0; 1-bit mask per token 1/64
    lay = BlockLayout(
        Codes(64, (CodeClass(2, 64), CodeClass(1, 64, 0.25))),
        GroupTerms(("scale", "zero"), "float16", 1, 32),
        metadata=(GroupTerms(("high-mask",), "bit", 1, 64),),
    )
    assert layout_bits(lay) == 2.25 + 1.0 + 1 / 64


@pytest.mark.parametrize(
    "codec,n",
    [
        (PerChannelCodec(2, torch.float16, group_size=32), 64),
        (PerTokenCodec(3, torch.float16, channel_group=16), 5),
        (PerTokenCodec(16, torch.float32, channel_group=64), 3),
        (PerHeadCodec(4, torch.bfloat16), 24),
    ],
)
def test_block_layout_matches_codec_and_stored_bytes(codec, n):
    torch.manual_seed(0)
    b, h, d = 2, 3, 64
    blk = codec.encode(torch.randn(b, h, n, d))
    lay = codec.layout(d, flush_tokens=n)
    assert blk.layout == lay
    # bytes actually held by the block, per element of one (row, head), against the layout
    # (codes byte-aligned here: D * bits is a multiple of 8)
    measured = 8 * tensor_bytes(*(t for _, t in blk.tensors())) / (b * h * n * d)
    assert measured == pytest.approx(layout_bits(lay), abs=1e-12)


def test_mixed_block_layout_matches_codec_and_stored_bytes():
    torch.manual_seed(0)
    b, h, g, d = 2, 2, 16, 64

    def top8(pages, _q):  # per page: the 8 channels of largest range are class 0
        score = pages.amax(-2) - pages.amin(-2)
        idx = score.argsort(-1, descending=True)[..., :8]
        return torch.ones_like(score, dtype=torch.long).scatter_(-1, idx, 0)

    codec = MixedChannelCodec([4, 2], top8, group_size=g, per_page=True, class_counts=(8, 56))
    blk = codec.encode(torch.randn(b, h, 3 * g, d))
    assert blk.layout == codec.layout(d)
    measured = 8 * tensor_bytes(*(t for _, t in blk.tensors())) / (b * h * 3 * g * d)
    # (8*4 + 56*2)/64 = 2.25, (16+16)/16 = 2.0, 8/16 = 0.5
    assert measured == layout_bits(codec.layout(d)) == 2.25 + 2.0 + 0.5


def test_mixed_codec_refuses_other_class_counts():
    codec = MixedChannelCodec(
        [4, 2], lambda k, q: torch.zeros(*k.shape[:2], k.shape[-1], dtype=torch.long),
        group_size=4, class_counts=(8, 56),
    )  # fmt: skip
    with pytest.raises(ValueError, match="class_counts"):
        codec.prepare(torch.randn(1, 1, 4, 64), None)
    with pytest.raises(ValueError, match="head_dim"):
        codec.layout(32)
    with pytest.raises(ValueError, match="prefill"):
        MixedChannelCodec([4, 2], lambda k, q: None, group_size=4).layout(64)


def test_layout_types_are_frozen_and_checked():
    lay = affine_layout(2, 64, torch.float16, False, 32, 1)
    with pytest.raises(AttributeError):
        lay.page_len = 1  # frozen
    with pytest.raises(ValueError, match="dtype"):
        GroupTerms(("scale",), "float12", 1, 1)
    with pytest.raises(ValueError, match="token_share"):
        CodeClass(2, 8, 1.5)
    with pytest.raises(ValueError, match="packing"):
        Codes.uniform(2, 8, "zip")
    assert Permutation("int16", True, 128).bits_per_element == 16 / 128


def test_codec_without_layout_names_what_to_implement():
    class Bare:
        token_group = 1

    class NoLayout(Method):
        Config = CacheConfig

        def key_codec(self, layer_idx, head_dim):
            return Bare()

    with pytest.raises(TypeError, match=r"key codec Bare has no layout\(head_dim, flush_tokens\)"):
        NoLayout().average_bits(64)


def test_a_method_without_key_codec_or_new_layer_names_both():
    class NoKeys(Method):
        Config = CacheConfig

    with pytest.raises(TypeError, match=r"NoKeys defines no key_codec.*override new_layer"):
        NoKeys().new_layer(0, 2, 64)
    with pytest.raises(TypeError, match=r"NoKeys defines no key_codec"):
        NoKeys().key_layout(64)
