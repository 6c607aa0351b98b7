"""kvbench.bench.metrics against separate straightforward implementations.

* ``attention_fidelity``: a float64 loop over (batch, query head, position) with an explicit
  causal softmax over keys ``0..t`` and ``scipy.special.rel_entr`` for KL(A || A'), the
  reference distribution first (docs/design.md#protocols); GQA maps query head ``h`` to KV head
  ``h // (H_q / H_kv)``.
* ``key_mse``: numpy float64.
* ``bootstrap_ci``: coverage of the true mean at its nominal rate on synthetic normal data,
  with a tolerance derived from the binomial spread of the coverage count (below).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import special, stats

from kvbench.bench.metrics import (
    add_ci,
    attention_fidelity,
    bootstrap_ci,
    direction,
    key_mse,
)


def _loop_attention(q, k_ref, v_ref, k_q, v_q, start, scale):
    """(mean KL, output relative error) by explicit loops, float64 numpy."""
    q, k_ref, v_ref, k_q, v_q = (x.double().numpy() for x in (q, k_ref, v_ref, k_q, v_q))
    b, hq, t, _ = q.shape
    rep = hq // k_ref.shape[1]
    kls, num, den = [], 0.0, 0.0
    for bi in range(b):
        for h in range(hq):
            g = h // rep
            for pos in range(start, t):
                keys = slice(0, pos + 1)  # causal: keys 0..pos
                a = special.softmax(k_ref[bi, g, keys] @ q[bi, h, pos] * scale)
                a2 = special.softmax(k_q[bi, g, keys] @ q[bi, h, pos] * scale)
                kls.append(special.rel_entr(a, a2).sum())  # sum a * log(a / a2)
                o, o2 = a @ v_ref[bi, g, keys], a2 @ v_q[bi, g, keys]
                num += ((o - o2) ** 2).sum()
                den += (o**2).sum()
    return float(np.mean(kls)), math.sqrt(num / den)


@pytest.mark.parametrize("start, scaling", [(3, None), (0, 0.3), (9, 1.7)])
def test_attention_fidelity_matches_loop(start: int, scaling: float | None) -> None:
    g = torch.Generator().manual_seed(start)
    b, hq, hkv, t, d = 2, 4, 2, 10, 8
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, hkv, t, d, generator=g)
    v = torch.randn(b, hkv, t, d, generator=g)
    # a quantized copy that differs differently per head, so that a wrong GQA map shows
    kq = k + 0.4 * torch.randn(b, hkv, t, d, generator=g) * torch.tensor([0.2, 1.5])[:, None, None]
    vq = v + 0.3 * torch.randn(b, hkv, t, d, generator=g)
    got = attention_fidelity(q, k, v, kq, vq, start, scaling)
    scale = 1 / math.sqrt(d) if scaling is None else scaling
    kl, rel = _loop_attention(q, k, v, kq, vq, start, scale)
    assert got["attn_kl"] == pytest.approx(kl, rel=1e-9)
    assert got["attn_out_rel_err"] == pytest.approx(rel, rel=1e-9)
    # the reverse direction KL(A' || A) is a different number on these inputs
    rev, _ = _loop_attention(q, kq, vq, k, v, start, scale)
    assert abs(rev - kl) > 1e-3 * kl


def test_attention_output_error_is_relative_for_small_values() -> None:
    # ||A V||_F far below 1 (values of 1e-4): the relative error is the same ratio as for the
    # values scaled up (the clamp only guards an all-zero output)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    kq, vq = k + 0.3 * torch.randn_like(k), v + 0.2 * torch.randn_like(v)
    kl, rel = _loop_attention(q, k[:, :1], v[:, :1], kq[:, :1], vq[:, :1], 2, 0.5)
    small = attention_fidelity(q, k[:, :1], 1e-4 * v[:, :1], kq[:, :1], 1e-4 * vq[:, :1], 2, 0.5)
    assert small["attn_out_rel_err"] == pytest.approx(rel, rel=1e-9)
    assert small["attn_kl"] == pytest.approx(kl, rel=1e-9)


def test_attention_fidelity_zero_for_identical_keys() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    out = attention_fidelity(q, k[:, :1], v[:, :1], k[:, :1].clone(), v[:, :1].clone(), 2)
    assert out == {"attn_kl": 0.0, "attn_out_rel_err": 0.0}


def test_key_mse_matches_numpy() -> None:
    g = torch.Generator().manual_seed(2)
    ref = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float32)
    quant = ref + 0.1 * torch.randn(2, 3, 5, 4, generator=g)
    r, qn = ref.double().numpy(), quant.double().numpy()
    mse, rel = key_mse(ref, quant)
    assert mse == pytest.approx(((r - qn) ** 2).mean(), rel=1e-12)
    assert rel == pytest.approx(((r - qn) ** 2).sum() / (r**2).sum(), rel=1e-12)


def test_key_mse_relative_error_of_small_keys() -> None:
    # ||ref||^2 far below 1 (keys of a few 1e-3): the relative error is still a plain ratio,
    # the clamp only guards an all-zero reference
    ref = torch.tensor([[1e-3, -2e-3], [3e-3, 0.0]], dtype=torch.float64)
    quant = torch.tensor([[2e-3, -2e-3], [3e-3, 1e-3]], dtype=torch.float64)
    mse, rel = key_mse(ref, quant)
    assert mse == pytest.approx((1e-6 + 1e-6) / 4, rel=1e-9)
    assert rel == pytest.approx(2e-6 / 14e-6, rel=1e-9)  # (1 + 1) / (1 + 4 + 9), in 1e-6


def test_bootstrap_interval_covers_the_mean_at_its_nominal_rate() -> None:
    """Coverage over ``reps`` independent data sets of ``n`` = 40 windows with a known mean.

    The percentile bootstrap of the mean is, to first order, ``mean +- z * s_n / sqrt(n)``
    with ``s_n`` the (1/n) standard deviation, so for normal data its coverage is
    ``p0 = P(|T_{n-1}| <= z_{0.975} sqrt((n-1)/n))`` (a little under 0.95 for small n).  The
    count of covering data sets is Binomial(reps, p0); we allow 4 standard deviations of it plus
    the bootstrap's own Monte-Carlo quantile error (1000 resamples: about 0.005 in coverage).
    A wrong interval (no resampling, the wrong quantiles, an interval of the std not of the
    mean) moves coverage by far more than that.
    """
    n, reps, mu = 40, 300, 3.0
    rng = np.random.default_rng(0)
    z = stats.norm.ppf(0.975)
    p0 = 2 * stats.t.cdf(z * math.sqrt((n - 1) / n), n - 1) - 1
    hits = 0
    for r in range(reps):
        x = rng.normal(mu, 2.0, size=n)
        lo, hi = bootstrap_ci(x.tolist(), seed=r)
        hits += lo <= mu <= hi
    tol = 4 * math.sqrt(p0 * (1 - p0) / reps) + 0.005
    assert abs(hits / reps - p0) <= tol, (hits / reps, p0, tol)


def test_bootstrap_interval_width_matches_standard_error() -> None:
    x = np.random.default_rng(5).normal(0.0, 1.0, size=200)
    lo, hi = bootstrap_ci(x.tolist(), n_boot=4000)
    se = x.std() / math.sqrt(len(x))
    assert (hi - lo) / (2 * stats.norm.ppf(0.975) * se) == pytest.approx(1.0, abs=0.08)
    assert lo < x.mean() < hi


def test_bootstrap_resamples_every_value_and_is_reproducible() -> None:
    # one outlier first: a resample that never draws index 0 has mean 0, one that draws it k
    # times has mean k; with 10 draws P(no index 0) = 0.9^10 = 0.35, so the 97.5% quantile is
    # at least 1 and the 2.5% quantile 0
    x = [10.0] + [0.0] * 9
    lo, hi = bootstrap_ci(x)
    assert lo == 0.0 and hi >= 1.0
    # the interval a record carries is reproducible from its seed (default 0) and depends on it
    y = np.random.default_rng(3).normal(size=30).tolist()
    assert bootstrap_ci(y) == bootstrap_ci(y, seed=0) == bootstrap_ci(y, seed=0)
    assert bootstrap_ci(y, seed=4) == bootstrap_ci(y, seed=4) != bootstrap_ci(y, seed=0)
    # equal tails: the same resamples of -y have exactly the negated means, so the percentile
    # interval of -y is the mirror image of y's (alpha/2 on each side, not more on one)
    lo, hi = bootstrap_ci(y, seed=4)
    lo_neg, hi_neg = bootstrap_ci([-v for v in y], seed=4)
    assert (lo_neg, hi_neg) == pytest.approx((-hi, -lo), rel=1e-9, abs=1e-12)
    m: dict[str, float] = {}
    add_ci(m, "kl", y, seed=4)
    assert (m["kl_ci_low"], m["kl_ci_high"]) == bootstrap_ci(y, seed=4)
    add_ci(m, "kl0", y)
    assert (m["kl0_ci_low"], m["kl0_ci_high"]) == bootstrap_ci(y, seed=0)


def test_bootstrap_with_one_value_reports_no_interval() -> None:
    assert bootstrap_ci([1.5]) is None
    assert bootstrap_ci([]) is None
    m: dict[str, float] = {}
    add_ci(m, "ppl_delta", [0.3])
    assert m == {}
    add_ci(m, "ppl_delta", [0.3, 0.5])
    assert set(m) == {"ppl_delta_ci_low", "ppl_delta_ci_high"}
    assert 0.3 <= m["ppl_delta_ci_low"] <= m["ppl_delta_ci_high"] <= 0.5


@pytest.mark.parametrize(
    "metric, want",
    [
        ("next_token_kl", "lower"),
        ("top1_agreement", "higher"),
        ("drift_kl_b3", "lower"),
        ("drift_top1_b0", "higher"),
        ("attn_kl_ratio", "lower"),
        ("ppl_delta_ci_high", "lower"),
        ("ppl_ref", "none"),
        ("num_examples", "none"),
        ("sel_prefill_r10_spread", "lower"),
        ("sel_prefill_r10_b2", "higher"),
        ("bytes_residual", "lower"),
        ("no_such_metric", None),
    ],
)
def test_directions_come_from_workload_declarations(metric: str, want: str | None) -> None:
    assert direction(metric) == want
