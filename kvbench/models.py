"""Old location of :mod:`kvbench.hf.models`, kept as an alias for one release (0.2 removes it)."""

import sys

from kvbench.hf import models as _moved

sys.modules[__name__] = _moved
