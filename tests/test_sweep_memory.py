"""Bounded memory over a sweep: every record carries its run's peak resident memory (reset per
run), and many runs in one process do not grow resident memory with their number."""

from __future__ import annotations

import sys

import pytest

from kvbench.run import memstat
from kvbench.run.runner import run_suite
from kvbench.run.suite import parse_suite

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc peak RSS")


@linux
def test_peak_is_per_run() -> None:
    import numpy as np

    assert memstat.reset_peak()
    big = np.ones(40 * 2**20 // 8)  # 40 MiB, touched
    big[::512] = 2.0
    held = memstat.peak(True)["peak_rss_bytes"]
    del big
    memstat.release()
    assert memstat.reset_peak()
    after = memstat.peak(True)["peak_rss_bytes"]
    assert held - after > 30 * 2**20  # the next run's peak no longer includes the 40 MiB


@linux
def test_many_runs_do_not_grow_resident_memory(tmp_path) -> None:
    # 4 layers x 3 KV heads x 4096 tokens x 64 channels x 4 B x (K, V) = 24 MiB of full-precision
    # cache per run: a leak of one run's cache would show as +24 MiB per run
    suite = parse_suite(
        {
            "name": "sweep",
            "model": "none",
            "threads": 1,
            "methods": [
                "full",
                {"name": "kivi", "config": {"bits": [2, 3, 4], "group_size": [32, 64]}},
                {"name": "per-token", "config": {"bits": [2, 3, 4, 8]}},
                "int4-block",
                "int8-block",
                "fp8",
            ],
            "workloads": [
                {
                    "type": "memory",
                    "source": "synthetic",
                    "context": 4096,
                    "appends": 2,
                    "num_layers": 4,
                    "num_heads": 9,
                    "num_kv_heads": 3,
                    "head_dim": 64,
                    "dtype": "float32",
                }
            ],
        },
        "sweep.yaml",
    )
    recs = run_suite(suite, tmp_path, quiet=True)
    assert len(recs) == 14
    peaks = [r["manifest"]["memory"]["peak_rss_bytes"] for r in recs]
    assert all(r["manifest"]["memory"]["rss_peak_scope"] == "run" for r in recs)
    first, last = max(peaks[:4]), max(peaks[-4:])
    assert last - first < 24 * 2**20, [p // 2**20 for p in peaks]
