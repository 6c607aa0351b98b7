"""Old location of :mod:`kvbench.kv.schedule`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.kv import schedule as _moved

sys.modules[__name__] = _moved
