"""Old location of :mod:`kvbench.kv.blocks`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.kv import blocks as _moved

sys.modules[__name__] = _moved
