"""Old location of :mod:`kvbench.kv.registry`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.kv import registry as _moved

sys.modules[__name__] = _moved
