"""Boxed-answer extraction and MATH-style answer equivalence (MATH-500, AIME, AMC).

Follows the normalization of the MATH benchmark's ``is_equiv`` / ``strip_string``
(Hendrycks et al., 2021, ``math_equivalence.py``) with a few additions from Minerva's
``normalize_final_answer`` (Lewkowycz et al., 2022): ``\\text{...}`` unwrapping, thin spaces,
``{,}`` thousands separators. Equality is string equality after normalization, then an exact
numeric comparison (integers, decimals, ``a/b``, ``\\frac{a}{b}``) with :class:`fractions.Fraction`,
so ``0.5`` equals ``\\frac{1}{2}`` without sympy.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

    Braces are matched with a depth counter, so nested groups (``\\boxed{\\sqrt{2}}``) are kept
    whole. The brace-less form ``\\boxed 5`` (MATH's ``last_boxed_only_string``) reads up to the
    next ``$`` or the end of the text.

    Parameters
    ----------
    text : str
        A model completion or a reference solution.

    Returns
    -------
    str or None
        The content without the command and the outer braces; ``None`` when there is no box or
        its braces are unbalanced.
    """
    idx = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if idx < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, idx))
    rest = text[idx + len(cmd) :].lstrip(" ")
    if not rest.startswith("{"):
        return rest.split("$")[0].strip() or None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\frac"
        if sub.startswith("{") or len(sub) < 2:
            out += sub
            continue
        a, b = sub[0], sub[1]
        out += "{" + a + "}" + (b + sub[2:] if b == "{" else "{" + b + "}" + sub[2:])
    return out


def _fix_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    return re.sub(r"\\sqrt([^{\[\\])", r"\\sqrt{\1}", s)


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are integers."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _unwrap_text(s: str) -> str:
    """``\\text{abc}`` -> ``abc`` (also ``\\textbf``, ``\\mbox``, ``\\mathrm``), innermost first."""
    pattern = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|mathbf)\{([^{}]*)\}")
    changed = 1
    while changed:
        s, changed = pattern.subn(r"\1", s)
    return s


def strip_math(answer: str) -> str:
    """Normalize a MATH-style answer string, as MATH's ``strip_string`` does.

    Takes the content of a ``\\boxed{}`` if there is one; removes line breaks, ``\\!``,
    ``\\left``/``\\right``, degree marks (``^\\circ``), ``\\$``, ``\\%``,
    units written as ``\\text{ unit}``, spaces and a trailing ``.``; unwraps ``\\text{}``; maps
    ``\\dfrac``/``\\tfrac`` to ``\\frac``; fixes ``\\frac12`` and ``\\sqrt3``; turns ``x = 3``
    into ``3`` (left side of at most two characters or a single variable); writes ``.5`` as
    ``0.5``; turns ``0.5`` and integer ``a/b`` into ``\\frac`` form (as MATH does).

    Parameters
    ----------
    answer : str
        Raw answer, e.g. the content of a ``\\boxed{}``.

    Returns
    -------
    str
        The normalized string (possibly empty).
    """
    s = answer
    if "\\boxed" in s or "\\fbox" in s:
        s = last_boxed(s) or s
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\degree", "")
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:  # MATH: "\text{ " only occurs before units
        s = s.split("\\text{ ")[0]
    s = _unwrap_text(s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("{,}", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = s.strip()
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2:
        lhs = sides[0].strip()
        if len(lhs) <= 2 or re.fullmatch(r"\\?[A-Za-z]+(_\{?\w+\}?)?", lhs):
            s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = s.rstrip(".")
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def _plain_number(s: str) -> Fraction | None:
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?", s):
        s = s.replace(",", "")
    if not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", s):
        return None
    try:
        return Fraction(Decimal(s))
    except (InvalidOperation, ValueError):
        return None


def to_fraction(answer: str) -> Fraction | None:
    """Exact value of a numeric answer, or ``None`` when it is not a plain number.

    Accepts integers, decimals, thousands separators (``1,000``), ``a/b`` and ``\\frac{a}{b}``
    with an optional leading sign, after :func:`strip_math`.

    Parameters
    ----------
    answer : str
        Raw or normalized answer.
    """
    s = strip_math(answer)
    sign = 1
    if s.startswith("-") and (s.startswith("-\\frac") or "/" in s):
        sign, s = -1, s[1:]
    m = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", s) or re.fullmatch(r"([^/]+)/([^/]+)", s)
    if m:
        num, den = _plain_number(m.group(1)), _plain_number(m.group(2))
        if num is None or den is None or den == 0:
            return None
        return sign * num / den
    value = _plain_number(s)
    return None if value is None else sign * value


def is_equiv(pred: str | None, gold: str | None) -> bool:
    """Whether a predicted answer equals the reference answer.

    Both are normalized with :func:`strip_math` and compared as strings; if they differ, both are
    parsed with :func:`to_fraction` and compared exactly as numbers (``0.5`` == ``\\frac{1}{2}``
    == ``1/2``; ``0.33`` != ``\\frac{1}{3}``).

    Parameters
    ----------
    pred : str or None
        Extracted prediction (e.g. from :func:`extract_math_answer`); ``None`` is never equal.
    gold : str or None
        Reference answer.
    """
    if pred is None or gold is None:
        return False
    a, b = strip_math(pred), strip_math(gold)
    if a == b:
        return bool(a)
    fa, fb = to_fraction(a), to_fraction(b)
    return fa is not None and fa == fb


_MINERVA_RE = re.compile(r"final answer is\s*(.+?)\.?\s*(?:I hope it is correct|$)", re.I | re.S)


def extract_math_answer(completion: str) -> str | None:
    """The final answer of a MATH/AIME/AMC completion.

    The last ``\\boxed{}``/``\\fbox{}``; else Minerva's ``Final Answer: The final answer is X.
    I hope it is correct.`` phrase (dollar signs stripped); else ``None``.

    Parameters
    ----------
    completion : str
        Model output.
    """
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    m = _MINERVA_RE.search(completion)
    return m.group(1).strip().strip("$").strip() if m else None


def aime_answer(completion: str) -> int | None:
    """AIME answer of a completion: an integer in 0..999, or ``None``.

    Parameters
    ----------
    completion : str
        Model output; the answer is read with :func:`extract_math_answer`.

    Returns
    -------
    int or None
        ``None`` when no answer is found or it is not an integer in 0..999 (``033`` -> 33).
    """
    ans = extract_math_answer(completion)
    if ans is None:
        return None
    m = re.fullmatch(r"\((\d+)\)", strip_math(ans))  # "\textbf{(113) }", as in AoPS solutions
    value = to_fraction(m.group(1) if m else ans)
    if value is None or value.denominator != 1 or not 0 <= value <= 999:
        return None
    return int(value)
