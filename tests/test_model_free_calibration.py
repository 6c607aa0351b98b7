"""Model-free calibration (``Workload.calibration_kv``): methods with ``needs_calibration`` run
in ``model: none`` suites on synthetic K/V of the workload, disjoint from the measured tokens."""

from __future__ import annotations

import pytest
import torch

from kvbench.bench.synthetic_kv import channel_gaussian_qkv
from kvbench.bench.workloads import WORKLOADS


def _wl(kind: str, **spec):
    cls = WORKLOADS.get(kind)
    return cls(cls.validate({"type": kind, "source": "synthetic", **spec}))


def test_memory_calibration_is_the_positions_after_context() -> None:
    wl = _wl("memory", context=40, appends=2, num_layers=2, num_heads=4, num_kv_heads=2)
    keys, values, info = wl.calibration_kv(0, 24)
    full = channel_gaussian_qkv(2, 4, 2, 64, 64, 0)
    for i in range(2):
        assert keys[i].shape == (1, 2, 24, 64)
        assert torch.equal(keys[i], full[i][1][:, :, 40:])
        assert torch.equal(values[i], full[i][2][:, :, 40:])
    assert info["tokens"] == 24


def test_fidelity_calibration_leaves_measured_tensors_and_shares_channels() -> None:
    wl = _wl("fidelity", tokens=64, prefill=32, num_layers=2)
    plain, _ = wl._synthetic(0)
    with_cal, _ = wl._synthetic(0, calibration=48)
    for a, b in zip(plain.keys + plain.values, with_cal.keys + with_cal.values):
        assert torch.equal(a, b)
    keys, _, _ = wl.calibration_kv(0, 48)
    for i in range(2):
        assert keys[i].shape == (1, 2, 48, 64)
        assert not torch.equal(keys[i][:, :, :32], plain.keys[i][:, :, :32])
        # the same outlier channels: per-channel spread agrees within sampling noise
        ratio = keys[i].std(dim=(0, 1, 2)) / plain.keys[i].std(dim=(0, 1, 2))
        assert ratio.min() > 0.6 and ratio.max() < 1.6


def test_model_free_workload_without_synthetic_kv_refuses_calibration(tmp_path) -> None:
    from kvbench.bench.runner import run_suite
    from kvbench.bench.suite import load_suite

    path = tmp_path / "s.yaml"
    path.write_text(
        "name: t\nseed: 0\nthreads: 1\nmodel: none\nmethods: [kvquant]\n"
        "workloads:\n  - {type: memory, source: synthetic, context: 40, appends: 2,"
        " num_layers: 1, num_heads: 2, num_kv_heads: 1}\n  - {type: bits, head_dim: 64}\n"
    )
    recs = run_suite(load_suite(path), tmp_path / "out", quiet=True)
    mem = next(r for r in recs if r.workload_type == "memory")
    assert mem.manifest["calibration"]["tokens"] == 2048  # the suite's default
    assert "calibration" not in next(r for r in recs if r.workload_type == "bits").manifest
    with pytest.raises(ValueError, match="draws no synthetic calibration"):
        from kvbench.bench.context import RunContext
        from kvbench.bench.runner import calibrate_model_free

        wl = _wl("memory", context=40, appends=2)
        wl.spec["source"] = "model"
        run = type("R", (), {"method": type("M", (), {"name": "kvquant"})()})()
        calibrate_model_free(RunContext(model_spec=None, seed=0), wl, None, {"tokens": 8}, run)


def test_fidelity_layers_outside_the_model_are_refused_naming_the_field() -> None:
    """``layers`` beyond the captured model's layers fails in ``prepare`` (before any method
    runs) naming the field and the allowed indices; an empty list or a negative index is refused
    when the spec is validated."""
    from kvbench.bench.context import RunContext

    wl = _wl("fidelity", num_layers=2, layers=[0, 5, 9])
    with pytest.raises(ValueError, match=r"field 'layers': \[5, 9\] outside .* 0\.\.1 or 'all'"):
        wl.prepare(RunContext(seed=0))
    wl = _wl("fidelity", num_layers=2, layers=[1])
    wl.prepare(RunContext(seed=0))  # the last layer is inside
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="layers"):
            _wl("fidelity", num_layers=2, layers=bad)
