"""Shared helpers of the core tests: independent float64 numpy references, and the switch
between the two quantizer paths of the affine codecs.

The references call no kvbench; they compute right values from the formulas of docs/methods.md#common-conventions
(min-max asymmetric quantization, round-half-to-even) so that tests compare the code under test
with an independent computation, never with its own output.

``affine_path``: an affine codec's ``encode`` returns the block of the native one-pass quantizer
(:mod:`kvbench.cache.native_quant`) where it builds and serves the input, and otherwise runs the
torch path (``quantize_groups`` + ``pack_bits``).  A test that uses the fixture runs once with
each, so both are checked against the same independent values (and mutation testing sees the
torch lines of ``encode``, which the native path would otherwise skip on this machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch


def np_minmax(x: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    """Min-max asymmetric quantization of the last axis of ``x`` in float64 (docs/methods.md#common-conventions).

    Returns ``codes`` (int64), ``scale`` and ``mn`` (``[..., 1]``), ``xhat`` and ``mse``.
    A zero-range group gets scale 0, codes 0 and ``xhat == mn`` (docs/methods.md#worked-example-5).
    """
    x = np.asarray(x, dtype=np.float64)
    qmax = 2**bits - 1
    mn = x.min(axis=-1, keepdims=True)
    mx = x.max(axis=-1, keepdims=True)
    scale = (mx - mn) / qmax
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.where(scale > 0, np.clip(np.round((x - mn) / safe), 0, qmax), 0).astype(np.int64)
    xhat = codes * scale + mn
    return {"codes": codes, "scale": scale, "mn": mn, "xhat": xhat, "mse": ((x - xhat) ** 2).mean()}


def per_channel_ref(x: np.ndarray, bits: int, group: int) -> dict[str, np.ndarray]:
    """KIVI per-channel quantization of ``x [B, H, T, D]``: groups of ``group`` tokens per
    channel (docs/methods.md#kivi).  Returns ``xhat`` and ``scale`` ``[B, H, T, D]`` (per element)."""
    b, h, t, d = x.shape
    g = np.asarray(x, dtype=np.float64).reshape(b, h, t // group, group, d).swapaxes(-1, -2)
    r = np_minmax(g, bits)
    xhat = r["xhat"].swapaxes(-1, -2).reshape(b, h, t, d)
    scale = np.broadcast_to(r["scale"], g.shape).swapaxes(-1, -2).reshape(b, h, t, d)
    codes = r["codes"].swapaxes(-1, -2).reshape(b, h, t, d)
    return {"xhat": xhat, "scale": scale, "codes": codes}


def per_token_ref(x: np.ndarray, bits: int, group: int) -> dict[str, np.ndarray]:
    """Per-token quantization of ``x [B, H, T, D]``: groups of ``group`` channels per token."""
    b, h, t, d = x.shape
    g = np.asarray(x, dtype=np.float64).reshape(b, h, t, d // group, group)
    r = np_minmax(g, bits)
    scale = np.broadcast_to(r["scale"], g.shape).reshape(b, h, t, d)
    return {
        "xhat": r["xhat"].reshape(b, h, t, d),
        "scale": scale,
        "codes": r["codes"].reshape(b, h, t, d),
    }


def storage_is_own(t: torch.Tensor) -> bool:
    """True when ``t`` does not keep a larger allocation alive (no hidden full-precision copy)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.fixture(params=["native", "torch"])
def affine_path(request, monkeypatch):
    """Run the test with the native quantizer (skipped where it does not build) and again with
    the torch path (the native build hidden, as ``KVBENCH_NATIVE=0`` does; the environment
    variable itself is read once per process, at the first load, so it cannot switch here)."""
    from kvbench.cache import native_quant

    if request.param == "torch":
        monkeypatch.setattr(native_quant, "_load", lambda: None)
    elif not native_quant.available():
        pytest.skip(f"native quantizer: {native_quant.unavailable_reason()}")
    return request.param


@pytest.fixture(scope="session")
def ref():
    """The reference helpers, as a namespace usable from hypothesis tests (session scope)."""

    class Ref:
        minmax = staticmethod(np_minmax)
        per_channel = staticmethod(per_channel_ref)
        per_token = staticmethod(per_token_ref)
        own = staticmethod(storage_is_own)

    return Ref


def np_block_bootstrap(windows, block, seed, n_boot=2000, stat=None, alpha=0.05):
    """Percentile block bootstrap of a token-level mean, float64 numpy with Python loops
    (Carlstein 1986; Efron & Tibshirani 1993, ch. 13), the seeding documented by
    ``kvbench.bench.metrics.block_bootstrap_ci``: a torch generator seeded ``seed``
    draws ``torch.randint(0, n_blocks, (n_boot, n_blocks))``; that draw is all it shares.

    ``windows``: per window, ``[N_w]`` or ``[N_w, K]`` values; blocks of ``block`` consecutive
    tokens inside each window (``None``: the window), the last one shorter.  Each resample
    concatenates its drawn blocks and takes the column means; ``stat(means)`` maps them to one
    number (default: column 0).  Returns ``(low, high)`` or ``None`` below two blocks."""
    blocks = []
    for w in windows:
        x = np.asarray(w, dtype=np.float64)
        x = x[:, None] if x.ndim == 1 else x
        step = len(x) if block is None else block
        start = 0
        while start < len(x):
            blocks.append(x[start : start + step])
            start += step
    if len(blocks) < 2:
        return None
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(blocks), (n_boot, len(blocks)), generator=g).numpy()
    stats = []
    for row in idx:
        means = np.concatenate([blocks[i] for i in row]).mean(axis=0)
        stats.append(means[0] if stat is None else stat(means))
    lo, hi = np.quantile(np.asarray(stats), [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


@pytest.fixture
def block_bootstrap_ref():
    """:func:`np_block_bootstrap`, the independent reference of the block bootstrap."""
    return np_block_bootstrap
