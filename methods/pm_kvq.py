"""``pm-kvq``: PM-KVQ (Liu et al., "PM-KVQ: Progressive Mixed-precision KV Cache Quantization for
Long-CoT LLMs", arXiv 2505.18610, ICLR'26), docs/methods.md#pm-kvq.  The paper text was not readable offline;
sources are its abstract and the code (thu-nics/PM-KVQ at c8a2bff, files named below) [SRC].

Progressive cache (``progressive/progressive_quantized_cache.py``): keys and values per token,
asymmetric min-max over ``channel_group_size`` channels (original 128; ``None`` = min(128, D)).
The first ``num_sink_tokens`` (1) tokens and a window of ``residual_length`` (128) stay out of
the main cache; the window is flushed whole when full (cycles 0..R-1).  Flushed tokens get
``init_bits`` = 16-bit integer codes, shifted down to the layer's width; when the layer exceeds
its budget the whole main cache (K and V) shrinks 16 -> 8 -> 4 -> 2 by the equivalent right
shift (:func:`shrink_codes`; scale x (2^c + 1), zero unchanged).

Choices made here:
* Sinks and window are kept in the model dtype, or in the config's ``storage_dtype``
  (float16/bfloat16: docs/design.md#storage-dtype) when set (bit-exact in that dtype; fp16/bf16
  = 2 bytes per element like the original's 16-bit codes, without their scales).  The original
  stores them through its 16-bit integer quantizer, so they are not bit-exact there.  Scales
  and zeros are stored in ``scale_dtype`` (float16 by default) whatever the compute dtype, so
  ``storage_dtype`` leaves them as they are; the budget counts sinks and window at 16 bits per
  element either way, so the widths reached do not depend on ``storage_dtype``.
* The budget is checked after each step's flush (docs/design.md#protocols) and the main cache shrinks until
  it fits (the original shrinks one step per update, reaching the same widths a few tokens
  later).  Over budget at 2 bits: ``on_overflow="raise"`` raises ``MemoryError`` like the
  original, ``"allow"`` continues.  A ``budget_bits`` below 2 is a ``ValueError`` at config time.
* docs/design.md#groups-and-head-dim; the 16-bit stage's range/65535 is then subnormal for
  ranges below ~4: measured 2-bit RMS error +4% for 128-channel groups of range ~0.05, +13% at
  ~0.016, none at range >= 0.5; ``scale_dtype="bfloat16"`` (the original's) avoids that.
* ``budget_scope="codes"`` counts what the original counts (codes; sinks and window at 16 bits
  per element, as the original stores them, whatever the model dtype); ``"all"`` adds scales
  and zeros.
* A ``budget_bits`` row must get the budget it names: when the main cache has to shrink below
  the width ``budget_bits`` names (:meth:`PMKVQ.final_bits`), the budget was sized for fewer
  tokens than the run holds (its window and sinks count at 16 bits), and the row would report
  a lower width's numbers under the named one.  With ``on_overflow="raise"`` that is a
  :class:`BudgetTooShort` error (a ``ValueError``) naming the tokens needed; ``"allow"``
  continues.  A run of T tokens keeps width b when ``budget_tokens >= T + (16 / b - 1) (R + N_s)``.
* Budgets are per layer and sequence (a batch of B holds B times it).  ``budget_bits`` b means
  ``b / 8 * 2 * H_kv * D * budget_tokens`` bytes, the original allocation's ``kv_mem``, so set
  ``budget_tokens`` (default 32768, its ``max_len``) to the workload's length; ``budget_bytes``
  gives bytes.  Either may be a per-layer list (e.g. from
  :func:`allocate_bits`); neither = 2.0.

Nominal bits (docs/methods.md#average-bits): b_eff = the widest width whose main cache of ``budget_tokens`` tokens
fits ``budget_bits`` (mean over a per-layer list) + one (scale, zero) per channel group; sinks
at 16 bits.  Defaults, D = 128: 2 + 32/128 = 2.25 (2.2504 with the sink).

Calibration (end of this module): block-wise memory allocation (:func:`allocate_bits`), a
per-layer sensitivity (:func:`layer_sensitivity`) and the positional-interpolation
reparameterization scales (:func:`pi_calibration_scales`).  Workflow for a runner: capture
post-RoPE Q/K/V (and, for the Taylor proxy, dLoss/dK and dLoss/dV) of each layer on a
calibration text disjoint from the evaluation text (record which), compute
``layer_sensitivity`` per layer, solve ``allocate_bits`` for a total byte budget and pass the
widths as ``budget_bits`` with ``budget_tokens`` = the length the layer sizes were computed for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kvbench import fields as kf
from kvbench.attention.reference import reference_attention
from kvbench.cache.blocks import AffineBlock, PerTokenCodec
from kvbench.cache.chunks import token_chunks
from kvbench.cache.layer import LayerCache
from kvbench.cache.layout import BlockLayout, CodeClass, Codes, GroupTerms
from kvbench.cache.method import PAIR_BITS, Capabilities, Method, MethodConfig
from kvbench.cache.quant import fake_quantize, pack_bits, packed_size, resolve_scale_dtype
from kvbench.cache.schedule import BlockSchedule

from .polarquant import split_pairs

__all__ = ["PMKVQ", "PMKVQConfig", "allocate_bits", "layer_sensitivity", "pi_calibration_scales"]

WIDTHS = (16, 8, 4, 2)
MIN_BITS = 2


def shrink_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Equivalent right shift ``bits`` -> ``c = bits // 2`` (``bit_width_shrinking``)::

        q_c = ((q (2^2c - 2^c + 1) + 2^(3c-1) - 2^(2c-1) + 2^(c-1)) >> 3c) & (2^c - 1)

    equals ``round(q / (2^c + 1))`` for every code in ``[0, 2^bits)``; no ties exist since
    2^c + 1 is odd.  int64 arithmetic above 8 bits (16 -> 8 exceeds 2^31), int32 up to 8 bits
    (the numerator stays below 2^17), in place on one working copy.  Integer codes of any
    shape -> int64 (``bits > 8``) or int32.  ``ValueError`` for odd ``bits``.
    """
    if bits < 2 or bits % 2:
        raise ValueError(f"bits={bits} must be even and >= 2 to halve")
    c = bits // 2
    q = codes.to(torch.int64 if bits > 8 else torch.int32, copy=True)
    q.mul_((1 << 2 * c) - (1 << c) + 1).add_((1 << 3 * c - 1) - (1 << 2 * c - 1) + (1 << c - 1))
    return q.bitwise_right_shift_(3 * c).bitwise_and_((1 << c) - 1)


