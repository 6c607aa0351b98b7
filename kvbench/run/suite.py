"""Suite files: YAML naming models x methods (with configs) x workloads; lists expand to sweeps.

Example::

    name: smoke
    seed: 0
    threads: 2
    model: {id: HuggingFaceTB/SmolLM2-135M-Instruct, dtype: float32, device: cpu}
    methods:
      - full
      - name: kivi
        config: {bits: [2, 4], value_bits: 2}     # a list expands to one run per value
    workloads:
      - {type: fidelity, text: essays, tokens: 1024, prefill: 512}
    resources: {num_cpus: 1, num_gpus: 1}   # per worker under --executor ray (docs/cluster.md)

``models:`` (a list) may replace ``model:``; ``model: none`` runs model-free workloads.
Errors name the file, the key and the allowed values.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbench.kv.registry import get_method_class

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
#: ``resources:`` keys (per worker, i.e. per model per device, under ``--executor ray``)
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "custom")
DEFAULT_MODEL = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}


@dataclass
class MethodSpec:
    """One expanded method configuration."""

    name: str
    config: dict[str, Any]
    label: str


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
    """``set_path(d, "model.dtype", "bfloat16")``; list items by index (``workloads.0.tokens``)."""
    keys = dotted.split(".")
    cur: Any = data
    for k in keys[:-1]:
        cur = cur[int(k)] if isinstance(cur, list) else cur.setdefault(k, {})
    last = keys[-1]
    if isinstance(cur, list):
        cur[int(last)] = value
    else:
        cur[last] = value


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
    if not isinstance(entry, dict) or "id" not in entry:
        raise ValueError(f"{where}: a model is an id string or a mapping with 'id'")
    unknown = set(entry) - MODEL_KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown model key(s) {sorted(unknown)}; allowed: {sorted(MODEL_KEYS)}"
        )
    return {**DEFAULT_MODEL, **entry}


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
    unknown = set(entry) - set(RESOURCE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unknown resources key(s) {sorted(unknown)}; allowed: {list(RESOURCE_KEYS)}"
        )
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


def parse_suite(data: dict[str, Any], path: str = "<suite>") -> Suite:
    """Validate and expand a suite mapping.

    Raises
    ------
    ValueError
        Unknown top-level keys, unknown methods (with a "did you mean"), unknown config fields
        (naming the allowed ones), unknown workload types or parameters; each message starts
        with the file name.
    """
    from kvbench.workloads import workload_class  # local: workloads import heavier modules

    if not isinstance(data, dict):
        raise ValueError(f"{path}: a suite is a YAML mapping")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}")
    models_raw = data.get("models", [data.get("model", "default")])
    if not isinstance(models_raw, list):
        raise ValueError(f"{path}: 'models' must be a list")
    models = [_model(m, f"{path}: models[{i}]") for i, m in enumerate(models_raw)]
    methods: list[MethodSpec] = []
    for i, entry in enumerate(data.get("methods") or []):
        where = f"{path}: methods[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict) or "name" not in entry:
            raise ValueError(f"{where}: a method is a name or a mapping with 'name'")
        extra = set(entry) - {"name", "config", "label"}
        if extra:
            raise ValueError(
                f"{where}: unknown key(s) {sorted(extra)}; allowed: ['config', 'label', 'name']"
            )
        try:
            cls = get_method_class(entry["name"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        for cfg in _expand(entry.get("config") or {}):
            cls.Config.from_dict(cfg, where=f"{where} ({entry['name']})")
            label = entry.get("label") or entry["name"]
            if len(cfg) and entry.get("config"):
                swept = {k: v for k, v in cfg.items() if isinstance(entry["config"][k], list)}
                if swept:
                    label += "[" + ",".join(f"{k}={v}" for k, v in swept.items()) + "]"
            methods.append(MethodSpec(entry["name"], cfg, label))
    if not methods:
        raise ValueError(f"{path}: 'methods' is empty")
    workloads = []
    for i, w in enumerate(data.get("workloads") or []):
        where = f"{path}: workloads[{i}]"
        if not isinstance(w, dict) or "type" not in w:
            raise ValueError(f"{where}: a workload is a mapping with 'type'")
        cls = workload_class(w["type"], where)
        for params in _expand({k: v for k, v in w.items() if k != "type"}, cls.LIST_PARAMS):
            workloads.append(cls.validate({"type": w["type"], **params}, where))
    if not workloads:
        raise ValueError(f"{path}: 'workloads' is empty")
    if any(m is None for m in models) and any(
        workload_class(w["type"], path).needs_model for w in workloads
    ):
        raise ValueError(f"{path}: 'model: none' only works with model-free workloads")
    return Suite(
        path,
        str(data.get("name", Path(path).stem)),
        int(data.get("seed", 0)),
        data.get("threads"),
        models,
        methods,
        workloads,
        data,
        {**DEFAULT_CALIBRATION, **(data.get("calibration") or {})},
        resources=parse_resources(data.get("resources"), path),
    )


def load_suite(path: str | Path, overrides: dict[str, Any] | None = None) -> Suite:
    """Read a suite YAML file, apply dotted ``overrides`` (``--set``), validate and expand."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such suite file")
    try:
        data = yaml.safe_load(p.read_text())
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
