"""Where kvbench keeps files and how it writes them: the user cache folder (converted models)
and :func:`atomic_file`, the one atomic write of every record, sidecar and prepared text."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def cache_dir() -> Path:
    """User cache root: ``$KVBENCH_CACHE``, else ``$XDG_CACHE_HOME/kvbench``, else
    ``~/.cache/kvbench``. Not created here."""
    if os.environ.get("KVBENCH_CACHE"):
        return Path(os.environ["KVBENCH_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvbench"


def _umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", plain: bool = False) -> Iterator[IO]:
    """Write ``path`` through a temporary file in the same folder (parents created): on a clean
    exit the file is flushed, fsynced and renamed onto ``path`` (``os.replace``), so a crash
    never leaves a partial file; on any exception the temporary file is removed and ``path`` is
    untouched.  ``mode``: ``"w"`` (text, UTF-8) or ``"wb"``.  ``plain``: give the file the mode a
    plain ``open`` would (``0o666`` less the umask) instead of ``mkstemp``'s ``0o600``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if plain:
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
