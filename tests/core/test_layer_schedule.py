"""kvbench.cache.schedule and kvbench.cache.layer.LayerCache: flush rules, the deferred flush, sinks,
reference attention, crop/reset and byte accounting.

Right values: docs/methods.md#flush-schedules, §4 (Kitty), docs/methods.md#worked-example-16 (prefill 300, then 300
decode steps, G = R = 128), docs/design.md#when-quantization-happens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbench
from kvbench.cache.blocks import PerChannelCodec, PerTokenCodec
from kvbench.cache.layer import LayerCache
from kvbench.cache.schedule import (
    AllButNewestSchedule,
    BlockSchedule,
    NeverSchedule,
    SlidingSchedule,
)

F32 = torch.float32


def rand(*shape, seed=0, dtype=F32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------ schedules (docs/methods.md#flush-schedules)


def test_block_schedule_kivi_keys() -> None:
    s = BlockSchedule(128)
    assert [s.prefill_count(n) for n in (0, 100, 127, 128, 300, 4096)] == [0, 0, 0, 128, 256, 4096]
    assert [s.flush_count(r) for r in (0, 1, 127, 128)] == [0, 0, 0, 128]
    assert BlockSchedule(0).prefill_count(7) == 7 and BlockSchedule(0).flush_count(1) == 1


def test_sliding_schedule_kivi_values() -> None:
    s = SlidingSchedule(128)
    assert [s.prefill_count(n) for n in (0, 100, 128, 129, 300)] == [0, 0, 0, 1, 172]
    assert [s.flush_count(r) for r in (0, 128, 129, 131)] == [0, 0, 1, 3]


def test_all_but_newest_schedule_kitty_keys() -> None:
    s = AllButNewestSchedule(128, 128)
    # Kitty-sim: nothing at prefill unless n > R; then whole pages of G
    assert [s.prefill_count(n) for n in (100, 128, 129, 268)] == [0, 0, 128, 256]
    # decode: the residual cycles 1..R; at R + 1 the oldest R are quantized
    assert [s.flush_count(r) for r in (1, 128, 129)] == [0, 0, 128]


def test_never_schedule() -> None:
    assert NeverSchedule().prefill_count(10**6) == 0 and NeverSchedule().flush_count(10**6) == 0


# ------------------------------------------------------------------ Example 16


def _trail_exact(kv: torch.Tensor, ref: torch.Tensor) -> int:
    """Number of newest tokens that come back bit-exact (a quantized 2-bit token never does)."""
    same = (kv == ref).all(dim=-1).flatten().tolist()
    n = 0
    for s in reversed(same):
        if not s:
            break
        n += 1
    return n


def test_example16_kivi_schedule() -> None:
    # docs/methods.md#worked-example-16, KIVI rows: G = R = 128, prompt 300, 300 decode steps
    m = kvbench.get_method(
        "kivi",
        bits=2,
        group_size=128,
        residual_length=128,
        value_bits=2,
        value_group_size=8,
        scale_dtype="float32",
    )
    layer = m.new_layer(0, 1, 8)
    ks, vs = rand(1, 1, 600, 8, seed=1), rand(1, 1, 600, 8, seed=2)
    layer.prefill(ks[:, :, :300], vs[:, :, :300])
    assert layer.quantized_tokens() == (256, 172)  # keys 256 + 44 fp, values 172 + 128 fp
    assert layer.seq_length == 300
    k, v = layer.keys_values()
    assert _trail_exact(k, ks[:, :, :300]) == 44 and _trail_exact(v, vs[:, :, :300]) == 128
    flushes = []
    for step in range(1, 301):
        t = 299 + step
        layer.append(ks[:, :, t : t + 1], vs[:, :, t : t + 1])
        before = layer.quantized_tokens()
        layer.end_step()
        kq, vq = layer.quantized_tokens()
        if kq != before[0]:
            flushes.append(step)
        assert layer.seq_length == 300 + step
        want_k = 256 if step < 84 else (384 if step < 212 else 512)  # by hand: 44 + step = 128k
        assert (kq, vq) == (want_k, 172 + step), step
    assert flushes == [84, 212]
    assert layer.quantized_tokens() == (512, 472)
    k, v = layer.keys_values()
    assert _trail_exact(k, ks) == 88 and _trail_exact(v, vs) == 128


def test_example16_kitty_schedule_on_core() -> None:
    # docs/methods.md#worked-example-16, Kitty-sim row (sink 32): keys 256 + 12 fp after prefill, flushes at
    # steps 117 and 245, final keys 512 + 56; values 140 quantized after prefill, final 440
    layer = LayerCache(
        PerChannelCodec(2, F32, group_size=128),
        PerTokenCodec(2, F32, channel_group=4),
        AllButNewestSchedule(128, 128),
        SlidingSchedule(128),
        num_sink_tokens=32,
    )
    x = rand(1, 1, 600, 4)
    layer.prefill(x[:, :, :300], x[:, :, :300])
    assert layer.quantized_tokens() == (256, 140)
    flushes = []
    for step in range(1, 301):
        layer.append(x[:, :, 299 + step : 300 + step], x[:, :, 299 + step : 300 + step])
        kq = layer.quantized_tokens()[0]
        layer.end_step()
        if layer.quantized_tokens()[0] != kq:
            flushes.append(step)
    assert flushes == [117, 245]
    assert layer.quantized_tokens() == (512, 440)
    assert layer.seq_length == 600
    k, _ = layer.keys_values()
    assert torch.equal(k[:, :, :32], x[:, :, :32])  # sinks exact
    assert _trail_exact(k, x) == 56


# ------------------------------------------------------------------ the deferred flush


def test_append_defers_the_flush_to_end_step() -> None:
    # docs/design.md#layer-cache: append only stores (the new token joins the residual); the flush
    # it makes due runs at end_step, or the next append.  The caller orders end_step with the
    # step's attention (docs/design.md#protocols: before it under write-then-attend, the default,
    # after it under in-chunk-full)
    m = kvbench.get_method("kivi", bits=2, group_size=4, residual_length=4, scale_dtype="float32")
    layer = m.new_layer(0, 1, 8)
    x = rand(1, 1, 10, 8)
    layer.prefill(x[:, :, :7], x[:, :, :7])  # keys 4 quantized + 3 fp
    assert layer.quantized_tokens() == (4, 0)
    layer.append(x[:, :, 7:8], x[:, :, 7:8])  # residual reaches R = 4
    assert layer.quantized_tokens() == (4, 0)
    k, _ = layer.keys_values()
    assert torch.equal(k[:, :, 4:], x[:, :, 4:8])  # all 4 residual keys still exact
    layer.append(x[:, :, 8:9], x[:, :, 8:9])  # runs the pending flush first
    assert layer.quantized_tokens() == (8, 0)
    layer.end_step()
    layer.end_step()  # idempotent
    assert layer.quantized_tokens() == (8, 0) and layer.seq_length == 9


def test_multi_token_append_flushes_whole_groups() -> None:
    m = kvbench.get_method(
        "kivi", bits=2, group_size=4, residual_length=8, value_bits=2, value_group_size=4
    )
    layer = m.new_layer(0, 2, 8)
    x = rand(1, 2, 30, 8)
    layer.prefill(x[:, :, :5], x[:, :, :5])
    assert layer.quantized_tokens() == (0, 0)
    layer.append(x[:, :, 5:25], x[:, :, 5:25])
    layer.end_step()
    # keys: residual 25 -> 24 quantized (3 blocks of R = 8), 1 fp; values: all but the last 8
    assert layer.quantized_tokens() == (24, 17)
    assert layer.k.block.group_len == [4] * 6


# ------------------------------------------------------------------ sinks


def test_sinks_fill_from_first_tokens_and_stay_exact() -> None:
    m = kvbench.get_method(
        "per-token", bits=2, residual_length=2, num_sink_tokens=4, value_bits=2, value_group_size=4
    )
    layer = m.new_layer(0, 1, 4)
    x = rand(1, 1, 12, 4)
    layer.prefill(x[:, :, :2], x[:, :, :2])  # shorter than N_s: both become sinks
    assert layer.quantized_tokens() == (0, 0)
    for t in range(2, 12):
        layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        layer.end_step()
    # 4 sinks + 6 quantized + 2 residual
    assert layer.quantized_tokens() == (6, 6)
    k, v = layer.keys_values()
    assert torch.equal(k[:, :, :4], x[:, :, :4]) and torch.equal(v[:, :, :4], x[:, :, :4])
    assert torch.equal(k[:, :, 10:], x[:, :, 10:])
    assert not torch.equal(k[:, :, 4:10], x[:, :, 4:10])
    nb = layer.nbytes()
    assert nb["sinks"] == 2 * 4 * 4 * 4 and nb["residual"] == 2 * 2 * 4 * 4


# ------------------------------------------------------------------ attention, bytes, reset


def test_attend_matches_float64_softmax() -> None:
    m = kvbench.get_method(
        "kivi", bits=4, group_size=4, residual_length=4, value_bits=4, value_group_size=4
    )
    layer = m.new_layer(0, 2, 8)
    layer.prefill(rand(1, 2, 10, 8, seed=1), rand(1, 2, 10, 8, seed=2))
    k, v = (t.double().numpy() for t in layer.keys_values())
    q = rand(1, 4, 3, 8, seed=3)
    out = layer.attend(q).double().numpy()
    qn = q.double().numpy()
    want = np.zeros_like(qn)
    for h in range(4):
        for i in range(3):  # causal: query i is absolute position 10 - 3 + i
            kk, vv = k[0, h // 2, : 8 + i], v[0, h // 2, : 8 + i]
            logit = kk @ qn[0, h, i] / np.sqrt(8)
            p = np.exp(logit - logit.max())
            want[0, h, i] = (p / p.sum()) @ vv
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_nbytes_is_sum_of_tensors_and_reset() -> None:
    m = kvbench.get_method(
        "kivi",
        bits=3,
        group_size=4,
        residual_length=8,
        value_bits=4,
        value_group_size=4,
        num_sink_tokens=2,
    )
    layer = m.new_layer(0, 2, 8)
    layer.prefill(rand(2, 2, 21, 8, dtype=torch.float16), rand(2, 2, 21, 8, dtype=torch.float16))
    nb = layer.nbytes()
    tensors = layer.tensors()
    assert nb["total"] == sum(t.numel() * t.element_size() for _, _, t in tensors)
    for cat in ("codes", "scales", "metadata", "residual", "sinks"):
        assert nb[cat] == sum(t.numel() * t.element_size() for _, c, t in tensors if c == cat)
    assert nb["key_total"] + nb["value_total"] == nb["total"]
    # by hand: 2 sinks, then 19 tokens: keys 16 quantized (4 groups of G = 4) + 3 fp (19 mod 8),
    # values 11 quantized + 8 fp (R = 8); fp16 throughout, scale and zero 2 bytes each
    b, h = 2, 2
    assert nb["sinks"] == 2 * b * h * 2 * 8 * 2
    assert nb["residual"] == b * h * (3 + 8) * 8 * 2
    assert nb["codes"] == b * h * 16 * 3 + b * h * 11 * 4  # ceil(8*3/8)=3, ceil(8*4/8)=4 B/token
    assert nb["scales"] == 2 * 2 * (b * h * 4 * 8 + b * h * 11 * 2)
    layer.reset()
    assert layer.seq_length == 0 and layer.nbytes()["total"] == 0
    assert layer.awaiting_queries is False and layer.kv_shape is None
    layer.prefill(rand(1, 2, 3, 8), rand(1, 2, 3, 8))  # reusable after reset, new batch size
    assert layer.seq_length == 3 and layer.batch_size == 1


def test_crop_negative_and_seq_length() -> None:
    m = kvbench.get_method(
        "kivi",
        bits=2,
        group_size=4,
        residual_length=4,
        value_bits=2,
        value_group_size=4,
        scale_dtype="float32",
    )
    layer = m.new_layer(0, 1, 4)
    x = rand(1, 1, 10, 4)
    layer.prefill(x, x)
    k_full, v_full = layer.keys_values()
    layer.crop(-3)  # drop the 3 newest
    assert layer.seq_length == 7
    k, v = layer.keys_values()
    assert torch.equal(k, k_full[:, :, :7]) and torch.equal(v, v_full[:, :, :7])
    assert layer.quantized_tokens() == (7, 6)
    layer.crop(0)
    assert layer.seq_length == 0 and layer.nbytes()["total"] == 0


# ------------------------------------------------------------------ a subclass on a padded batch


def test_subclass_overrides_dispatch_to_the_rows_of_a_padded_batch() -> None:
    # LayerCache.__init_subclass__ wraps a subclass's own overrides (docs/design.md#padding):
    # on a left-padded batch each runs once per row cache, never on the container, and the
    # subclass's prefill accepts ``lengths``; each row holds what a cache of that row alone holds
    calls = []

    class Logged(LayerCache):
        def prefill(self, keys, values, queries=None):
            calls.append(("prefill", keys.shape[0], keys.shape[2]))
            super().prefill(keys, values, queries)

        def append(self, keys, values):
            calls.append(("append", keys.shape[0]))
            super().append(keys, values)

        def quantized_tokens(self):
            calls.append(("quantized_tokens", self.seq_length))
            return super().quantized_tokens()

    def new(cls):
        return cls(PerTokenCodec(2, F32, channel_group=4), None, SlidingSchedule(2))

    x = rand(2, 1, 6, 4, seed=3)
    layer = new(Logged)
    layer.prefill(x[:, :, :5], x[:, :, :5], lengths=torch.tensor([3, 5]))
    assert calls == [("prefill", 1, 3), ("prefill", 1, 5)]
    calls.clear()
    layer.append(x[:, :, 5:6], x[:, :, 5:6])
    layer.end_step()
    assert calls == [("append", 1), ("append", 1)]
    calls.clear()
    # row 0: 3 + 1 tokens, 2 quantized (R = 2); row 1: 5 + 1, 4 quantized; the most is reported
    assert layer.quantized_tokens() == (4, 0)
    assert calls == [("quantized_tokens", 4), ("quantized_tokens", 6)]
    for b, n in enumerate((3, 5)):
        alone = new(LayerCache)
        alone.prefill(x[b : b + 1, :, 5 - n : 5], x[b : b + 1, :, 5 - n : 5])
        alone.append(x[b : b + 1, :, 5:6], x[b : b + 1, :, 5:6])
        alone.end_step()
        for got, want in zip(layer.rows[b].keys_values(), alone.keys_values(), strict=True):
            assert torch.equal(got, want)

    # a subclass that overrides nothing keeps the base operations, padded or not
    class Plain(LayerCache):
        pass

    for lengths in (None, torch.tensor([3, 5])):
        plain = new(Plain)
        plain.prefill(x[:, :, :5], x[:, :, :5], lengths=lengths)
        plain.append(x[:, :, 5:6], x[:, :, 5:6])
        plain.end_step()
        assert plain.seq_length == 6 and plain.quantized_tokens() == (4, 0)  # 6 - R


def test_crop_with_sinks_at_every_length() -> None:
    # 3 sinks + 4 quantized (per-token codes, exact under crop) + 2 residual: cropping to n keeps
    # the first n tokens of the uncropped read, min(n, 3) of them as sinks
    def new():
        return LayerCache(
            PerTokenCodec(2, F32, channel_group=4),
            PerTokenCodec(2, F32, channel_group=4),
            SlidingSchedule(2),
            SlidingSchedule(2),
            num_sink_tokens=3,
        )

    x = rand(1, 2, 9, 4, seed=5)
    full = new()
    full.prefill(x, x)
    k_full, v_full = full.keys_values()
    assert full.quantized_tokens() == (4, 4)
    sink_bytes = 2 * 4 * 4  # H x D x float32, per sink token
    for n in [*range(10), -1, -4, -9]:
        layer = new()
        layer.prefill(x, x)
        layer.crop(n)
        m = n % 9 if n < 0 else n
        assert layer.seq_length == m, n
        assert layer.nbytes()["sinks"] == 2 * sink_bytes * min(m, 3), n
        assert layer.quantized_tokens() == (min(max(m - 3, 0), 4),) * 2, n
        if m:
            k, v = layer.keys_values()
            assert torch.equal(k, k_full[:, :, :m]) and torch.equal(v, v_full[:, :, :m]), n


def test_attend_calls_the_dispatch(monkeypatch) -> None:
    # attend() is a thin wrapper of kvbench.attention.dispatch.attend: the layer, the query, the
    # scaling and the lengths go to it unchanged and its result comes back
    from kvbench.attention import dispatch

    seen = []

    def fake(layer, query, scaling, lengths):
        seen.append((layer, scaling, lengths))
        return query * 2

    monkeypatch.setattr(dispatch, "attend", fake)
    layer = LayerCache(None, None)
    q, lens = torch.ones(1, 1, 1, 4), torch.tensor([3])
    assert torch.equal(layer.attend(q, 0.5, lens), q * 2)
    assert seen == [(layer, 0.5, lens)]


def test_index_batch_keeps_sinks_and_codec_state() -> None:
    # beam search / batch select (index_batch) reorders every stored part, the sinks too, and
    # hands the rows to a codec that keeps per-sequence state (a selection)
    seen = []

    class Selecting(PerTokenCodec):
        def index_batch(self, idx):
            seen.append(idx.tolist())

    def new():
        return LayerCache(
            Selecting(2, F32, channel_group=4),
            PerTokenCodec(2, F32, channel_group=4),
            SlidingSchedule(2),
            SlidingSchedule(2),
            num_sink_tokens=2,
        )

    x = rand(3, 2, 7, 4, seed=6)  # per side: 2 sinks + 3 quantized + 2 residual
    full = new()
    full.prefill(x, x)
    k_full, v_full = full.keys_values()
    layer = new()
    layer.prefill(x, x)
    layer.index_batch([2, 0])
    assert seen == [[2, 0]] and layer.batch_size == 2
    k, v = layer.keys_values()
    assert torch.equal(k, k_full[[2, 0]]) and torch.equal(v, v_full[[2, 0]])
    assert layer.nbytes()["sinks"] == 2 * full.nbytes()["sinks"] // 3


def test_keys_values_in_a_requested_dtype() -> None:
    # a float16 cache read as float32: every part (sinks, dequantized blocks, residual) comes
    # back float32; the full-precision parts exact, the quantized ones the float16 read widened
    layer = LayerCache(
        PerTokenCodec(4, F32, channel_group=4), None, SlidingSchedule(2), num_sink_tokens=1
    )
    x = rand(1, 1, 6, 4, seed=7, dtype=torch.float16)
    layer.prefill(x, x)
    k16, v16 = layer.keys_values()
    k32, v32 = layer.keys_values(torch.float32)
    assert (k16.dtype, v16.dtype, k32.dtype, v32.dtype) == (torch.float16,) * 2 + (F32,) * 2
    assert torch.equal(v32, x.float()) and torch.equal(v16, x)  # no value codec
    assert torch.equal(k32[:, :, :1], x[:, :, :1].float())  # the sink
    assert torch.equal(k32[:, :, -2:], x[:, :, -2:].float())  # the residual (R = 2)
    assert layer.quantized_tokens() == (3, 0)
    assert torch.equal(k32.half(), k16)  # dequantized in float32 either way


def test_prefill_waits_for_its_queries() -> None:
    # needs_queries (PN-Mix's channel selection): a prefill without post-RoPE queries stores the
    # prompt and quantizes nothing until provide_queries(), which prepares the key codec with
    # the prompt keys and those queries, then flushes; a second call does nothing
    seen = []

    class Preparing(PerTokenCodec):
        def prepare(self, keys, queries):
            seen.append((keys.clone(), None if queries is None else queries.clone()))

    layer = LayerCache(
        Preparing(2, F32, channel_group=4), None, SlidingSchedule(2), needs_queries=True
    )
    x, q = rand(1, 1, 6, 4, seed=8), rand(1, 2, 6, 4, seed=9)
    layer.prefill(x, x)
    assert layer.awaiting_queries is True and layer.quantized_tokens() == (0, 0) and not seen
    with pytest.raises(ValueError, match=r"needs queries at prefill .* provide_queries\(\)"):
        layer.append(x[:, :, :1], x[:, :, :1])
    layer.provide_queries(q)
    assert layer.awaiting_queries is False and layer.quantized_tokens() == (4, 0)
    assert len(seen) == 1 and torch.equal(seen[0][0], x) and torch.equal(seen[0][1], q)
    layer.provide_queries(q)
    assert len(seen) == 1 and layer.quantized_tokens() == (4, 0)


def test_prefill_with_its_queries_prepares_the_key_codec_once() -> None:
    # queries given at prefill: the key codec is prepared with the prompt keys and those
    # queries before the first flush; the value codec is never prepared (it selects nothing)
    seen = []

    class Preparing(PerTokenCodec):
        def prepare(self, keys, queries):
            seen.append((self.bits, keys.clone(), queries.clone()))

    layer = LayerCache(
        Preparing(2, F32, channel_group=4), Preparing(3, F32, channel_group=4),
        SlidingSchedule(2), SlidingSchedule(2), needs_queries=True,
    )  # fmt: skip
    x, q = rand(1, 1, 6, 4, seed=10), rand(1, 2, 6, 4, seed=11)
    assert layer.awaiting_queries is False  # a bool before any prefill too
    layer.prefill(x, x, queries=q)
    assert layer.awaiting_queries is False and len(seen) == 1 and seen[0][0] == 2
    assert torch.equal(seen[0][1], x) and torch.equal(seen[0][2], q)
    assert layer.quantized_tokens() == (4, 4)


class _OddSchedule:
    """Asks for 3 tokens whenever the residual holds 3 or more."""

    def prefill_count(self, n: int) -> int:
        return 3 if n >= 3 else 0

    def flush_count(self, residual: int) -> int:
        return self.prefill_count(residual)


@pytest.mark.parametrize("group", [2, 3])
def test_flush_of_a_partial_token_group_is_refused(group) -> None:
    # a schedule must hand a per-channel codec whole groups of G tokens
    layer = LayerCache(PerChannelCodec(2, F32, group_size=group), None, _OddSchedule())
    x = rand(1, 1, 4, 4, seed=12)
    if group == 3:
        layer.prefill(x, x)
        assert layer.quantized_tokens() == (3, 0)
    else:
        with pytest.raises(
            RuntimeError, match="schedule asked to flush 3 tokens, not a multiple of 2"
        ):
            layer.prefill(x, x)
