"""``fidelity``: key/value MSE, attention KL and attention-output error on real captured
post-RoPE Q/K/V; protocol (prefill P of T tokens, append the rest one at a time, compare) and
metrics as docs/design.md#fidelity-metrics.  ``quantized_key_fraction`` is the share of the T
key tokens the cache holds quantized at the end (0 when the context never filled a group beyond
the residual window: the runner flags such runs).

An evicting method (``capabilities.evicts``, docs/design.md#eviction) holds fewer than the T
tokens, so its K/V cannot be compared token by token: each of the T - P tokens after the prefill
is appended and its query attends to what the cache holds (``LayerCache.attend``, which also
hands the attention to evictors that score by it), and ``attn_out_rel_err`` compares those
outputs with exact attention over every token seen; ``held_token_fraction`` is the share of the
T tokens held at the end, ``quantized_key_fraction`` the share of the held keys quantized and
the effective bits count the bytes held against the T tokens seen.

Parameters: ``text`` (kvbench.data.loaders name, default ``essays``), ``tokens`` (T, 2048), ``prefill``
(P, 1024), ``layers`` (``all`` or a list of layer indices), ``window`` (which non-overlapping
T-token window of the text, default 0), ``source`` (``model``, or ``synthetic``: seeded Gaussian
Q/K/V of ``num_layers`` x ``[1, num_heads | num_kv_heads, T, head_dim]`` with per-channel key
scales spread over two orders of magnitude (the outlier channels of real keys, KIVI §3), for
model-free regression gates); each source keeps only its own parameters
(``Workload.SOURCE_PARAMS``, docs/design.md#suites-and-workloads).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from kvbench.attention.reference import reference_attention
from kvbench.bench.context import Capture, Info, LayerKV, RunContext
from kvbench.bench.metrics import (
    LOWER,
    NONE,
    STORAGE_METRICS,
    attention_fidelity,
    key_mse,
)
from kvbench.cache.method import Method
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue

from . import KV_SOURCE_PARAMS, LAYERS, SOURCES, Result, Workload, check_kv_heads, reject

if TYPE_CHECKING:
    from kvbench.cache.layer import LayerCache


def _prefilled(
    method: Method, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: int
) -> LayerCache:
    """A fresh layer cache of ``method`` prefilled with the first P tokens of ``k``/``v`` and
    their queries ``q``.  Shapes ``[B, H, T, D]`` (``H_q`` heads for ``q``)."""
    layer = method.new_layer(layer_idx, k.shape[1], k.shape[3], k.dtype, k.device)
    layer.prefill(k[:, :, :prefill], v[:, :, :prefill], queries=q[:, :, :prefill])
    return layer


def replay(
    method: Method, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: int
) -> LayerCache:
    """Prefill a fresh layer cache with P tokens (and their queries), append the rest one at a
    time, settle the last flush; returns the layer cache.  Shapes ``[B, H, T, D]``."""
    layer = _prefilled(method, layer_idx, q, k, v, prefill)
    for t in range(prefill, k.shape[2]):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    layer.end_step()
    return layer


def attn_out_rel_err(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    approx: torch.Tensor,
    prefill: int,
    scaling: float | None,
) -> float:
    """``||exact - approx|| / ||exact||`` (Frobenius, float64) of the attention outputs of the
    queries after the first ``prefill``: ``exact`` is exact attention over every token of
    ``k``/``v`` ``[B, H, T, D]`` (causal), ``approx`` ``[B, H_q, T - P, D]`` a cache's."""
    exact = reference_attention(q.double(), k.double(), v.double(), scaling)[:, :, prefill:]
    return ((exact - approx.double()).norm() / exact.norm()).item()


def storage_metrics(layer: LayerCache, k: torch.Tensor) -> dict[str, float]:
    """``quantized_key_fraction`` (keys held quantized / tokens held) and
    ``effective_key_bits`` / ``effective_value_bits`` (bits held per element of the T tokens
    seen, ``k`` ``[B, H, T, D]``) of a layer cache after its run."""
    nb = layer.nbytes()
    elems = k.numel()
    return {
        "quantized_key_fraction": layer.quantized_tokens()[0] / max(layer.seq_length, 1),
        "effective_key_bits": 8 * nb["key_total"] / elems,
        "effective_value_bits": 8 * nb["value_total"] / elems,
    }


