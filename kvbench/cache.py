"""Old location of :mod:`kvbench.hf.cache`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.hf import cache as _moved

sys.modules[__name__] = _moved
