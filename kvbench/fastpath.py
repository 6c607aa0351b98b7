"""Old location of :mod:`kvbench.attend.cpu`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.attend import cpu as _moved

sys.modules[__name__] = _moved