def layer_fidelity(
    method: Method,
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefill: int,
    scaling: float | None = None,
) -> dict[str, float]:
    """Fidelity metrics of one layer (see the module docstring).  An evicting method's cache
    is prefilled with P tokens and their queries, then per later token: append, attend with
    its query ``[B, H_q, 1, D]``, end the step.  Shapes ``[B, H, T, D]``."""
    if method.capabilities.evicts:
        layer = _prefilled(method, layer_idx, q, k, v, prefill)
        outs = []
        for t in range(prefill, k.shape[2]):
            layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(layer.attend(q[:, :, t : t + 1], scaling))
            layer.end_step()
        return {
            "attn_out_rel_err": attn_out_rel_err(q, k, v, torch.cat(outs, 2), prefill, scaling),
            "held_token_fraction": layer.seq_length / layer.seen_tokens,
            **storage_metrics(layer, k),
        }
    layer = replay(method, layer_idx, q, k, v, prefill)
    out: dict[str, float] = {}
    if method.capabilities.keys_values:
        kq, vq = layer.keys_values(torch.float32)
        out["key_mse"], out["key_rel_mse"] = key_mse(k, kq)
        out["value_mse"], _ = key_mse(v, vq)
        out.update(attention_fidelity(q, k, v, kq, vq, prefill, scaling))
    else:
        approx = layer.attend(q[:, :, prefill:], scaling)
        out["attn_out_rel_err"] = attn_out_rel_err(q, k, v, approx, prefill, scaling)
    out.update(storage_metrics(layer, k))
    return out


