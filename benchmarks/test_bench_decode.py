"""Microbenchmarks: one decode step's attention over a 4K-token KIVI cache of one layer.

Run with ``make bench-micro`` (pytest-benchmark).  Shape: the default model's layer,
``[1, 3, 4096, 64]`` K/V (B, H_kv, T, D) float32, 9 query heads (GQA 3), KIVI 2-bit keys per
channel in pages of G = 128, 2-bit values per token in groups of 64 channels, R = 128, float16
scales.  Every timed function is first checked against the float64 reference within the
float32 accumulation bound of :func:`_check`.

Groups (read the ratios within a group, all in one run):

* ``attend``: the whole ``LayerCache.attend`` step: the reference path (dequantize the cache +
  softmax), the eager and native code-domain paths (:mod:`kvbench.kernels.cpu.codedomain`,
  :mod:`kvbench.kernels.cpu.native`);
* ``keys``: the key logits of the 32 quantized pages, by the candidate kernels
  measure: dequantize + matmul (what the reference does), ``unpack_bits`` + matmul with the
  scale folded into the query (eager fast path), (b) a 256-entry lookup table of the 4 codes of
  a byte + matmul, (c) per-page partial sums: a query-side table of the partial dot product
  of each byte value per page, then gathers only, and the native C kernel
  (:func:`kvbench.kernels.cpu.native.keys_rows`, what ``auto`` mode runs where it is built);
* ``values``: the attention-weighted value sum over 3968 per-token quantized values:
  dequantize + matmul, eager code domain, native.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import kvbench
from kvbench.cache.quant import unpack_bits
from kvbench.kernels.cpu import affine, codedomain, native

B, HKV, T, D, REP = 1, 3, 4096, 64, 3


@functools.cache
def _cache():
    m = kvbench.get_method(
        "kivi", bits=2, value_bits=2, group_size=128, residual_length=128, value_group_size=64
    )
    lc = m.new_layer(0, HKV, D)
    g = torch.Generator().manual_seed(0)
    lc.prefill(torch.randn(B, HKV, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g))
    q = torch.randn(B, HKV * REP, 1, D, generator=g)
    k, v = lc.keys_values(torch.float64)
    kr, vr = k.repeat_interleave(REP, 1), v.repeat_interleave(REP, 1)
    p = torch.softmax(q.double() @ kr.transpose(-1, -2) / math.sqrt(D), -1)
    return lc, q, p @ vr


U32 = 2.0**-24  # unit roundoff of float32


def _check(out: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor, n: int) -> None:
    """Float32 accumulation bound, elementwise: ``|out - ref| <= 4 sqrt(n) u sum|terms|`` for
    outputs that sum ``n`` terms whose absolute values sum to ``abs_sum`` (the probabilistic
    rounding-error bound, Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
    §3.1 and §2.8; factor 4 for the rescaling and scale folding of the code-domain paths).  A
    wrong code, scale or offset misses it by orders of magnitude."""
    err = (out.double() - ref.double()).abs()
    tol = 4 * math.sqrt(n) * U32 * abs_sum.double()
    assert bool((err <= tol).all()), (err.max().item(), (err / tol).max().item())


def _attend_scale(lc, q: torch.Tensor) -> torch.Tensor:
    """``P @ |V|`` in float64: the absolute sum of the value terms of each output."""
    k, v = lc.keys_values(torch.float64)
    kr, vr = k.repeat_interleave(REP, 1), v.repeat_interleave(REP, 1)
    p = torch.softmax(q.double() @ kr.transpose(-1, -2) / math.sqrt(D), -1)
    return p @ vr.abs()


@pytest.mark.parametrize("mode", ["reference", "eager", "native"])
def test_attend(benchmark, mode):
    lc, q, ref = _cache()
    benchmark.group = "attend [1,3,4096,64] 2-bit"
    with codedomain.cpu_attention_mode(mode):
        _check(lc.attend(q), ref, _attend_scale(lc, q), T + D)  # logits (D), value sum (T)
        benchmark(lc.attend, q)


# ---------------------------------------------------------------------------- key candidates
def _key_inputs():
    lc, q, _ = _cache()
    blk = lc.k.block
    a, b = affine.affine_terms(blk)
    qr = (q.float() / math.sqrt(D)).reshape(B, HKV, REP, D)
    pk = blk.codes.reshape(B, HKV, T // 128, 128, -1)
    return blk, pk, qr, a, b


def keys_dequantize(blk, pk, q, a, b):
    return torch.matmul(q, blk.dequantize(torch.float32).transpose(-1, -2))


def keys_unpack_matmul(blk, pk, q, a, b):
    return affine.key_pages_eager(pk, q, a, b, 2)


_LUT = ((torch.arange(256, dtype=torch.uint8).unsqueeze(-1) >> torch.arange(0, 8, 2, dtype=torch.uint8)) & 3).float()  # fmt: skip


def keys_lut_matmul(blk, pk, q, a, b):
    c = torch.nn.functional.embedding(pk.long(), _LUT).flatten(-2)  # [B, H, NP, L, D]
    qs = q.unsqueeze(2) * a.unsqueeze(3)  # [B, H, NP, M, D]
    lg = torch.matmul(qs, c.transpose(-1, -2)) + (q.unsqueeze(2) * b.unsqueeze(3)).sum(-1, True)
    return lg.permute(0, 1, 3, 2, 4).flatten(-2)


def keys_page_tables(blk, pk, q, a, b):
    bsz, h, npg, length, nb = pk.shape
    qs = (q.unsqueeze(2) * a.unsqueeze(3)).reshape(bsz, h, npg, REP, nb, 4)
    tab = qs @ _LUT.t()  # [B, H, NP, M, W, 256]: partial dot product of each byte value
    idx = pk.long().unsqueeze(3).expand(bsz, h, npg, REP, length, nb).transpose(-1, -2)
    lg = tab.gather(-1, idx).sum(-2)  # [B, H, NP, M, L]
    lg = lg + (q.unsqueeze(2) * b.unsqueeze(3)).sum(-1, True)
    return lg.permute(0, 1, 3, 2, 4).flatten(-2)


def _need_native():
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")


def keys_native(blk, pk, q, a, b):
    _need_native()
    return native.keys_rows(
        blk.codes, q, affine._per_channel(a, D), affine._per_channel(b, D), 128, 2
    )


@pytest.mark.parametrize(
    "fn",
    [
        keys_dequantize,
        keys_unpack_matmul,
        keys_lut_matmul,
        keys_page_tables,
        keys_native,
    ],
    ids=lambda f: f.__name__,
)
def test_keys(benchmark, fn):
    args = _key_inputs()
    benchmark.group = "key logits, 4096 tokens 2-bit"
    ref = keys_dequantize(*args)
    blk, _, q, _, _ = args
    abs_sum = q.double().abs() @ blk.dequantize(torch.float64).abs().transpose(-1, -2)
    _check(fn(*args), ref, abs_sum, D)
    benchmark(fn, *args)


# ---------------------------------------------------------------------------- values
def _value_inputs():
    lc, q, _ = _cache()
    blk = lc.v.block
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(B, HKV, REP, blk.ntokens, generator=g), -1)
    return blk, p


def values_dequantize(blk, p):
    return torch.matmul(p, blk.dequantize(torch.float32))


def values_eager(blk, p):
    a, b = affine.affine_terms(blk)
    return affine.value_tokens_eager(blk.codes, p, a, b, 2, D)


def values_native(blk, p):
    _need_native()
    a, b = affine.affine_terms(blk)
    return native.values_groups(blk.codes, p, a, b, 2, D)


@pytest.mark.parametrize(
    "fn",
    [values_dequantize, values_eager, values_native],
    ids=lambda f: f.__name__,
)
def test_values(benchmark, fn):
    args = _value_inputs()
    benchmark.group = "value sum, 3968 tokens 2-bit"
    blk, p = args
    abs_sum = p.double() @ blk.dequantize(torch.float64).abs()
    _check(fn(*args), values_dequantize(*args), abs_sum, blk.ntokens)
    benchmark(fn, *args)


def test_unpack_reference(benchmark):
    """The unpack alone (``kvbench.cache.quant.unpack_bits`` to float) of the 4096 key tokens."""
    blk = _cache()[0].k.block
    benchmark.group = "key logits, 4096 tokens 2-bit"
    benchmark(lambda: unpack_bits(blk.codes, 2, D).float())
