"""Reproducibility manifest of a run: code version, library versions, device, threads, seed."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch


@lru_cache(maxsize=1)
def git_sha() -> str:
    """The kvbench source tree's git commit (with ``+dirty`` if modified), or ``'unknown'``."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()


def base_manifest(device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Everything a reader needs to reproduce a record, except model and data (added later)."""
    return {
        "kvbench_version": _version("kvbench"),
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "datasets": _version("datasets"),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "seed": seed,
    }