class Fidelity(Workload):
    type = "fidelity"
    METRICS = {
        **STORAGE_METRICS,
        "attn_kl": LOWER,
        "attn_out_rel_err": LOWER,
        "quantized_key_fraction": NONE,  # what the run covered, not a quality
        "held_token_fraction": NONE,  # evicting methods: tokens held / tokens seen
    }
    LIST_PARAMS = frozenset({"layers"})
    SOURCE_PARAMS = KV_SOURCE_PARAMS
    needs_model = False  # ``source: synthetic`` runs without one
    PARAMS = {
        "text": "essays",
        "tokens": 2048,
        "prefill": 1024,
        "layers": "all",
        "window": 0,
        "source": "model",
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
    }
    FIELDS = {
        "tokens": Field(int, low=2),
        "prefill": Field(int, low=1),
        "layers": LAYERS,
        "source": SOURCES,
        **{k: Field(int, low=1) for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim")},
    }

    @classmethod
    def check(cls, spec: dict[str, JSONValue], pre: str) -> None:
        if spec["prefill"] >= spec["tokens"]:
            reject(pre, "prefill", spec["prefill"], f"integers 1..{spec['tokens'] - 1} (< tokens)")
        check_kv_heads(spec, pre)

    def _synthetic(self, seed: int, calibration: int = 0) -> tuple[SimpleNamespace, Info]:
        """Seeded Q/K/V (module docstring), as a stand-in of a
        :class:`~kvbench.hf.capture.CapturedQKV` (``layer_ids``, ``queries``, ``keys``,
        ``values``, ``scaling``); ``calibration`` > 0 also draws that many further
        K/V tokens per layer with the same key channel scales, after the measured ones (the
        measured tensors do not depend on it), in ``cap.calib_keys`` / ``cap.calib_values``."""
        s = self.spec
        g = torch.Generator().manual_seed(seed)
        t, d, hkv = s["tokens"], s["head_dim"], s["num_kv_heads"]
        qs, ks, vs, chans = [], [], [], []
        for _ in range(s["num_layers"]):
            chan = torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]  # key outliers
            qs.append(torch.randn(1, s["num_heads"], t, d, generator=g))
            ks.append(torch.randn(1, hkv, t, d, generator=g) * chan)
            vs.append(torch.randn(1, hkv, t, d, generator=g))
            chans.append(chan)
        n = s["num_layers"]
        cap = SimpleNamespace(
            layer_ids=list(range(n)), queries=qs, keys=ks, values=vs, scaling=[None] * n
        )
        if calibration:
            cap.calib_keys = [torch.randn(1, hkv, calibration, d, generator=g) * c for c in chans]
            cap.calib_values = [torch.randn(1, hkv, calibration, d, generator=g) for _ in chans]
        return cap, {"kv_source": "synthetic", "seed": seed}

    def calibration_kv(self, seed: int, tokens: int) -> tuple[LayerKV, LayerKV, Info] | None:
        """``source: synthetic``: ``tokens`` further K/V per layer from the same generator and
        key channel scales as the measured ones (none of the measured tokens)."""
        if self.spec["source"] != "synthetic":
            return None
        cap, _ = self._synthetic(seed, calibration=tokens)
        keys = dict(enumerate(cap.calib_keys))
        values = dict(enumerate(cap.calib_values))
        info = {"source": "synthetic (fidelity workload, drawn after the measured Q/K/V)"}
        return keys, values, {"dataset": {**info, "seed": seed}, "tokens": tokens}

    def prepare(self, ctx: RunContext) -> None:
        self._capture(ctx)
        self._check_layers()

    def _capture(self, ctx: RunContext) -> None:
        """``self.captured`` / ``self.info``: the synthetic Q/K/V, or the model's on the text
        (shared across methods through ``ctx.shared.captures``)."""
        from kvbench.data.loaders import load_text, token_windows
        from kvbench.hf.capture import capture_qkv

        if self.spec["source"] == "synthetic":
            self.captured, self.info = self._synthetic(ctx.seed)
            return
        if ctx.model is None:
            raise ValueError("fidelity with source 'model' needs a model (the suite has none)")

        key = ("fidelity", self.spec["text"], self.spec["tokens"], self.spec["window"])
        if key in ctx.shared.captures:
            got = ctx.shared.captures[key]
            self.captured, self.info = got.qkv, got.info
            return
        text, tinfo = load_text(self.spec["text"])
        w = self.spec["window"]
        ids, winfo = token_windows(ctx.tokenizer, text, self.spec["tokens"], w + 1)
        ids = ids[w : w + 1]
        self.check_context(ctx, "tokens")
        captured = capture_qkv(ctx.model, ids)
        self.captured = captured
        self.info = {"dataset": tinfo, "windows": winfo}
        ctx.shared.captures[key] = Capture(captured, self.info)

    def _check_layers(self) -> None:
        """``layers`` names only layers the captured model has (before any method runs).

        Raises
        ------
        ValueError
            naming the field, the layers outside and the allowed range.
        """
        n = len(self.captured.keys)
        layers = self.spec["layers"]
        if layers != "all" and any(i >= n for i in layers):
            outside = sorted({i for i in layers if i >= n})
            raise ValueError(
                f"fidelity: field 'layers': {outside} outside the model's layers; allowed: "
                f"indices 0..{n - 1} or 'all'"
            )

    def run(self, ctx: RunContext, method: Method) -> Result:
        n = len(self.captured.keys)
        layers = range(n) if self.spec["layers"] == "all" else self.spec["layers"]
        per: dict[str, list[float]] = {}
        for i in layers:
            c = self.captured
            m = layer_fidelity(
                method,
                c.layer_ids[i],
                c.queries[i],
                c.keys[i],
                c.values[i],
                self.spec["prefill"],
                c.scaling[i],
            )
            for k, v in m.items():
                per.setdefault(k, []).append(v)
        metrics = {k: sum(v) / len(v) for k, v in per.items()}
        bits = method.average_bits(head_dim=self.captured.keys[0].shape[-1])
        metrics["nominal_key_bits"] = bits["key_bits"]
        metrics["nominal_value_bits"] = bits["value_bits"]
        per_layer = {"layers": list(layers), **per}
        return Result(metrics, per_layer, self.info)
