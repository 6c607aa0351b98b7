"""The native libraries come from the package's build (setup.py), next to their modules.

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
from pathlib import Path
from types import ModuleType

import pytest
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

    built = {(library_file(lib), root / src, root / mod) for lib, src, mod in table}
    assert built == {(m.LIBRARY, m.SOURCE, Path(m.__file__)) for m, *_ in LIBRARIES}


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
