"""``semkv``: SemKV (2026), token-level mixed precision.  [RECON] throughout: neither code nor
paper text was available, only the summary "preserves every token, ranks tokens by a
model-internal score, and assigns two adjacent above-cliff precisions".  Reconstruction:

* Every token is kept, quantized per token (KIVI value style, fp16 (scale, min) per
  ``value_group_size`` channels) at ``high_bits`` or ``low_bits``; its value (``mixed_values``)
  at the same width.  Nominal bits (docs/methods.md#average-bits): ``target + 32/group + 1/D`` (1-bit mask).
* ``score='attention'``: attention a key receives, summed over its KV head's query heads and
  averaged over the queries that saw it (the last ``score_window`` prefill queries, then decode
  queries given to :meth:`SemKVLayer.attend`, e.g. ``QuantizedKVCache(..., attend=True)``); a
  flush where a candidate was seen by no query (cache-only fidelity path) ranks by key-norm,
  which ``score='key-norm'`` always uses: ``||k||_2`` (post-RoPE).
* ``f = (target - low) / (high - low)`` of each (row, KV head)'s quantized tokens are high.
  Prefill: the ``round(f n)`` best of the ``n`` flushed (ties: older first).  Decode (sliding
  residual R): a flushed token is *important* if in the top ``ceil(f m)`` of the ``m`` residual
  tokens, then the high count is clamped to ``[floor(f N), ceil(f N)]`` of ``N`` quantized.

Sinks and residual are stored in the compute dtype, or in the config's ``storage_dtype``
(float16/bfloat16, docs/design.md#storage-dtype; a flush codes them converted back to the
compute dtype).  Scales and zeros are stored in ``scale_dtype`` (float16 by default) whatever the
compute dtype, so ``storage_dtype`` leaves them as they are; so it does the attention score's
float32 ``stats`` (key metadata, a running sum that 16 bits would round).

The stored block, :class:`MixedTokenBlock` (per-token min-max codes at two widths, the
high-width tokens' upper bits stored apart), is defined here; ``kvbench.kernels.cpu.mixed_tokens``
reads it in the code domain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvbench import fields as kf
from kvbench.attention.reference import causal_mask, length_mask
from kvbench.cache.blocks import cat_blocks, own_storage
from kvbench.cache.layer import LayerCache
from kvbench.cache.layout import BlockLayout, CodeClass, Codes, GroupTerms
from kvbench.cache.method import CacheConfig, Capabilities, Method
from kvbench.cache.native_quant import quantize_pack
from kvbench.cache.quant import pack_bits, quantize_groups, unpack_bits
from kvbench.cache.schedule import SlidingSchedule

_PER_TOKEN = ("low", "scale", "zero")  # MixedTokenBlock fields laid out [B, H_kv, n, ...]
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)])  # set bits of each byte


@dataclass
class MixedTokenBlock:
    """Per-token min-max codes at two widths.  low: uint8 ``[B, H_kv, n, ceil(D*lb/8)]``
    (``low_bits`` plane of every token); extra: uint8 ``[N_high, ceil(D*(hb-lb)/8)]`` (upper
    bits of high tokens, ``[n, B, H_kv]`` order); mask: uint8 ``[B, H_kv, ceil(n/8)]`` (1 bit
    per token: high); scale, zero: ``[B, H_kv, n, NG]`` (scale dtype)."""

    low: torch.Tensor
    extra: torch.Tensor
    mask: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    low_bits: int
    high_bits: int
    head_dim: int

    @property
    def ntokens(self) -> int:
        return self.scale.shape[2]

    def high(self) -> torch.Tensor:
        """Bool ``[B, H_kv, n]``: which tokens hold ``high_bits`` codes."""
        return unpack_bits(self.mask, 1, self.ntokens).bool()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        b, h, n, d = *self.low.shape[:3], self.head_dim
        codes = unpack_bits(self.low, self.low_bits, d).int().permute(2, 0, 1, 3)
        up = unpack_bits(self.extra, self.high_bits - self.low_bits, d).int()
        codes[self.high().permute(2, 0, 1)] += up << self.low_bits
        c = codes.permute(1, 2, 0, 3).float().reshape(b, h, n, self.scale.shape[-1], -1)
        x = c * self.scale.float()[..., None] + self.zero.float()[..., None]
        return x.reshape(b, h, n, d).to(dtype)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        parts = ("codes", "low"), ("codes", "extra"), ("metadata", "mask"), ("scales", "scale")
        return [(cat, getattr(self, k)) for cat, k in (*parts, ("scales", "zero"))]

    def _with(self, high: torch.Tensor, extra: torch.Tensor, **kw) -> MixedTokenBlock:
        mask = pack_bits(high.to(torch.uint8), 1, check=False)  # 0/1 by construction
        return replace(self, mask=mask, extra=extra, **kw)

    def high_count(self) -> torch.Tensor:
        """Int64 ``[B, H_kv]``: high tokens per (row, KV head), from the mask's bytes (the
        bits past ``ntokens`` are zero)."""
        return _POPCOUNT.to(self.mask.device)[self.mask.long()].sum(-1)

    def cat(self, other: MixedTokenBlock) -> MixedTokenBlock:
        """Tokens of ``self`` then ``other``.  The masks' bit streams are joined at the tail
        of ``self``'s: only its last, partly filled byte is unpacked, so a one-token flush
        costs O(1) bit work (the per-token tensors are concatenated whole)."""
        n, whole = self.ntokens, self.ntokens // 8
        mask = self.mask[..., :whole]
        if n % 8:
            tail = unpack_bits(self.mask[..., whole:], 1, n - 8 * whole)
            bits = torch.cat([tail, unpack_bits(other.mask, 1, other.ntokens)], -1)
            mask = torch.cat([mask, pack_bits(bits, 1, check=False)], -1)
        else:
            mask = torch.cat([mask, other.mask], -1)
        cat2 = {k: torch.cat([getattr(self, k), getattr(other, k)], 2) for k in _PER_TOKEN}
        return replace(self, mask=mask, extra=torch.cat([self.extra, other.extra]), **cat2)

    def crop(self, n: int) -> MixedTokenBlock:
        high = self.high()[:, :, :n]
        kept = {k: own_storage(getattr(self, k)[:, :, :n]) for k in _PER_TOKEN}
        return self._with(high, own_storage(self.extra[: int(high.sum())]), **kept)

    def index_batch(self, idx: torch.Tensor) -> MixedTokenBlock:
        idx = idx.to(self.low.device).long()
        hi_t = self.high().permute(2, 0, 1)  # [n, B, H]
        rows = torch.full(hi_t.shape, -1, dtype=torch.long, device=hi_t.device)
        rows[hi_t] = torch.arange(int(hi_t.sum()), device=hi_t.device)
        extra = self.extra[rows[:, idx][hi_t[:, idx]]]
        sel = {k: getattr(self, k)[idx] for k in _PER_TOKEN}
        return self._with(self.high()[idx], extra, **sel)


SCORES = ("attention", "key-norm")


@dataclass
class MixedTokenCodec:
    """``encode(x [B, H_kv, n, D], high bool [B, H_kv, n]) -> MixedTokenBlock``: per-token groups
    of ``channel_group`` channels, min-max at ``high_bits`` where ``high`` else ``low_bits``."""

    low_bits: int
    high_bits: int
    channel_group: int
    scale_dtype: torch.dtype = torch.float16
    token_group: int = 1  # (no ``prepare``: SemKVLayer calls ``encode`` itself)

    def _quantize(self, x: torch.Tensor, bits: int):
        """``(codes [B, H_kv, n, D], scale, zero [B, H_kv, n, D / channel_group])`` of
        ``quantize_groups`` on the channel groups: from the native one-pass quantizer
        (:mod:`kvbench.cache.native_quant`, the same values, one uint8 code per channel) where it
        serves ``x``, else from ``quantize_groups``."""
        cg, sd = self.channel_group, self.scale_dtype
        got = quantize_pack(x, bits, 1, cg, scale_dtype=sd, packed=False)
        if got is not None:
            return got
        b, h, n, d = x.shape
        q = quantize_groups(x.reshape(b, h, n, d // cg, cg), bits, scale_dtype=sd)
        return q.codes.reshape(b, h, n, d), q.scale[..., 0], q.zero[..., 0]

    def encode(self, x: torch.Tensor, high: torch.Tensor) -> MixedTokenBlock:
        d = x.shape[-1]
        lb, hb = self.low_bits, self.high_bits
        (cl, sl, zl), (ch, sh, _) = (self._quantize(x, bits) for bits in (lb, hb))
        codes = torch.where(high[..., None], ch, cl)
        scale = torch.where(high[..., None], sh, sl)
        # codes in range by construction (quantize_groups clamps; shifts and masks keep them)
        up = (codes >> lb).permute(2, 0, 1, 3)[high.permute(2, 0, 1)]
        extra = pack_bits(up, hb - lb, check=False)
        low = pack_bits(codes & ((1 << lb) - 1), lb, check=False)
        mask = pack_bits(high.to(torch.uint8), 1, check=False)
        return MixedTokenBlock(low, extra, mask, scale, zl, lb, hb, d)


def prefill_probabilities(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """:func:`kvbench.attention.reference.reference_probabilities` (causal, default scaling) of
    ``query [B, H_q, n_q, D]`` over ``keys [B, H_kv, T, D]``, float32 ``[B, H_q, n_q, T]``,
    one query head at a time against its KV head's float32 keys: the same per-head products,
    mask and softmax (equal bit for bit, tested), without the ``H_q / H_kv`` repeated float32
    copy of every key (4 GiB for 8 rows x 8 KV heads x 32K tokens at GQA 4:1)."""
    b, hq, nq, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    if hq % hkv or d != keys.shape[3] or b != keys.shape[0]:
        raise ValueError(
            f"attention shapes do not fit: query {tuple(query.shape)}, keys {tuple(keys.shape)}"
        )
    g, scale = hq // hkv, 1.0 / math.sqrt(d)
    masked = ~causal_mask(nq, t, query.device) if nq > 1 else None
    out = torch.empty(b, hq, nq, t, device=query.device)
    for h in range(hkv):
        kt = keys[:, h].float().transpose(-1, -2)
        for j in range(h * g, (h + 1) * g):
            lg = torch.matmul(query[:, j].float(), kt) * scale
            if masked is not None:
                lg = lg.masked_fill(masked, float("-inf"))
            out[:, j] = torch.softmax(lg, dim=-1)
    return out


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank along the last dim, 0 = highest score; ties: lower index first."""
    return torch.argsort(torch.argsort(-scores, dim=-1, stable=True), dim=-1)


