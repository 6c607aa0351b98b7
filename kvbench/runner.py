"""Old location of :mod:`kvbench.run.runner`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.run import runner as _moved

sys.modules[__name__] = _moved
