"""Kernel tests run on CPU in the Triton interpreter (``TRITON_INTERPRET=1``).

Triton decides interpreted vs compiled when a ``@triton.jit`` function is decorated, i.e. when
the kernel modules are imported, and reads the variable again while launching.  So this conftest
sets ``TRITON_INTERPRET=1`` while it imports (or re-imports) the kernel modules, then puts the
environment back; an autouse fixture sets it again for each test of this folder only.  The
setting does not leak into other test folders, and nothing outside ``tests/kernels`` imports
Triton.  Without Triton every test here is skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
KERNEL_MODULES = ("_triton", "pack", "quantize", "decode_attention", "dispatch")


def _load_interpreted() -> None:
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:  # in dependency order, so a reloaded module is what the later ones import from
        for name in KERNEL_MODULES:
            mod = sys.modules.get(f"kvbench.kernels.{name}")
            if mod is None:
                importlib.import_module(f"kvbench.kernels.{name}")
            else:  # imported (compiled) before this conftest: decorate again, interpreted
                importlib.reload(mod)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


if HAVE_TRITON:
    _load_interpreted()


def pytest_collection_modifyitems(config, items):
    if HAVE_TRITON:
        return
    skip = pytest.mark.skip(reason="Triton is not installed (pip install triton)")
    here = os.path.dirname(__file__)
    for item in items:
        runs_anyway = getattr(getattr(item, "module", None), "RUNS_WITHOUT_TRITON", False)
        if str(item.fspath).startswith(here) and not runs_anyway:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def poison(monkeypatch):
    """Fill every tensor the kernels' host wrappers allocate with garbage (NaN for floats,
    0xAB / -12345 for integers), so that an element a kernel fails to write cannot pass."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(0xAB)
        elif t.dtype != torch.bool:
            t.fill_(-12345)
        return t

    def poisoned_like(t, *args, **kwargs):
        return poisoned(
            t.shape,
            *args,
            dtype=kwargs.pop("dtype", t.dtype),
            device=kwargs.pop("device", t.device),
            **kwargs,
        )

    monkeypatch.setattr(torch, "empty", poisoned)
    monkeypatch.setattr(torch, "empty_like", poisoned_like)
    return poisoned


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)
