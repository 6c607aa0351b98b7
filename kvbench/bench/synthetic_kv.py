"""Synthetic Q/K/V: the seeded stand-ins for captured tensors, one function per named
distribution.

* ``channel-gaussian`` (:func:`channel_gaussian_qkv`): the memory workload's ``source:
  synthetic`` (a geometry, no model).  Per layer ``i`` a generator seeded ``seed * 1000 + i``
  draws the key scales ``s = exp(0.75 z)`` then offsets ``mu = z`` (``z ~ N(0, 1)``, one per
  (KV head, channel), ``[1, H_kv, 1, D]``); tokens come in chunks of 256, chunk ``c`` one
  draw ``x ~ N(0, 1)`` of ``[1, 2 H_kv + H_q, 256, D]`` from its own generator seeded
  ``(seed * 1000 + i) * 100003 + c``, cut to ``T`` tokens: keys ``x[:, :H_kv] * s + mu``
  (per-channel offsets and scales: the outlier channels of real keys), values ``0.5 *
  x[:, H_kv:2 H_kv]`` (N(0, 0.5^2)), queries ``x[:, 2 H_kv:]`` (N(0, 1)); no RoPE; float32,
  batch 1.
* ``rope-outliers`` (:func:`rope_outlier_qkv`, :func:`rope_outlier_queries`): post-RoPE Q/K/V
  of a model's shape, with the outlier channels real keys have, where only the shape matters
  (bytes at rest, transient peaks, decode-step time): a shape model (:mod:`kvbench.hf.shapes`)
  has random weights, so capturing its K/V would give neither real statistics nor anything
  cheaper than drawing them.  Defined below.

Both are prefix-stable: a shorter ``T`` is a prefix of a longer one for the same seed and layer.
(The fidelity workload's ``source: synthetic`` draws its own, a third distribution:
:meth:`kvbench.bench.workloads.fidelity.Fidelity._synthetic`.)

``rope-outliers`` (per layer, seeded; float32 draws cast chunk by chunk into ``dtype``):

* pre-RoPE keys ``k[b, h, t, c] = mu[h, c] + s[h, c] * z``, ``z ~ N(0, 1)``, with a per-channel
  offset ``mu ~ N(0, 0.5^2)`` (real keys have per-channel means, which is why KIVI quantizes
  keys per channel) and a per-channel scale ``s = exp(0.25 * N(0, 1))`` (median 1);
* outlier channels: ``outlier_pairs`` RoPE pairs per KV head (default 2, i.e. 4 of
  ``head_dim`` channels), fixed over tokens and drawn among the lowest-frequency half of the
  pairs (where real outliers sit: a slowly rotating pair keeps its magnitude in place), have
  scale ``outlier_scale`` (default 4.5, the ratio seen on SmolLM2-135M's captured keys:
  docs/design.md#model-shapes) times the median (:func:`channel_outlier_ratio` measures it)
  and offset ``0.5 * outlier_scale * N(0, 1)`` on both channels of the pair;
* RoPE is then applied with the shape's own inverse frequencies (``rope_theta`` and any
  scaling, e.g. Llama-3.1's ``llama3`` factor 8, through transformers'
  ``ROPE_INIT_FUNCTIONS``), rotate-half layout (channel ``i`` pairs with ``i + D/2``), at
  positions ``0..T-1``, so paired channels rotate as a model's do;
* values ``v = s_v[h, c] * z`` with ``s_v = exp(0.25 * N(0, 1))`` (no fixed outlier channels:
  KIVI's observation that values have none); queries ``N(0, 1)`` with the same RoPE.

One generator seeded ``(seed * 1000003 + layer) * 1009 + batch`` draws ``mu``, ``s``, ``s_v``
and the outlier pairs, in that order.  Tokens are drawn in chunks of 1024, each from its own
generator seed (K/V and queries apart), so a shorter ``T`` is a
prefix of a longer one for the same (seed, layer, batch), and the chunks are drawn on
``torch.get_num_threads()`` threads with the same values as one thread's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: per-layer ``(q [B, H_q, T, D], k [B, H_kv, T, D], v [B, H_kv, T, D])``
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: tokens per generator of ``channel-gaussian``
GAUSSIAN_CHUNK = 256


def channel_gaussian_qkv(
    num_layers: int, hq: int, hkv: int, t: int, d: int, seed: int
) -> list[QKV]:
    """The ``channel-gaussian`` distribution (module docstring): per layer ``(q [1, hq, t, d],
    k [1, hkv, t, d], v [1, hkv, t, d])`` float32.  A given (seed, layer) gives the same
    tensors for every ``t`` prefix length."""
    out = []
    heads, chunk = 2 * hkv + hq, GAUSSIAN_CHUNK
    for i in range(num_layers):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        scale = torch.exp(0.75 * torch.randn(1, hkv, 1, d, generator=g))
        offset = torch.randn(1, hkv, 1, d, generator=g)
        # chunks of 256 tokens, each from its own seed: a shorter t is a prefix of a longer one
        parts = [
            torch.randn(
                1,
                heads,
                chunk,
                d,
                generator=torch.Generator().manual_seed((seed * 1000 + i) * 100003 + c),
            )
            for c in range(-(-t // chunk))
        ]
        x = torch.cat(parts, dim=2)[:, :, :t] if parts else torch.zeros(1, heads, 0, d)
        k = x[:, :hkv] * scale + offset
        v = 0.5 * x[:, hkv : 2 * hkv]
        q = x[:, 2 * hkv :]
        out.append((q.contiguous(), k.contiguous(), v.contiguous()))
    return out


# ------------------------------------------------------------------ rope-outliers
#: tokens per generator of ``rope-outliers``
CHUNK = 1024
OUTLIER_PAIRS = 2
OUTLIER_SCALE = 4.5


def _text(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config: ``text_config`` of a multimodal config, else ``config``."""
    return getattr(config, "text_config", None) or config  # only multimodal configs have it


