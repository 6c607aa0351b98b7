"""The one attention-backend registry: which code computes a decode step's attention.

:meth:`kvbench.cache.layer.LayerCache.attend` calls :func:`attend` (installed into
:mod:`kvbench.cache.layer` by :mod:`kvbench.attention` at import: ``kv`` never imports ``attend``, so the
core folders have no import cycle; ``attend`` depends on ``kv``).  The decode step asks the
registry once (:func:`resolve`) and runs the first backend that accepts the cache:

1. *whole-cache backends* registered for the query's device with :func:`register_backend`
   (the fused Triton kernel on CUDA, :mod:`kvbench.attention.triton`), in priority order;
2. the *code-domain* backend (:mod:`kvbench.attention.codedomain`): sinks and residual as matmuls, each
   quantized block through the :class:`BlockKernel` registered for its type and device with
   :func:`register_block_kernel` (``AffineBlock``, ``MixedChannelBlock`` in the core; methods
   register their own block types, e.g. ``methods/fp8.py``);
3. the *reference* path: :meth:`~kvbench.cache.layer.LayerCache.keys_values` (dequantize) and
   :func:`kvbench.attention.reference.reference_attention`.

The path taken is recorded on the cache as ``attend_path`` (a backend name:
``"triton"``, ``"cpu-compiled"``, ``"cpu-eager"``, or ``"reference"``) and why the faster ones
declined as ``attend_path_reason`` (``""`` when the first choice ran).  Nothing here reads a
type name, a private field, or sniffs overrides: a ``LayerCache`` (or ``Side``) subclass whose
reads are not its stored parts says so with ``reads_transformed`` (a reason string), and a block
type says what it stores by its registered kernel.

Bad input never crashes a step and never gives a silent wrong result: a layout without a backend
for the device takes the reference path with the reason recorded; a backend that raises at run
time is reported (one ``RuntimeWarning`` naming the backend, the layout and the device, then the
reference path runs; the reason is recorded).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvbench.attention.reference import (
    length_mask,
    reference_attention,
    reference_probabilities,
    repeat_kv,
)
from kvbench.cache.layer import LayerCache

REFERENCE_PATH = "reference"


class BlockKernel(Protocol):
    """Code-domain attention terms of one stored block type on one device.

    ``key_reason(block, head_dim)`` / ``value_reason(block, head_dim)``: ``None`` when the
    block is supported on that side, else why not.  ``key_logits(block, q, compiled) ->
    float32 [B, H_kv, M, n]`` for query rows ``q`` float32 ``[B, H_kv, M, D]`` (the logit scale
    applied; ``M = (H_q / H_kv) * n_q`` rows per KV head).  ``value_output(block, p, compiled)
    -> float32 [B, H_kv, M, D]`` for probabilities ``p`` float32 ``[B, H_kv, M, n]``.
    ``compiled``: the caller allows ``torch.compile``d kernels (a kernel may ignore it).
    """

    def key_reason(self, block: Any, head_dim: int) -> str | None: ...

    def value_reason(self, block: Any, head_dim: int) -> str | None: ...

    def key_logits(self, block: Any, q: torch.Tensor, compiled: bool) -> torch.Tensor: ...

    def value_output(self, block: Any, p: torch.Tensor, compiled: bool) -> torch.Tensor: ...


@dataclass(frozen=True)
class Backend:
    """A whole-cache attention backend for one device type.

    ``name``: the recorded path; ``device``: ``"cpu"``, ``"cuda"``, ...; ``layouts``: the
    block types it reads (keys and values; a side with no block always fits);
    ``reason(layer_cache, query, lengths) -> str | None``: why it cannot run this step
    (``None``: it can); ``run(layer_cache, query, scaling, lengths) -> [B, H_q, n_q, D]``;
    ``priority``: higher is tried first.
    """

    name: str
    device: str
    layouts: tuple[type, ...]
    reason: Callable[..., str | None]
    run: Callable[..., torch.Tensor]
    priority: int = 0


_BLOCK_KERNELS: dict[tuple[type, str], BlockKernel] = {}
_BACKENDS: list[Backend] = []
#: the code-domain composition, installed by :mod:`kvbench.attention.codedomain`:
#: ``(reason(layer_cache, query, lengths), run(layer_cache, query, scaling, lengths) ->
#: (out, path))``
_code_domain: tuple[Callable[..., str | None], Callable[..., Any], Callable[..., Any]] | None = None


def register_block_kernel(
    block_type: type, kernel: BlockKernel, devices: tuple[str, ...] = ("cpu",)
) -> None:
    """Register ``kernel`` for blocks of exactly ``block_type`` on each device type in
    ``devices`` (replacing an earlier registration)."""
    for dev in devices:
        _BLOCK_KERNELS[(block_type, dev)] = kernel


def block_kernel(block: Any, device: str = "cpu") -> BlockKernel | None:
    """The kernel registered for ``type(block)`` on ``device``, or ``None``."""
    return _BLOCK_KERNELS.get((type(block), device))


def register_backend(backend: Backend) -> None:
    """Register a whole-cache :class:`Backend` (one per ``(name, device)``; a second
    registration replaces the first)."""
    _BACKENDS[:] = [b for b in _BACKENDS if (b.name, b.device) != (backend.name, backend.device)]
    _BACKENDS.append(backend)
    _BACKENDS.sort(key=lambda b: -b.priority)


def install_code_domain(
    reason: Callable[..., str | None], run: Callable[..., Any], eager: Callable[..., Any]
) -> None:
    """Install the code-domain composition backend (done by :mod:`kvbench.attention.codedomain`):
    ``reason(layer_cache, query, lengths, check_mode=True, common=True)`` (``common=False``:
    :func:`common_reason` already ran), ``run(layer_cache, query, scaling,
    lengths) -> (out, path)`` and ``eager(layer_cache, query, scaling, compiled, lengths)``."""
    global _code_domain
    _code_domain = (reason, run, eager)


def backends_for(block_type: type) -> dict[str, list[str]]:
    """Which devices can attend to ``block_type`` without dequantizing:
    ``{"code_domain": [devices], "fused": [backend names on devices]}`` (for capabilities
    reports; computed from the registry)."""
    code = sorted(dev for (t, dev) in _BLOCK_KERNELS if t is block_type)
    fused = [f"{b.name}@{b.device}" for b in _BACKENDS if block_type in b.layouts]
    return {"code_domain": code, "fused": fused}


def layout_name(layer_cache: Any) -> str:
    """``"keys=<type>, values=<type>"`` of a cache's stored blocks (for messages)."""
    kb, vb = layer_cache.k.block, layer_cache.v.block
    return (
        f"keys={type(kb).__name__ if kb is not None else 'none'}, "
        f"values={type(vb).__name__ if vb is not None else 'none'}"
    )


