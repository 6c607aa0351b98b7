"""Per-run memory accounting: peak resident set size (Linux ``VmHWM``, reset per run through
``/proc/self/clear_refs``) and, on CUDA, the allocator's peak; plus :func:`release`, which
returns freed memory to the OS between runs so a sweep's peak is that of its largest run.

Units: bytes.  Where the OS gives no per-run peak (not Linux), the process peak since start is
reported (``rss_peak_scope: "process"``).

Accounting never stops a run: a CUDA allocator call that fails is recorded instead, in the dict
:func:`peak` returns (``cuda_peak_error``: the failure of :func:`reset_peak` or of reading the
peak, so the run's ``manifest.memory`` says why its CUDA peak is absent or process-wide), or, for
:func:`release`, in a :class:`RuntimeWarning`.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
import warnings
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")
#: why the last :func:`reset_peak` could not reset CUDA's peak (``None``: it did, or no CUDA)
_reset_error: str | None = None


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


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
    global _reset_error
    _reset_error = None
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
    # any failure of the CUDA call (a RuntimeError of the driver or allocator, most likely):
    # accounting must never stop a run; kept for peak()'s cuda_peak_error (the run's manifest)
    except Exception as exc:  # noqa: BLE001 - CUDA errors -> cuda_peak_error
        _reset_error = f"reset_peak_memory_stats: {_describe(exc)}"
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


def peak(per_run: bool) -> dict[str, int | str]:
    """``{"peak_rss_bytes", "rss_peak_scope", "cuda_peak_allocated_bytes"?,
    "cuda_peak_error"?}`` since :func:`reset_peak` (bytes; ``rss_peak_scope`` ``"run"`` or
    ``"process"``; ``cuda_peak_error`` only when a CUDA call failed, naming it)."""
    kib = _status_kib("VmHWM")
    if kib is not None and per_run:
        out: dict[str, int | str] = {"peak_rss_bytes": kib * 1024, "rss_peak_scope": "run"}
    else:
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = {
            "peak_rss_bytes": ru if sys.platform == "darwin" else ru * 1024,
            "rss_peak_scope": "process",
        }
    errors = [] if _reset_error is None else [_reset_error]  # the peak spans more than the run
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    # any failure of the CUDA call (a RuntimeError of the driver or allocator, most likely):
    # accounting must never stop a run; recorded as cuda_peak_error (the run's manifest.memory)
    except Exception as exc:  # noqa: BLE001 - CUDA errors -> cuda_peak_error
        errors.append(f"max_memory_allocated: {_describe(exc)}")
    if errors:
        out["cuda_peak_error"] = "; ".join(errors)
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
    # any failure of the CUDA call (a RuntimeError of the driver or allocator, most likely):
    # freeing between runs must never stop a sweep; reported as a RuntimeWarning on stderr
    except Exception as exc:  # noqa: BLE001 - CUDA errors -> RuntimeWarning
        warnings.warn(
            f"kvbench: could not empty the CUDA cache between runs ({_describe(exc)}); the "
            "next run's CUDA peak may include memory freed before it",
            RuntimeWarning,
            stacklevel=2,
        )
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def unfreeze() -> None:
    """Undo the freezing of :func:`release` (call once a sweep is over)."""
    gc.unfreeze()
