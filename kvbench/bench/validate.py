"""Checks a suite passes before any model loads: field types and ranges, dtype and device
availability, the output folder's writability, threads that fit the machine.

Every error is a ``ValueError`` whose message starts with ``<file>: <entry>:`` (``seed``,
``model``, ``methods[2] (kivi[bits=9])``, ``workloads[1] (fidelity)``) and names the field and
the allowed values.  Data names, hub and local availability of models and datasets are checked
by the pre-flight of assets, not here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvbench import fields as kf
from kvbench.fields import Field
from kvbench.registry import did_you_mean

#: model dtypes the loaders accept
MODEL_DTYPES = ("float32", "float16", "bfloat16")
#: the form of a model entry's fields (:func:`check_devices` checks the device exists here)
MODEL_FIELDS = {
    "id": Field(str, nonempty=True, text="a model id or a local folder"),
    "dtype": Field(str, choices=MODEL_DTYPES),
    "device": Field(str, text="a string such as 'cpu' or 'cuda:0'"),
}


def check_keys(entry: dict[str, Any], allowed: Iterable[str], where: str, kind: str = "") -> None:
    """``ValueError`` ``"<where>: unknown <kind> key(s) [...]; allowed: [...]"`` (with "did you
    mean") when ``entry`` has a key outside ``allowed``."""
    names = sorted(allowed)
    unknown = sorted(set(entry) - set(names))
    if unknown:
        raise ValueError(
            f"{where}: unknown {kind + ' ' if kind else ''}key(s) {unknown}; allowed: {names}"
            + did_you_mean(unknown[0], names, n=2, cutoff=0.6)
        )


def check_entry(
    entry: Any,
    where: str,
    allowed: Iterable[str],
    required: str | None = None,
    kind: str = "",
    shape: str | None = None,
) -> dict[str, Any]:
    """``entry`` as a mapping that holds ``required`` (when given) and only ``allowed`` keys
    (:func:`check_keys`).  Otherwise ``ValueError`` ``"<where>: <shape>"``, ``shape``
    defaulting to "must be a mapping [with '<required>']"."""
    if not isinstance(entry, dict) or (required is not None and required not in entry):
        with_key = f" with {required!r}" if required is not None else ""
        raise ValueError(f"{where}: {shape or 'must be a mapping' + with_key}")
    check_keys(entry, allowed, where, kind)
    return entry


def check_int(value: Any, where: str, field: str, low: int = 0) -> int:
    """``value`` as an int >= ``low`` (bools and strings rejected; :mod:`kvbench.fields`)."""
    Field(int, low=low).check(value, field, where)
    return value


def free_cpus() -> int:
    """CPUs this process may use and that are not busy: the affinity mask's size minus the
    1-minute load average of the other processes (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    return max(1, min(n, int(n - busy + 0.5)))


def check_threads(value: Any, where: str) -> int | None:
    """``threads:``: ``None``/``auto`` (the runner picks :func:`free_cpus`) or an integer >= 1."""
    if value is None or value == "auto":
        return None
    return check_int(value, where, "threads", 1)


def check_calibration(block: Any, where: str, default: dict[str, Any]) -> dict[str, Any]:
    """``calibration: {text: NAME, tokens: N}`` filled from ``default``; the text's name is
    checked with the data (pre-flight), its type and the token count here."""
    if block is None:
        return dict(default)
    shape = "calibration must be a mapping {text: NAME, tokens: N}"
    check_entry(block, where, default, kind="calibration", shape=shape)
    out = {**default, **block}
    Field(str, nonempty=True, text="a text name").check(out["text"], "calibration.text", where)
    check_int(out["tokens"], where, "calibration.tokens", 16)
    return out


def device_problem(device: Any) -> str | None:
    """Why ``device`` cannot be used by this torch here, or ``None``."""
    import torch

    if not isinstance(device, str):
        return kf.message("", "device", device, "a string such as 'cpu' or 'cuda:0'")
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return None
    if kind == "cuda":
        if not torch.cuda.is_available():
            built = "a CUDA build of torch" if torch.version.cuda else "torch without CUDA"
            return f"device={device!r}: no CUDA device is available ({built}); use 'cpu'"
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            here = ", ".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))
            return kf.message("", "device", device, f"cuda, {here}, cpu")
        return None
    if kind == "mps" and not index:
        ok = getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
        return None if ok else f"device={device!r}: MPS is not available here; use 'cpu'"
    return kf.message("", "device", device, "cpu, cuda, cuda:N, mps")


def check_model(model: dict[str, Any], where: str) -> None:
    """A model entry's ``id``, ``dtype`` and ``device`` (its form; :func:`check_devices`
    checks that it exists here, at run time)."""
    MODEL_FIELDS["id"].check(model["id"], "id", where)
    dtype = MODEL_FIELDS["dtype"]
    if not dtype.accepts(model["dtype"]):
        msg = kf.message(where, "dtype", model["dtype"], dtype.allowed())
        raise ValueError(msg + did_you_mean(model["dtype"], MODEL_DTYPES, n=2, cutoff=0.6))
    MODEL_FIELDS["device"].check(model["device"], "device", where)


def check_devices(suite: Any) -> None:
    """Every model's device exists here (a suite for CUDA fails on a CPU-only torch before any
    model loads)."""
    for i, model in enumerate(suite.models):
        why = model is not None and device_problem(model["device"])
        if why:
            where = "model" if len(suite.models) == 1 else f"models[{i}]"
            raise ValueError(f"{suite.path}: {where}: {why}")


def check_labels(labels: list[tuple[str, str]], path: str) -> None:
    """Two method entries with one label would make their records indistinguishable."""
    seen: dict[str, str] = {}
    for where, label in labels:
        if label in seen and seen[label] != where:
            raise ValueError(
                f"{path}: {seen[label]} and {where} have the same label {label!r}; "
                "give one of them a distinct 'label:'"
            )
        seen.setdefault(label, where)


def check_output(out: str | Path) -> None:
    """The result folder exists or can be made, is a folder, and takes a file.

    Raises ``ValueError`` naming the folder and the reason (a file in the way, read-only)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {p}: is a file, not a folder; choose another --out")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kvbench-write-check.", dir=p)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ValueError(
            f"--out {p}: cannot write records there ({exc.strerror or exc}); choose a writable "
            "folder with --out"
        ) from None


def check_methods_for_model(methods: list[Any], info: dict[str, Any], path: str) -> None:
    """Build one layer of every method on the loaded model's shape (``head_dim``,
    ``num_key_value_heads``), so a config that does not fit the model (a ``value_group_size``
    that does not divide ``head_dim``) fails before the first run, naming the entry."""
    from kvbench.cache.registry import get_method

    d, h = info.get("head_dim"), info.get("num_key_value_heads") or info.get("num_kv_heads")
    if not d or not h:
        return
    for spec in methods:
        try:
            m = get_method(spec.name, **spec.config).for_model(info)
            if m.capabilities.layer_cache and not m.needs_calibration:  # not fitted yet
                m.new_layer(0, int(h), int(d))
                m.average_bits(head_dim=int(d), tokens=1024)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {spec.where} ({spec.label}): {exc}") from None
