"""Reference attention over a KV cache, with GQA and a causal mask aligned to the end."""

from __future__ import annotations

import math

import torch


class NoDequantizedForm(NotImplementedError):
    """Raised by ``keys_values`` (and a block's ``dequantize``) of a cache whose stored keys
    have no dequantized form, only an estimator of ``q . k`` (QJL's 1-bit sketches, arXiv
    2406.03482 §3).  :func:`kvbench.attention.dispatch.reference_attend` catches exactly this
    and reads such a cache through its estimator's eager kernel; any other error propagates."""


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, H_kv, T, D]`` -> ``[B, H_kv * n_rep, T, D]``; query head ``h`` reads KV head ``h // n_rep``."""
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=1)


def causal_mask(n_q: int, n_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[n_q, n_k]``: query ``i`` (absolute position ``n_k - n_q + i``) sees keys ``<=`` it."""
    qpos = torch.arange(n_k - n_q, n_k, device=device).unsqueeze(1)
    return torch.arange(n_k, device=device).unsqueeze(0) <= qpos


def length_mask(
    lengths: torch.Tensor | None, n_q: int, n_k: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Bool ``[B|1, n_q, n_k]``: the keys query ``i`` of row ``b`` sees.  Row ``b`` holds its
    tokens at ``[0, lengths[b])`` and its queries are the last ``n_q`` of them (causal within
    them); ``lengths=None``: every row holds all ``n_k`` tokens (:func:`causal_mask`).
    Raises ``ValueError`` for a length outside ``[n_q, n_k]``."""
    if lengths is None:
        return causal_mask(n_q, n_k, device).unsqueeze(0)
    ln = torch.as_tensor(lengths, device=device).long().view(-1, 1, 1)
    if ln.numel() and (int(ln.min()) < n_q or int(ln.max()) > n_k):
        raise ValueError(f"lengths={ln.flatten().tolist()} must lie in [n_q, T] = [{n_q}, {n_k}]")
    qpos = ln - n_q + torch.arange(n_q, device=device).view(1, -1, 1)
    return torch.arange(n_k, device=device).view(1, 1, -1) <= qpos


def reference_probabilities(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 softmax ``[B, H_q, n_q, T]`` of :func:`reference_attention` (masked keys 0);
    same parameters and errors (``keys`` ``[B, H_kv, T, D]``)."""
    b, hq, nq, d = query.shape
    bk, hkv, t, dk = keys.shape
    if hq % hkv or d != dk or b != bk:
        raise ValueError(
            f"attention shapes do not fit: query {tuple(query.shape)}, keys {tuple(keys.shape)}"
        )
    scale = 1.0 / math.sqrt(d) if scaling is None else scaling
    k = repeat_kv(keys.float(), hq // hkv)
    logits = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    if lengths is not None:
        mask = length_mask(lengths, nq, t, query.device).unsqueeze(1)  # [B, 1, n_q, T]
        logits = logits.masked_fill(~mask, float("-inf"))
    elif nq > 1:
        logits = logits.masked_fill(~causal_mask(nq, t, query.device), float("-inf"))
    return torch.softmax(logits, dim=-1)


def reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of the newest ``n_q`` positions over ``T`` cached keys.

    Parameters
    ----------
    query : ``[B, H_q, n_q, D]``, the queries of the last ``n_q`` positions.
    keys, values : ``[B, H_kv, T, D]`` (KV heads, not repeated); ``H_q % H_kv == 0``.
    scaling : logit scale, default ``1/sqrt(D)``.
    lengths : optional int ``[B]``: row ``b`` holds ``lengths[b]`` valid tokens at the start of
        the cache (:func:`length_mask`); ``None``: all ``T``.

    Returns
    -------
    ``[B, H_q, n_q, D]`` in ``query``'s dtype; logits and softmax computed in float32.

    Raises
    ------
    ValueError
        Head counts that do not divide, or mismatched head_dim / batch.
    """
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(
            f"attention shapes do not fit: query {tuple(query.shape)}, keys {tuple(keys.shape)},"
            f" values {tuple(values.shape)}"
        )
    probs = reference_probabilities(query, keys, scaling, lengths)
    v = repeat_kv(values.float(), query.shape[1] // keys.shape[1])
    return torch.matmul(probs, v).to(query.dtype)


#: a side's view for :func:`view_attention`: ``(start, full [B, H_kv, F, D], steps [F])``
SideViewTensors = tuple[int, torch.Tensor, torch.Tensor]


def view_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
    key_view: SideViewTensors | None = None,
    value_view: SideViewTensors | None = None,
) -> torch.Tensor:
    """:func:`reference_attention` (causal, aligned to the end) where query ``t`` of the
    ``n_q`` reads held tokens ``start .. start + F - 1`` of a side as ``full`` instead of the
    given ``keys`` / ``values`` when ``steps[i] > t`` (a view per query:
    :func:`kvbench.attention.dispatch.attend_views`).

    Parameters
    ----------
    query : ``[B, H_q, n_q, D]``.
    keys, values : ``[B, H_kv, T, D]``, what the cache stores (dequantized).
    key_view, value_view : ``(start, full [B, H_kv, F, D], steps int [F])`` or ``None``.

    Returns ``[B, H_q, n_q, D]`` in ``query``'s dtype; logits, softmax and sums in float32, or
    in ``query``'s dtype when it is wider (float64).

    Raises ``ValueError`` for shapes that do not fit or a view outside ``[0, T)``."""
    b, hq, nq, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    if hq % hkv or keys.shape != values.shape or keys.shape[0] != b or keys.shape[3] != d:
        raise ValueError(
            f"attention shapes do not fit: query {tuple(query.shape)}, keys {tuple(keys.shape)},"
            f" values {tuple(values.shape)}"
        )
    dt = torch.promote_types(query.dtype, torch.float32)
    rep = hq // hkv
    scale = 1.0 / math.sqrt(d) if scaling is None else scaling
    q = query.to(dt)
    qstep = torch.arange(nq, device=query.device).view(nq, 1)

    def window(view: SideViewTensors) -> tuple[slice, torch.Tensor, torch.Tensor]:
        start, full, steps = view
        f = full.shape[2]
        if start < 0 or start + f > t or full.shape[:2] != keys.shape[:2] or steps.numel() != f:
            raise ValueError(f"a view of tokens {start}..{start + f - 1} does not fit {t} held")
        reads_full = steps.to(query.device).view(1, f) > qstep  # [n_q, F]
        return slice(start, start + f), repeat_kv(full.to(dt), rep), reads_full

    logits = torch.matmul(q, repeat_kv(keys.to(dt), rep).transpose(-1, -2)) * scale
    if key_view is not None:
        sl, kf, m = window(key_view)
        full_logits = torch.matmul(q, kf.transpose(-1, -2)) * scale
        logits[..., sl] = torch.where(m, full_logits, logits[..., sl])
    if nq > 1:
        logits = logits.masked_fill(~causal_mask(nq, t, query.device), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, repeat_kv(values.to(dt), rep))
    if value_view is not None:
        sl, vf, m = window(value_view)
        diff = vf - repeat_kv(values[:, :, sl].to(dt), rep)
        out = out + torch.matmul(probs[..., sl] * m.to(dt), diff)
    return out.to(query.dtype)
