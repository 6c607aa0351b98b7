"""The type of a JSON value: what records, their manifests, dataset info and loaded suite
entries hold (``json.loads`` of any document).  It imports nothing, so every layer may use it."""

from __future__ import annotations

from typing import TypeAlias

#: a value of a JSON document (a record, its manifest, a per-sample row, a loaded suite entry)
JSONValue: TypeAlias = str | int | float | bool | None | list["JSONValue"] | dict[str, "JSONValue"]
