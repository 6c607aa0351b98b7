"""In-place growth of a long full-precision residual (kvbench.cache.layer.Side.add_residual):
the values ``torch.cat`` gives, bytes of the tokens held, amortised regrowth, no tensor handed
out before an append changed by it, and the exact-size residual of a short one.

Right values: ``torch.cat`` of the tokens appended (bit for bit); the regrowth rule of
docs/design.md#memory (:func:`kvbench.cache.layer.grown_capacity`: the tokens held plus a
quarter, rounded up to a multiple of 256 tokens).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import kvbench
from kvbench.cache.layer import GROW_TOKENS, grown_capacity

B, H, D = 2, 3, 8


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def full_layer(storage_dtype: str | None = None):
    return kvbench.get_method("full", storage_dtype=storage_dtype).new_layer(0, H, D)


def allocation(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def token_bytes(t: torch.Tensor) -> int:
    return B * H * D * t.element_size()


def test_grown_capacity_is_a_quarter_more_in_256_token_steps():
    assert GROW_TOKENS == 256
    assert grown_capacity(256) == 512  # 256 + 64 -> 320 -> 512
    assert grown_capacity(999) == 1280  # 999 + 249 = 1248 -> 1280
    assert grown_capacity(8167) == 10240  # 8167 + 2041 = 10208 -> 10240
    assert grown_capacity(1024) == 1280  # exactly 1280


@pytest.mark.parametrize("storage_dtype", [None, "float16"])
def test_appends_equal_torch_cat_and_regrow_geometrically(storage_dtype):
    """300 prompt tokens, then 1700 decode tokens one at a time and a few in threes: the K/V
    held equal torch.cat of everything appended, bit for bit; the residual's allocation changes
    only when its room is used up (5 regrowths by the rule: to 512, 768, 1024, 1536 and 2048
    tokens, not one per step); bytes count the tokens held, the room is reported apart."""
    lc = full_layer(storage_dtype)
    k, v = rand(B, H, 2000, D, seed=1), rand(B, H, 2000, D, seed=2)
    lc.prefill(k[:, :, :300], v[:, :, :300])
    assert lc.spare_bytes() == 0  # the prompt is stored to its exact size
    t, regrowths = 300, 0
    while t < 2000:
        n = 3 if t % 100 == 0 else 1
        before = allocation(lc.k.residual)
        lc.append(k[:, :, t : t + n], v[:, :, t : t + n])
        lc.end_step()
        t += n
        regrowths += allocation(lc.k.residual) != before
    # the rule: a regrowth at 301 tokens (to 512), then whenever the room is used up
    want, cap, t = 0, 300, 300
    while t < 2000:
        n = 3 if t % 100 == 0 else 1
        if t + n > cap:
            want, cap = want + 1, grown_capacity(t + n)
        t += n
    assert regrowths == want == 5, (regrowths, want)
    assert regrowths <= 1 + math.ceil(math.log(2000 / 300, 1.25))  # geometric, not per step
    sd = lc.k.residual.dtype
    keys, values = lc.keys_values()
    torch.testing.assert_close(keys, k.to(sd).to(keys.dtype), rtol=0, atol=0)
    torch.testing.assert_close(values, v.to(sd).to(values.dtype), rtol=0, atol=0)
    assert torch.equal(lc.k.residual, torch.cat([k[:, :, :300], k[:, :, 300:]], dim=2).to(sd))
    nb = lc.nbytes()
    assert nb["residual"] == nb["total"] == 2 * 2000 * token_bytes(lc.k.residual)
    room = cap  # the last regrowth's capacity, by the rule
    assert lc.k.room.capacity == lc.v.room.capacity == room
    assert lc.spare_bytes() == 2 * (room - 2000) * token_bytes(lc.k.residual)
    for side in (lc.k, lc.v):
        res = side.residual
        assert res.storage_offset() == 0  # the allocation holds nothing before the tokens
        assert res.untyped_storage().nbytes() == room * token_bytes(res)
    total = nb["total"] + lc.spare_bytes()
    assert total == sum(s.residual.untyped_storage().nbytes() for s in (lc.k, lc.v))


def test_a_view_handed_out_before_an_append_is_not_changed_by_it():
    """keys_values() of step t (a view of the grown residual) still reads the tokens of step t
    after later appends write into the room behind them."""
    lc = full_layer()
    k, v = rand(B, H, 600, D, seed=3), rand(B, H, 600, D, seed=4)
    lc.prefill(k[:, :, :400], v[:, :, :400])
    lc.append(k[:, :, 400:401], v[:, :, 400:401])
    old_k, old_v = lc.keys_values()
    saved = old_k.clone(), old_v.clone()
    for t in range(401, 600):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert old_k.shape[2] == 401
    assert torch.equal(old_k, saved[0]) and torch.equal(old_v, saved[1])
    assert torch.equal(lc.keys_values()[0], k)


def test_a_short_residual_keeps_its_exact_size():
    """Below GROW_TOKENS tokens the residual is concatenated to its exact size (no room)."""
    lc = full_layer()
    k = rand(B, H, GROW_TOKENS, D, seed=5)
    lc.prefill(k[:, :, :10], k[:, :, :10])
    for t in range(10, GROW_TOKENS - 1):
        lc.append(k[:, :, t : t + 1], k[:, :, t : t + 1])
        res = lc.k.residual
        assert res.untyped_storage().nbytes() == res.numel() * res.element_size()
    assert lc.spare_bytes() == 0
    lc.append(k[:, :, -1:], k[:, :, -1:])  # 256 tokens: grows
    assert lc.spare_bytes() == 2 * (512 - 256) * token_bytes(k)


def test_crop_index_batch_and_reset_leave_compact_tensors_and_appends_go_on():
    """crop and index_batch of a grown residual keep only what they hold (a compact copy), and
    later appends still equal torch.cat."""
    lc = full_layer()
    k = rand(B, H, 700, D, seed=6)
    lc.prefill(k[:, :, :300], k[:, :, :300])
    for t in range(300, 500):
        lc.append(k[:, :, t : t + 1], k[:, :, t : t + 1])
    lc.crop(450)
    res = lc.k.residual
    assert res.shape[2] == 450 and res.untyped_storage().nbytes() == res.numel() * 4
    assert lc.spare_bytes() == 0
    for t in range(450, 700):
        lc.append(k[:, :, t : t + 1], k[:, :, t : t + 1])
    assert torch.equal(lc.keys_values()[0], k)
    lc.index_batch(torch.tensor([1]))
    res = lc.k.residual
    assert res.untyped_storage().nbytes() == res.numel() * 4
    assert torch.equal(lc.keys_values()[0], k[1:])
    lc.reset()
    assert lc.spare_bytes() == 0 and lc.k.room is None


def test_a_flush_from_a_grown_residual_keeps_no_full_precision_copy():
    """KIVI with a 512-token key block: the keys' residual grows in place until its flush;
    after it nothing keeps the grown allocation (the flushed tokens' full-precision copy) alive:
    every tensor held owns exactly its bytes, or is a grown residual (or quantized block,
    Side.add_block) whose allocation is its tokens plus the reported room."""
    m = kvbench.get_method("kivi", bits=2, value_bits=2, group_size=32, residual_length=512)
    lc = m.new_layer(0, H, D * 4)
    k, v = rand(B, H, 1400, D * 4, seed=7), rand(B, H, 1400, D * 4, seed=8)
    lc.prefill(k[:, :, :300], v[:, :, :300])
    for t in range(300, 1400):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lc.end_step()
        if t == 900:  # 901 held: 512 quantized, 389 in the key residual
            assert lc.k.spare_tokens() > 0  # the key residual grew in place
    spare = 0
    for _side, cat, t in lc.tensors():
        extra = t.untyped_storage().nbytes() - t.numel() * t.element_size()
        if extra:
            assert cat in ("residual", "codes", "scales") and t.storage_offset() == 0
            spare += extra
    assert spare == lc.spare_bytes()


def test_inference_tensors_grown_in_inference_mode_append_outside_it():
    lc = full_layer()
    k = rand(B, H, 600, D, seed=9)
    with torch.inference_mode():
        lc.prefill(k[:, :, :300], k[:, :, :300])
        for t in range(300, 400):
            lc.append(k[:, :, t : t + 1], k[:, :, t : t + 1])
    for t in range(400, 600):  # no "inplace update to inference tensor" error: it regrows
        lc.append(k[:, :, t : t + 1].clone(), k[:, :, t : t + 1].clone())
    assert torch.equal(lc.keys_values()[0], k)


def test_two_holders_of_one_room_do_not_write_the_same_slot():
    """A shallow copy of a layer's sides shares the grown allocation and its room: the first
    to append writes past the tokens, the second regrows, and each holds its own tokens."""
    lc = full_layer()
    k = rand(B, H, 400, D, seed=10)
    lc.prefill(k[:, :, :300], k[:, :, :300])
    lc.append(k[:, :, 300:301], k[:, :, 300:301])
    twin = copy.copy(lc)
    twin.k, twin.v = copy.copy(lc.k), copy.copy(lc.v)
    lc.append(k[:, :, 301:302], k[:, :, 301:302])
    other = rand(B, H, 1, D, seed=11)
    twin.append(other, other)
    assert torch.equal(lc.keys_values()[0], k[:, :, :302])
    assert torch.equal(twin.keys_values()[0], torch.cat([k[:, :, :301], other], dim=2))
