"""kvbench as an EleutherAI lm-evaluation-harness model backend (``--model kvbench``).

* :mod:`kvbench.integrations.lm_eval.backend`: :class:`~kvbench.integrations.lm_eval.backend.KVBenchLM`, a subclass of
  lm-eval's ``HFLM`` registered as ``kvbench``; every request runs through a fresh kvbench cache
  of the chosen method (protocol in ``docs/lm-eval.md``).
* :mod:`kvbench.integrations.lm_eval.tasks`: task YAMLs kept in the repository whose data come from the local
  data folder (``$KVBENCH_DATA_DIR``), and the offline check for hub-backed tasks.
* ``kvbench lm-eval ARGS...`` (this module's :func:`main`): imports the backend (lm-eval 0.4
  discovers no model plugins; ``@register_model`` runs at import) and then runs lm-eval's own CLI
  unchanged, with kvbench's local task folder added to ``--include_path``.

lm-eval is an optional dependency: ``pip install 'kvbench[lm-eval]'`` (``lm-eval>=0.4.13,<0.5``;
the backend overrides private ``HFLM`` methods, so the range is pinned and tested).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

#: the optional dependency, as pip spells it
REQUIREMENT = "lm-eval>=0.4.13,<0.5"


def require_lm_eval() -> Any:
    """Import and return ``lm_eval``; ``RuntimeError`` with the install line when absent or of
    an unsupported version."""
    try:
        import lm_eval
    except ImportError as exc:
        raise RuntimeError(
            f"the lm-eval backend needs {REQUIREMENT}: pip install 'kvbench[lm-eval]' ({exc})"
        ) from None
    from importlib.metadata import version

    v = tuple(int(x) for x in version("lm_eval").split(".")[:3] if x.isdigit())
    if not ((0, 4, 13) <= v < (0, 5)):
        raise RuntimeError(f"kvbench's lm-eval backend supports {REQUIREMENT}; found {v}")
    return lm_eval


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of lm-eval's CLI")


def main(args: argparse.Namespace) -> int:
    """Run lm-eval's CLI with the ``kvbench`` model registered (``kvbench lm-eval ARGS``)."""
    return run_cli(list(args.args))


def run_cli(argv: list[str]) -> int:
    """``lm-eval ARGS`` in this process after registering the backend.  kvbench's local task
    folder is appended to ``--include_path`` unless ``--include_path`` is given; a task whose
    dataset needs the unreachable hub is reported by name with the local-YAML route."""
    require_lm_eval()
    from lm_eval.__main__ import cli_evaluate

    import kvbench.integrations.lm_eval.backend  # noqa: F401  (registers --model kvbench)
    from kvbench.integrations.lm_eval.tasks import TASK_DIR, TaskDataUnavailable, hub_guard

    argv = list(argv)
    if argv and argv[0] not in ("-h", "--help", "ls", "validate") and "--include_path" not in argv:
        argv += ["--include_path", str(TASK_DIR)]
    old = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        with hub_guard():
            cli_evaluate()
    except SystemExit as exc:  # argparse's --help / usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except TaskDataUnavailable as exc:
        raise RuntimeError(str(exc)) from None
    finally:
        sys.argv = old
    return 0