class SemKVLayer(LayerCache):
    """A LayerCache whose flushes give each token its width.  ``stats`` (``score='attention'``,
    float32 ``[B, H_kv, r, 2]``, key metadata): per residual key, the attention mass received
    and the number of queries that saw it; :meth:`attend` adds the decode queries'."""

    #: a flush ranks the tokens it codes against the whole window, which a longer decode call
    #: lengthens, so one call's flush is not its steps': ``exact-chunked`` cuts every token
    steady_updates = False

    def __init__(self, config: SemKVConfig, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.c, self.stats = config, None
        self.frac = (config.target_bits - config.low_bits) / (config.high_bits - config.low_bits)

    def _rlen(self, side=None) -> int:  # residual tokens of a side (keys by default)
        return 0 if (res := (side or self.k).residual) is None else res.shape[2]

    def _grow(self, new: int, like: torch.Tensor) -> None:  # ``new`` unseen residual tokens
        if self.c.score == "attention":
            zeros = torch.zeros(*like.shape[:2], new, 2, device=like.device)
            self.stats = zeros if self.stats is None else torch.cat([self.stats, zeros], 2)

    @property
    def observes_attention(self) -> bool:  # the attention score reads every step's softmax
        return self.c.score == "attention"

    def observe_attention(self, probs: torch.Tensor, lengths: torch.Tensor | None) -> None:
        """Residual keys' attention mass (summed over the KV head's query heads and the
        queries) and the number of queries that saw them -> ``stats``.  ``probs``: float32
        ``[B, H_q, n_q, T]`` of a step (masked keys 0), called by the attention backend."""
        (b, _, nq, t), r = probs.shape, self._rlen()
        if self.stats is None or not r:
            return
        h = self.stats.shape[1]
        self.stats[..., 0] += probs[..., t - r :].reshape(b, h, -1, r).sum(2)
        seen = length_mask(lengths, nq, t, probs.device)[..., t - r :].sum(1)  # [B|1, r]
        self.stats[..., 1] += seen[:, None].to(self.stats.dtype)

    def _observe(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """Prefill: the causal softmax of the newest queries over the prompt -> stats."""
        self.observe_attention(prefill_probabilities(query, keys), None)

    def _scores(self) -> torch.Tensor:
        """``[B, H_kv, r]``: mean attention received, or key-norm when a key was never seen."""
        if self.stats is not None and bool((self.stats[..., 1] > 0).all()):
            return self.stats[..., 0] / self.stats[..., 1]
        return self.k.residual.float().norm(dim=-1)

    def _flush(self, n: int, want, scores: torch.Tensor | None = None) -> None:
        """Quantize the ``n`` oldest residual tokens, the ``want`` best-scored at high bits
        (``scores``: :meth:`_scores` when the caller has them).  One token (a decode step's
        sliding flush) is its own best: high where ``want`` is 1, without ranking."""
        if n == 1 and isinstance(want, torch.Tensor):
            high = (want > 0)[..., None]
        else:
            scores = (self._scores() if scores is None else scores)[..., :n]
            high = _ranks(scores) < torch.as_tensor(want, device=scores.device)[..., None]
        for side in (self.k, self.v) if self.c.mixed_values else (self.k,):
            head, rest = side.residual[:, :, :n], side.residual[:, :, n:]
            side.residual = own_storage(rest) if rest.shape[2] else None
            if side.compute_dtype is not None:  # a 16-bit-stored residual, coded as computed
                head = head.to(side.compute_dtype)
            side.block = cat_blocks(side.block, side.codec.encode(head, high))
        if self.stats is not None:
            self.stats = own_storage(self.stats[:, :, n:])

    def finish_prefill(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        (r, p), self.stats = (self._rlen(), keys.shape[2]), None
        self._grow(r, keys)
        if self.stats is not None and r and queries is not None:
            self._observe(queries[:, :, max(p - self.c.score_window, 0) :], keys)
        if n := self.k.schedule.prefill_count(r):
            self._flush(n, math.floor(self.frac * n + 0.5))
        if not self.c.mixed_values:
            self.v.flush(self.v.schedule.prefill_count(self._rlen(self.v)))

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.end_step()
        r0 = self._rlen()
        super().append(keys, values)
        self._grow(self._rlen() - r0, keys)

    def end_step(self) -> None:
        if not self._pending:
            return
        self._pending, r, f = False, self._rlen(), self.frac
        if n := self.k.schedule.flush_count(r):
            blk = self.k.block
            nh, total = (0, n) if blk is None else (blk.high_count(), n + blk.ntokens)
            scores = self._scores()
            important = (_ranks(scores)[..., :n] < math.ceil(f * r - 1e-9)).sum(-1)
            lo, hi = math.floor(f * total + 1e-9), math.ceil(f * total - 1e-9)
            self._flush(n, ((nh + important).clamp(lo, hi) - nh).clamp(0, n), scores)
        if not self.c.mixed_values:
            self.v.flush(self.v.schedule.flush_count(self._rlen(self.v)))

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        if self.stats is not None:
            self.stats = own_storage(self.stats[:, :, : self._rlen()])

    def index_batch(self, idx: torch.Tensor) -> None:
        super().index_batch(idx)
        if self.stats is not None:
            self.stats = self.stats[torch.as_tensor(idx, device=self.stats.device).long()]

    def reset(self) -> None:
        super().reset()
        self.stats = None

    def tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return super().tensors() + ([] if self.stats is None else [("key", "metadata", self.stats)])


@dataclass(frozen=True)
class SemKVConfig(CacheConfig):
    """SemKV settings [RECON] (and :class:`kvbench.cache.method.CacheConfig`'s): high_bits, low_bits
    (3, 2; 1..8, high > low); target_bits: average code bits in [low, high] (2.5); score:
    ``"attention"`` (default, needs prefill queries) or ``"key-norm"``; score_window (32);
    mixed_values: values at their token's width (default True), else ``value_bits`` (16 = full
    precision).  ``residual_length``: any R >= 0."""

    high_bits: int = kf.spec(3, int, low=2, high=8)
    low_bits: int = kf.spec(2, int, low=1, high=7)
    target_bits: float = kf.spec(2.5, float, low=1, high=8)
    score: str = kf.spec("attention", str, choices=SCORES)
    score_window: int = kf.spec(32, int, low=1)
    mixed_values: bool = kf.spec(True, bool)

    token_axis_keys = False

    def __post_init__(self) -> None:
        super().__post_init__()
        lo, hi = self.low_bits, self.high_bits
        if hi <= lo:
            self.reject("high_bits", f"integers {lo + 1}..8 (above low_bits={lo})")
        if not lo <= self.target_bits <= hi:
            self.reject("target_bits", f"numbers in [{lo}, {hi}] (low_bits..high_bits)")
        if self.mixed_values and self.value_bits != 16:
            self.reject("value_bits", "16 with mixed_values=True")


class SemKV(Method):
    """SemKV [RECON]: every token kept, ranked by a model-internal score, two adjacent widths."""

    Config = SemKVConfig
    description = "SemKV [RECON]: per-token mixed precision (3/2 bits) ranked by attention"
    source = "SemKV (2026), reconstruction from its summary; no public code"
    capabilities = Capabilities(needs_queries=True, reconstruction=True)

    @property
    def needs_queries(self) -> bool:  # prefill queries serve the attention score only
        return self.config.score == "attention"

    def key_codec(self, layer_idx: int, head_dim: int) -> MixedTokenCodec:
        c = self.config
        return MixedTokenCodec(
            c.low_bits, c.high_bits, c.channel_group(head_dim), c.torch_scale_dtype
        )

    def key_schedule(self) -> object:
        return SlidingSchedule(self.config.residual_length)

    def value_codec(self, layer_idx: int, head_dim: int):
        codec = self.key_codec if self.config.mixed_values else super().value_codec
        return codec(layer_idx, head_dim)

    def value_schedule(self) -> object:
        return self.key_schedule() if self.config.mixed_values else super().value_schedule()

    def new_layer(self, layer_idx, num_kv_heads, head_dim, *args, **kwargs) -> SemKVLayer:
        """One empty :class:`SemKVLayer` for ``num_kv_heads`` heads of ``head_dim`` channels."""
        c, hd = self.config, {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        codecs = (self.key_codec(layer_idx, head_dim), self.value_codec(layer_idx, head_dim))
        sched = (self.key_schedule(), self.value_schedule())
        return SemKVLayer(c, *codecs, *sched, c.num_sink_tokens, self.needs_queries, **hd)

    def key_layout(self, head_dim: int) -> BlockLayout:
        """Every token's ``low_bits`` plane, the upper ``high_bits - low_bits`` plane for the
        high share ``f = (target - low) / (high - low)`` of the tokens, a (scale, zero) per token
        per ``value_group_size`` channels and a 1-bit high/low mask per token."""
        c, g = self.config, self.config.channel_group(head_dim)
        lo, hi = c.low_bits, c.high_bits
        share = (c.target_bits - lo) / (hi - lo)
        codes = Codes(head_dim, (CodeClass(lo, head_dim), CodeClass(hi - lo, head_dim, share)))
        return BlockLayout(
            codes,
            GroupTerms(("scale", "zero"), c.scale_dtype, 1, g),
            metadata=(GroupTerms(("high-mask",), "bit", 1, head_dim),),
        )

    def value_layout(self, head_dim: int) -> BlockLayout:
        """As :meth:`key_layout` with ``mixed_values``; else the KIVI value layout."""
        return (self.key_layout if self.config.mixed_values else super().value_layout)(head_dim)
