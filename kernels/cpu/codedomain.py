"""The code-domain attention backend: attention computed on the stored codes, never
dequantizing the cache (registered as ``code-domain`` in the entry-point group
``kvbench.backends``; :mod:`kvbench.attention.dispatch` decides when it runs and records
``attend_path`` / ``attend_path_reason``).

Sinks and the full-precision residual are plain matmuls (cast to float32 chunk by chunk along
T: :func:`dense_logits`, :func:`dense_output`); each quantized block goes through the
:class:`BlockKernel` registered for its type and device (:func:`register_block_kernel`; the
built-in kernels, one module each in this package, are the table :data:`_KERNELS` below and,
for the block types defined in a method's module, :data:`_METHOD_KERNELS`, by name, loaded on
first use); one float32 softmax over sinks + block + residual of the keys, split along the
values' own partition (keys and values flush on different schedules).  Paths recorded:
:data:`NATIVE_PATH`, :data:`EAGER_PATH`, ``cpu-native+eager`` when the blocks differed (the
kinds: :mod:`kvbench.kernels.cpu.affine`).

Where the native kernels run and :func:`fused_parts` takes the cache (llama.cpp ``q4_0`` /
``q8_0`` blocks on both sides, or KIVI's 2- and 4-bit per-channel keys with per-token or
full-precision values; head_dim 32/64/128, a cache that does not observe its probabilities),
the whole step is one call of
:func:`kvbench.kernels.cpu.native.attend_fused` instead (scores, online softmax and values in
one pass over the tokens, the GQA group's query rows sharing each decoded token), recorded
as :data:`FUSED_PATH`; equal to the per-block path up to float32 round-off.

Mode (environment ``KVBENCH_CPU_ATTENTION`` or :func:`cpu_attention_mode`): ``auto`` (default)
and ``native``: native where a block supports it, else eager; ``eager``; ``reference``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from kvbench.attention.backend import AttentionCache, common_reason
from kvbench.attention.reference import length_mask
from kvbench.cache.blocks import AffineBlock
from kvbench.cache.chunks import token_chunks
from kvbench.cache.mixed_channel import MixedChannelBlock
from kvbench.kernels.cpu import affine, mixed_channel, native
from kvbench.kernels.cpu.affine import _state

ENV_MODE = "KVBENCH_CPU_ATTENTION"
MODES = ("auto", "native", "eager", "reference")
NATIVE_PATH, EAGER_PATH, REFERENCE_PATH = "cpu-native", "cpu-eager", "reference"
#: the path of a step computed by one call of :func:`kvbench.kernels.cpu.native.attend_fused`
FUSED_PATH = "cpu-native-fused"
#: the backend's name (its entry point in ``kvbench.backends``)
NAME = "code-domain"
#: bytes of the float32 scratch a full-precision part (residual, sinks, ``full``'s whole cache)
#: is cast into, chunk by chunk along T, by :func:`dense_logits` and :func:`dense_output`
DENSE_CHUNK_BYTES = 8 << 20

_mode_override: str | None = None


KERNEL_KINDS = ("native", "native-fused", "eager")


def path_kinds(path: str) -> set[str]:
    """The kernel kinds a recorded code-domain path names: ``"cpu-native+eager"`` ->
    ``{"native", "eager"}``, ``"cpu-native-fused"`` -> ``{"native-fused"}``; ``ValueError`` for a path that is not a ``cpu-`` path of
    :data:`KERNEL_KINDS`."""
    kinds = set(path.removeprefix("cpu-").split("+")) if path.startswith("cpu-") else set()
    if not kinds or not kinds <= set(KERNEL_KINDS):
        raise ValueError(f"{path!r} is not a CPU code-domain path (cpu-<kinds of {KERNEL_KINDS}>)")
    return kinds


def cpu_mode() -> str:
    """The active CPU mode (override, else ``$KVBENCH_CPU_ATTENTION``, else ``auto``).

    Raises ``ValueError`` for a value not in :data:`MODES`."""
    mode = _mode_override or os.environ.get(ENV_MODE, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r} is not supported; allowed: {list(MODES)}")
    return mode


@contextlib.contextmanager
def cpu_attention_mode(mode: str) -> Iterator[None]:
    """Use CPU ``mode`` (one of :data:`MODES`) inside the ``with`` block; ``ValueError``
    otherwise."""
    global _mode_override
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; allowed: {list(MODES)}")
    old, _mode_override = _mode_override, mode
    try:
        yield
    finally:
        _mode_override = old


class BlockKernel(Protocol):
    """Code-domain attention terms of one stored block type on one device.

    ``key_reason(block, head_dim)`` / ``value_reason(block, head_dim)``: ``None`` when the
    block is supported on that side, else why not.  ``key_logits(block, q) -> float32
    [B, H_kv, M, n]`` for query rows ``q`` float32 ``[B, H_kv, M, D]`` (the logit scale
    applied; ``M = (H_q / H_kv) * n_q`` rows per KV head).  ``value_output(block, p) ->
    float32 [B, H_kv, M, D]`` for probabilities ``p`` float32 ``[B, H_kv, M, n]``.  A kernel
    with a native form uses it only where the running step allows it
    (:func:`kvbench.kernels.cpu.affine.native_allowed`) and reports it
    (:func:`kvbench.kernels.cpu.affine.note_impl`).
    """

    def key_reason(self, block: object, head_dim: int) -> str | None: ...

    def value_reason(self, block: object, head_dim: int) -> str | None: ...

    def key_logits(self, block: object, q: torch.Tensor) -> torch.Tensor: ...

    def value_output(self, block: object, p: torch.Tensor) -> torch.Tensor: ...


#: (block type, device type) -> its kernel: the core's block types, one layout each, and the
#: entries of :data:`_METHOD_KERNELS` resolved so far; a plugin adds its own block type with
#: :func:`register_block_kernel`
_KERNELS: dict[tuple[type, str], BlockKernel] = {
    (AffineBlock, "cpu"): affine.AffineBlockAttention(),
    (MixedChannelBlock, "cpu"): mixed_channel.MixedChannelAttention(),
}

#: (dotted name of a block type, device type) -> its kernel class, named relative to this
#: package: the block types that each belong to one built-in method (defined in the method's
#: module; their kernel modules import it).  Names, not imports, so that loading the backend
#: loads no method: :func:`block_kernel` resolves an entry (imports the kernel, keeps it in
#: :data:`_KERNELS`) when it first meets a block of that type, which exists only once its
#: method is loaded
_METHOD_KERNELS: dict[tuple[str, str], str] = {
    ("kvbench.methods.fp8.FP8Block", "cpu"): ".fp8.FP8Attention",
    ("kvbench.methods.kvquant.LUTBlock", "cpu"): ".lut.LUTAttention",
    ("kvbench.methods.polarquant.PolarBlock", "cpu"): ".polar.PolarAttention",
    ("kvbench.methods.qjl.QJLBlock", "cpu"): ".qjl.QJLAttention",
    ("kvbench.methods.qjl.QJLBlock", "cuda"): ".qjl.QJLAttention",
    ("kvbench.methods.semkv.MixedTokenBlock", "cpu"): ".mixed_tokens.MixedTokenAttention",
    ("kvbench.methods.turboquant_mse.TurboBlock", "cpu"): ".turbo.TurboAttention",
}


def _dotted(block_type: type) -> str:
    """``module.QualifiedName`` of ``block_type`` (the key of :data:`_METHOD_KERNELS`)."""
    return f"{block_type.__module__}.{block_type.__qualname__}"


def _load(dotted: str) -> Any:
    """The object named ``package.module.Name`` (``.module.Name``: a module of this package)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module, __package__), name)


