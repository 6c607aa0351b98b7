"""The block bootstrap of the perplexity workload's intervals
(``kvbench.bench.metrics.block_bootstrap_ci``) against an independent float64 numpy
implementation with Python loops (``tests/core/conftest.py: np_block_bootstrap``, sharing only
the documented torch draw of block indices), blocks counted by hand, and its statistical
properties: the interval holds the mean, narrows as 1/sqrt(tokens), and, on dependent tokens
(AR(1) series, whose long-run variance is known in closed form), has the width of the true
standard error where a per-token bootstrap is too narrow."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvbench.bench.metrics import (
    BLOCK_TOKENS,
    WINDOW_BLOCKS_FROM,
    add_block_ci,
    block_bootstrap_ci,
    interval_rule,
    token_blocks,
)


def _ar1(n: int, phi: float, seed: int) -> np.ndarray:
    """x_t = phi x_{t-1} + e_t, e ~ N(0, 1), started in its stationary law (200 burn-in)."""
    rng = np.random.default_rng(seed)
    e = rng.normal(size=n + 200)
    x = np.zeros(n + 200)
    for i in range(1, n + 200):
        x[i] = phi * x[i - 1] + e[i]
    return x[200:]


def test_token_blocks_by_hand() -> None:
    # windows of 5 and 3 tokens, blocks of 2: the last block of each window keeps its remainder
    assert token_blocks([5, 3], 2) == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 8)]
    assert token_blocks([5, 3], None) == [(0, 5), (5, 8)]  # one block per window
    assert token_blocks([4, 0, 2], 4) == [(0, 4), (4, 6)]  # an empty window has none
    with pytest.raises(ValueError, match="block=0"):
        token_blocks([4], 0)
    with pytest.raises(ValueError, match="window length -1"):
        token_blocks([-1], 2)


@pytest.mark.parametrize("block", [1, 5, 16, None])
def test_matches_numpy_loops(block_bootstrap_ref, block) -> None:
    """Three windows of unequal length (57, 64, 41 tokens; blocks that do not divide them),
    seeds 0 and 9: the same interval as the loop implementation, to float64 rounding."""
    g = torch.Generator().manual_seed(1)
    windows = [torch.rand(n, generator=g, dtype=torch.float64) ** 3 for n in (57, 64, 41)]
    for seed in (0, 9):
        got = block_bootstrap_ci(windows, block=block, seed=seed)
        want = block_bootstrap_ref(windows, block, seed)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (block, seed)


def test_a_statistic_of_aligned_series_matches_numpy(block_bootstrap_ref) -> None:
    """``ppl_delta``'s statistic: exp(mean NLL) - exp(mean reference NLL) over the same drawn
    blocks (paired), against the loop implementation."""
    g = torch.Generator().manual_seed(2)
    windows = [torch.rand(n, 2, generator=g, dtype=torch.float64) * 4 for n in (40, 33)]
    got = block_bootstrap_ci(windows, 8, seed=3, stat=lambda m: m[:, 0].exp() - m[:, 1].exp())
    want = block_bootstrap_ref(windows, 8, 3, stat=lambda m: math.exp(m[0]) - math.exp(m[1]))
    assert got == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="stat returned shape"):
        block_bootstrap_ci(windows, 8, stat=lambda m: m)
    with pytest.raises(ValueError, match="same number of series"):
        block_bootstrap_ci([torch.zeros(4, 2), torch.zeros(4, 3)], 2)


def test_fewer_than_two_blocks_give_no_interval() -> None:
    assert block_bootstrap_ci([[0.1] * 32], block=32) is None  # one window, one block
    assert block_bootstrap_ci([[0.1] * 33], block=32) is not None  # 32 + 1
    m: dict[str, float] = {}
    add_block_ci(m, "next_token_kl", [torch.ones(10)], block=None)
    assert m == {}
    add_block_ci(m, "next_token_kl", [torch.ones(10), torch.zeros(10)], block=None, seed=4)
    assert (m["next_token_kl_ci_low"], m["next_token_kl_ci_high"]) == block_bootstrap_ci(
        [torch.ones(10), torch.zeros(10)], block=None, seed=4
    )


def test_seed_reproduces_and_changes_the_interval() -> None:
    x = [torch.as_tensor(_ar1(300, 0.3, 4))]
    assert block_bootstrap_ci(x, seed=2) == block_bootstrap_ci(x, seed=2)
    assert block_bootstrap_ci(x, seed=2) != block_bootstrap_ci(x, seed=3)


@pytest.mark.parametrize("seed", range(8))
def test_interval_contains_the_mean(seed: int) -> None:
    """The token mean (the point estimate) lies inside the percentile interval, for skewed
    (squared) and symmetric data."""
    for x in (_ar1(512, 0.5, seed), _ar1(512, 0.5, seed) ** 2):
        lo, hi = block_bootstrap_ci([x], seed=seed)
        assert lo < x.mean() < hi


def test_interval_narrows_as_tokens_grow() -> None:
    """Widths at 256, 1024 and 4096 tokens of AR(1) series (phi 0.5) fall with the number of
    tokens, on each series, and on average over 10 series about as 1/sqrt(n): 16x the tokens,
    about 1/4 the width (one series' width at 8 blocks is itself noisy, hence the mean)."""
    widths = np.zeros((10, 3))
    for s in range(10):
        x = _ar1(4096, 0.5, 100 + s)
        for j, n in enumerate((256, 1024, 4096)):
            lo, hi = block_bootstrap_ci([x[:n]], seed=s)
            widths[s, j] = hi - lo
        assert widths[s, 0] > widths[s, 2], s
    mean = widths.mean(0)
    assert mean[0] > mean[1] > mean[2]
    assert mean[1] / mean[0] == pytest.approx(1 / 2, rel=0.2)
    assert mean[2] / mean[0] == pytest.approx(1 / 4, rel=0.2)


def test_blocks_carry_the_dependence_of_neighbouring_tokens() -> None:
    """AR(1) with phi = 0.8, 4096 tokens: the standard error of the mean is
    sqrt(sigma^2 / (1 - phi^2) x (1 + phi) / (1 - phi) / n) (its long-run variance).  Blocks of
    :data:`BLOCK_TOKENS` give an interval of about 2 x 1.96 x that width; resampling single
    tokens (block 1) gives about a third of it (sqrt((1 - phi) / (1 + phi)) = 0.33)."""
    phi, n = 0.8, 4096
    x = [_ar1(n, phi, 1)]
    se = math.sqrt(1 / (1 - phi**2) * (1 + phi) / (1 - phi) / n)
    for block, want in ((BLOCK_TOKENS, 1.0), (1, math.sqrt((1 - phi) / (1 + phi)))):
        lo, hi = block_bootstrap_ci(x, block=block)
        assert (hi - lo) / (2 * 1.96 * se) == pytest.approx(want, rel=0.25), block


def test_interval_rule_switches_to_whole_windows() -> None:
    block, rule = interval_rule(1)
    assert block == BLOCK_TOKENS and f"blocks of {BLOCK_TOKENS} consecutive" in rule
    assert interval_rule(WINDOW_BLOCKS_FROM - 1)[0] == BLOCK_TOKENS
    block, rule = interval_rule(WINDOW_BLOCKS_FROM)
    assert block is None and "whole windows" in rule
