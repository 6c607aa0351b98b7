"""Code-domain kernels of the methods' own block layouts, one module per layout.

Each module reads one block type of ``kvbench.cache`` (:mod:`.fp8`:
:class:`~kvbench.cache.fp8.FP8Block`, :mod:`.lut`: :class:`~kvbench.cache.lut.LUTBlock`,
:mod:`.polar`, :mod:`.qjl`, :mod:`.mixed_tokens`, :mod:`.turbo`); all are registered, with the
core's kernels, in :mod:`kvbench.attention.dispatch`.
"""