def shrink_block(block: AffineBlock, bits: int | None = None) -> AffineBlock:
    """Halve a block's width (``bits``: halve repeatedly down to that width, default one
    halving): codes by :func:`shrink_codes`, scale x (2^c + 1) per halving (float32 math,
    stored in the scale dtype after each, as one halving at a time stores it), zero
    unchanged.  The codes stay unpacked between halvings and are packed once at the end
    (packing is lossless, so the stored codes equal those of one halving at a time)."""
    target = block.bits // 2 if bits is None else bits
    codes, scale, b = block.unpacked_codes(), block.scale, block.bits
    while b > target:
        c = b // 2
        codes = shrink_codes(codes, b)
        scale = (scale.float() * ((1 << c) + 1)).to(block.scale.dtype)
        b = c
    return replace(block, codes=pack_bits(codes, b), scale=scale, bits=b)


@dataclass
class ProgressiveCodec:
    """Per-token groups coded at ``init_bits``, then shrunk to the layer's current ``bits``."""

    init_bits: int
    bits: int
    channel_group: int
    scale_dtype: torch.dtype = torch.float16
    token_group: int = field(default=1)

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        return None

    def encode(self, x: torch.Tensor) -> AffineBlock:
        """``x [B, H_kv, n, D]`` -> :class:`AffineBlock` at ``bits``, chunk by chunk along T
        (:func:`~kvbench.cache.chunks.token_chunks`: per-token groups, so the codes and scales
        equal one pass's, while the 16-bit codes and their int64 halvings stay a chunk's)."""
        b, h, n, d = x.shape
        codec = PerTokenCodec(self.init_bits, self.scale_dtype, channel_group=self.channel_group)
        parts = []
        for t0, t1 in token_chunks(b, h, n, d):
            block = codec.encode(x[:, :, t0:t1])
            parts.append(shrink_block(block, self.bits) if block.bits > self.bits else block)
        if not parts:  # no tokens
            block = codec.encode(x)
            return shrink_block(block, self.bits) if block.bits > self.bits else block
        return AffineBlock.join(parts)


class BudgetTooShort(ValueError):
    """A ``budget_bits`` budget ran out before the run ended (the width fell below the named
    one); the message names the tokens held and the ``budget_tokens`` that would keep it."""


