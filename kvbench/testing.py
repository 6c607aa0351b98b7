"""Contract checks for a method: what a plugin's own tests call.

:func:`check_method` builds a method's layer cache on seeded random keys and values, prefills
it, decodes token by token and runs the checks ``config``, ``attend`` (at every decode step),
``positions``, ``round trip``, ``bytes`` and (when ``capabilities.padding``) ``padding`` in this
order; what each requires is
the table of docs/plugins.md#testing-a-plugin.  An eviction method
(:class:`kvbench.cache.eviction.EvictionMethod`) is followed through its evictions: the seen
positions of the tokens it holds are tracked from its ``evict`` decisions, ``seen_tokens`` must
count every token given, and the round trip, attend and bytes checks compare with the inputs
at the held positions (docs/design.md#eviction).  The round-trip bound of a quantized side,
:func:`half_step_bound`, is the half step of a symmetric absmax code and at least that of a
min-max affine code; a codec of another kind (floating-point codes, codebooks, projections)
passes its own ``round_trip_atol``.

A failed check raises ``AssertionError`` whose message starts with
``check_method(<method>): <check>:`` and says what differed.  A method that needs calibration
must be calibrated before the call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbench.cache.eviction import EvictionMethod
from kvbench.cache.layer import BYTE_KEYS, LayerCache
from kvbench.cache.layout import BlockLayout
from kvbench.cache.method import Method

#: the field name used to check that an unknown config field is refused
UNKNOWN_FIELD = "no_such_field_kvbench_check"
#: pad values of the padding check (keys, values, queries): no statistic may see them
PAD_KEY, PAD_VALUE, PAD_QUERY = 1e3, -1e3, 50.0


@dataclass(frozen=True)
class MethodCheck:
    """What :func:`check_method` measured (every check passed).

    Attributes
    ----------
    prompt_tokens, decode_tokens : tokens prefilled and then appended one at a time.
    quantized_tokens : ``(keys, values)`` held quantized at the end.
    key_error, value_error : largest ``|x_hat - x|`` over the quantized tokens (0.0 when none).
    key_bound, value_bound : the bound each was checked against (0.0: exact required).
    attend_error : largest ``|attend - reference|`` over the decode steps, in units of ``max|v|``.
    padding_checked : whether the padding check ran.
    """

    prompt_tokens: int
    decode_tokens: int
    quantized_tokens: tuple[int, int]
    key_error: float
    value_error: float
    key_bound: float
    value_bound: float
    attend_error: float
    padding_checked: bool


class _Checker:
    """Formats failures as ``check_method(<name>): <check>: <message>``."""

    def __init__(self, method: Method) -> None:
        self.name = method.name or type(method).__name__

    def fail(self, check: str, message: str) -> AssertionError:
        return AssertionError(f"check_method({self.name!r}): {check}: {message}")

    def require(self, ok: bool, check: str, message: str) -> None:
        if not ok:
            raise self.fail(check, message)


def _code_bits(layout: BlockLayout) -> int:
    """The narrowest code width of ``layout`` (16 or more: full precision)."""
    return min(c.bits for c in layout.codes.classes)


def half_step_bound(x: torch.Tensor, bits: int) -> float:
    """Largest error of a ``bits``-bit absmax or min-max code of ``x``'s values, read back in
    ``x``'s dtype: ``1.01 * max|x| / (2^bits - 2)`` (``1.01 * max|x|`` for 1 bit; 1 % for scale
    rounding) plus ``eps * max|x|`` (``eps`` of ``x``'s dtype: rounding the dequantized value);
    0.0 for ``bits >= 16``."""
    if bits >= 16:
        return 0.0
    amax = float(x.abs().max())
    step = amax if bits == 1 else amax / (2**bits - 2)
    return 1.01 * step + torch.finfo(x.dtype).eps * amax


def reference_attention64(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Float64 softmax attention of ``query [B, H_q, 1, D]`` over every cached token of
    ``keys``, ``values [B, H_kv, T, D]``; returns ``[B, H_q, 1, D]`` float64."""
    rep = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(rep, dim=1)
    v = values.double().repeat_interleave(rep, dim=1)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    probs = torch.softmax(query.double() @ k.transpose(-1, -2) * scale, dim=-1)
    return probs @ v


def _storing(method: Method) -> Method:
    """The method whose layer stores the tokens: an eviction method's quantizer, else itself."""
    return method.quantizer if isinstance(method, EvictionMethod) else method


def _default_lengths(method: Method) -> tuple[int, int]:
    """Prompt and decode lengths that reach quantized tokens and a decode-time flush (and, for
    an eviction method, a prompt longer than its ``window_size`` where it has one)."""
    c = _storing(method).config
    r = int(c.residual_length or 0)
    g = int(c.group_size or 1)
    ns = int(c.num_sink_tokens or 0)
    span = max(r, g, 1)
    window = int(getattr(method.config, "window_size", 0) or 0)
    return ns + 2 * span + 1 + window, span + 1


class HeldPositions:
    """The seen positions of the tokens a layer cache holds, followed through its evictions.

    Installed on ``layer`` before any token (it wraps ``layer.evict``); :meth:`now` gives int64
    ``[B, H_kv, T_held]``, ascending per row and head (held tokens stay in the order seen)."""

    def __init__(self, layer: LayerCache) -> None:
        self.layer = layer
        self.pos: torch.Tensor | None = None
        evict = layer.evict

        def tracked(drop: torch.Tensor) -> None:
            pos = self.now()
            evict(drop)
            keep = torch.ones(pos.shape, dtype=torch.bool)
            keep.scatter_(2, torch.as_tensor(drop, dtype=torch.long).cpu(), False)
            self.pos = pos[keep].reshape(*pos.shape[:2], -1)

        layer.evict = tracked

    def now(self) -> torch.Tensor:
        """Positions of the held tokens now (tokens stored since the last eviction appended)."""
        lc = self.layer
        b, h, _ = lc.kv_shape
        old = self.pos if self.pos is not None else torch.zeros(b, h, 0, dtype=torch.long)
        new = lc.seq_length - old.shape[2]
        fresh = torch.arange(lc.seen_tokens - new, lc.seen_tokens).expand(b, h, new)
        self.pos = torch.cat([old, fresh], dim=2)
        return self.pos


def held_inputs(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` at the held positions ``pos [B, H, T_held]``."""
    return torch.gather(x, 2, pos[..., None].expand(*pos.shape, x.shape[3]))


def _data(
    batch: int, hkv: int, hq: int, tokens: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded keys, values ``[B, H_kv, T, D]`` and queries ``[B, H_q, T, D]`` in ``dtype``;
    keys have an offset and one outlier channel, as post-RoPE keys do."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, hkv, tokens, head_dim, generator=g, dtype=torch.float64) * 1.5 + 0.3
    k[..., min(3, head_dim - 1)] *= 6
    v = torch.randn(batch, hkv, tokens, head_dim, generator=g, dtype=torch.float64)
    q = torch.randn(batch, hq, tokens, head_dim, generator=g, dtype=torch.float64)
    return k.to(dtype), v.to(dtype), q.to(dtype)


def _run(
    method: Method,
    k: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    prompt: int,
    lengths: list[int] | None = None,
    on_step: Callable[[LayerCache, int, torch.Tensor], None] | None = None,
    track: list[HeldPositions] | None = None,
) -> tuple[LayerCache, list[torch.Tensor]]:
    """Prefill ``prompt`` tokens (left-padded to ``lengths`` if given), then append the rest one
    token at a time; ``on_step(layer, t, out)`` sees each decode step's attention output.
    ``track``: a list that gets the layer's :class:`HeldPositions` (installed before the
    prefill)."""
    lc = method.new_layer(0, k.shape[1], k.shape[3], k.dtype)
    if track is not None:
        track.append(HeldPositions(lc))
    queries = q[:, :, :prompt] if method.needs_queries else None
    lc.prefill(k[:, :, :prompt], v[:, :, :prompt], queries, lengths=lengths)
    outs = []
    for t in range(prompt, k.shape[2]):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        out = lc.attend(q[:, :, t : t + 1])
        if on_step is not None:
            on_step(lc, t, out)
        outs.append(out)
        lc.end_step()
    return lc, outs


def _check_config(
    chk: _Checker, method: Method, bad_configs: Sequence[Mapping[str, object]]
) -> None:
    cls = type(method).Config
    cases = [({UNKNOWN_FIELD: 1}, "an unknown field")]
    cases += [(dict(bad), f"the bad config {dict(bad)}") for bad in bad_configs]
    for bad, what in cases:
        try:
            cls.from_dict(bad)
        except ValueError as e:
            chk.require(
                any(f in str(e) for f in bad),
                "config",
                f"the ValueError for {what} names none of {list(bad)}: {e}",
            )
        else:
            raise chk.fail("config", f"{cls.__name__}.from_dict accepted {what}")
    again = cls.from_dict(method.config.to_dict())
    chk.require(
        again == method.config,
        "config",
        f"from_dict(to_dict()) gave {again}, not {method.config}",
    )


def _check_round_trip(
    chk: _Checker,
    method: Method,
    lc: LayerCache,
    inputs: tuple[torch.Tensor, torch.Tensor],
    atol: Mapping[str, float],
) -> tuple[list[float], list[float]]:
    kv = lc.keys_values()
    held = inputs[0].shape[2]
    ns = min(int(_storing(method).config.num_sink_tokens or 0), held)
    errors, bounds = [], []
    for i, side in enumerate(("key", "value")):
        got, x = kv[i], inputs[i]
        chk.require(
            got.shape == x.shape and got.dtype == x.dtype,
            "round trip",
            f"keys_values() {side}s are {tuple(got.shape)} {got.dtype}; expected "
            f"{tuple(x.shape)} {x.dtype} ([B, H_kv, T, D] in the cache dtype)",
        )
        nq = lc.quantized_tokens()[i]
        layout = method.key_layout(x.shape[3]) if i == 0 else method.value_layout(x.shape[3])
        bits = _code_bits(layout)
        full = [*range(ns), *range(ns + nq, held)]
        bad = [t for t in full if not torch.equal(got[:, :, t], x[:, :, t])]
        chk.require(
            not bad,
            "round trip",
            f"{side}s of full-precision tokens (sinks, residual) differ from the input at "
            f"positions {bad[:8]} (sinks {ns}, quantized {nq}, held {held})",
        )
        if bits >= 16:
            chk.require(
                nq == 0 or torch.equal(got, x),
                "round trip",
                f"the {side} layout is full precision but dequantized {side}s differ",
            )
        else:
            chk.require(
                nq > 0,
                "round trip",
                f"no {side} was quantized after {held} tokens ({bits}-bit layout): raise "
                "prompt_tokens / decode_tokens past the residual window",
            )
        bound = atol.get(side, half_step_bound(x[:, :, ns : ns + nq], bits))
        err = float((got - x)[:, :, ns : ns + nq].abs().max()) if nq else 0.0
        chk.require(
            err <= bound,
            "round trip",
            f"dequantized {side}s are up to {err:.4g} away from the input; the {bits}-bit "
            f"bound is {bound:.4g} (max|x| / (2^b - 2))",
        )
        errors.append(err)
        bounds.append(bound)
    return errors, bounds


def _check_bytes(chk: _Checker, lc: LayerCache, itemsize: int) -> None:
    nb = lc.nbytes()
    want = dict.fromkeys(BYTE_KEYS, 0) | {"key_total": 0, "value_total": 0}
    room = 0  # bytes allocated behind grown residuals and blocks (LayerCache.spare_bytes)
    for side, cat, t in lc.tensors():
        chk.require(
            cat in BYTE_KEYS,
            "bytes",
            f"a stored {side} tensor has category {cat!r}; allowed: {list(BYTE_KEYS)}",
        )
        extra = t.untyped_storage().nbytes() - t.numel() * t.element_size()
        chk.require(
            extra == 0 or t.storage_offset() == 0,
            "bytes",
            f"a stored {side} {cat} tensor {tuple(t.shape)} is a view of a larger allocation "
            f"({t.untyped_storage().nbytes()} bytes held, {t.numel() * t.element_size()} "
            "counted); store a compact copy (kvbench.cache.blocks.own_storage)",
        )
        room += extra
        want[cat] += t.numel() * t.element_size()
        want[f"{side}_total"] += t.numel() * t.element_size()
    chk.require(
        room == lc.spare_bytes(),
        "bytes",
        f"the stored tensors are views of allocations {room} bytes larger than their tokens, "
        f"but spare_bytes() reports {lc.spare_bytes()} bytes of room (only a residual or block "
        "grown by the layer cache may have room after its tokens; else store a compact copy, "
        "kvbench.cache.blocks.own_storage)",
    )
    want["total"] = want["key_total"] + want["value_total"]
    for key, n in want.items():
        chk.require(
            nb.get(key) == n,
            "bytes",
            f"nbytes()[{key!r}] = {nb.get(key)} but the stored tensors hold {n} bytes",
        )
    chk.require(
        sum(nb[c] for c in BYTE_KEYS) == nb["total"],
        "bytes",
        f"the categories {BYTE_KEYS} add up to {sum(nb[c] for c in BYTE_KEYS)}, not "
        f"total={nb['total']}",
    )
    b, h, d = lc.kv_shape
    held = lc.seq_length
    for i, side in enumerate(("key", "value")):
        fp = sum(
            t.numel() * t.element_size()
            for s, c, t in lc.tensors()
            if s == side and c in ("residual", "sinks")
        )
        nq = lc.quantized_tokens()[i]
        chk.require(
            fp == (held - nq) * b * h * d * itemsize,
            "bytes",
            f"{side} residual + sinks hold {fp} bytes, not the {held - nq} full-precision "
            f"tokens x {b * h * d} elements x {itemsize} bytes",
        )
        packed = nb[f"{side}_total"] - fp
        chk.require(
            nq == 0 or packed <= nq * b * h * d * itemsize,
            "bytes",
            f"{nq} quantized {side}s take {packed} bytes, more than in the cache dtype "
            f"({nq * b * h * d * itemsize})",
        )


def _check_positions(chk: _Checker, lc: LayerCache, pos: torch.Tensor, seen: int) -> None:
    """Positions follow the tokens seen: ``seen_tokens`` counts every token given, the held
    count is ``seen`` less the evicted ones, and the held positions are distinct, ascending
    and below ``seen``."""
    chk.require(
        lc.seen_tokens == seen and lc.seq_length == pos.shape[2],
        "positions",
        f"seen_tokens={lc.seen_tokens} and seq_length={lc.seq_length} after {seen} tokens with "
        f"{seen - pos.shape[2]} evicted (want {seen} and {pos.shape[2]}): positions must count "
        "every token seen, attention the tokens held",
    )
    chk.require(
        pos.shape[2] == 0 or bool((pos.diff(dim=2) > 0).all() and (pos < seen).all()),
        "positions",
        "the held tokens are not distinct tokens seen, in the order seen",
    )
    b, h, d = lc.kv_shape
    chk.require(
        lc.seen_bytes16() == 2 * 2 * b * h * d * seen,
        "bytes",
        f"seen_bytes16()={lc.seen_bytes16()}, not the 16-bit cache of the {seen} tokens seen "
        f"({2 * 2 * b * h * d * seen} bytes)",
    )


def _check_padding(
    chk: _Checker,
    method: Method,
    k: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    prompt: int,
    atol: float,
) -> None:
    """Two rows ``k, v, q`` ``[2, H, T, D]``: row 0 holds the whole prompt, row 1 about a
    third less (left-padded)."""
    k, v, q = k.clone(), v.clone(), q.clone()
    lengths = [prompt, max(1, prompt - max(1, prompt // 3))]
    for row, n in enumerate(lengths):
        k[row, :, : prompt - n], v[row, :, : prompt - n] = PAD_KEY, PAD_VALUE
        q[row, :, : prompt - n] = PAD_QUERY
    batch, outs = _run(method, k, v, q, prompt, lengths=lengths)
    chk.require(
        batch.rows is not None and batch.row_lengths == [n + k.shape[2] - prompt for n in lengths],
        "padding",
        f"prefill(..., lengths={lengths}) did not cache each row apart (rows: "
        f"{batch.row_lengths}); the pads were stored as tokens (docs/design.md#padding)",
    )
    out = torch.cat(outs, dim=2)
    kv = method.capabilities.keys_values
    kb, vb = batch.keys_values() if kv else (None, None)
    stored = 0
    for row, n in enumerate(lengths):
        pad = prompt - n
        sl = slice(pad, None)
        alone, ref = _run(
            method, k[row : row + 1, :, sl], v[row : row + 1, :, sl], q[row : row + 1, :, sl], n
        )
        got, want = batch.rows[row].tensors(), alone.tensors()
        same = len(got) == len(want) and all(
            (s, c) == (s2, c2) and a.shape == b.shape and torch.equal(a, b)
            for (s, c, a), (s2, c2, b) in zip(got, want)
        )
        chk.require(
            same,
            "padding",
            f"row {row} of a left-padded batch ({pad} pads) stores other tensors than the row "
            "alone: its codes depend on the pads",
        )
        if kv:
            ka, va = alone.keys_values()
            chk.require(
                torch.equal(kb[row : row + 1, :, pad:], ka)
                and torch.equal(vb[row : row + 1, :, pad:], va)
                and not kb[row, :, :pad].any()
                and not vb[row, :, :pad].any(),
                "padding",
                f"keys_values() of padded row {row} is not the row alone with zeros at the left",
            )
        diff = float((out[row : row + 1] - torch.cat(ref, dim=2)).abs().max())
        scale = float(v[row, :, pad:].abs().max())
        chk.require(
            diff <= atol * scale,
            "padding",
            f"attention of padded row {row} differs from the row alone by {diff:.3g} "
            f"(allowed {atol * scale:.3g})",
        )
        stored += alone.nbytes()["total"]
    chk.require(
        batch.nbytes()["total"] == stored,
        "padding",
        f"a padded batch holds {batch.nbytes()['total']} bytes, its rows alone {stored}: "
        "pads were stored",
    )


def check_method(
    method: Method,
    *,
    head_dim: int = 32,
    num_kv_heads: int = 2,
    batch: int = 2,
    num_query_heads: int | None = None,
    prompt_tokens: int | None = None,
    decode_tokens: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    round_trip_atol: Mapping[str, float] | None = None,
    attend_atol: float | None = None,
    bad_configs: Sequence[Mapping[str, object]] = (),
) -> MethodCheck:
    """Check ``method``'s contract (docs/plugins.md#testing-a-plugin); returns what was measured.

    Parameters
    ----------
    method : a configured (and, if it needs it, calibrated) method.
    head_dim, num_kv_heads, batch : the cache's ``D``, ``H_kv`` and ``B``.
    num_query_heads : ``H_q`` of the queries, a multiple of ``H_kv``; default ``2 * H_kv``
        (grouped-query attention: query head ``h`` reads KV head ``h // (H_q / H_kv)``).
    prompt_tokens, decode_tokens : default ``N_s + 2 * max(R, G, 1) + 1`` and
        ``max(R, G, 1) + 1`` from the config's ``num_sink_tokens`` (N_s),
        ``residual_length`` (R) and ``group_size`` (G), so that tokens are quantized at the
        prefill and flushed again while decoding.
    dtype : the cache dtype of keys, values and queries (float16, bfloat16, float32).
    seed : seed of the random keys, values and queries.
    round_trip_atol : ``{"key": ..., "value": ...}``: absolute bounds replacing the derived
        half-step bound (codecs that are not uniform integer codes).
    attend_atol : allowed ``|attend - reference|`` in units of ``max |v|``; default 1e-5 for a
        float32 cache, ``2 * eps`` of a float16 / bfloat16 one (``attend`` returns the query's
        dtype).
    bad_configs : configs (mappings) that ``Config.from_dict`` must refuse with a
        ``ValueError`` naming one of their fields, e.g. ``[{"bits": 0}, {"bits": 9}]``.

    Returns
    -------
    MethodCheck

    Raises
    ------
    AssertionError
        ``check_method(<method>): <check>: ...`` for the first check that failed (``config``,
        ``attend``, ``positions``, ``round trip``, ``bytes``, ``padding``).
    """
    chk = _Checker(method)
    if attend_atol is None:
        attend_atol = (
            1e-5 if dtype in (torch.float32, torch.float64) else 2 * torch.finfo(dtype).eps
        )
    _check_config(chk, method, bad_configs)
    caps = method.capabilities
    if not caps.layer_cache:
        raise chk.fail("config", "capabilities.layer_cache is False: no LayerCache to check")
    dp, dd = _default_lengths(method)
    prompt = dp if prompt_tokens is None else prompt_tokens
    steps = dd if decode_tokens is None else decode_tokens
    hq = 2 * num_kv_heads if num_query_heads is None else num_query_heads
    k, v, q = _data(batch, num_kv_heads, hq, prompt + steps, head_dim, dtype, seed)
    worst = [0.0]
    vmax = float(v.abs().max())

    def compare(lc: LayerCache, t: int, out: torch.Tensor) -> None:
        if not caps.keys_values:
            return
        keys, values = lc.keys_values()
        want = reference_attention64(q[:, :, t : t + 1], keys, values, None)
        err = float((out.double() - want).abs().max()) / vmax
        worst[0] = max(worst[0], err)
        chk.require(
            out.shape == want.shape and err <= attend_atol,
            "attend",
            f"attend() at decode position {t} differs from attention over keys_values() by "
            f"{err:.3g} x max|v| (allowed {attend_atol:g}; path {lc.attend_path or '?'})",
        )

    track: list[HeldPositions] = []
    lc, _ = _run(method, k, v, q, prompt, on_step=compare, track=track)
    pos = track[0].now()
    _check_positions(chk, lc, pos, prompt + steps)
    held = (held_inputs(k, pos), held_inputs(v, pos))
    errs, bounds = [0.0, 0.0], [0.0, 0.0]
    if caps.keys_values:
        errs, bounds = _check_round_trip(chk, method, lc, held, round_trip_atol or {})
    _check_bytes(chk, lc, k.element_size())
    padded = caps.padding
    if padded:
        pk, pv, pq = _data(2, num_kv_heads, hq, prompt + steps, head_dim, dtype, seed + 1)
        _check_padding(chk, method, pk, pv, pq, prompt, max(attend_atol, 1e-6))
    return MethodCheck(
        prompt, steps, lc.quantized_tokens(), errs[0], errs[1], bounds[0], bounds[1], worst[0],
        padded,
    )  # fmt: skip
