"""The code-domain attention backend (``kvbench.kernels.cpu``): decode attention on the stored
codes, registered as ``code-domain`` in the entry-point group ``kvbench.backends``.

:mod:`.codedomain` is the backend and the table of block kernels (one per stored block type
and device; :func:`.codedomain.register_block_kernel` adds a plugin's); :mod:`.affine` the
arithmetic of affine codes shared by every kernel and the kernel of
:class:`kvbench.cache.blocks.AffineBlock`; one module per other block type (:mod:`.mixed_channel`,
:mod:`.fp8`, :mod:`.lut`, :mod:`.polar`, :mod:`.qjl`, :mod:`.mixed_tokens`, :mod:`.turbo`);
:mod:`.native` the C kernels (``csrc/codes.c``, built by ``setup.py``).  These modules read the
core's blocks (they import ``kvbench.cache`` and ``kvbench.attention``); the core never imports
them: :mod:`kvbench.attention.dispatch` loads the backend through its entry point.
"""
