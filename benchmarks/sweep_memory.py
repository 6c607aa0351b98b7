"""Resident memory over a sweep, run by run: where a long sweep's memory goes.

Runs a suite in this process (``kvbench.bench.runner.run_suite``, records under ``--out``) and
prints one line per computed run: the run's peak RSS (the record's ``peak_rss_bytes``), the
resident set after the run and after :func:`kvbench.measure.memstat.release` (gc + CUDA cache +
``malloc_trim``), glibc's heap in use and free (``mallinfo2``), torch.compile's counters
(frames compiled, graphs, recompiles), and with ``--tracemalloc`` the Python-level bytes
allocated and still alive.  Units: MiB.

Usage (an idle machine; a run of the full latency suite takes hours)::

    KVBENCH_DATA_DIR=... python benchmarks/sweep_memory.py suites/latency.yaml --out /tmp/lat
    python benchmarks/sweep_memory.py suites/latency.yaml --out /tmp/lat-small \\
        --set 'workloads.0.context=[512,1100]' --set workloads.0.steps=4

``--no-release`` skips the between-runs release (to see what it bounds); ``--json FILE`` writes
the rows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from kvbench.bench.records import Record

MIB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap() -> dict[str, float]:
    """glibc's main heap + mmapped chunks in use and free (MiB); empty off glibc."""
    try:
        f = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    f.restype = _Mallinfo2
    m = f()
    return {"heap_used": (m.uordblks + m.hblkhd) / MIB, "heap_free": m.fordblks / MIB}


def compile_counts() -> dict[str, int]:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {
        "frames": int(counters["frames"]["ok"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": sum(int(v) for v in counters["recompiles"].values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-release", action="store_true")
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from kvbench.bench import runner
    from kvbench.bench.suite import load_suite, parse_set
    from kvbench.measure import memstat

    suite = load_suite(args.suite, parse_set(args.set))
    if args.tracemalloc:
        tracemalloc.start()
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    real_release, real_write = memstat.release, runner.write_run
    pending: dict[str, Any] = {}

    def write_run(path: Path, rec: Record) -> None:
        real_write(path, rec)
        pending.update(
            run=len(rows) + 1,
            label=rec.manifest.get("label"),
            workload=rec.workload.get("context", ""),
            peak=rec.manifest["memory"]["peak_rss_bytes"] / MIB,
            after_run=(memstat.rss_bytes() or 0) / MIB,
        )

    def release() -> None:
        if not args.no_release:
            real_release()
        if not pending:  # the release after a workload group
            return
        row = dict(pending, after_release=(memstat.rss_bytes() or 0) / MIB, **heap())
        row.update(compile_counts())
        if args.tracemalloc:
            row["py_alive"] = tracemalloc.get_traced_memory()[0] / MIB
        row["t"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        pending.clear()
        print(
            " ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            ),
            file=sys.stderr,
            flush=True,
        )

    memstat.release, runner.write_run = release, write_run
    try:
        runner.run_suite(suite, args.out, force=True, quiet=True)
    finally:
        memstat.release, runner.write_run = real_release, real_write
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
