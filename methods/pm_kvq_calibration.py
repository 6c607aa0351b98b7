"""Calibration helpers of ``pm-kvq`` (PM-KVQ, Liu et al., arXiv 2505.18610; thu-nics/PM-KVQ at
c8a2bff; docs/methods.md#pm-kvq): block-wise memory allocation
(:func:`allocate_bits`), a per-layer sensitivity (:func:`layer_sensitivity`) and the
positional-interpolation reparameterization scales (:func:`pi_calibration_scales`).

Workflow for a runner: capture post-RoPE Q/K/V (and, for the Taylor proxy, dLoss/dK and dLoss/dV)
of each layer on a calibration text disjoint from the evaluation text (record which), compute
``layer_sensitivity`` per layer, solve ``allocate_bits`` for a total byte budget and pass the
widths as ``budget_bits`` with ``budget_tokens`` = the length the layer sizes were computed for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvbench.attention.reference import reference_attention
from kvbench.cache.quant import fake_quantize, resolve_scale_dtype

from .polarquant import split_pairs


def allocate_bits(
    sensitivities: Any, layer_sizes: Sequence[float], budget: float, choices: Sequence[int] = (4, 2)
) -> tuple[int, ...]:
    """Block-wise memory allocation (``allocation/allocation.py``): the width per layer that
    minimizes summed sensitivity s.t. ``sum_i bits_i * layer_sizes[i] / 8 <= budget``, a 0/1
    integer program solved by ``scipy.optimize.milp``.

    ``sensitivities``: ``[L, len(choices)]`` (layer i at ``choices[j]``) or a mapping ``bits ->
    [L]`` (the original's dict); ``layer_sizes``: ``[L]`` elements per layer, K and V (original
    ``2 * hidden * max_len``); ``budget``: bytes over all layers.  Returns the widths, usable as
    ``budget_bits`` with ``budget_tokens = max_len``.  ``ValueError`` on bad shapes or a budget
    below every layer at its narrowest width.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    choices = [int(b) for b in choices]
    if isinstance(sensitivities, Mapping):
        sensitivities = np.stack([np.asarray(sensitivities[b], float) for b in choices], axis=1)
    s, sizes = np.asarray(sensitivities, dtype=float), np.asarray(layer_sizes, dtype=float)
    if not len(sizes) or not choices or s.shape != (len(sizes), len(choices)):
        raise ValueError(
            f"sensitivities must be [{len(sizes)} layers, {len(choices)} choices], "
            f"got shape {s.shape}"
        )
    cost = np.outer(sizes, choices) / 8  # bytes of layer i at choices[j]
    if cost.min(axis=1).sum() > budget:
        raise ValueError(
            f"budget={budget} B is infeasible: the narrowest widths need "
            f"{cost.min(axis=1).sum():.0f} B"
        )
    n_l, n_c = s.shape
    rows = LinearConstraint(np.kron(np.eye(n_l), np.ones(n_c)), 1, 1)  # one width per layer
    memory = LinearConstraint(cost.reshape(1, -1), -np.inf, budget)
    res = milp(
        s.reshape(-1),
        constraints=[rows, memory],
        integrality=np.ones(n_l * n_c),
        bounds=Bounds(0, 1),
    )
    if not res.success:
        raise ValueError(f"allocation failed: {res.message}")
    return tuple(choices[j] for j in res.x.reshape(n_l, n_c).argmax(axis=1))


def layer_sensitivity(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None = None,
    *,
    key_grad: torch.Tensor | None = None,
    value_grad: torch.Tensor | None = None,
    choices: Sequence[int] = (4, 2),
    channel_group_size: int | None = None,
    scale_dtype: str = "float16",
) -> dict[int, float]:
    """Sensitivity ``{bits: value}`` of one layer to K/V stored at each width in ``choices``.

    Calibration tensors ``[B, H_kv, T, D]`` (post-RoPE keys, values; queries ``[B, H_q, T, D]``),
    from a text disjoint from the evaluation text (the runner records it).  Q_b is direct b-bit
    per-token min-max over ``channel_group_size`` channels.  With ``key_grad``/``value_grad``
    (dLoss/dK, dLoss/dV) it is the original's first-order Taylor proxy
    (``allocation/sensitivity.py``): ``mean|(Q_b(K) - K) dL/dK| + mean|(Q_b(V) - V) dL/dV|``.
    Otherwise the causal attention-output error ``||A(Q, Q_b K, Q_b V) - A(Q, K, V)||^2 /
    ||A(Q, K, V)||^2`` (float32).  ``ValueError`` without gradients or queries, or a bad group.
    """
    cg = channel_group_size or min(128, keys.shape[-1])
    sd = resolve_scale_dtype(scale_dtype)
    if keys.shape[-1] % cg:
        raise ValueError(f"channel_group_size={cg} does not divide head_dim={keys.shape[-1]}")

    def q(x: torch.Tensor, b: int) -> torch.Tensor:
        xg = x.float().reshape(*x.shape[:-1], -1, cg)
        return fake_quantize(xg, b, scale_dtype=sd).reshape(x.shape)

    k, v = keys.float(), values.float()
    if key_grad is not None and value_grad is not None:
        kg, vg = key_grad.float(), value_grad.float()
        return {
            b: float(((q(k, b) - k) * kg).abs().mean() + ((q(v, b) - v) * vg).abs().mean())
            for b in choices
        }
    if queries is None:
        raise ValueError("layer_sensitivity needs key_grad and value_grad, or queries")
    ref = reference_attention(queries.float(), k, v)
    out = {b: reference_attention(queries.float(), q(k, b), q(v, b)) for b in choices}
    return {b: float(((o - ref) ** 2).sum() / (ref**2).sum()) for b, o in out.items()}


def pi_calibration_scales(
    keys: torch.Tensor | Sequence[torch.Tensor], alpha: float = 0.5, pairing: str = "rotate_half"
) -> torch.Tensor:
    """Reparameterization scales from positional-interpolation calibration
    (``smoothattention/apply_smoothattention.py``): ``clamp(max|K|^alpha, 1e-4, 1e4)`` per KV
    head and RoPE pair, the max over batch, tokens and both channels of the pair.

    ``keys``: post-RoPE calibration keys ``[B, H_kv, T, D]`` (or a list) of a short text run at
    positions ``arange(0, L, L // T)`` spread over a longer context L.  Returns float32
    ``[H_kv, D/2]``.  A runner applies s before the run: for KV head h and pair i, divide the
    ``k_proj`` rows (and bias) of both channels by ``s[h, i]`` and multiply the ``q_proj`` rows
    of those channels in each query head of h's GQA group by ``s[h, i]``; QK^T is unchanged (a
    per-pair scalar commutes with RoPE's rotation) and the cache stores ``K / s``.
    """
    ks = [keys] if isinstance(keys, torch.Tensor) else list(keys)
    if not ks or not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise ValueError(f"need at least one key tensor and a finite alpha (got {alpha!r})")
    amax = None
    for k in ks:
        a, b = split_pairs(k.float().abs(), pairing)
        m = torch.maximum(a, b).amax(dim=(0, 2))  # [H_kv, D/2]
        amax = m if amax is None else torch.maximum(amax, m)
    return (amax**alpha).clamp(1e-4, 1e4)
