"""What an attention backend is, and what it may read of a cache.

A *backend* computes one decode step's attention over a layer cache
(:class:`Backend`); it is registered in the entry-point group ``kvbench.backends`` (the
built-in ones live in ``kvbench.kernels``) and :mod:`kvbench.attention.dispatch` holds the order
in which each device tries them.  A backend reads only the public attributes of
:class:`AttentionCache` (the layer cache's sides, shape and flags), so nothing here imports
:mod:`kvbench.cache.layer`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionSide(Protocol):
    """One side (keys or values) of a cache, in token order: ``sinks`` ``[B, H_kv, S, D]``
    (full precision or ``None``), ``block`` (the quantized tokens, a block object or
    ``None``), ``residual`` ``[B, H_kv, R, D]`` (full precision or ``None``);
    ``reads_transformed``: ``None`` when attention may read the stored parts, else why not."""

    sinks: torch.Tensor | None
    block: object | None
    residual: torch.Tensor | None

    @property
    def reads_transformed(self) -> str | None: ...

    def __len__(self) -> int: ...


class AttentionCache(Protocol):
    """The public attributes of :class:`kvbench.cache.layer.LayerCache` that the backends read.

    Flags: ``reads_transformed`` (on the cache or a side: why attention may not read the stored
    parts; ``None``: it may), ``observes_attention`` (the cache wants each step's
    probabilities through ``observe_attention(probs, lengths)``).  The dispatch records the
    path that ran in ``attend_path`` and why the faster ones declined in
    ``attend_path_reason``."""

    k: AttentionSide
    v: AttentionSide
    attend_path: str | None
    attend_path_reason: str

    @property
    def reads_transformed(self) -> str | None: ...

    @property
    def observes_attention(self) -> bool: ...

    @property
    def kv_shape(self) -> tuple[int, int, int] | None: ...

    @property
    def seq_length(self) -> int: ...

    @property
    def awaiting_queries(self) -> bool: ...

    def keys_values(
        self, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def observe_attention(self, probs: torch.Tensor, lengths: torch.Tensor | None) -> None: ...


class Backend(Protocol):
    """A decode-attention backend.

    ``name``: its name (``"triton"``, ``"code-domain"``); ``device``: the device type it
    serves (``"cuda"``; ``"*"``: any device); ``devices_for(block_type)``: the device types on
    which it reads blocks of ``block_type`` without dequantizing them;
    ``reason(cache, query, lengths)``: ``None`` when it can run this step, else why not (the
    string recorded in ``attend_path_reason``); ``run(cache, query, scaling, lengths)``:
    ``(out [B, H_q, n_q, D] in the query's dtype, the recorded path)``."""

    name: str
    device: str

    def devices_for(self, block_type: type) -> list[str]: ...

    def reason(
        self, cache: AttentionCache, query: torch.Tensor, lengths: torch.Tensor | None
    ) -> str | None: ...

    def run(
        self,
        cache: AttentionCache,
        query: torch.Tensor,
        scaling: float | None,
        lengths: torch.Tensor | None,
    ) -> tuple[torch.Tensor, str]: ...


def layout_name(cache: AttentionCache) -> str:
    """``"keys=<type>, values=<type>"`` of a cache's stored blocks (for messages)."""
    kb, vb = cache.k.block, cache.v.block
    return (
        f"keys={type(kb).__name__ if kb is not None else 'none'}, "
        f"values={type(vb).__name__ if vb is not None else 'none'}"
    )


def common_reason(
    cache: AttentionCache, query: torch.Tensor, lengths: torch.Tensor | None
) -> str | None:
    """Why no backend but the reference may read ``cache`` for ``query`` (``None``: the stored
    parts are what attention reads and the shapes fit)."""
    why = cache.reads_transformed
    if why:
        return why
    for name, side in (("key", cache.k), ("value", cache.v)):
        why = side.reads_transformed
        if why:
            return f"{name} side: {why}"
    if cache.awaiting_queries or not cache.seq_length:
        return "no stored tokens to attend to"
    shape = cache.kv_shape
    if (
        query.dim() != 4
        or shape is None
        or query.shape[0] != shape[0]
        or query.shape[3] != shape[2]
    ):
        return "query does not fit the cache"
    if query.shape[1] % shape[1]:
        return "query heads are not a multiple of the KV heads"
    if len(cache.k) != len(cache.v):
        return "keys and values hold different token counts"
    return None
