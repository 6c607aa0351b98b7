"""Per-run memory accounting: peak resident set size (Linux ``VmHWM``, reset per run through
``/proc/self/clear_refs``) and, on CUDA, the allocator's peak; plus :func:`release`, which
returns freed memory to the OS between runs so a sweep's peak is that of its largest run.

Units: bytes.  Where the OS gives no per-run peak (not Linux), the process peak since start is
reported (``rss_peak_scope: "process"``).
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int | None:
    """Current resident set size, bytes (``None`` where ``/proc`` is absent)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter (and CUDA's); True if the RSS peak is per run."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
    except Exception:  # noqa: BLE001 - accounting must never stop a run
        pass
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


def peak(per_run: bool) -> dict[str, Any]:
    """``{"peak_rss_bytes", "rss_peak_scope", "cuda_peak_allocated_bytes"?}`` since
    :func:`reset_peak`."""
    kib = _status_kib("VmHWM")
    if kib is not None and per_run:
        out: dict[str, Any] = {"peak_rss_bytes": kib * 1024, "rss_peak_scope": "run"}
    else:
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = {
            "peak_rss_bytes": ru if sys.platform == "darwin" else ru * 1024,
            "rss_peak_scope": "process",
        }
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    except Exception:  # noqa: BLE001
        pass
    return out


def release() -> None:
    """Collect garbage, empty the CUDA caching allocator and give glibc's free heap pages back
    to the OS (``malloc_trim``), so memory freed by one run does not stay resident.

    The objects that survive the collection are then frozen (``gc.freeze()``), so the next
    call scans only what was allocated since: without it every call walks the whole heap of
    imported modules (torch, transformers).  :func:`unfreeze` (the end of a sweep) hands them
    back to the collector."""
    gc.collect()
    gc.freeze()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def unfreeze() -> None:
    """Undo the freezing of :func:`release` (call once a sweep is over)."""
    gc.unfreeze()
