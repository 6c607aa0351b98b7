"""The timing front door (kvbench.measure): statistics, ratios, interleaving order, the
flush split, on hand-made samples with answers worked out by hand.  No assertion reads real
wall-clock speed: the clock and the per-call timer are replaced by scripted ones."""

from __future__ import annotations

import pytest
import torch

from kvbench.measure import timer as timer_mod
from kvbench.measure.timer import (
    Timer,
    contiguous_read,
    interleave,
    percentile,
    pin_threads,
    ratios,
    rotation,
    summarize,
    system_state,
)
from kvbench.measure.window import flush_steps, split_steps


class Scripted(Timer):
    """Runs the call, returns the next scripted sample (ms) instead of reading a clock."""

    def __init__(self, samples):
        super().__init__("cpu")
        self.samples = list(samples)

    def __call__(self, fn):
        fn()
        return self.samples.pop(0)


def test_percentiles_by_the_stated_rule() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]  # sorted 1..5, h = 4 q / 100
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)  # h = 3.6: 4 + 0.6 * (5 - 4)
    assert percentile(xs, 99) == pytest.approx(4.96)  # h = 3.96
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)  # h = 0.25
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)
    with pytest.raises(ValueError, match="outside"):
        percentile(xs, 101)


def test_summary_and_ratios_by_hand() -> None:
    s = summarize([10.0, 40.0, 20.0, 30.0])
    assert (s.n, s.median, s.mean, s.min, s.max) == (4, 25.0, 25.0, 10.0, 40.0)
    assert s.p90 == pytest.approx(37.0)  # h = 2.7: 30 + 0.7 * 10
    assert s.p99 == pytest.approx(39.7)
    b = summarize([5.0, 5.0, 10.0, 10.0])  # median 7.5, mean 7.5, p90 10, p99 10
    r = ratios(s, b)
    assert r["median"] == pytest.approx(25 / 7.5) and r["mean"] == pytest.approx(25 / 7.5)
    assert r["p90"] == pytest.approx(3.7) and r["p99"] == pytest.approx(3.97)
    assert s.as_dict("x_")["x_median"] == 25.0
    with pytest.raises(ValueError):
        summarize([])


def test_rotation_order() -> None:
    assert [rotation("AB", i) for i in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert [rotation("ABC", i) for i in range(4)] == [
        ["A", "B", "C"],
        ["B", "C", "A"],
        ["C", "A", "B"],
        ["A", "B", "C"],
    ]


def test_interleave_order_warmup_and_samples() -> None:
    calls, seen = [], []
    fns = {n: (lambda n=n: calls.append(n)) for n in "ABC"}
    # timed rounds 2, 3 (after 2 warm-up rounds): orders C A B, then A B C
    t = Scripted([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    out = interleave(
        fns, rounds=2, warmup=2, timer=t, after=lambda n, i, ms: seen.append((n, i, ms))
    )
    assert calls == list("ABCBCACABABC")
    assert out == {"C": [1.0, 6.0], "A": [2.0, 4.0], "B": [3.0, 5.0]}
    assert seen[:3] == [("A", 0, None), ("B", 0, None), ("C", 0, None)]
    assert seen[6:9] == [("C", 2, 1.0), ("A", 2, 2.0), ("B", 2, 3.0)]
    with pytest.raises(ValueError, match="rounds >= 1"):
        interleave(fns, rounds=0)


def test_cpu_timer_reads_perf_counter_in_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([1_000_000, 3_500_000])  # ns
    monkeypatch.setattr(timer_mod.time, "perf_counter_ns", lambda: next(ticks))
    ran = []
    t = Timer("cpu")
    assert t(lambda: ran.append(1)) == 2.5 and ran == [1]
    assert t.how == "time.perf_counter_ns" and t.graph(len) is len  # no graphs on CPU


def test_contiguous_read_bandwidth_from_the_median() -> None:
    t = Scripted([2.0, 1.0, 4.0])  # the 2 warm-up calls are not timed
    r = contiguous_read(10, reps=3, warmup=2, timer=t)
    assert r["bytes"] == 12  # rounded up to 3 float32 elements
    assert r["median_ms"] == 2.0 and r["gbps"] == pytest.approx(12 / 2e-3 / 1e9)


def test_pin_threads_sets_and_restores() -> None:
    before = torch.get_num_threads()
    with pin_threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
        assert system_state()["threads"] == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads=0"):
        with pin_threads(0):
            pass


def test_flush_steps_are_where_held_bytes_fall() -> None:
    # before, then after each of 5 steps: the cache shrinks after steps 1 and 4
    assert flush_steps([10, 11, 5, 6, 7, 3]) == [1, 4]
    assert flush_steps([1, 2, 3]) == [] and flush_steps([4]) == []


def test_split_steady_flush_and_amortized_by_hand() -> None:
    ms = [1.0, 1.0, 10.0, 1.0, 2.0]
    s = split_steps(ms, [2], period=4)
    assert s.steady.n == 4 and s.steady.mean == 1.25 and s.steady.median == 1.0
    assert s.flush.mean == 10.0
    assert s.amortized_mean == pytest.approx(1.25 + (10 - 1.25) / 4)
    m = s.metrics()
    assert m["decode_ms_p50"] == 1.0 and m["flush_steps"] == 1 and m["flush_ms_max"] == 10.0
    # unknown period: the flush is spread over the window (5 steps, 1 flush)
    assert split_steps(ms, [2]).amortized_mean == pytest.approx(1.25 + 8.75 / 5)
    none = split_steps(ms, [])
    assert none.flush is None and none.amortized_mean == pytest.approx(3.0)
    assert "flush_ms_mean" not in none.metrics()
    with pytest.raises(ValueError, match="every timed step"):
        split_steps([1.0], [0])
    with pytest.raises(ValueError, match="out of range"):
        split_steps(ms, [5])


def test_a_failed_graph_capture_is_timed_eagerly_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call CUDA graphs cannot capture falls back to eager timing; ``how`` names the failure."""

    def no_stream(*_args: object) -> None:
        raise RuntimeError("operation not permitted\nwhen stream is capturing")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_args: None)
    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    t = Timer("cuda", cuda_graphs=True)
    fn = t.graph(len)
    assert fn is len and t.graph_failures == 1
    assert t.graph_errors == ["RuntimeError: operation not permitted when stream is capturing"]
    assert t.how == (
        "cuda events (synchronized), cuda graph replay (1 capture(s) failed: eager; first: "
        "RuntimeError: operation not permitted when stream is capturing)"
    )
