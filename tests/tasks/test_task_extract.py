"""Answer extraction: GSM8K (lm-eval filters), MATH/AIME boxed answers, MGSM."""

from __future__ import annotations

import pytest
from data_helpers import dataset

from kvbench.bench.tasks import extract as ex
from kvbench.bench.tasks.math_answer import (
    aime_answer,
    extract_math_answer,
    is_equiv,
    last_boxed,
    strip_math,
    to_fraction,
)


# --------------------------------------------------------------------------- GSM8K
def test_harness_regexes_verbatim() -> None:
    assert ex.GSM8K_STRICT_REGEX == r"#### (\-?[0-9\.\,]+)"
    assert ex.FLEXIBLE_REGEX == r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
    assert ex.GSM8K_COT_STRICT_REGEX == r"The answer is (\-?[0-9\.\,]+)."


def test_strict_match_hash_answer() -> None:
    completion = "Natalia sold 48/2 = 24 clips in May.\n48 + 24 = 72\n#### 72"
    assert ex.gsm8k_strict(completion) == "72"
    assert ex.gsm8k_is_correct(completion, "72", mode="strict-match")
    assert ex.gsm8k_is_correct(completion, "... so 72 in all.\n#### 72", mode="strict-match")


def test_strict_match_takes_first_and_fails_without_marker() -> None:
    assert ex.gsm8k_strict("#### 5\n#### 7") == "5"
    assert ex.gsm8k_strict("The answer is 72.") == ex.INVALID
    assert not ex.gsm8k_is_correct("The answer is 72.", "72", mode="strict-match")
    assert ex.gsm8k_strict("#### -3") == "-3"


def test_flexible_extract_the_answer_is() -> None:
    completion = "She sold 48 in April and 24 in May. The answer is 72."
    assert ex.gsm8k_flexible(completion) == "72."  # the harness keeps the dot; metric drops it
    assert ex.normalize_answer("72.") == "72"
    assert ex.gsm8k_is_correct(completion, "72")
    assert ex.gsm8k_cot_strict(completion) == "72"
    assert ex.gsm8k_is_correct(completion, "#### 72", mode="cot-strict-match")


def test_flexible_takes_last_number_and_money() -> None:
    assert ex.gsm8k_flexible("3 apples and 5 pears make 8") == "8"
    assert ex.gsm8k_flexible("It costs $1,080 in total") == "$1,080"
    assert ex.gsm8k_is_correct("It costs $1,080 in total", "1080")
    assert ex.gsm8k_flexible("no digits here") == ex.INVALID
    assert not ex.gsm8k_is_correct("no digits here", "0")


def test_normalization_and_number_comparison() -> None:
    assert ex.gsm8k_gold("work...\n#### 1,234") == "1234"
    assert ex.harness_exact_match("$72.", "72")
    assert not ex.harness_exact_match("72.0", "72")  # string metric of the harness
    assert ex.numbers_equal("72.00", "72")  # kvbench compares numbers
    assert not ex.numbers_equal("[invalid]", "72")
    assert not ex.numbers_equal("7.2", "72")
    with pytest.raises(ValueError, match="mode"):
        ex.gsm8k_is_correct("1", "1", mode="loose")


@pytest.mark.data
def test_gsm8k_reference_solutions_pass_strict_match() -> None:
    rows, _ = dataset("gsm8k")
    assert all(ex.gsm8k_is_correct(r["answer"], r["answer"], "strict-match") for r in rows)


# --------------------------------------------------------------------------- MATH / AIME
def test_last_boxed_nested_and_last() -> None:
    assert last_boxed(r"so $\boxed{\sqrt{2}}$.") == r"\sqrt{2}"
    assert last_boxed(r"\boxed{1} then \boxed{\frac{a}{b^{2}}}") == r"\frac{a}{b^{2}}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"$\boxed 5$") == "5"
    assert last_boxed(r"\boxed{unbalanced") is None
    assert last_boxed("no box") is None


