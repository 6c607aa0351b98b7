"""Old location of :mod:`kvbench.attend.reference`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.attend import reference as _moved

sys.modules[__name__] = _moved
