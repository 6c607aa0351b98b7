"""glibc heap reuse for allocation-heavy CPU measurements (:func:`heap_reuse`).

Eager CPU tensor code allocates and frees large temporaries; glibc serves every block above its
mmap threshold (at most 32 MiB) with a fresh ``mmap``, so each temporary's pages are faulted in
and zeroed by the kernel again (docs/design.md#model-shapes, docs/results/memory-shapes.md).
Nothing a workload measures from tensors or allocator events changes.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# glibc ``mallopt`` parameters (malloc.h) and the defaults :func:`heap_reuse` restores
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
DEFAULTS = ((M_MMAP_MAX, 65536), (M_TRIM_THRESHOLD, 128 * 1024), (M_MMAP_THRESHOLD, 32 << 20))


def _libc() -> ctypes.CDLL | None:
    """glibc, with ``mallopt`` and ``malloc_trim``; ``None`` elsewhere (not Linux, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@contextmanager
def heap_reuse(trim_bytes: int = 1 << 30) -> Iterator[bool]:
    """Within the block glibc serves every allocation from its heap (``mallopt(M_MMAP_MAX,
    0)``) and keeps up to ``trim_bytes`` (default 1 GiB) free at the heap's top
    (``M_TRIM_THRESHOLD``), so large temporaries reuse pages already faulted in.

    Changes no tensor and no allocation size (the CPU transient peaks of
    :func:`kvbench.measure.peak.transient_peak` come from the profiler's allocator events);
    the resident set can stay higher within the block (freed heap pages stay resident until
    reused).  On exit: glibc's defaults ``M_MMAP_MAX`` 65536, ``M_TRIM_THRESHOLD`` 128 KiB,
    ``M_MMAP_THRESHOLD`` 32 MiB (the cap of its dynamic threshold, which an explicit ``mallopt``
    fixes from then on), then ``malloc_trim(0)`` hands the free heap back to the OS.  Yields
    whether it applied (``False`` without glibc: a no-op)."""
    libc = _libc()
    if libc is None:
        yield False
        return
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, int(trim_bytes))
    try:
        yield True
    finally:
        for param, value in DEFAULTS:
            libc.mallopt(param, value)
        libc.malloc_trim(0)
