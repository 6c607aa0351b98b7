"""RULER-style word-frequency tasks: common words (``cwe``) and frequent words (``fwe``).

Both fill the prompt with words from the wonderwords lists and have no needles, so their
examples carry empty ``needle_token_positions``; see :mod:`kvbench.bench.tasks.synthetic`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .haystack import Placement, SyntheticExample, word_list
from .tokens import TokenizerLike, count_tokens

__all__ = ["common_words", "frequent_words"]

_NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 10: "ten"}


def _fit(
    build: Callable[[int], str], tokenizer: TokenizerLike, length: int, hi: int
) -> tuple[int, Placement]:
    """The largest ``n`` in [0, hi] whose prompt fits ``length`` tokens, and that prompt."""
    if count_tokens(tokenizer, build(0)) > length:
        raise ValueError(f"length={length} is too small for this task's fixed part")
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, build(mid)) <= length:
            lo = mid
        else:
            hi = mid - 1
    prompt = build(lo)
    return lo, Placement(prompt, [], count_tokens(tokenizer, prompt))


def common_words(
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    num_common: int = 10,
    freq_common: int | None = None,
    freq_uncommon: int | None = None,
    wrap: tuple[str, str] = ("", ""),
) -> SyntheticExample:
    """RULER common words extraction (``cwe``).

    A numbered list ("1. word 2. word ...") of ``num_common`` words repeated ``freq_common``
    times and as many words repeated ``freq_uncommon`` times as fit in ``length`` tokens, in a
    seeded random order. The common words are the answers. Defaults follow RULER: 30 and 3
    repeats, or 6 and 1 below 4096 tokens (RULER's short-context setting; its one-shot example
    is not included).

    Parameters
    ----------
    length : int
        Maximum prompt length in tokens.
    wrap : (str, str)
        Text around the prompt (e.g. a chat template), counted in ``length``.

    Returns
    -------
    dict
        As the needle tasks, with empty ``needle_token_positions`` and ``depth`` None.
    """
    short = length < 4096
    freq_common = freq_common if freq_common is not None else (6 if short else 30)
    freq_uncommon = freq_uncommon if freq_uncommon is not None else (1 if short else 3)
    if freq_common <= freq_uncommon:
        raise ValueError("freq_common must exceed freq_uncommon")
    rng = random.Random(seed)
    vocab = sorted(set(word_list("noun") + word_list("adjective") + word_list("verb")))
    rng.shuffle(vocab)
    common, rare = vocab[:num_common], vocab[num_common:]
    head = (
        "Below is a numbered list of words. In these words, some appear more often than "
        "others. Memorize the ones that appear most often.\n"
    )
    tail = (
        f"\nQuestion: What are the {num_common} most common words in the above list? "
        f"Answer: The top {num_common} words that appear most often in the list are:"
    )

    def build(n: int) -> str:
        words = common * freq_common + rare[:n] * freq_uncommon
        random.Random(seed + 1).shuffle(words)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return wrap[0] + head + listing + tail + wrap[1]

    _, p = _fit(build, tokenizer, length, len(rare))
    return p.example("cwe", seed, None, common, [])


def frequent_words(
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    num_answers: int = 3,
    alpha: float = 2.0,
    vocab_size: int = 2000,
    wrap: tuple[str, str] = ("", ""),
) -> SyntheticExample:
    """RULER frequent words extraction (``fwe``).

    ``vocab_size`` seeded nouns get Zipf counts ``floor(C / rank**alpha)``, shuffled into a
    space-separated text; ``C`` is the largest that fits ``length`` tokens. The
    ``num_answers`` most frequent words (distinct counts are checked) are the answers. Unlike
    RULER, the words are real nouns, not random letter codes, and there is no ``....`` noise.

    Parameters
    ----------
    length : int
        Maximum prompt length in tokens.
    alpha : float
        Zipf exponent (RULER: 2.0; lower is harder).

    Returns
    -------
    dict
        As :func:`common_words`.
    """
    rng = random.Random(seed)
    vocab = list(word_list("noun"))
    rng.shuffle(vocab)
    vocab = vocab[:vocab_size]
    n = _NUMBER_WORDS.get(num_answers, str(num_answers))
    head = (
        "Read the following coded text and track the frequency of each coded word. Find the "
        f"{n} most frequently appeared coded words. "
    )
    tail = (
        f"\nQuestion: Do not provide any explanation. What are the {n} most frequently "
        f"appeared words in the above coded text? Answer: According to the coded text above, "
        f"the {n} most frequently appeared words are:"
    )

    def counts(c: int) -> list[int]:
        return [int(c / (r + 1) ** alpha) for r in range(len(vocab))]

    def build(c: int) -> str:
        words = [w for w, n in zip(vocab, counts(c)) for _ in range(n)]
        random.Random(seed + 1).shuffle(words)
        return wrap[0] + head + " ".join(words) + tail + wrap[1]

    scale, p = _fit(build, tokenizer, length, 4 * length)
    cnt = counts(scale)
    if len(cnt) <= num_answers or not all(cnt[i] > cnt[i + 1] for i in range(num_answers)):
        raise ValueError(f"length={length} is too small for {num_answers} distinct top counts")
    return p.example("fwe", seed, None, vocab[:num_answers], [])
