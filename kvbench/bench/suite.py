"""Suite files: YAML naming models x methods (with configs) x workloads; lists expand to sweeps.

Example::

    name: smoke
    seed: 0
    threads: auto          # or an integer >= 1; auto/absent: the CPUs free here (never more)
    model: {id: HuggingFaceTB/SmolLM2-135M-Instruct, dtype: float32, device: cpu}
    methods:
      - full
      - name: kivi
        config: {bits: [2, 4], value_bits: 2}     # a list expands to one run per value
    workloads:
      - {type: fidelity, text: essays, tokens: 1024, prefill: 512}
    resources: {num_cpus: 1, num_gpus: 1}   # per worker under --executor ray (docs/cluster.md)
    storage_dtype: float16  # every method's full-precision parts stored in 16 bits (see below)

The keys (``models:``, ``model: none``, ``calibration:``), the sweep expansion and the errors
(checks in :mod:`kvbench.bench.validate`) are in docs/design.md#suites-and-workloads.

``storage_dtype`` (:func:`suite_storage_dtype`): the method config field of the same name
(docs/design.md#storage-dtype) for every method of the suite that stores through kvbench's layer
cache, where its entry's ``config`` does not set it (a config value, ``null`` included, wins);
transformers peers (``capabilities.layer_cache=False``) keep their own dtype.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import cast

import yaml

from kvbench.bench import validate
from kvbench.cache.method import STORAGE_DTYPES
from kvbench.cache.registry import get_method_class

TOP_KEYS = {
    "name",
    "description",
    "seed",
    "threads",
    "model",
    "models",
    "methods",
    "workloads",
    "paper",
    "calibration",
    "resources",
    "storage_dtype",
}
#: calibration text for methods that need it (must differ from every evaluation text)
DEFAULT_CALIBRATION: dict[str, str | int] = {"text": "essays-calib", "tokens": 2048}
MODEL_KEYS = {"id", "dtype", "device"}
#: keys of a ``methods:`` entry
METHOD_KEYS = {"name", "config", "label"}
#: ``resources:`` keys (per worker, i.e. per model per device, under ``--executor ray``)
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "custom")
#: ``model: {shape: NAME}``: a preset or hub config with seeded random weights (kvbench.hf.shapes)
SHAPE_KEYS = {"shape", "layers", "dtype", "device"}
DEFAULT_MODEL = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}

#: a validated model entry: ``id``, ``dtype``, ``device`` (strings); a shape model also has
#: ``shape`` (a string) and ``layers`` (an int or ``None``)
ModelSpec = dict[str, object]
#: a check of a parsed suite that :func:`parse_suite` runs with its own (``ValueError``)
SuiteCheck = Callable[["Suite"], object]


@dataclass
class MethodSpec:
    """One expanded method configuration."""

    name: str
    #: config field -> value as the suite gives it (the method's config class checks it)
    config: dict[str, object]
    label: str
    #: the suite entry it came from (``methods[3]``), for error messages
    where: str = ""


@dataclass
class Suite:
    """A validated, expanded suite."""

    path: str
    name: str
    seed: int
    threads: int | None
    models: list[ModelSpec | None]
    methods: list[MethodSpec]
    #: validated workload parameters, ``type`` included (one per expanded workload)
    workloads: list[dict[str, object]]
    #: the suite mapping as loaded (``--set`` applied)
    raw: dict[str, object] = field(default_factory=dict)
    calibration: dict[str, object] = field(default_factory=lambda: dict(DEFAULT_CALIBRATION))
    #: per-worker request of ``--executor ray`` (validated ``resources:``; ``None``: defaults)
    resources: dict[str, object] | None = None


def set_path(data: object, dotted: str, value: object) -> None:
    """``set_path(d, "model.dtype", "bfloat16")``; list items by index (``workloads.0.tokens``).

    Missing mapping keys are created (the suite's validation then names unknown ones); a list
    index out of range or a path through a scalar raises ``ValueError`` naming the path."""
    keys = dotted.split(".")
    cur: object = data
    for depth, k in enumerate(keys):
        here = ".".join(keys[: depth + 1])
        last = depth == len(keys) - 1
        if isinstance(cur, list):
            if not k.lstrip("-").isdigit() or not -len(cur) <= int(k) < len(cur):
                raise ValueError(
                    f"--set {dotted}: {'.'.join(keys[:depth]) or 'the suite'} has "
                    f"{len(cur)} entries (indices 0..{len(cur) - 1}); {here!r} does not exist"
                )
            if last:
                cur[int(k)] = value
            else:
                cur = cur[int(k)]
        elif isinstance(cur, dict):
            if last:
                cur[k] = value
            else:
                if cur.get(k) is None:
                    cur[k] = {}
                cur = cur[k]
        else:
            raise ValueError(
                f"--set {dotted}: {'.'.join(keys[:depth])!r} is {cur!r}, not a mapping or a "
                f"list, so {here!r} does not exist"
            )


def _expand(
    config: dict[str, object], keep: frozenset[str] = frozenset()
) -> list[dict[str, object]]:
    """Cartesian product over list values (keys in ``keep`` hold lists as plain values)."""
    keys = list(config)
    values = [v if isinstance(v, list) and k not in keep else [v] for k, v in config.items()]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def _model(entry: object, where: str) -> ModelSpec | None:
    if entry in (None, "none"):
        return None
    if isinstance(entry, str):
        entry = {"id": DEFAULT_MODEL["id"] if entry == "default" else entry}
    if isinstance(entry, dict) and "shape" in entry:
        return _shape_model(entry, where)
    if not isinstance(entry, dict) or "id" not in entry:
        raise ValueError(f"{where}: a model is an id string or a mapping with 'id'")
    validate.check_keys(entry, MODEL_KEYS, where, "model")
    model: ModelSpec = {**DEFAULT_MODEL, **entry}
    validate.check_model(model, where)
    return model


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_resources(entry: object, where: str) -> dict[str, object] | None:
    """Validate a ``resources:`` mapping: what one worker (one model on one device) reserves on
    a Ray cluster, fixed when the worker is created.  ``num_cpus`` (> 0), ``num_gpus`` (>= 0,
    fractions allowed), ``memory`` (bytes, > 0), ``custom`` (Ray custom resources: name ->
    amount > 0).  The local executor ignores it.  ``ValueError`` names the key and the allowed
    keys or values."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: 'resources' is a mapping with keys {list(RESOURCE_KEYS)}")
    validate.check_keys(entry, RESOURCE_KEYS, where, "resources")
    for key, low, strict in (("num_cpus", 0, True), ("num_gpus", 0, False), ("memory", 0, True)):
        if key in entry:
            v = entry[key]
            if not _number(v) or v < low or (strict and v == low):
                sign = ">" if strict else ">="
                raise ValueError(f"{where}: resources.{key}={v!r} must be a number {sign} {low}")
    custom = entry.get("custom", {})
    if not isinstance(custom, dict) or not all(
        isinstance(k, str) and _number(v) and v > 0 for k, v in custom.items()
    ):
        raise ValueError(f"{where}: resources.custom maps resource names to amounts > 0")
    return dict(entry)


