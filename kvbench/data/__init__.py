"""Datasets: texts and task rows with a public source, a pinned checksum and a local-file
fallback (:mod:`kvbench.data.catalog`), and the hub access rules.  ``kvbench.data`` re-exports
:mod:`kvbench.data.loaders` (its old flat location).
"""

from kvbench.data.loaders import *  # noqa: F401,F403
from kvbench.data.loaders import (  # noqa: F401  (private helpers some callers use)
    _hub_rows,
    resolve_data_dir,
    sha256_text,
)
