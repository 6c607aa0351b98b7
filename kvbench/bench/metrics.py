"""The fidelity computations (docs/design.md#protocols and docs/design.md#metrics) and metric directions.

Each workload declares the direction of its metrics in its ``METRICS`` class attribute
(:mod:`kvbench.bench.workloads`); :func:`direction` looks them up.  ``*_ratio`` metrics (a value
divided by the ``full`` baseline's in the same run) inherit the direction of their base metric.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from kvbench.attention.reference import causal_mask, repeat_kv
from kvbench.bench.workloads import HIGHER, LOWER, NONE, metric_direction

__all__ = [
    "HIGHER",
    "LOWER",
    "NONE",
    "add_block_ci",
    "add_ci",
    "attention_fidelity",
    "block_bootstrap_ci",
    "bootstrap_ci",
    "direction",
    "interval_rule",
    "key_mse",
    "paired_ratio_ci",
    "token_blocks",
]

#: bytes, bits and errors of what a cache stores: shared by several workloads
STORAGE_METRICS: dict[str, str] = {
    "bytes_*": LOWER,  # bytes_total, bytes_codes, bytes_key_total, ...
    "peak_step_bytes": LOWER,
    "cuda_bytes_total": LOWER,
    "cuda_peak_bytes": LOWER,
    "nominal_key_bits": LOWER,
    "nominal_value_bits": LOWER,
    "effective_bits": LOWER,
    "effective_key_bits": LOWER,
    "effective_value_bits": LOWER,
    "analytic_*bits": LOWER,
    "key_mse": LOWER,
    "key_rel_mse": LOWER,
    "value_mse": LOWER,
}


#: lm-evaluation-harness metric names -> direction, as lm-eval 0.4's registry declares them
#: (``lm_eval.api.registry.HIGHER_IS_BETTER_REGISTRY``), plus common task-defined metrics; the
#: ``lm_eval`` workload declares ``lm_eval.<task>.<metric>[,<filter>]`` from it.
LM_EVAL_DIRECTIONS: dict[str, str] = {
    **dict.fromkeys(
        "acc acc_norm acc_mutual_info acc_bytes acc_all exact_match likelihood mcc f1 bleu chrf "
        "chrf++ rouge1 rouge2 rougeL rougeLsum pass@1 pass@10 em contains".split(),
        HIGHER,
    ),
    **dict.fromkeys(
        "perplexity word_perplexity byte_perplexity bits_per_byte brier_score ter".split(), LOWER
    ),
}


def direction(metric: str) -> str | None:
    """``'lower'``/``'higher'``/``'none'`` as declared by the registered workloads' ``METRICS``
    (``*_ratio``, ``*_ci_low``/``_ci_high`` follow their base), else ``None``."""
    return metric_direction(metric)


def key_mse(ref: torch.Tensor, quant: torch.Tensor) -> tuple[float, float]:
    """(mean squared error, relative ``||ref - quant||^2 / ||ref||^2``), in float64."""
    r, q = ref.double(), quant.double()
    err = (r - q).pow(2)
    return err.mean().item(), (err.sum() / r.pow(2).sum().clamp_min(1e-300)).item()


def attention_fidelity(
    queries: torch.Tensor,
    keys_ref: torch.Tensor,
    values_ref: torch.Tensor,
    keys_q: torch.Tensor,
    values_q: torch.Tensor,
    start: int,
    scaling: float | None = None,
    eps: float = 1e-12,
) -> dict[str, float]:
    """Attention KL and output error for the queries of positions ``start..T-1``.

    ``D_KL(A || A')`` with ``A = softmax(q k^T * scaling)`` causal over keys ``0..t`` from the
    reference keys and ``A'`` from the quantized keys and the same queries (docs/methods.md#pn-mix metric
    definitions; reference distribution first, ``A'`` clamped at ``eps``, float64), averaged
    over batch, query heads and positions.  ``attn_out_rel_err`` =
    ``||A V - A' V'||_F / ||A V||_F`` over the same positions.

    Shapes: ``queries [B, H_q, T, D]``, keys/values ``[B, H_kv, T, D]``.
    """
    b, hq, t, d = queries.shape
    n_rep = hq // keys_ref.shape[1]
    scale = 1.0 / math.sqrt(d) if scaling is None else scaling
    q = queries[:, :, start:].double()
    mask = causal_mask(t - start, t, queries.device)

    def probs(k: torch.Tensor) -> torch.Tensor:
        logits = torch.matmul(q, repeat_kv(k.double(), n_rep).transpose(-1, -2)) * scale
        return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)

    a, a2 = probs(keys_ref), probs(keys_q)
    kl = torch.where(mask, a * (torch.log(a.clamp_min(eps)) - torch.log(a2.clamp_min(eps))), 0.0)
    out_ref = torch.matmul(a, repeat_kv(values_ref.double(), n_rep))
    out_q = torch.matmul(a2, repeat_kv(values_q.double(), n_rep))
    rel = (out_ref - out_q).norm() / out_ref.norm().clamp_min(1e-300)
    return {"attn_kl": kl.sum(-1).mean().item(), "attn_out_rel_err": rel.item()}


def bootstrap_ci(
    values: list[float] | torch.Tensor, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile bootstrap ``1 - alpha`` confidence interval of the mean of ``values`` (over
    windows or prompts; Efron & Tibshirani 1993, ch. 13), float64.

    Returns ``None`` for fewer than two values: one window has no spread to resample, and an
    interval of zero width would claim a certainty the data do not give.  Callers then report
    no ``*_ci_low``/``*_ci_high``.
    """
    x = torch.as_tensor(values, dtype=torch.float64).flatten()
    if x.numel() < 2:
        return None
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.numel(), (n_boot, x.numel()), generator=g)
    means = x[idx].mean(-1)
    lo, hi = torch.quantile(means, torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64))
    return lo.item(), hi.item()


