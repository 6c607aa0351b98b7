"""kvbench: a benchmark suite for KV-cache quantization in LLM inference.

Public API: :func:`get_method`, :func:`list_methods`, :class:`~kvbench.cache.method.Method`,
:class:`~kvbench.cache.layer.LayerCache`.

Imported before torch, it sets ``KINETO_LOG_LEVEL=6`` unless the variable is set: the memory
workload profiles every run's allocator events, and at kineto's default level each profile
prints two ``USDT ... profiler_start/stop`` lines through the progress bar (kineto has no
level that keeps its errors and drops those lines).  Set ``KINETO_LOG_LEVEL`` to see kineto's
messages again.
"""

import os
import sys

if "torch" not in sys.modules:  # kineto reads it once, when torch loads
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")

from kvbench.cache.method import CacheConfig, Capabilities, Method, MethodConfig  # noqa: E402
from kvbench.cache.registry import get_method, get_method_class, list_methods  # noqa: E402

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
