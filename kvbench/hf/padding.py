"""Left padding in the transformers bridge: per-row lengths from the 2-D attention mask.

transformers builds one mask per forward from the 2-D ``attention_mask`` ``[B, kv_len]``
(True/1 = real token).  kvbench's mask function (:func:`kvbench.hf.attention.kvbench_mask`)
records it with :func:`record`; ``QuantizedKVCache.update`` reads it with :func:`current`, derives
per-row lengths at the prefill (:func:`prefill_lengths`) and checks every decode step's mask
against what the cache holds (:func:`check_decode`).  The recorded mask carries its shape, so a
mask left from another forward (another length) is never taken for this one.  What is refused,
and why right padding is refused also in a prefill-only batch: docs/design.md#padding.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch


class PaddedBatchError(ValueError):
    """A padded batch that a kvbench cache cannot take: not left padding (holes, right padding,
    right padding followed by decode), a row without real tokens, a method without
    ``capabilities.padding``, or a padded cache stepped without its mask."""


_MASK: ContextVar[torch.Tensor | None] = ContextVar("kvbench_padding_mask", default=None)


def record(attention_mask: object) -> None:
    """Remember the 2-D mask of the current forward (``None``: no mask, or no padding)."""
    ok = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
    pad = attention_mask.bool() if ok else None
    _MASK.set(None if pad is None or bool(pad.all()) else pad)


def current(batch: int, kv_len: int) -> torch.Tensor | None:
    """The recorded padded 2-D mask if it belongs to a step over ``[batch, kv_len]``."""
    m = _MASK.get()
    return m if m is not None and tuple(m.shape) == (batch, kv_len) else None


def _not_left(row: int, where: str) -> PaddedBatchError:
    return PaddedBatchError(
        f"row {row} of the attention_mask is not left padding ({where}); kvbench caches take "
        "left-padded batches (pads first, then real tokens, then only real decode tokens). "
        "Re-tokenize with padding_side='left'."
    )


def prefill_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Per-row real tokens ``[B]`` (int64) of a left-padded prefill mask ``[B, P]`` (bool).

    Raises :class:`PaddedBatchError` naming the first row with no real token or with a pad
    after a real token (a hole or right padding)."""
    m = mask.bool().cpu()
    lengths = m.sum(-1)
    for b in range(m.shape[0]):
        n = int(lengths[b])
        if n == 0:
            raise PaddedBatchError(
                f"row {b} of the attention_mask has no real token; every row needs at least one"
            )
        if not bool(m[b, m.shape[1] - n :].all()):
            first = int(m[b].int().argmax())
            hole = int((~m[b, first:]).int().argmax()) + first
            where = "right padding" if not bool(m[b, hole:].any()) else "a hole"
            raise _not_left(b, f"{where} at position {hole}")
    return lengths


def check_decode(mask: torch.Tensor | None, pads: list[int], held: int, new: int) -> None:
    """Check a decode step's mask ``[B, held + new]`` against the cache: row ``b`` has
    ``pads[b]`` pads at the left, all else real.  ``mask=None`` (no padding recorded for this
    step) is right only when no row is padded.

    Raises :class:`PaddedBatchError` naming the row."""
    if mask is None:
        if any(pads):
            raise PaddedBatchError(
                "this cache holds a left-padded batch but the step came without its "
                "attention_mask (or with a mask of another shape): pass the extended "
                "attention_mask at every step (model.generate does)"
            )
        return
    m = mask.bool().cpu()
    pos = torch.arange(held + new)
    for b, p in enumerate(pads):
        want = pos >= p
        if not torch.equal(m[b], want):
            bad = int((m[b] != want).int().argmax())
            where = (
                "a new pad after real tokens: right padding followed by decode, or a hole"
                if bad >= p
                else "its pads changed since the prefill"
            )
            raise _not_left(b, f"{where}, position {bad}")
