"""Answer extraction and normalization for the math-reasoning task suites.

GSM8K follows EleutherAI lm-evaluation-harness (``lm_eval/tasks/gsm8k/gsm8k.yaml`` and
``gsm8k-cot.yaml``, task version 3.0):

- ``strict-match`` (gsm8k.yaml): regex ``#### (\\-?[0-9\\.\\,]+)``, first match
  (``take_first``); gsm8k-cot.yaml's strict-match is ``The answer is (\\-?[0-9\\.\\,]+).``
- ``flexible-extract`` (both): regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` with ``group_select: -1``
  (the last match; of a match's groups, the non-empty one), stripped.
- no match gives the harness fallback ``"[invalid]"``.
- comparison: the ``exact_match`` metric with ``ignore_case: true`` and ``regexes_to_ignore``
  ``","``, ``"\\$"``, ``"(?s).*#### "``, ``"\\.$"`` applied to prediction and reference.
  :func:`harness_exact_match` is that string comparison; :func:`numbers_equal` (the default of
  :func:`gsm8k_is_correct`) compares the same normalized strings as exact numbers, so ``72.00``
  equals ``72``.

MGSM native chain-of-thought answer phrases are lm-evaluation-harness's
(``lm_eval/tasks/mgsm/utils.py``, ``LANGUAGES[lang]["REGEX"]``; Bengali keeps the English
phrase there), with the flexible-extract regex as fallback. MATH/AIME/AMC boxed answers live in
:mod:`kvbench.bench.tasks.math_answer`.
"""

from __future__ import annotations

import re
import unicodedata
from decimal import Decimal, InvalidOperation

__all__ = [
    "INVALID",
    "GSM8K_STRICT_REGEX",
    "GSM8K_COT_STRICT_REGEX",
    "FLEXIBLE_REGEX",
    "MGSM_ANSWER_REGEX",
    "MGSM_LANGUAGES",
    "regex_filter",
    "gsm8k_strict",
    "gsm8k_cot_strict",
    "gsm8k_flexible",
    "gsm8k_gold",
    "normalize_answer",
    "harness_exact_match",
    "numbers_equal",
    "gsm8k_is_correct",
    "ascii_digits",
    "mgsm_strict",
    "mgsm_extract",
    "mgsm_is_correct",
]

INVALID = "[invalid]"
GSM8K_STRICT_REGEX = r"#### (\-?[0-9\.\,]+)"
GSM8K_COT_STRICT_REGEX = r"The answer is (\-?[0-9\.\,]+)."
FLEXIBLE_REGEX = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
_IGNORE_REGEXES = (",", r"\$", r"(?s).*#### ", r"\.$")

_NUM = r"(\-?[0-9\.\,]+)"
#: Native-CoT answer regexes per MGSM language (lm-evaluation-harness mgsm/utils.py).
MGSM_ANSWER_REGEX: dict[str, str] = {
    "bn": "The answer is " + _NUM,
    "de": "Die Antwort lautet " + _NUM,
    "en": "The answer is " + _NUM,
    "es": "La respuesta es " + _NUM,
    "fr": "La r\u00e9ponse est " + _NUM,
    "ja": "\u7b54\u3048\u306f" + _NUM + "\u3067\u3059\u3002",  # 答えは(...)です。
    "ru": "\u041e\u0442\u0432\u0435\u0442 \u2014 " + _NUM,  # Ответ — (...)
    "sw": "Jibu ni " + _NUM,
    "te": "\u0c38\u0c2e\u0c3e\u0c27\u0c3e\u0c28\u0c02 " + _NUM,  # సమాధానం (...)
    "th": "\u0e04\u0e33\u0e15\u0e2d\u0e1a\u0e04\u0e37\u0e2d " + _NUM,  # คำตอบคือ (...)
    "zh": "\u7b54\u6848\u662f " + _NUM + "\u3002",  # 答案是 (...)。
}
MGSM_LANGUAGES: tuple[str, ...] = tuple(sorted(MGSM_ANSWER_REGEX))


def regex_filter(text: str, pattern: str, group_select: int = 0, fallback: str = INVALID) -> str:
    """lm-evaluation-harness's ``RegexFilter`` on one response.

    Parameters
    ----------
    text : str
        Model completion.
    pattern : str
        Regular expression; ``re.findall`` semantics.
    group_select : int
        Which match to keep (0: first, -1: last).
    fallback : str
        Returned when nothing matches.

    Returns
    -------
    str
        The selected match (first non-empty group of a multi-group pattern), stripped.
    """
    matches = re.findall(pattern, text)
    if not matches:
        return fallback
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), "")
    return match.strip()


