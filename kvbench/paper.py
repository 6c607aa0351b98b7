"""Old location of :mod:`kvbench.report.paper`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.report import paper as _moved

sys.modules[__name__] = _moved
