"""Build kvbench's native C libraries: plain shared objects loaded through ctypes (no Python C-API).

Each library is compiled by the system C compiler (``$CC``, else ``cc``, else ``gcc``) from its
C source with the ``FLAGS`` tuple of the module that loads it, then ``$KVBENCH_NATIVE_CFLAGS``
(appended, so later flags win: e.g. ``-march=x86-64-v3`` for a wheel meant for other machines),
into ``_<name>.so`` next to that module.  A library is one C source file, compiled as one or
more translation units (``LIBRARIES``' units: the file once per ``-DKV_UNIT=<unit>``, each
unit holding the functions under that unit's guard, see ``kernels/cpu/csrc/codes.c``) into
object files that are linked with the source's SHA-256 as the symbol ``kvbench_source_sha256``
(:mod:`kvbench.clib` refuses a build of another source); every unit is that one file, so the
digest covers every line compiled into the library.  The compiles of all libraries run
concurrently, ``$KVBENCH_NATIVE_JOBS`` at a time (default: the CPUs this process may use), each
library linked once its units are compiled.
``pip install .`` puts the libraries in the installed package; ``pip install -e .`` (and
``python setup.py build_ext --inplace``) in the source tree.  With no compiler or a failed
compile the install still succeeds with one line per library saying so (the unit and the
compiler's error), and kvbench uses its torch paths
(``kvbench.kernels.cpu.native.unavailable_reason()`` says why); a failure in one library does
not stop the others.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ENV_FLAGS = "KVBENCH_NATIVE_CFLAGS"
ENV_JOBS = "KVBENCH_NATIVE_JOBS"
SOURCE_SYMBOL = "kvbench_source_sha256"  # kvbench.clib.SOURCE_SYMBOL
UNIT_MACRO = "KV_UNIT"
# (library, C source, the module that loads it and defines its FLAGS, the source's translation
# units: each compiled with -DKV_UNIT=<unit>, the longest first, so that the compiles end
# together; (): the whole source as one unit)
LIBRARIES = (
    (
        "kvbench.kernels.cpu._codes",
        "kernels/cpu/csrc/codes.c",
        "kernels/cpu/native.py",
        (  # CPU-s with GCC 12 -O3 on a 2-core AMD EPYC, 141 in all (~25% more when loaded)
            "KV_UNIT_KEYS",  # 33
            "KV_UNIT_FUSED",  # 31
            "KV_UNIT_FUSED_AVX512",  # 33
            "KV_UNIT_FUSED_AVX2",  # 34
            "KV_UNIT_VALUES",  # 6
            "KV_UNIT_TABLES",  # 2.5
        ),
    ),
    ("kvbench.cache._affine", "kvbench/cache/csrc/affine.c", "kvbench/cache/native_quant.py", ()),
)


def module_flags(module: str) -> list[str]:
    """The literal ``FLAGS`` tuple assigned at the top level of ``module`` (a path)."""
    for node in ast.parse(Path(module).read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
            "FLAGS"
        ]:
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{module} defines no FLAGS tuple")


def compiler() -> list[str] | None:
    """The C compiler command (``$CC`` split as a shell would, else ``cc``, else ``gcc``), or
    ``None`` when none is on PATH."""
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    return cc if cc[0] and shutil.which(cc[0]) else None


def native_jobs() -> int:
    """How many compiles run at once: ``$KVBENCH_NATIVE_JOBS`` (a positive integer), else the
    CPUs this process may run on (``os.sched_getaffinity``, else ``os.cpu_count()``).

    Raises ``ValueError`` when ``$KVBENCH_NATIVE_JOBS`` is set to anything else."""
    text = os.environ.get(ENV_JOBS, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"${ENV_JOBS} must be a positive integer, not {text!r}")
        return int(text)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


class NativeExtension(Extension):
    """A native library: its one C source, its flags and its translation units (``()``: one)."""

    def __init__(self, name: str, source: str, flags: list[str], units: tuple[str, ...]) -> None:
        super().__init__(name, [source], extra_compile_args=flags, optional=True)
        self.units = units


class Compile(NamedTuple):
    """One translation unit's compile: ``unit`` (``""``: the whole source) and its command."""

    unit: str
    cmd: list[str]


class LibraryBuild(NamedTuple):
    """One library's commands: ``compiles`` (one object file each, run concurrently), then
    ``link`` (the objects and the source digest into ``out``)."""

    name: str
    out: Path
    compiles: list[Compile]
    link: list[str]


