"""This machine's resources that the rest of kvbench shares: the user cache folder
(:func:`cache_dir`) and the compile-once, load-cached native (C) libraries
(:class:`NativeLibrary`).

It imports no other kvbench module, so every core folder (``kv``, ``attend``, ``hf``) may use it
without an import cycle.
"""

from kvbench.machine.native import ENV_DISABLE, NativeLibrary, compile_cached, cpu_flags
from kvbench.machine.paths import cache_dir

__all__ = ["ENV_DISABLE", "NativeLibrary", "cache_dir", "compile_cached", "cpu_flags"]
