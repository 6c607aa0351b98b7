"""Drop one known, harmless line that C++ code writes to the process's stderr, within a scope.

torch's CPU allocator logs (``LOG(WARNING)``, straight to file descriptor 2) ``Memory block of
unknown size was allocated before the profiling started, ...`` the first time a memory-profiling
session sees the free of a block allocated while no session ran, which every CPU memory run of
:func:`kvbench.measure.peak.transient_peak` does (a decode step replaces cache tensors
built before it).  kvbench already leaves such frees out of the peak, so the line says nothing
to its user.  torch has no runtime switch for its C++ log level, and ``TORCH_CPP_LOG_LEVEL``
would hide every C++ warning of the whole process; :func:`drop_stderr_lines` instead sends
descriptor 2 to a temporary file for the scope and writes back every line but the dropped ones
when the scope ends (an exception included).  What other threads write to stderr meanwhile is
delayed to the end of the scope, not lost.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

#: the part of torch's CPUAllocator line that identifies it
UNKNOWN_BLOCK_WARNING = b"Memory block of unknown size was allocated before the profiling started"


def _flush() -> None:
    if sys.stderr is not None:
        sys.stderr.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@contextmanager
def drop_stderr_lines(marker: bytes = UNKNOWN_BLOCK_WARNING) -> Iterator[None]:
    """Within the block, lines written to file descriptor 2 that contain ``marker`` are dropped;
    every other line reaches stderr, in order, when the block ends.  Without a usable
    descriptor 2 (closed) the block runs unfiltered."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with tempfile.TemporaryFile() as tmp:
            _flush()
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                _flush()
                os.dup2(saved, 2)
                tmp.seek(0)
                kept = b"".join(
                    line for line in tmp.read().splitlines(keepends=True) if marker not in line
                )
                if kept:
                    _write_all(2, kept)
    finally:
        os.close(saved)
