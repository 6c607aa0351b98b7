"""``memory``: measured bytes at rest and the transient peak of a decode step; what each metric
measures and how: docs/design.md#memory, shape models: docs/design.md#model-shapes.

Protocol per layer: K/V of ``context`` (d) tokens, either captured once from the model
(:func:`kvbench.hf.capture.capture_qkv`, post-RoPE, ``source: model``) or drawn from a seeded
generator (``source: synthetic``, no model needed), are cast to ``dtype`` (default ``float16``,
the paper's FP16 storage; recorded) and replayed into a fresh cache of the method: prefill
``d - appends`` tokens (with their post-RoPE queries), then ``appends`` single-token decode steps,
so the cache holds exactly d tokens at the end.  Each step stores its token and runs the
deferred flush; only the last two also read the cache by ``path`` (the last is the measured
step; the one before it warms the kernels it runs, so first-call allocations stay out of the
measured peak, and feeds a method that observes attention, e.g. SemKV, as a real step would:
without it such records change).  Otherwise a read changes nothing the cache holds.  kvbench
methods replay into their :class:`~kvbench.cache.layer.LayerCache` (``append``, read K/V,
``end_step``); peers (``capabilities.layer_cache=False``) into the transformers cache layer they
wrap (``new_hf_layer().update``; bytes from :func:`kvbench.hf.peers.hf_layer_nbytes`).

Metrics, summed over layers (the whole cache: :func:`whole_cache` scales a subset of layers,
e.g. a shape model's layer 0, to all of them; the manifest's ``bytes_total_is`` says so):

* bytes: ``bytes_total`` and its breakdown ``bytes_codes``, ``bytes_scales``,
  ``bytes_metadata``, ``bytes_residual``, ``bytes_sinks``, ``bytes_key_total``,
  ``bytes_value_total``; ``bytes_per_layer`` (the mean over the measured layers);
* bits: ``effective_bits`` = 8 x bytes / stored K and V elements (``effective_key_bits``,
  ``effective_value_bits``), ``nominal_key_bits``/``nominal_value_bits``
  (docs/methods.md#average-bits, T_q = d) and ``analytic_bits`` (``analytic_key_bits``,
  ``analytic_value_bits``): that formula on the cache's actual split of quantized and
  full-precision tokens;
* ``peak_step_bytes``: peak bytes allocated by the last step above those before it, max over
  layers; the step by ``path`` (recorded as ``peak_step_path``): ``attend`` = store +
  ``LayerCache.attend(query)`` + flush, ``reference`` = store + ``keys_values()`` + flush, peers
  their layer's ``update``;
* ``key_mse``/``value_mse``: float64 error of the dequantized K/V held at the end (a shape model
  at ``batch`` > 1: row 0 only, after bytes and peak were taken from all rows; ``errors_cover``);
* CUDA only, in bytes above the allocation before the first cache: ``cuda_bytes_total`` (every
  layer's cache alive) and ``cuda_peak_bytes`` (highest over the replay, prefill included).

K/V: ``source: synthetic`` draws the ``channel-gaussian`` distribution, a shape model's K/V the
``rope-outliers`` one whatever ``source`` says (:mod:`kvbench.bench.synthetic_kv`).  The
transient peak is :func:`kvbench.measure.peak.transient_peak`.  All configurations share one
process.  A run whose tensors would not fit the device's available memory is refused before
allocating.

Fill (``fill``): ``steps`` (default) is the protocol above.  ``chunks`` replays the perplexity
workload's fill instead, so that a cache whose stored state depends on how its tokens arrive
(transformers' quanto and HQQ caches quantize the whole prompt, then re-quantize everything each
time their residual reaches ``residual_length``) holds here what it held when the perplexity
workload scored it (docs/design.md#memory): prefill ``prefill`` (P) tokens, then the tokens
P..d-1 in the chunks of ``chunk`` (C) tokens that the perplexity workload feeds
(:func:`~kvbench.bench.workloads.perplexity.chunk_spans`; its T = d + 1).  A peer takes each
chunk as one ``update``, as the perplexity workload's peer call does, and its last chunk is the
measured step (its ``peak_step_bytes`` covers that call, ``peak_step_tokens`` in the manifest).  A
kvbench cache takes each chunk in calls cut where :meth:`~kvbench.cache.layer.LayerCache.steady_appends`
allows (the perplexity workload's ``exact-chunked`` protocol: each call leaves what one-token steps
leave), without reads, except that an evicting method reads at every token (one token per
call, as under ``steps``); its last two tokens are the two reading steps above, the last one
measured (one token, as under ``steps``).  A method that observes attention (SemKV) is not read
before those two, as under ``steps``: its stored sizes depend on the K/V values, and the
perplexity workload's decode K/V come from a model attending to the quantized cache, not from
this capture, so no replay holds its exact cache (reading every token would cost about 20x
the rest of its replay).  ``appends`` does not apply (left out of the spec).

Parameters: ``context`` (d, default 2048), ``appends`` (decode steps after prefill, default 4),
``source`` (``model`` | ``synthetic``), ``text`` and ``window`` (captured text, default
``essays``, 0), ``dtype`` (``float16`` | ``bfloat16`` | ``float32``), ``layers`` (``all`` or a
list of indices), ``path`` (``attend`` | ``reference``, the decode step ``peak_step_bytes``
measures), ``batch`` (rows, default 1; above 1 only with a shape model), and for
``synthetic`` the geometry ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``
(default 4 x 9/3 x 64, the default model's heads); each source keeps only its own parameters
(``Workload.SOURCE_PARAMS``, docs/design.md#suites-and-workloads); ``fill`` (``steps`` |
``chunks``, :data:`FILLS`) with, for ``chunks`` only and then required, ``prefill`` (P, 1..d-2)
and ``chunk`` (C, 1..d-P).  ``fill: steps`` stays out of the spec (run ids of earlier records).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbench.bench.context import Capture, RunContext
from kvbench.bench.metrics import LOWER, NONE, STORAGE_METRICS
from kvbench.bench.synthetic_kv import QKV, channel_gaussian_qkv
from kvbench.cache.method import STORAGE_DTYPES, Method
from kvbench.fields import Field
from kvbench.hf.peers import hf_layer_keys_values, hf_layer_tensors
from kvbench.measure.peak import transient_peak

from . import KV_SOURCE_PARAMS, LAYERS, SOURCES, Result, Workload, check_kv_heads, reject
from .perplexity import chunk_spans

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: batch rows whose K/V errors a shape model's run reads back at batch > 1 (``Memory.error_rows``)
ERROR_ROWS = 1
BYTE_CATEGORIES = ("codes", "scales", "metadata", "residual", "sinks")
#: how the replay fills the cache before the measured step (module docstring, "Fill")
FILLS = {
    "steps": "prefill context - appends tokens, then appends one-token steps",
    "chunks": "the perplexity workload's fill: prefill P, then chunks of C (exact-chunked)",
}


def chunked_mse(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean squared error of ``got`` vs ``ref`` (both ``[B, H, T, D]``) in float64, as
    :func:`kvbench.bench.metrics.key_mse`, one (row, head) at a time so the float64
    working memory stays one head's (32 MiB at 32K x 128) rather than the whole tensor's."""
    total = 0.0
    for b in range(ref.shape[0]):
        for h in range(ref.shape[1]):
            diff = ref[b, h].double().sub_(got[b, h]).flatten()  # one float64 buffer
            total += float(torch.dot(diff, diff))
    return total / max(ref.numel(), 1)


