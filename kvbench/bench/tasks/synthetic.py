"""RULER-style synthetic long-context tasks, offline and deterministic from a seed.

Tasks (Hsieh et al., 2024, "RULER"; passkey retrieval from Mohtashami & Jaggi, 2023):

- ``niah_single``: one passkey ("The pass key is 71432. Remember it.") in the haystack.
- ``niah_multikey``: ``num_needles`` "special magic number" needles with distinct keys; one asked.
- ``niah_multivalue``: ``num_values`` numbers for one key; all asked.
- ``niah_multiquery``: ``num_needles`` keys, ``num_queries`` of them asked.
- ``vt`` (variable tracking): chains ``VAR X1 = 12345``, ``VAR X2 = VAR X1``...; asked for every
  variable of the first chain.
- ``cwe`` (common words extraction) and ``fwe`` (frequent words extraction): word-frequency
  tasks over wonderwords lists; they have no needles.

Every generator takes a tokenizer (see :class:`kvbench.bench.tasks.tokens.TokenizerLike`), a target
``length`` in tokens (the prompt never exceeds it) and a ``seed``, and returns a dict with
``task``, ``prompt``, ``answers``, ``needle_token_positions`` (first token of each needle in
``encode(prompt)`` without special tokens; the asked needle first), ``needle_token_spans``,
``needles``, ``context_tokens`` (tokens of the whole prompt), ``depth`` and ``seed``.
``depth`` is the target of the first needle as a fraction of the prompt's tokens (drawn from
the seed when ``None``); other needles go to seeded random depths. ``protect_prefix`` and
``protect_suffix`` keep every needle token out of the first / last tokens of the prompt (e.g.
attention sinks and a full-precision residual window). Prompts end with RULER's answer prefix.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvbench.registry import Registry

from .haystack import HaystackOptions, SyntheticExample, build_haystack_prompt, word_list
from .tokens import TokenizerLike
from .words import common_words, frequent_words

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = [
    "TASKS",
    "generate",
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
    "frequent_words",
    "score",
    "score_any",
    "needle_depths",
    "key_value_needles",
]

_NIAH_HEAD = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.\n"
)
_MAGIC = "One of the special magic numbers for {key} is: {value}."


def _keys(rng: random.Random, n: int) -> list[str]:
    adjectives, nouns = word_list("adjective"), word_list("noun")
    keys: dict[str, None] = {}
    while len(keys) < n:
        keys[f"{rng.choice(adjectives)}-{rng.choice(nouns)}"] = None
    return list(keys)


def _numbers(rng: random.Random, n: int, low: int = 1_000_000, high: int = 9_999_999) -> list[str]:
    return [str(v) for v in rng.sample(range(low, high + 1), n)]


def needle_depths(rng: random.Random, depth: float | None, n: int) -> tuple[float, list[float]]:
    """``(first, depths)``: target depths in [0, 1] of ``n`` needles, the first at ``depth``
    (drawn from ``rng`` when None), the others drawn from ``rng``, in that order."""
    first = rng.random() if depth is None else float(depth)
    return first, [first] + [rng.random() for _ in range(n - 1)]


def key_value_needles(
    keys: list[str], values: list[str], n_values: int, n_queries: int
) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """``(pairs, asked, answers)`` of RULER's key-value needles: ``(key, value)`` of each
    needle (key ``i // n_values`` with value ``i``), the first ``n_queries`` keys (asked) and
    the values of the asked keys in needle order."""
    pairs = [(keys[i // n_values], values[i]) for i in range(len(values))]
    asked = keys[:n_queries]
    return pairs, asked, [v for k, v in pairs if k in asked]


def niah_single(
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    protect_prefix: int = 0,
    protect_suffix: int = 0,
    haystack: str = "essay",
    wrap: tuple[str, str] = ("", ""),
) -> SyntheticExample:
    """Passkey retrieval: one needle "The pass key is NNNNN. Remember it.".

    Parameters
    ----------
    tokenizer : TokenizerLike
        Used to count tokens and measure positions.
    length : int
        Maximum prompt length in tokens.
    seed : int
        Seeds the passkey and (if ``depth`` is None) the depth.
    depth : float, optional
        Target position of the needle as a fraction of the prompt, in [0, 1].
    protect_prefix, protect_suffix : int
        Token counts at the start / end of the prompt that the needle must not touch.
    haystack : {"essay", "noise"}
    wrap : (str, str)
        Text around the prompt (e.g. a chat template's parts), included in positions.

    Returns
    -------
    dict
        See the module docstring; ``answers`` is ``[passkey]``.
    """
    rng = random.Random(seed)
    key = str(rng.randint(10_000, 99_999))
    d, depths = needle_depths(rng, depth, 1)
    needles = [f"The pass key is {key}. Remember it."]
    head = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information there.\n"
    )
    p = build_haystack_prompt(
        tokenizer,
        length,
        head,
        "\nWhat is the pass key? The pass key is",
        needles,
        depths,
        protect_prefix=protect_prefix,
        protect_suffix=protect_suffix,
        haystack=haystack,
        wrap=wrap,
    )
    return p.example("niah_single", seed, d, [key], needles)


def _niah(
    task: str,
    tokenizer: TokenizerLike,
    length: int,
    seed: int,
    depth: float | None,
    n_keys: int,
    n_values: int,
    n_queries: int,
    **kw: Unpack[HaystackOptions],
) -> SyntheticExample:
    rng = random.Random(seed)
    keys = _keys(rng, n_keys)
    values = _numbers(rng, n_keys * n_values)
    pairs, asked, answers = key_value_needles(keys, values, n_values, n_queries)
    d, depths = needle_depths(rng, depth, len(pairs))
    needles = [_MAGIC.format(key=k, value=v) for k, v in pairs]
    if n_values > 1 or n_queries > 1:
        query = asked[0] if n_values > 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
        tail = (
            f"\nWhat are all the special magic numbers for {query} mentioned in the "
            f"provided text? The special magic numbers for {query} mentioned in the "
            "provided text are"
        )
    else:
        tail = (
            f"\nWhat is the special magic number for {asked[0]} mentioned in the provided "
            f"text? The special magic number for {asked[0]} mentioned in the provided text is"
        )
    p = build_haystack_prompt(tokenizer, length, _NIAH_HEAD, tail, needles, depths, **kw)
    return p.example(task, seed, d, answers, needles)


def niah_multikey(
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    num_needles: int = 4,
    **kw: Unpack[HaystackOptions],
) -> SyntheticExample:
    """``num_needles`` key-value needles; the first key is asked (others are distractors).

    Keyword arguments as :func:`niah_single` (``protect_prefix``, ``protect_suffix``,
    ``haystack``, ``wrap``).
    """
    return _niah("niah_multikey", tokenizer, length, seed, depth, num_needles, 1, 1, **kw)


def niah_multivalue(
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    num_values: int = 4,
    **kw: Unpack[HaystackOptions],
) -> SyntheticExample:
    """One key with ``num_values`` values; all values are the answers."""
    return _niah("niah_multivalue", tokenizer, length, seed, depth, 1, num_values, 1, **kw)


def niah_multiquery(
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    num_needles: int = 4,
    num_queries: int = 4,
    **kw: Unpack[HaystackOptions],
) -> SyntheticExample:
    """``num_needles`` keys; the values of the first ``num_queries`` keys are the answers."""
    if not 1 <= num_queries <= num_needles:
        raise ValueError(f"need 1 <= num_queries <= num_needles, got {num_queries}, {num_needles}")
    return _niah(
        "niah_multiquery", tokenizer, length, seed, depth, num_needles, 1, num_queries, **kw
    )


def variable_tracking(
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    num_chains: int = 1,
    num_hops: int = 4,
    **kw: Unpack[HaystackOptions],
) -> SyntheticExample:
    """RULER variable tracking: ``num_chains`` chains of ``num_hops`` + 1 assignments.

    The first statement of the first chain goes to ``depth``; each chain's statements are in
    increasing depth order. The answers are the names of every variable of the first chain.
    """
    rng = random.Random(seed)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: dict[str, None] = {}
    while len(names) < num_chains * (num_hops + 1):
        names["".join(rng.choice(letters) for _ in range(5))] = None
    pool = list(names)
    values = _numbers(rng, num_chains, 10_000, 99_999)
    needles, depths = [], []
    d = rng.random() if depth is None else float(depth)
    for c in range(num_chains):
        chain = pool[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        lo = d if c == 0 else rng.random()
        ds = [lo] + sorted(lo + (1.0 - lo) * rng.random() for _ in range(num_hops))
        needles += [f"VAR {chain[0]} = {values[c]}"]
        needles += [f"VAR {chain[h]} = VAR {chain[h - 1]}" for h in range(1, num_hops + 1)]
        depths += ds
    answers = pool[: num_hops + 1]
    head = (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    )
    tail = (
        f"\nQuestion: Find all variables that are assigned the value {values[0]} in the text "
        "above. Answer: According to the chain(s) of variable assignment in the text above, "
        f"{num_hops + 1} variables are assigned the value {values[0]}, they are:"
    )
    p = build_haystack_prompt(tokenizer, length, head, tail, needles, depths, **kw)
    return p.example("vt", seed, d, answers, needles)


#: task name -> its generator ``(tokenizer, length, seed=..., **kwargs) -> example``
TASKS: Registry[Callable[..., SyntheticExample]] = Registry("task")
for _name, _generator in (
    ("niah_single", niah_single),
    ("niah_multikey", niah_multikey),
    ("niah_multivalue", niah_multivalue),
    ("niah_multiquery", niah_multiquery),
    ("vt", variable_tracking),
    ("cwe", common_words),
    ("fwe", frequent_words),
):
    TASKS.register(_name, _generator)


def generate(
    task: str, tokenizer: TokenizerLike, length: int, seed: int = 0, **kwargs: object
) -> SyntheticExample:
    """Generate one example of ``task`` (a name of :data:`TASKS`); kwargs go to its generator.

    Raises :class:`kvbench.registry.UnknownName` (a ``ValueError``) for an unknown task."""
    return TASKS.get(task)(tokenizer, length, seed=seed, **kwargs)


def score(prediction: str, answers: Sequence[str]) -> float:
    """RULER ``string_match_all``: fraction of answers contained (case-insensitively) in the
    prediction, in [0, 1]. Used for every task here."""
    if not answers:
        raise ValueError("answers must not be empty")
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def score_any(prediction: str, answers: Sequence[str]) -> float:
    """RULER ``string_match_part``: 1.0 if any answer is contained in the prediction."""
    pred = prediction.lower()
    return float(any(a.lower() in pred for a in answers))
