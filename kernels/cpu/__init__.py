"""The code-domain attention backend (``kvbench.kernels.cpu``): decode attention on the stored
codes, registered as ``code-domain`` in the entry-point group ``kvbench.backends``.

:mod:`.codedomain` is the backend and the table of block kernels (one per stored block type
and device; :func:`.codedomain.register_block_kernel` adds a plugin's); :mod:`.affine` the
arithmetic of affine codes shared by every kernel and the kernel of
:class:`kvbench.cache.blocks.AffineBlock`; one module per other block type (:mod:`.mixed_channel`
for the core's :class:`kvbench.cache.mixed_channel.MixedChannelBlock`; :mod:`.fp8`, :mod:`.lut`,
:mod:`.polar`, :mod:`.qjl`, :mod:`.mixed_tokens`, :mod:`.turbo` for the block type each of the
methods ``fp8``, ``kvquant``, ``polarquant``, ``qjl``, ``semkv``, ``turboquant-mse`` defines in its
own module); :mod:`.native` the C kernels (``csrc/codes.c``, built by ``setup.py``).  These
modules read the blocks (they import ``kvbench.cache``, ``kvbench.attention`` and, for a
method's block type, that method's module); the core never imports them:
:mod:`kvbench.attention.dispatch` loads the backend through its entry point, and the backend
loads a method's kernel module by name the first time it meets that method's block
(:data:`.codedomain._METHOD_KERNELS`), so loading the backend loads no method.
"""
