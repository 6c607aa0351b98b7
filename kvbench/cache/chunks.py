"""Token-axis chunking for eager encoders whose codes depend on each token group alone.

Run chunk by chunk along T, an eager torch encoder's float32 and int32 temporaries stay a few
tens of MiB instead of the size of a whole long-prompt layer.  Only for codecs where every output
position along T depends on the input tokens of its own group (per-token groups, or token groups
of ``group`` tokens): the codes are then equal bit for bit to one pass.
"""

from __future__ import annotations

from collections.abc import Iterator

#: elements (over B, H_kv, tokens, D) per chunk: 8M, 32 MiB of float32 working data
CHUNK_ELEMENTS = 1 << 23


def token_chunks(
    batch: int, heads: int, tokens: int, dim: int, group: int = 1, elements: int | None = None
) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` token ranges covering ``[0, tokens)`` in order, each a multiple of
    ``group`` tokens long (the last may be shorter only where ``tokens`` is not) and about
    ``elements`` (default :data:`CHUNK_ELEMENTS`, read at each call) elements of a
    ``[batch, heads, n, dim]`` tensor (at least one group)."""
    elements = CHUNK_ELEMENTS if elements is None else elements
    group = max(int(group), 1)
    per_token = max(batch * heads * dim, 1)
    step = max(elements // per_token // group, 1) * group
    for t0 in range(0, tokens, step):
        yield t0, min(t0 + step, tokens)
