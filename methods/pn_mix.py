"""``pn-mix``: PN-Mix, pair-norm guided mixed-precision key cache (Song & Yoo, arXiv 2610.19605,
Oct 2026).  docs/methods.md#pn-mix, docs/methods.md#average-bits, docs/methods.md#worked-example-8 .. docs/methods.md#worked-example-10; PN-Mix Tables 1, 4, 9, 10, 11.

Keys (post-RoPE) are quantized per channel in pages of G tokens.  Salient RoPE pairs are chosen
**once at prefill** per (batch row, KV head) and kept for the whole generation: the
``n_H = floor(high_ratio * D/2)`` pairs with the highest score (ties: lower pair index) store
both channels at ``high_bits``, all other channels at ``low_bits``; 1-bit groups use the
midpoint correction (Eq. 7).  Main config PN-Mix (1) = H3(50%)L1: high 3, low 1, r = 0.5,
G = R = 128, N_s = 32, b_V = 16 (Table 10); nominal key bits (512 + 32768 * 2.25) / 32800 =
2.263 (reported 2.26).  The selection is stored once per (b, h) as a uint8 channel permutation
(docs/methods.md#pn-mix: amortized to ~0, so ``m_sal = 0``) and is inspectable as
``layer_cache.k.codec.selected_pairs`` (LongTensor ``[B, H_kv, n_H]``).

Reconstructed parts [RECON] (the paper text was not available; docs/methods.md#pn-mix), each a config field:

* ``score`` (Eq. 5): ``qk-pair-norm`` (default, separable: mean over the KV head's query heads
  and prefill tokens of ||q_i|| times mean over tokens of ||k_i||; query head g belongs to KV
  head g // (H_q / H_kv)), ``qk-pair-norm-causal`` (Table 1's causal-joint comparator,
  mean_g sum_t ||q_i^t|| sum_{s<=t} ||k_i^s||), and the key-only criteria of Table 11 / Fig. 4:
  ``k-range`` and ``k-magnitude`` (per-channel range / mean |k|, a pair scores the sum of its
  two channels), ``k-pair-norm`` (mean ||k_i||);
* ``midpoint_correction`` (Eq. 7 read as threshold at the midpoint, reconstruct at bin centres);
* ``pairing``: ``rotate-half`` (i, i + D/2), HF Llama/Qwen, default; ``interleaved`` (2i, 2i+1);
* ``flush``: ``kivi`` (default; blocks of R, docs/methods.md#kivi) or ``kitty`` (all but newest, docs/methods.md#kitty);
* ``score_sink_tokens``: whether the score sees the sink tokens (default: all prefill tokens;
  if excluding them leaves none, all are used).

Capabilities: the query scores need the post-RoPE prefill queries; the key-only scores do not.
A runner reads the instance property :attr:`PNMix.needs_queries` (the class capability says
``True``, the worst case); ``new_layer`` hands it to the LayerCache, which keeps a query-less
prefill pending until ``provide_queries`` and refuses decode tokens before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import fields as kf
from kvbench.cache.blocks import Codec
from kvbench.cache.chunks import token_chunks
from kvbench.cache.method import CacheConfig, Capabilities, Method
from kvbench.cache.mixed_channel import (
    PAIRINGS,
    MixedChannelCodec,
    channel_scores,
    high_pairs,
    pair_channels,
    rank_classes,
)
from kvbench.cache.schedule import AllButNewestSchedule, BlockSchedule

SCORES = ("qk-pair-norm", "qk-pair-norm-causal", "k-range", "k-magnitude", "k-pair-norm")
FLUSHES = ("kivi", "kitty")


def _pair_norm(x: torch.Tensor, pc: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``hypot`` of each RoPE pair ``[..., T, D/2]`` in ``dt`` for ``x [..., T, D]``: each half
    read from ``x`` in its own dtype, then cast (the cast is exact, so the same values as
    reading from ``x.to(dt)``), chunk by chunk along T into one ``dt`` output
    (:mod:`kvbench.cache.chunks`; elementwise, so equal to one pass), without a ``dt`` copy of
    all of ``x`` (4 GiB of float32 for 8 rows of 32K-token queries).  A half whose channels
    step evenly (both pairings) is read as a strided view instead of an index gather."""
    halves = [_channels(x, pc[:, j]) for j in (0, 1)]
    out = torch.empty(*x.shape[:-1], pc.shape[0], dtype=dt, device=x.device)
    t = x.shape[-2]
    rows = x[..., 0, 0].numel()
    for t0, t1 in token_chunks(rows, 1, t, x.shape[-1]):
        a, b = (h(t0, t1).to(dt) for h in halves)
        torch.hypot(a, b, out=out[..., t0:t1, :])
    return out


