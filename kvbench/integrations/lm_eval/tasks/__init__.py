"""lm-eval tasks that run offline, and the offline check for tasks that need the hub.

lm-evaluation-harness tasks load their data with ``datasets.load_dataset(dataset_path, ...)``,
i.e. from the Hugging Face hub.  The YAMLs in this folder (:data:`TASK_DIR`) are lm-eval task
configs whose rows come from kvbench's data loaders instead (``custom_dataset: !function
kvbench.integrations.lm_eval.tasks.gsm8k_local``: the local data folder ``$KVBENCH_DATA_DIR`` first, then
the hub), so they run without network access:

* ``gsm8k_local``: lm-eval's ``gsm8k`` (version 3.0: prompt, filters, metrics), generate_until;
* ``gsm8k_local_answer_ll``: log-likelihood of the final answer after the question, loglikelihood.

Any other local data works the same way with lm-eval's own mechanism: a YAML with
``dataset_path: json`` and ``dataset_kwargs: {data_files: {test: /path/rows.jsonl}}`` (or a
``custom_dataset`` function), passed with ``--include_path DIR``.  With the hub reachable, stock
task names (``gsm8k``, ``hellaswag``, ...) work unchanged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from kvbench.jsontypes import JSONValue

if TYPE_CHECKING:
    import datasets
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager

#: the folder of kvbench's local task YAMLs (pass it to lm-eval as ``--include_path``)
TASK_DIR = Path(__file__).resolve().parent
#: provenance of the rows the local tasks loaded in this process: dataset name -> load info
LOADED: dict[str, dict[str, JSONValue]] = {}


class TaskDataUnavailable(FileNotFoundError):
    """A task's dataset cannot be loaded here (hub unreachable, no local copy)."""


def gsm8k_local(**_: object) -> datasets.DatasetDict:
    """``custom_dataset`` of the local GSM8K tasks: a ``datasets.DatasetDict`` with the
    ``test`` split (``question``, ``answer``) from :func:`kvbench.data.loaders.load_rows`.

    lm-eval passes the task metadata and model arguments as keywords; they are ignored.

    Raises
    ------
    TaskDataUnavailable
        Neither ``$KVBENCH_DATA_DIR/gsm8k/test.jsonl`` nor the hub is available.
    """
    import datasets

    from kvbench.data.loaders import load_rows

    try:
        rows, info = load_rows("gsm8k", "test")
    except FileNotFoundError as exc:
        raise TaskDataUnavailable(
            "kvbench's local GSM8K tasks (gsm8k_local, gsm8k_local_answer_ll) need dataset "
            "gsm8k: put GSM8K's test.jsonl at "
            f"$KVBENCH_DATA_DIR/gsm8k/test.jsonl (KVBENCH_DATA_DIR: the local data folder) or "
            f"make the hub reachable ({exc})"
        ) from None
    LOADED["gsm8k"] = info
    rows = [{"question": r["question"], "answer": r["answer"]} for r in rows]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def local_task_names(dirs: Sequence[str | Path] = (TASK_DIR,)) -> dict[str, Path]:
    """Task name -> YAML file for every ``*.yaml`` with a ``task:`` key in ``dirs`` (read
    without resolving ``!function`` tags)."""

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    out: dict[str, Path] = {}
    for d in dirs:
        for path in sorted(Path(d).rglob("*.yaml")):
            try:
                cfg = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 (SafeLoader)
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(cfg, dict) and isinstance(cfg.get("task"), str):
                out[cfg["task"]] = path
    return out


def task_manager(tasks: Sequence[str], include_path: Sequence[str | Path] = ()) -> TaskManager:
    """An lm-eval ``TaskManager`` that knows kvbench's local tasks and ``include_path``.

    lm-eval's own task index (~15k YAMLs; a minute to build on a small machine) is included only
    when some task in ``tasks`` is not found in those folders."""
    from lm_eval.tasks import TaskManager

    dirs = [TASK_DIR, *map(Path, include_path)]
    local = local_task_names(dirs)
    defaults = any(t not in local for t in tasks)
    return TaskManager(include_path=[str(d) for d in dirs], include_defaults=defaults)


def _hub_error_message(task: str | None, dataset: str | None, exc: BaseException) -> str:
    local = ", ".join(sorted(local_task_names())) or "none"
    return (
        f"lm-eval task {task!r} could not load its dataset {dataset!r}, which comes from the "
        f"Hugging Face hub ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}). "
        "Offline, run a task whose YAML reads local files: kvbench ships "
        f"{local} (kvbench/integrations/lm_eval/tasks, rows from $KVBENCH_DATA_DIR), or write a task YAML with "
        "`dataset_path: json` and `dataset_kwargs: {data_files: {test: FILE.jsonl}}` (or a "
        "`custom_dataset` function) and pass its folder with --include_path (workload: "
        "include_path)."
    )


@contextlib.contextmanager
def serial_bootstrap() -> Iterator[None]:
    """While active: lm-eval computes its bootstrap standard errors in this process
    (``DISABLE_MULTIPROC=1``, lm-eval's own switch in ``lm_eval.api.metrics.bootstrap_stderr``)
    instead of in a ``multiprocessing.Pool`` forked from it.  A fork of a process whose torch
    thread pools have run can deadlock in the child (seen in kvbench's tests: a pool worker
    waiting on a futex forever, the run stalled); a value the user set is kept."""
    had = "DISABLE_MULTIPROC" in os.environ
    if not had:
        os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if not had:
            os.environ.pop("DISABLE_MULTIPROC", None)


@contextlib.contextmanager
def hub_guard() -> Iterator[None]:
    """While active: lm-eval task data loads fail fast when the hub is unreachable (HF offline
    mode, cache only) and a failure raises :class:`TaskDataUnavailable` naming the task and the
    local-YAML route (wraps ``ConfigurableTask.download``; restored on exit)."""
    from lm_eval.api.task import ConfigurableTask

    from kvbench.data.hub import hf_offline_env, hub_reachable, offline_requested

    original = ConfigurableTask.download
    offline = offline_requested() or (not hf_offline_env() and not hub_reachable())

    def download(self: ConfigurableTask, *args: object, **kwargs: object) -> None:
        try:
            if offline and not callable(self.config.custom_dataset):
                import datasets
                import huggingface_hub.constants as hub_constants

                old = (hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
                hub_constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
                try:
                    return original(self, *args, **kwargs)
                finally:
                    hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = old
            return original(self, *args, **kwargs)
        except TaskDataUnavailable:
            raise
        except Exception as exc:  # any download error: re-raised as TaskDataUnavailable
            # naming the task, its dataset, the error and the local-YAML route
            raise TaskDataUnavailable(
                _hub_error_message(self.config.task, self.config.dataset_path, exc)
            ) from exc

    ConfigurableTask.download = download
    try:
        yield
    finally:
        ConfigurableTask.download = original
