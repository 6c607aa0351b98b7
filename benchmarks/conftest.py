"""Benchmarks are not part of ``make test``; ``make bench-micro`` runs them.

Every benchmark runs at a pinned thread count (``KVBENCH_BENCH_THREADS``, default 1: on a shared
machine 2+ OpenMP threads spin at barriers and every sample becomes a multiple of the
scheduler's quantum), and the saved machine info records it with the load average
(``kvbench.measure.timer.system_state``)."""

from __future__ import annotations

import os

import pytest

from kvbench.measure.timer import pin_threads, system_state


def _threads() -> int:
    raw = os.environ.get("KVBENCH_BENCH_THREADS", "1")
    n = int(raw) if raw.strip().isdigit() else 0
    if n < 1:
        raise pytest.UsageError(f"KVBENCH_BENCH_THREADS={raw!r} must be a positive integer")
    return n


@pytest.fixture(autouse=True, scope="session")
def _pinned_threads():
    with pin_threads(_threads()):
        yield


def pytest_benchmark_update_machine_info(config, machine_info):
    with pin_threads(_threads()):
        machine_info["kvbench"] = system_state()
