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
}
#: calibration text for methods that need it (must differ from every evaluation text)
DEFAULT_CALIBRATION = {"text": "mobydick", "tokens": 2048}
MODEL_KEYS = {"id", "dtype", "device"}
#: ``model: {shape: NAME}``: a preset or hub config with seeded random weights (kvbench.hf.shapes)
SHAPE_KEYS = {"shape", "layers", "dtype", "device"}
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
    if isinstance(entry, dict) and "shape" in entry:
        return _shape_model(entry, where)
    if not isinstance(entry, dict) or "id" not in entry:
        raise ValueError(f"{where}: a model is an id string or a mapping with 'id'")
    unknown = set(entry) - MODEL_KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown model key(s) {sorted(unknown)}; allowed: {sorted(MODEL_KEYS)}"
        )
    return {**DEFAULT_MODEL, **entry}


def _shape_model(entry: dict[str, Any], where: str) -> dict[str, Any]:
    from kvbench.hf.shapes import check_shape_spec

    unknown = set(entry) - SHAPE_KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown shape-model key(s) {sorted(unknown)}; allowed: {sorted(SHAPE_KEYS)}"
        )
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
        Unknown top-level keys, unknown methods (with a "did you mean"), unknown config fields
        (naming the allowed ones), unknown workload types or parameters; each message starts
        with the file name.
    """
    # local: workloads import heavier modules
    from kvbench.workloads import check_random_weights, workload_class

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
    for i, m in enumerate(models):
        check_random_weights([w["type"] for w in workloads], m, f"{path}: models[{i}]")
    return Suite(
        path,
        str(data.get("name", Path(path).stem)),
        int(data.get("seed", 0)),
        data.get("threads"),
        models,
        methods,
        workloads,
        data,
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