def _shape_model(entry: dict[str, object], where: str) -> ModelSpec:
    from kvbench.hf.shapes import check_shape_spec

    validate.check_keys(entry, SHAPE_KEYS, where, "shape-model")
    try:
        check_shape_spec(entry["shape"], entry.get("layers"))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    tag = f"[layers={entry['layers']}]" if entry.get("layers") is not None else ""
    out: ModelSpec = {
        "id": f"shape:{entry['shape']}{tag}",
        "dtype": "float32",
        "device": "cpu",
        **entry,
    }
    out.setdefault("layers", None)
    return out


def _models(
    data: dict[str, object], path: str, problems: validate.Problems
) -> list[ModelSpec | None] | None:
    """The ``model:`` or ``models:`` entries, or ``None`` when one of them is refused (its
    error recorded in ``problems``)."""
    if "model" in data and "models" in data:
        problems.errors.append(f"{path}: give either 'model' or 'models', not both")
        return None
    models_raw = data.get("models", [data.get("model", "default")])
    if not isinstance(models_raw, list) or not models_raw:
        problems.errors.append(f"{path}: 'models' must be a non-empty list")
        return None
    models: list[ModelSpec | None] = []
    for i, m in enumerate(models_raw):
        where = f"{path}: " + ("model" if "models" not in data else f"models[{i}]")
        with problems.catch():
            models.append(_model(m, where))
    return models if len(models) == len(models_raw) else None


