"""The name a record goes by in every table and figure."""

from __future__ import annotations

from typing import Any


def label_of(rec: dict[str, Any]) -> str:
    """The record's ``manifest.label`` (the suite's label of its configuration), else its
    method name."""
    return rec.get("manifest", {}).get("label") or rec["method"]
