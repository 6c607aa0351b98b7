"""The repository's modules form no import cycle, and the core stays below the edge.

Every module of the repository's packages is parsed (AST, imports inside functions included):
``kvbench/`` (its ``methods`` and ``kernels`` subpackages live in ``methods/`` and ``kernels/``)
and ``benchmarks/``.  Each import is an edge from the importing module to the module it names:
relative imports are resolved against the importing package, ``from pkg import name`` is an edge
to ``pkg.name`` when that is a module and to ``pkg`` otherwise, and a package ``__init__`` is a
module of its own (``kvbench.cache``).  The tests fail on

- any import cycle between modules (a strongly connected component of more than one module, or
  a module importing itself), naming the modules and the import lines that close the cycle;
- any path of imports from the core to ``kvbench.integrations``, ``kvbench.methods``,
  ``kvbench.kernels``, ``benchmarks`` or ``kvbench.cli`` (the edge imports the core, never the
  reverse: the core reaches methods, workloads and attention backends through entry points);
- any import of an attention backend (``kvbench.kernels``, anything of ``kvbench.attention``
  but the reference math) from a method;
- any path from ``kvbench.cache`` to ``kvbench.bench``, ``kvbench.report`` or ``kvbench.hf``;
- any import of the glibc heap tuning but the memory workload's.

An import of ``pkg.mod`` also runs ``pkg/__init__.py`` first; that implicit step is not an edge
(Python initializes a package before its submodules, so it closes no cycle by itself).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Folder of the checkout -> dotted package it is installed as.  ``kvbench/methods`` and
# ``kvbench/kernels`` may be symlinks in a working tree: they are skipped under ``kvbench/``.
PACKAGES: dict[str, str] = {
    "kvbench": "kvbench",
    "methods": "kvbench.methods",
    "kernels": "kvbench.kernels",
    "benchmarks": "benchmarks",
}
SKIP_UNDER_KVBENCH = ("methods", "kernels")

CORE = (
    "kvbench.cache",
    "kvbench.attention",
    "kvbench.hf",
    "kvbench.data",
    "kvbench.bench",
    "kvbench.measure",
    "kvbench.report",
    "kvbench.registry",
    "kvbench.clib",
    "kvbench.paths",
    "kvbench.jsontypes",
)
EDGE = ("kvbench.integrations", "kvbench.methods", "kvbench.kernels", "benchmarks", "kvbench.cli")
HEAP, HEAP_USER = "kvbench.measure.heap", "kvbench.bench.workloads.memory"


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int


def under(name: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted ``name`` is one of ``prefixes`` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the repository's packages."""
    out: dict[str, Path] = {}
    for folder, dotted in PACKAGES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if folder == "kvbench" and rel.parts[0] in SKIP_UNDER_KVBENCH:
                continue
            parts = [*dotted.split("."), *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: Mapping[str, Path]) -> list[Import]:
    """Imports of module ``name`` (file ``path``) that land on a module in ``known``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    rel = str(path.relative_to(ROOT))

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):  # longest known prefix
            if ".".join(parts[:n]) in known:
                return ".".join(parts[:n])
        return None

    out = []
    for node in ast.walk(ast.parse(path.read_text(), rel)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                targets.append(sub if sub in known else mod)
        for t in targets:
            if (hit := resolve(t)) is not None:
                out.append(Import(name, hit, rel, node.lineno))
    return out


def graph() -> dict[str, list[Import]]:
    """Module -> its imports of other repository modules."""
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def components(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of ``edges`` (Tarjan), each sorted, largest first.

    A component of one node is listed only when the node has an edge to itself.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        on_stack.add(n)
        for m in sorted(edges.get(n, ())):
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in on_stack:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            comp = []
            while True:
                m = stack.pop()
                on_stack.discard(m)
                comp.append(m)
                if m == n:
                    break
            if len(comp) > 1 or n in edges.get(n, ()):
                found.append(sorted(comp))

    for n in sorted(edges):
        if n not in index:
            visit(n)
    return sorted(found, key=lambda c: (-len(c), c))


def path_between(edges: Mapping[str, Iterable[str]], start: str, goal: str) -> list[str] | None:
    """A shortest path ``start -> ... -> goal`` of at least one edge (breadth first), or None."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for n in frontier:
            for m in sorted(edges.get(n, ())):
                if m == goal:
                    path = [m, n]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1]
                if m not in parent and m != start:
                    parent[m] = n
                    nxt.append(m)
        frontier = nxt
    return None


def describe(path: list[str], g: Mapping[str, list[Import]]) -> str:
    """``a -> b -> c`` plus the file and line of the first import behind each edge."""
    lines = [" -> ".join(path)]
    for a, b in zip(path, path[1:]):
        imp = next(i for i in g[a] if i.target == b)
        lines.append(f"    {imp.path}:{imp.line} imports {b}")
    return "\n".join(lines)


def adjacency(g: Mapping[str, list[Import]]) -> dict[str, set[str]]:
    return {n: {i.target for i in imps} for n, imps in g.items()}