def suite_storage_dtype(
    data: dict[str, object], models: Sequence[ModelSpec | None], path: str
) -> str | None:
    """The suite's ``storage_dtype``: ``float16`` or ``bfloat16`` (:data:`STORAGE_DTYPES`),
    given to every layer-cache method's config that does not set the field
    (:func:`_method_entry`), or ``None``: absent, or the compute dtype (a ``dtype`` of the
    suite's models, e.g. ``float32``: the full-precision parts stay as computed, configs
    unchanged).  ``ValueError`` naming the field and the allowed values otherwise (e.g.
    ``float8_e4m3fn``, which no method stores its full-precision parts in)."""
    value = data.get("storage_dtype")
    if value is None or (isinstance(value, str) and value in STORAGE_DTYPES):
        return cast("str | None", value)
    compute = sorted({str(m["dtype"]) for m in models if m is not None})
    if isinstance(value, str) and value in compute:
        return None
    also = f", or {' or '.join(compute)} (the compute dtype: the model's)" if compute else ""
    raise ValueError(
        f"{path}: field 'storage_dtype': {value!r} is not allowed; allowed: "
        f"{' or '.join(STORAGE_DTYPES)} (full-precision parts stored in 16 bits){also}"
    )


def _methods(
    data: dict[str, object], path: str, problems: validate.Problems, storage: str | None = None
) -> list[MethodSpec]:
    """The expanded ``methods:`` (the refused entries and configs left out, their errors
    recorded in ``problems``); ``storage``: the suite's :func:`suite_storage_dtype`."""
    methods_raw = data.get("methods")
    if not isinstance(methods_raw, list) or not methods_raw:
        problems.errors.append(
            f"{path}: 'methods' must be a non-empty list of method names or "
            "{name, config, label} mappings (`kvbench list` shows the names)"
        )
        return []
    methods: list[MethodSpec] = []
    for i, entry in enumerate(methods_raw):
        with problems.catch():
            methods += _method_entry(entry, i, path, problems, storage)
    with problems.catch():
        validate.check_labels([(m.where, m.label) for m in methods], path)
    return methods


