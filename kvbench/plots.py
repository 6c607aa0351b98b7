"""Old location of :mod:`kvbench.report.plots`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.report import plots as _moved

sys.modules[__name__] = _moved
