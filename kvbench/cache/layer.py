"""``LayerCache``: one attention layer's quantized KV cache, method-agnostic.

Layout ``[B, H_kv, T, D]`` (KV heads, never repeated).  Each side (keys, values) stores, in
token order: ``num_sink_tokens`` full-precision sinks, quantized blocks made by the side's
codec, and a full-precision residual whose size the side's flush schedule controls.

Protocol (docs/design.md#protocols): prefill attention uses the full-precision prompt (the
caller has it).  At a decode step :meth:`LayerCache.append` only stores (the new tokens join
the residual) and the flush it makes due waits for :meth:`LayerCache.end_step` (idempotent;
the next ``append`` runs it too); the caller orders the two with the step's attention over
sinks + quantized + residual.  Under ``write-then-attend``, the default of every workload that
decodes through the model (:data:`kvbench.hf.cache.WRITE_THEN_ATTEND`), ``end_step`` runs
right after ``append``, so the step's queries read their own tokens as stored; under
``in-chunk-full`` (:data:`kvbench.hf.cache.IN_CHUNK_FULL`) it runs after the attention, so the
step reads its new tokens in full precision.

Attention (:meth:`LayerCache.attend`) is computed by :func:`kvbench.attention.dispatch.attend`,
called directly; the dispatch reads the cache through its public attributes and never imports
this module, so there is no import cycle.  ``reads_transformed`` (on the cache or a
:class:`Side`) and ``observes_attention`` are the flags of docs/design.md#layer-cache.

Rotation (docs/design.md#rotation, :mod:`kvbench.cache.rotation`): a layer whose ``rotation`` is
set rotates what it stores and the prefill queries; :meth:`LayerCache.attend` rotates the query
and the output back, and :meth:`LayerCache.keys_values` returns the stored (rotated) space while
:meth:`LayerCache.attend` runs, else keys and values rotated back.

Growth: a full-precision residual of :data:`GROW_TOKENS` tokens or more (``full``'s whole cache)
and a quantized :class:`~kvbench.cache.blocks.AffineBlock` as long grow in place into
allocations with room (:meth:`Side.add_residual`, :meth:`Side.add_block`; one rule,
:func:`grown_capacity`; as a deployed engine preallocates), so a decode step copies its new
tokens only, not the whole cache; ``nbytes()`` counts the tokens held,
:meth:`LayerCache.spare_bytes` the room (docs/design.md#memory).

Padded batches: ``prefill(..., lengths=...)`` (left padding) turns the layer into a container of
one single-row cache per sequence (:mod:`kvbench.cache.ragged`, docs/design.md#padding).  Every
public operation then dispatches to those rows, also the overrides of a subclass
(``__init_subclass__`` wraps them; the base class's own operations check for rows explicitly).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

import torch

from kvbench.attention import dispatch
from kvbench.cache import finite, ragged
from kvbench.cache.blocks import AffineBlock, Block, Codec, cat_blocks, own_storage, tensor_bytes
from kvbench.cache.rotation import ChannelRotation
from kvbench.cache.schedule import NeverSchedule

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BYTE_KEYS = ("codes", "scales", "metadata", "residual", "sinks")


def _cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or a.shape[2] == 0:
        return b
    if b is None or b.shape[2] == 0:
        return a
    return torch.cat([a, b], dim=2)


def _len(t: torch.Tensor | Block | None) -> int:
    if t is None:
        return 0
    return t.ntokens if not isinstance(t, torch.Tensor) else t.shape[2]


#: a full-precision residual that holds at least this many tokens after an append grows in
#: place (:meth:`Side.add_residual`): its allocation has room for later tokens, in multiples of
#: this many tokens; a shorter one is concatenated to its exact size as before
GROW_TOKENS = 256
#: a regrowth leaves room for at least ``1 / GROW_DIVISOR`` of the tokens then held (geometric
#: growth: a token is copied O(1) times on average, a step costs O(new tokens) amortised)
GROW_DIVISOR = 4


def grown_capacity(tokens: int) -> int:
    """Tokens a residual (or a quantized block, :meth:`Side.add_block`) regrown to hold
    ``tokens`` tokens is allocated for: ``tokens + tokens // GROW_DIVISOR`` rounded up to a
    multiple of :data:`GROW_TOKENS` (int, >= ``tokens``)."""
    want = tokens + tokens // GROW_DIVISOR
    return -(-want // GROW_TOKENS) * GROW_TOKENS


def _grow_parts(
    old: Block | None, new: Block, token_group: int
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The ``(held, new)`` tensor pairs :meth:`Side.add_block` writes into rooms when ``new``
    joins ``old`` -- codes ``[B, H_kv, n, nbytes]``, then scale (and zero) ``[B|1, H_kv|1, NG,
    Dg]``, each growing along dim 2 -- or ``None`` where it concatenates as before: either is
    not exactly an :class:`AffineBlock`, the codec's token groups are not ``token_group >= 1``
    tokens each in both, or the two differ in anything but their tokens (settings, dtypes,
    devices, the other dims)."""
    if type(old) is not AffineBlock or type(new) is not AffineBlock or token_group < 1:
        return None
    if (old.bits, old.head_dim, old.symmetric, old.midpoint, old.batch_shared) != (
        new.bits, new.head_dim, new.symmetric, new.midpoint, new.batch_shared
    ) or (old.zero is None) != (new.zero is None):  # fmt: skip
        return None
    pairs = [(old.codes, new.codes), (old.scale, new.scale)]
    if old.zero is not None:
        pairs.append((old.zero, new.zero))
    for a, b in pairs:
        if (
            a.dim() != 4
            or b.dim() != 4
            or (a.dtype, a.device, a.shape[:2], a.shape[3])
            != (b.dtype, b.device, b.shape[:2], b.shape[3])
            or a.requires_grad
            or b.requires_grad
        ):
            return None
    if any(g != token_group for g in new.group_len):
        return None
    return pairs


@dataclass
class Room:
    """The allocation a residual was last grown into (:meth:`Side.add_residual`): the address
    of its storage, the tokens written into it so far and its capacity (tokens).  Only tokens
    past ``filled`` are ever written, so no tensor handed out before (a residual of ``filled``
    tokens or fewer) sees a later append; ``filled`` is updated in place, so two holders of one
    room (a shallow copy of a side) cannot both write the same token slot: the second regrows."""

    ptr: int
    filled: int
    capacity: int

    def holds(self, part: torch.Tensor) -> bool:
        """``part`` (``[B, H_kv, n, D]``) is the first ``filled`` tokens of this allocation, as
        :meth:`Side.add_residual` left it, and may be written past its end here (not an
        inference tensor outside inference mode, no autograd)."""
        b, h, n, d = part.shape
        return (
            n == self.filled
            and part.storage_offset() == 0
            and part.stride() == (h * self.capacity * d, self.capacity * d, d, 1)
            and part.untyped_storage().data_ptr() == self.ptr
            and not part.requires_grad
            and (not part.is_inference() or torch.is_inference_mode_enabled())
        )


