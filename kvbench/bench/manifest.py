"""Reproducibility manifest of a run: code version, library versions, device, threads, seed,
and the provenance of the invocation (command, load average, the run log of a result folder).

Gathering only; :mod:`kvbench.report.provenance` renders what is gathered here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from kvbench.bench.records import RecordError, utc_now, write_jsonl_atomic
from kvbench.jsontypes import JSONValue

#: environment variable a wrapper sets to the command its user typed (the Makefile: ``make bench``)
COMMAND_ENV = "KVBENCH_COMMAND"
#: one JSON line per ``kvbench run`` into a result folder (not ``*.json``: never read as a record)
RUN_LOG = "kvbench-run.jsonl"


@lru_cache(maxsize=1)
def git_sha() -> str:
    """The kvbench source tree's git commit (with ``+dirty`` if modified), or ``'unknown'``."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        return run.stdout.strip()

    try:
        sha, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def dist_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_cpu_model(cpuinfo: str) -> str | None:
    """The first ``model name`` of a ``/proc/cpuinfo`` text, or ``None`` when it has none."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return value.strip()
    return None


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """This machine's CPU model: ``model name`` of ``/proc/cpuinfo`` on Linux, else
    ``platform.processor()`` (often only the architecture), else ``platform.machine()``."""
    try:
        name = parse_cpu_model(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        name = None
    return name or platform.processor() or platform.machine()


def device_name(device: str | torch.device) -> str:
    """The GPU's name for a CUDA device, else the CPU model (:func:`cpu_model`)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return cpu_model()


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (``os.getloadavg``, 2 decimals), ``None`` where the
    platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


_argv: list[str] | None = None


@contextmanager
def cli_argv(argv: Sequence[str]) -> Iterator[None]:
    """Within the block, :func:`invocation` names ``kvbench`` with arguments ``argv`` (the CLI's
    ``main`` wraps each command in it, so a ``main(argv)`` call records that ``argv``)."""
    global _argv
    before, _argv = _argv, list(argv)
    try:
        yield
    finally:
        _argv = before


def invocation() -> dict[str, str]:
    """``{"argv", "command"}`` of this process: ``argv`` is the kvbench command line joined
    shell-quoted (``shlex.join``; ``kvbench`` and the CLI's arguments, or outside the CLI the
    program's file name and ``sys.argv[1:]``); ``command`` is :data:`COMMAND_ENV` when set (what
    a wrapper's user typed, e.g. ``make bench``), else ``argv``."""
    if _argv is not None:
        argv = shlex.join(["kvbench", *_argv])
    else:
        argv = shlex.join([Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]])
    return {"argv": argv, "command": os.environ.get(COMMAND_ENV) or argv}


def base_manifest(device: str = "cpu", seed: int = 0) -> dict[str, JSONValue]:
    """Everything a reader needs to reproduce a record, except model and data (added later)."""
    return {
        "kvbench_version": dist_version("kvbench"),
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": dist_version("transformers"),
        "triton": dist_version("triton"),
        "datasets": dist_version("datasets"),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_model": cpu_model(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "seed": seed,
        **invocation(),
    }


def read_run_log(folder: str | Path) -> list[dict[str, JSONValue]]:
    """The entries of ``<folder>/kvbench-run.jsonl`` (:func:`run_log`), oldest first; ``[]``
    when the folder has none.  ``RecordError`` naming the file and line for a malformed line."""
    path = Path(folder) / RUN_LOG
    if not path.is_file():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path}:{i}: not a JSON line ({exc})") from exc
        if not isinstance(entry, dict):
            raise RecordError(f"{path}:{i}: not a JSON object")
        out.append(entry)
    return out


@contextmanager
def run_log(out: str | Path, suite: str) -> Iterator[dict[str, JSONValue]]:
    """Log one ``kvbench run`` of suite file ``suite`` into result folder ``out``: an entry of
    ``<out>/kvbench-run.jsonl`` (its fields: docs/design.md#run-log) written when the block
    starts (``status: "running"``) and rewritten when it ends (``finished``, ``interrupted`` on
    Ctrl-C, ``failed`` on an exception).  The caller may add keys to the yielded entry
    (``records``).  Earlier entries (a resumed sweep) are kept; the file is rewritten
    atomically, under the caller's output lock."""
    path = Path(out) / RUN_LOG
    earlier = read_run_log(out)
    entry: dict[str, JSONValue] = {
        "suite": suite,
        **invocation(),
        "kvbench_version": dist_version("kvbench"),
        "git_sha": git_sha(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "started": utc_now(),
        "loadavg_start": loadavg(),
        "status": "running",
    }
    write_jsonl_atomic(path, [*earlier, entry])
    t0, status = time.perf_counter(), "failed"
    try:
        yield entry
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        entry.update(
            ended=utc_now(),
            wall_s=round(time.perf_counter() - t0, 3),
            loadavg_end=loadavg(),
            status=status,
        )
        write_jsonl_atomic(path, [*earlier, entry])
