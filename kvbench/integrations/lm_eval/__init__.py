"""kvbench as an EleutherAI lm-evaluation-harness model backend (``--model kvbench``).

* :mod:`kvbench.integrations.lm_eval.backend`: :class:`~kvbench.integrations.lm_eval.backend.KVBenchLM`, a subclass of
  lm-eval's ``HFLM`` registered as ``kvbench``; every request runs through a fresh kvbench cache
  of the chosen method (protocol in ``docs/lm-eval.md``).
* :mod:`kvbench.integrations.lm_eval.tasks`: task YAMLs kept in the repository whose data come from the local
  data folder (``$KVBENCH_DATA_DIR``), and the offline check for hub-backed tasks.
* :mod:`kvbench.integrations.lm_eval.cli`: ``kvbench lm-eval ARGS...`` (this module's
  :func:`main`): imports the backend (lm-eval 0.4 discovers no model plugins, so ``lm_eval
  --model kvbench`` fails; ``@register_model`` runs at import) and then runs lm-eval's own CLI,
  with kvbench's local task folder merged into ``--include_path`` and the output folder named
  after the method and its configuration (:mod:`kvbench.integrations.lm_eval.naming`).
* :mod:`kvbench.integrations.lm_eval.coverage`: the per-task share of the past read quantized
  and the warning when it is low.

lm-eval is an optional dependency: ``pip install -e '.[lm-eval]'`` from the clone (``lm-eval>=0.4.13,<0.5``;
the backend overrides private ``HFLM`` methods, so the range is pinned and tested).
"""

from __future__ import annotations

from types import ModuleType

#: the optional dependency, as pip spells it
REQUIREMENT = "lm-eval>=0.4.13,<0.5"


def require_lm_eval() -> ModuleType:
    """Import and return ``lm_eval``; ``RuntimeError`` with the install line when absent or of
    an unsupported version."""
    try:
        import lm_eval
    except ImportError as exc:
        raise RuntimeError(
            f"the lm-eval backend needs {REQUIREMENT}: pip install -e '.[lm-eval]' in the "
            f"kvbench clone (kvbench is not on the package index; make env installs it), or "
            f"pip install '{REQUIREMENT}' ({exc})"
        ) from None
    from importlib.metadata import version

    v = tuple(int(x) for x in version("lm_eval").split(".")[:3] if x.isdigit())
    if not ((0, 4, 13) <= v < (0, 5)):
        raise RuntimeError(f"kvbench's lm-eval backend supports {REQUIREMENT}; found {v}")
    return lm_eval
