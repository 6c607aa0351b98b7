"""Build kvbench's native C libraries: plain shared objects loaded through ctypes (no Python C-API).

Each library is compiled by the system C compiler (``$CC``, else ``cc``, else ``gcc``) from its
C source with the ``FLAGS`` tuple of the module that loads it, then ``$KVBENCH_NATIVE_CFLAGS``
(appended, so later flags win: e.g. ``-march=x86-64-v3`` for a wheel meant for other machines),
into ``_<name>.so`` next to that module, with the source's SHA-256 as the symbol
``kvbench_source_sha256`` (:mod:`kvbench.clib` refuses a build of another source).
``pip install .`` puts the libraries in the installed package; ``pip install -e .`` (and
``python setup.py build_ext --inplace``) in the source tree.  With no compiler or a failed
compile the install still succeeds with one line saying so, and kvbench uses its torch paths
(``kvbench.kernels.cpu.native.unavailable_reason()`` says why).
"""

from __future__ import annotations

import ast
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ENV_FLAGS = "KVBENCH_NATIVE_CFLAGS"
SOURCE_SYMBOL = "kvbench_source_sha256"  # kvbench.clib.SOURCE_SYMBOL
# (library, C source, the module that loads it and defines its FLAGS)
LIBRARIES = (
    ("kvbench.kernels.cpu._codes", "kernels/cpu/csrc/codes.c", "kernels/cpu/native.py"),
    ("kvbench.cache._affine", "kvbench/cache/csrc/affine.c", "kvbench/cache/native_quant.py"),
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


class BuildNative(build_ext):
    """Compile each library with its own flags (not Python's extension flags) into
    ``<package>/_<name>.so``; a missing compiler or a failed compile skips it with one line."""

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
        for ext in self.extensions:
            self.compile_library(cc, ext)

    def compile_library(self, cc: list[str], ext: Extension) -> None:
        (source,) = ext.sources
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        digest = Path(self.build_temp) / f"{ext.name}.sha256.c"
        digest.parent.mkdir(parents=True, exist_ok=True)
        sha = hashlib.sha256(Path(source).read_bytes()).hexdigest()
        digest.write_text(f'const char {SOURCE_SYMBOL}[65] = "{sha}";\n')
        flags = [*ext.extra_compile_args, *shlex.split(os.environ.get(ENV_FLAGS, ""))]
        cmd = [*cc, *flags, source, str(digest), "-o", str(out)]
        print(" ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            out.unlink(missing_ok=True)
            print(
                f"kvbench: {ext.name} not built, the torch paths are used: {cc[0]} failed: "
                f"{' | '.join(r.stderr.strip().splitlines())[:300]}",
                file=sys.stderr,
            )


setup(
    ext_modules=[
        Extension(name, [source], extra_compile_args=module_flags(module), optional=True)
        for name, source, module in LIBRARIES
    ],
    cmdclass={"build_ext": BuildNative},
)
