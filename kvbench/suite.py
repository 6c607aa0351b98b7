"""Old location of :mod:`kvbench.run.suite`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.run import suite as _moved

sys.modules[__name__] = _moved
