"""Compile a C source once per machine, cache the shared object, load it lazily.

Used by the native quantizer (:mod:`kvbench.cache.native_quant`) and the native decode kernels
(:mod:`kvbench.attention.native`).  A build is cached under ``<cache>/native/<stem>-<key>.so``
(``<cache>`` from :func:`kvbench.paths.cache_dir`), the key a hash of the source, the
flags, the compiler's ``--version`` and the CPU's flags, so an upgraded compiler or another CPU
rebuilds.  The build is written to a temporary file in the same folder and renamed into place
(atomic: a concurrent build never loads half a file).  ``KVBENCH_NATIVE=0`` disables every
native library; no compiler or a failed build leaves the library unavailable with the reason,
and the callers use their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from kvbench.paths import cache_dir

ENV_DISABLE = "KVBENCH_NATIVE"


def cpu_flags() -> str:
    """The CPU's feature line (``/proc/cpuinfo`` ``flags`` or ``Features``), else
    :func:`platform.processor`: part of a build's cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compile_cached(source: Path, flags: Sequence[str], stem: str, timeout: float) -> Path:
    """The cached shared object of ``source`` built with ``flags`` (compiled now if absent).

    Raises ``RuntimeError`` without a C compiler (``$CC``, else ``cc``, else ``gcc``) or when
    the compiler fails (its first 300 characters of stderr).  ``timeout``: seconds for the
    compiler (``subprocess.TimeoutExpired`` past it)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc) on PATH")
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        b"\0".join(x.encode() for x in (source.read_text(), " ".join(flags), ver, cpu_flags()))
    ).hexdigest()[:16]
    out = cache_dir() / "native" / f"{stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            so = Path(tmp) / out.name
            r = subprocess.run(
                [cc, *flags, str(source), "-o", str(so)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:300]}")
            os.replace(so, out)
    return out


def load_checked(path: Path, abi_symbol: str, abi_version: int) -> ctypes.CDLL:
    """``ctypes.CDLL(path)`` whose ``abi_symbol()`` returns ``abi_version``, else
    ``RuntimeError`` naming both versions (a stale build of another source)."""
    lib = ctypes.CDLL(str(path))
    got = getattr(lib, abi_symbol)()
    if got != abi_version:
        raise RuntimeError(f"{path} has ABI {got}, expected {abi_version}")
    return lib


class NativeLibrary:
    """A native library built on first use, thread-safe, once per process.

    ``build``: a callable returning the loaded library (it may raise: the library is then
    unavailable with ``"<what> unavailable: <error>"`` as the reason).  ``lib`` and ``reason``
    hold the outcome (both ``None`` until the first :meth:`load`; tests reset them)."""

    def __init__(self, build: Callable[[], ctypes.CDLL], what: str) -> None:
        self._build, self.what = build, what
        self.lib: ctypes.CDLL | None = None
        self.reason: str | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        """The library, built and loaded on the first call; ``None`` when unavailable."""
        if self.lib is not None or self.reason is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.reason is None:
                if os.environ.get(ENV_DISABLE, "1") == "0":
                    self.reason = f"{ENV_DISABLE}=0"
                else:
                    try:
                        self.lib = self._build()
                    except Exception as e:  # noqa: BLE001 - no compiler, odd platform
                        self.reason = f"{self.what} unavailable: {type(e).__name__}: {e}"
        return self.lib

    def available(self) -> bool:
        """Whether the library is built and loaded (builds it on the first call)."""
        return self.load() is not None

    def unavailable_reason(self) -> str | None:
        """``None`` when :meth:`available`, else why not (no compiler, build error, disabled)."""
        self.load()
        return self.reason
