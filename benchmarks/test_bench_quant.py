"""Microbenchmarks: quantize+pack and unpack+dequantize of 4096 tokens (32 pages of 128).

Run with ``make bench-micro`` (pytest-benchmark, ``--benchmark-autosave``; compare saved runs
with ``pytest-benchmark compare``).  Every method's key codec is timed beside a plain tensor
copy of the same data in the same run, so ratios to ``copy`` are the numbers to read.
Shape: the default model's ``[1, 3, 4096, 64]`` float32 (B, H_kv, T, D).
"""

from __future__ import annotations

import pytest
import torch

import kvbench

SHAPE = (1, 3, 4096, 64)
METHODS = [
    "uniform",
    "per-head",
    "per-channel",
    "per-token",
    "kivi",
    "kitty",
    "pn-mix",
    "chanmix",
    "polarquant",
    "int8-block",
    "int4-block",
    "turboquant-mse",
]


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g)


def _codec(name: str, bits: int):
    try:
        method = kvbench.get_method(name, bits=bits)
    except Exception as exc:  # noqa: BLE001 - methods with other knobs are skipped, said why
        pytest.skip(f"{name} at bits={bits}: {exc}")
    codec = method.key_codec(0, SHAPE[-1])
    x = _data()
    q = torch.randn(SHAPE[0], SHAPE[1] * 3, SHAPE[2], SHAPE[3])
    codec.prepare(x, q)
    return codec, x


def test_copy(benchmark) -> None:
    x = _data()
    benchmark.group = "reference"
    benchmark(lambda: x.clone())


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("name", METHODS)
def test_quantize_pack(benchmark, name: str, bits: int) -> None:
    codec, x = _codec(name, bits)
    benchmark.group = f"quantize+pack {bits}-bit"
    benchmark(codec.encode, x)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("name", METHODS)
def test_unpack_dequantize(benchmark, name: str, bits: int) -> None:
    codec, x = _codec(name, bits)
    block = codec.encode(x)
    benchmark.group = f"unpack+dequantize {bits}-bit"
    benchmark(block.dequantize, torch.float32)
