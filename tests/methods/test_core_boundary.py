"""Methods use the core through its public names only: no private import from ``kvbench.*``
and no override of a core class's private member (a method extends public hooks such as
``LayerCache.finish_prefill``, ``Method.key_layout``)."""

from __future__ import annotations

import abc
import ast
import importlib
import inspect
from pathlib import Path

import pytest

METHODS = sorted(
    p
    for p in (Path(__file__).resolve().parents[2] / "methods").glob("*.py")
    if p.stem != "__init__"
)


def _core(cls: type) -> bool:
    mod = cls.__module__
    return mod.startswith("kvbench.") and not mod.startswith("kvbench.methods")


@pytest.mark.parametrize("path", METHODS, ids=lambda p: p.stem)
def test_no_private_core_imports(path: Path) -> None:
    tree = ast.parse(path.read_text())
    bad = [
        f"{node.module}.{a.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvbench")
        for a in node.names
        if a.name.startswith("_")
    ]
    assert not bad, f"{path.name} imports private core names {bad}"


@pytest.mark.parametrize("path", METHODS, ids=lambda p: p.stem)
def test_no_private_core_overrides(path: Path) -> None:
    mod = importlib.import_module(f"kvbench.methods.{path.stem}")
    bad = []
    for _, cls in inspect.getmembers(mod, inspect.isclass):
        if cls.__module__ != mod.__name__:
            continue
        core_bases = [b for b in cls.__mro__[1:] if _core(b)]
        for name in cls.__dict__:
            if name in vars(abc.ABC):  # set by ABCMeta on every subclass, not by the method
                continue
            if name.startswith("_") and not name.startswith("__"):
                if any(name in b.__dict__ for b in core_bases):
                    bad.append(f"{cls.__name__}.{name}")
    assert not bad, f"{path.name} overrides private core members {bad}"
