"""One ``kvbench run`` per result folder: an exclusive lock on ``<out>/.lock``.

Two sweeps writing into one folder at once would each compute the same runs and race on the
records.  :func:`output_lock` takes ``fcntl.flock`` on ``<out>/.lock`` without waiting and writes
the holder (pid, host, start time) into it; a second run fails at once with a message naming the
holder.  The kernel releases a ``flock`` when its process dies, so the file a killed run leaves
behind blocks nothing: the next run takes the lock and overwrites it.  Where ``fcntl`` does not
exist (Windows) no lock is taken.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

#: the lock file inside the result folder (not ``*.json``: never read as a record)
LOCK_NAME = ".lock"


class OutputLocked(RuntimeError):
    """Another live process holds the result folder's lock; the message names it."""


def _holder(text: str) -> str:
    """The holder described by the lock file's JSON (``pid``, ``host``, ``since``)."""
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']} since {info['since']}"
    except (ValueError, KeyError, TypeError):  # it has locked but not yet written
        return "another process"


@contextmanager
def output_lock(out: str | Path) -> Iterator[Path]:
    """Hold the exclusive lock of result folder ``out`` (which must exist) for the block.

    Yields the lock file's path.  The file keeps ``{"pid", "host", "since"}`` (``since``: UTC,
    ISO 8601) while held and is emptied on release.

    Raises
    ------
    OutputLocked
        Another live process holds the lock (a ``RuntimeError``: ``kvbench run`` exits 2 with
        the message, which names its pid, host and start time).
    """
    path = Path(out) / LOCK_NAME
    if fcntl is None:
        yield path
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with open(path, encoding="utf-8", errors="replace") as f:
                who = _holder(f.read())
            raise OutputLocked(
                f"--out {out} is in use by another kvbench run ({who}; lock file {path}); "
                "wait for it to finish or choose another --out"
            ) from None
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
