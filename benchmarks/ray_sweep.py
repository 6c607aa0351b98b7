"""Wall time of a sweep on N local Ray workers vs the local executor, and the Ray path's
overhead per run (docs/cluster.md, "How a sweep scales").

The sweep: 6 method configurations x 2 model-free workloads (``bits``; ``memory`` on seeded
synthetic K/V) = 12 runs, ``threads: 1``, ``resources: {num_cpus: 1}`` per worker.  Printed:

* local executor wall time (one process, one thread);
* Ray start-up: ``ray.init`` (a local instance with ``--workers`` CPUs) and worker spawn (each
  worker's process start and imports), stated apart from the sweep;
* Ray sweep wall time (first submission to last record written, worker spawn included) and
  the ratio local / Ray, with and without ``ray.init``;
* per run: in-worker time ``e_i`` and overhead ``o_i`` = (submit -> record written on the
  driver) - ``e_i`` (transfer, scheduling, object-store fetch of the prepared workload);
* the prediction ``T(N) ~= S + W + sum_i (e_i + o_i) / N`` for a few N.

Run on an idle machine (it is a timing benchmark)::

    .venv/bin/python benchmarks/ray_sweep.py --workers 2

``--context`` sets the memory workload's depth (default 2048 tokens, ~seconds per run);
``--json FILE`` also writes the numbers as JSON.  Records of both executors are checked equal
on every non-timing metric.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def sweep_suite(context: int):
    from kvbench.bench.suite import parse_suite

    return parse_suite(
        {
            "name": "ray-sweep",
            "seed": 0,
            "threads": 1,
            "model": "none",
            "resources": {"num_cpus": 1},
            "methods": [
                "full",
                {"name": "kivi", "config": {"bits": [2, 4]}},
                "per-token",
                "per-channel",
                "uniform",
            ],
            "workloads": [
                {"type": "bits"},
                {"type": "memory", "source": "synthetic", "context": context},
            ],
        },
        "benchmarks/ray_sweep.py",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="local Ray workers (CPUs)")
    ap.add_argument("--context", type=int, default=2048, help="memory workload depth d")
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args(argv)

    from kvbench.bench.runner import run_suite
    from kvbench.integrations.ray.connect import import_ray
    from kvbench.integrations.ray.scheduler import RayExecutor

    suite = sweep_suite(args.context)
    out = Path(tempfile.mkdtemp(prefix="kvbench-ray-sweep-"))
    n_runs = len(suite.methods) * len(suite.workloads)

    t0 = time.perf_counter()
    local = run_suite(suite, out / "local", quiet=True)
    local_s = time.perf_counter() - t0

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local instance only
    ray = import_ray()
    t0 = time.perf_counter()
    ray.init(num_cpus=args.workers, include_dashboard=False)
    init_s = time.perf_counter() - t0
    try:
        ex = RayExecutor(suite, out / "ray", max_parallel=args.workers, quiet=True)
        t0 = time.perf_counter()
        ex.run()
        ray_s = time.perf_counter() - t0
    finally:
        ray.shutdown()

    timed = ("_ms", "_s", "tokens_per_s", "latency", "speedup")
    for a, b in zip(local, ex.records, strict=True):
        keys = [k for k in a.metrics if not any(t in k for t in timed)]
        assert a.run_id == b.run_id, (a.run_id, b.run_id)
        assert all(a.metrics[k] == b.metrics[k] for k in keys), a.run_id
    exec_s = [t["exec_s"] for t in ex.timings]
    over_s = [t["overhead_s"] for t in ex.timings]
    spawn = statistics.mean(ex.spawn_s) if ex.spawn_s else 0.0
    total = sum(e + o for e, o in zip(exec_s, over_s))
    numbers = {
        "runs": n_runs,
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "local_wall_s": local_s,
        "ray_init_s": init_s,
        "ray_worker_spawn_s_mean": spawn,
        "ray_sweep_wall_s": ray_s,
        "ratio_local_over_ray": local_s / ray_s,
        "ratio_local_over_ray_with_init": local_s / (ray_s + init_s),
        "run_exec_s_sum": sum(exec_s),
        "run_exec_s_median": statistics.median(exec_s),
        "run_overhead_s_median": statistics.median(over_s),
        "run_overhead_s_mean": statistics.mean(over_s),
        "run_overhead_s_max": max(over_s),
    }
    print(f"sweep: {n_runs} runs (6 configs x bits, memory d={args.context}), threads 1")
    print(f"local executor            {local_s:8.2f} s")
    print(f"ray.init (start-up)       {init_s:8.2f} s   (not in the sweep time below)")
    print(f"ray worker spawn (mean)   {spawn:8.2f} s   (process start + imports, in the sweep)")
    print(f"ray sweep, {args.workers} workers      {ray_s:8.2f} s")
    print(f"ratio local / ray         {local_s / ray_s:8.2f}   (with ray.init: "
          f"{local_s / (ray_s + init_s):.2f})")  # fmt: skip
    print(f"per run in worker e_i     median {statistics.median(exec_s):.3f} s, "
          f"sum {sum(exec_s):.2f} s")  # fmt: skip
    print(f"per run overhead o_i      median {statistics.median(over_s) * 1e3:.1f} ms, "
          f"mean {statistics.mean(over_s) * 1e3:.1f} ms, max {max(over_s) * 1e3:.1f} ms "
          "(submit -> record written, minus e_i)")  # fmt: skip
    print("T(N) ~= S + W + sum(e_i + o_i) / N   (S = ray.init, W = worker spawn)")
    for n in (1, 2, 4, 8):
        print(f"  N={n}: {init_s + spawn + total / n:8.2f} s predicted")
    numbers["predicted_s"] = {n: init_s + spawn + total / n for n in (1, 2, 4, 8)}
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
