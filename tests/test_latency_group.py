"""The latency workload's ``group``: configurations timed in one interleaved run against one
baseline (docs/design.md#latency).

Right values: the number of one-token forwards per cache from the protocol (each round steps
every cache of the group once, the baseline once); each record's ratio recomputed in float64
from its own recorded per-round steps and the baseline's; scripted step times (the workload's
timer replaced) whose pairing with caches follows the documented rotation.  A tiny random
Llama (2 layers) runs every test; no assertion reads real wall-clock speed.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from test_latency_workload import tiny_model

import kvbench
import kvbench.bench.workloads.latency as lat
from kvbench.bench.context import RunContext
from kvbench.bench.runner import run_suite
from kvbench.bench.suite import parse_suite
from kvbench.bench.workloads import PendingRun
from kvbench.bench.workloads.latency import Latency
from kvbench.cache.method import Method
from kvbench.measure.timer import rotation

pytestmark = pytest.mark.usefixtures("one_thread")

KIVI8 = dict(bits=2, value_bits=2, group_size=8, residual_length=8)
ONE = ["model"]  # one baseline candidate: no pre-pass
W, N = 2, 4  # warm-up and timed rounds of every test here


def _prepared(model, **params) -> tuple[Latency, RunContext]:
    """A ``prefill: shared`` workload at 40 tokens (``W`` + ``N`` rounds), prepared."""
    spec = dict(
        context=40,
        steps=N,
        warmup=W,
        prefill_repeats=1,
        prefill="shared",
        baseline_storage_dtypes=ONE,
    )
    w = Latency(Latency.validate({"type": "latency", **(spec | params)}))
    ctx = RunContext(model=model, model_info={"max_position_embeddings": 256}, seed=0)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ctx.shared.token_ids[("latency-ids", "essays", 0, 40, 1)] = (ids, {})
    w.prepare(ctx)
    return w, ctx


def _methods() -> dict[str, Method]:
    return {
        "kivi K2V2": kvbench.get_method("kivi", **KIVI8),
        "int8-block": kvbench.get_method("int8-block", block_size=16),
        "full": kvbench.get_method("full"),
    }


def _pending(methods: dict[str, Method]) -> list[PendingRun]:
    return [PendingRun(label, lambda m=m: m) for label, m in methods.items()]


def _count_steps(model) -> list[object]:
    """The cache of every one-token forward of ``model``, in call order."""
    caches: list[object] = []

    def hook(mod, args, kw):
        if kw["input_ids"].shape[1] == 1:
            caches.append(kw.get("cache", kw.get("past_key_values")))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return caches


def test_a_group_steps_the_baseline_once_per_round() -> None:
    """group 3 over 3 methods: one run of 4 caches (3 methods + the baseline), each stepped
    once a round for ``W + N`` rounds (no second baseline, no re-timing per record); every
    record pairs its steps with the same baseline steps and names the two it was timed with."""
    model = tiny_model()
    steps = _count_steps(model)
    w, ctx = _prepared(model, group=3)
    methods = _methods()
    w.plan(_pending(methods))
    res = {label: w.run(ctx, m) for label, m in methods.items()}
    assert len(steps) == 4 * (W + N)
    per_cache: dict[int, int] = {}
    for c in steps:
        per_cache[id(c)] = per_cache.get(id(c), 0) + 1
    assert sorted(per_cache.values()) == [W + N] * 4
    for r in range(W + N):  # each round steps every cache once
        assert len({id(c) for c in steps[4 * r : 4 * r + 4]}) == 4
    base = [r.per_layer["baseline_decode_ms"] for r in res.values()]
    assert base[0] == base[1] == base[2] and len(base[0]) == N
    for label, r in res.items():
        assert r.info["group_size"] == 3
        assert r.info["timed_with"] == [other for other in methods if other != label]
        assert "kivi K2V2, int8-block, full, baseline rotated left by i" in r.info["interleaving"]
        assert "steps the baseline once" in r.info["interleaving"]
        assert len(r.per_layer["decode_ms"]) == N
    assert w.groups[0].timed is None  # every member collected: the group let go of its caches


def test_group_1_times_each_configuration_alone_with_todays_fields() -> None:
    """``group: 1`` (the default): each run interleaves its own cache with a baseline of its
    own, 2 x (W + N) steps a record, and the record has no group fields."""
    model = tiny_model()
    steps = _count_steps(model)
    w, ctx = _prepared(model)
    assert w.spec["group"] == 1
    methods = _methods()
    w.plan(_pending(methods))
    for i, m in enumerate(methods.values()):
        res = w.run(ctx, m)
        assert len(steps) == 2 * (W + N) * (i + 1)
        assert "group_size" not in res.info and "timed_with" not in res.info
        assert res.info["interleaving"] == (
            "round i starts at configuration i mod 2 (method, baseline rotated left by i)"
        )


def test_a_method_outside_the_plan_is_timed_alone() -> None:
    """A run of a configuration the plan does not hold (another executor, a rerun) times it
    with its own baseline, as ``group: 1``."""
    model = tiny_model()
    steps = _count_steps(model)
    w, ctx = _prepared(model, group=3)
    w.plan(_pending(_methods()))
    res = w.run(ctx, kvbench.get_method("fp8"))
    assert len(steps) == 2 * (W + N) and "group_size" not in res.info


class ScriptedTimer:
    """Replaces the workload's timer: runs each call, returns the next scripted ms."""

    samples: list[float] = []

    def __init__(self, device) -> None:
        self.how = "scripted"

    def __call__(self, fn):
        fn()
        return ScriptedTimer.samples.pop(0)


