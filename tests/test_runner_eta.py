"""The sweep's ETA knows runs differ: the mean time of finished runs of the same workload entry,
else of the same type, else of any run; resumed runs cost nothing.  The nothing-quantized flag."""

from __future__ import annotations

from pathlib import Path

from kvbench.bench.runner import Eta, PlannedRun, quantized_flag
from kvbench.bench.suite import MethodSpec


def _run(wi: int, wtype: str, name: str = "kivi", config: dict | None = None) -> PlannedRun:
    spec = {"type": wtype, "i": wi}
    m = MethodSpec(name, config or {}, name)
    return PlannedRun(0, wi, None, spec, spec, m, f"{wi}-{name}-{id(spec)}", Path("x"))


def test_eta_by_workload_entry_then_type_then_any() -> None:
    fid = [_run(0, "fidelity") for _ in range(3)]
    gen = [_run(1, "generation") for _ in range(3)]
    lat = [_run(2, "latency")]
    gen2 = [_run(3, "generation")]
    eta = Eta([*fid, *gen, *lat, *gen2])
    assert eta.seconds() is None and eta.text() == ""
    eta.done(fid[0], 2.0)
    eta.done(fid[1], None)  # resumed: not a timing
    eta.done(gen[0], 100.0)
    # left: fid[2] (2 s), gen[1], gen[2] (100 s each), latency (any run: 51 s), gen2 (type: 100 s)
    assert eta.seconds() == 2.0 + 200.0 + 51.0 + 100.0
    assert eta.text() == "ETA ~0:05:53, "


def test_nothing_quantized_flag() -> None:
    run = _run(0, "fidelity", "kivi", {"group_size": 4096, "residual_length": 4096})
    flag = quantized_flag(run, {"quantized_key_fraction": 0.0, "nominal_key_bits": 2.0078})
    assert flag.startswith("nothing quantized") and "group_size=4096, residual_length=4096" in flag
    assert "only 10.0%" in quantized_flag(run, {"quantized_key_fraction": 0.1})
    assert quantized_flag(run, {"quantized_key_fraction": 0.5}) is None
    assert quantized_flag(_run(0, "fidelity", "full"), {"quantized_key_fraction": 0.0}) is None
    assert quantized_flag(run, {"quantized_key_fraction": 0.0, "nominal_key_bits": 16}) is None


def test_fidelity_measures_the_quantized_fraction() -> None:
    import torch

    from kvbench.bench.workloads.fidelity import layer_fidelity
    from kvbench.cache.registry import get_method

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 500, 64, generator=g) for _ in range(3))
    idle = get_method("kivi", group_size=4096, residual_length=4096)
    assert layer_fidelity(idle, 0, q, k, v, 256)["quantized_key_fraction"] == 0.0
    # G = R = 32: a block of R tokens is flushed when the residual fills, so 500 = 15 x 32 + 20
    # leaves the newest 20 in full precision
    busy = layer_fidelity(get_method("kivi", group_size=32, residual_length=32), 0, q, k, v, 256)
    assert busy["quantized_key_fraction"] == 480 / 500
