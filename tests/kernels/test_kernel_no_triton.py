"""The kernels package without Triton, and its import hygiene (subprocesses)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

RUNS_WITHOUT_TRITON = True  # conftest: not skipped when Triton is missing
ROOT = Path(__file__).resolve().parents[2]

BLOCK_TRITON = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton blocked for this test")
sys.meta_path.insert(0, _Block())
"""


def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_imports_and_references_without_triton():
    code = (
        BLOCK_TRITON
        + """
import torch
import kvbench.kernels as K
from kvbench.kernels import pack, quantize, decode_attention, dispatch
assert K.HAS_TRITON is False and K.triton_version() is None
assert "triton" not in sys.modules
c = torch.tensor([[1, 2, 3, 0, 1]])
assert pack.pack_reference(c, 2).tolist() == [[0x39, 0x01]]
try:
    pack.pack_bits(c, 2)
except K.TritonUnavailable as e:
    assert "pip install" in str(e)
else:
    raise AssertionError("a launch without Triton must raise TritonUnavailable")
q, k = torch.randn(1, 2, 1, 64), torch.randn(1, 1, 5, 64)
assert decode_attention.decode_attention_reference(q, k, k).shape == (1, 2, 1, 64)
class Cache: pass
assert dispatch.try_fused_attend(Cache(), q, layouts=dispatch.Layouts({}, {})) is None
print("ok")
"""
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_import_hygiene_in_a_fresh_process():
    # kvbench.kernels (and dispatch, which layer.py may import) does not import Triton; the
    # kernel modules, imported from the source tree (PYTHONPATH=.), pull no transformers/datasets
    code = """
import sys
import kvbench.kernels, kvbench.kernels.dispatch
print("triton" in sys.modules)
import kernels.pack, kernels.quantize, kernels.decode_attention, kernels.dispatch
print(sorted({m.split(".")[0] for m in sys.modules} & {"transformers", "datasets"}))
"""
    r = _run(code, {"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["False", "[]"]


def test_kernel_modules_import_only_torch_triton_and_stdlib():
    # the Triton kernel modules' imports (benchmarks/triton_decode.py, which reaches the core,
    # is a benchmark and lives in benchmarks/)
    allowed = {
        "torch",
        "triton",
        "__future__",
        "dataclasses",
        "functools",
        "importlib",
        "math",
        "os",
    }
    # the Triton kernel modules; not the backend adapters, which read the core's blocks
    # (triton_backend.py, cpu/): the core never imports them, it loads them by entry point
    for path in sorted((ROOT / "kernels").glob("*.py")):
        if path.name == "triton_backend.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            assert all(n.split(".")[0] in allowed for n in names), (path.name, names)
