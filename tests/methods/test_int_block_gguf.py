"""int4-block's default is llama.cpp's q4_0: checked against the ``gguf`` package's own ``Q4_0``
quantizer (ggml-org/llama.cpp gguf-py, a reimplementation of ``quantize_row_q4_0_ref``), which
is independent of kvbench's code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.methods.int_block import Int4Block

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402


def _kvbench_q4(method: Int4Block, x: np.ndarray) -> np.ndarray:
    """Dequantized keys of ``x [T, D]`` (one head) after a prefill."""
    k = torch.tensor(x, dtype=torch.float32).reshape(1, 1, *x.shape)
    layer = method.new_layer(0, 1, x.shape[-1])
    layer.prefill(k, k.clone())
    return layer.keys_values()[0].reshape(x.shape).numpy()


def _gguf_q4(x: np.ndarray) -> np.ndarray:
    q = gguf_quants.quantize(x.astype(np.float32), GGMLQuantizationType.Q4_0)
    return gguf_quants.dequantize(q, GGMLQuantizationType.Q4_0).reshape(x.shape)


def test_default_rule_is_llamacpp_and_equals_gguf_q4_0():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((256, 64)) * rng.uniform(0.05, 4.0, (256, 1))).astype(np.float32)
    assert Int4Block().config.q4_rule == "llamacpp"
    ours, ref = _kvbench_q4(Int4Block(), x), _gguf_q4(x)
    assert np.array_equal(ours, ref)  # bit-exact: same d, same codes
    # the absmax/7 alternative is a different (worse) quantizer: RMS error ~15% higher here
    alt = _kvbench_q4(Int4Block(q4_rule="absmax7"), x)
    err = lambda y: float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2)))  # noqa: E731
    assert not np.array_equal(alt, ref)
    assert 1.08 < err(alt) / err(ref) < 1.3
