"""kvbench: a benchmark suite for KV-cache quantization in LLM inference.

Public API: :func:`get_method`, :func:`list_methods`, :class:`~kvbench.kv.method.Method`,
:class:`~kvbench.kv.layer.LayerCache`.
"""

import kvbench.attend  # noqa: F401 - installs LayerCache.attend's backend registry
from kvbench.kv.method import CacheConfig, Capabilities, Method, MethodConfig
from kvbench.kv.registry import get_method, get_method_class, list_methods

__version__ = "0.1.0"
__all__ = [
    "CacheConfig",
    "Capabilities",
    "Method",
    "MethodConfig",
    "get_method",
    "get_method_class",
    "list_methods",
    "__version__",
]