#: what ``Replay.step`` runs for each ``path`` (recorded as ``peak_step_path``)
STEP_PATHS = {
    "attend": "append + LayerCache.attend(query) + end_step (the decode path the latency "
    "workload and the model run by default)",
    "reference": "append + LayerCache.keys_values() (dequantized K/V for sdpa) + end_step",
}
PEER_STEP = "transformers cache layer update (returns the K/V sdpa reads)"


class Replay:
    """One layer's cache of ``method`` behind one protocol (kvbench ``LayerCache`` or a peer's
    transformers layer): ``prefill``, ``step`` (one decode token: store + the step's read of
    the cache, by ``path`` (:data:`STEP_PATHS`) + the deferred flush), ``tensors``, ``read``
    (dequantized K/V at rest).  ``path="reference"`` falls back to ``attend`` for methods
    without ``keys_values``."""

    def __init__(
        self,
        method: Method,
        layer_idx: int,
        hkv: int,
        d: int,
        dtype: torch.dtype,
        device: torch.device,
        path: str = "attend",
    ) -> None:
        if path not in STEP_PATHS:
            raise ValueError(f"path={path!r} is not allowed; allowed: {sorted(STEP_PATHS)}")
        self.method = method
        self.peer = not method.capabilities.layer_cache
        self.attend = path == "attend" or not method.capabilities.keys_values
        if self.peer:
            self.layer = method.new_hf_layer()
        else:
            self.layer = method.new_layer(layer_idx, hkv, d, dtype, device)

    def prefill(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> None:
        if self.peer:
            self.layer.update(k, v)
        else:
            self.layer.prefill(k, v, queries=q)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One decode token stored and flushed as ``step`` does, without the step's read."""
        if self.peer:
            self.layer.update(k, v)
        else:
            self.layer.append(k, v)
            self.layer.end_step()

    def step(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> None:
        if self.peer:
            out = self.layer.update(k, v)
        else:
            self.layer.append(k, v)
            out = self.layer.attend(q) if self.attend else self.layer.keys_values()
            self.layer.end_step()
        del out

    @property
    def path(self) -> str:
        """What ``step`` runs, for the record (with the attend path the layer took)."""
        if self.peer:
            return PEER_STEP
        if not self.attend:
            return STEP_PATHS["reference"]
        ran = getattr(self.layer, "attend_path", None)
        return STEP_PATHS["attend"] + (f"; attend_path={ran}" if ran else "")

    def tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return hf_layer_tensors(self.layer) if self.peer else self.layer.tensors()

    def nbytes(self) -> list[tuple[str, str, int]]:
        """``(side, category, bytes)`` per stored tensor (peers: storage of inner tensors)."""
        if self.peer:
            return [(s, c, t.untyped_storage().nbytes()) for s, c, t in self.tensors()]
        return [(s, c, t.numel() * t.element_size()) for s, c, t in self.tensors()]

    def read(self, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Dequantized K/V at rest ``[B, H_kv, T, D]`` (``None`` without ``keys_values``).

        ``rows``: only the first ``rows`` batch rows ``[rows, H_kv, T, D]``.  A kvbench cache
        first drops its other rows (``LayerCache.index_batch``, in place: the last use of the
        cache, after its bytes and peak are taken), so only those rows are dequantized; a peer
        dequantizes all and the rows are sliced."""
        if self.peer:
            k, v = hf_layer_keys_values(self.layer)
            return (k, v) if rows is None else (k[:rows], v[:rows])
        if not self.method.capabilities.keys_values:
            return None
        if rows is not None and rows < self.layer.batch_size:
            self.layer.index_batch(torch.arange(rows))
        return self.layer.keys_values()


def per_element_bits(terms: dict[str, float]) -> float:
    """Bits per quantized element from docs/methods.md#average-bits: ``b_eff + m_q / G + m_sal``."""
    if terms["b_eff"] >= 16:
        return float(terms["b_eff"])
    return terms["b_eff"] + terms["m_q"] / terms["group"] + terms["m_sal"]


#: byte counts at rest that :func:`whole_cache` scales from the measured layers to all layers
AT_REST = (
    "bytes_total",
    "bytes_key_total",
    "bytes_value_total",
    *(f"bytes_{c}" for c in BYTE_CATEGORIES),
)


def whole_cache(metrics: dict[str, float], measured: int, num_layers: int) -> dict[str, float]:
    """``bytes_total`` (and every byte count of :data:`AT_REST`) as the whole cache of
    ``num_layers`` layers, and ``bytes_per_layer`` = the mean over the ``measured`` layers.

    ``metrics`` holds the sums over the measured layers; when fewer than ``num_layers`` were
    measured (a shape model measures layer 0, a ``layers`` list a subset), each sum becomes
    ``num_layers`` x its per-layer mean (the layers of these models share one shape)."""
    if measured < 1 or num_layers < measured:
        raise ValueError(f"whole_cache: measured={measured} of num_layers={num_layers}")
    out = {"bytes_per_layer": metrics["bytes_total"] / measured}
    if measured != num_layers:
        out.update({k: metrics[k] * num_layers / measured for k in AT_REST if k in metrics})
    return out


class Memory(Workload):
    type = "memory"
    METRICS = {**STORAGE_METRICS, "analytic_bits": LOWER, "held_token_fraction": NONE}
    needs_model = False  # ``source: synthetic`` runs without one
    accepts_random_weights = True  # a shape model: K/V of its shape (rope-outliers)
    shape_forward = False  # only the config is read (meta device)
    shape_reads_data = False  # a shape model's K/V are drawn (rope-outliers), not a text
    layer_cache = False  # peers run through their transformers layers
    LIST_PARAMS = frozenset({"layers"})
    SOURCE_PARAMS = KV_SOURCE_PARAMS
    PARAMS = {
        "context": 2048,
        "appends": 4,
        "source": "model",
        "text": "essays",
        "window": 0,
        "dtype": "float16",
        "layers": "all",
        "num_layers": 4,
        "num_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
        "path": "attend",
        "batch": 1,
        "fill": "steps",
        "prefill": None,
        "chunk": None,
    }
    FIELDS = {
        "context": Field(int, low=2),
        "appends": Field(int, low=1),
        "source": SOURCES,
        "path": Field(str, choices=tuple(sorted(STEP_PATHS))),
        "dtype": Field(str, choices=tuple(sorted(DTYPES))),
        "fill": Field(str, choices=tuple(FILLS)),
        "prefill": Field(int, low=1, optional=True),
        "chunk": Field(int, low=1, optional=True),
        "layers": LAYERS,
        **{
            k: Field(int, low=1)
            for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "batch")
        },
    }

    @classmethod
    def check(cls, spec: dict[str, Any], pre: str) -> None:
        d, a = spec["context"], spec["appends"]
        if spec["fill"] == "chunks":
            p, c = spec["prefill"], spec["chunk"]
            if p is None or not 1 <= p <= d - 2:
                reject(pre, "prefill", p, f"integers 1..{d - 2} (< context - 1) with fill: chunks")
            if c is None or not 1 <= c <= d - p:
                reject(
                    pre, "chunk", c, f"integers 1..{d - p} (<= context - prefill) with fill: chunks"
                )
            if a != cls.PARAMS["appends"]:
                reject(pre, "appends", a, "unset with fill: chunks (the chunks set the steps)")
            del spec["appends"]
        else:
            for k in ("prefill", "chunk"):
                if spec[k] is not None:
                    reject(pre, k, spec[k], "unset with fill: steps (set fill: chunks)")
            if a >= d:
                reject(pre, "appends", a, f"integers 1..{d - 1} (< context={d})")
            # the default stays out of the spec: run ids of records kept
            for k in ("fill", "prefill", "chunk"):
                del spec[k]
        if spec["batch"] == 1:  # the default stays out of the spec: run ids of records kept
            del spec["batch"]
        check_kv_heads(spec, pre)

    @property
    def prefill_tokens(self) -> int:
        """Tokens the replay prefills (P): ``prefill`` under ``fill: chunks``, else
        ``context - appends``."""
        s = self.spec
        return s["prefill"] if s.get("fill") == "chunks" else s["context"] - s["appends"]

    # ------------------------------------------------------------------ inputs
    def calibration_kv(
        self, seed: int, tokens: int
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[str, object]] | None:
        """``source: synthetic``: the ``tokens`` positions after the measured ``context`` of
        the same seeded generator (:func:`~kvbench.bench.synthetic_kv.channel_gaussian_qkv`
        is prefix-stable), so calibration sees
        the measured channels' distribution but none of the measured tokens."""
        s = self.spec
        if s["source"] != "synthetic":
            return None
        d = s["context"]
        qkv = channel_gaussian_qkv(
            s["num_layers"], s["num_heads"], s["num_kv_heads"], d + tokens, s["head_dim"], seed
        )
        keys = {i: k[:, :, d:].contiguous() for i, (_, k, _) in enumerate(qkv)}
        values = {i: v[:, :, d:].contiguous() for i, (_, _, v) in enumerate(qkv)}
        info = {"source": "synthetic (memory workload, positions after context)", "seed": seed}
        return keys, values, {"dataset": info, "tokens": tokens}

    def prepare(self, ctx: RunContext) -> None:
        s = self.spec
        d = s["context"]
        self.shape = bool(ctx.model_info.get("random_weights"))
        if self.shape:  # shape model: K/V of its shape, one layer unless `layers` says more
            from kvbench.bench.synthetic_kv import shape_inputs

            self.device = ctx.device
            self.qkv, self.layer_ids, self.info = shape_inputs(
                ctx.model.config, ctx.model_info, d, s.get("batch", 1), s["layers"],
                DTYPES[s["dtype"]], self.device, ctx.seed, query_tokens=d - self.prefill_tokens,
            )  # fmt: skip
            self.config, self.seed = ctx.model.config, ctx.seed
            self.num_layers = self.info["num_hidden_layers"]
            ctx.shared.shape_layers_measured = tuple(self.layer_ids)  # what to calibrate
            return
        if s.get("batch", 1) != 1:
            raise ValueError("memory: batch > 1 needs a shape model (model: {shape: ...})")
        if s["source"] == "synthetic":
            self.qkv = channel_gaussian_qkv(
                s["num_layers"], s["num_heads"], s["num_kv_heads"], d, s["head_dim"], ctx.seed
            )
            self.layer_ids = list(range(s["num_layers"]))
            self.info = {"kv_source": "synthetic", "seed": ctx.seed}
        else:
            self._capture(ctx)
        self.num_layers = len(self.layer_ids)  # the whole cache's layers (bytes_total)
        if s["layers"] != "all":
            keep = [self.layer_ids.index(i) for i in s["layers"] if i in self.layer_ids]
            if len(keep) != len(s["layers"]):
                raise ValueError(f"layers={s['layers']} names layers outside {self.layer_ids}")
            self.qkv = [self.qkv[i] for i in keep]
            self.layer_ids = [self.layer_ids[i] for i in keep]
        self.device = ctx.device if s["source"] == "model" else torch.device("cpu")

    def _capture(self, ctx: RunContext) -> None:
        s = self.spec
        d = s["context"]
        if ctx.model is None:
            raise ValueError(
                "memory workload with source: model needs a model; use source: synthetic for "
                "model-free runs"
            )
        self.check_context(ctx, "context")
        from kvbench.data.loaders import load_text, token_windows
        from kvbench.hf.capture import capture_qkv

        # one capture serves every shorter context of the same text (causal: a prefix's K/V do
        # not depend on later tokens)
        key = ("memory-capture", s["text"], s["window"])
        got = ctx.shared.captures.get(key)
        if got is None or got.tokens < d:
            text, tinfo = load_text(s["text"])
            ids, winfo = token_windows(ctx.tokenizer, text, d, s["window"] + 1)
            captured = capture_qkv(ctx.model, ids[s["window"] : s["window"] + 1])
            got = Capture(captured, {"dataset": tinfo, "windows": winfo}, tokens=d)
            ctx.shared.captures[key] = got
        c, info = got.qkv, got.info
        self.qkv = [
            (q[:, :, :d], k[:, :, :d], v[:, :, :d]) for q, k, v in zip(c.queries, c.keys, c.values)
        ]
        self.layer_ids = list(c.layer_ids)
        self.info = {"kv_source": "model capture (post-RoPE)", **info}

    # ------------------------------------------------------------------ run
    def run(self, ctx: RunContext, method: Method) -> Result:
        """The replay, bytes, peak and errors of ``method`` (see the module docstring), with
        glibc serving the run's allocations from its heap (:func:`kvbench.measure.heap.heap_reuse`:
        no fresh pages for every large temporary; nothing measured changes)."""
        from kvbench.measure.heap import heap_reuse

        with heap_reuse() as reused:
            result = self._run(ctx, method)
        result.info["allocator"] = (
            "glibc heap reuse during the run (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD 1 GiB)"
            if reused
            else "default"
        )
        return result

    def _run(self, ctx: RunContext, method: Method) -> Result:
        s = self.spec
        d, p = s["context"], self.prefill_tokens
        chunks = s.get("fill") == "chunks"
        dtype, dev = DTYPES[s["dtype"]], self.device
        inputs = [tuple(x.to(dev, dtype) for x in qkv) for qkv in self.qkv]
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        caches, peaks, peak_how, cuda_peak = [], [], "", 0
        last = 1  # tokens of the measured step
        for idx, (q, k, v) in zip(self.layer_ids, inputs):
            r = Replay(method, idx, k.shape[1], k.shape[3], dtype, dev, path=s["path"])
            q0 = d - q.shape[2]  # a shape model's queries start at the decode steps
            r.prefill(k[:, :, :p], v[:, :, :p], self._prefill_queries(method, idx, q, p, r))
            if chunks:
                t = self._fill_chunks(method, r, q, k, v, q0)
            else:
                for t in range(p, d - 1):
                    kt, vt = k[:, :, t : t + 1], v[:, :, t : t + 1]
                    # the step before the measured one reads too (warms kernels); an evicting
                    # method's every step reads (its decode evictions may score by that attention)
                    if t == d - 2 or method.capabilities.evicts:
                        r.step(kt, vt, q[:, :, t - q0 : t - q0 + 1])
                    else:  # earlier steps: store and flush, no read (nothing at rest changes)
                        r.store(kt, vt)
                t = d - 1
            last = d - t
            kt, vt, qt = k[:, :, t:].clone(), v[:, :, t:].clone(), q[:, :, t - q0 :].clone()
            if cuda:  # the allocator's peak so far, before transient_peak resets it
                cuda_peak = max(cuda_peak, torch.cuda.max_memory_allocated(dev) - base)
            peak, peak_how = transient_peak(
                lambda r=r, kt=kt, vt=vt, qt=qt: r.step(kt, vt, qt), dev
            )
            peaks.append(peak)
            caches.append(r)
            if cuda:
                cuda_peak = max(cuda_peak, torch.cuda.memory_allocated(dev) - base + peak)
        metrics: dict[str, float] = {}
        if cuda:
            torch.cuda.synchronize(dev)
            metrics["cuda_bytes_total"] = torch.cuda.memory_allocated(dev) - base
            metrics["cuda_peak_bytes"] = max(cuda_peak, torch.cuda.max_memory_allocated(dev) - base)
        metrics.update(self._bytes(method, caches, inputs, peaks))
        if not method.capabilities.evicts:  # it holds fewer tokens: no token-wise error
            metrics.update(self._errors(caches, inputs))
        metrics.update(whole_cache(metrics, len(caches), self.num_layers))
        per_layer = {
            "layers": self.layer_ids,
            "bytes_per_layer": [sum(n for _, _, n in c.nbytes()) for c in caches],
            "peak_step_bytes": peaks,
        }
        info = {
            **self.info,
            "kv_dtype": s["dtype"],
            "context": d,
            "prefill_tokens": p,
            **(
                {"fill": FILLS["chunks"], "chunk": s["chunk"], "peak_step_tokens": last}
                if chunks
                else {"decode_appends": s["appends"]}
            ),
            "cache_kind": "transformers layer (peer)" if caches[0].peer else "kvbench LayerCache",
            "peak_step_bytes_measured_by": peak_how,
            "peak_step_path": sorted({c.path for c in caches}),
            "peak_step_bytes_covers": "one decode step of the cache by peak_step_path: store, "
            "the step's read of the cache, flush; max over layers",
            "process": "shared by all configurations of the suite",
        }
        if "key_mse" in metrics:
            rows = self.error_rows(inputs[0][1].shape[0])
            info["errors_cover"] = (
                "every batch row"
                if rows is None
                else f"batch rows [0, {rows}) of "
                f"{inputs[0][1].shape[0]} (all KV heads and tokens); bytes and peak: all rows"
            )
        info["bytes_total_is"] = (
            f"the whole cache, measured on all {self.num_layers} layers"
            if len(caches) == self.num_layers
            else f"the whole cache: {self.num_layers} layers x bytes_per_layer measured on "
            f"layers {self.layer_ids} (every bytes_* at rest scaled alike; the layers share one "
            "shape)"
        )
        return Result(metrics, per_layer, info)

    def _fill_chunks(
        self,
        method: Method,
        r: Replay,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q0: int,
    ) -> int:
        """``fill: chunks`` after the prefill (module docstring, "Fill"): feed the perplexity
        workload's chunks up to the measured step of ``r`` and return the position where that
        step starts (its tokens ``t..d-1``: a peer's last chunk, a kvbench cache's last token).
        ``q``/``k``/``v`` ``[B, H, T, D]``: the layer's inputs, ``q`` from position ``q0``."""
        d, c = self.spec["context"], self.spec["chunk"]
        spans = chunk_spans(self.prefill_tokens, d, c)
        if r.peer:  # each chunk one update, as the perplexity workload's peer call
            for s, e in spans[:-1]:
                r.store(k[:, :, s:e], v[:, :, s:e])
            return spans[-1][0]
        layer = r.layer
        # exact-chunked with per-query views, as the perplexity workload's attend route: a
        # sliding window's call keeps its chunk (nothing here reads the views; the state the
        # call leaves is that of one-token steps)
        layer.step_views = method.capabilities.keys_values
        reads = method.capabilities.evicts
        for s, e in spans:
            e = min(e, d - 2)  # the last two tokens: the reading steps below
            while s < e:
                if reads:  # one token per call, read as one-token decode reads it
                    r.step(k[:, :, s : s + 1], v[:, :, s : s + 1], q[:, :, s - q0 : s - q0 + 1])
                    s += 1
                    continue
                m = s + 1 + layer.steady_appends(e - s - 1)  # exact-chunked cut
                r.store(k[:, :, s:m], v[:, :, s:m])
                s = m
        t = d - 2  # the step before the measured one reads (warms kernels), as under steps
        r.step(k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t - q0 : t - q0 + 1])
        return d - 1

    def _prefill_queries(
        self, method: Method, idx: int, q: torch.Tensor, p: int, r: Replay
    ) -> torch.Tensor | None:
        """The prefill's post-RoPE queries ``[B, H_q, p, D]``: captured/synthetic ones as held;
        for a shape model (queries held for the decode steps only) drawn by
        :func:`~kvbench.bench.synthetic_kv.rope_outlier_queries` for a method that needs
        them at prefill (once per workload, then shared), else ``None``."""
        if q.shape[2] >= self.spec["context"]:
            return q[:, :, :p]
        if r.peer or not method.needs_queries:
            return None
        from kvbench.bench.synthetic_kv import rope_outlier_queries

        # drawn once per workload and layer, shared by the methods that ask (the draw is
        # seeded, so every method sees the same queries either way; methods only read them)
        key = (idx, p, q.shape[0], q.dtype, q.device)
        cache = self.__dict__.setdefault("_prefill_q", {})
        if key not in cache:
            cache.clear()
            cache[key] = rope_outlier_queries(
                self.config, 0, p, q.shape[0], self.seed, idx, q.dtype, q.device
            )
        return cache[key]

    def _bytes(
        self, method: Method, caches: list[Replay], inputs: list[QKV], peaks: list[float]
    ) -> dict[str, float]:
        by: dict[tuple[str, str], int] = {}
        for c in caches:
            for side, cat, n in c.nbytes():
                by[side, cat] = by.get((side, cat), 0) + n
        side_total = {s: sum(n for (sd, _), n in by.items() if sd == s) for s in ("key", "value")}
        m: dict[str, float] = {
            f"bytes_{cat}": sum(n for (_, c), n in by.items() if c == cat)
            for cat in BYTE_CATEGORIES
        }
        m["bytes_key_total"], m["bytes_value_total"] = side_total["key"], side_total["value"]
        m["bytes_total"] = side_total["key"] + side_total["value"]
        elems = sum(k.numel() for _, k, _ in inputs)  # per side; K and V have one shape
        held = elems  # elements held per side: fewer for an evicting method
        if method.capabilities.evicts:
            frac = sum(c.layer.seq_length for c in caches) / sum(
                c.layer.seen_tokens for c in caches
            )
            m_held = {"held_token_fraction": frac}
            held = elems * frac
        else:
            m_held = {}
        # bits of a full-precision element as stored: the config's storage_dtype, else as computed
        storage = method.config.storage_dtype
        el_bits = 8 * (STORAGE_DTYPES[storage].itemsize if storage else inputs[0][1].element_size())
        m["effective_key_bits"] = 8 * side_total["key"] / elems
        m["effective_value_bits"] = 8 * side_total["value"] / elems
        m["effective_bits"] = 8 * m["bytes_total"] / (2 * elems)
        head_dim = inputs[0][1].shape[-1]
        d = self.spec["context"]
        nominal = method.average_bits(head_dim=head_dim, tokens=d)
        m["nominal_key_bits"], m["nominal_value_bits"] = nominal["key_bits"], nominal["value_bits"]
        # analytic: quantized tokens at the formula's per-element cost, fp tokens at el_bits
        for side, terms in (("key", nominal["key_terms"]), ("value", nominal["value_terms"])):
            fp_bytes = by.get((side, "residual"), 0) + by.get((side, "sinks"), 0)
            fp_elems = fp_bytes * 8 / el_bits
            q_elems = max(held - fp_elems, 0)
            m[f"analytic_{side}_bits"] = (q_elems * per_element_bits(terms) + fp_bytes * 8) / elems
        m["analytic_bits"] = (m["analytic_key_bits"] + m["analytic_value_bits"]) / 2
        m["peak_step_bytes"] = max(peaks)
        m.update(m_held)
        return m

    def error_rows(self, batch: int) -> int | None:
        """Batch rows the K/V errors read back: a shape model's first row (:data:`ERROR_ROWS`)
        when ``batch`` exceeds it (the rows are i.i.d. draws of one distribution, and reading
        back all of them cost as much as the rest of the run); else every row (``None``)."""
        return ERROR_ROWS if self.shape and batch > ERROR_ROWS else None

    def _errors(self, caches: list[Replay], inputs: list[QKV]) -> dict[str, float]:
        ks, vs = [], []
        rows = self.error_rows(inputs[0][1].shape[0])
        for c, (_, k, v) in zip(caches, inputs):
            got = c.read(rows)  # after _bytes: a kvbench cache drops its other rows here
            if got is None:
                return {}
            if rows is not None:
                k, v = k[:rows], v[:rows]
            ks.append(chunked_mse(k, got[0]))
            vs.append(chunked_mse(v, got[1]))
        out = {"key_mse": sum(ks) / len(ks), "value_mse": sum(vs) / len(vs)}
        return {k: v for k, v in out.items() if math.isfinite(v)}
