"""Old location of :mod:`kvbench.workloads.metrics`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.workloads import metrics as _moved

sys.modules[__name__] = _moved
