"""Bounded memory over a sweep: every record carries its run's peak resident memory (reset per
run), and many runs in one process do not grow resident memory with their number."""

from __future__ import annotations

import sys

import pytest

from kvbench.bench.runner import run_suite
from kvbench.bench.suite import parse_suite
from kvbench.measure import memstat

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
def test_many_runs_do_not_grow_resident_memory(tmp_path, monkeypatch) -> None:
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
    after: list[int] = []  # resident memory after each run's release

    def release() -> None:
        real()
        after.append(memstat.rss_bytes())

    real = memstat.release
    monkeypatch.setattr(memstat, "release", release)
    recs = run_suite(suite, tmp_path, quiet=True)
    assert len(recs) == 14
    assert all(r.manifest["memory"]["rss_peak_scope"] == "run" for r in recs)
    # the first runs warm up (imports, allocator pools); from run 5 on, resident memory after a
    # run moves only by allocator noise: the growth from run 5 to the last must stay below one
    # run's cache plus twice the largest step seen between consecutive warmed-up runs (a leak of
    # one cache per run would add 9 x 24 MiB)
    runs = after[:14]
    steps = [abs(b - a) for a, b in zip(runs[4:], runs[5:])]
    mib = [r // 2**20 for r in runs]
    assert runs[-1] - runs[4] < 24 * 2**20 + 2 * max(steps), mib
    peaks = [r.manifest["memory"]["peak_rss_bytes"] for r in recs]
    assert max(peaks[-4:]) - max(peaks[4:8]) < 24 * 2**20, [p // 2**20 for p in peaks]


@pytest.mark.parametrize("name", ["full", "kivi", "per-token", "hf-dynamic"])
def test_a_dropped_cache_is_freed_without_the_cyclic_collector(name: str) -> None:
    """A cache used by a model forward is freed as soon as its last reference goes: no
    reference cycle keeps its K/V alive until Python's cyclic collector happens to run (the
    latency workload drops 2 x prefill_repeats caches per run; a cycle per cache piled them up
    over a sweep)."""
    import gc
    import weakref

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.cache.registry import get_method
    from kvbench.hf.attention import use_kvbench_attention
    from kvbench.hf.cache import cache_kwarg, make_hf_cache

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=64,
        max_position_embeddings=128,
    )
    model = use_kvbench_attention(LlamaForCausalLM(cfg).eval())
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    for attend in (False, True):
        cache = make_hf_cache(get_method(name), model, attend=attend)
        with torch.no_grad():
            model(input_ids=ids[:, :39], use_cache=True, **cache_kwarg(cache, model))
            model(input_ids=ids[:, 39:], use_cache=True, **cache_kwarg(cache, model))
        ref = weakref.ref(cache)
        gc.disable()
        try:
            del cache
            assert ref() is None, f"{name} (attend={attend}): the cache is in a reference cycle"
        finally:
            gc.enable()


def test_a_failing_cuda_call_is_recorded_not_raised(monkeypatch) -> None:
    """Accounting never stops a run: a CUDA allocator call that fails is named in the peak dict
    (the run's manifest.memory) or, between runs, in a RuntimeWarning."""
    import torch

    def boom(*_args: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", boom)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 123)
    memstat.reset_peak()
    got = memstat.peak(True)
    assert got["cuda_peak_allocated_bytes"] == 123
    assert got["cuda_peak_error"] == (
        "reset_peak_memory_stats: RuntimeError: CUDA error: an illegal memory access\n"
        "was encountered"
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", boom)
    memstat.reset_peak()
    got = memstat.peak(True)
    assert "cuda_peak_allocated_bytes" not in got
    assert got["cuda_peak_error"].startswith("max_memory_allocated: RuntimeError: CUDA error")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 7)
    assert "cuda_peak_error" not in memstat.peak(True)  # a clean reset: nothing to report
    monkeypatch.setattr(torch.cuda, "empty_cache", boom)
    with pytest.warns(RuntimeWarning, match="could not empty the CUDA cache"):
        memstat.release()
