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

The keys (``models:``, ``model: none``, ``calibration:``), the sweep expansion and the errors
(checks in :mod:`kvbench.bench.validate`) are in docs/design.md#suites-and-workloads.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbench.bench import validate
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
}
#: calibration text for methods that need it (must differ from every evaluation text)
DEFAULT_CALIBRATION = {"text": "essays-calib", "tokens": 2048}
MODEL_KEYS = {"id", "dtype", "device"}
#: keys of a ``methods:`` entry
METHOD_KEYS = {"name", "config", "label"}
#: ``resources:`` keys (per worker, i.e. per model per device, under ``--executor ray``)
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "custom")
#: ``model: {shape: NAME}``: a preset or hub config with seeded random weights (kvbench.hf.shapes)
SHAPE_KEYS = {"shape", "layers", "dtype", "device"}
DEFAULT_MODEL = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}


@dataclass
class MethodSpec:
    """One expanded method configuration."""

    name: str
    config: dict[str, Any]
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
    models: list[dict[str, Any] | None]
    methods: list[MethodSpec]
    workloads: list[dict[str, Any]]
    raw: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CALIBRATION))
    #: per-worker request of ``--executor ray`` (validated ``resources:``; ``None``: defaults)
    resources: dict[str, Any] | None = None


def set_path(data: dict, dotted: str, value: Any) -> None:
    """``set_path(d, "model.dtype", "bfloat16")``; list items by index (``workloads.0.tokens``).

    Missing mapping keys are created (the suite's validation then names unknown ones); a list
    index out of range or a path through a scalar raises ``ValueError`` naming the path."""
    keys = dotted.split(".")
    cur: Any = data
    for depth, k in enumerate(keys):
        here = ".".join(keys[: depth + 1])
        last = depth == len(keys) - 1
        key: Any = k
        if isinstance(cur, list):
            if not k.lstrip("-").isdigit() or not -len(cur) <= int(k) < len(cur):
                raise ValueError(
                    f"--set {dotted}: {'.'.join(keys[:depth]) or 'the suite'} has "
                    f"{len(cur)} entries (indices 0..{len(cur) - 1}); {here!r} does not exist"
                )
            key = int(k)
        elif not isinstance(cur, dict):
            raise ValueError(
                f"--set {dotted}: {'.'.join(keys[:depth])!r} is {cur!r}, not a mapping or a "
                f"list, so {here!r} does not exist"
            )
        elif not last and cur.get(k) is None:
            cur[k] = {}
        if last:
            cur[key] = value
        else:
            cur = cur[key]


