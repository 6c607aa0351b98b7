"""In-place growth of a quantized block (kvbench.cache.layer.Side.add_block): the codes and
scales ``AffineBlock.cat`` gives, bytes of the tokens held, the residual's regrowth rule in the
block's token groups, no tensor handed out before a flush changed by it, and compact tensors
after crop / eviction / index_batch.

Right values: the codec's blocks of the same flushes joined with ``torch.cat``
(:meth:`kvbench.cache.blocks.AffineBlock.join`, the path before growth), bit for bit; the rule
of docs/design.md#memory (:func:`kvbench.cache.layer.grown_capacity`, rounded up to whole
token groups).
"""

from __future__ import annotations

import pytest
import torch

import kvbench
from kvbench.cache.blocks import AffineBlock, tensor_bytes
from kvbench.cache.layer import GROW_TOKENS, grown_capacity
from kvbench.testing import check_method

B, H, D = 2, 3, 64


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def block_tensors(blk: AffineBlock) -> list[torch.Tensor]:
    return [blk.codes, blk.scale] + ([] if blk.zero is None else [blk.zero])


def codes_ptr(blk: AffineBlock | None) -> int:
    return 0 if blk is None else blk.codes.untyped_storage().data_ptr()


def assert_same_block(got: AffineBlock, want: AffineBlock) -> None:
    assert got.group_len == want.group_len
    for a, b in zip(block_tensors(got), block_tensors(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_1000_step_append_loop_grows_by_the_rule_and_holds_no_token():
    """int8-block (every token quantized on write, one scale row per token): after a prompt of
    100 tokens, 1000 one-token steps store the codes and scales of the cat-built reference,
    count its bytes, regrow exactly where the rule says (the first time the block reaches
    GROW_TOKENS tokens, then when the room is used up) and report the room by hand."""
    lc = kvbench.get_method("int8-block").new_layer(0, H, D)
    x = rand(B, H, 1100, D, seed=1, dtype=torch.float16)
    lc.prefill(x[:, :, :100], x[:, :, :100])
    codec = lc.k.codec
    ref = codec.encode(x[:, :, :100])
    assert lc.spare_bytes() == 0  # the prompt's block is stored to its exact size
    regrowths, want, cap = 0, 0, 0
    for t in range(100, 1100):
        before = lc.k.block.codes.untyped_storage().data_ptr()
        lc.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        lc.end_step()
        ref = AffineBlock.join([ref, codec.encode(x[:, :, t : t + 1])])
        if t + 1 < GROW_TOKENS:  # a short block is concatenated to its exact size
            assert lc.spare_bytes() == 0
        else:
            regrowths += lc.k.block.codes.untyped_storage().data_ptr() != before
        if t + 1 >= GROW_TOKENS and t + 1 > cap:  # the rule, by hand
            want, cap = want + 1, grown_capacity(t + 1)
    assert regrowths == want == 4, (regrowths, want)  # to 512, 768, 1024 and 1536 tokens
    for side in (lc.k, lc.v):
        assert_same_block(side.block, ref)
        assert side.block_rooms[0].capacity == cap == 1536
    nb = lc.nbytes()
    assert nb["total"] == 2 * tensor_bytes(*block_tensors(ref))
    # codes 64 bytes and one float16 scale per 32 channels per token, both sides
    per_token = B * H * (D + 2 * D // 32)
    assert lc.spare_bytes() == 2 * (cap - 1100) * per_token
    allocated = sum(
        t.untyped_storage().nbytes() for s in (lc.k, lc.v) for t in block_tensors(s.block)
    )
    assert allocated == nb["total"] + lc.spare_bytes()
    assert torch.equal(lc.keys_values()[0], ref.dequantize(torch.float16))


def test_token_groups_grow_in_whole_groups():
    """kivi: keys per channel in groups of 32 tokens (one scale row per group), values per
    token: each side's room is grown_capacity rounded up to whole groups, and what is stored
    equals the cat-built blocks of the same flushes."""
    m = kvbench.get_method(
        "kivi", bits=2, value_bits=2, group_size=32, value_group_size=32, residual_length=32
    )
    lc = m.new_layer(0, H, D)
    x = rand(B, H, 900, D, seed=2)
    lc.prefill(x[:, :, :300], x[:, :, :300])
    ref = {"k": lc.k.block, "v": lc.v.block}
    regrown = {"k": 0, "v": 0}
    for t in range(300, 900):
        ptrs = {s: codes_ptr(getattr(lc, s).block) for s in regrown}
        lc.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        lc.end_step()
        for s in regrown:
            side = getattr(lc, s)
            if side.block_rooms and codes_ptr(side.block) != ptrs[s]:  # by the rule
                regrown[s] += 1
                tg, n = side.codec.token_group, side.block.ntokens
                assert side.block_rooms[0].capacity == -(-grown_capacity(n) // tg) * tg
    assert regrown["k"] >= 1 and regrown["v"] >= 1
    k, v = lc.k, lc.v
    assert k.codec.token_group == 32 and v.codec.token_group == 1
    for side in (k, v):
        blk, rooms = side.block, side.block_rooms
        n, tg = blk.ntokens, side.codec.token_group
        assert rooms is not None and rooms[0].filled == n and rooms[1].filled == n // tg
        assert rooms[0].capacity == rooms[1].capacity * tg
    # the same flushes through the cat path: re-encode the flushed tokens side by side
    for name, side in (("k", k), ("v", v)):
        start = 0 if ref[name] is None else ref[name].ntokens
        want = AffineBlock.join([b for b in [ref[name]] if b is not None] + [
            side.codec.encode(x[:, :, s : s + side.codec.token_group])
            for s in range(start, side.block.ntokens, side.codec.token_group)
        ])  # fmt: skip
        assert_same_block(side.block, want)


def test_a_view_handed_out_before_a_flush_is_not_changed_by_it():
    """A block held at step t (views of the grown allocations) still reads its tokens after
    later flushes write into the room behind them."""
    lc = kvbench.get_method("int4-block").new_layer(0, H, D)
    x = rand(B, H, 700, D, seed=3)
    lc.prefill(x[:, :, :400], x[:, :, :400])
    lc.append(x[:, :, 400:401], x[:, :, 400:401])
    lc.end_step()
    held = lc.k.block
    saved = [t.clone() for t in block_tensors(held)]
    for t in range(401, 512):  # into the room grown at 401 tokens (512 = grown_capacity(401))
        lc.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
    lc.end_step()
    assert held.ntokens == 401 and lc.k.block.ntokens == 512
    assert all(torch.equal(a, b) for a, b in zip(block_tensors(held), saved, strict=True))
    assert lc.k.block.codes.untyped_storage().data_ptr() == held.codes.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_crop_evict_index_batch_leave_compact_blocks_and_appends_go_on(dtype):
    lc = kvbench.get_method("int8-block").new_layer(0, H, D)
    ref = kvbench.get_method("int8-block").new_layer(0, H, D)
    x = rand(B, H, 800, D, seed=4, dtype=dtype)
    for c in (lc, ref):
        c.prefill(x[:, :, :300], x[:, :, :300])
    for t in range(300, 500):
        lc.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
    lc.end_step()
    assert lc.spare_bytes() > 0
    ref.append(x[:, :, 300:500], x[:, :, 300:500])  # one flush of 200: no growth in steps
    ref.end_step()
    lc.crop(450)
    ref.crop(450)
    for side in (lc.k, lc.v):
        assert all(
            t.untyped_storage().nbytes() == tensor_bytes(t) for t in block_tensors(side.block)
        )
    assert lc.spare_bytes() == 0
    keep = torch.arange(0, 450, 2).expand(B, H, -1)  # the same tokens everywhere
    drop = torch.arange(1, 450, 2).expand(B, H, -1)
    lc.evict(drop)
    ref.evict(drop)
    assert lc.k.block.ntokens == keep.shape[2] and lc.spare_bytes() == 0
    for t in range(450, 800):
        lc.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        ref.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        ref.end_step()
    lc.end_step()
    assert torch.equal(lc.keys_values()[0], ref.keys_values()[0])
    assert lc.nbytes() == ref.nbytes()
    lc.index_batch(torch.tensor([1]))
    ref.index_batch(torch.tensor([1]))
    assert torch.equal(lc.keys_values()[1], ref.keys_values()[1]) and lc.spare_bytes() == 0
    lc.reset()
    assert lc.spare_bytes() == 0 and lc.k.block_rooms is None


@pytest.mark.parametrize("name", ["int4-block", "int8-block", "per-token"])
def test_check_method_holds_with_grown_blocks(name):
    """The storage check (room == spare_bytes()) of kvbench.testing on a long replay."""
    got = check_method(kvbench.get_method(name), prompt_tokens=250, decode_tokens=40)
    assert got.decode_tokens == 40
