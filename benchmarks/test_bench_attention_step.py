"""Microbenchmark: one decode attention step at 4K context, KIVI 2-bit vs the full cache.

Run with ``make bench-micro`` (pytest-benchmark; read the ratios within the group
``attention step 4K``, all measured in one run).  Shape: one layer of the default model,
``[1, 3, 4096, 64]`` K/V (B, H_kv, T, D) float32 and 9 query heads (GQA 3) with one query
token.  KIVI: 2-bit keys per channel in pages of G = 128, 2-bit values per token in groups of
64 channels, R = 128, float16 scales (keys: 4096 quantized; values: 3968 quantized + 128 in the
residual, docs/methods.md#kivi).

Timed, each checked first against a float64 reference of the same cache contents:

* ``full-attend``: kvbench's ``full`` ``LayerCache.attend`` (reference attention over the
  stored K/V, no dequantization);
* ``full-sdpa``: ``scaled_dot_product_attention`` over the stored K/V (what transformers runs
  with a ``DynamicCache``);
* ``kivi-attend``: KIVI's ``LayerCache.attend`` (its fast path where one fits,
  :mod:`kvbench.kernels.cpu.codedomain`; else dequantize the whole cache, then attention);
* ``kivi-read+sdpa``: ``keys_values()`` then sdpa (what the model runs on the fidelity path);
* ``kivi-read``: ``keys_values()`` alone (the dequantization share of the step).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import kvbench

B, HKV, T, D, REP = 1, 3, 4096, 64, 3
KIVI2 = dict(bits=2, value_bits=2, group_size=128, residual_length=128, value_group_size=64)


@functools.cache
def _setup():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, HKV, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g)
    q = torch.randn(B, HKV * REP, 1, D, generator=g)
    caches = {}
    for name, cfg in (("full", {}), ("kivi", KIVI2)):
        lc = kvbench.get_method(name, **cfg).new_layer(0, HKV, D)
        lc.prefill(k, v)
        caches[name] = lc
    return caches, q


def _reference(lc, q: torch.Tensor) -> torch.Tensor:
    k, v = lc.keys_values(torch.float64)
    kr, vr = k.repeat_interleave(REP, 1), v.repeat_interleave(REP, 1)
    p = torch.softmax(q.double() @ kr.transpose(-1, -2) / math.sqrt(D), -1)
    return p @ vr


def _sdpa(lc, q: torch.Tensor) -> torch.Tensor:
    k, v = lc.keys_values()
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


CASES = {
    "full-attend": ("full", lambda lc, q: lc.attend(q)),
    "full-sdpa": ("full", _sdpa),
    "kivi-attend": ("kivi", lambda lc, q: lc.attend(q)),
    "kivi-read+sdpa": ("kivi", _sdpa),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_step(benchmark, case: str) -> None:
    caches, q = _setup()
    name, fn = CASES[case]
    lc = caches[name]
    out, ref = fn(lc, q), _reference(lc, q)
    err = (out.double() - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), err  # float32 sums of 4096 terms
    benchmark.group = "attention step 4K"
    benchmark(fn, lc, q)


def test_kivi_read(benchmark) -> None:
    caches, _ = _setup()
    lc = caches["kivi"]
    k, _ = lc.keys_values()
    assert k.shape == (B, HKV, T, D)
    benchmark.group = "attention step 4K"
    benchmark(lc.keys_values)