def common_reason(layer_cache: Any, query: torch.Tensor, lengths: Any) -> str | None:
    """Why no backend but the reference may read ``layer_cache`` for ``query`` (``None``: the
    stored parts are what attention reads and the shapes fit)."""
    why = getattr(layer_cache, "reads_transformed", None)
    if why:
        return why
    for name, side in (("key", layer_cache.k), ("value", layer_cache.v)):
        why = getattr(side, "reads_transformed", None)
        if why:
            return f"{name} side: {why}"
    if layer_cache.awaiting_queries or not layer_cache.seq_length:
        return "no stored tokens to attend to"
    shape = layer_cache.kv_shape
    if (
        query.dim() != 4
        or shape is None
        or query.shape[0] != shape[0]
        or query.shape[3] != shape[2]
    ):
        return "query does not fit the cache"
    if query.shape[1] % shape[1]:
        return "query heads are not a multiple of the KV heads"
    if len(layer_cache.k) != len(layer_cache.v):
        return "keys and values hold different token counts"
    return None


def _fits(backend: Backend, layer_cache: Any) -> str | None:
    for name, side in (("key", layer_cache.k), ("value", layer_cache.v)):
        if side.block is not None and type(side.block) not in backend.layouts:
            return f"{name} block {type(side.block).__name__} has no {backend.name} kernel"
    return None


