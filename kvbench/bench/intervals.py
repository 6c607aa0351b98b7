"""Wilson score intervals for shares and for means of scores in [0, 1] (the ``ruler11`` and
``output_length`` workloads; docs/design.md#ruler-protocols-and-output-length).

The Wilson score interval (Wilson 1927, JASA 22(158)) of a proportion ``p = k / n`` at level
``1 - alpha`` is the set of ``p0`` with ``|p - p0| <= z * sqrt(p0 (1 - p0) / n)``, ``z`` the
``1 - alpha/2`` normal quantile:

    centre = (p + z^2 / (2n)) / (1 + z^2 / n)
    half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))

It never leaves [0, 1] and has width > 0 at ``k = 0`` and ``k = n`` (a percentile bootstrap
of 20 correct answers out of 20 has width 0).  For a mean of scores in [0, 1] that are not all
0 or 1 (RULER's ``string_match_all`` gives fractions), ``k`` is the sum of the scores: a
variable in [0, 1] with mean ``p`` has variance at most ``p (1 - p)`` (the Bernoulli's), so the
interval is conservative there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

__all__ = ["wilson_ci", "add_wilson_ci"]


def wilson_ci(successes: float, n: int, alpha: float = 0.05) -> tuple[float, float] | None:
    """Wilson score ``1 - alpha`` interval ``(low, high)`` of the share ``successes / n``.

    ``successes`` may be fractional (a sum of scores in [0, 1]).  Returns ``None`` for
    ``n == 0`` (no data, no interval).  Raises ``ValueError`` for ``successes`` outside
    ``[0, n]``, a negative ``n`` or ``alpha`` outside (0, 1)."""
    if n < 0:
        raise ValueError(f"wilson_ci: n={n} must be >= 0")
    if not 0 < alpha < 1:
        raise ValueError(f"wilson_ci: alpha={alpha} must lie in (0, 1)")
    if n == 0:
        return None
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_ci: successes={successes} must lie in [0, n={n}]")
    z = NormalDist().inv_cdf(1 - alpha / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def add_wilson_ci(metrics: dict[str, float], name: str, values: Sequence[float]) -> None:
    """Set ``metrics[name]`` to the mean of ``values`` (each in [0, 1]) and
    ``metrics[name + '_ci_low' / '_ci_high']`` to its :func:`wilson_ci` (95%); nothing for an
    empty ``values``."""
    if not values:
        return
    ci = wilson_ci(float(sum(values)), len(values))
    metrics[name] = sum(values) / len(values)
    if ci is not None:
        metrics[f"{name}_ci_low"], metrics[f"{name}_ci_high"] = ci