def gsm8k_strict(completion: str) -> str:
    """GSM8K ``strict-match``: the first ``#### <number>``, else ``"[invalid]"``."""
    return regex_filter(completion, GSM8K_STRICT_REGEX)


def gsm8k_cot_strict(completion: str) -> str:
    """gsm8k-cot ``strict-match``: the first ``The answer is <number>.``, else ``"[invalid]"``."""
    return regex_filter(completion, GSM8K_COT_STRICT_REGEX)


def gsm8k_flexible(completion: str) -> str:
    """GSM8K ``flexible-extract``: the last number-like span, else ``"[invalid]"``."""
    return regex_filter(completion, FLEXIBLE_REGEX, group_select=-1)


def gsm8k_gold(answer: str) -> str:
    """The reference number of a GSM8K ``answer`` field (text after ``####``), normalized."""
    return normalize_answer(answer)


def normalize_answer(text: str) -> str:
    """The harness's ``exact_match`` normalization (``regexes_to_ignore`` then lower case).

    Removes commas, ``$``, everything up to a ``#### ``, one trailing ``.``, and strips
    surrounding whitespace (the gold's ``answer.split('####')[-1].strip()``).
    """
    for pattern in _IGNORE_REGEXES:
        text = re.sub(pattern, "", text.strip())
    return text.strip().lower()


def harness_exact_match(pred: str, gold: str) -> bool:
    """String equality after :func:`normalize_answer`, as the harness scores GSM8K."""
    return normalize_answer(pred) == normalize_answer(gold)


def _as_decimal(text: str) -> Decimal | None:
    s = normalize_answer(text)
    if not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def numbers_equal(pred: str, gold: str) -> bool:
    """Exact numeric equality after :func:`normalize_answer` (``"$1,000.00"`` == ``"1000"``).

    Returns ``False`` when either side is not a number (e.g. ``"[invalid]"``).
    """
    a, b = _as_decimal(pred), _as_decimal(gold)
    return a is not None and b is not None and a == b


def gsm8k_is_correct(completion: str, gold: str, mode: str = "flexible-extract") -> bool:
    """Whether a GSM8K completion is correct under one of the harness filters.

    Parameters
    ----------
    completion : str
        Model output.
    gold : str
        Reference answer: the dataset's ``answer`` field or just the number.
    mode : {"flexible-extract", "strict-match", "cot-strict-match"}
        Which filter extracts the prediction.

    Returns
    -------
    bool
        :func:`numbers_equal` of the extracted and the reference number.
    """
    filters = {
        "flexible-extract": gsm8k_flexible,
        "strict-match": gsm8k_strict,
        "cot-strict-match": gsm8k_cot_strict,
    }
    if mode not in filters:
        raise ValueError(f"mode must be one of {sorted(filters)}, got {mode!r}")
    return numbers_equal(filters[mode](completion), gsm8k_gold(gold))


def ascii_digits(text: str) -> str:
    """Map every Unicode decimal digit (full-width, Bengali, Thai, Telugu...) to ASCII."""
    return "".join(
        str(unicodedata.decimal(ch)) if not ch.isascii() and ch.isdecimal() else ch for ch in text
    )


def mgsm_strict(completion: str, lang: str) -> str:
    """MGSM native-CoT ``strict-match`` for ``lang`` (first match), else ``"[invalid]"``.

    Non-ASCII decimal digits are mapped to ASCII first (the harness regexes only see
    ``[0-9]``; this is kvbench's only deviation).
    """
    if lang not in MGSM_ANSWER_REGEX:
        raise ValueError(f"lang must be one of {list(MGSM_LANGUAGES)}, got {lang!r}")
    return regex_filter(ascii_digits(completion), MGSM_ANSWER_REGEX[lang])


def mgsm_extract(completion: str, lang: str) -> str:
    """MGSM answer: the native answer phrase if present, else the last number (flexible).

    Parameters
    ----------
    completion : str
        Model output.
    lang : str
        One of :data:`MGSM_LANGUAGES` (``bn de en es fr ja ru sw te th zh``).

    Returns
    -------
    str
        The extracted number string, or ``"[invalid]"``.
    """
    strict = mgsm_strict(completion, lang)
    if strict != INVALID:
        return strict
    return regex_filter(ascii_digits(completion), FLEXIBLE_REGEX, group_select=-1)


def mgsm_is_correct(completion: str, answer_number: str | int | float, lang: str) -> bool:
    """Whether an MGSM completion's extracted number equals ``answer_number`` exactly."""
    gold = answer_number
    if isinstance(gold, float) and gold.is_integer():
        gold = int(gold)
    return numbers_equal(mgsm_extract(completion, lang), str(gold))