def resolve(layer_cache: Any, query: torch.Tensor, lengths: Any = None):
    """Ask the registry once: ``(run, reasons)`` where ``run(layer_cache, query, scaling,
    lengths) -> (out, path)`` is the first backend that accepts the step, or ``None`` for the
    reference path, and ``reasons`` lists why the ones before it declined."""
    dev = getattr(getattr(query, "device", None), "type", None) or (
        "cuda" if getattr(query, "is_cuda", False) else "cpu"
    )
    reasons: list[str] = []
    why = common_reason(layer_cache, query, lengths)
    if why:
        return None, [why]
    for b in _BACKENDS:
        if b.device != dev:
            continue
        why = _fits(b, layer_cache) or b.reason(layer_cache, query, lengths)
        if why is None and getattr(layer_cache, "observes_attention", False):
            why = "the cache observes the attention probabilities"
        if why is None:
            return (lambda lc, q, s, ln, b=b: (b.run(lc, q, s, ln), b.name)), reasons
        reasons.append(f"{b.name}: {why}")
    if _code_domain is not None:
        why = _code_domain[0](layer_cache, query, lengths, common=False)
        if why is None:
            return _code_domain[1], reasons
        reasons.append(why)
    elif not reasons:
        reasons.append(f"no backend for {dev}")
    return None, reasons


def record(layer_cache: Any, path: str, reason: str) -> None:
    """Set ``attend_path`` / ``attend_path_reason`` (a cache with ``__slots__``: nothing)."""
    try:
        layer_cache.attend_path = path
        layer_cache.attend_path_reason = reason
    except AttributeError:
        pass


def reference_attend(
    layer_cache: Any, query: torch.Tensor, scaling: float | None, lengths: Any = None
) -> torch.Tensor:
    """The reference path: dequantize (``keys_values``) and softmax.  A cache whose blocks have
    no dequantized form (``keys_values`` raises ``NotImplementedError``: QJL's sketches) is
    read by the eager code-domain backend, its blocks' estimator being their reference."""
    try:
        keys, values = layer_cache.keys_values(query.dtype)
    except NotImplementedError:
        if _code_domain is None or _code_domain[0](layer_cache, query, lengths, False):
            raise
        return _code_domain[2](layer_cache, query, scaling, False, lengths)
    if not getattr(layer_cache, "observes_attention", False):
        return reference_attention(query, keys, values, scaling, lengths=lengths)
    probs = reference_probabilities(query, keys, scaling, lengths)
    layer_cache.observe_attention(probs, lengths)
    v = repeat_kv(values.float(), query.shape[1] // values.shape[1])
    return torch.matmul(probs, v).to(query.dtype)


def attend(
    layer_cache: Any,
    query: torch.Tensor,
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, H_q, n_q, D]`` over ``layer_cache`` by the registry's choice;
    ``[B, H_q, n_q, D]`` in the query's dtype.  ``lengths``: optional int ``[B]``, the valid
    cached tokens of each row (row ``b`` holds its tokens at positions ``[0, lengths[b])`` and
    its queries are its last ``n_q`` positions); ``None``: every row holds the whole cache.
    Records ``attend_path`` and ``attend_path_reason`` (see the module docstring).

    Raises ``ValueError`` for ``lengths`` outside ``[n_q, T]`` (before any backend runs)."""
    if lengths is not None:
        length_mask(lengths, query.shape[2], layer_cache.seq_length)  # validates
    run, reasons = resolve(layer_cache, query, lengths)
    if run is not None:
        try:
            out, path = run(layer_cache, query, scaling, lengths)
        except Exception as e:  # noqa: BLE001 - a backend bug must not end a run: report it
            dev = getattr(query, "device", "?")
            msg = f"{type(e).__name__}: {e}"[:300]
            warnings.warn(
                f"kvbench attention backend failed on {layer_name(layer_cache)} ({dev}): {msg}; "
                "using the reference path",
                RuntimeWarning,
                stacklevel=3,
            )
            record(layer_cache, REFERENCE_PATH, f"backend failed: {msg}")
            return reference_attend(layer_cache, query, scaling, lengths)
        record(layer_cache, path, "; ".join(reasons))
        return out
    record(layer_cache, REFERENCE_PATH, "; ".join(reasons))
    return reference_attend(layer_cache, query, scaling, lengths)


def layer_name(layer_cache: Any) -> str:
    return f"{type(layer_cache).__name__}({layout_name(layer_cache)})"


def install() -> None:
    """Make :func:`attend` the dispatch of :meth:`LayerCache.attend` (idempotent)."""
    LayerCache.install_attention(attend)
