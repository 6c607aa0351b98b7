"""Attention over a layer cache.

:mod:`.dispatch` picks the backend of each decode step (:func:`.dispatch.attend`, called by
:meth:`kvbench.cache.layer.LayerCache.attend`); :mod:`.backend` says what a backend is;
:mod:`.reference` is the dequantize-and-softmax math; :mod:`.codedomain` the code-domain backend
and :mod:`.block_kernels` its per-block-type kernels; :mod:`.triton` the fused CUDA backend (its
kernels live in ``kvbench.kernels``); :mod:`.native` the C kernels.
"""
