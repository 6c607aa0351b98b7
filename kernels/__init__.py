"""Kernels for quantized KV caches, and the attention backends built on them
(``kvbench.kernels``).

Triton kernel modules (each literate: a PyTorch reference, the ``@triton.jit`` kernels, host
wrappers):

* :mod:`.pack`: pack / unpack of 1..8-bit codes in the core's layout
  (:func:`kvbench.cache.quant.pack_bits`);
* :mod:`.quantize`: quantize-and-pack on flush: per-channel key pages (uniform, or Kitty /
  PN-Mix mixed precision) and per-token values, bit-identical to the core codecs;
* :mod:`.decode_attention`: fused split-KV decode attention over sinks + quantized pages +
  full-precision residual, and the same kernel over fp16 K/V (the control);
* :mod:`.dispatch`: ``unsupported`` / ``fused_attend`` over a layer cache's blocks through
  converters the caller passes, and the stand-alone ``try_fused_attend(layer_cache, query,
  scaling, layouts=...)`` (``None``: reference path).

These import only torch and (optionally) triton: never transformers, datasets or the kvbench
core.  Their one-call GPU check (timings, each timed kernel guarded by the reference) is a
benchmark: ``benchmarks/triton_decode.py``, run by ``bash benchmarks/device_check.sh``.
Importing this package does not import Triton (``HAS_TRITON`` only looks for it); the kernel
modules import it and still load without it (the references work, launches raise
:class:`TritonUnavailable`).

Attention backends (entry-point group ``kvbench.backends``; they read the core's blocks, so
they import the core, which never imports them):

* :mod:`.triton_backend`: the CUDA backend ``triton``, the fused kernel above behind the core's
  block types;
* :mod:`.cpu`: the code-domain backend ``code-domain``: its block kernels (one per stored block
  type) and the native C kernels (``cpu/csrc/codes.c``, built by ``setup.py``).
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install triton (or .venv/bin/pip install -e '.[triton]' in a kvbench clone)"


def _find_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a blocked or broken entry in sys.modules
        return False


#: whether Triton is installed (found, not imported)
HAS_TRITON = _find_triton()


class TritonUnavailable(RuntimeError):
    """Raised when a Triton kernel is launched but Triton cannot be imported."""


def triton_version() -> str | None:
    """The installed Triton version, or ``None`` without Triton (imports Triton)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


__all__ = ["HAS_TRITON", "INSTALL_HINT", "TritonUnavailable", "triton_version"]
