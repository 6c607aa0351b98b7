"""Attention over a layer cache: which backend runs a decode step, and the reference math.

:mod:`.dispatch` picks the backend of each decode step (:func:`.dispatch.attend`, called by
:meth:`kvbench.cache.layer.LayerCache.attend`) from the entry-point group ``kvbench.backends``;
:mod:`.backend` says what a backend is; :mod:`.reference` is the dequantize-and-softmax math.
The backends themselves (code-domain kernels, native C, the Triton entry) live in
``kvbench.kernels`` and are never imported by the core.
"""
