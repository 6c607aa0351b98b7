"""The paired bootstrap interval of the latency workload's step ratio
(``kvbench.bench.metrics.paired_ratio_ci``) against an independent plain-Python float64
implementation (``statistics.median``, a hand-written type-7 quantile, Python loops) that shares
only the documented torch draw of round indices; a ratio that holds in every round with its
point interval by hand; and the pairing itself: under a drift that moves both series of a round
alike the paired interval is narrow where resampling the two series apart (a second, independent
draw for the baseline) is wide."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from kvbench.bench.metrics import RATIO_RESAMPLES, paired_ratio_ci


def _draw(n: int, n_boot: int, seed: int) -> list[list[int]]:
    """The documented draw: ``torch.randint(0, n, (n_boot, n))`` from a generator seeded
    ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (n_boot, n), generator=g).tolist()


def _quantile7(xs: list[float], q: float) -> float:
    """Hyndman-Fan type 7: h = (n - 1) q, x[floor h] + (h - floor h)(x[floor h + 1] - x[floor h])."""
    s = sorted(xs)
    h = (len(s) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (h - lo) * (s[hi] - s[lo])


def _reference(
    method: list[float],
    baseline: list[float],
    method_skip: set[int],
    baseline_skip: set[int],
    draws_m: list[list[int]],
    draws_b: list[list[int]],
    alpha: float = 0.05,
) -> tuple[float, float]:
    """Percentile interval of median(method's drawn rounds) / median(baseline's drawn rounds),
    each side without its skipped rounds; resamples with an empty side dropped.  Paired when
    ``draws_m is draws_b``."""
    ratios = []
    for dm, db in zip(draws_m, draws_b):
        a = [method[i] for i in dm if i not in method_skip]
        b = [baseline[i] for i in db if i not in baseline_skip]
        if a and b:
            ratios.append(statistics.median(a) / statistics.median(b))
    return _quantile7(ratios, alpha / 2), _quantile7(ratios, 1 - alpha / 2)


def _drifting(n: int, seed: int, ratio: float, noise: float) -> tuple[list[float], list[float]]:
    """Rounds whose speed drifts by a factor of 1..6 (a busy machine), both steps of a round
    alike; the method takes ``ratio`` x the baseline times lognormal noise of sd ``noise``."""
    rng = random.Random(seed)
    drift = [1.0 + 5.0 * i / (n - 1) for i in range(n)]
    base = [d * math.exp(rng.gauss(0.0, noise)) for d in drift]
    meth = [ratio * d * math.exp(rng.gauss(0.0, noise)) for d in drift]
    return meth, base


def test_a_ratio_that_holds_in_every_round_has_a_point_interval() -> None:
    """method = 2 x baseline in every round: every resample's medians keep the factor 2 (exact
    in floating point), so the interval is [2, 2] however the rounds drift."""
    base = [1.0, 3.0, 2.0, 7.5, 4.0, 1.5, 9.0]
    assert paired_ratio_ci([2 * x for x in base], base, seed=3) == (2.0, 2.0)


@pytest.mark.parametrize(
    ("n", "method_skip", "baseline_skip", "seed"),
    [(12, set(), set(), 0), (9, {2, 7}, set(), 5), (4, {0, 3}, {1}, 11)],
)
def test_against_a_plain_python_reference(n, method_skip, baseline_skip, seed) -> None:
    """Spread rounds (lognormal noise of sd 0.2), with and without skipped (flush) rounds; n = 4
    with two skipped rounds draws only skipped ones in about 1 resample of 16 (dropped)."""
    meth, base = _drifting(n, seed, 1.3, 0.2)
    got = paired_ratio_ci(meth, base, method_skip, baseline_skip, seed=seed)
    draws = _draw(n, RATIO_RESAMPLES, seed)
    want = _reference(meth, base, method_skip, baseline_skip, draws, draws)
    assert got == pytest.approx(want, rel=1e-12)
    assert got[0] < got[1]  # a real spread, low first


def test_pairing_cancels_the_drift_between_rounds() -> None:
    """Drift of 1..6x between rounds, 1% noise within one: the paired interval sits within a few
    percent of 1.5; drawing the baseline's rounds apart from the method's (unpaired) lets the
    drift into the ratio and the interval spans more than a factor of 1.5."""
    n, seed = 20, 0
    meth, base = _drifting(n, 1, 1.5, 0.01)
    lo, hi = paired_ratio_ci(meth, base, seed=seed)
    assert 1.45 < lo <= hi < 1.55
    draws = _draw(n, RATIO_RESAMPLES, seed)
    apart = _draw(n, RATIO_RESAMPLES, seed + 1)
    ulo, uhi = _reference(meth, base, set(), set(), draws, apart)
    assert uhi / ulo > 1.5  # the unpaired interval the test above would reject


def test_the_seed_fixes_the_interval() -> None:
    meth, base = _drifting(10, 2, 1.1, 0.3)
    assert paired_ratio_ci(meth, base, seed=4) == paired_ratio_ci(meth, base, seed=4)
    assert paired_ratio_ci(meth, base, seed=4) != paired_ratio_ci(meth, base, seed=5)


def test_no_interval_without_two_rounds_a_side() -> None:
    assert paired_ratio_ci([2.0], [1.0]) is None
    assert paired_ratio_ci([2.0, 3.0, 4.0], [1.0, 1.0, 1.0], method_skip=[0, 2]) is None
    assert paired_ratio_ci([2.0, 3.0, 4.0], [1.0, 1.0, 1.0], baseline_skip=[1, 2]) is None
    assert paired_ratio_ci([2.0, 3.0, 4.0], [1.0, 1.0, 1.0], method_skip=[0]) is not None


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="3 method rounds and 2 baseline rounds"):
        paired_ratio_ci([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="out of range for 2 rounds"):
        paired_ratio_ci([1.0, 2.0], [1.0, 2.0], method_skip=[2])
    with pytest.raises(ValueError, match="out of range"):
        paired_ratio_ci([1.0, 2.0], [1.0, 2.0], baseline_skip=[-1])
