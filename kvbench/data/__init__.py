"""Datasets: texts and task rows with a public source and a local-file fallback, and the hub
access rules.  ``kvbench.data`` re-exports :mod:`kvbench.data.loaders` (its old flat location).
"""

from kvbench.data.loaders import *  # noqa: F401,F403
from kvbench.data.loaders import (  # noqa: F401  (private helpers some callers use)
    _hub_rows,
    resolve_data_dir,
    sha256_text,
)
