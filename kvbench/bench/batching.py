"""Batches of prompts of different lengths for the workloads that decode through a model
(``generation``, ``passkey``, the task workloads, ``latency``): left padding with per-row
positions, and what the padding cost (docs/design.md#padding).

A batch of prompts ``[1, P_i]`` becomes ``ids`` ``[B, P]`` (``P = max P_i``; row ``b``'s real
tokens are its last ``P_b`` positions, the rest the pad id), ``mask`` ``[B, P]`` (int64, 1 =
real) and ``positions`` ``[B, P]`` (int64, the real tokens at 0..P_b-1, as the row alone).  A
kvbench cache fed that mask caches each row alone, so padding costs compute, not storage;
:class:`PadLedger` records that cost and the pad tokens the caches hold (0 by construction).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from transformers.cache_utils import Cache

    from kvbench.hf.shapes import ByteTokenizer

T = TypeVar("T")


def chunks(items: Sequence[T], size: int) -> list[list[T]]:
    """``items`` cut into consecutive batches of ``size`` (the last may be shorter)."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def pad_id(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | ByteTokenizer | None = None
) -> int:
    """The id written at pad positions: the tokenizer's pad token, else an end-of-sequence id
    of the tokenizer or the model's generation config, else 0.  Pads are masked and never
    cached, so the value does not change any result."""
    cands: list[int | list[int] | None] = []
    if tokenizer is not None:
        cands += [tokenizer.pad_token_id, tokenizer.eos_token_id]
    gen = model.generation_config  # None for a model that cannot generate
    if gen is not None:
        cands += [gen.pad_token_id, gen.eos_token_id]
    for c in cands:
        if isinstance(c, (list, tuple)) and c:
            c = c[0]
        if isinstance(c, int) and not isinstance(c, bool):
            return c
    return 0


def left_pad(
    prompts: Sequence[torch.Tensor], pad: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, positions)``, each ``[B, P]`` int64, of prompts ``[1, P_i]`` or ``[P_i]``
    left-padded to the longest (module docstring).  Raises ``ValueError`` for an empty prompt
    (a row needs at least one real token)."""
    lens = [int(p.reshape(-1).shape[0]) for p in prompts]
    if not lens or min(lens) < 1:
        raise ValueError(f"left_pad needs prompts of at least one token; lengths {lens}")
    b, width = len(prompts), max(lens)
    ids = torch.full((b, width), int(pad), dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - lens[i] :] = p.reshape(-1)
        mask[i, width - lens[i] :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


def stored_pad_tokens(cache: Cache, lens: Sequence[int], width: int) -> int | None:
    """Pad tokens the layers of a kvbench ``cache`` hold, measured: over layers, the tokens the
    rows hold minus the real ones (``lens[b]`` prompt tokens plus the decode tokens fed since,
    the padded length minus ``width``).  ``None`` for a cache that is not kvbench's
    (:class:`~kvbench.hf.cache.QuantizedKVCache`)."""
    layers = getattr(cache, "layer_caches", None)  # only kvbench's cache has them
    if not callable(layers):
        return None
    total = 0
    for lc in layers():
        if lc is None:
            continue
        steps = lc.seq_length - width
        held = lc.row_lengths if lc.rows is not None else [lc.seq_length] * lc.batch_size
        total += sum(held) - sum(n + steps for n in lens)
    return total


class PadLedger:
    """What padding cost over a workload's batches (the record's ``info["padding"]``):
    ``batch_size``, ``batches``, ``prompt_tokens`` (real), ``pad_tokens`` (prefill positions
    that were pads, summed over batches), ``pad_fraction`` (pads / all prefill positions),
    ``pad_tokens_stored`` (measured from the caches by :func:`stored_pad_tokens`, summed over
    layers and caches; ``None`` when a cache cannot say) and ``decode_attention_calls_per_layer``
    (a padded batch attends once per row)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = int(batch_size)
        self.batches = self.real = self.pads = 0
        self.stored: int | None = 0
        self.padded_batches = 0

    def add(self, lens: Sequence[int], cache: Cache | None = None, stored: int | None = 0) -> None:
        """One batch of prompts with ``lens`` real tokens, and the cache that held it (its
        stored pad tokens are measured), or ``stored``: pad tokens measured by the caller
        (``None``: unknown).  A batch of one prompt has no pads."""
        width = max(lens)
        self.batches += 1
        self.real += sum(lens)
        self.pads += sum(width - n for n in lens)
        self.padded_batches += any(n != width for n in lens)
        if cache is not None:
            stored = stored_pad_tokens(cache, lens, width)
        self.stored = None if stored is None or self.stored is None else self.stored + stored

    def info(self) -> dict[str, object]:
        total = self.real + self.pads
        return {
            "batch_size": self.batch_size,
            "batches": self.batches,
            "padded_batches": self.padded_batches,
            "prompt_tokens": self.real,
            "pad_tokens": self.pads,
            "pad_fraction": self.pads / total if total else 0.0,
            "pad_tokens_stored": self.stored,
            "rule": "left padding; each row cached alone, pads dropped before any code runs "
            "(docs/design.md#padding)",
            "decode_attention_calls_per_layer": "one per row in a padded batch (per-row caches)",
        }