def test_the_packages_are_all_parsed():
    known = modules()
    for name in (
        "kvbench",
        "kvbench.cache.layer",
        "kvbench.methods",
        "kvbench.methods.kivi",
        "kvbench.kernels.decode_attention",
        "benchmarks.decode_step",
    ):
        assert name in known, name
    assert not any(n.startswith("kvbench.kvbench") for n in known)


def test_imports_resolve_relative_and_submodule_names():
    g = graph()
    targets = {i.target for i in g["kvbench.bench.workloads.ruler"]}  # ``from .passkey import``
    assert "kvbench.bench.workloads.passkey" in targets
    # ``from kvbench.hf import attention`` is an import of the submodule
    targets = {i.target for i in g["benchmarks.decode_step"]}
    assert "kvbench.hf.attention" in targets


def test_no_import_cycle_between_modules():
    g = graph()
    adj = adjacency(g)
    cycles = [describe(path_between(adj, c[0], c[0]) or [c[0]], g) for c in components(adj)]
    assert not cycles, "import cycles between modules:\n" + "\n".join(cycles)


def reach_violations(sources: Iterable[str], forbidden: Iterable[str], shown: int = 5) -> list[str]:
    """The shortest import paths from modules under ``sources`` to modules under ``forbidden``
    (one per source module, the ``shown`` shortest, then a count of the rest)."""
    g = graph()
    adj = adjacency(g)
    targets = sorted(n for n in g if under(n, tuple(forbidden)))
    paths = []
    for src in sorted(n for n in g if under(n, tuple(sources))):
        found = [p for dst in targets if (p := path_between(adj, src, dst)) is not None]
        if found:
            paths.append(min(found, key=len))
    paths.sort(key=len)
    more = [f"... and {len(paths) - shown} more modules"] if len(paths) > shown else []
    return [describe(p, g) for p in paths[:shown]] + more


def test_the_core_never_imports_the_edge():
    bad = reach_violations(CORE, EDGE)
    assert not bad, "the core imports the edge:\n" + "\n".join(bad)


def test_the_cache_never_imports_bench_report_or_hf():
    bad = reach_violations(["kvbench.cache"], ["kvbench.bench", "kvbench.report", "kvbench.hf"])
    assert not bad, "kvbench.cache imports a layer above it:\n" + "\n".join(bad)


def test_heap_tuning_belongs_to_the_memory_workload():
    """glibc heap tuning (``kvbench.measure.heap``) changes how the process allocates: only the
    memory workload's measurement may import it."""
    g = graph()
    users = sorted(n for n, imps in g.items() if any(i.target == HEAP for i in imps))
    assert users == [HEAP_USER], users


def test_the_cycle_finder_finds_cycles():
    ring = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert components(ring) == [["a", "b", "c"]]
    assert path_between(ring, "a", "a") == ["a", "b", "c", "a"]
    assert components({"a": {"b"}, "b": set()}) == []
    assert components({"a": {"a"}}) == [["a"]]
    two = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}}
    assert components(two) == [["c", "d", "e"], ["a", "b"]]
    assert path_between({"a": {"b"}, "b": set()}, "b", "a") is None


def test_the_dispatch_call_is_the_only_import_of_attention_in_cache():
    """``LayerCache.attend`` calls :func:`kvbench.attention.dispatch.attend` (explicit dispatch,
    no import-time hook); no module of ``kvbench.attention`` imports ``kvbench.cache.layer``, so
    the seam adds no cycle."""
    g = graph()
    seam = sorted(
        (n, i.target)
        for n, imps in g.items()
        if under(n, ["kvbench.cache"])
        for i in imps
        if under(i.target, ["kvbench.attention"])
    )
    assert seam == [("kvbench.cache.layer", "kvbench.attention.dispatch")], seam
    back = sorted(
        (n, i.target)
        for n, imps in g.items()
        if under(n, ["kvbench.attention"])
        for i in imps
        if i.target == "kvbench.cache.layer"
    )
    assert not back, f"attention modules import kvbench.cache.layer: {back}"


def test_attend_needs_only_the_layer_module():
    """A fresh interpreter imports the layer cache alone, attends, and gets a code-domain path
    (the dispatch loads the backend through its entry point)."""
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
    """A method declares its layout by building blocks of a core type or of a type defined in
    its own module; the code-domain kernels of those blocks live in ``kvbench.kernels.cpu``.
    A method may use the public reference math (``kvbench.attention.reference``), nothing else
    of ``kvbench.attention`` and nothing of ``kvbench.kernels``."""
    g = graph()
    bad = sorted(
        (n, i.target)
        for n, imps in g.items()
        if under(n, ["kvbench.methods"])
        for i in imps
        if under(i.target, ["kvbench.attention", "kvbench.kernels"])
        and not under(i.target, ["kvbench.attention.reference"])
    )
    assert not bad, f"methods import attention backends: {bad}"
