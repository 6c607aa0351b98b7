"""The synthetic Q/K/V the workloads draw stay what they were, bit for bit: the memory workload's
``source: synthetic`` (``channel-gaussian``, :func:`kvbench.bench.synthetic_kv.channel_gaussian_qkv`,
formerly ``kvbench.bench.workloads.memory.synthetic_qkv``) and the fidelity workload's ``source:
synthetic`` (``Fidelity._synthetic``), each against a copy of the implementation records were
written with (the same arithmetic on both sides: ``torch.equal``).  The shape models'
``rope-outliers`` draw is checked against its own from-scratch reference in tests/test_shapes.py.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.bench.synthetic_kv import channel_gaussian_qkv
from kvbench.bench.workloads import WORKLOADS


def memory_synthetic_qkv_reference(num_layers, hq, hkv, t, d, seed):
    """kvbench.bench.workloads.memory.synthetic_qkv as records were written with."""
    out = []
    heads, chunk = 2 * hkv + hq, 256
    for i in range(num_layers):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        scale = torch.exp(0.75 * torch.randn(1, hkv, 1, d, generator=g))
        offset = torch.randn(1, hkv, 1, d, generator=g)
        parts = [
            torch.randn(
                1,
                heads,
                chunk,
                d,
                generator=torch.Generator().manual_seed((seed * 1000 + i) * 100003 + c),
            )
            for c in range(-(-t // chunk))
        ]
        x = torch.cat(parts, dim=2)[:, :, :t] if parts else torch.zeros(1, heads, 0, d)
        k = x[:, :hkv] * scale + offset
        v = 0.5 * x[:, hkv : 2 * hkv]
        q = x[:, 2 * hkv :]
        out.append((q.contiguous(), k.contiguous(), v.contiguous()))
    return out


def fidelity_synthetic_reference(s, seed, calibration=0):
    """kvbench.bench.workloads.fidelity.Fidelity._synthetic as records were written with:
    ``(queries, keys, values, calib_keys, calib_values)`` lists."""
    g = torch.Generator().manual_seed(seed)
    t, d, hkv = s["tokens"], s["head_dim"], s["num_kv_heads"]
    qs, ks, vs, chans = [], [], [], []
    for _ in range(s["num_layers"]):
        chan = torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]
        qs.append(torch.randn(1, s["num_heads"], t, d, generator=g))
        ks.append(torch.randn(1, hkv, t, d, generator=g) * chan)
        vs.append(torch.randn(1, hkv, t, d, generator=g))
        chans.append(chan)
    ck, cv = [], []
    if calibration:
        ck = [torch.randn(1, hkv, calibration, d, generator=g) * c for c in chans]
        cv = [torch.randn(1, hkv, calibration, d, generator=g) for _ in chans]
    return qs, ks, vs, ck, cv


def _wl(kind: str, **spec):
    cls = WORKLOADS.get(kind)
    return cls(cls.validate({"type": kind, "source": "synthetic", **spec}))


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize(
    "geometry", [(2, 9, 3, 300, 64, 0), (1, 4, 4, 256, 32, 7), (3, 8, 2, 5, 16, 12345)]
)
def test_channel_gaussian_is_the_memory_workloads_draw(geometry) -> None:
    got = channel_gaussian_qkv(*geometry)
    want = memory_synthetic_qkv_reference(*geometry)
    assert len(got) == len(want) == geometry[0]
    for g, w in zip(got, want):
        _same(g, w)


def test_memory_workload_prepares_and_calibrates_on_the_same_draw() -> None:
    from kvbench.bench.context import RunContext

    wl = _wl("memory", context=300, appends=2, num_layers=2, num_heads=4, num_kv_heads=2)
    wl.prepare(RunContext(seed=5))
    want = memory_synthetic_qkv_reference(2, 4, 2, 300, 64, 5)
    for got, ref in zip(wl.qkv, want):
        _same(got, ref)
    keys, values, _ = wl.calibration_kv(5, 40)
    longer = memory_synthetic_qkv_reference(2, 4, 2, 340, 64, 5)
    for i in range(2):
        assert torch.equal(keys[i], longer[i][1][:, :, 300:])
        assert torch.equal(values[i], longer[i][2][:, :, 300:])


@pytest.mark.parametrize("calibration", [0, 48])
def test_fidelity_workload_draw_is_unchanged(calibration) -> None:
    wl = _wl("fidelity", tokens=64, prefill=32, num_layers=2, num_heads=4, num_kv_heads=2)
    cap, info = wl._synthetic(3, calibration=calibration)
    qs, ks, vs, ck, cv = fidelity_synthetic_reference(wl.spec, 3, calibration)
    _same(cap.queries, qs)
    _same(cap.keys, ks)
    _same(cap.values, vs)
    if calibration:
        _same(cap.calib_keys, ck)
        _same(cap.calib_values, cv)
    assert info == {"kv_source": "synthetic", "seed": 3}