def register_block_kernel(
    block_type: type, kernel: BlockKernel, devices: tuple[str, ...] = ("cpu",)
) -> None:
    """Register ``kernel`` for blocks of exactly ``block_type`` on each device type in
    ``devices`` (replacing an earlier registration).

    This is how a plugin method gives its own block type a code-domain kernel: call it once,
    e.g. from the module that defines the block type, before the first decode step.  A block
    type without a kernel is read by the reference path (dequantize, then softmax), with the
    reason recorded."""
    for dev in devices:
        _KERNELS[(block_type, dev)] = kernel


def block_kernel(block: object, device: str = "cpu") -> BlockKernel | None:
    """The kernel registered for ``type(block)`` on ``device``, or ``None``.

    A type of :data:`_METHOD_KERNELS` not registered on ``device`` gets its built-in kernel,
    imported and kept in :data:`_KERNELS` on first use."""
    block_type = type(block)
    kernel = _KERNELS.get((block_type, device))
    if kernel is None and (name := _METHOD_KERNELS.get((_dotted(block_type), device))):
        if _load(_dotted(block_type)) is block_type:  # the method's own type, not a namesake
            kernel = _KERNELS.setdefault((block_type, device), _load(name)())
    return kernel


def kernel_devices(block_type: type) -> list[str]:
    """The device types with a kernel registered for ``block_type`` (or a built-in one in
    :data:`_METHOD_KERNELS`), sorted."""
    devs = {dev for (t, dev) in _KERNELS if t is block_type}
    return sorted(devs | {dev for (n, dev) in _METHOD_KERNELS if n == _dotted(block_type)})