def inv_freq(config: PretrainedConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` float32 of a transformers ``config``
    (default RoPE or the scaled variants of ``transformers.modeling_rope_utils``)."""
    cfg = _text(config)
    rope = getattr(cfg, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if kind != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")[0].float()
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = float(theta if theta is not None else getattr(cfg, "rope_theta", 10000.0))
    d = _geometry(cfg)[3]
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``cos``/``sin`` ``[n, D]``, halves equal) with
    one output and half-size temporaries: the first half ``x1 cos - x2 sin`` (equal bit for
    bit to ``x1 cos + (-x2) sin``: negation is exact), the second ``x2 cos + x1 sin``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.mul(x1, c, out=out[..., :half])
    out[..., :half].sub_(x2 * s)
    torch.mul(x2, c, out=out[..., half:])
    out[..., half:].add_(x1 * s)
    return out


def qkv_nbytes(
    batch: int, hq: int, hkv: int, tokens: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one layer's ``(q, k, v)`` from :func:`rope_outlier_qkv` in ``dtype``."""
    el = torch.empty((), dtype=dtype).element_size()
    return batch * (hq + 2 * hkv) * tokens * head_dim * el


def available_bytes(device: torch.device | str = "cpu") -> int:
    """Memory a new allocation can use: CUDA ``mem_get_info()`` free bytes; CPU
    ``MemAvailable`` of ``/proc/meminfo`` (Linux), else free physical pages (``sysconf``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(nbytes: int, device: torch.device | str, what: str) -> None:
    """Raise ``MemoryError`` naming ``what`` and both sizes (GiB) when ``nbytes`` exceeds
    :func:`available_bytes` of ``device``; called before anything is allocated."""
    free = available_bytes(device)
    if nbytes > free:
        raise MemoryError(
            f"{what} needs about {nbytes / 2**30:.2f} GiB but {torch.device(device)} has "
            f"{free / 2**30:.2f} GiB available; lower batch or context, or use a larger machine"
        )


def _base_seed(seed: int, layer: int, batch: int) -> int:
    return (seed * 1_000_003 + layer) * 1009 + batch


def _chunk_rope(freq: torch.Tensor, c0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(c0, c0 + CHUNK, dtype=torch.float64)[:n]
    ang = (pos[:, None] * freq.double()[None, :]).float()
    return torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)


def _chunk_seed(base: int, c0: int) -> int:
    return (base * 7919 + c0 // CHUNK) * 2  # K/V: this seed; queries: this seed + 1


def _geometry(config: PretrainedConfig) -> tuple[PretrainedConfig, int, int, int]:
    """``(decoder config, H_q, H_kv, D)``; ``num_key_value_heads`` and ``head_dim`` are
    optional in transformers configs (default ``H_q`` and ``hidden_size / H_q``)."""
    cfg = _text(config)
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return cfg, hq, hkv, d


def _row_draws(seed: int, batch: int, heads: int, d: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(b, z)`` for each batch row ``b``: ``z [heads, CHUNK, D]`` float32 N(0, 1), the values
    of row ``b`` of ``torch.randn(batch, heads, CHUNK, D)`` from a generator seeded ``seed``
    (torch's CPU normal fills a contiguous tensor from the generator's stream in order, and a
    row holds a multiple of 16 values, so row by row draws the same stream; a test checks the
    values against the whole draw).  One reused buffer, so a row's RoPE and cast stay in cache."""
    g = torch.Generator().manual_seed(seed)
    z = torch.empty(heads, CHUNK, d)
    for b in range(batch):
        yield b, z.normal_(generator=g)


def rope_outlier_queries(
    config: PretrainedConfig,
    start: int,
    stop: int,
    batch: int = 1,
    seed: int = 0,
    layer: int = 0,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Post-RoPE queries ``[B, H_q, stop - start, D]`` of positions ``start..stop-1``: the same
    values as ``rope_outlier_qkv(...)[0][:, :, start:stop]`` (one generator per chunk of
    :data:`CHUNK` tokens), drawn without the K/V or the earlier chunks.  Raises
    ``ValueError`` unless ``0 <= start < stop``."""
    cfg, hq, _, d = _geometry(config)
    if not 0 <= start < stop:
        raise ValueError(f"need 0 <= start < stop, got start={start}, stop={stop}")
    base, freq = _base_seed(seed, layer, batch), inv_freq(cfg)
    out = torch.empty(batch, hq, stop - start, d, dtype=dtype, device=device)

    def one(c0: int) -> None:
        n = min(CHUNK, stop - c0)
        lo = max(start - c0, 0)
        cos, sin = _chunk_rope(freq, c0, n)
        for b, z in _row_draws(_chunk_seed(base, c0) + 1, batch, hq, d):
            q = _rope(z[:, :n], cos, sin)
            out[b, :, c0 + lo - start : c0 + n - start].copy_(q[:, lo:])

    _each_chunk(one, range(start - start % CHUNK, stop, CHUNK))
    return out


def _each_chunk(fn: Callable[[int], None], starts: Iterable[int]) -> None:
    """``fn(c0)`` for every chunk start, on up to ``torch.get_num_threads()`` Python threads
    (torch releases the GIL inside its operations; each chunk has its own generator and writes
    its own slice, so the values are those of one thread, bit for bit, and only the wall time
    changes: the draws are the generator's serial work)."""
    starts = list(starts)
    workers = min(torch.get_num_threads(), len(starts))
    if workers <= 1:
        for c0 in starts:
            fn(c0)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, starts))


def rope_outlier_qkv(
    config: PretrainedConfig,
    tokens: int,
    batch: int = 1,
    seed: int = 0,
    layer: int = 0,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    outlier_pairs: int = OUTLIER_PAIRS,
    outlier_scale: float = OUTLIER_SCALE,
    queries: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One layer's post-RoPE ``(q [B, H_q, T, D], k [B, H_kv, T, D], v [B, H_kv, T, D])`` in
    ``dtype`` on ``device`` for the attention geometry of ``config`` (see the module docstring
    for the ``rope-outliers`` distribution).  Raises ``ValueError`` for ``outlier_pairs`` outside
    ``[0, D/4]`` or non-positive sizes.  ``queries=False`` returns ``None`` for q (K/V are
    the same either way: queries come from their own generator; :func:`rope_outlier_queries`
    draws a range of them alone)."""
    cfg, hq, hkv, d = _geometry(config)
    if tokens < 1 or batch < 1:
        raise ValueError(f"tokens={tokens} and batch={batch} must be >= 1")
    if not 0 <= outlier_pairs <= d // 4:
        raise ValueError(f"outlier_pairs={outlier_pairs} must be in [0, {d // 4}] (head_dim {d})")
    base = _base_seed(seed, layer, batch)
    g = torch.Generator().manual_seed(base)
    half = d // 2
    mu = 0.5 * torch.randn(hkv, d, generator=g)
    s_k = torch.exp(0.25 * torch.randn(hkv, d, generator=g))
    s_k = s_k / s_k.median(dim=-1, keepdim=True).values
    s_v = torch.exp(0.25 * torch.randn(hkv, d, generator=g))
    for h in range(hkv):  # fixed outlier pairs among the lowest-frequency half of the pairs
        pairs = half // 2 + torch.randperm(half - half // 2, generator=g)[:outlier_pairs]
        for i in pairs.tolist():
            s_k[h, i] = s_k[h, i + half] = outlier_scale
            mu[h, i] = mu[h, i + half] = 0.5 * outlier_scale * float(torch.randn(1, generator=g))
    freq = inv_freq(cfg)
    heads = (hq, hkv, hkv) if queries else (hkv, hkv)
    out = [torch.empty(batch, n, tokens, d, dtype=dtype, device=device) for n in heads]

    def one(c0: int) -> None:
        n = min(CHUNK, tokens - c0)
        cos, sin = _chunk_rope(freq, c0, n)
        sl = slice(c0, c0 + n)
        for b, z in _row_draws(_chunk_seed(base, c0), batch, 2 * hkv, d):
            z = z[:, :n]
            # in place on the draw (products and sums commute exactly): mu + s_k z, s_v z;
            # the cast to dtype (and device) in the copy
            out[-2][b, :, sl].copy_(_rope(z[:hkv].mul_(s_k[:, None]).add_(mu[:, None]), cos, sin))
            out[-1][b, :, sl].copy_(z[hkv:].mul_(s_v[:, None]))
        if queries:
            for b, z in _row_draws(_chunk_seed(base, c0) + 1, batch, hq, d):
                out[0][b, :, sl].copy_(_rope(z[:, :n], cos, sin))

    _each_chunk(one, range(0, tokens, CHUNK))
    return (out[0], out[1], out[2]) if queries else (None, out[0], out[1])


def channel_outlier_ratio(k: torch.Tensor) -> float:
    """Max over channels / median over channels of mean |K| per (KV head, channel), averaged
    over heads, for ``k [B, H_kv, T, D]`` (the statistic quoted for real keys: ~4-5)."""
    m = k.double().abs().mean(dim=(0, 2))  # [H_kv, D]
    return float((m.max(dim=-1).values / m.median(dim=-1).values).mean())


def synthetic_calibration(
    config: PretrainedConfig, tokens: int, seed: int = 0, layers: Iterable[int] | None = None
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[str, object]]:
    """Calibration K/V for a shape model (random weights: a capture would mean nothing):
    ``({layer: k [1, H_kv, tokens, D]}, {layer: v}, info)`` float32 for ``layers`` (default:
    every layer of ``config``; ``rope-outliers``), drawn with ``seed + 1`` so they differ from
    the K/V a workload then measures."""
    cfg = _text(config)
    keys, values = {}, {}
    for layer in range(cfg.num_hidden_layers) if layers is None else layers:
        _, k, v = rope_outlier_qkv(cfg, tokens, 1, seed + 1, layer, torch.float32, queries=False)
        keys[layer], values[layer] = k, v
    # the recorded text names the module where this generator lived: records stay unchanged
    info = {"source": "kvbench.bench.workloads.synthetic_kv (shape model)", "tokens": tokens}
    return keys, values, {"dataset": info}


def shape_inputs(
    config: PretrainedConfig,
    model_info: dict[str, Any],
    context: int,
    batch: int,
    layers: str | Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    query_tokens: int | None = None,
) -> tuple[list[QKV], list[int], dict[str, Any]]:
    """The memory workload's inputs for a shape model: per measured layer ``(q, k, v)`` of
    :func:`rope_outlier_qkv` at ``batch`` x ``context``, the layer ids, and the manifest info.
    ``query_tokens``: draw queries only for the last that many positions (``q`` is then
    ``[B, H_q, query_tokens, D]``; :func:`rope_outlier_queries` draws the earlier ones when a
    method needs them at prefill); default all ``context``.

    ``layers``: ``"all"`` measures layer 0 only (every layer of these models has one shape, so
    the model's total is ``num_hidden_layers`` x that layer's bytes; see
    :func:`kvbench.bench.workloads.memory.whole_cache`),
    or a list of layer indices.  The memory the run will need (inputs, caches, the read-back
    K/V and the float64 error terms) is checked against the device's available memory first.

    Raises
    ------
    ValueError
        ``context`` above the shape's ``max_position_embeddings``, or a layer index outside it.
    MemoryError
        The estimate exceeds the available memory (nothing has been allocated).
    """
    cfg = _text(config)
    query_tokens = context if query_tokens is None else query_tokens
    full = model_info.get("shape_num_hidden_layers") or cfg.num_hidden_layers
    name = model_info.get("model_id", "the shape")
    max_pos = model_info.get("max_position_embeddings") or 1 << 30
    if context > max_pos:
        raise ValueError(f"context={context} exceeds {name}'s maximum context {max_pos}")
    ids = [0] if layers == "all" else list(layers)
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < full]
    if bad:
        raise ValueError(f"layers={layers} names layers outside [0, {full}) of {name}")
    hq, hkv, d = (model_info[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    el = torch.empty((), dtype=dtype).element_size()
    side = batch * hkv * context * d * el  # one side (K or V) of one layer in dtype
    # inputs (K/V, and the prefill queries a method may ask for), one layer's cache (<= K/V),
    # the quantizer's float32 working copy of a side, the read-back K/V (<= float32)
    need = len(ids) * (qkv_nbytes(batch, hq, hkv, context, d, dtype) + 2 * side)
    need += 2 * side * 4 // el + 2 * side * 4 // el
    check_fits(need, device, f"memory run of {name} at batch {batch} x context {context} ({dtype})")
    start = max(context - query_tokens, 0)
    qkv = []
    for i in ids:
        _, k, v = rope_outlier_qkv(cfg, context, batch, seed, i, dtype, device, queries=False)
        q = rope_outlier_queries(cfg, start, context, batch, seed, i, dtype, device)
        qkv.append((q, k, v))
    info = {  # kv_source names the module where the generator lived: records stay unchanged
        "kv_source": "synthetic K/V of the model shape (kvbench.bench.workloads.synthetic_kv)",
        "kv_distribution": f"keys: per-channel offset and lognormal scale, {OUTLIER_PAIRS} "
        f"fixed outlier RoPE pairs per KV head at {OUTLIER_SCALE}x the median scale, RoPE of "
        "the shape applied; values: lognormal per-channel scale, no outlier channels",
        "random_weights": True,
        "seed": seed,
        "batch": batch,
        "layers_measured": ids,
        "num_hidden_layers": full,
        "memory_estimate_bytes": need,
        "queries_drawn": f"last {min(query_tokens, context)} positions; the prefill's only "
        "for methods that need queries at prefill (Method.needs_queries)",
    }
    return qkv, ids, info