def test_boxed_half_equals_decimal() -> None:
    pred = extract_math_answer(r"Thus the probability is $\boxed{\frac{1}{2}}$.")
    assert pred == r"\frac{1}{2}"
    assert is_equiv(pred, "0.5")
    assert is_equiv("0.5", r"\frac{1}{2}")
    assert is_equiv("1/2", r"\frac12")


def test_dfrac_shorthand_equals_frac() -> None:
    assert strip_math(r"\dfrac12") == r"\frac{1}{2}"
    assert is_equiv(extract_math_answer(r"\boxed{\dfrac12}"), r"\frac{1}{2}")
    assert is_equiv(r"\tfrac{3}{4}", "0.75")


def test_nested_braces_sqrt() -> None:
    pred = extract_math_answer(r"The side is \boxed{\sqrt{2}}")
    assert is_equiv(pred, r"\sqrt{2}")
    assert is_equiv(pred, r"\sqrt2")
    assert not is_equiv(pred, r"\sqrt{3}")


def test_strip_math_cases() -> None:
    assert strip_math("x = 3") == "3"
    assert strip_math(r"\left( 3, \frac{\pi}{2} \right)") == r"(3,\frac{\pi}{2})"
    assert strip_math(r"90^\circ") == "90"
    assert strip_math(r"5\text{ cm}") == "5"
    assert strip_math(r"10\%") == "10"
    assert strip_math(r"\!12.") == "12"
    assert is_equiv(r"\$18.90", "18.9")
    assert is_equiv("1,000", "1000")
    assert is_equiv(r"-\frac{1}{2}", "-0.5")
    assert is_equiv(r"\text{(C)}", "(C)")
    assert is_equiv("27", "27.0")  # AMC answers are stored as floats
    assert not is_equiv("0.33", r"\frac{1}{3}")
    assert not is_equiv(None, "1")
    assert to_fraction(r"\frac{6}{4}") == to_fraction("1.5")
    assert to_fraction(r"\pi") is None


def test_aime_answers() -> None:
    assert aime_answer(r"so $\boxed{033}$") == 33
    assert aime_answer(r"$\boxed{\textbf{(113) }}$") == 113
    assert aime_answer(r"\boxed{1000}") is None
    assert aime_answer(r"\boxed{2.5}") is None
    assert aime_answer("Final Answer: The final answer is $204$. I hope it is correct.") == 204
    assert aime_answer("I give up") is None


@pytest.mark.data
def test_math500_reference_solutions_equal_answers() -> None:
    rows, _ = dataset("math500")
    assert all(is_equiv(extract_math_answer(r["solution"]), r["answer"]) for r in rows)


# --------------------------------------------------------------------------- MGSM
def test_mgsm_native_phrases() -> None:
    assert set(ex.MGSM_LANGUAGES) == {
        "bn",
        "de",
        "en",
        "es",
        "fr",
        "ja",
        "ru",
        "sw",
        "te",
        "th",
        "zh",
    }
    cases = {
        "en": "3 + 4 = 7. The answer is 18.",
        "de": "Also 9 mal 2. Die Antwort lautet 18.",
        "es": "La respuesta es 18.",
        "fr": "Donc 9 x 2. La réponse est 18.",
        "ja": "9×2=18。答えは18です。",
        "zh": "所以 9 × 2 = 18。答案是 18。",
        "ru": "Ответ — 18.",
        "sw": "Jibu ni 18.",
        "te": "సమాధానం 18.",
        "th": "คำตอบคือ 18",
        "bn": "The answer is 18.",
    }
    for lang, text in cases.items():
        assert ex.mgsm_strict(text + " 99", lang) != ex.INVALID, lang
        assert ex.mgsm_is_correct(text + " Then 99 more.", 18, lang), lang  # strict beats last


def test_mgsm_fallback_and_digits() -> None:
    assert ex.mgsm_extract("so 5 + 3 = 8", "de") == "8"
    assert ex.mgsm_is_correct("答案是 ４２。", 42.0, "zh")  # full-width digits
    assert ex.mgsm_is_correct("উত্তর ৪২", "42", "bn")  # Bengali digits, last number
    assert not ex.mgsm_is_correct("nothing", 1, "en")
    with pytest.raises(ValueError, match="lang"):
        ex.mgsm_extract("1", "xx")
