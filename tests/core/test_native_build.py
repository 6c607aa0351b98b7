"""The native libraries come from the package's build (setup.py), next to their modules.

The build itself (setup.py's ``BuildNative`` run by setuptools, with a fake compiler on
``$CC`` that logs when each of its runs starts and ends): the translation units of all
libraries compile concurrently, ``$KVBENCH_NATIVE_JOBS`` at a time (intervals overlapping with
2 jobs, one after the other with 1), each library linked after its own units from their object
files and its source digest; a unit that fails leaves its library unbuilt (an earlier build of
it removed) with one line naming the unit, and the other libraries built.  The units setup.py
lists for ``codes.c`` are that file's ``KV_UNIT_*`` bits, each once, together all of them.

Right values: the library loaded is the file ``_<name>.so`` beside the module that loads it,
its ABI is the module's and its ``kvbench_source_sha256`` is the SHA-256 of the module's C
source, computed here with hashlib.  A library that is missing, stale (its source edited since
the build) or of another ABI is unavailable with a reason naming the file and the command that
builds it, and the callers' torch paths give the values they give with the library: the
quantizer's blocks bit for bit, the decode attention within float32 rounding of the reference.
"""

from __future__ import annotations

import ast
import ctypes
import hashlib
import importlib
import json
import re
import runpy
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import setuptools
import torch

import kvbench
from kvbench.cache import native_quant
from kvbench.cache.blocks import PerTokenCodec
from kvbench.kernels.cpu import codedomain, native

# (module, the file setup.py builds next to it, its ABI symbol, its NativeLibrary's name)
LIBRARIES = [
    (native, "_codes.so", "kv_abi_version", "native kernels"),
    (native_quant, "_affine.so", "kq_abi_version", "native quantizer"),
]
IDS = ["codes", "affine"]


