"""Triton pack/unpack (interpreter) against hand-packed bytes and kvbench.cache.quant.pack_bits."""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.quant import pack_bits as core_pack
from kvbench.cache.quant import unpack_bits as core_unpack
from kvbench.kernels import pack


def test_hand_packed_bytes(poison):
    # 2-bit codes [1, 2, 3, 0, 1]: byte 0 = 1 | 2<<2 | 3<<4 | 0<<6 = 0x39, byte 1 = 1
    c2 = torch.tensor([[1, 2, 3, 0, 1]], dtype=torch.int32)
    assert pack.pack_bits(c2, 2).tolist() == [[0x39, 0x01]]
    # 3-bit codes [5, 6, 7]: bits 101 | 110<<3 | 111<<6 = 0b111110101 -> bytes 0xF5, 0x01
    c3 = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    assert pack.pack_bits(c3, 3).tolist() == [[0xF5, 0x01]]
    # 1-bit codes [1,0,1,1,0,0,0,1, 1]: byte 0 = 0b10001101 = 0x8D, byte 1 = 1
    c1 = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1, 1]], dtype=torch.int32)
    assert pack.pack_bits(c1, 1).tolist() == [[0x8D, 0x01]]
    # 4-bit [0xA, 0x3, 0xF] -> 0x3A, 0x0F; 8-bit is the identity
    assert pack.pack_bits(torch.tensor([[10, 3, 15]]), 4).tolist() == [[0x3A, 0x0F]]
    assert pack.pack_bits(torch.tensor([[200, 7]]), 8).tolist() == [[200, 7]]
    for c, b in ((c2, 2), (c3, 3), (c1, 1)):
        assert torch.equal(pack.unpack_bits(pack.pack_bits(c, b), b, c.shape[-1]), c)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_matches_core_layout(bits, gen, poison):
    # odd code counts (a partial last byte, a partial last chunk of 8) and several tiles
    for n in (5, 13, 136):
        codes = torch.randint(0, 2**bits, (2, 3, n), generator=gen)
        ref = core_pack(codes, bits)
        got = pack.pack_bits(codes, bits)
        assert got.shape == ref.shape == (2, 3, (n * bits + 7) // 8)
        assert torch.equal(got, ref)
        back = pack.unpack_bits(ref, bits, n)
        assert back.dtype == torch.int32
        assert torch.equal(back, codes.int())
        assert torch.equal(core_unpack(got, bits, n).int(), codes.int())


def test_reference_matches_core(gen):
    for bits in (1, 3, 5, 8):
        codes = torch.randint(0, 2**bits, (4, 11), generator=gen)
        assert torch.equal(pack.pack_reference(codes, bits), core_pack(codes, bits))
        assert torch.equal(pack.unpack_reference(core_pack(codes, bits), bits, 11), codes.int())


def test_bad_inputs():
    c = torch.zeros(2, 8, dtype=torch.int32)
    for bits in (0, 9, 16, True):
        with pytest.raises(ValueError, match="bits"):
            pack.pack_bits(c, bits)
    with pytest.raises(ValueError, match="integer dtype"):
        pack.pack_bits(c.float(), 2)
    with pytest.raises(ValueError, match="uint8"):
        pack.unpack_bits(c, 2, 8)
    with pytest.raises(ValueError, match="cannot hold"):
        pack.unpack_bits(torch.zeros(2, 1, dtype=torch.uint8), 2, 8)
