"""The fidelity computations (docs/design.md#protocols and docs/design.md#metrics) and metric directions.

Each workload declares the direction of its metrics in its ``METRICS`` class attribute
(:mod:`kvbench.bench.workloads`); :func:`direction` looks them up.  ``*_ratio`` metrics (a value
divided by the ``full`` baseline's in the same run) inherit the direction of their base metric.
"""

from __future__ import annotations

import math

import torch

from kvbench.attention.reference import causal_mask, repeat_kv
from kvbench.bench.workloads import HIGHER, LOWER, NONE, metric_direction

__all__ = [
    "HIGHER",
    "LOWER",
    "NONE",
    "add_ci",
    "attention_fidelity",
    "bootstrap_ci",
    "direction",
    "key_mse",
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