def _method_entry(
    entry: object, i: int, path: str, problems: validate.Problems, storage: str | None = None
) -> list[MethodSpec]:
    """The configurations ``methods[i]`` expands to; ``ValueError`` for an entry that is
    refused as a whole, each refused configuration recorded in ``problems`` and left out.
    ``storage`` (the suite's ``storage_dtype``) is added to each configuration of a method with
    a layer cache whose entry does not set ``storage_dtype``."""
    where = f"{path}: methods[{i}]"
    if isinstance(entry, str):
        entry = {"name": entry}
    shape = "a method is a name or a mapping with 'name'"
    entry = validate.check_entry(entry, where, METHOD_KEYS, "name", shape=shape)
    name = cast(str, entry["name"])  # any other YAML value: the registry refuses it by name
    label = entry.get("label")
    if label is not None and (not isinstance(label, str) or not label):
        raise ValueError(f"{where}: label={label!r} must be a non-empty string")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config={config!r} must be a mapping of config fields")
    try:
        cls = get_method_class(name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    out: list[MethodSpec] = []
    for cfg in _expand(config):
        tag = label or name
        swept = {k: v for k, v in cfg.items() if isinstance(config[k], list)}
        if swept:
            tag += "[" + ",".join(f"{k}={v}" for k, v in swept.items()) + "]"
        if storage is not None and "storage_dtype" not in cfg and cls.capabilities.layer_cache:
            cfg = {**cfg, "storage_dtype": storage}
        try:
            cls(cls.Config.from_dict(cfg))
        except (ValueError, TypeError) as exc:
            found = validate.messages(exc)
            known = {f.name for f in fields(cls.Config)}
            if set(cfg) - known:  # an unknown name was refused first: check the known fields too
                try:
                    cls(cls.Config(**{k: v for k, v in cfg.items() if k in known}))
                except (ValueError, TypeError) as more:
                    found += validate.messages(more)
            problems.errors.extend(f"{where} ({tag}): {m}" for m in found)
            continue
        out.append(MethodSpec(name, cfg, tag, f"methods[{i}]"))
    return out


def _workloads(
    data: dict[str, object], path: str, problems: validate.Problems
) -> list[dict[str, object]] | None:
    """The expanded ``workloads:``, or ``None`` when an entry or a configuration is refused
    (every error recorded in ``problems``)."""
    from kvbench.bench.workloads import WORKLOADS

    workloads_raw = data.get("workloads")
    if not isinstance(workloads_raw, list) or not workloads_raw:
        problems.errors.append(
            f"{path}: 'workloads' must be a non-empty list of {{type: ...}} mappings"
        )
        return None
    workloads: list[dict[str, object]] = []
    complete = True
    for i, w in enumerate(workloads_raw):
        where = f"{path}: workloads[{i}]"
        if not isinstance(w, dict) or "type" not in w:
            problems.errors.append(f"{where}: a workload is a mapping with 'type'")
            complete = False
            continue
        try:
            cls = WORKLOADS.get(w["type"], where)
        except ValueError as exc:
            problems.errors.append(str(exc))
            complete = False
            continue
        where = f"{where} ({w['type']})"
        for params in _expand({k: v for k, v in w.items() if k != "type"}, cls.LIST_PARAMS):
            try:
                workloads.append(cls.validate({"type": w["type"], **params}, where))
            except ValueError as exc:
                problems.errors.extend(validate.messages(exc))
                complete = False
            except TypeError as exc:  # a check comparing a string with a number
                problems.errors.append(f"{where}: {exc}")
                complete = False
    return workloads if complete else None


def parse_suite(data: object, path: str = "<suite>", checks: Sequence[SuiteCheck] = ()) -> Suite:
    """Validate and expand a suite mapping.

    Every entry is checked, and one refusal names every error found (one per line).  ``checks``
    run on the parsed suite too, their errors joining the others (``kvbench run`` passes the
    checks of devices and contexts, :func:`kvbench.bench.validate.check_devices` and
    :func:`kvbench.bench.preflight.check_contexts`); they run only when every model and
    workload entry parsed (the suite they see then has all of them).

    Raises
    ------
    ValueError
        ``data`` is not a mapping; or :class:`kvbench.bench.validate.SuiteErrors` (a
        ``ValueError``: one error's message as it is, several under a ``"<path>: N errors:"``
        header): any field out of its type or range (checks in :mod:`kvbench.bench.validate`):
        unknown top-level keys, ``seed``/``threads``/``calibration``, a model's dtype or a
        device this torch cannot use, an empty or duplicate-labelled ``methods`` list, unknown
        methods and workload types (with a "did you mean"), config fields (naming the allowed
        ones and the entry's label), workload parameters.  Each message starts with the file
        name and the entry (``methods[2] (kivi[bits=9])``, ``workloads[1] (fidelity)``).
    """
    # local: workloads import heavier modules
    from kvbench.bench.workloads import WORKLOADS, check_random_weights

    if not isinstance(data, dict):
        raise ValueError(f"{path}: a suite is a YAML mapping")
    problems = validate.Problems(path)
    with problems.catch():
        validate.check_keys(data, TOP_KEYS, path)
    seed = 0
    with problems.catch():
        seed = validate.check_int(data.get("seed", 0), path, "seed", 0)
    threads = None
    with problems.catch():
        threads = validate.check_threads(data.get("threads"), path)
    calibration: dict[str, object] = dict(DEFAULT_CALIBRATION)
    with problems.catch():
        calibration = validate.check_calibration(data.get("calibration"), path, DEFAULT_CALIBRATION)
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            problems.errors.append(f"{path}: {key}={data[key]!r} must be a string")
    models = _models(data, path, problems)
    storage = None
    with problems.catch():
        storage = suite_storage_dtype(data, models or [], path)
    methods = _methods(data, path, problems, storage)
    workloads = _workloads(data, path, problems)
    resources = None
    with problems.catch():
        resources = parse_resources(data.get("resources"), path)
    if models is not None and workloads is not None:
        if any(m is None for m in models) and any(
            WORKLOADS.get(w["type"], path).needs_model for w in workloads
        ):
            problems.errors.append(f"{path}: 'model: none' only works with model-free workloads")
        for i, m in enumerate(models):
            with problems.catch():
                check_random_weights([w["type"] for w in workloads], m, f"{path}: models[{i}]")
    suite = Suite(
        path,
        str(data.get("name", Path(path).stem)),
        seed,
        threads,
        models or [],
        methods,
        workloads or [],
        data,
        calibration,
        resources=resources,
    )
    if models is not None and workloads is not None:
        for check in checks:
            with problems.catch():
                check(suite)
    problems.raise_if_any()
    return suite


def load_suite(
    path: str | Path,
    overrides: dict[str, object] | None = None,
    checks: Sequence[SuiteCheck] = (),
) -> Suite:
    """Read a suite YAML file (UTF-8), apply dotted ``overrides`` (``--set``), validate and
    expand (:func:`parse_suite`, which runs ``checks`` too).  ``ValueError`` names the file
    when it is missing, not UTF-8, or not valid YAML."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such suite file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{p}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save the suite file as UTF-8"
        ) from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{p}: invalid YAML: {exc}") from exc
    data = copy.deepcopy(data) or {}
    for k, v in (overrides or {}).items():
        set_path(data, k, v)
    return parse_suite(data, str(p), checks)


def parse_set(items: list[str] | None) -> dict[str, object]:
    """``["key=value", ...]`` -> dict, values parsed as YAML scalars (``high_ratio=0.03125``).

    Raises ``ValueError`` for an item without ``=``.
    """
    out: dict[str, object] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return out