def _reset(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> None:
    """Forget the loaded library (restored after the test) so the next call loads again, with
    ``KVBENCH_NATIVE`` unset."""
    monkeypatch.setattr(module._NATIVE, "lib", None)
    monkeypatch.setattr(module._NATIVE, "reason", None)
    monkeypatch.delenv("KVBENCH_NATIVE", raising=False)


def _require_built(module: ModuleType, name: str) -> None:
    """Skip unless ``name`` was built next to ``module`` (no compiler at install, a source
    checkout never built)."""
    if not Path(module.__file__).with_name(name).exists():
        pytest.skip(f"not built: {module.unavailable_reason()}")


def test_setup_builds_each_library_where_its_module_loads_it():
    """setup.py's table: each library's file (``<name>.so`` in its dotted package's folder,
    ``kvbench.kernels`` being ``kernels/``), C source and flag-holding module are the loading
    module's :data:`LIBRARY`, :data:`SOURCE` and file."""
    setup_py = Path(__file__).resolve().parents[2] / "setup.py"
    if not setup_py.exists():
        pytest.skip("not a source checkout")
    (table,) = (
        ast.literal_eval(node.value)
        for node in ast.parse(setup_py.read_text()).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LIBRARIES"
    )
    root = Path(kvbench.__file__).parent.parent

    def library_file(dotted: str) -> Path:
        package, name = dotted.rsplit(".", 1)
        return Path(importlib.import_module(package).__file__).parent / f"{name}.so"

    def real(*paths: Path) -> tuple[Path, ...]:  # kvbench/kernels may be a link to kernels/
        return tuple(p.resolve() for p in paths)

    built = {real(library_file(lib), root / src, root / mod) for lib, src, mod, _units in table}
    assert built == {real(m.LIBRARY, m.SOURCE, Path(m.__file__)) for m, *_ in LIBRARIES}


@pytest.mark.parametrize(("module", "name", "abi", "what"), LIBRARIES, ids=IDS)
def test_the_loaded_library_is_the_build_next_to_the_module(module, name, abi, what, monkeypatch):
    _require_built(module, name)
    _reset(monkeypatch, module)
    lib = module._load()
    assert lib is not None, module.unavailable_reason()
    assert Path(lib._name) == Path(module.__file__).with_name(name)
    assert getattr(lib, abi)() == module.ABI_VERSION
    built = (ctypes.c_char * 65).in_dll(lib, "kvbench_source_sha256").value.decode()
    assert built == hashlib.sha256(module.SOURCE.read_bytes()).hexdigest()


@pytest.mark.parametrize(("module", "name", "abi", "what"), LIBRARIES, ids=IDS)
def test_a_missing_library_names_the_build_command(module, name, abi, what, monkeypatch, tmp_path):
    _reset(monkeypatch, module)
    missing = tmp_path / name
    monkeypatch.setattr(module, "LIBRARY", missing)
    assert not module.available() and module._load() is None
    reason = module.unavailable_reason()
    assert reason.startswith(f"{what} unavailable: FileNotFoundError: {missing} was not built")
    assert "`pip install -e .`" in reason


@pytest.mark.parametrize(("module", "name", "abi", "what"), LIBRARIES, ids=IDS)
def test_a_stale_build_is_refused(module, name, abi, what, monkeypatch, tmp_path):
    """A source edited since the build, then an ABI bumped without a rebuild."""
    _require_built(module, name)
    edited = tmp_path / module.SOURCE.name
    edited.write_bytes(module.SOURCE.read_bytes() + b"/* edited */\n")
    monkeypatch.setattr(module, "SOURCE", edited)
    _reset(monkeypatch, module)
    assert not module.available()
    assert f"was built from another version of {edited}" in module.unavailable_reason()
    monkeypatch.undo()
    _reset(monkeypatch, module)
    monkeypatch.setattr(module, "ABI_VERSION", module.ABI_VERSION + 1)
    assert not module.available()
    assert f"has ABI {module.ABI_VERSION - 1}, expected {module.ABI_VERSION}" in (
        module.unavailable_reason()
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (so -0.0 differs from 0.0)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(view)


def test_without_the_quantizer_the_torch_path_gives_the_same_block(monkeypatch, tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 64, generator=g).half()
    codec = PerTokenCodec(3, torch.float16, channel_group=32)
    with_lib = codec.encode(x) if native_quant.available() else None
    _reset(monkeypatch, native_quant)
    monkeypatch.setattr(native_quant, "LIBRARY", tmp_path / "_affine.so")
    assert native_quant.quantize_pack(x, 3, 1, 32) is None
    block = codec.encode(x)
    # per-token groups of 32 channels: zero the group min as float16, scale the float16 at or
    # just above (max - zero) / 7
    groups = x.float().reshape(2, 3, 40, 2, 32)
    assert torch.equal(_bits(block.zero), _bits(groups.amin(-1).half()))
    need, s = (groups.amax(-1) - block.zero.float()) / 7, block.scale.float()
    assert bool((s >= need).all()) and bool((s - need <= s * 2**-10).all())
    if with_lib is not None:
        for a, b in ((block.codes, with_lib.codes), (block.scale, with_lib.scale)):
            assert torch.equal(_bits(a), _bits(b))
        assert torch.equal(_bits(block.zero), _bits(with_lib.zero))


def test_without_the_kernels_decode_attention_takes_the_eager_path(monkeypatch, tmp_path):
    h = 3
    lc = kvbench.get_method("kivi", bits=2, group_size=16, residual_length=16).new_layer(0, h, 64)
    g = torch.Generator().manual_seed(0)
    lc.prefill(torch.randn(1, h, 70, 64, generator=g), torch.randn(1, h, 70, 64, generator=g))
    q = torch.randn(1, 2 * h, 1, 64, generator=g)
    with_lib = lc.attend(q) if native.available() else None
    _reset(monkeypatch, native)
    monkeypatch.setattr(native, "LIBRARY", tmp_path / "_codes.so")
    out = lc.attend(q)
    assert lc.attend_path == codedomain.EAGER_PATH
    with codedomain.cpu_attention_mode("reference"):
        ref = lc.attend(q).double()
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    if with_lib is not None:
        assert float((with_lib.double() - ref).abs().max() / ref.abs().max()) < 1e-5


ROOT = Path(__file__).resolve().parents[2]
# a C compiler's stand-in: writes its -o file, logs its run (a compile sleeps
# $FAKE_CC_SECONDS first), and fails with a message when $FAKE_CC_FAIL is one of its arguments
FAKE_CC = """\
import json, os, sys, time

args = sys.argv[1:]
start = time.time()
if "-c" in args:
    time.sleep(float(os.environ["FAKE_CC_SECONDS"]))
if os.environ.get("FAKE_CC_FAIL") in args:
    print("fake-cc: error: cannot compile this unit", file=sys.stderr)
    sys.exit(1)
out = args[args.index("-o") + 1]
with open(out, "w") as f:
    f.write("built")
record = {"args": args, "out": out, "start": start, "end": time.time()}
with open(os.environ["FAKE_CC_LOG"], "a") as log:
    log.write(json.dumps(record) + "\\n")
"""


@pytest.fixture(scope="module")
def setup_py() -> dict[str, Any]:
    """setup.py's names, run from the checkout's root with ``setuptools.setup`` doing nothing."""
    if not (ROOT / "setup.py").exists():
        pytest.skip("not a source checkout")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(setuptools, "setup", lambda **kwargs: None)
        mp.chdir(ROOT)
        return runpy.run_path(str(ROOT / "setup.py"), run_name="kvbench_setup")


def _fake_build(
    setup_py: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    jobs: int,
    fail: str | None = None,
) -> list[dict[str, Any]]:
    """Run setup.py's ``BuildNative`` (as setuptools does) on two libraries: ``pkg._a`` from
    ``a.c`` in units ``U1``, ``U2`` and ``pkg._b`` from ``b.c`` whole, with the fake compiler
    as ``$CC``, ``jobs`` compiles at a time; the compiler's log, in the order its runs ended."""
    script, log = tmp_path / "fake_cc.py", tmp_path / "cc.jsonl"
    script.write_text(FAKE_CC)
    for name in ("a", "b"):
        (tmp_path / f"{name}.c").write_text(f"int {name};\n")
    monkeypatch.setenv("CC", f"{sys.executable} {script}")
    monkeypatch.setenv("FAKE_CC_LOG", str(log))
    monkeypatch.setenv("FAKE_CC_SECONDS", "0.6")
    monkeypatch.setenv("KVBENCH_NATIVE_JOBS", str(jobs))
    monkeypatch.delenv("KVBENCH_NATIVE_CFLAGS", raising=False)
    if fail is not None:
        monkeypatch.setenv("FAKE_CC_FAIL", fail)
    ext = setup_py["NativeExtension"]
    dist = setuptools.Distribution(
        {
            "name": "fake",
            "ext_modules": [
                ext("pkg._a", str(tmp_path / "a.c"), ["-O2", "-shared"], ("U1", "U2")),
                ext("pkg._b", str(tmp_path / "b.c"), ["-O1", "-shared"], ()),
            ],
        }
    )
    cmd = setup_py["BuildNative"](dist)
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "temp")
    cmd.ensure_finalized()
    cmd.run()
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _compiles(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((r for r in runs if "-c" in r["args"]), key=lambda r: r["start"])


def test_the_build_compiles_the_units_concurrently_then_links_each_library(
    setup_py, tmp_path, monkeypatch
):
    runs = _fake_build(setup_py, tmp_path, monkeypatch, jobs=2)
    compiles = {Path(r["out"]).name: r for r in sorted(_compiles(runs), key=lambda r: r["out"])}
    assert list(compiles) == ["pkg._a.U1.o", "pkg._a.U2.o", "pkg._b.all.o"]
    # the first two (pkg._a's units) run at once: each starts before the other ends
    u1, u2 = compiles["pkg._a.U1.o"], compiles["pkg._a.U2.o"]
    assert u2["start"] < u1["end"] and u1["start"] < u2["end"]
    for r, define, opt in zip(compiles.values(), ("-DKV_UNIT=U1", "-DKV_UNIT=U2", None), "221"):
        assert r["args"][:2] == [f"-O{opt}", "-shared"]
        assert (define in r["args"]) if define else not any("KV_UNIT" in a for a in r["args"])
        assert r["args"][-4:-2] == ["-c", str(tmp_path / ("a.c" if define else "b.c"))]
    temp, lib = tmp_path / "temp", tmp_path / "lib" / "pkg"
    links = {r["out"]: r for r in runs if "-c" not in r["args"]}
    assert set(links) == {str(lib / "_a.so"), str(lib / "_b.so")}
    for name, units in (("a", ("U1", "U2")), ("b", ("all",))):
        link = links[str(lib / f"_{name}.so")]
        digest = temp / f"pkg._{name}.sha256.c"
        objects = [str(temp / f"pkg._{name}.{u}.o") for u in units]
        assert link["args"][2:] == [*objects, str(digest), "-o", str(lib / f"_{name}.so")]
        assert link["start"] >= max(r["end"] for r in compiles.values() if r["out"] in objects)
        sha = hashlib.sha256((tmp_path / f"{name}.c").read_bytes()).hexdigest()
        assert digest.read_text() == f'const char kvbench_source_sha256[65] = "{sha}";\n'
        assert (lib / f"_{name}.so").read_text() == "built"


def test_one_job_compiles_one_unit_at_a_time(setup_py, tmp_path, monkeypatch):
    compiles = _compiles(_fake_build(setup_py, tmp_path, monkeypatch, jobs=1))
    assert len(compiles) == 3
    assert all(b["start"] >= a["end"] for a, b in zip(compiles, compiles[1:]))


def test_a_failed_unit_leaves_its_library_unbuilt_and_builds_the_others(
    setup_py, tmp_path, monkeypatch, capfd
):
    stale = tmp_path / "lib" / "pkg" / "_a.so"  # an earlier build of pkg._a: removed
    stale.parent.mkdir(parents=True)
    stale.write_text("old")
    runs = _fake_build(setup_py, tmp_path, monkeypatch, jobs=2, fail="-DKV_UNIT=U2")
    assert not stale.exists()
    assert (tmp_path / "lib" / "pkg" / "_b.so").read_text() == "built"
    assert sorted(Path(r["out"]).name for r in runs) == ["_b.so", "pkg._a.U1.o", "pkg._b.all.o"]
    err = capfd.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("kvbench:")] == [
        f"kvbench: pkg._a not built, the torch paths are used: {sys.executable} failed on "
        "KV_UNIT=U2: fake-cc: error: cannot compile this unit"
    ]


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_the_job_count_is_a_positive_integer(setup_py, monkeypatch, value):
    monkeypatch.setenv("KVBENCH_NATIVE_JOBS", value)
    with pytest.raises(ValueError, match="KVBENCH_NATIVE_JOBS must be a positive integer"):
        setup_py["native_jobs"]()
    monkeypatch.setenv("KVBENCH_NATIVE_JOBS", "3")
    assert setup_py["native_jobs"]() == 3


def test_the_units_of_codes_c_are_all_of_it_each_once(setup_py):
    """Every ``KV_UNIT_*`` bit of codes.c is in exactly one unit setup.py compiles (a function
    in no unit would be missing from the library, one in two defined twice)."""
    ((_, source, _, units),) = (t for t in setup_py["LIBRARIES"] if t[0].endswith("._codes"))
    text = (ROOT / source).read_text()
    bits = {n: int(v) for n, v in re.findall(r"^#define (KV_UNIT_\w+) (\d+)\b", text, re.M)}
    every = bits.pop("KV_UNIT_ALL")
    assert all(v & (v - 1) == 0 for v in bits.values()), "one bit a unit"
    assert len(set(units)) == len(units) and set(units) == set(bits)
    assert sum(bits[u] for u in units) == every