def library_build(
    cc: list[str],
    name: str,
    source: str,
    flags: list[str],
    units: tuple[str, ...],
    out: Path,
    temp: Path,
) -> LibraryBuild:
    """The commands that build library ``name`` from ``source`` into ``out``: ``cc`` with
    ``flags`` then ``$KVBENCH_NATIVE_CFLAGS``, each unit ``-DKV_UNIT=<unit>`` to an object in
    ``temp``; the link adds ``temp/<name>.sha256.c``, written here (:data:`SOURCE_SYMBOL`, the
    SHA-256 of ``source``'s bytes)."""
    temp.mkdir(parents=True, exist_ok=True)
    digest = temp / f"{name}.sha256.c"
    sha = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    digest.write_text(f'const char {SOURCE_SYMBOL}[65] = "{sha}";\n')
    flags = [*flags, *shlex.split(os.environ.get(ENV_FLAGS, ""))]
    compiles, objects = [], []
    for unit in units or ("",):
        obj = temp / f"{name}.{unit or 'all'}.o"
        define = [f"-D{UNIT_MACRO}={unit}"] if unit else []
        compiles.append(Compile(unit, [*cc, *flags, *define, "-c", source, "-o", str(obj)]))
        objects.append(str(obj))
    return LibraryBuild(name, out, compiles, [*cc, *flags, *objects, str(digest), "-o", str(out)])


def run_command(cmd: list[str], unit: str = "") -> str | None:
    """Run ``cmd``: ``None`` when it succeeds, else the error on one line (the program, the
    unit, the first 300 characters of its stderr)."""
    where = f" on {UNIT_MACRO}={unit}" if unit else ""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        return f"{cmd[0]} failed{where}: {e}"
    if r.returncode == 0:
        return None
    return f"{cmd[0]} failed{where}: {' | '.join(r.stderr.strip().splitlines())[:300]}"


def build_libraries(libraries: list[LibraryBuild], jobs: int) -> dict[str, str | None]:
    """Run every library's compiles, ``jobs`` at a time in the order given, and link each
    library once its own compiles are done (while the others' go on).  Returns each library's
    error (``None``: built); a library with an error has no ``out`` (removed)."""
    errors: dict[str, str | None] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        started = [
            (lib, [pool.submit(run_command, c.cmd, c.unit) for c in lib.compiles])
            for lib in libraries
        ]
        for lib, futures in started:
            failed = [e for e in (f.result() for f in futures) if e is not None]
            if not failed:
                print(" ".join(lib.link))
            error = failed[0] if failed else run_command(lib.link)
            if error is not None:
                lib.out.unlink(missing_ok=True)
            errors[lib.name] = error
    return errors


class BuildNative(build_ext):
    """Compile each library with its own flags (not Python's extension flags) into
    ``<package>/_<name>.so``, the compiles of all libraries concurrently (:func:`native_jobs`);
    a missing compiler or a failed compile skips that library with one line."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extensions(self) -> None:
        cc = compiler()
        if cc is None:
            for ext in self.extensions:  # not a build left in build/ by an earlier install
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            print(
                "kvbench: no C compiler (cc, or $CC) on PATH: native kernels not built, "
                "the torch paths are used (install one and rerun pip install)",
                file=sys.stderr,
            )
            return
        builds = []
        for ext in self.extensions:
            (source,) = ext.sources
            out = Path(self.get_ext_fullpath(ext.name))
            out.parent.mkdir(parents=True, exist_ok=True)
            if not isinstance(ext, NativeExtension):
                raise TypeError(f"{ext.name}: not a NativeExtension (setup.py's LIBRARIES)")
            flags = list(ext.extra_compile_args)
            builds.append(
                library_build(cc, ext.name, source, flags, ext.units, out, Path(self.build_temp))
            )
        jobs = native_jobs()
        print(f"kvbench: compiling {sum(len(b.compiles) for b in builds)} units, {jobs} at a time")
        for b in builds:
            for c in b.compiles:
                print(" ".join(c.cmd))
        for name, error in build_libraries(builds, jobs).items():
            if error is not None:
                print(
                    f"kvbench: {name} not built, the torch paths are used: {error}", file=sys.stderr
                )


setup(
    ext_modules=[
        NativeExtension(name, source, module_flags(module), units)
        for name, source, module, units in LIBRARIES
    ],
    cmdclass={"build_ext": BuildNative},
)
