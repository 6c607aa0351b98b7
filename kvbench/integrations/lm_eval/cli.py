"""``kvbench lm-eval ARGS``: lm-eval's own CLI with the ``kvbench`` model registered.

lm-eval 0.4 has no model entry points (``@register_model`` runs when a module is imported), so
``lm_eval --model kvbench`` fails with lm-eval's "unknown model"; this wrapper imports the
backend and then runs lm-eval's CLI unchanged, with three additions while it runs:

* ``--include_path``: kvbench's local task folder
  (:data:`~kvbench.integrations.lm_eval.tasks.TASK_DIR`) is on every task index lm-eval builds
  (``run``, ``ls``, ``validate``), merged with the user's folders, given with ``--include_path``
  or in a ``--config`` YAML (``A:B``: folders separated by ``os.pathsep``, as lm-eval's own help
  writes it);
* ``--output_path``: results of ``--model kvbench`` go to a folder named after the model, the
  method and its configuration (:func:`~kvbench.integrations.lm_eval.naming.output_folder_name`)
  instead of lm-eval's folder named after ``pretrained`` only;
* ``--help`` (or no argument): kvbench's usage line, then lm-eval's ``run`` options.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lm_eval.tasks import TaskManager

#: printed before lm-eval's own ``run`` help by ``kvbench lm-eval --help``
USAGE = """\
kvbench lm-eval: lm-evaluation-harness's CLI with kvbench's model registered.

  kvbench lm-eval --model kvbench \\
      --model_args pretrained=default,method=kivi,bits=2,value_bits=2 \\
      --tasks gsm8k_local_answer_ll --limit 50 --output_path out/

`lm_eval --model kvbench` does not work: lm-eval 0.4 loads no model plugins and answers with
its generic unknown-model error. Every argument after `kvbench lm-eval` is lm-eval's (below).
kvbench adds its local task folder to --include_path, merged with yours (separate several
folders with '{sep}'); its tasks: {tasks}. Results go to a folder of --output_path named after
the model, the method and its configuration (e.g. default__kivi-bits2-value_bits2).
--model_args of --model kvbench: pretrained, method, method_config, any config field of the
method, chunk, dtype, device, min_quantized_fraction, and lm-eval HFLM's arguments
(docs/lm-eval.md). lm-eval's other commands work too: `kvbench lm-eval ls tasks`,
`kvbench lm-eval validate --tasks NAME`.

lm-eval's options (`lm-eval run --help`):
"""

_HELP = ("-h", "--help")


def include_paths(
    include_path: str | Path | Sequence[str | Path] | None, task_dir: str | Path
) -> list[str]:
    """lm-eval's ``include_path`` (``None``, a folder, folders joined by ``os.pathsep``, or a
    list of those) as a list of folders, empty parts dropped, with ``task_dir`` last unless it
    is already there."""
    given = include_path if isinstance(include_path, (list, tuple)) else [include_path]
    folders = [p for g in given if g for p in str(g).split(os.pathsep) if p]
    if not any(Path(p).resolve() == Path(task_dir).resolve() for p in folders):
        folders.append(str(task_dir))
    return folders


@contextlib.contextmanager
def cli_patches() -> Iterator[None]:
    """While active: every lm-eval ``TaskManager`` gets :func:`include_paths` (the user's
    folders, from ``--include_path`` or a ``--config`` YAML, and kvbench's
    :data:`~kvbench.integrations.lm_eval.tasks.TASK_DIR`), and the results folder of ``--model
    kvbench`` is :func:`~kvbench.integrations.lm_eval.naming.output_folder_name`.  Restored on
    exit."""
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lm_eval.tasks import TaskManager

    from kvbench.integrations.lm_eval.naming import output_folder_name
    from kvbench.integrations.lm_eval.tasks import TASK_DIR

    tm_init = TaskManager.__init__
    log_args = GeneralConfigTracker.log_experiment_args

    def init(
        self: TaskManager,
        verbosity: str | None = None,
        include_path: str | Path | Sequence[str | Path] | None = None,
        **kwargs: object,
    ) -> None:
        tm_init(self, verbosity, include_paths(include_path, TASK_DIR), **kwargs)

    def log_experiment_args(
        self: GeneralConfigTracker,
        model_source: str,
        model_args: str | dict[str, object],
        *a: object,
        **k: object,
    ) -> None:
        log_args(self, model_source, model_args, *a, **k)
        if model_source == "kvbench":
            self.model_name_sanitized = output_folder_name(model_args)

    TaskManager.__init__ = init
    GeneralConfigTracker.log_experiment_args = log_experiment_args
    try:
        yield
    finally:
        TaskManager.__init__ = tm_init
        GeneralConfigTracker.log_experiment_args = log_args


def wants_help(argv: Sequence[str]) -> bool:
    """No argument, ``-h``/``--help`` alone or first, or ``run`` with nothing else or help."""
    args = list(argv)
    if args[:1] == ["run"]:
        args = args[1:]
    return not args or args[0] in _HELP


def print_help() -> None:
    """kvbench's usage (:data:`USAGE`), then lm-eval's ``run`` options."""
    from kvbench.integrations.lm_eval.tasks import local_task_names

    print(USAGE.format(tasks=", ".join(sorted(local_task_names())), sep=os.pathsep))
    sys.stdout.flush()
    _lm_eval_cli(["run", "--help"])


def _lm_eval_cli(argv: list[str]) -> int:
    from lm_eval.__main__ import cli_evaluate

    old = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse's --help / usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        sys.argv = old
    return 0


def run_cli(argv: Sequence[str]) -> int:
    """``lm-eval ARGS`` in this process after registering the backend (module docstring).

    Returns the exit status.  Raises ``RuntimeError`` when lm-eval is missing or of an
    unsupported version, or naming a task whose dataset needs the unreachable hub (with the
    local-YAML route)."""
    from kvbench.integrations.lm_eval import require_lm_eval

    require_lm_eval()
    import kvbench.integrations.lm_eval.backend  # noqa: F401  (registers --model kvbench)
    from kvbench.integrations.lm_eval.tasks import TaskDataUnavailable, hub_guard, serial_bootstrap

    argv = list(argv)
    if wants_help(argv):
        print_help()
        return 0
    try:
        with hub_guard(), cli_patches(), serial_bootstrap():
            return _lm_eval_cli(argv)
    except TaskDataUnavailable as exc:
        raise RuntimeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of lm-eval's CLI")


def main(args: argparse.Namespace) -> int:
    """Run lm-eval's CLI with the ``kvbench`` model registered (``kvbench lm-eval ARGS``;
    :func:`run_cli`)."""
    return run_cli(list(args.args))
