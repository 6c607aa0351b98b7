"""Old location of :mod:`kvbench.kv.quant`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.kv import quant as _moved

sys.modules[__name__] = _moved
