"""Old location of :mod:`kvbench.kv.layer`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.kv import layer as _moved

sys.modules[__name__] = _moved