def code_domain_reason(
    layer_cache: Any,
    query: torch.Tensor,
    lengths: Any = None,
    check_mode: bool = True,
    common: bool = True,
) -> str | None:
    """Why ``layer_cache`` cannot take the CPU code-domain path for ``query`` (``None``: it
    can): the mode, a non-CPU query, shapes that do not fit, or a block without a CPU kernel.
    ``common=False``: the caller (the registry's :func:`~kvbench.attention.dispatch.resolve`)
    already ran :func:`~kvbench.attention.dispatch.common_reason`."""
    if check_mode and cpu_mode() == "reference":
        return f"{ENV_MODE}=reference"
    dev = getattr(getattr(query, "device", None), "type", "cpu")
    why = common_reason(layer_cache, query, lengths) if common else None
    if why:
        return why
    d = layer_cache.kv_shape[2]
    for name, side in (("key", layer_cache.k), ("value", layer_cache.v)):
        if side.block is not None:
            impl = block_kernel(side.block, dev)
            if impl is None:
                where = "" if dev == "cpu" else f" on {dev}"
                return f"{name} block {type(side.block).__name__} has no code-domain kernel{where}"
            why = (impl.key_reason if name == "key" else impl.value_reason)(side.block, d)
            if why:
                return why
    return None


def code_domain_attend(
    layer_cache: Any,
    query: torch.Tensor,
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, H_q, n_q, D]`` over ``layer_cache`` (a
    :class:`kvbench.cache.layer.LayerCache`) in the code domain; ``[B, H_q, n_q, D]`` in the query's
    dtype.  Same contract as :func:`kvbench.attention.reference.reference_attention` over
    ``keys_values()`` (GQA: query head ``h`` reads KV head ``h // (H_q / H_kv)``; causal mask
    aligned to the end when ``n_q > 1``; ``lengths``: per-row valid tokens; float32 logits and
    softmax).

    Raises
    ------
    ValueError
        The layout is not supported (the reason; see :func:`code_domain_reason`).
    """
    why = code_domain_reason(layer_cache, query, lengths, check_mode=False)
    if why:
        raise ValueError(why)
    return _attend(layer_cache, query, scaling, lengths)


def _float_pieces(part: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(t0, t1, part[:, :, t0:t1] as float32)`` covering a full-precision part
    ``[B, H, T, D]`` along T: one piece where the part is float32 already, fits one chunk or is
    not on the CPU, else chunks of :func:`~kvbench.cache.chunks.token_chunks` of about
    :data:`DENSE_CHUNK_BYTES` of float32 each, cast into one reused scratch (each piece is
    valid until the next is drawn)."""
    bsz, h, t, d = part.shape
    spans = list(token_chunks(bsz, h, t, d, elements=DENSE_CHUNK_BYTES // 4))
    if part.dtype == torch.float32 or len(spans) <= 1 or part.device.type != "cpu":
        yield 0, t, part.float()
        return
    buf = part.new_empty(bsz, h, spans[0][1], d, dtype=torch.float32)
    for t0, t1 in spans:
        chunk = buf[:, :, : t1 - t0]
        chunk.copy_(part[:, :, t0:t1])
        yield t0, t1, chunk


def dense_logits(q: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``q @ part^T`` in float32 for ``q [B, H_kv, M, D]`` float32 and a full-precision part
    ``part [B, H_kv, T, D]`` (any float dtype): ``[B, H_kv, M, T]`` float32.

    A part longer than one chunk is cast into one reused float32 scratch of
    :data:`DENSE_CHUNK_BYTES`, chunk by chunk along T (:func:`_float_pieces`), instead of a
    float32 copy of the whole part (at batch 8 x 32K x 8 heads x 128 that copy is 1 GiB of
    fresh pages per step; measured on 2 cores: ~5x faster, peak working memory one chunk; on
    the CPU only, where the cast's fresh pages cost more than the arithmetic).  Each logit is
    the same length-D dot product either way (equal bit for bit on the machines measured; the
    tests compare with the one-matmul form to float32 rounding)."""
    t, out = part.shape[2], None
    for t0, t1, x in _float_pieces(part):
        lg = torch.matmul(q, x.transpose(-1, -2))
        if t1 - t0 == t:
            return lg
        if out is None:
            out = q.new_empty(*q.shape[:-1], t)
        out[..., t0:t1] = lg
    return out


def dense_output(p: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``p @ part`` in float32 for probabilities ``p [B, H_kv, M, T]`` float32 and a
    full-precision part ``part [B, H_kv, T, D]``: ``[B, H_kv, M, D]`` float32, chunked along T
    as :func:`dense_logits` (the sum over T then adds chunk partial sums in order: equal to
    the one-matmul form up to float32 rounding)."""
    out = None
    for t0, t1, x in _float_pieces(part):
        o = torch.matmul(p[..., t0:t1], x)
        out = o if out is None else out.add_(o)
    return out


def _attend(
    layer_cache: Any,
    query: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
):
    """:func:`code_domain_attend` without its layout checks."""
    bsz, hq, nq, d = query.shape
    hkv = layer_cache.kv_shape[1]
    dev = query.device.type
    m = hq // hkv * nq
    scale = 1.0 / math.sqrt(d) if scaling is None else scaling
    q = (query.float() * scale).reshape(bsz, hkv, m, d)  # rows: (query head in group, n_q)
    ks, vs = layer_cache.k, layer_cache.v
    logits = []
    for part in (ks.sinks, ks.block, ks.residual):
        if isinstance(part, torch.Tensor):
            logits.append(dense_logits(q, part))
        elif part is not None:
            logits.append(block_kernel(part, dev).key_logits(part, q))
    lg = torch.cat(logits, -1) if len(logits) > 1 else logits[0]  # [B, H_kv, M, T]
    t = lg.shape[-1]
    if nq > 1 or lengths is not None:
        mask = length_mask(lengths, nq, t, query.device)  # [B|1, n_q, T]
        lg = lg.reshape(bsz, hkv, hq // hkv, nq, t).masked_fill(~mask[:, None, None], float("-inf"))
        lg = lg.reshape(bsz, hkv, m, t)
    probs = torch.softmax(lg, dim=-1)
    if getattr(layer_cache, "observes_attention", False):
        layer_cache.observe_attention(probs.reshape(bsz, hq, nq, t), lengths)
    out, off = None, 0
    for part in (vs.sinks, vs.block, vs.residual):
        if part is None:
            continue
        n = part.shape[2] if isinstance(part, torch.Tensor) else part.ntokens
        p = probs[..., off : off + n]
        off += n
        if isinstance(part, torch.Tensor):
            o = dense_output(p, part)
        else:
            o = block_kernel(part, dev).value_output(part, p.contiguous())
        out = o if out is None else out + o
    return out.reshape(bsz, hq, nq, d).to(query.dtype)


def _fused_block(block: object) -> tuple[str, int] | str:
    """``(kind, tokens)`` of :class:`~kvbench.kernels.cpu.native.FusedSide` that reads
    ``block`` (``tokens``: per row of its terms, ``"channel"`` only), or why it has none.  From
    what the block declares it stores (the fields its ``layout`` is made of: code width,
    symmetry, term dtype and group rectangle; token groups all of one length, checked in O(1)
    for per-token terms: this runs every step): ``"block"``, symmetric per-token codes of 4 or
    8 bits with float16 scales (llama.cpp ``q4_0`` / ``q8_0``, :mod:`kvbench.methods.int_block`);
    ``"token"``, affine codes of 2 or 4 bits with terms per token per group of channels (KIVI's
    values); ``"channel"``, affine codes of 2 or 4 bits with terms per channel per ``G`` tokens
    (KIVI's keys)."""
    if type(block) is not AffineBlock:
        return f"{type(block).__name__} blocks"
    if block.midpoint:
        return "1-bit midpoint codes"
    gl, n = block.group_len, block.ntokens
    if len(gl) == n:  # every group one token (each holds at least one)
        tokens = 1
    elif len(gl) * gl[0] == n and all(x == gl[0] for x in gl):
        tokens = gl[0]
    else:
        return "token groups of unequal lengths"
    per_token_channels = block.head_dim // block.scale.shape[-1]
    if block.symmetric:
        if block.bits not in native.FUSED_KIND_BITS["block"]:
            return "symmetric codes other than 4 or 8 bits"
        if tokens != 1 or block.scale.dtype != torch.float16:
            return "symmetric scales other than float16 per token"
        return "block", 1
    if block.bits not in native.FUSED_KIND_BITS["token"] or block.zero is None:
        return "affine codes other than 2 or 4 bits"
    if tokens == 1 and per_token_channels > 1:
        return "token", 1
    if per_token_channels == 1:
        return "channel", tokens
    return "affine terms other than per-token channel groups or per-channel token groups"


def _side_pieces(side: Any) -> list[tuple[int, object]]:
    """``(tokens, part)`` of a cache side's non-empty parts in token order (sinks, block,
    residual)."""
    out = []
    for part in (side.sinks, side.block, side.residual):
        if part is None:
            continue
        n = part.shape[2] if isinstance(part, torch.Tensor) else part.ntokens
        if n:
            out.append((n, part))
    return out


def _fused_side(part: object, off: int, n: int) -> native.FusedSide | str:
    """Tokens ``[off, off + n)`` of a side's part (a full-precision tensor or a block) as a
    :class:`~kvbench.kernels.cpu.native.FusedSide` (views; full-precision parts as float32),
    or why not (:func:`_fused_block`)."""
    if isinstance(part, torch.Tensor):
        return native.FusedSide(part[:, :, off : off + n].float())
    got = _fused_block(part)
    if isinstance(got, str):
        return got
    kind, tokens = got
    codes = part.codes[:, :, off : off + n]
    if kind == "channel":
        r0 = off // tokens
        sc, zr = part.scale[:, :, r0:], part.zero[:, :, r0:]
        return native.FusedSide(codes, kind, part.bits, sc, zr, tokens, off - r0 * tokens)
    sc = part.scale[:, :, off : off + n]
    zr = None if part.zero is None else part.zero[:, :, off : off + n]
    return native.FusedSide(codes, kind, part.bits, sc, zr)


def fused_parts(layer_cache: Any, query: torch.Tensor) -> list[native.FusedPart] | str:
    """The parts of ``layer_cache`` for one :func:`~kvbench.kernels.cpu.native.attend_fused`
    call: the tokens split wherever the keys or the values change part (sinks, block,
    residual; KIVI's keys and values flush on different schedules), each side a view of its
    part (full-precision parts as float32), or why not: no quantized block, a block it does
    not read (:func:`_fused_block`), a cache that observes its probabilities, or shapes and
    pairs of kinds (:func:`~kvbench.kernels.cpu.native.fused_reason`)."""
    if getattr(layer_cache, "observes_attention", False):
        return "the cache observes the attention probabilities"
    ks, vs = layer_cache.k, layer_cache.v
    if ks.block is None and vs.block is None:
        return "no quantized block"
    kp, vp = _side_pieces(ks), _side_pieces(vs)
    if sum(n for n, _ in kp) != sum(n for n, _ in vp):
        return "keys and values hold different token counts"
    parts, ki, vi, koff, voff = [], 0, 0, 0, 0
    while ki < len(kp):
        n = min(kp[ki][0] - koff, vp[vi][0] - voff)
        k = _fused_side(kp[ki][1], koff, n)
        v = _fused_side(vp[vi][1], voff, n)
        for name, side in (("keys", k), ("values", v)):
            if isinstance(side, str):
                return f"{name}: {side}"
        parts.append(native.FusedPart(k, v))
        koff, voff = koff + n, voff + n
        if koff == kp[ki][0]:
            ki, koff = ki + 1, 0
        if voff == vp[vi][0]:
            vi, voff = vi + 1, 0
    bsz, hkv, d = query.shape[0], *layer_cache.kv_shape[1:]
    return native.fused_reason(parts, bsz, hkv, d) or parts


def _attend_fused(
    layer_cache: Any,
    query: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None,
    parts: list[native.FusedPart],
) -> torch.Tensor:
    """:func:`_attend` in one native call over ``parts`` (:func:`fused_parts`)."""
    bsz, hq, nq, d = query.shape
    hkv = layer_cache.kv_shape[1]
    scale = 1.0 / math.sqrt(d) if scaling is None else scaling
    q = (query.float() * scale).reshape(bsz, hkv, hq // hkv * nq, d).contiguous()
    out = torch.empty_like(q)
    ln = None if lengths is None else torch.as_tensor(lengths).to(torch.int64)
    native.attend_fused(parts, q, nq, out, ln)
    return out.reshape(bsz, hq, nq, d).to(query.dtype)


def _registry_run(layer_cache: Any, query: torch.Tensor, scaling: float | None, lengths: Any):
    """The registry's code-domain backend: ``(out, path)``; the mode picks the kernels.

    ``auto`` and ``native``: the native kernels (:mod:`kvbench.kernels.cpu.native`) wherever a
    block supports them, else eager; ``eager``: eager.  The path names what ran:
    ``cpu-native-fused`` (the whole step in one native call where :func:`fused_parts` takes
    the cache), ``cpu-native``, ``cpu-eager``, or ``cpu-native+eager`` when blocks differed."""
    mode = cpu_mode()
    allowed = query.device.type == "cpu" and mode in ("auto", "native") and native.available()
    if allowed:
        parts = fused_parts(layer_cache, query)
        if not isinstance(parts, str):
            return _attend_fused(layer_cache, query, scaling, lengths, parts), FUSED_PATH
    _state.native = allowed
    _state.used = []
    try:
        out = _attend(layer_cache, query, scaling, lengths)
    finally:
        used, _state.used = _state.used, []
        _state.native = False
    dev = query.device.type
    if dev != "cpu":  # a block kernel registered for another device (QJL's on CUDA): eager
        return out, f"{dev}-eager"
    blocks = sum(side.block is not None for side in (layer_cache.k, layer_cache.v))
    if len(used) < blocks:  # a kernel that did not report ran its eager code
        used.append("eager")
    kinds = sorted(set(used) or {"eager"}, key=KERNEL_KINDS.index)
    return out, "cpu-" + "+".join(kinds)


class CodeDomainBackend:
    """The code-domain :class:`~kvbench.attention.backend.Backend` (any device whose blocks
    have kernels): :func:`code_domain_reason` and :func:`_registry_run`; :meth:`eager` is the
    reference of blocks that have no dequantized form."""

    name = NAME
    device = "*"

    def devices_for(self, block_type: type) -> list[str]:
        return kernel_devices(block_type)

    def eager(
        self,
        cache: AttentionCache,
        query: torch.Tensor,
        scaling: float | None,
        lengths: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The eager code-domain attention (whatever the mode), or ``None`` where the block
        kernels do not read ``cache``: the reference of blocks that have no dequantized form
        (QJL's sketches; :func:`kvbench.attention.dispatch.reference_attend`)."""
        if code_domain_reason(cache, query, lengths, check_mode=False):
            return None
        return _attend(cache, query, scaling, lengths)

    def reason(
        self, cache: AttentionCache, query: torch.Tensor, lengths: torch.Tensor | None
    ) -> str | None:
        return code_domain_reason(cache, query, lengths, common=False)

    def run(
        self,
        cache: AttentionCache,
        query: torch.Tensor,
        scaling: float | None,
        lengths: torch.Tensor | None,
    ) -> tuple[torch.Tensor, str]:
        return _registry_run(cache, query, scaling, lengths)


BACKEND = CodeDomainBackend()
