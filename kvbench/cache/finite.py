"""The NaN/Inf policy of every layer cache, decided once in the core.

Policy: a key or value tensor handed to
:meth:`LayerCache.prefill` or :meth:`LayerCache.append` that holds a NaN or an infinity raises
``ValueError`` naming the layer, the side (keys/values), the operation and the count of
non-finite elements.  A quantizer cannot represent such a value (a min-max group with one NaN
turns every element of the group into NaN; an Inf makes the scale infinite), so a silent NaN
output would be reported as a fidelity number.  Every built-in method and every plugin
inherits the check, because it runs where tokens enter the cache, before any codec.

Opt-out: ``KVBENCH_NONFINITE=propagate`` in the environment, or ``with nonfinite("propagate"):``
around the calls, stores the tensors as they are (NaN/Inf then propagate to the outputs, as in
a model that overflowed).  Cost: one min/max reduction per side and call (:func:`all_finite`),
with no tensor-sized temporary.
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

POLICIES = ("raise", "propagate")
ENV = "KVBENCH_NONFINITE"
_override: list[str] = []


class NamedCache(Protocol):
    """What this module reads of a layer cache (:class:`~kvbench.cache.layer.LayerCache`,
    which imports this module): the model layer it serves, ``None`` when unknown."""

    layer_idx: int | None


P = ParamSpec("P")
M = TypeVar("M")
L = TypeVar("L", bound=NamedCache)

#: the wrappers made by :func:`named_layers`
_NAMING: weakref.WeakSet[Callable[..., object]] = weakref.WeakSet()


def policy() -> str:
    """The active policy: the innermost :func:`nonfinite` block, else ``$KVBENCH_NONFINITE``,
    else ``"raise"``.  Raises ``ValueError`` for an unknown value in the environment."""
    if _override:
        return _override[-1]
    value = os.environ.get(ENV, "raise").strip().lower() or "raise"
    if value not in POLICIES:
        raise ValueError(f"{ENV}={value!r} is not supported; allowed: {list(POLICIES)}")
    return value


@contextmanager
def nonfinite(mode: str) -> Iterator[None]:
    """Run a block under policy ``mode`` (``"raise"`` or ``"propagate"``)."""
    if mode not in POLICIES:
        raise ValueError(f"nonfinite policy {mode!r} is not supported; allowed: {list(POLICIES)}")
    _override.append(mode)
    try:
        yield
    finally:
        _override.pop()


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` (any shape; float16/bfloat16/float32/float64, or an
    integer/bool dtype, always finite) is finite, with one ``torch.aminmax`` reduction: a NaN
    propagates into both the min and the max and an infinity of either sign becomes the min or
    the max, so both are finite exactly when every element is.  Same answer as
    ``bool(torch.isfinite(x).all())`` without its tensor-sized bool temporary."""
    if x.numel() == 0 or not (x.dtype.is_floating_point or x.dtype.is_complex):
        return True
    if x.dtype.is_complex or x.dtype.itemsize == 1:  # no aminmax for complex / float8
        return bool(torch.isfinite(x).all())
    mn, mx = torch.aminmax(x)
    return bool(torch.isfinite(mn) & torch.isfinite(mx))


def check(keys: torch.Tensor, values: torch.Tensor, cache: NamedCache, op: str) -> None:
    """Apply the policy to ``keys``/``values`` ``[B, H_kv, n, D]`` entering ``cache`` by ``op``
    (``"prefill"`` or ``"append"``).  Raises ``ValueError`` (policy ``raise``)."""
    if all_finite(keys) and all_finite(values):
        return
    if policy() == "propagate":
        return
    layer = cache.layer_idx
    where = f"layer {layer}" if layer is not None else "a layer cache"
    parts = []
    for side, x in (("keys", keys), ("values", values)):
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        if nan or inf:
            parts.append(f"{side}: {nan} NaN and {inf} Inf of {x.numel()} elements")
    raise ValueError(
        f"{where}: {op} got non-finite input ({'; '.join(parts)}); a quantized cache cannot "
        f"store NaN/Inf. Fix the model's numerics (dtype overflow?), or set {ENV}=propagate "
        "to store them as they are"
    )


def named_layers(new_layer: Callable[Concatenate[M, P], L]) -> Callable[Concatenate[M, P], L]:
    """Decorate a ``Method.new_layer`` so the cache it returns knows its ``layer_idx`` (used
    in the messages above); :class:`~kvbench.cache.method.Method` applies it to every subclass."""
    if inspect.unwrap(new_layer, stop=_NAMING.__contains__) in _NAMING:  # wrapped already
        return new_layer

    @functools.wraps(new_layer)
    def wrapper(self: M, *args: P.args, **kwargs: P.kwargs) -> L:
        layer = new_layer(self, *args, **kwargs)
        idx = args[0] if args else kwargs.get("layer_idx")
        # a plugin's cache with __slots__ (not a LayerCache) may have no layer_idx, or refuse
        # it: messages then say "a layer cache"
        with suppress(AttributeError):
            if layer.layer_idx is None:
                layer.layer_idx = idx
        return layer

    _NAMING.add(wrapper)
    return wrapper
