"""Attention over a layer cache: the backend registry (:mod:`.registry`), the reference
(dequantize-and-softmax) math (:mod:`.reference`), the CPU code-domain backend (:mod:`.cpu`,
:mod:`.mixed`) and the Triton backend's registration (:mod:`.triton`; the kernels live in
``kvbench.kernels``).

Importing this package installs the registry's dispatch into
:meth:`kvbench.cache.layer.LayerCache.attend` (``kvbench/__init__.py`` imports it), so ``kv`` never
imports ``attend``.
"""

from kvbench.attention import codedomain as cpu
from kvbench.attention import dispatch as registry
from kvbench.attention import mixed_channel as mixed
from kvbench.attention import triton  # noqa: F401 - registrations

registry.install()