def _expand(config: dict[str, Any], keep: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Cartesian product over list values (keys in ``keep`` hold lists as plain values)."""
    keys = list(config)
    values = [v if isinstance(v, list) and k not in keep else [v] for k, v in config.items()]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def _model(entry: Any, where: str) -> dict[str, Any] | None:
    if entry in (None, "none"):
        return None
    if isinstance(entry, str):
        entry = {"id": DEFAULT_MODEL["id"] if entry == "default" else entry}
    if isinstance(entry, dict) and "shape" in entry:
        return _shape_model(entry, where)
    if not isinstance(entry, dict) or "id" not in entry:
        raise ValueError(f"{where}: a model is an id string or a mapping with 'id'")
    validate.check_keys(entry, MODEL_KEYS, where, "model")
    model = {**DEFAULT_MODEL, **entry}
    validate.check_model(model, where)
    return model


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_resources(entry: Any, where: str) -> dict[str, Any] | None:
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


def _shape_model(entry: dict[str, Any], where: str) -> dict[str, Any]:
    from kvbench.hf.shapes import check_shape_spec

    validate.check_keys(entry, SHAPE_KEYS, where, "shape-model")
    try:
        check_shape_spec(entry["shape"], entry.get("layers"))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    tag = f"[layers={entry['layers']}]" if entry.get("layers") is not None else ""
    out = {"id": f"shape:{entry['shape']}{tag}", "dtype": "float32", "device": "cpu", **entry}
    out.setdefault("layers", None)
    return out


def parse_suite(data: dict[str, Any], path: str = "<suite>") -> Suite:
    """Validate and expand a suite mapping.

    Raises
    ------
    ValueError
        Any field out of its type or range (checks in :mod:`kvbench.bench.validate`): unknown
        top-level keys, ``seed``/``threads``/``calibration``, a model's dtype or a device this
        torch cannot use, an empty or duplicate-labelled ``methods`` list, unknown methods and
        workload types (with a "did you mean"), config fields (naming the allowed ones and the
        entry's label), workload parameters.  Each message starts with the file name and the
        entry (``methods[2] (kivi[bits=9])``, ``workloads[1] (fidelity)``).
    """
    # local: workloads import heavier modules
    from kvbench.bench.workloads import WORKLOADS, check_random_weights

    if not isinstance(data, dict):
        raise ValueError(f"{path}: a suite is a YAML mapping")
    validate.check_keys(data, TOP_KEYS, path)
    seed = validate.check_int(data.get("seed", 0), path, "seed", 0)
    threads = validate.check_threads(data.get("threads"), path)
    calibration = validate.check_calibration(data.get("calibration"), path, DEFAULT_CALIBRATION)
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise ValueError(f"{path}: {key}={data[key]!r} must be a string")
    if "model" in data and "models" in data:
        raise ValueError(f"{path}: give either 'model' or 'models', not both")
    models_raw = data.get("models", [data.get("model", "default")])
    if not isinstance(models_raw, list) or not models_raw:
        raise ValueError(f"{path}: 'models' must be a non-empty list")
    models = [
        _model(m, f"{path}: " + ("model" if "models" not in data else f"models[{i}]"))
        for i, m in enumerate(models_raw)
    ]
    methods_raw = data.get("methods")
    if not isinstance(methods_raw, list) or not methods_raw:
        raise ValueError(
            f"{path}: 'methods' must be a non-empty list of method names or "
            "{name, config, label} mappings (`kvbench list` shows the names)"
        )
    methods: list[MethodSpec] = []
    for i, entry in enumerate(methods_raw):
        where = f"{path}: methods[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        shape = "a method is a name or a mapping with 'name'"
        validate.check_entry(entry, where, METHOD_KEYS, "name", shape=shape)
        if "label" in entry and (not isinstance(entry["label"], str) or not entry["label"]):
            raise ValueError(f"{where}: label={entry['label']!r} must be a non-empty string")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config={config!r} must be a mapping of config fields")
        try:
            cls = get_method_class(entry["name"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        for cfg in _expand(config):
            label = entry.get("label") or entry["name"]
            swept = {k: v for k, v in cfg.items() if isinstance(config[k], list)}
            if swept:
                label += "[" + ",".join(f"{k}={v}" for k, v in swept.items()) + "]"
            try:
                cls(cls.Config.from_dict(cfg))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where} ({label}): {exc}") from None
            methods.append(MethodSpec(entry["name"], cfg, label, f"methods[{i}]"))
    validate.check_labels([(m.where, m.label) for m in methods], path)
    workloads_raw = data.get("workloads")
    if not isinstance(workloads_raw, list) or not workloads_raw:
        raise ValueError(f"{path}: 'workloads' must be a non-empty list of {{type: ...}} mappings")
    workloads = []
    for i, w in enumerate(workloads_raw):
        where = f"{path}: workloads[{i}]"
        if not isinstance(w, dict) or "type" not in w:
            raise ValueError(f"{where}: a workload is a mapping with 'type'")
        cls = WORKLOADS.get(w["type"], where)
        where = f"{where} ({w['type']})"
        for params in _expand({k: v for k, v in w.items() if k != "type"}, cls.LIST_PARAMS):
            try:
                spec = cls.validate({"type": w["type"], **params}, where)
            except TypeError as exc:  # a check comparing a string with a number
                raise ValueError(f"{where}: {exc}") from None
            workloads.append(spec)
    if any(m is None for m in models) and any(
        WORKLOADS.get(w["type"], path).needs_model for w in workloads
    ):
        raise ValueError(f"{path}: 'model: none' only works with model-free workloads")
    for i, m in enumerate(models):
        check_random_weights([w["type"] for w in workloads], m, f"{path}: models[{i}]")
    return Suite(
        path,
        str(data.get("name", Path(path).stem)),
        seed,
        threads,
        models,
        methods,
        workloads,
        data,
        calibration,
        resources=parse_resources(data.get("resources"), path),
    )


def load_suite(path: str | Path, overrides: dict[str, Any] | None = None) -> Suite:
    """Read a suite YAML file (UTF-8), apply dotted ``overrides`` (``--set``), validate and
    expand.  ``ValueError`` names the file when it is missing, not UTF-8, or not valid YAML."""
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
    return parse_suite(data, str(p))


def parse_set(items: list[str] | None) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict, values parsed as YAML scalars (``high_ratio=0.03125``).

    Raises ``ValueError`` for an item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return out
