"""Tokenizer adapter for the synthetic tasks: ids, counts and character-to-token spans.

Any object with ``encode(text)`` returning ids (or an object with ``.ids``) works. A
``tokenizers.Tokenizer``, or a Hugging Face tokenizer with a ``backend_tokenizer``, is used
through its Rust backend: batched counting and character offsets, so a needle's token span is
read from one encoding of the prompt. Other tokenizers fall back to encoding prompt prefixes.
Special tokens are never added: positions index ``encode(prompt, add_special_tokens=False)``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["TokenizerLike", "encode", "count_tokens", "count_many", "token_spans"]


@runtime_checkable
class Encoding(Protocol):
    """What a ``tokenizers.Tokenizer.encode`` returns: the token ``ids`` (and more)."""

    @property
    def ids(self) -> list[int]: ...


class TokenizerLike(Protocol):
    """Anything with ``encode(text)`` returning token ids (or an object with ``.ids``)."""

    def encode(self, text: str) -> Sequence[int] | Encoding: ...


def _backend(tokenizer: TokenizerLike) -> Tokenizer | None:
    """The Rust ``tokenizers.Tokenizer`` of ``tokenizer`` (itself, or a Hugging Face fast
    tokenizer's ``backend_tokenizer``: slow ones and other objects have none), else ``None``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def encode(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens.

    Works with Hugging Face tokenizers (``add_special_tokens=False``), ``tokenizers.Tokenizer``
    (``Encoding.ids``) and any object whose ``encode(text)`` returns a list of ints.
    """
    backend = _backend(tokenizer)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    try:
        out = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[call-arg]
    except TypeError:
        out = tokenizer.encode(text)
    return list(out.ids if isinstance(out, Encoding) else out)


def count_tokens(tokenizer: TokenizerLike, text: str) -> int:
    """Number of tokens of ``text`` (see :func:`encode`)."""
    return len(encode(tokenizer, text))


def count_many(tokenizer: TokenizerLike, texts: Sequence[str]) -> list[int]:
    """Token counts of several texts (one batched call with a Rust backend)."""
    backend = _backend(tokenizer)
    if backend is not None:
        return [len(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [count_tokens(tokenizer, t) for t in texts]


def _lcp(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def token_spans(
    tokenizer: TokenizerLike, text: str, char_spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Encode ``text`` and map character spans to token spans ``[start, end)``.

    A token belongs to a span if it overlaps the span's non-blank characters (so a leading
    ``" "`` merged into the first word's token, as in byte-level BPE, is included).

    Parameters
    ----------
    char_spans : sequence of (int, int)
        Character ranges ``[a, b)`` of ``text``.

    Returns
    -------
    ids : list of int
        ``encode(text)``.
    spans : list of (int, int)
        Token ranges, one per character range.
    """
    backend = _backend(tokenizer)
    spans: list[tuple[int, int]] = []
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        ends = [e for _, e in enc.offsets]
        starts = [s for s, _ in enc.offsets]
        for a, b in char_spans:
            a += len(text[a:b]) - len(text[a:b].lstrip())
            spans.append((bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)))
        return ids, spans
    ids = encode(tokenizer, text)
    for a, b in char_spans:
        start = _lcp(ids, encode(tokenizer, text[:a]))
        end_ids = encode(tokenizer, text[:b])
        end = _lcp(ids, end_ids)
        spans.append((start, end if end == len(end_ids) else end + 1))
    return ids, spans
