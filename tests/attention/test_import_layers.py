"""The core folders form no import cycle, and the core never imports a method.

Every module under ``kvbench/`` is parsed (AST, imports inside functions included); an import
of ``kvbench.<folder>...`` (absolute or relative) from a module in another core folder is an edge
between the two folders.  The test fails on any cycle between the folders and on any import of
``kvbench.methods`` from the core.

One edge is the designed seam and is left out of the folder graph: ``kvbench.cache.layer``
calls :func:`kvbench.attention.dispatch.attend` (explicit dispatch, no import-time hook).  It
stays acyclic at the module level: no module of ``kvbench.attention`` imports
``kvbench.cache.layer``, and that is the only import of ``kvbench.attention`` in
``kvbench.cache``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

KVBENCH = Path(__file__).resolve().parents[2] / "kvbench"
FOLDERS = ("cache", "attention", "hf", "data", "bench", "measure", "report", "integrations")
#: (module, imported module): the one cross-folder edge the folder graph leaves out
SEAM = ("kvbench.cache.layer", "kvbench.attention.dispatch")


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(KVBENCH.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(path: Path) -> list[str]:
    """Absolute dotted names imported by ``path`` (relative imports resolved)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            out.append(name)
            out += [f"{name}.{a.name}" for a in node.names]  # ``from kvbench import attend``
    return out


def folder_of(dotted: list[str]) -> str | None:
    return (
        dotted[1] if len(dotted) > 1 and dotted[0] == "kvbench" and dotted[1] in FOLDERS else None
    )


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {f: set() for f in FOLDERS}
    for path in KVBENCH.rglob("*.py"):
        src = folder_of(_module(path))
        if src is None:
            continue
        for name in imports(path):
            if (".".join(_module(path)), name) == SEAM or name == "kvbench.attention":
                continue  # the seam (``from kvbench.attention import dispatch`` names both)
            dst = folder_of(name.split("."))
            if dst and dst != src:
                graph[src].add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_cycle_between_core_folders():
    cycle = find_cycle(edges())
    assert cycle is None, f"import cycle between core folders: {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_cache_does_not_import_attention_and_attention_imports_cache():
    g = edges()
    assert "attention" not in g["cache"] and "cache" in g["attention"]


def test_the_core_imports_no_method():
    bad = [
        (str(p.relative_to(KVBENCH.parent)), name)
        for p in KVBENCH.rglob("*.py")
        for name in imports(p)
        if name == "kvbench.methods" or name.startswith("kvbench.methods.")
    ]
    assert not bad, f"core modules import methods: {bad}"


def test_the_seam_is_the_only_import_of_attention_in_cache_and_has_no_cycle():
    cache_to_attention = sorted(
        (".".join(_module(p)), name)
        for p in (KVBENCH / "cache").rglob("*.py")
        for name in imports(p)
        if folder_of(name.split(".")) == "attention"
    )
    assert cache_to_attention == [
        ("kvbench.cache.layer", "kvbench.attention"),
        SEAM,
    ], cache_to_attention
    back = [
        (".".join(_module(p)), name)
        for p in (KVBENCH / "attention").rglob("*.py")
        for name in imports(p)
        if name == "kvbench.cache.layer" or name.startswith("kvbench.cache.layer.")
    ]
    assert not back, f"attention modules import kvbench.cache.layer: {back}"


def test_attend_needs_only_the_layer_module():
    # a fresh interpreter: import the layer cache alone, attend, and get the code-domain path
    code = (
        "import sys, torch\n"
        "from kvbench.cache.layer import LayerCache\n"
        "from kvbench.cache.blocks import PerChannelCodec\n"
        "from kvbench.cache.schedule import BlockSchedule\n"
        "lc = LayerCache(PerChannelCodec(2, group_size=4), None, BlockSchedule(4))\n"
        "x = torch.randn(1, 2, 12, 16)\n"
        "lc.prefill(x, x)\n"
        "assert lc.attend(torch.randn(1, 4, 1, 16)).shape == (1, 4, 1, 16)\n"
        "assert lc.attend_path.startswith('cpu-'), lc.attend_path\n"
        "assert 'kvbench.methods' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_methods_import_no_attention_backend():
    # a method declares its layout by building blocks of a core type; the code-domain kernels
    # of those blocks live in kvbench.attention.blocks, registered in kvbench.attention.dispatch.
    # A method may use the public reference math (kvbench.attention.reference), nothing else.
    methods = KVBENCH.parent / "methods"
    bad = [
        (p.name, name)
        for p in sorted(methods.glob("*.py"))
        for name in imports(p)
        if name.startswith("kvbench.attention")
        and not name.startswith("kvbench.attention.reference")
    ]
    assert not bad, f"methods import attention backends: {bad}"