#: public operations that a padded layer (one cache per row) dispatches to
#: :mod:`kvbench.cache.ragged`: name -> the ragged function that runs them on the rows
ROW_DISPATCH: dict[str, Callable[..., object]] = {
    "provide_queries": ragged.provide_queries,
    "append": ragged.append,
    "end_step": ragged.end_step,
    "keys_values": ragged.keys_values,
    "attend": ragged.attend,
    "crop": ragged.crop,
    "index_batch": ragged.index_batch,
    "quantized_tokens": ragged.quantized_tokens,
    "tensors": ragged.tensors,
}

#: the wrappers made by :func:`_row_dispatch` and :func:`_padded_prefill`
_ROW_WRAPPERS: weakref.WeakSet[Callable[..., object]] = weakref.WeakSet()


def _dispatches(fn: Callable[..., object]) -> bool:
    """Whether ``fn`` is such a wrapper, or wraps one (``functools.wraps``'s ``__wrapped__``)."""
    return inspect.unwrap(fn, stop=_ROW_WRAPPERS.__contains__) in _ROW_WRAPPERS


def _row_dispatch(fn: Callable[..., object], alt: Callable[..., object]) -> Callable[..., object]:
    """Run ``fn``, or its :mod:`kvbench.cache.ragged` counterpart ``alt`` once the layer holds
    rows."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self.__dict__.get("_rows") is not None:
            return alt(self, *args, **kwargs)
        return fn(self, *args, **kwargs)

    _ROW_WRAPPERS.add(wrapper)
    return wrapper


def _padded_prefill(fn: Callable[..., None]) -> Callable[..., None]:
    """``prefill(keys, values, queries=None, lengths=None)``: with ``lengths`` the padded path."""

    @functools.wraps(fn)
    def wrapper(self, keys, values, queries=None, lengths=None):
        if lengths is None:
            return fn(self, keys, values, queries)
        return _prefill_rows(self, keys, values, queries, lengths)

    _ROW_WRAPPERS.add(wrapper)
    return wrapper


def _prefill_rows(
    layer: LayerCache,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    lengths: torch.Tensor,
) -> None:
    """The padded prefill: checks, then one row cache per sequence (:func:`ragged.prefill`)."""
    layer._check(keys, values)
    if layer.seq_length:
        raise ValueError("prefill() needs an empty cache; use append() for later tokens")
    n = ragged.check_lengths(lengths, keys.shape[0], keys.shape[2])
    ragged.prefill(layer, keys, values, queries, n)


class Evictor(Protocol):
    """What a layer cache asks when it holds an evictor (``LayerCache.evictor``,
    docs/design.md#eviction): which held tokens to drop.

    A decision is int64 ``drop [B, H_kv, n]``: indices into the tokens held (sinks, quantized,
    residual, in the order they were seen), the same ``n`` in every row and KV head, the indices
    free to differ between heads; :meth:`LayerCache.evict` applies it.  ``None``: drop nothing.
    Implementations: :mod:`kvbench.cache.eviction`."""

    #: the prefill decision needs the prompt's post-RoPE queries (the layer waits for them)
    needs_queries: bool
    #: :meth:`at_step` may drop tokens (a fixed budget while decoding)
    evicts_at_decode: bool
    #: the evictor scores by the attention decode steps read (:meth:`observe`)
    observes_attention: bool

    def check_prompt(self, tokens: int) -> None:
        """Raise ``ValueError`` naming the config field when a prompt of ``tokens`` tokens
        cannot meet the budget (before anything is stored)."""
        ...

    def at_prefill(
        self, layer: LayerCache, keys: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The prompt's drop decision from its held keys ``[B, H_kv, P, D]`` (stored space)
        and post-RoPE queries ``[B, H_q, P, D]`` (``None`` unless :attr:`needs_queries`)."""
        ...

    def at_step(self, layer: LayerCache) -> torch.Tensor | None:
        """A decode step's drop decision, once its tokens are held (``end_step``)."""
        ...

    def decode_room(self, layer: LayerCache) -> int | None:
        """Tokens ``layer`` can still take (appended, then :meth:`at_step`) before a decode
        step drops one: an int >= 0, or ``None`` when :meth:`at_step` drops none (no decode
        budget, or none set yet)."""
        ...

    def observe(self, layer: LayerCache, probs: torch.Tensor, lengths: torch.Tensor | None) -> None:
        """A decode step's float32 softmax ``[B, H_q, n_q, T]`` over the held tokens (only
        called when :attr:`observes_attention`)."""
        ...

    def reset(self) -> None:
        """Forget per-sequence state (the layer was emptied)."""
        ...


@dataclass
class Side:
    """State of one side (keys or values) of a layer cache.

    ``reads_transformed``: ``None`` when :meth:`read` returns exactly sinks + dequantized
    blocks + residual; a subclass that transforms what is read sets a reason string."""

    reads_transformed: ClassVar[str | None] = None
    codec: Codec | None
    schedule: object
    sinks: torch.Tensor | None = None
    block: Block | None = None
    residual: torch.Tensor | None = None
    #: the dtype a flush hands the codec when the residual is stored in another one (the
    #: layer's ``storage_dtype``); ``None``: the residual as stored
    compute_dtype: torch.dtype | None = None
    #: the allocation the residual was last grown into (:meth:`add_residual`), or ``None``
    room: Room | None = field(default=None, init=False, repr=False, compare=False)
    #: the allocations the quantized block's codes, scale (and zero) were last grown into
    #: (:meth:`add_block`), or ``None``
    block_rooms: tuple[Room, ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __len__(self) -> int:
        return _len(self.sinks) + _len(self.block) + _len(self.residual)

    def add_residual(self, x: torch.Tensor) -> None:
        """Append full-precision tokens ``x`` ``[B, H_kv, k, D]`` (in the stored dtype) after
        the residual.

        A residual that holds at least :data:`GROW_TOKENS` tokens afterwards lives in an
        allocation with room (:func:`grown_capacity`): the tokens are copied into the room and
        the residual becomes a view of the first tokens of the allocation, so a step copies
        O(k) bytes instead of the whole residual (a regrowth, when the room is used up, copies
        it once into a larger allocation).  A shorter residual is concatenated to its exact
        size.  The values are those of ``torch.cat`` either way; :meth:`tensors` (and so
        ``nbytes()``) count the tokens held, :meth:`spare_tokens` the room behind them
        (docs/design.md#memory)."""
        res, k = self.residual, x.shape[2]
        n = _len(res)
        room = self.room
        if (
            k
            and res is not None
            and room is not None
            and n + k <= room.capacity
            and room.holds(res)
        ):
            grown = res.as_strided((*res.shape[:2], n + k, res.shape[3]), res.stride(), 0)
            grown[:, :, n:].copy_(x)
            self.residual, room.filled = grown, n + k
            return
        if k and n + k >= GROW_TOKENS and not x.requires_grad:
            b, h, _, d = x.shape
            cap = grown_capacity(n + k)
            buf = x.new_empty(b, h, cap, d)
            if n:
                buf[:, :, :n].copy_(res)
            buf[:, :, n : n + k].copy_(x)
            self.residual = buf[:, :, : n + k]
            self.room = Room(buf.untyped_storage().data_ptr(), n + k, cap)
            return
        self.residual = own_storage(_cat(res, x))
        self.room = None

    def spare_tokens(self) -> int:
        """Tokens of room behind the residual (allocated for later appends, not held; 0 when
        the residual owns exactly its tokens): :meth:`add_residual`."""
        res, room = self.residual, self.room
        if res is None or room is None or not room.holds(res):
            return 0
        return room.capacity - room.filled

    def add_block(self, new: Block) -> None:
        """Append the quantized tokens ``new`` (the codec's block of the oldest residual
        tokens) after :attr:`block`.

        An :class:`AffineBlock` whose token groups are the codec's ``token_group`` (>= 1) tokens
        each and that holds at least :data:`GROW_TOKENS` tokens afterwards grows in place, by
        the residual's rule (:meth:`add_residual`): its codes, scale and zero are views of the
        first tokens (token groups) of allocations with room, the new ones are copied into the
        room, and when the room is used up all are regrown to :func:`grown_capacity` of the
        tokens held, rounded up to whole token groups (the codes hold ``token_group`` tokens
        per scale row).  Any other block is concatenated (``cat``) as before.  The values are
        those of ``cat`` either way; :meth:`tensors` (and so ``nbytes()``) count the tokens
        held, :meth:`spare_block_bytes` the room (docs/design.md#memory)."""
        old, rooms = self.block, self.block_rooms
        tg = 0 if self.codec is None else self.codec.token_group
        pairs = None if old is None or not new.ntokens else _grow_parts(old, new, tg)
        if pairs is None:
            self.block, self.block_rooms = cat_blocks(old, new), None
            return
        n, k = old.ntokens, new.ntokens
        if (
            rooms is not None
            and len(rooms) == len(pairs)
            and all(
                r.holds(a) and a.shape[2] + b.shape[2] <= r.capacity
                for r, (a, b) in zip(rooms, pairs, strict=True)
            )
        ):
            grown = []
            for r, (a, b) in zip(rooms, pairs, strict=True):
                m = a.shape[2]
                t = a.as_strided((*a.shape[:2], m + b.shape[2], a.shape[3]), a.stride(), 0)
                t[:, :, m:].copy_(b)
                r.filled = m + b.shape[2]
                grown.append(t)
        elif n + k >= GROW_TOKENS and all(g == tg for g in old.group_len):
            groups = -(-grown_capacity(n + k) // tg)  # token groups of room, rounded up
            grown, made = [], []
            for i, (a, b) in enumerate(pairs):
                cap = groups * tg if i == 0 else groups  # codes in tokens, terms in groups
                m, j = a.shape[2], b.shape[2]
                buf = a.new_empty(a.shape[0], a.shape[1], cap, a.shape[3])
                buf[:, :, :m].copy_(a)
                buf[:, :, m : m + j].copy_(b)
                grown.append(buf[:, :, : m + j])
                made.append(Room(buf.untyped_storage().data_ptr(), m + j, cap))
            rooms = tuple(made)
        else:
            self.block, self.block_rooms = cat_blocks(old, new), None
            return
        self.block = replace(
            old,
            codes=grown[0],
            scale=grown[1],
            zero=grown[2] if len(grown) > 2 else None,
            group_len=[*old.group_len, *new.group_len],
        )
        self.block_rooms = rooms

    def spare_block_bytes(self) -> int:
        """Bytes allocated behind the quantized block's codes, scale and zero for tokens not yet
        flushed (the room :meth:`add_block` grows into; 0 when they own exactly what they
        hold)."""
        blk, rooms = self.block, self.block_rooms
        if type(blk) is not AffineBlock or rooms is None:
            return 0
        parts = [blk.codes, blk.scale] + ([] if blk.zero is None else [blk.zero])
        out = 0
        for r, t in zip(rooms, parts, strict=False):
            if r.holds(t):
                b, h, _, d = t.shape
                out += (r.capacity - r.filled) * b * h * d * t.element_size()
        return out

    def flush(self, n: int) -> None:
        """Quantize the oldest ``n`` residual tokens into the side's blocks."""
        if n <= 0 or self.codec is None:
            return
        tg = self.codec.token_group
        if tg > 1 and n % tg:
            raise RuntimeError(f"schedule asked to flush {n} tokens, not a multiple of {tg}")
        head, self.residual = self.residual[:, :, :n], own_storage(self.residual[:, :, n:])
        if self.compute_dtype is not None:  # a float16-stored residual is encoded as computed
            head = head.to(self.compute_dtype)
        self.add_block(self.codec.encode(head))
        if self.residual.shape[2] == 0:
            self.residual = None

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        parts = [
            self.sinks,
            None if self.block is None else self.block.dequantize(dtype),
            self.residual,
        ]
        parts = [p.to(dtype) for p in parts if p is not None and p.shape[2] > 0]
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def plan_keep(self, mask: torch.Tensor) -> list[tuple[str, torch.Tensor | None]]:
        """What keeping the held tokens where ``mask`` (bool ``[B, H_kv, T]``, T tokens held)
        is True takes, part by part: ``(part, keep)`` with int64 ``keep [B, H_kv, K]``
        (ascending per row and head) or ``None`` (the part is emptied); parts that keep every
        token are left out.  Nothing changes; :meth:`keep` applies the plan.

        Each part (sinks, quantized block, residual) must keep the same number of tokens in
        every row and head (the indices may differ).  Raises ``ValueError`` naming the part
        otherwise, ``TypeError`` when a quantized block that loses tokens has no ``gather``."""
        plan: list[tuple[str, torch.Tensor | None]] = []
        start = 0
        for name in ("sinks", "block", "residual"):
            part = getattr(self, name)
            n = _len(part)
            m = mask[:, :, start : start + n]
            start += n
            if not n or bool(m.all()):
                continue
            counts = m.sum(-1)
            k = int(counts.flatten()[0])
            if bool((counts != k).any()):
                raise ValueError(
                    f"an eviction keeps {int(counts.min())}..{int(counts.max())} of the {n} "
                    f"{name} tokens across rows and heads; each part must keep the same number "
                    "in every row and head (kvbench.cache.eviction.choose_drop plans that)"
                )
            if name == "block" and k and getattr(part, "gather", None) is None:
                raise TypeError(
                    f"{type(part).__name__} has no gather(keep): its quantized tokens cannot be "
                    "evicted (docs/design.md#eviction)"
                )
            b, h = m.shape[:2]
            plan.append((name, m.nonzero()[:, 2].reshape(b, h, k) if k else None))
        return plan

    def keep(self, plan: list[tuple[str, torch.Tensor | None]]) -> None:
        """Apply a :meth:`plan_keep` plan: each part keeps its tokens ``keep``, quantized ones
        through ``Block.gather`` (their stored form unchanged)."""
        for name, idx in plan:
            part = getattr(self, name)
            if idx is None:
                setattr(self, name, None)
            elif name == "block":
                self.block = part.gather(idx)
            else:
                b, h, k = idx.shape
                idx = idx.to(part.device)[..., None].expand(b, h, k, part.shape[3])
                setattr(self, name, torch.gather(part, 2, idx))

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [] if self.block is None else list(self.block.tensors())
        if self.sinks is not None:
            out.append(("sinks", self.sinks))
        if self.residual is not None:
            out.append(("residual", self.residual))
        return out


def _side_steady_appends(side: Side, num_sink_tokens: int, limit: int, views: bool = False) -> int:
    """:meth:`LayerCache.steady_appends` of one side: simulate its schedule's ``flush_count``
    over one-token steps (the first may flush anything; a later one nothing, or only its own
    token when the codec codes tokens independently, ``token_group == 1``; with ``views`` such
    a codec may flush any of its oldest tokens at a later step, which :meth:`LayerCache.
    append_viewed` hands the call's earlier queries in full precision) and check that one call
    of all the steps' tokens flushes what they flushed in all."""
    if side.codec is None:
        return limit  # never quantized: nothing held changes
    room = max(num_sink_tokens - _len(side.sinks), 0)  # free sink slots (full precision)
    r0 = _len(side.residual)
    r, flushed, added = r0, 0, 0
    own_ok = side.codec.token_group == 1
    for step in range(limit + 1):
        own = not room  # the step's token joins the residual (else a sink slot)
        if room:
            room -= 1
        else:
            r, added = r + 1, added + 1
        f = side.schedule.flush_count(r)
        if step and f and not (own_ok and (views or (own and f == 1 and r == 1))):
            return step - 1
        r, flushed = r - f, flushed + f
        if side.schedule.flush_count(r0 + added) != flushed:  # one call of the steps' tokens
            return max(step - 1, 0)
    return limit


class LayerCache:
    """One layer's cache; see the module docstring for the protocol.

    Parameters
    ----------
    key_codec, value_codec : codecs for each side, or ``None`` to keep that side in full
        precision (``value_bits=16``, the ``full`` baseline).
    key_schedule, value_schedule : flush schedules (:mod:`kvbench.cache.schedule`).
    num_sink_tokens : the first N_s tokens of each sequence stay full precision.  Sinks fill
        from the first tokens that arrive, so a prompt shorter than N_s leaves the rest of the
        sink slots to the first decode tokens.
    needs_queries : the key codec selects with post-RoPE queries at prefill (PN-Mix); a prefill
        without queries stays pending until :meth:`provide_queries`.
    num_kv_heads, head_dim : when given (``Method.new_layer`` does), K/V must have
        ``H_kv == num_kv_heads`` and ``D == head_dim``, so a wrong layout (e.g. ``[B, T, H, D]``)
        raises ``ValueError`` instead of being stored.

    Attribute ``rotation``: a :class:`~kvbench.cache.rotation.ChannelRotation` or ``None``
    (set by ``Method.new_layer`` before any token; see the module docstring).

    Attribute ``storage_dtype``: ``None`` (the full-precision parts, sinks and residual, are
    stored in the compute dtype, that of the first tokens) or ``torch.float16`` /
    ``torch.bfloat16`` (set by ``Method.new_layer`` from the config's ``storage_dtype``
    before any token): sinks and residual are stored in it and read back in the compute dtype
    (:meth:`keys_values`, :meth:`attend`; a flush encodes them in the compute dtype), so
    :meth:`nbytes` counts them at its width (docs/design.md#storage-dtype).
    """

    #: ``None``: attention reads the stored parts; else why it does not (see module docstring)
    reads_transformed: ClassVar[str | None] = None
    #: the layer's decode updates are the base class's: :meth:`append` stores, :meth:`end_step`
    #: flushes what the side schedules' ``flush_count`` says, and a side's ``flush(n)`` codes
    #: its oldest ``n`` residual tokens from those tokens (and their positions) alone, so
    #: :meth:`steady_appends` follows from the schedules.  A subclass whose updates change held
    #: tokens in other ways too sets it ``False`` (one token per ``exact-chunked`` call: exact,
    #: slower), or overrides :meth:`steady_appends` to also stop before its own changes (PM-KVQ's
    #: budget halvings).  tests/test_exact_chunked.py checks that every registered method whose
    #: layer overrides ``append`` or ``end_step`` does one of the two.
    steady_updates: ClassVar[bool] = True
    #: the caller attends each multi-token decode call with :meth:`attend_views` over what
    #: :meth:`append_viewed` returned (``exact-chunked`` on the attend route, set by
    #: :class:`kvbench.hf.cache.QuantizedKVCache` before any token): :meth:`steady_appends` then
    #: lets a side whose codec codes tokens independently (``token_group == 1``) flush its
    #: oldest tokens at any step of a call, not only at the first (a sliding window).  Only
    #: effective on a class with the base class's updates (:meth:`base_updates`).
    step_views: bool = False
    #: the model layer this cache serves (set by ``Method.new_layer``, for messages); ``None``
    #: for a cache built directly
    layer_idx: int | None = None
    #: the backend path of the last :meth:`attend` (``"triton"``, ``"cpu-native"``,
    #: ``"reference"``, ...; :mod:`kvbench.attention.dispatch`); ``None`` before any
    attend_path: str | None = None
    #: why the faster backends declined or failed at the last :meth:`attend` (``""``: none did)
    attend_path_reason: str = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name, alt in ROW_DISPATCH.items():  # a subclass's overrides dispatch to the rows too
            fn = cls.__dict__.get(name)
            if callable(fn) and not _dispatches(fn):
                setattr(cls, name, _row_dispatch(fn, alt))
        fn = cls.__dict__.get("prefill")
        if callable(fn) and not _dispatches(fn):
            cls.prefill = _padded_prefill(fn)

    def __init__(
        self,
        key_codec: Codec | None,
        value_codec: Codec | None,
        key_schedule: object | None = None,
        value_schedule: object | None = None,
        num_sink_tokens: int = 0,
        needs_queries: bool = False,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
    ) -> None:
        self.k = Side(key_codec, key_schedule or NeverSchedule())
        self.v = Side(value_codec, value_schedule or NeverSchedule())
        self.num_sink_tokens = num_sink_tokens
        self.needs_queries = needs_queries
        self._pending = False
        self._awaiting_queries = False
        self.dtype: torch.dtype | None = None
        self._bhd: tuple[int, int, int] | None = None
        self._hd = (num_kv_heads, head_dim)
        self._rows: list[LayerCache] | None = None  # a padded batch: one cache per row
        self._pads: list[int] = []
        self.rotation: ChannelRotation | None = None
        self.storage_dtype: torch.dtype | None = None
        self._attending = False  # inside attend(): keys_values() reads the stored space
        #: the token evictor (:class:`Evictor`, set by an eviction method before any token), or
        #: ``None``: every token seen stays held
        self.evictor: Evictor | None = None
        self._evicted = 0  # tokens dropped so far (the same in every row and head)

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (full-precision tokens in the compute dtype) in the dtype the cache stores
        them in: ``x`` itself without a ``storage_dtype``."""
        if self.storage_dtype is None:
            return x
        self.k.compute_dtype = self.v.compute_dtype = self.dtype
        return x.to(self.storage_dtype)

    def _rot(self, x: torch.Tensor | None, side: str, back: bool = False) -> torch.Tensor | None:
        """``x`` rotated into (``back``: out of) the stored space by ``self.rotation``."""
        if self.rotation is None or x is None:
            return x
        return self.rotation.back(x, side) if back else self.rotation.forward(x, side)

    # ---------------------------------------------------------------- inputs
    def _check(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.dim() != 4 or values.dim() != 4:
            raise ValueError(
                f"keys and values must be [B, H_kv, T, D]; got shapes {tuple(keys.shape)} "
                f"and {tuple(values.shape)}"
            )
        if keys.shape != values.shape:
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must have one shape"
            )
        if keys.dtype not in CACHE_DTYPES or values.dtype != keys.dtype:
            raise ValueError(
                f"dtype {keys.dtype}/{values.dtype} is not supported; allowed: one of "
                f"{[str(d) for d in CACHE_DTYPES]} for both keys and values"
            )
        h, d = self._hd
        if (h is not None and keys.shape[1] != h) or (d is not None and keys.shape[3] != d):
            raise ValueError(
                f"keys/values {tuple(keys.shape)} are not laid out [B, H_kv, T, D] with "
                f"H_kv={h} and D={d} (this layer's num_kv_heads and head_dim)"
            )
        bhd = (keys.shape[0], keys.shape[1], keys.shape[3])
        if self._bhd is not None and bhd != self._bhd:
            raise ValueError(
                f"new tokens {tuple(keys.shape)} do not match the cache's [B, H_kv, *, D] = "
                f"{(self._bhd[0], self._bhd[1], '*', self._bhd[2])}"
            )
        self._bhd = bhd

    def _take_sinks(self, keys: torch.Tensor, values: torch.Tensor):
        room = self.num_sink_tokens - _len(self.k.sinks)
        if room <= 0:
            return keys, values
        n = min(room, keys.shape[2])
        self.k.sinks = own_storage(_cat(self.k.sinks, self._store(keys[:, :, :n])))
        self.v.sinks = own_storage(_cat(self.v.sinks, self._store(values[:, :, :n])))
        return keys[:, :, n:], values[:, :, n:]

    # ---------------------------------------------------------------- operations
    def prefill(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> None:
        """Store the prompt ``[B, H_kv, P, D]`` and quantize what the schedules say.

        ``queries``: post-RoPE ``[B, H_q, P, D]``, needed by methods with ``needs_queries``.
        ``lengths``: optional int ``[B]`` for a left-padded batch: row ``b``'s real tokens are
        its last ``lengths[b]`` positions; the pads are dropped and each row is cached alone
        (:mod:`kvbench.cache.ragged`, docs/design.md#padding), so its codes are those of the row
        run alone.  Later :meth:`append` tokens are real for every row.

        Raises
        ------
        ValueError
            On bad shapes/dtypes, a prefill into a non-empty cache, or ``lengths`` that are not
            ``B`` integers in ``[1, P]`` (the message names the row).
        """
        if lengths is not None:
            return _prefill_rows(self, keys, values, queries, lengths)
        self._check(keys, values)
        finite.check(keys, values, self, "prefill")  # NaN/Inf policy (kvbench.cache.finite)
        if self.seq_length:
            raise ValueError("prefill() needs an empty cache; use append() for later tokens")
        if self.evictor is not None:
            self.evictor.check_prompt(keys.shape[2])
        self.dtype = keys.dtype
        keys, values, queries = (
            self._rot(keys, "keys"),
            self._rot(values, "values"),
            self._rot(queries, "keys"),
        )
        k, v = self._take_sinks(keys, values)
        self.k.residual, self.v.residual = own_storage(self._store(k)), own_storage(self._store(v))
        if self.needs_queries and queries is None:
            self._awaiting_queries = True
            return
        self.finish_prefill(keys, queries)

    def provide_queries(self, queries: torch.Tensor) -> None:
        """Finish a prefill that was waiting for its post-RoPE queries ``[B, H_q, P, D]``."""
        if self._rows is not None:
            return ragged.provide_queries(self, queries)
        if not self._awaiting_queries:
            return
        keys = self.k.read(self.dtype)  # the stored (rotated) space
        self._awaiting_queries = False
        self.finish_prefill(keys, self._rot(queries, "keys"))

    def finish_prefill(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        """Hook run once the prefill keys ``[B, H_kv, P, D]`` (and post-RoPE queries, or
        ``None``) are in: prepares the codecs (channel selection) and flushes what the schedules
        quantize at prefill.  Subclasses that extend it call ``super().finish_prefill``.

        With an :attr:`evictor` the prompt's eviction runs first (:meth:`Evictor.at_prefill`),
        and the codecs are prepared on the keys still held."""
        if self.evictor is not None:
            drop = self.evictor.at_prefill(self, keys, queries)
            if drop is not None:
                self.evict(drop)
                keys = self.k.read(self.dtype)
        for side, x in ((self.k, keys), (self.v, None)):
            if side.codec is not None:
                if x is not None:
                    side.codec.prepare(x, queries)
                side.flush(side.schedule.prefill_count(_len(side.residual)))

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add decode tokens ``[B, H_kv, n, D]`` to the residual; the flush waits for
        :meth:`end_step` (before the step's attention under ``write-then-attend``, after it
        under ``in-chunk-full``: the module docstring)."""
        if self._rows is not None:
            return ragged.append(self, keys, values)
        if self._awaiting_queries:
            raise ValueError(
                "this method needs queries at prefill (capability needs_queries); call "
                "provide_queries() before appending decode tokens"
            )
        self._check(keys, values)
        finite.check(keys, values, self, "append")  # NaN/Inf policy (kvbench.cache.finite)
        if self.seq_length and keys.dtype != self.dtype:  # torch.cat would silently promote
            raise ValueError(
                f"new tokens are {keys.dtype} but the cache holds {self.dtype}; append tokens "
                "in the cache's dtype"
            )
        self.end_step()
        if self.dtype is None or not self.seq_length:
            self.dtype = keys.dtype
        k, v = self._take_sinks(self._rot(keys, "keys"), self._rot(values, "values"))
        self.k.add_residual(self._store(k))
        self.v.add_residual(self._store(v))
        self._pending = True

    def end_step(self) -> None:
        """Run the flush deferred by the last :meth:`append` (idempotent)."""
        if self._rows is not None:
            return ragged.end_step(self)
        if not self._pending:
            return
        self._pending = False
        if self.evictor is not None:  # a decode budget drops tokens before the flush
            drop = self.evictor.at_step(self)
            if drop is not None:
                self.evict(drop)
        for side in (self.k, self.v):
            side.flush(side.schedule.flush_count(_len(side.residual)))

    def steady_appends(self, limit: int) -> int:
        """How many further tokens can be appended, after the next one, without a change of the
        stored form of a token the layer already holds (``exact-chunked``,
        docs/design.md#protocols): an integer in ``[0, limit]`` (tokens; ``limit`` >= 0 caps
        the look-ahead).

        With the answer ``k``, appending the next ``j + 1 <= k + 1`` tokens in one call and
        then :meth:`end_step` leaves every stored tensor as appending them one at a time with
        :meth:`end_step` after each does (up to float rounding), and token ``i`` of the call,
        masked causally, reads what it would read after its own step: within those steps only
        the first flushes tokens held before it, later ones at most quantize their own new
        token (a codec with ``token_group == 1``: its tokens are coded independently).

        Derived from the state (residual length, free sink slots) and the side schedules'
        ``flush_count`` (:mod:`kvbench.cache.schedule`, e.g. KIVI's block of R keys: up to
        R - 1 after a flush; a sliding window of R > 0 values: 0, every step quantizes an older
        token), which assumes :attr:`steady_updates`: a class that clears it gets 0 (one token
        per call: exact, slower), as does a cache that :attr:`observes_attention` or still
        awaits its prefill queries.  An :attr:`evictor` with a decode budget caps it at
        :meth:`eviction_appends` (no step of the call but its first may drop a token: once the
        budget is full, one token per call).  A padded batch: the minimum over its rows."""
        if self._rows is not None:
            return min(row.steady_appends(limit) for row in self._rows)
        if (
            limit <= 0
            or not self.steady_updates
            or self.observes_attention
            or self._awaiting_queries
        ):
            return 0
        limit = self.eviction_appends(limit)
        views = self.viewable()
        for side in (self.k, self.v):  # each side looks no further than the other allows
            limit = _side_steady_appends(side, self.num_sink_tokens, limit, views)
        return limit

    def eviction_appends(self, limit: int) -> int:
        """How many further tokens can follow the next one in the same decode call before the
        layer's :attr:`evictor` drops a token (docs/design.md#eviction): an integer in
        ``[0, limit]`` (tokens); ``limit`` without a decode budget.

        A decode budget applies after every token, as one-token decode applies it, so query
        ``t`` of a call reads what the layer held after step ``t``.  A call that stays within
        the budget's room (:meth:`Evictor.decode_room`) drops nothing, and its queries read
        exactly that; once the budget is full every step drops a token, so calls take one
        token each (a longer one would drop tokens before its earlier queries attend, leaving
        them fewer than one-token decode shows them, or none).  Callers cut decode calls here
        under every protocol.  A padded batch: the minimum over its rows."""
        if self._rows is not None:
            return min(row.eviction_appends(limit) for row in self._rows)
        room = None if self.evictor is None else self.evictor.decode_room(self)
        if room is None or limit <= 0:
            return max(limit, 0)
        return max(min(limit, room - 1), 0)

    @classmethod
    def base_updates(cls) -> bool:
        """Whether ``cls`` decodes with the base class's :meth:`append`, :meth:`end_step` and
        :meth:`steady_appends` (no override), so that a call's flushes are those of the side
        schedules alone (what :meth:`append_viewed` replays)."""
        return all(
            getattr(cls, n) is getattr(LayerCache, n)
            for n in ("append", "end_step", "steady_appends")
        )

    def viewable(self) -> bool:
        """Whether :meth:`steady_appends` counts on :meth:`attend_views` (:attr:`step_views`
        set, the base class's updates, a single cache, no evictor and reads of the stored
        parts, so that the full-precision tokens a view restores are what one-token decode
        reads)."""
        return (
            self.step_views
            and self._rows is None
            and self.evictor is None
            and type(self).base_updates()
            and self.reads_transformed is None
            and self.k.reads_transformed is None
            and self.v.reads_transformed is None
        )

    def append_viewed(self, keys: torch.Tensor, values: torch.Tensor) -> dispatch.StepViews | None:
        """:meth:`append` the call's tokens ``[B, H_kv, n, D]`` and :meth:`end_step` at once,
        and return what its queries must read otherwise than the stored state
        (:class:`kvbench.attention.dispatch.StepViews`; ``None``: nothing, every query reads the
        stored state, as :meth:`attend` does).

        One-token decode of the same tokens runs ``n`` steps; the call's step ``t`` (its query
        ``t``) would read the oldest tokens that the side schedules flush at steps ``> t`` in
        full precision, as the residual held them.  The flush count of each step is replayed
        from the state before the call (free sink slots, residual length) with
        ``schedule.flush_count``, as :meth:`steady_appends` simulates it.  A token flushed at
        step 0, or at the step that appends it, is read quantized by every query that sees
        it.  ``RuntimeError`` when the flushes of the call differ from the replayed ones (the
        call was not cut at :meth:`steady_appends` with :attr:`step_views`)."""
        self.end_step()  # a flush deferred by an earlier call, before the state is read
        n = keys.shape[2]
        before = {}
        for name, side in (("keys", self.k), ("values", self.v)):
            room = max(self.num_sink_tokens - _len(side.sinks), 0)
            before[name] = (room, _len(side.residual), _len(side.block))
        self.append(keys, values)
        held = {
            name: None if side.codec is None or side.residual is None else side.residual.clone()
            for name, side in (("keys", self.k), ("values", self.v))
        }
        self.end_step()
        views: dict[str, dispatch.SideView | None] = {}
        for name, side in (("keys", self.k), ("values", self.v)):
            room, r0, nb = before[name]
            flushed = _len(side.block) - nb if side.codec is not None else 0
            views[name] = None
            if flushed <= 0:
                continue
            steps, appended, r = [], [], r0
            for t in range(n):
                if room:
                    room -= 1
                else:
                    r += 1
                    appended.append(t)
                f = side.schedule.flush_count(r)
                steps += [t] * f
                r -= f
            if len(steps) != flushed:
                raise RuntimeError(
                    f"append_viewed: this call of {n} tokens flushed {flushed} {name} tokens, "
                    f"its one-token steps {len(steps)}; cut calls at steady_appends()"
                )
            # step at which each flushed token joined: -1 before the call (residual order)
            joined = [-1] * r0 + appended
            seen = [t if t > max(j, 0) else 0 for t, j in zip(steps, joined)]
            if max(seen) == 0:
                continue
            views[name] = dispatch.SideView(
                start=_len(side.sinks) + nb,
                full=held[name][:, :, :flushed],
                steps=torch.tensor(seen, dtype=torch.long),
            )
        if views["keys"] is None and views["values"] is None:
            return None
        return dispatch.StepViews(views["keys"], views["values"])

    def keys_values(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values ``[B, H_kv, T, D]`` (sinks, quantized, residual), rotated
        back when the layer rotates (inside :meth:`attend`: the stored space)."""
        if self._rows is not None:
            return ragged.keys_values(self, dtype)
        if not self.seq_length:
            raise ValueError("the cache is empty")
        dt = dtype or self.dtype
        k, v = self.k.read(dt), self.v.read(dt)
        if self._attending:
            return k, v
        return self._rot(k, "keys", back=True), self._rot(v, "values", back=True)

    def attend(
        self,
        query: torch.Tensor,
        scaling: float | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the newest ``n_q`` positions: ``query [B, H_q, n_q, D]`` ->
        ``[B, H_q, n_q, D]`` in the query's dtype (float32 logits and softmax; GQA: query head
        ``h`` reads KV head ``h // (H_q / H_kv)``; causal mask aligned to the end).

        ``lengths``: optional int ``[B]``, valid cached tokens per row (see
        :func:`kvbench.attention.dispatch.attend`).  A thin wrapper of the backend registry
        (:mod:`kvbench.attention.dispatch`): the fused kernel on CUDA, code-domain attention on the
        CPU, else the reference path over :meth:`keys_values`; all agree up to float rounding.
        ``self.attend_path`` / ``self.attend_path_reason`` record which ran and why.  With a
        ``rotation`` the backends get the rotated query and the output is rotated back.

        Raises ``ValueError`` for ``lengths`` outside ``[n_q, T]``."""
        if self._rows is not None:
            return ragged.attend(self, query, scaling, lengths)
        return self._in_stored_space(query, lambda q: dispatch.attend(self, q, scaling, lengths))

    def attend_views(
        self, query: torch.Tensor, scaling: float | None, views: dispatch.StepViews
    ) -> torch.Tensor:
        """:meth:`attend` of the ``n_q`` queries of a call stored by :meth:`append_viewed`,
        each query ``t`` reading the tokens of ``views`` flushed at a later step in full
        precision (what it reads under one-token decode): ``query [B, H_q, n_q, D]`` ->
        ``[B, H_q, n_q, D]`` in the query's dtype, by
        :func:`kvbench.attention.dispatch.attend_views` (dequantized keys and values,
        float32 or the query's wider dtype; recorded as ``attend_path`` ``"reference-views"``).
        With a ``rotation`` the query is rotated in and the output back, as :meth:`attend`."""
        return self._in_stored_space(
            query, lambda q: dispatch.attend_views(self, q, scaling, views)
        )

    def _in_stored_space(
        self, query: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``attend`` of ``query`` rotated into the stored space, its output rotated back
        (:meth:`keys_values` inside reads the stored space); without a ``rotation``,
        ``attend(query)``."""
        if self.rotation is None:
            return attend(query)
        self._attending = True
        try:
            out = attend(self._rot(query, "keys"))
        finally:
            self._attending = False
        return self._rot(out, "values", back=True)

    @property
    def observes_attention(self) -> bool:
        """The cache wants each attention step's probabilities (:meth:`observe_attention`):
        in the base class when its :attr:`evictor` scores by observed attention (a subclass
        that observes for itself overrides it)."""
        return self.evictor is not None and self.evictor.observes_attention

    def observe_attention(self, probs: torch.Tensor, lengths: torch.Tensor | None) -> None:
        """Called by the attention backends with the step's float32 softmax ``probs [B, H_q,
        n_q, T]`` (masked keys 0; ``lengths`` as in :meth:`attend`) when ``observes_attention``
        is set; the base cache hands it to its evictor (:meth:`Evictor.observe`)."""
        if self.evictor is not None and self.evictor.observes_attention:
            self.evictor.observe(self, probs, lengths)

    @property
    def kv_shape(self) -> tuple[int, int, int] | None:
        """``(B, H_kv, D)`` of the stored tokens, or ``None`` before any."""
        return self._bhd

    @property
    def awaiting_queries(self) -> bool:
        """A prefill is waiting for its post-RoPE queries (:meth:`provide_queries`)."""
        if self._rows is not None:
            return any(r.awaiting_queries for r in self._rows)
        return self._awaiting_queries

    @property
    def seq_length(self) -> int:
        """Tokens held (sinks + quantized + residual), what attention reads; a padded batch: the
        padded length.  Positions and masks count :attr:`seen_tokens` instead."""
        if self._rows is not None:
            return ragged.seq_length(self)
        return len(self.k)

    @property
    def seen_tokens(self) -> int:
        """Tokens stored so far, evicted ones included: the next token's position (int, per
        row and head; :attr:`seq_length` plus :attr:`evicted_tokens`)."""
        return self.seq_length + self.evicted_tokens

    @property
    def evicted_tokens(self) -> int:
        """Tokens dropped by :meth:`evict` so far (the same in every row and KV head).  Rows
        cached apart (``prefill(..., lengths=...)``) must have dropped the same number:
        ``ValueError`` otherwise (one mask offset serves the batch)."""
        if self._rows is not None:
            counts = {r.evicted_tokens for r in self._rows}
            if len(counts) > 1:
                raise ValueError(
                    f"the rows of this batch evicted different numbers of tokens {sorted(counts)}"
                    "; eviction methods take batches of equal prompts (capabilities.padding)"
                )
            return counts.pop()
        return self._evicted

    def part_bounds(self) -> list[int]:
        """Where the held parts end, as token indices: the sinks' end, then the ends of each
        side's quantized block and of the held tokens (sorted, distinct): the segments within
        which :meth:`evict` needs equal drop counts per row and head."""
        ns = _len(self.k.sinks)
        ends = {ns, ns + _len(self.k.block), ns + _len(self.v.block), self.seq_length}
        return sorted(ends)

    def evict(self, drop: torch.Tensor) -> None:
        """Drop held tokens ``drop`` (int64 ``[B, H_kv, n]``, indices into the held tokens in
        the order :meth:`keys_values` returns them; the same ``n`` in every row and head, the
        indices free to differ) from every part that holds them: the full-precision residual
        and the quantized blocks (``Block.gather``).  Positions do not move:
        :attr:`seen_tokens` still counts the dropped tokens.

        Raises ``ValueError`` for indices out of range, repeated in a row and head, or naming
        a full-precision sink (sinks stay held), or when a part would keep different numbers
        of tokens in different rows or heads; ``TypeError`` for a quantized block without
        ``gather``."""
        if self._rows is not None:
            raise ValueError("evict() does not take a padded batch (cache rows one at a time)")
        held = self.seq_length
        b, h = self._bhd[0], self._bhd[1]
        drop = torch.as_tensor(drop, dtype=torch.long)
        if drop.dim() != 3 or tuple(drop.shape[:2]) != (b, h):
            raise ValueError(f"drop must be [B, H_kv, n] = [{b}, {h}, n]; got {tuple(drop.shape)}")
        n = drop.shape[2]
        if n == 0:
            return
        ns = _len(self.k.sinks)
        if bool((drop < ns).any()) or bool((drop >= held).any()):
            raise ValueError(
                f"drop indices must be in [{ns}, {held}) (the {ns} sinks stay held); got "
                f"{int(drop.min())}..{int(drop.max())}"
            )
        mask = torch.ones(b, h, held, dtype=torch.bool)
        mask.scatter_(2, drop.cpu(), False)
        if bool((mask.sum(-1) != held - n).any()):
            raise ValueError("drop repeats an index within a row and head")
        plans = [side.plan_keep(mask) for side in (self.k, self.v)]  # all checked, then applied
        for side, plan in zip((self.k, self.v), plans, strict=True):
            side.keep(plan)
        self._evicted += n

    def seen_bytes16(self) -> int:
        """Bytes a 16-bit cache of every token seen would hold (keys and values, 2 bytes per
        element): the reference that "bytes vs 16-bit" divides by (docs/design.md#eviction)."""
        if self._rows is not None:
            return sum(r.seen_bytes16() for r in self._rows)
        if self._bhd is None:
            return 0
        b, h, d = self._bhd
        return 2 * 2 * b * h * d * self.seen_tokens

    @property
    def row_lengths(self) -> list[int] | None:
        """Real tokens per row of a padded batch (``prefill(..., lengths=...)``), else ``None``."""
        return None if self._rows is None else ragged.lengths(self)

    @property
    def rows(self) -> list[LayerCache] | None:
        """A padded batch's single-row caches (read them, e.g. to compare codes), else ``None``."""
        return None if self._rows is None else list(self._rows)

    @property
    def padding_tokens(self) -> int:
        """Pad positions of a padded batch (never stored; 0 otherwise)."""
        return sum(self._pads) if self._rows is not None else 0

    def quantized_tokens(self) -> tuple[int, int]:
        """(keys, values) tokens currently held in quantized form."""
        if self._rows is not None:
            return ragged.quantized_tokens(self)
        return _len(self.k.block), _len(self.v.block)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: drop that many from the end)."""
        if self._rows is not None:
            return ragged.crop(self, max_length)
        if self._evicted:
            raise ValueError(
                f"crop() after an eviction ({self._evicted} tokens dropped): the held tokens are "
                "no longer a prefix of those seen"
            )
        n = self.seq_length + max_length if max_length < 0 else max_length
        for side in (self.k, self.v):
            ns, nb = _len(side.sinks), _len(side.block)
            if side.sinks is not None:
                side.sinks = own_storage(side.sinks[:, :, : max(0, min(n, ns))])
            m = n - ns
            if side.block is not None:
                side.block = side.block.crop(m) if 0 < m < nb else (side.block if m >= nb else None)
            if side.residual is not None:
                r = m - nb
                side.residual = own_storage(side.residual[:, :, :r]) if r > 0 else None

    def index_batch(self, idx: torch.Tensor) -> None:
        """Keep/reorder batch rows ``idx`` (beam search ``reorder_cache``, batch select)."""
        if self._rows is not None:
            return ragged.index_batch(self, idx)
        idx = torch.as_tensor(idx, dtype=torch.long)
        for side in (self.k, self.v):
            if side.sinks is not None:
                side.sinks = side.sinks.index_select(0, idx.to(side.sinks.device))
            if side.residual is not None:
                side.residual = side.residual.index_select(0, idx.to(side.residual.device))
            if side.block is not None:
                side.block = side.block.index_batch(idx)
            if hasattr(side.codec, "index_batch"):  # per-sequence codec state (a selection)
                side.codec.index_batch(idx)
        if self._bhd is not None:
            self._bhd = (len(idx), *self._bhd[1:])

    def repeat_batch(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times (``batch_repeat_interleave``)."""
        self.index_batch(torch.arange(self.batch_size).repeat_interleave(repeats))

    @property
    def batch_size(self) -> int:
        return 0 if self._bhd is None else self._bhd[0]

    def reset(self) -> None:
        """Drop every stored token (codecs keep their configuration)."""
        self._rows, self._pads = None, []
        for side in (self.k, self.v):
            side.sinks = side.block = side.residual = None
            side.room = side.block_rooms = None
        self._pending = self._awaiting_queries = False
        self._bhd = None
        self._evicted = 0
        if self.evictor is not None:
            self.evictor.reset()

    # ---------------------------------------------------------------- accounting
    def tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """Every tensor the cache holds, as ``(side, category, tensor)``."""
        if self._rows is not None:
            return ragged.tensors(self)
        return [
            (name, cat, t)
            for name, side in (("key", self.k), ("value", self.v))
            for cat, t in side.tensors()
        ]

    def nbytes(self) -> dict[str, int]:
        """Bytes actually held, by category (``codes, scales, metadata, residual, sinks``), per
        side (``key_total``, ``value_total``) and in all (``total``); summed from
        :meth:`tensors`."""
        out = dict.fromkeys(BYTE_KEYS, 0) | {"key_total": 0, "value_total": 0}
        for side, cat, t in self.tensors():
            n = tensor_bytes(t)
            out[cat] += n
            out[f"{side}_total"] += n
        out["total"] = out["key_total"] + out["value_total"]
        return out

    def spare_bytes(self) -> int:
        """Bytes allocated behind the full-precision residuals and quantized blocks for tokens
        not yet appended or flushed (the room :meth:`Side.add_residual` and
        :meth:`Side.add_block` grow into; docs/design.md#memory): not held, so not in
        :meth:`nbytes`; what the process allocates for this layer is ``nbytes()["total"] +
        spare_bytes()``.  A padded batch: the sum over its rows."""
        if self._rows is not None:
            return sum(r.spare_bytes() for r in self._rows)
        out = 0
        for side in (self.k, self.v):
            out += side.spare_block_bytes()
            if side.spare_tokens():
                b, h, _, d = side.residual.shape
                out += side.spare_tokens() * b * h * d * side.residual.element_size()
        return out
