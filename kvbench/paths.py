"""The user cache folder of kvbench (converted models, native builds)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """User cache root: ``$KVBENCH_CACHE``, else ``$XDG_CACHE_HOME/kvbench``, else
    ``~/.cache/kvbench``. Not created here."""
    if os.environ.get("KVBENCH_CACHE"):
        return Path(os.environ["KVBENCH_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvbench"
