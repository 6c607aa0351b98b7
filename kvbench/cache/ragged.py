"""Left-padded batches in a :class:`~kvbench.cache.layer.LayerCache`: one row cache per sequence.

The rule, its price and the padded layer's coordinates are docs/design.md#padding: a prefill with
per-row ``lengths`` (row ``b``'s real tokens are the last ``lengths[b]`` positions) is stored as
``B`` deep copies of the still-empty layer cache, each prefilled with its row's real tokens only,
so a row's codes are bit-identical to the row run alone and no pad is stored.

This module holds the functions that :class:`~kvbench.cache.layer.LayerCache` dispatches to once a
padded prefill made it a row container; it never imports :mod:`kvbench.cache.layer`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

import torch


class Padded(Protocol):
    """A :class:`~kvbench.cache.layer.LayerCache` as this module reads it (it cannot import that
    module): the padded layer and each of its single-row caches."""

    dtype: torch.dtype | None
    attend_path: str | None
    attend_path_reason: str
    _rows: list[Padded] | None
    _pads: list[int]
    _bhd: tuple[int, int, int] | None

    @property
    def seq_length(self) -> int: ...

    def _check(self, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def prefill(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> None: ...

    def provide_queries(self, queries: torch.Tensor) -> None: ...

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def end_step(self) -> None: ...

    def keys_values(
        self, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(
        self,
        query: torch.Tensor,
        scaling: float | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def quantized_tokens(self) -> tuple[int, int]: ...

    def crop(self, max_length: int) -> None: ...

    def tensors(self) -> list[tuple[str, str, torch.Tensor]]: ...


def check_lengths(lengths: torch.Tensor | Sequence[int], batch: int, prompt: int) -> list[int]:
    """Per-row real-token counts as a list of ints.

    Raises ``ValueError`` unless ``lengths`` is ``[B]`` integers in ``[1, P]`` (a row with no
    real token is named: it has nothing to cache)."""
    t = torch.as_tensor(lengths)
    if t.dim() != 1 or t.shape[0] != batch or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(
            f"lengths must be {batch} integers (one per batch row, real tokens at the end of "
            f"the prompt); got {lengths!r}"
        )
    out = [int(x) for x in t.tolist()]
    for b, n in enumerate(out):
        if n < 1:
            raise ValueError(
                f"row {b} has {n} real tokens (lengths[{b}]={n}); every row needs >= 1"
            )
        if n > prompt:
            raise ValueError(f"lengths[{b}]={n} exceeds the prompt's {prompt} positions")
    return out


def prefill(
    layer: Padded,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    lengths: list[int],
) -> None:
    """Make the (empty) ``layer`` a container of one row cache per sequence and prefill each
    with its real tokens ``keys[b, :, P - lengths[b]:]`` (and queries likewise)."""
    p = keys.shape[2]
    template = copy.deepcopy(layer)  # empty: codecs, schedules, calibration, no tokens
    template._bhd = None  # (the caller's shape check recorded the batch's)
    rows = []
    for b, n in enumerate(lengths):
        row = copy.deepcopy(template)
        sl = slice(p - n, p)
        q = None if queries is None else queries[b : b + 1, :, sl]
        row.prefill(keys[b : b + 1, :, sl], values[b : b + 1, :, sl], q)
        rows.append(row)
    layer._rows, layer._pads = rows, [p - n for n in lengths]
    layer.dtype = keys.dtype


def provide_queries(layer: Padded, queries: torch.Tensor) -> None:
    for b, (row, pad) in enumerate(zip(layer._rows, layer._pads)):
        row.provide_queries(queries[b : b + 1, :, pad:])


def append(layer: Padded, keys: torch.Tensor, values: torch.Tensor) -> None:
    layer._check(keys, values)
    for b, row in enumerate(layer._rows):
        row.append(keys[b : b + 1], values[b : b + 1])


def end_step(layer: Padded) -> None:
    for row in layer._rows:
        row.end_step()


def seq_length(layer: Padded) -> int:
    """The padded length: pads + the row's tokens (equal for every row)."""
    return layer._pads[0] + layer._rows[0].seq_length


def keys_values(
    layer: Padded, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H_kv, T, D]`` in the batch's coordinates; each row's pads are zeros at the left."""
    t = seq_length(layer)
    ks, vs = [], []
    for row in layer._rows:
        k, v = row.keys_values(dtype or layer.dtype)
        pad = t - k.shape[2]
        ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
        vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
    return torch.cat(ks), torch.cat(vs)


def attend(
    layer: Padded,
    query: torch.Tensor,
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row attends to its own cache (its real tokens only); ``[B, H_q, n_q, D]``."""
    if lengths is not None:
        raise ValueError(
            "this layer cache holds a padded batch and knows each row's tokens; call attend() "
            "with lengths=None"
        )
    outs = [row.attend(query[b : b + 1], scaling) for b, row in enumerate(layer._rows)]
    paths = sorted({str(r.attend_path) for r in layer._rows})
    reasons = sorted({r.attend_path_reason for r in layer._rows} - {""})
    layer.attend_path = "+".join(paths)
    layer.attend_path_reason = "; ".join(["per-row caches (padded batch)", *reasons])
    return torch.cat(outs)


def quantized_tokens(layer: Padded) -> tuple[int, int]:
    """(keys, values) quantized tokens of the row that holds the most."""
    per = [row.quantized_tokens() for row in layer._rows]
    return max(k for k, _ in per), max(v for _, v in per)


def crop(layer: Padded, max_length: int) -> None:
    """Keep the first ``max_length`` positions of the batch's coordinates (negative: drop that
    many from the end).  Raises ``ValueError`` if a row would lose all its real tokens."""
    n = seq_length(layer) + max_length if max_length < 0 else max_length
    for b, pad in enumerate(layer._pads):
        if n - pad < 1:
            raise ValueError(
                f"crop to {n} positions would leave row {b} (padded by {pad}) with no real token"
            )
    for row, pad in zip(layer._rows, layer._pads):
        row.crop(n - pad)


def index_batch(layer: Padded, idx: torch.Tensor) -> None:
    """Keep/reorder rows ``idx`` (a row taken twice, as in beam search, is copied)."""
    seen: set[int] = set()
    rows, pads = [], []
    for i in torch.as_tensor(idx, dtype=torch.long).tolist():
        row = layer._rows[i]
        rows.append(copy.deepcopy(row) if i in seen else row)
        pads.append(layer._pads[i])
        seen.add(i)
    layer._rows, layer._pads = rows, pads
    layer._bhd = (len(rows), *layer._bhd[1:])


def tensors(layer: Padded) -> list[tuple[str, str, torch.Tensor]]:
    """Every tensor the rows hold (nothing is stored for pads)."""
    return [x for row in layer._rows for x in row.tensors()]


def lengths(layer: Padded) -> list[int]:
    """Tokens each row holds (its real tokens)."""
    return [row.seq_length for row in layer._rows]
