"""Load a native C library that the package's build compiled next to its module.

Used by the native quantizer (:mod:`kvbench.cache.native_quant`) and the native decode kernels
(``kvbench.kernels.cpu.native``).  ``setup.py`` compiles each C source into a shared object
next to the module that loads it (``kernels/cpu/_codes.so``, ``kvbench/cache/_affine.so``),
at ``pip install .`` and in place at ``pip install -e .``; nothing is compiled at run time.
Each build carries its source's SHA-256 (the symbol :data:`SOURCE_SYMBOL`) and an ABI version,
both checked at load, so a build of an edited source is never used.  A library has one C source
file: ``setup.py`` may compile it as several translation units in parallel (the same file, once
per ``-DKV_UNIT=<unit>``) linked into the one library, so that file's digest covers every line
compiled into it (a library made of several files would need one digest over all of them).
``KVBENCH_NATIVE=0`` disables every native library; a library not built (no C compiler at
install, a source checkout never built), stale or of another ABI is unavailable with the
reason, and the callers use their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

ENV_DISABLE = "KVBENCH_NATIVE"
#: what builds the libraries of a source checkout (``python setup.py build_ext --inplace`` too)
BUILD_COMMAND = "pip install -e ."
#: the ``const char[65]`` in every built library: the hex SHA-256 of the C source it was built
#: from (its one source file, whatever the translation units ``setup.py`` compiled it as)
SOURCE_SYMBOL = "kvbench_source_sha256"


def source_digest(source: Path) -> str:
    """The hex SHA-256 of ``source``'s bytes (what ``setup.py`` stores as :data:`SOURCE_SYMBOL`)."""
    return hashlib.sha256(source.read_bytes()).hexdigest()


def load_checked(path: Path, source: Path, abi_symbol: str, abi_version: int) -> ctypes.CDLL:
    """``ctypes.CDLL(path)``, built from ``source`` as it is now, whose ``abi_symbol()`` returns
    ``abi_version``.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist (the message names the cause and :data:`BUILD_COMMAND`).
    RuntimeError
        The library was built from another version of ``source`` (edited since the build), or
        its ABI is not ``abi_version``; the message names :data:`BUILD_COMMAND`.
    OSError
        The file is not a loadable shared object.
    """
    if not path.exists():
        raise FileNotFoundError(
            f"{path} was not built (no C compiler when kvbench was installed, or a source "
            f"checkout never built): run `{BUILD_COMMAND}` in the source checkout (or reinstall "
            f"kvbench) with a C compiler (cc) on PATH"
        )
    lib = ctypes.CDLL(str(path))
    got = getattr(lib, abi_symbol)()  # a C function named at run time
    if got != abi_version:
        raise RuntimeError(f"{path} has ABI {got}, expected {abi_version}: run `{BUILD_COMMAND}`")
    built = (ctypes.c_char * 65).in_dll(lib, SOURCE_SYMBOL).value.decode()
    if built != source_digest(source):
        raise RuntimeError(
            f"{path} was built from another version of {source} (edited since the build): "
            f"run `{BUILD_COMMAND}`"
        )
    return lib


class NativeLibrary:
    """A native library loaded on first use, thread-safe, once per process.

    ``load``: a callable returning the loaded library (it may raise: the library is then
    unavailable with ``"<what> unavailable: <error>"`` as the reason).  ``lib`` and ``reason``
    hold the outcome (both ``None`` until the first :meth:`load`; tests reset them)."""

    def __init__(self, load: Callable[[], ctypes.CDLL], what: str) -> None:
        self._load, self.what = load, what
        self.lib: ctypes.CDLL | None = None
        self.reason: str | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        """The library, loaded on the first call; ``None`` when unavailable."""
        if self.lib is not None or self.reason is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.reason is None:
                if os.environ.get(ENV_DISABLE, "1") == "0":
                    self.reason = f"{ENV_DISABLE}=0"
                else:
                    try:
                        self.lib = self._load()
                    except Exception as e:  # noqa: BLE001 - any load failure: self.reason
                        # what it catches: any failure to load (not built, stale, odd platform);
                        # kept as self.reason: available() is then False and
                        # unavailable_reason() returns it to the callers, which report it
                        self.reason = f"{self.what} unavailable: {type(e).__name__}: {e}"
        return self.lib

    def available(self) -> bool:
        """Whether the library is built and loaded (loads it on the first call)."""
        return self.load() is not None

    def unavailable_reason(self) -> str | None:
        """``None`` when :meth:`available`, else why not (not built, stale, disabled)."""
        self.load()
        return self.reason