def test_each_ratio_pairs_its_own_steps_with_the_same_rounds_baseline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scripted steps: in timed round i the baseline takes ``1 + i`` ms and configuration j
    ``(j + 2) (1 + i) + 0.01 j``, the calls in the documented rotation of (m0, m1, m2,
    baseline).  Each record holds its own steps and the baseline's of the same rounds, and its
    ratio is the float64 ratio of the steady medians recomputed from those."""
    names = ["m0", "m1", "m2", "baseline"]

    def ms(name: str, i: int) -> float:
        if name == "baseline":
            return 1.0 + i
        j = int(name[1])
        return (j + 2) * (1.0 + i) + 0.01 * j

    seq = []
    for r in range(W, W + N):
        seq += [ms(name, r - W) for name in rotation(names, r)]
    ScriptedTimer.samples = seq
    monkeypatch.setattr(lat, "Timer", ScriptedTimer)
    w, ctx = _prepared(tiny_model(), group=3)
    methods = _methods()
    w.plan(_pending(methods))
    res = [w.run(ctx, m) for m in methods.values()]
    assert ScriptedTimer.samples == []
    for j, r in enumerate(res):
        mine, base = r.per_layer["decode_ms"], r.per_layer["baseline_decode_ms"]
        assert mine == [ms(f"m{j}", i) for i in range(N)]
        assert base == [ms("baseline", i) for i in range(N)]
        own = [float(x) for k, x in enumerate(mine) if k not in r.info["flush_index"]]
        ref = [float(x) for k, x in enumerate(base) if k not in r.info["baseline_flush_index"]]
        expected = statistics.median(own) / statistics.median(ref)
        assert r.metrics["decode_ms_p50_ratio"] == pytest.approx(expected, rel=1e-12)
        lo, hi = r.metrics["decode_ms_p50_ratio_ci_low"], r.metrics["decode_ms_p50_ratio_ci_high"]
        assert lo <= r.metrics["decode_ms_p50_ratio"] <= hi


def test_a_failing_method_does_not_stop_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration whose cache is refused (here: when it is built) is left out of the
    group's run; the others are timed together (group of 2) and the failing one's own run,
    timed alone, raises its own error."""
    methods = _methods()
    bad = methods["int8-block"]
    real = lat.make_hf_cache

    def refusing(method, model, **kw):
        if method is bad:
            raise ValueError("int8-block refused at prefill")
        return real(method, model, **kw)

    monkeypatch.setattr(lat, "make_hf_cache", refusing)
    model = tiny_model()
    steps = _count_steps(model)
    w, ctx = _prepared(model, group=3)
    w.plan(_pending(methods))
    first = w.run(ctx, methods["kivi K2V2"])
    assert len(steps) == 3 * (W + N)  # two configurations and the baseline
    assert first.info["group_size"] == 2 and first.info["timed_with"] == ["full"]
    with pytest.raises(ValueError, match="int8-block refused at prefill"):
        w.run(ctx, bad)
    last = w.run(ctx, methods["full"])
    assert last.info["timed_with"] == ["kivi K2V2"]
    assert last.per_layer["baseline_decode_ms"] == first.per_layer["baseline_decode_ms"]
    assert len(steps) == 3 * (W + N)  # the failing run stepped nothing


def test_a_method_that_cannot_be_built_does_not_stop_its_group() -> None:
    """``PendingRun.method()`` raising (a calibration or config error): left out of the group."""
    model = tiny_model()
    w, ctx = _prepared(model, group=3)
    methods = _methods()

    def broken() -> Method:
        raise ValueError("cannot build")

    pending = _pending(methods)
    w.plan([pending[0], PendingRun("broken", broken), pending[2]])
    res = w.run(ctx, methods["kivi K2V2"])
    assert res.info["timed_with"] == ["full"]


@pytest.mark.parametrize("value", [0, -1, 1.5, "3", True, None])
def test_bad_group_is_refused_naming_the_field(value) -> None:
    with pytest.raises(ValueError, match="field 'group'"):
        Latency.validate({"type": "latency", "group": value})


def test_runner_plans_the_pending_runs(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner hands the workload its runs still to compute (a finished record's run left
    out), before the first run, each with the method object ``run`` then receives."""
    from kvbench.bench.workloads import Result

    planned: list[list[PendingRun]] = []
    ran: list[Method] = []

    def fake_run(self, ctx, method):
        ran.append(method)
        return Result({"decode_ms_p50": 1.0})

    monkeypatch.setattr(Latency, "plan", lambda self, pending: planned.append(pending))
    monkeypatch.setattr(Latency, "run", fake_run)
    monkeypatch.setattr(Latency, "prepare", lambda self, ctx: None)
    monkeypatch.setattr(Latency, "needs_model", False)

    def suite(methods: list) -> object:
        return parse_suite(
            {"model": "none", "methods": methods, "workloads": [{"type": "latency", "context": 64}]}
        )

    run_suite(suite(["full", "kivi"]), tmp_path, quiet=True)
    assert [[p.label for p in plan] for plan in planned] == [["full", "kivi"]]
    assert [p.method() for p in planned[0]] == ran and ran[0] is planned[0][0].method()
    planned.clear()
    ran.clear()
    run_suite(suite(["full", "kivi", "fp8"]), tmp_path, quiet=True)
    assert [[p.label for p in plan] for plan in planned] == [["fp8"]]
    assert ran == [planned[0][0].method()] and ran[0] is planned[0][0].method()