def _channels(x: torch.Tensor, idx: torch.Tensor):
    """``f(t0, t1)`` -> ``x[..., t0:t1, idx]``: a strided view where ``idx`` steps evenly, else
    an index gather (same values either way)."""
    n = idx.shape[0]
    start = int(idx[0])
    step = int(idx[1] - idx[0]) if n > 1 else 1
    if step > 0 and torch.equal(idx.cpu(), start + step * torch.arange(n)):
        return lambda t0, t1: x[..., t0:t1, start : start + step * (n - 1) + 1 : step]
    return lambda t0, t1: x[..., t0:t1, :][..., idx]


def pair_scores(
    keys: torch.Tensor,
    queries: torch.Tensor | None = None,
    score: str = "qk-pair-norm",
    pairing: str = "rotate-half",
) -> torch.Tensor:
    """Importance of each RoPE pair per KV head (docs/methods.md#pn-mix [RECON], Example 8).

    Parameters
    ----------
    keys : post-RoPE prefill keys ``[B, H_kv, P, D]``.
    queries : post-RoPE prefill queries ``[B, H_q, P, D]`` (``H_q % H_kv == 0``); needed by the
        ``qk-*`` scores, ignored by the key-only ones.
    score, pairing : see the module docstring.

    Returns
    -------
    ``[B, H_kv, D/2]`` float32 (float64 for float64 keys).

    Raises
    ------
    ValueError
        Unknown score/pairing, odd D, no tokens, missing or mis-shaped queries.
    """
    if score not in SCORES:
        raise ValueError(f"score={score!r} is not supported; allowed: {list(SCORES)}")
    b, hkv, p, d = keys.shape
    pc = pair_channels(d, pairing).to(keys.device)
    if p == 0:
        raise ValueError("pair_scores needs at least one prefill token")
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32
    if score in ("k-range", "k-magnitude"):
        ch = channel_scores(keys.to(dt), score[2:])
        return ch[..., pc[:, 0]] + ch[..., pc[:, 1]]
    kn = _pair_norm(keys, pc, dt)  # [B, H_kv, P, D/2]
    if score == "k-pair-norm":
        return kn.mean(dim=2)
    if queries is None:
        raise ValueError(
            f"score={score!r} needs the post-RoPE prefill queries (capability needs_queries)"
        )
    bq, hq, pq, dq = queries.shape
    if bq != b or dq != d or hq % hkv or (score == "qk-pair-norm-causal" and pq != p):
        raise ValueError(
            f"queries {tuple(queries.shape)} do not fit keys {tuple(keys.shape)}: need the same "
            "B, D (and P for the causal score) and H_q a multiple of H_kv"
        )
    qn = _pair_norm(queries, pc, dt).reshape(b, hkv, hq // hkv, pq, d // 2)
    if score == "qk-pair-norm":
        return qn.mean(dim=(2, 3)) * kn.mean(dim=2)
    return (qn * kn.cumsum(dim=2).unsqueeze(2)).sum(dim=3).mean(dim=2)


@dataclass(frozen=True)
class PNMixConfig(CacheConfig):
    """PN-Mix settings; common fields: :class:`kvbench.cache.method.CacheConfig`.

    Attributes
    ----------
    high_bits, low_bits : code widths of selected / other pairs (1..8, low < high).
    high_ratio : fraction r of pairs at ``high_bits``, in [0, 1]; ``n_H = floor(r * D/2)``
        (r_eff = 2 n_H / D).  0 is KIVI at ``low_bits`` with PN-Mix's sinks.
    score, pairing, midpoint_correction, flush, score_sink_tokens : [RECON] switches, see the
        module docstring.
    """

    group_size: int = 128
    residual_length: int = 128
    num_sink_tokens: int = 32
    high_bits: int = kf.spec(3, int, low=1, high=8)
    low_bits: int = kf.spec(1, int, low=1, high=8)
    high_ratio: float = kf.spec(0.5, float, low=0, high=1)
    score: str = kf.spec("qk-pair-norm", str, choices=SCORES)
    pairing: str = kf.spec("rotate-half", str, choices=tuple(PAIRINGS))
    midpoint_correction: bool = kf.spec(True, bool)
    flush: str = kf.spec("kivi", str, choices=FLUSHES)
    score_sink_tokens: bool = kf.spec(True, bool)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.low_bits >= self.high_bits:
            self.reject("low_bits", f"integers below high_bits={self.high_bits}")


class PairSelector:
    """Prefill selector: keys ``[B, H_kv, P, D]`` (+ queries) -> channel classes
    ``[B, H_kv, D]`` (0 = both channels of a selected pair).  ``scores`` keeps the pair scores
    ``[B, H_kv, D/2]`` of the last prefill, in that prefill's batch order (for Table 1/11
    studies; not reordered by ``index_batch``)."""

    def __init__(self, config: PNMixConfig, head_dim: int) -> None:
        self.config = config
        self.channels = pair_channels(head_dim, config.pairing)
        self.n_high = high_pairs(head_dim, config.high_ratio)
        self.scores: torch.Tensor | None = None

    def __call__(self, keys: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        ns = c.num_sink_tokens
        if not c.score_sink_tokens and keys.shape[2] > ns:
            keys = keys[:, :, ns:]
            queries = None if queries is None else queries[:, :, ns:]
        self.scores = pair_scores(keys, queries, c.score, c.pairing)
        n_pairs = self.channels.shape[0]
        pclass = rank_classes(self.scores, [self.n_high, n_pairs - self.n_high])
        out = torch.empty(*pclass.shape[:-1], 2 * n_pairs, dtype=torch.long, device=keys.device)
        ch = self.channels.to(keys.device)
        out[..., ch[:, 0]] = pclass
        out[..., ch[:, 1]] = pclass
        return out


class PairCodec(MixedChannelCodec):
    """:class:`~kvbench.cache.mixed_channel.MixedChannelCodec` with a fixed RoPE-pair selection."""

    @property
    def selected_pairs(self) -> torch.Tensor | None:
        """Selected (``high_bits``) pairs, ascending: LongTensor ``[B, H_kv, n_H]`` (follows
        ``index_batch``); ``[1, 1, n_H]`` when every pair is in one class (r = 0 or 1);
        ``None`` before the prefill."""
        cls = self.classes
        if cls is None:
            return None
        first = self.selector.channels[:, 0].to(cls.device)
        pcls = cls[..., first]
        n_high = self.selector.n_high
        return torch.sort(pcls, dim=-1, stable=True).indices[..., :n_high]


class PNMix(Method):
    """PN-Mix: RoPE pairs selected once at prefill by the query-key pair-norm product."""

    Config = PNMixConfig
    description = "PN-Mix: prefill-selected RoPE pairs at high bits (QK pair norm), 1-bit midpoint"
    source = "Song & Yoo, arXiv 2610.19605, Eq. 5, 7, Tables 1, 4, 10, 11 [RECON]; docs/methods.md#pn-mix"
    capabilities = Capabilities(needs_queries=True, reconstruction=True)

    @property
    def needs_queries(self) -> bool:
        """True for the ``qk-*`` scores, False for the key-only ones."""
        return self.config.score.startswith("qk-")

    def key_codec(self, layer_idx: int, head_dim: int) -> Codec:
        c = self.config
        sel = PairSelector(c, head_dim)
        return PairCodec(
            [c.high_bits, c.low_bits],
            sel,
            group_size=c.group_size,
            scale_dtype=c.torch_scale_dtype,
            midpoint=c.midpoint_correction,
            class_counts=(2 * sel.n_high, head_dim - 2 * sel.n_high),
        )

    def key_schedule(self) -> object:
        c = self.config
        if c.flush == "kitty":
            return AllButNewestSchedule(c.residual_length, c.group_size)
        return BlockSchedule(c.residual_length)

    def pair_scores(
        self, keys: torch.Tensor, queries: torch.Tensor | None, score: str, pairing: str
    ) -> torch.Tensor:
        """PN-Mix's RoPE-pair scores (:func:`pair_scores`), the pair studies' hook."""
        return pair_scores(keys, queries, score, pairing)
