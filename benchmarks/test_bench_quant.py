"""Microbenchmarks: quantize+pack and unpack+dequantize of 4096 tokens (32 pages of 128).

Run with ``make bench-micro`` (pytest-benchmark, ``--benchmark-autosave``; compare saved runs
with ``pytest-benchmark compare``).  Every method's key codec is timed beside a plain tensor
copy of the same data in the same run, so ratios to ``copy`` are the numbers to read.
Shape: the default model's ``[1, 3, 4096, 64]`` float32 (B, H_kv, T, D).  Every built-in
method has an operating point in each width group it can reach (:data:`OPERATING_POINTS`), so
none is skipped.
"""

from __future__ import annotations

import pytest
import torch

import kvbench

SHAPE = (1, 3, 4096, 64)
#: one operating point per nominal width for every built-in method with a key codec:
#: (method, config, width group).  Methods with a ``bits`` field take it; mixed-precision and
#: block methods take the class widths that put their nominal key bits nearest the group
#: (``Method.average_bits`` at D = 64, T = 4096, printed in the benchmark name); fixed-format
#: methods (int8/int4 blocks, fp8) sit in their own width.  kvquant (needs calibration) and
#: semkv (its selection needs attention scores) are left out: their codecs do not encode alone.
OPERATING_POINTS = [
    *[
        (n, dict(bits=b), f"{b}-bit")
        for n in ("uniform", "per-head", "per-channel")
        for b in (2, 4)
    ],
    *[
        (n, dict(bits=b), f"{b}-bit")
        for n in ("per-token", "kivi", "turboquant-mse")
        for b in (2, 4)
    ],
    ("kitty", dict(high_bits=4, low_bits=2), "2-bit"),
    ("kitty", dict(high_bits=8, low_bits=4), "4-bit"),
    ("pn-mix", dict(high_bits=3, low_bits=1), "2-bit"),
    ("pn-mix", dict(high_bits=5, low_bits=3), "4-bit"),
    ("chanmix", dict(), "2-bit"),
    ("chanmix", dict(retrieval_bits=6, outlier_bits=5, normal_bits=4, subnormal_bits=3), "4-bit"),
    ("polarquant", dict(radius_bits=2, angle_bits=2), "2-bit"),
    ("polarquant", dict(radius_bits=4, angle_bits=4), "4-bit"),
    ("pm-kvq", dict(), "2-bit"),
    ("qjl", dict(), "4-bit"),
    ("int4-block", dict(), "4-bit"),
    ("int8-block", dict(), "8-bit"),
    ("fp8", dict(), "8-bit"),
]


def _id(point) -> str:
    name, cfg, _ = point
    return name + "".join(f"-{k}{v}" for k, v in cfg.items())


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g)


def _codec(name: str, cfg: dict):
    method = kvbench.get_method(name, **cfg)
    codec = method.key_codec(0, SHAPE[-1])
    x = _data()
    q = torch.randn(SHAPE[0], SHAPE[1] * 3, SHAPE[2], SHAPE[3])
    codec.prepare(x, q)
    bits = method.average_bits(SHAPE[-1], SHAPE[2])["key_bits"]
    return codec, x, bits


def test_copy(benchmark) -> None:
    x = _data()
    benchmark.group = "reference"
    benchmark(lambda: x.clone())


@pytest.mark.parametrize("point", OPERATING_POINTS, ids=_id)
def test_quantize_pack(benchmark, point) -> None:
    name, cfg, group = point
    codec, x, bits = _codec(name, cfg)
    benchmark.group = f"quantize+pack {group}"
    benchmark.extra_info["key_bits"] = bits
    benchmark(codec.encode, x)


#: QJL keys are a sign sketch that attention reads as such (arXiv:2406.03482 §3): no dequantize
DEQUANTIZABLE = [p for p in OPERATING_POINTS if p[0] != "qjl"]


@pytest.mark.parametrize("point", DEQUANTIZABLE, ids=_id)
def test_unpack_dequantize(benchmark, point) -> None:
    name, cfg, group = point
    codec, x, bits = _codec(name, cfg)
    block = codec.encode(x)
    benchmark.group = f"unpack+dequantize {group}"
    benchmark.extra_info["key_bits"] = bits
    benchmark(block.dequantize, torch.float32)
