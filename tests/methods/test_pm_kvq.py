"""PM-KVQ (Liu et al., arXiv 2505.18610; docs/methods.md#pm-kvq): right values from docs/methods.md#worked-example-13, float64
numpy, hand traces of the budget and hand-solvable allocation instances."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import kvbench
from kvbench.cache.blocks import PerTokenCodec
from kvbench.methods.pm_kvq import (
    PMKVQ,
    BudgetTooShort,
    PMKVQConfig,
    allocate_bits,
    layer_sensitivity,
    pi_calibration_scales,
    shrink_block,
    shrink_codes,
)

# ---------------------------------------------------------------- equivalent right shift


def test_example13_shrink_codes():
    q4 = torch.arange(16)
    assert shrink_codes(q4, 4).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3]
    q8 = torch.tensor([0, 7, 8, 9, 24, 25, 26, 127, 128, 254, 255])
    assert shrink_codes(q8, 8).tolist() == [0, 0, 0, 1, 1, 1, 2, 7, 8, 15, 15]


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_every_code_equals_round_q_over_2c_plus_1(bits):
    c = bits // 2
    q = np.arange(2**bits)
    ratio = q / (2**c + 1)  # float64
    # no exact halves: 2q = (2k + 1)(2^c + 1) has no solution, as 2^c + 1 is odd
    assert np.all(np.abs(ratio - np.floor(ratio) - 0.5) > 1e-9)
    expect = np.round(ratio).astype(np.int64)
    got = shrink_codes(torch.from_numpy(q).to(torch.int32), bits)
    assert got.dtype == (torch.int64 if bits > 8 else torch.int32)
    assert np.array_equal(got.numpy(), expect)


@pytest.mark.parametrize("target", [8, 4, 2])
def test_shrink_to_width_stores_what_one_halving_at_a_time_stores(target):
    # the encode path halves 16 -> target with the codes unpacked between halvings; its stored
    # codes, scales and zeros must equal halving one step at a time, and the codes the shift
    # formula gives from the 16-bit codes directly (fp16 scales rounded after each halving)
    g = torch.Generator().manual_seed(target)
    x = (torch.randn(2, 3, 7, 16, generator=g) * 3).half()
    block = PerTokenCodec(16, torch.float16, channel_group=8).encode(x)
    step = block
    while step.bits > target:
        step = shrink_block(step)
    direct = shrink_block(block, target)
    assert direct.bits == step.bits == target
    for a, b in zip(direct.tensors(), step.tensors()):
        assert a[0] == b[0] and a[1].dtype == b[1].dtype and torch.equal(a[1], b[1])
    codes, b = block.unpacked_codes().long(), 16
    while b > target:  # round(q / (2^c + 1)), no ties (odd divisor), one halving at a time
        c = b // 2
        codes, b = torch.div(2 * codes + (1 << c) + 1, 2 * ((1 << c) + 1), rounding_mode="floor"), c
    assert torch.equal(direct.unpacked_codes().long(), codes)


def test_shrink_block_stays_within_half_new_scale():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 16, generator=g) * 3
    block = PerTokenCodec(16, torch.float32, channel_group=8).encode(x)
    rng = (x.reshape(2, 3, 5, 2, 8).amax(-1) - x.reshape(2, 3, 5, 2, 8).amin(-1)).double()
    old = block.dequantize(torch.float64)
    for c in (8, 4, 2):
        new_block = shrink_block(block)
        assert new_block.bits == c and torch.equal(new_block.zero, block.zero)
        # scale x (2^c + 1): from range / 65535 to range / (2^c - 1)
        ratio = new_block.scale.double() / block.scale.double()
        np.testing.assert_allclose(ratio.numpy(), 2**c + 1, rtol=1e-6)
        np.testing.assert_allclose(
            new_block.scale.double().numpy(), (rng / (2**c - 1)).numpy(), rtol=1e-5
        )
        new = new_block.dequantize(torch.float64)
        half = new_block.scale.double().repeat_interleave(8, dim=-1) / 2
        assert bool(((new - old).abs() <= half * (1 + 1e-5) + 1e-6).all())
        block, old = new_block, new
    assert block.codes.shape[-1] == 16 * 2 // 8  # packed 2-bit codes: 4 bytes per token


# ---------------------------------------------------------------- budget and bytes


def _trace(scope="codes", on_overflow="raise", steps=16, batch=1):
    """fp16 K/V [B, 1, 25, 8]; one 8-channel group per token, sinks 1, window R = 4, budget
    2 bits x 64 tokens: 2/8 * 2 * 1 * 8 * 64 = 256 bytes per sequence."""
    m = PMKVQ(
        residual_length=4,
        budget_bits=2,
        budget_tokens=64,
        channel_group_size=8,
        budget_scope=scope,
        on_overflow=on_overflow,
    )
    layer = m.new_layer(0, 1, 8)
    x = torch.randn(batch, 1, 25, 8, generator=torch.Generator().manual_seed(0)).half()
    layer.prefill(x[:, :, :9], x[:, :, :9])
    widths = [layer.bits]
    for t in range(9, 9 + steps):
        layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
        layer.end_step()
        widths.append(layer.bits)
    return layer, x, widths


def test_uniform_two_bit_budget_trace_and_bytes():
    # per side: main n*w/8*8 = n*w bytes, sink 16, window 16 per token; limit 128 per side.
    # prefill 9: sink 1 + main 8 at 16 bits = 144 > 128 -> 8 bits (80).  Decode: r=2 at step 6
    # gives 64+16+32 = 144 -> 4 bits; at step 15 main 20 at 4 bits + r=3: 144 -> 2 bits.
    layer, x, widths = _trace()
    assert widths == [8, 8, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2, 2]
    assert layer.quantized_tokens() == (24, 24)
    nb = layer.nbytes()
    # codes: 24 tokens x 8 ch x 2 bits = 48 B per side; scales: 24 x fp16 (scale, zero) = 96
    assert (nb["codes"], nb["scales"], nb["sinks"], nb["residual"]) == (96, 192, 32, 0)
    assert nb["total"] == 320 and layer.budget_used() == (128, 256)
    k, v = layer.keys_values()
    assert torch.equal(k[:, :, 0], x[:, :, 0]) and torch.equal(v[:, :, 0], x[:, :, 0])  # sink
    main = x[:, :, 1:25].float()
    rng = main.amax(-1, keepdim=True) - main.amin(-1, keepdim=True)
    # 2-bit step range/3, plus the 16-bit step and fp16 storage of scale and output
    assert bool(((k[:, :, 1:25].float() - main).abs() <= rng / 6 * 1.01 + 2e-3).all())


def test_budget_scope_all_shrinks_earlier_and_overflows():
    # with scales (4 B per token and side): prefill 128+32+16 -> 8 bits (112); step 2: r=2 gives
    # 64+32+16+32 = 144 -> 4 bits; step 6: 48+48+16+32 = 144 -> 2 bits (120); step 7: 136 > 128
    _, _, widths = _trace("all", "allow", steps=6)
    assert widths == [8, 8, 4, 4, 4, 4, 2]
    with pytest.raises(MemoryError, match="budget"):
        _trace("all", "raise", steps=7)
    layer, _, widths = _trace("all", "allow", steps=7)
    assert widths[-1] == 2 and layer.budget_used()[0] == 2 * 136 > layer.budget_used()[1]


def test_batch_scales_budget_and_reset_restores_width():
    layer, _, widths = _trace(batch=3)
    assert widths[-1] == 2 and layer.budget_used() == (3 * 128, 3 * 256)
    layer.reset()
    assert layer.bits == 16 and layer.seq_length == 0


def test_budget_below_what_two_bits_can_hold_raises_memory_error():
    m = PMKVQ(budget_bytes=100, residual_length=128)  # 3 tokens at D=64 fp32: 1024 B of window
    layer = m.new_layer(0, 1, 64)
    with pytest.raises(MemoryError):
        layer.prefill(torch.randn(1, 1, 3, 64), torch.randn(1, 1, 3, 64))


def test_per_layer_budget_list():
    m = PMKVQ(budget_bits=[16, 2], budget_tokens=64, residual_length=4, channel_group_size=8)
    widths = []
    for i in range(2):
        layer = m.new_layer(i, 1, 8)
        x = torch.randn(1, 1, 33, 8)  # fp32: sink 1 (32 B per side), main 32 tokens, window 0
        layer.prefill(x, x)
        widths.append(layer.bits)
    # layer 0: 16/8*2*8*64 = 2048 B >= 2*(32*16 + 32) = 1088; layer 1: 256 B, and 2*(32*w + 32)
    # is 1088, 576, 320 at w = 16, 8, 4 (all over) and 192 at w = 2
    assert widths == [16, 2]


def test_average_bits():
    ns = 1
    base = PMKVQ().average_bits(128, 32768)
    assert base["key_bits"] == pytest.approx((ns * 16 + 32768 * 2.25) / (32768 + ns))
    assert base["value_bits"] == base["key_bits"] and base["key_terms"]["b_eff"] == 2
    four = PMKVQ(budget_bits=4, num_sink_tokens=0).average_bits(128, 32768)
    assert four["key_bits"] == pytest.approx(4.25)
    assert PMKVQ(budget_bits=3.5).key_bit_terms(128)["b_eff"] == 2
    assert PMKVQ(budget_bits=(4, 2)).key_bit_terms(128)["b_eff"] == 3
    assert PMKVQ(budget_bits=16, init_bits=8).key_bit_terms(128)["b_eff"] == 8
    assert PMKVQ(scale_dtype="float32", num_sink_tokens=0).average_bits(64)["key_bits"] == 3.0
    with pytest.raises(ValueError, match="budget_bits"):
        PMKVQ(budget_bytes=1e6).average_bits()


def test_registry_and_config_roundtrip():
    m = kvbench.get_method("pm-kvq", budget_bits=[4, 2, 2])
    assert isinstance(m, PMKVQ) and m.config.budget_bits == (4, 2, 2)
    assert PMKVQConfig.from_dict(m.config.to_dict()) == m.config


@pytest.mark.parametrize(
    "cfg",
    [
        {"budget_bits": 1.5},
        {"budget_bits": [4, 1]},
        {"budget_bits": 4, "budget_bytes": 1000},
        {"budget_bytes": 0},
        {"budget_bytes": -5},
        {"budget_bits": "2"},
        {"init_bits": 3},
        {"init_bits": True},
        {"channel_group_size": 0},
        {"budget_scope": "scales"},
        {"on_overflow": "ignore"},
        {"scale_dtype": "int8"},
        {"budget_tokens": 0},
    ],
)
def test_bad_config(cfg):
    with pytest.raises(ValueError):
        PMKVQConfig(**cfg)


def test_bad_layer_inputs():
    with pytest.raises(ValueError, match="does not divide"):
        PMKVQ(channel_group_size=48).new_layer(0, 1, 64)
    with pytest.raises(ValueError, match="layer 2"):
        PMKVQ(budget_bits=[4, 2]).new_layer(2, 1, 64)
    with pytest.raises(ValueError, match="even"):
        shrink_codes(torch.arange(8), 3)


# ---------------------------------------------------------------- calibration helpers


def _enumerate(s, sizes, budget, choices):
    best = None
    for pick in itertools.product(range(len(choices)), repeat=len(sizes)):
        mem = sum(choices[j] * sizes[i] / 8 for i, j in enumerate(pick))
        obj = sum(s[i][j] for i, j in enumerate(pick))
        if mem <= budget and (best is None or obj < best[0]):
            best = (obj, tuple(choices[j] for j in pick))
    return best[1]


def test_allocate_bits_matches_enumeration():
    s = [[0.1, 0.9], [0.2, 0.5], [0.05, 0.3]]  # sensitivity at 4 and at 2 bits
    sizes = [100, 200, 100]
    # all at 2 bits: 25 + 50 + 25 = 100 B; 4 bits adds 25, 50, 25 B and saves 0.8, 0.3, 0.25.
    # 125 B: layer 0 only; 150 B: layers 0 and 2 (1.05) beat layer 1 (0.3)
    assert allocate_bits(s, sizes, 125) == (4, 2, 2) == _enumerate(s, sizes, 125, (4, 2))
    assert allocate_bits(s, sizes, 150) == (4, 2, 4) == _enumerate(s, sizes, 150, (4, 2))
    assert allocate_bits(s, sizes, 200) == (4, 4, 4)
    as_dict = {4: [r[0] for r in s], 2: [r[1] for r in s]}
    assert allocate_bits(as_dict, sizes, 125) == (4, 2, 2)
    s3 = [[0.0, 1.0, 5.0], [0.0, 0.2, 3.0], [0.0, 0.7, 0.8]]  # at 8, 4, 2 bits
    for budget in (100, 150, 175, 250, 400):
        got = allocate_bits(s3, sizes, budget, choices=(8, 4, 2))
        assert got == _enumerate(s3, sizes, budget, (8, 4, 2))
    assert allocate_bits(s3, sizes, 175, choices=(8, 4, 2)) == (4, 4, 2)


def test_allocate_bits_bad_input():
    with pytest.raises(ValueError, match="infeasible"):
        allocate_bits([[0.1, 0.2]], [100], 24)
    with pytest.raises(ValueError, match="shape"):
        allocate_bits([[0.1, 0.2, 0.3]], [100], 100)


def test_layer_sensitivity_taylor_hand_values():
    # one 4-channel group per token: [0, 0.4, 2, 3] at 2 bits (scale 1) -> codes 0, 0, 2, 3:
    # error -0.4 on one element -> mean |err * 1| = 0.1; at 4 bits scale 0.2 -> exact
    k = torch.tensor([0.0, 0.4, 2.0, 3.0]).reshape(1, 1, 1, 4)
    v = torch.tensor([0.0, 1.0, 2.0, 3.0]).reshape(1, 1, 1, 4)  # exact at 2 and 4 bits
    grad = torch.ones(1, 1, 1, 4)
    sens = layer_sensitivity(k, v, key_grad=grad, value_grad=2 * grad, scale_dtype="float32")
    assert sens[2] == pytest.approx(0.1, abs=1e-6) and sens[4] == pytest.approx(0.0, abs=1e-6)


def _np_attn(q, k, v):
    t, d = q.shape[-2], q.shape[-1]
    logits = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _np_fake(x, bits, cg):
    g = x.reshape(*x.shape[:-1], -1, cg)
    mn, mx = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    s = (mx - mn) / (2**bits - 1)
    return (np.round((g - mn) / s) * s + mn).reshape(x.shape)


def test_layer_sensitivity_attention_error_matches_numpy():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    sens = layer_sensitivity(k, v, q, channel_group_size=4, scale_dtype="float32")
    qn, kn, vn = (t.double().numpy() for t in (q, k, v))
    ref = _np_attn(qn, kn, vn)
    for b in (4, 2):
        out = _np_attn(qn, _np_fake(kn, b, 4), _np_fake(vn, b, 4))
        assert sens[b] == pytest.approx(((out - ref) ** 2).sum() / (ref**2).sum(), rel=1e-4)
    assert sens[2] > sens[4] > 0
    with pytest.raises(ValueError, match="queries"):
        layer_sensitivity(k, v)
    with pytest.raises(ValueError, match="divide"):
        layer_sensitivity(k, v, q, channel_group_size=3)


def test_pi_calibration_scales_hand_values():
    k = torch.tensor([[1.0, -3.0, 0.5, 2.0], [-2.0, 1.0, 4.0, 0.25]]).reshape(1, 1, 2, 4)
    # rotate-half pairs (0, 2), (1, 3): max |K| = 4, 3 -> sqrt = 2, 1.732051
    s = pi_calibration_scales(k)
    np.testing.assert_allclose(s.numpy(), [[2.0, math.sqrt(3)]], rtol=1e-6)
    # interleaved pairs (0, 1), (2, 3): max 3, 4; alpha = 1; a second tensor raises pair 0 to 5
    k2 = torch.zeros(1, 1, 1, 4)
    k2[..., 1] = -5.0
    s2 = pi_calibration_scales([k, k2], alpha=1.0, pairing="interleaved")
    np.testing.assert_allclose(s2.numpy(), [[5.0, 4.0]])
    assert float(pi_calibration_scales(torch.zeros(1, 1, 1, 2))[0, 0]) == pytest.approx(1e-4)
    with pytest.raises(ValueError):
        pi_calibration_scales(k, alpha=float("nan"))
    with pytest.raises(ValueError):
        pi_calibration_scales(torch.zeros(1, 1, 1, 3))


# ---------------------------------------------------------------- a budget shorter than the run


def _run(budget_bits, budget_tokens, tokens, on_overflow="raise"):
    """fp32 K/V [1, 1, tokens, 8]; sinks 1, window R = 4, one 8-channel group per token."""
    m = PMKVQ(
        residual_length=4,
        budget_bits=budget_bits,
        budget_tokens=budget_tokens,
        channel_group_size=8,
        on_overflow=on_overflow,
    )
    layer = m.new_layer(0, 1, 8)
    x = torch.randn(1, 1, tokens, 8, generator=torch.Generator().manual_seed(1))
    layer.prefill(x, x)
    return layer


def test_budget_bits_row_keeps_its_width_when_the_budget_covers_the_run():
    # prefill 64 tokens: sink 1, main 60, window 3 (flushed in whole windows of R = 4).  Counted
    # (codes + sink/window at 16 bits): 2 sides x (60 x 8 ch x 4/8 B + 4 tokens x 8 x 2 B) = 608 B
    # at 4 bits; the budget is 4/8 x 2 x 8 x T' = 8 T' B, so T' = 76 keeps 4 bits, 75 does not.
    # The message suggests the sufficient T + (16/4 - 1)(R + N_s) = 64 + 15 = 79.
    assert _run(4, 76, 64).bits == 4
    with pytest.raises(BudgetTooShort, match=r"budget_tokens >= 79"):
        _run(4, 75, 64)
    assert _run(4, 79, 64).bits == 4
    with pytest.raises(BudgetTooShort, match="ran out at 64 tokens"):
        _run(4, 64, 64)  # a budget sized for the run length itself is too short
    assert _run(4, 64, 64, on_overflow="allow").bits == 2  # allowed: shrinks (the old row)


def test_two_bit_budget_is_the_floor_and_never_too_short():
    # 2 bits is the last width: overflow there is the MemoryError of the original
    with pytest.raises(MemoryError):
        _run(2, 16, 64)
    assert not issubclass(MemoryError, ValueError)


@pytest.mark.parametrize(("tokens", "scope"), [(40, "codes"), (40, "all"), (200, "codes")])
def test_budget_halvings_at_once_store_what_one_halving_at_a_time_stores(tokens, scope):
    # the layer finds the width from the stored bytes and halves once to it; the blocks must be
    # those of halving both sides one step at a time and re-counting the bytes after each step
    m = PMKVQ(
        residual_length=4,
        budget_bits=2,
        budget_tokens=16,
        channel_group_size=8,
        budget_scope=scope,
        on_overflow="allow",
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, tokens, 16, generator=g).half()
    got = m.new_layer(0, 2, 16)
    got.prefill(x, x.flip(-1))
    ref = m.new_layer(0, 2, 16)
    budget, ref.budget = ref.budget, float("inf")
    ref.prefill(x, x.flip(-1))
    assert ref.bits == 16  # nothing shrunk yet
    ref.budget = budget
    steps = 0
    while (over := ref.budget_used())[0] > over[1] and ref.bits > 2:
        for side in (ref.k, ref.v):
            side.block = shrink_block(side.block)
            side.codec.bits //= 2
        steps += 1
    assert steps >= 2 and got.bits == ref.bits  # more than one halving at this prefill
    for a, b in ((got.k.block, ref.k.block), (got.v.block, ref.v.block)):
        assert a.bits == b.bits
        assert torch.equal(a.codes, b.codes)
        assert torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
    assert got.nbytes() == ref.nbytes() and got.budget_used() == ref.budget_used()
