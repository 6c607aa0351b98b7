"""Optional Triton import shared by the kernel modules.

Every kernel module does ``from ._triton import triton, tl, ...`` instead of importing Triton
directly, so that ``kvbench.kernels`` and each of its modules import cleanly when Triton is
not installed (CPU-only installs; the ``triton`` extra of ``pyproject.toml``): the PyTorch
references keep working, and a kernel launch raises :class:`TritonUnavailable` with the install
hint.  Nothing here imports transformers, datasets or the kvbench core.
"""

from __future__ import annotations

import functools

from . import INSTALL_HINT, TritonUnavailable

try:  # pragma: no cover - exercised by whichever environment runs the tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

if HAS_TRITON:
    try:
        from triton.language.extra import libdevice
    except ImportError:  # pragma: no cover - older layouts
        libdevice = None
    jit = triton.jit
else:

    class _Constexpr:  # stands in for ``tl.constexpr`` in annotations
        pass

    class _StubLanguage:
        constexpr = _Constexpr

    tl = _StubLanguage()  # noqa: F811 - annotations only
    libdevice = None

    class _StubKernel:
        """What ``@jit`` returns without Triton: launching it raises ``TritonUnavailable``."""

        def __init__(self, fn):
            functools.update_wrapper(self, fn)
            self.fn = fn

        def _fail(self, *args, **kwargs):
            raise TritonUnavailable(f"Triton is not installed: {INSTALL_HINT}")

        __call__ = _fail

        def __getitem__(self, grid):
            return self._fail

    def jit(fn=None, **kwargs):
        if fn is None:
            return lambda f: _StubKernel(f)
        return _StubKernel(fn)


def _fix_interpreter_scalars() -> None:
    """Make the Triton CPU interpreter run loops with runtime bounds under numpy >= 2.4.

    The interpreter (Triton 3.6) holds scalars as 1-element arrays and converts them with
    ``int(array)``, which numpy 2.4 rejects for arrays of shape ``(1,)``, so ``for j in
    range(lo, hi)`` with runtime ``lo``/``hi`` fails.  This wraps the interpreter's tensor
    patching to convert through the single element.  Interpreter only; compiled kernels are
    not affected.
    """
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_kvbench_scalar_fix", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._kvbench_scalar_fix = True
    interp._patch_lang_tensor = patched


def require_triton() -> None:
    """Raise :class:`TritonUnavailable` (with the install hint) if Triton is missing."""
    if not HAS_TRITON:
        raise TritonUnavailable(f"Triton is not installed: {INSTALL_HINT}")


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@jit`` function) runs in the Triton CPU interpreter.

    Triton fixes this when the kernel is decorated (``TRITON_INTERPRET=1`` at import time)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel, *tensors) -> None:
    """Refuse tensors the kernel cannot read (device placement before a kernel launch (CPU tensor to Triton): jy-yuan/KIVI#24 and #13, docs/methods.md#device-placement-before-a-kernel-launch): CUDA tensors on one device, or CPU
    tensors under the interpreter.  Raises ``ValueError`` naming the required device."""
    require_triton()
    interp = is_interpreted(kernel)
    if interp:
        _fix_interpreter_scalars()
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    for dev in devices:
        if interp and dev.type != "cpu":
            raise ValueError(
                f"the Triton interpreter (TRITON_INTERPRET=1) needs CPU tensors, got {dev}"
            )
        if not interp and dev.type != "cuda":
            raise ValueError(
                f"Triton kernels need CUDA tensors, got {dev} (set TRITON_INTERPRET=1 before "
                "importing triton to run them on CPU in the interpreter)"
            )


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
