"""Result records: one JSON object per run, versioned, written atomically.

The fields, the run id (a hash of what defines the run: resume and ``kvbench compare`` match
on it) and the schema versions read are in docs/design.md#records.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

from kvbench.jsontypes import JSONValue
from kvbench.paths import atomic_file

#: the record layout this code writes and the newest it reads
SCHEMA_VERSION = 1


class RecordError(ValueError):
    """A record that is missing, unreadable, malformed or of a newer schema version."""


def canonical(obj: object) -> str:
    """Deterministic JSON text (sorted keys, no spaces) used for hashing; a value JSON cannot
    hold is written as its ``str``."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def utc_now() -> str:
    """The current time, UTC, ISO 8601 to the second (the form of a record's ``created``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def make_run_id(
    model: dict[str, JSONValue],
    method: str,
    config: dict[str, JSONValue],
    workload: dict[str, JSONValue],
) -> str:
    """16-hex-digit hash of what defines a run (not of its results or its machine)."""
    text = canonical({"model": model, "method": method, "config": config, "workload": workload})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Record:
    """One run's result as read from and written to ``<run_id>.json``
    (docs/design.md#record-fields).

    ``files`` are per-sample logs the runner writes beside the record (``<run_id>.<name>``,
    JSON Lines); they are not part of the record's JSON.
    """

    run_id: str
    method: str
    config: dict[str, JSONValue]
    metrics: dict[str, float]
    model: dict[str, JSONValue] = field(default_factory=dict)
    workload: dict[str, JSONValue] = field(default_factory=dict)
    per_layer: dict[str, JSONValue] | None = None
    manifest: dict[str, JSONValue] = field(default_factory=dict)
    created: str = ""
    schema_version: int = SCHEMA_VERSION
    files: dict[str, list[dict[str, JSONValue]]] = field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        """The method's label in its suite (``manifest.label``), else the method name."""
        return self.manifest.get("label") or self.method

    @property
    def workload_type(self) -> str:
        return self.workload.get("type", "?")

    @property
    def config_key(self) -> str:
        """What identifies a method configuration across workloads: model, method and config."""
        return canonical({"model": self.model, "method": self.method, "config": self.config})

    @property
    def flags(self) -> list[str]:
        """The runner's warnings about this run (``manifest.flags``)."""
        return list(self.manifest.get("flags") or [])

    @classmethod
    def from_json(cls, data: dict[str, JSONValue] | str | Path) -> Record:
        """A record from its JSON object, or from the file at a path.

        A record without ``schema_version`` is read as version 1.

        Raises
        ------
        RecordError
            Unreadable JSON, not an object, a ``schema_version`` newer than
            :data:`SCHEMA_VERSION` (naming both), a missing ``run_id``, ``method``, ``config``
            or ``metrics``, or a key that is not a record field.
        """
        where = ""
        if isinstance(data, (str, Path)):
            where = f"{data}: "
            try:
                data = json.loads(Path(data).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise RecordError(f"{where}not a readable record ({exc})") from exc
        if not isinstance(data, dict):
            raise RecordError(f"{where}not a kvbench record (a JSON object)")
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or version > SCHEMA_VERSION or version < 1:
            raise RecordError(
                f"{where}schema_version {version} is not supported: this kvbench reads records "
                f"up to schema_version {SCHEMA_VERSION}"
            )
        for key in _REQUIRED:
            if key not in data:
                raise RecordError(f"{where}record lacks {key!r}")
        unknown = sorted(set(data) - _FIELDS)
        if unknown:
            raise RecordError(f"{where}unknown record field(s) {unknown}")
        return cls(**{**data, "schema_version": version})

    def to_json(self) -> dict[str, JSONValue]:
        """The record's JSON object (every field but ``files``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "files"}


_REQUIRED = ("run_id", "method", "config", "metrics")
_FIELDS = {f.name for f in fields(Record)} - {"files"}


def new_record(
    *,
    method: str,
    config: dict[str, JSONValue],
    model: dict[str, JSONValue],
    workload: dict[str, JSONValue],
    metrics: dict[str, float],
    manifest: dict[str, JSONValue],
    per_layer: dict[str, JSONValue] | None = None,
) -> Record:
    """Assemble a record; ``metrics`` must be a flat name -> number mapping (``ValueError``)."""
    for k, v in metrics.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"metric {k!r} must be a number, got {type(v).__name__}")
    return Record(
        run_id=make_run_id(model, method, config, workload),
        method=method,
        config=config,
        model=model,
        workload=workload,
        metrics=metrics,
        per_layer=per_layer,
        manifest=manifest,
        created=utc_now(),
    )


def record_path(out_dir: str | Path, run_id: str) -> Path:
    return Path(out_dir) / f"{run_id}.json"


def write_atomic(path: str | Path, data: object) -> None:
    """Write JSON to ``path`` via a temporary file in the same folder and ``os.replace``, so a
    crash never leaves a partial file behind.  The file gets the mode a plain ``open`` would
    give (``0o666`` less the umask), not ``mkstemp``'s private ``0o600``.  A value JSON cannot
    hold is written as its ``str``."""
    with atomic_file(path, plain=True) as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
        f.write("\n")


def write_record(path: str | Path, rec: Record) -> None:
    """Write ``rec``'s JSON atomically (:func:`write_atomic`)."""
    write_atomic(path, rec.to_json())


def write_jsonl_atomic(path: str | Path, rows: Iterable[object]) -> None:
    """Write one JSON object per line to ``path`` atomically (as :func:`write_atomic`)."""
    with atomic_file(path) as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True, default=str) + "\n")


def sidecar_path(record: str | Path, name: str) -> Path:
    """``<run_id>.<name>`` beside the record file ``<run_id>.json`` (never ``*.json``, so
    :func:`load_records` does not read it)."""
    if name.endswith(".json") or "/" in name:
        raise ValueError(f"sidecar name {name!r} must not end in .json or contain '/'")
    record = Path(record)
    return record.with_name(f"{record.stem}.{name}")


def load_record(path: str | Path) -> Record:
    """Read and check one record (:meth:`Record.from_json`; ``RecordError``)."""
    return Record.from_json(Path(path))


def load_records(paths: str | Path | Iterable[str | Path]) -> list[Record]:
    """Records from files and/or folders (``*.json`` directly inside a folder)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(load_record(f) for f in sorted(p.glob("*.json")))
        elif p.exists():
            out.append(load_record(p))
        else:
            raise RecordError(f"{p}: no such file or folder")
    return out
