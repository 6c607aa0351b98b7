"""Old location of :mod:`kvbench.run.manifest`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.run import manifest as _moved

sys.modules[__name__] = _moved
