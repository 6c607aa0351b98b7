"""Test-wide helpers for data-dependent tests.

A test that needs a dataset carries the ``data`` marker and gets it through
``data_helpers.dataset`` (the public source, the local folder named by ``KVBENCH_DATA_DIR``, or a
pip package) or ``data_helpers.local_data_dir``, which skip with a reason naming the dataset and
how to provide it. With
``KVBENCH_REQUIRE_DATA=1`` (set by ``.ci/run`` when a data folder is given) a skipped ``data``
test fails instead, so CI cannot pass by skipping.

Triton: on a machine without CUDA, ``TRITON_INTERPRET=1`` is set here, before any test module is
collected.  Triton decides interpreted vs compiled when a ``@triton.jit`` function is decorated,
and importing transformers' generation code (which many tests do) imports torch's inductor and,
through it, Triton's own jit'd language functions; decorated compiled, those cannot be called
from the interpreted kernels of ``tests/kernels``.  Without CUDA no compiled Triton kernel can
run anyway, and torch's CPU compiler does not use Triton.

Mutation testing (docs/mutation.md): while mutmut runs a mutant's tests (``MUTANT_UNDER_TEST``
names a mutant) the tests that took over half a second in mutmut's recorded stats run last, in
their collected order otherwise: a mutant is killed at its first failing test (``-x``), usually a
fast one.  The same tests run either way; only a killed mutant's wait changes.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is not None and "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

REQUIRE_ENV = "KVBENCH_REQUIRE_DATA"


SLOW_UNDER_MUTATION_S = 0.5


def pytest_collection_modifyitems(config, items):
    """Under mutmut (a mutant's run, not its stats or clean runs): slow tests last."""
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    stats = Path("mutmut-stats.json")  # mutmut runs the tests from mutants/, beside its stats
    if not stats.is_file():
        return
    dur = json.loads(stats.read_text()).get("duration_by_test", {})
    items.sort(key=lambda it: dur.get(it.nodeid, 0.0) > SLOW_UNDER_MUTATION_S)  # stable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if (
        rep.skipped
        and os.environ.get(REQUIRE_ENV) == "1"
        and item.get_closest_marker("data") is not None
    ):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"data test skipped while {REQUIRE_ENV}=1 (a data folder is given): {reason}"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module (``pytestmark = pytest.mark.usefixtures(
    "one_thread")``): tiny models gain nothing from more and only spin on a busy machine; the
    previous setting is restored for the other modules."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
