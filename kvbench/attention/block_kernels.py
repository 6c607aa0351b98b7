"""The table of code-domain block kernels: which :class:`BlockKernel` reads a stored block
type on a device.

The built-in kernels are registered in one place, :mod:`kvbench.attention.dispatch`.  A plugin
whose method stores its own block type registers its kernel with :func:`register_block_kernel`
(the one public way to do so); a block type without a kernel is read by the reference path
(dequantize, then softmax), with the reason recorded.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BlockKernel(Protocol):
    """Code-domain attention terms of one stored block type on one device.

    ``key_reason(block, head_dim)`` / ``value_reason(block, head_dim)``: ``None`` when the
    block is supported on that side, else why not.  ``key_logits(block, q) -> float32
    [B, H_kv, M, n]`` for query rows ``q`` float32 ``[B, H_kv, M, D]`` (the logit scale
    applied; ``M = (H_q / H_kv) * n_q`` rows per KV head).  ``value_output(block, p) ->
    float32 [B, H_kv, M, D]`` for probabilities ``p`` float32 ``[B, H_kv, M, n]``.  A kernel
    with a native form uses it only where the running step allows it
    (``native_allowed()`` of the code-domain backend) and reports it (``note_impl``).
    """

    def key_reason(self, block: object, head_dim: int) -> str | None: ...

    def value_reason(self, block: object, head_dim: int) -> str | None: ...

    def key_logits(self, block: object, q: torch.Tensor) -> torch.Tensor: ...

    def value_output(self, block: object, p: torch.Tensor) -> torch.Tensor: ...


_KERNELS: dict[tuple[type, str], BlockKernel] = {}


def register_block_kernel(
    block_type: type, kernel: BlockKernel, devices: tuple[str, ...] = ("cpu",)
) -> None:
    """Register ``kernel`` for blocks of exactly ``block_type`` on each device type in
    ``devices`` (replacing an earlier registration).

    This is how a plugin method gives its own block type a code-domain kernel: call it once,
    e.g. from the module that defines the block type, before the first decode step."""
    for dev in devices:
        _KERNELS[(block_type, dev)] = kernel


def block_kernel(block: object, device: str = "cpu") -> BlockKernel | None:
    """The kernel registered for ``type(block)`` on ``device``, or ``None``."""
    return _KERNELS.get((type(block), device))


def kernel_devices(block_type: type) -> list[str]:
    """The device types with a kernel registered for ``block_type``, sorted."""
    return sorted(dev for (t, dev) in _KERNELS if t is block_type)