def add_ci(metrics: dict[str, float], name: str, values: list[float], seed: int = 0) -> None:
    """Set ``metrics[name + '_ci_low' / '_ci_high']`` from :func:`bootstrap_ci` when there is an
    interval (two or more values); otherwise leave them out."""
    ci = bootstrap_ci(values, seed=seed)
    if ci is not None:
        metrics[f"{name}_ci_low"], metrics[f"{name}_ci_high"] = ci


#: resamples of :func:`paired_ratio_ci`
RATIO_RESAMPLES = 2000


def paired_ratio_ci(
    method: Sequence[float],
    baseline: Sequence[float],
    method_skip: Iterable[int] = (),
    baseline_skip: Iterable[int] = (),
    n_boot: int = RATIO_RESAMPLES,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Paired percentile bootstrap ``1 - alpha`` interval of ``median(method) /
    median(baseline)`` over interleaved rounds (Efron & Tibshirani 1993, ch. 13), float64.

    ``method[i]`` and ``baseline[i]`` (ms, ``[n]`` each) were timed in the same round ``i`` of
    :func:`kvbench.measure.timer.interleave`.  Each of ``n_boot`` resamples draws ``n`` round
    indices with replacement, by ``torch.randint(0, n, (n_boot, n), generator=g)`` with ``g =
    torch.Generator().manual_seed(seed)``, and takes the **same** rounds for both series
    (paired: drift of the machine from round to round moves both and cancels in the ratio).
    A side's statistic is the median (linear interpolation, as
    :data:`kvbench.measure.timer.PERCENTILE_RULE`) of its drawn rounds that are not in its
    ``*_skip`` indices (e.g. its flush steps, which the point estimate leaves out too); the
    interval is the ``alpha/2`` and ``1 - alpha/2`` quantiles (``torch.quantile``, linear) of
    the resampled ratios, over the resamples where the ratio is finite (a resample that drew
    only skipped rounds on one side has no median; with a few skipped rounds, a rare event).

    Returns ``None`` when either side has fewer than two rounds left after its skips (no spread
    to resample).  ValueError for series of different lengths or a skip index out of range."""
    a = torch.as_tensor(method, dtype=torch.float64).flatten().clone()
    b = torch.as_tensor(baseline, dtype=torch.float64).flatten().clone()
    if a.shape != b.shape:
        raise ValueError(
            f"paired_ratio_ci: {a.numel()} method rounds and {b.numel()} baseline rounds; "
            "a paired interval needs one of each per round"
        )
    n = a.numel()
    for x, skip in ((a, method_skip), (b, baseline_skip)):
        idx = sorted(set(skip))
        if idx and (idx[0] < 0 or idx[-1] >= n):
            raise ValueError(f"paired_ratio_ci: skip index {idx} out of range for {n} rounds")
        x[idx] = float("nan")
    if min(int((~a.isnan()).sum()), int((~b.isnan()).sum())) < 2:
        return None
    g = torch.Generator().manual_seed(seed)
    draw = torch.randint(0, n, (n_boot, n), generator=g)
    ratio = a[draw].nanquantile(0.5, dim=-1) / b[draw].nanquantile(0.5, dim=-1)
    ratio = ratio[ratio.isfinite()]
    if ratio.numel() == 0:
        return None
    q = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)
    lo, hi = torch.quantile(ratio, q)
    return lo.item(), hi.item()


#: consecutive scored tokens per block of :func:`block_bootstrap_ci` in the perplexity workload
BLOCK_TOKENS = 32
#: from this many windows on, the perplexity workload resamples whole windows (one block each)
WINDOW_BLOCKS_FROM = 20
#: resamples of :func:`block_bootstrap_ci`
BLOCK_RESAMPLES = 2000


def interval_rule(windows: int) -> tuple[int | None, str]:
    """The block length :func:`block_bootstrap_ci` uses for ``windows`` scored windows
    (``None``: one block per window) and the rule in words, for the record's ``info``: below
    :data:`WINDOW_BLOCKS_FROM` windows, blocks of :data:`BLOCK_TOKENS` consecutive scored
    tokens; from it on, whole windows (why: docs/design.md#perplexity-and-next-token-agreement)."""
    if windows >= WINDOW_BLOCKS_FROM:
        block, unit = None, "whole windows (one block each)"
    else:
        block, unit = BLOCK_TOKENS, f"blocks of {BLOCK_TOKENS} consecutive scored tokens"
    return block, (
        f"95% percentile block bootstrap over {unit} (blocks never cross a window; a window's "
        f"last block keeps its remainder; whole windows from {WINDOW_BLOCKS_FROM} windows on, "
        f"blocks of {BLOCK_TOKENS} tokens below), the blocks of all windows resampled together "
        f"with replacement, {BLOCK_RESAMPLES} resamples, torch generator seeded with the run's "
        "seed; statistic: the token-weighted mean over the drawn blocks (ppl_delta: exp(mean "
        "NLL) - exp(mean reference NLL) over the same blocks)"
    )


def token_blocks(lengths: list[int], block: int | None) -> list[tuple[int, int]]:
    """``[start, stop)`` of the blocks of :func:`block_bootstrap_ci` in the concatenation of
    windows of ``lengths`` tokens: ``block`` consecutive tokens each, never crossing a window, a
    window's last block holding its remainder when ``block`` does not divide its length;
    ``block=None``: one block per (non-empty) window.

    ValueError for ``block < 1`` or a negative length."""
    if block is not None and block < 1:
        raise ValueError(f"block={block} is not allowed; allowed: integers >= 1 or None")
    out, start = [], 0
    for n in lengths:
        if n < 0:
            raise ValueError(f"window length {n} is not allowed; allowed: integers >= 0")
        step = max(n, 1) if block is None else block
        out.extend((start + a, start + min(a + step, n)) for a in range(0, n, step))
        start += n
    return out


def block_bootstrap_ci(
    windows: list[torch.Tensor] | list[list[float]],
    block: int | None = BLOCK_TOKENS,
    n_boot: int = BLOCK_RESAMPLES,
    alpha: float = 0.05,
    seed: int = 0,
    stat: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[float, float] | None:
    """Percentile block bootstrap ``1 - alpha`` interval of a token-level mean, float64: the
    non-overlapping block bootstrap (Carlstein 1986, Ann. Statist. 14(3); the moving-block
    variant is Kunsch 1989) with the percentile interval (Efron & Tibshirani 1993, ch. 13).

    ``windows``: per window, per-token values ``[N_w]`` or ``K`` aligned series ``[N_w, K]``
    (e.g. the method's and the reference's NLL of each scored token).  The tokens are cut into
    blocks (:func:`token_blocks`); each of ``n_boot`` resamples draws as many blocks as there
    are, with replacement, by ``torch.randint(0, n_blocks, (n_boot, n_blocks), generator=g)``
    with ``g = torch.Generator().manual_seed(seed)``, and takes each series' token-weighted mean
    over the drawn blocks (sum of their values / sum of their tokens), ``[n_boot, K]``.
    ``stat`` maps those means to one value per resample ``[n_boot]`` (default: the only
    series); the interval is their ``alpha/2`` and ``1 - alpha/2`` quantiles
    (``torch.quantile``, linear interpolation).

    Why blocks: docs/design.md#perplexity-and-next-token-agreement.  Returns ``None`` with fewer
    than two blocks (no spread to resample).  ValueError for a series count that differs between
    windows or a ``stat`` of the wrong shape."""
    xs = [torch.as_tensor(w, dtype=torch.float64) for w in windows]
    xs = [x[:, None] if x.dim() == 1 else x for x in xs]
    if len({x.shape[1] for x in xs}) > 1:
        raise ValueError("block_bootstrap_ci: every window needs the same number of series")
    blocks = token_blocks([x.shape[0] for x in xs], block)
    if len(blocks) < 2:
        return None
    x = torch.cat(xs)
    sums = torch.stack([x[a:b].sum(0) for a, b in blocks])  # [n_blocks, K]
    counts = torch.tensor([b - a for a, b in blocks], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(blocks), (n_boot, len(blocks)), generator=g)
    draws = torch.zeros(n_boot, len(blocks), dtype=torch.float64)
    draws.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))  # times drawn
    means = (draws @ sums) / (draws @ counts)[:, None]
    vals = means[:, 0] if stat is None else torch.as_tensor(stat(means), dtype=torch.float64)
    if vals.shape != (n_boot,):
        raise ValueError(
            f"block_bootstrap_ci: stat returned shape {tuple(vals.shape)}, expected ({n_boot},)"
        )
    q = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)
    lo, hi = torch.quantile(vals, q)
    return lo.item(), hi.item()


def add_block_ci(
    metrics: dict[str, float],
    name: str,
    windows: list[torch.Tensor],
    block: int | None,
    seed: int = 0,
    stat: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Set ``metrics[name + '_ci_low' / '_ci_high']`` from :func:`block_bootstrap_ci` when
    there is an interval (two or more blocks); otherwise leave them out."""
    ci = block_bootstrap_ci(windows, block=block, seed=seed, stat=stat)
    if ci is not None:
        metrics[f"{name}_ci_low"], metrics[f"{name}_ci_high"] = ci
