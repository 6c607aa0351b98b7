"""Metric names, their directions, and the fidelity computations (design.md §2-§3).

Every metric's direction (is lower or higher better?) is declared once, here.  ``*_ratio``
metrics (a value divided by the ``full`` baseline's in the same run) inherit the direction of
their base metric.
"""

from __future__ import annotations

import math

import torch

from kvbench.attend.reference import causal_mask, repeat_kv

LOWER = "lower"
HIGHER = "higher"

DIRECTIONS: dict[str, str] = {
    "key_mse": LOWER,
    "key_rel_mse": LOWER,
    "value_mse": LOWER,
    "attn_kl": LOWER,
    "attn_out_rel_err": LOWER,
    "ppl": LOWER,
    "ppl_ref": LOWER,
    "ppl_delta": LOWER,
    "next_token_kl": LOWER,
    "top1_agreement": HIGHER,
    "gen_first_divergence": HIGHER,
    "gen_match_rate": HIGHER,
    "passkey_acc": HIGHER,
    "task_score": HIGHER,
    "nominal_key_bits": LOWER,
    "nominal_value_bits": LOWER,
    "effective_bits": LOWER,
    "effective_key_bits": LOWER,
    "effective_value_bits": LOWER,
    "bytes_total": LOWER,
    "bytes_codes": LOWER,
    "bytes_scales": LOWER,
    "bytes_metadata": LOWER,
    "bytes_residual": LOWER,
    "bytes_sinks": LOWER,
    "peak_step_bytes": LOWER,
    "prefill_ms": LOWER,
    "decode_ms_p50": LOWER,
    "decode_ms_p90": LOWER,
    "decode_ms_p99": LOWER,
    "tokens_per_s": HIGHER,
    # memory and latency workloads (kvbench.workloads.memory, latency)
    "bytes_key_total": LOWER,
    "bytes_value_total": LOWER,
    "cuda_bytes_total": LOWER,
    "cuda_peak_bytes": LOWER,
    "decode_ms_mean": LOWER,
    # task workloads (kvbench.workloads.gsm8k, mgsm, math_task, humaneval, ruler, hub_tasks)
    "gsm8k_strict": HIGHER,
    "gsm8k_flexible": HIGHER,
    "mgsm_flexible": HIGHER,
    "mgsm_strict": HIGHER,
    "math500_acc": HIGHER,
    "aime24_acc": HIGHER,
    "aime25_acc": HIGHER,
    "amc23_acc": HIGHER,
    "humaneval_pass1": HIGHER,
    "ruler_avg": HIGHER,
    "needles_in_quantized_keys": HIGHER,
    "gpqa_acc": HIGHER,
    "ib_avg": HIGHER,
    # RoPE-pair studies (kvbench.workloads.pair_analysis, PN-Mix Tables 1 and 11)
    "spearman_rho": HIGHER,
    "top10_overlap": HIGHER,
    "top50_overlap": HIGHER,
}
#: lm-evaluation-harness metric names -> direction, as lm-eval 0.4's registry declares them
#: (``lm_eval.api.registry.HIGHER_IS_BETTER_REGISTRY``), plus common task-defined metrics.
#: Used for the ``lm_eval`` workload's ``lm_eval.<task>.<metric>[,<filter>]`` metrics.
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
LM_EVAL_PREFIX = "lm_eval."
#: metric families with per-language / per-task / per-length / per-bin names
PREFIX_DIRECTIONS: dict[str, str] = {
    "mgsm_": HIGHER,  # mgsm_<lang>, mgsm_strict_<lang>
    "ruler_": HIGHER,  # ruler_<task>, ruler_<task>_<length>, ruler_len<length>
    "ib_": HIGHER,  # ib_<task>
    "sel_": HIGHER,  # sel_<ref>_r<pct>[_b<i>]; the *_spread variants are LOWER (below)
}


def direction(metric: str) -> str | None:
    """``'lower'``/``'higher'`` for a known metric (``*_ratio``, ``*_ci_low``/``_ci_high``
    follow their base), else ``None``."""
    for suffix in ("_ratio", "_ci_low", "_ci_high"):
        if metric.endswith(suffix):
            metric = metric[: -len(suffix)]
    if metric in DIRECTIONS:
        return DIRECTIONS[metric]
    if metric.startswith(LM_EVAL_PREFIX):  # lm_eval.<task>.<metric>[,<filter>]; stderr: none
        return LM_EVAL_DIRECTIONS.get(metric.rsplit(".", 1)[-1].split(",", 1)[0])
    if metric.startswith("sel_") and metric.endswith("_spread"):
        return LOWER  # max - min of the stability over bins
    for prefix, d in PREFIX_DIRECTIONS.items():
        if metric.startswith(prefix):
            return d
    return None


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
    reference keys and ``A'`` from the quantized keys and the same queries (spec §7 metric
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
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values`` (over windows or
    prompts).  With one value the interval is that value."""
    x = torch.as_tensor(values, dtype=torch.float64).flatten()
    if x.numel() <= 1:
        v = x.item() if x.numel() else float("nan")
        return v, v
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.numel(), (n_boot, x.numel()), generator=g)
    means = x[idx].mean(-1)
    lo, hi = torch.quantile(means, torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64))
    return lo.item(), hi.item()
