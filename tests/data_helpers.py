"""Helpers of data-dependent tests (imported by tests/conftest.py and the test modules): get a
dataset from any source, or skip with a reason naming it and how to provide it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvbench.data import catalog
from kvbench.data.loaders import DATA_DIR_ENV, DatasetUnavailable, load_rows, load_text


def dataset(name: str) -> tuple[object, dict]:
    """``load_text(name)`` or ``load_rows(name)``; skips (naming the dataset and how to provide
    it) when no source has it here. A checksum mismatch is an error, not a skip."""
    try:
        return load_text(name) if name in catalog.TEXTS else load_rows(name)
    except DatasetUnavailable as exc:
        pytest.skip(f"needs dataset {name!r}: {exc}")


def local_data_dir(*rel: str) -> Path:
    """The local data folder (``$KVBENCH_DATA_DIR``) when it holds every path in ``rel``;
    skips naming the files otherwise."""
    root = os.environ.get(DATA_DIR_ENV)
    missing = [r for r in rel if not root or not (Path(root) / r).is_file()]
    if not root or not Path(root).is_dir() or missing:
        pytest.skip(
            f"needs the local data folder: set {DATA_DIR_ENV}=<folder holding "
            f"{', '.join(missing or rel) or 'the published files'}>"
        )
    return Path(root)
