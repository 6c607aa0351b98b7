"""kvbench.cache.quant.pack_bits / unpack_bits: LSB-first bit stream, every width 1..8 and 16.

Right values: hand-packed bytes, and numpy's own ``np.packbits(bitorder="little")`` over the
bit stream built independently (code ``i`` occupies stream bits ``i*b .. i*b+b-1``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.cache.blocks import PerChannelCodec, PerTokenCodec
from kvbench.cache.quant import pack_bits, packed_size, quantize_groups, unpack_bits

ALL_BITS = [1, 2, 3, 4, 5, 6, 7, 8, 16]


def np_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Independent packer: bit ``j`` of code ``i`` is stream bit ``i*bits + j``; bytes LSB-first."""
    *lead, n = codes.shape
    stream = ((codes[..., :, None] >> np.arange(bits)) & 1).astype(np.uint8)
    stream = stream.reshape(*lead, n * bits)
    return np.packbits(stream, axis=-1, bitorder="little")


@pytest.mark.parametrize(
    ("bits", "codes", "packed"),
    [
        (2, [3, 0, 1, 2], [3 | 0 << 2 | 1 << 4 | 2 << 6]),  # 147
        (4, [0xA, 0x5], [0x5A]),
        (3, [1, 2, 7], [0b11010001, 0b1]),  # bits 0..8 = 100 010 111
        (1, [1, 0, 1, 1, 0, 0, 0, 0, 1], [13, 1]),  # odd count spills into a second byte
        (8, [0, 255, 7], [0, 255, 7]),
    ],
)
def test_hand_packed(bits, codes, packed) -> None:
    c = torch.tensor(codes, dtype=torch.int32)
    p = pack_bits(c, bits)
    assert p.dtype == torch.uint8
    assert p.tolist() == packed
    assert p.numel() == packed_size(len(codes), bits) == -(-len(codes) * bits // 8)
    assert unpack_bits(p, bits, len(codes)).tolist() == codes


def test_sixteen_bit_codes() -> None:
    c = torch.tensor([0, 65535, 32768, 1], dtype=torch.int32)
    p = pack_bits(c, 16)
    assert p.dtype == torch.int16 and p.tolist() == [-32768, 32767, 0, -32767]
    assert p.numel() * p.element_size() == packed_size(4, 16) == 8
    assert unpack_bits(p, 16, 4).tolist() == [0, 65535, 32768, 1]


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(ALL_BITS),
    n=st.integers(1, 70),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_identity(bits, n, lead, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, n), generator=gen, dtype=torch.int64)
    p = pack_bits(codes, bits)
    assert p.shape == (*lead, n if bits == 16 else packed_size(n, bits))
    assert p.numel() * p.element_size() == int(np.prod(lead, dtype=np.int64)) * packed_size(n, bits)
    back = unpack_bits(p, bits, n)
    assert back.shape == codes.shape
    assert torch.equal(back.long(), codes)
    if bits != 16:
        assert np.array_equal(p.numpy(), np_pack(codes.numpy(), bits))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d", [4, 12, 64])
def test_block_codes_are_packed(bits, d) -> None:
    # a block stores ceil(D * bits / 8) bytes per token and channel row, not one byte per code
    x = torch.randn(2, 3, 8, d, generator=torch.Generator().manual_seed(1))
    for codec in (PerChannelCodec(bits, group_size=4), PerTokenCodec(bits, channel_group=4)):
        blk = codec.encode(x)
        assert blk.codes.dtype == torch.uint8
        assert blk.codes.shape == (2, 3, 8, -(-d * bits // 8))
        assert blk.unpacked_codes().max() <= 2**bits - 1


@pytest.mark.parametrize(
    "codes, bits, bad",
    [([-8, 7, -1], 4, -8), ([0, 16], 4, 16), ([3, 256], 8, 256), ([2], 1, 2), ([8], 3, 8)]
    + [([0, 65536], 16, 65536), ([-1], 16, -1), ([4], 2, 4), ([0, 32], 5, 32)]
    # the largest valid code (2^b - 1) before the offender is not the one named
    + [([15, 3, 16], 4, 16), ([1, 2], 1, 2), ([255, 0, 300], 8, 300)],
)
def test_pack_rejects_out_of_range_codes(codes: list[int], bits: int, bad: int) -> None:
    # pack_bits(tensor([-8, 7, -1]), 4) used to unpack to [8, 6, 15]: the sign bits spilled
    with pytest.raises(
        ValueError, match=rf"code {bad} is outside \[0, {2**bits - 1}\] for bits={bits}"
    ):
        pack_bits(torch.tensor(codes), bits)
    # and it says how to store a signed code: add 2^(bits-1)
    with pytest.raises(ValueError, match=rf"add 2\^\(bits-1\) = {2 ** (bits - 1)} before packing"):
        pack_bits(torch.tensor(codes), bits)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_packed_size_by_hand(bits: int) -> None:
    for n in (0, 1, 5, 8, 13):
        want = 2 * n if bits == 16 else math.ceil(n * bits / 8)
        assert packed_size(n, bits) == want
        packed = pack_bits(torch.zeros(2, n, dtype=torch.int64), bits)
        assert packed.numel() * packed.element_size() == 2 * want  # int16 for 16 bits


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpacked_code_dtype(bits: int) -> None:
    # documented: uint8 codes (int32 for 16 bits), whichever unpacking path the width takes
    codes = torch.tensor([[0, 2**bits - 1, 1, 0, 1, 0, 1, 1, 0]])
    out = unpack_bits(pack_bits(codes, bits), bits, 9)
    assert out.dtype == (torch.int32 if bits == 16 else torch.uint8)
    assert out.tolist() == codes.tolist()


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_of_no_rows(bits: int) -> None:
    packed = pack_bits(torch.zeros(0, 5, dtype=torch.int64), bits)
    assert packed.shape == (0, 5 if bits == 16 else math.ceil(5 * bits / 8))
    assert packed.dtype == (torch.int16 if bits == 16 else torch.uint8)
    out = unpack_bits(packed, bits, 5)
    assert out.shape == (0, 5)
    assert out.dtype == (torch.int32 if bits == 16 else torch.uint8)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_pack_accepts_both_ends_of_the_range(bits: int) -> None:
    codes = torch.tensor([0, 2**bits - 1, 0])
    assert unpack_bits(pack_bits(codes, bits), bits, 3).tolist() == codes.tolist()


def test_pack_rejects_float_codes() -> None:
    with pytest.raises(ValueError, match="integer dtype"):
        pack_bits(torch.tensor([1.0, 2.0]), 4)


def test_symmetric_codes_are_offset_binary() -> None:
    # the documented convention: signed q in [-(2^(b-1)-1), 2^(b-1)-1] stored as q + 2^(b-1)
    g = quantize_groups(torch.tensor([[-1.0, 0.0, 1.0]]), 4, symmetric=True)
    assert g.codes.tolist() == [[1, 8, 15]]
    assert unpack_bits(pack_bits(g.codes, 4), 4, 3).tolist() == [[1, 8, 15]]