class ProgressiveLayerCache(LayerCache):
    """:class:`LayerCache` whose main cache shrinks while the layer exceeds ``budget`` (bytes per
    sequence).  Codecs, schedules, sinks and ``num_kv_heads``/``head_dim`` as in
    :class:`LayerCache` (built by :meth:`PMKVQ.new_layer` through
    :meth:`~kvbench.cache.method.Method.layer_cache`); ``budget_scope`` and ``on_overflow`` come
    from ``config``; ``bits`` is the width now."""

    def __init__(
        self,
        key_codec: ProgressiveCodec,
        value_codec: ProgressiveCodec,
        *args: Any,
        config: PMKVQConfig,
        budget: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(key_codec, value_codec, *args, **kwargs)
        self.budget, self.scope, self.on_overflow = budget, config.budget_scope, config.on_overflow
        self.init_bits = key_codec.init_bits
        #: the width the budget names (``budget_bits``); below it the budget is too short
        self.named_bits, self.config = MIN_BITS, config

    @property
    def bits(self) -> int:
        return self.k.codec.bits

    def budget_used(self) -> tuple[int, float]:
        """(bytes counted against the budget, the budget for the current batch)."""
        nb = self.nbytes()
        # sinks and window count as 16-bit integers, as the original stores them, whatever the
        # dtype they are stored in (the layer's storage_dtype, else the model dtype: an fp32
        # model would otherwise spend the budget on its window)
        stored = self.storage_dtype or self.dtype
        per = 2 / (torch.finfo(stored).bits // 8) if stored is not None else 1.0
        used = nb["codes"] + int((nb["residual"] + nb["sinks"]) * per)
        used += nb["scales"] + nb["metadata"] if self.scope == "all" else 0
        return used, self.budget * max(self.batch_size, 1)

    def _enforce_budget(self) -> None:
        target = self._budget_bits()
        if target < self.bits:  # all halvings at once: the blocks of one halving at a time
            for side in (self.k, self.v):
                side.block = None if side.block is None else shrink_block(side.block, target)
                side.codec.bits = target
        if self.bits < self.named_bits and self.on_overflow == "raise":
            c, t = self.config, self.seq_length
            need = t + (16 / self.named_bits - 1) * (c.residual_length + c.num_sink_tokens)
            raise BudgetTooShort(
                f"PM-KVQ budget_bits={self.named_bits} sized for budget_tokens={c.budget_tokens} "
                f"ran out at {t} tokens (the cache shrank to {self.bits} bits; window and sinks "
                f"count at 16 bits): set budget_tokens >= {math.ceil(need)} for this run, or "
                "on_overflow='allow' to let it shrink"
            )
        used, budget = self.budget_used()
        if used > budget and self.on_overflow == "raise":
            raise MemoryError(
                f"PM-KVQ layer holds {used} B > budget {budget:.0f} B at {self.bits} bits; raise "
                "budget_bits/budget_bytes or budget_tokens, or set on_overflow='allow'"
            )

    def _budget_bits(self) -> int:
        """The width the layer halves down to: halve (both sides together) while the bytes
        counted against the budget exceed it and the width is above :data:`MIN_BITS`.  Only the
        codes change size with a halving (``packed_size(D, bits)`` bytes per token row; scales,
        zeros, window and sinks stay), so each halving's bytes follow from the stored ones
        without shrinking the blocks in between (:func:`shrink_block` does all halvings at
        once, with the codes of one halving at a time)."""
        used, budget = self.budget_used()
        bits = self.bits
        blocks = [s.block for s in (self.k, self.v) if s.block is not None]
        rows = [
            b.codes.numel() * b.codes.element_size() // packed_size(b.head_dim, bits)
            for b in blocks
        ]
        codes = sum(r * packed_size(b.head_dim, bits) for r, b in zip(rows, blocks))
        while used > budget and bits > MIN_BITS:
            bits //= 2
            now = sum(r * packed_size(b.head_dim, bits) for r, b in zip(rows, blocks))
            used, codes = used - codes + now, now
        return bits

    def steady_appends(self, limit: int) -> int:
        """:meth:`LayerCache.steady_appends` (the schedules: no flush after the next step) that
        also stops before a budget halving, which re-encodes every held token: the minimum of
        the schedules' answer and :meth:`budget_appends`."""
        k = super().steady_appends(limit)
        if self._rows is not None or k == 0:
            return k  # rows: the minimum of each row's own answer
        return self.budget_appends(k)

    def budget_appends(self, limit: int) -> int:
        """How many tokens can follow the next one, none of them flushing, before the layer's
        width halves: an integer in ``[0, limit]`` (tokens; ``limit`` at :data:`MIN_BITS`,
        where it never halves).

        Every such step adds one token to the window (or a sink slot) and no codes, so the
        bytes counted against the budget grow by one token of K and V at 16 bits per element
        (:meth:`budget_used`) and the width halves at the first step they exceed the budget.
        0 when the next step flushes (its codes change the bytes; the next call is cut from
        the state it leaves) or already exceeds the budget (it halves, before the call's
        queries read)."""
        if self.bits <= MIN_BITS:
            return limit
        held = [0 if s.residual is None else s.residual.shape[2] for s in (self.k, self.v)]
        if any(s.schedule.flush_count(r + 1) for s, r in zip((self.k, self.v), held)):
            return 0
        b, h, d = self.kv_shape
        token = 2 * b * h * d * 2  # K and V, 2 bytes per element as budget_used counts them
        used, budget = self.budget_used()
        return min(max(int((budget - used) // token) - 1, 0), limit)

    def finish_prefill(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        super().finish_prefill(keys, queries)
        self._enforce_budget()

    def end_step(self) -> None:
        pending = self._pending
        super().end_step()
        if pending:
            self._enforce_budget()

    def reset(self) -> None:
        super().reset()
        self.k.codec.bits = self.v.codec.bits = self.init_bits


@dataclass(frozen=True)
class PMKVQConfig(MethodConfig):
    """PM-KVQ settings (choices: module docstring).

    Attributes
    ----------
    channel_group_size : channels per (scale, zero) along head_dim; ``None`` = min(128, D).
    residual_length, num_sink_tokens : window R (128) and sinks (1), full precision.
    init_bits : first width of flushed tokens: 16, 8, 4 or 2.
    budget_bits : bits per element >= 2, or a per-layer list; exclusive with ``budget_bytes``
        (bytes per layer and sequence, > 0, or a list).  Neither: 2.0 bits.
    budget_tokens : context length a ``budget_bits`` budget is sized for.
    budget_scope : ``"codes"`` or ``"all"``.  on_overflow : ``"raise"`` or ``"allow"``.
    scale_dtype : ``float16`` (default), ``bfloat16`` (the original's) or ``float32``.
    """

    channel_group_size: int | None = kf.spec(None, int, low=1, optional=True)
    residual_length: int = kf.spec(128, int, low=0)
    num_sink_tokens: int = kf.spec(1, int, low=0)
    init_bits: int = kf.spec(16, int, choices=WIDTHS)
    #: below 2 bits no width can hold budget_tokens tokens
    budget_bits: float | tuple[float, ...] | None = kf.spec(
        None, float, low=2, shape="one-or-list", optional=True
    )
    budget_bytes: float | tuple[float, ...] | None = kf.spec(
        None, float, low=0, low_open=True, shape="one-or-list", optional=True
    )
    budget_tokens: int = kf.spec(32768, int, low=1)
    budget_scope: str = kf.spec("codes", str, choices=("codes", "all"))
    on_overflow: str = kf.spec("raise", str, choices=("raise", "allow"))
    scale_dtype: str = kf.spec("float16", str, choices=tuple(sorted(PAIR_BITS)))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget_bits is not None and self.budget_bytes is not None:
            self.reject("budget_bytes", "None when budget_bits is set (set one of the two)")
        for name in ("budget_bits", "budget_bytes"):  # per-layer lists are stored as tuples
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def bits_budget(self) -> float | tuple[float, ...] | None:
        """``budget_bits``, or its default 2.0 when neither budget is set."""
        return 2.0 if self.budget_bits is None and self.budget_bytes is None else self.budget_bits

    def channel_group(self, head_dim: int) -> int:
        """Channels per group; ``ValueError`` unless it divides ``head_dim``."""
        cg = self.channel_group_size or min(128, head_dim)
        if head_dim % cg:
            raise ValueError(f"channel_group_size={cg} does not divide head_dim={head_dim}")
        return cg

    def layer_budget(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> float:
        """Layer ``layer_idx``'s budget in bytes per sequence; ``ValueError`` past a list's end."""
        value = self.bits_budget if self.budget_bytes is None else self.budget_bytes
        if isinstance(value, tuple):
            if layer_idx >= len(value):
                raise ValueError(
                    f"per-layer budget has {len(value)} entries, none for layer {layer_idx}"
                )
            value = value[layer_idx]
        if self.budget_bytes is not None:
            return value
        return value / 8 * 2 * num_kv_heads * head_dim * self.budget_tokens


class PMKVQ(Method):
    """Progressive per-token K/V codes (16 -> 8 -> 4 -> 2) under a per-layer memory budget."""

    Config = PMKVQConfig
    description = "PM-KVQ: progressive 16->8->4->2-bit per-token K/V under a per-layer budget"
    source = (
        "Liu et al., arXiv 2505.18610 (ICLR'26), thu-nics/PM-KVQ c8a2bff; docs/methods.md#pm-kvq"
    )
    capabilities = Capabilities()  # all [SRC]; the choices are documented above

    def key_codec(self, layer_idx: int, head_dim: int) -> ProgressiveCodec:
        """The per-token progressive codec (values use the same; both shrink together)."""
        c = self.config
        sd = resolve_scale_dtype(c.scale_dtype)
        return ProgressiveCodec(c.init_bits, c.init_bits, c.channel_group(head_dim), sd)

    value_codec = key_codec

    def value_schedule(self) -> BlockSchedule:
        """Values flush with the keys, in blocks of ``residual_length`` tokens."""
        return self.key_schedule()

    def new_layer(
        self,
        layer_idx: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> ProgressiveLayerCache:
        c = self.config
        budget = c.layer_budget(layer_idx, num_kv_heads, head_dim)
        layer = self.layer_cache(
            layer_idx, num_kv_heads, head_dim, ProgressiveLayerCache, config=c, budget=budget
        )
        if c.budget_bytes is None:  # a budget_bits row: the width it names
            widths = self.final_bits()
            layer.named_bits = widths[layer_idx] if isinstance(c.bits_budget, tuple) else widths[0]
        return layer

    def final_bits(self) -> list[int]:
        """Width per ``budget_bits`` entry once ``budget_tokens`` tokens are held (sinks and window
        ignored); ``ValueError`` with ``budget_bytes`` (its width depends on H_kv)."""
        c = self.config
        if c.bits_budget is None:
            raise ValueError("nominal bits need budget_bits; a budget_bytes width depends on H_kv")
        budgets = c.bits_budget if isinstance(c.bits_budget, tuple) else (c.bits_budget,)
        chain = [w for w in WIDTHS if w <= c.init_bits]
        return [next((w for w in chain if w <= b), MIN_BITS) for b in budgets]

    def token_limit(self) -> tuple[str, object, int] | None:
        """``("budget_tokens", budget_tokens, T)``: the longest run T (tokens per sequence) in
        which every layer keeps the width b its ``budget_bits`` B names (:meth:`final_bits`)
        within its budget; past it the run raises (:class:`BudgetTooShort`, or
        ``MemoryError`` at 2 bits).  At a budget check (after a step's flush) the layer holds
        b-bit codes for T - w - N_s tokens and the window (w <= R - 1: flushed whole when
        full) and sinks at 16 bits per element, b T + (16 - b)(w + N_s) <= B x budget_tokens,
        so T = floor((B x budget_tokens - (16 - b)(R - 1 + N_s)) / b) holds at every window
        fill (the module docstring's rule, with R + N_s, is the same bound a token short);
        the smallest over a per-layer list.  ``None`` where no run fails on it or its length
        depends on the model's shape: ``on_overflow="allow"``, ``budget_bytes``,
        ``budget_scope="all"`` (scales count too)."""
        c = self.config
        if c.on_overflow != "raise" or c.budget_bytes is not None or c.budget_scope != "codes":
            return None
        budgets = c.bits_budget if isinstance(c.bits_budget, tuple) else (c.bits_budget,)
        kept = max(c.residual_length - 1, 0) + c.num_sink_tokens
        most = min(
            math.floor((budget * c.budget_tokens - (16 - width) * kept) / width)
            for budget, width in zip(budgets, self.final_bits())
        )
        return "budget_tokens", c.budget_tokens, most

    def key_layout(self, head_dim: int) -> BlockLayout:
        """Per-token (scale, zero) groups of ``value_group_size`` channels; the codes' widths
        are :meth:`final_bits`, each budget's layers holding an equal share of the tokens."""
        c = self.config
        widths = self.final_bits()
        share = 1.0 / len(widths)
        classes = tuple(CodeClass(w, head_dim, share if len(widths) > 1 else 1.0) for w in widths)
        terms = GroupTerms(("scale", "zero"), c.scale_dtype, 1, c.channel_group(head_dim))
        return BlockLayout(Codes(head_dim, classes), terms)

    value_layout = key_layout


# ---------------------------------------------------------------- calibration


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
