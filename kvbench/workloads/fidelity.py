"""``fidelity``: key/value MSE, attention KL and attention-output error on real captured
post-RoPE Q/K/V (design.md §2 "Fidelity metrics").

Protocol: the full-precision model runs once over ``tokens`` (T) tokens of ``text``; for each
layer the cache is prefilled with the first ``prefill`` (P) tokens (with their queries), the
remaining T - P tokens are appended one at a time (cache operations only, no model), then the
cache's final ``keys_values()`` are compared with the originals, and attention KL is computed for
the queries of positions P..T-1 over keys 0..t (causal, reference first, float64).  Per-layer
values are in ``per_layer``; the metrics average over layers.  ``quantized_key_fraction`` is
the share of the T key tokens the cache holds quantized at the end (0 when the context never
filled a group beyond the residual window: the runner flags such runs).  Methods without ``keys_values()``
(capability) report ``attn_out_rel_err`` only, from ``attend`` over the same queries.

Parameters: ``text`` (kvbench.data.loaders name, default ``essays``), ``tokens`` (T, 2048), ``prefill``
(P, 1024), ``layers`` (``all`` or a list of layer indices), ``window`` (which non-overlapping
T-token window of the text, default 0).
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.attend.reference import reference_attention
from kvbench.kv.method import Method
from kvbench.workloads.metrics import attention_fidelity, key_mse

from . import Result, Workload


def replay(
    method: Method, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: int
) -> Any:
    """Prefill a fresh layer cache with P tokens (and their queries), append the rest one at a
    time, settle the last flush; returns the layer cache.  Shapes ``[B, H, T, D]``."""
    layer = method.new_layer(layer_idx, k.shape[1], k.shape[3], k.dtype, k.device)
    layer.prefill(k[:, :, :prefill], v[:, :, :prefill], queries=q[:, :, :prefill])
    for t in range(prefill, k.shape[2]):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    layer.end_step()
    return layer


def layer_fidelity(
    method: Method,
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefill: int,
    scaling: float | None = None,
) -> dict[str, float]:
    """Fidelity metrics of one layer (see the module docstring)."""
    layer = replay(method, layer_idx, q, k, v, prefill)
    out: dict[str, float] = {}
    if method.capabilities.keys_values:
        kq, vq = layer.keys_values(torch.float32)
        out["key_mse"], out["key_rel_mse"] = key_mse(k, kq)
        out["value_mse"], _ = key_mse(v, vq)
        out.update(attention_fidelity(q, k, v, kq, vq, prefill, scaling))
    else:
        exact = reference_attention(q.double(), k.double(), v.double(), scaling)[:, :, prefill:]
        approx = layer.attend(q[:, :, prefill:], scaling).double()
        out["attn_out_rel_err"] = ((exact - approx).norm() / exact.norm()).item()
    nb = layer.nbytes()
    elems = k.numel()
    out["quantized_key_fraction"] = layer.quantized_tokens()[0] / max(layer.seq_length, 1)
    out["effective_key_bits"] = 8 * nb["key_total"] / elems
    out["effective_value_bits"] = 8 * nb["value_total"] / elems
    return out


class Fidelity(Workload):
    type = "fidelity"
    LIST_PARAMS = frozenset({"layers"})
    PARAMS = {"text": "essays", "tokens": 2048, "prefill": 1024, "layers": "all", "window": 0}

    @classmethod
    def check(cls, spec: dict[str, Any], pre: str) -> None:
        t, p = spec["tokens"], spec["prefill"]
        if not (isinstance(t, int) and isinstance(p, int) and 0 < p < t):
            raise ValueError(
                f"{pre}need integers 0 < prefill < tokens, got prefill={p!r}, tokens={t!r}"
            )
        if spec["layers"] != "all" and not isinstance(spec["layers"], list):
            raise ValueError(f"{pre}layers must be 'all' or a list of layer indices")

    def prepare(self, ctx: Any) -> None:
        from kvbench.data.loaders import load_text, token_windows
        from kvbench.hf.capture import capture_qkv

        key = ("fidelity", self.spec["text"], self.spec["tokens"], self.spec["window"])
        if key in ctx.shared:
            self.captured, self.info = ctx.shared[key]
            return
        text, tinfo = load_text(self.spec["text"])
        w = self.spec["window"]
        ids, winfo = token_windows(ctx.tokenizer, text, self.spec["tokens"], w + 1)
        ids = ids[w : w + 1]
        max_pos = ctx.model_info.get("max_position_embeddings") or 1 << 30
        if self.spec["tokens"] > max_pos:
            raise ValueError(
                f"tokens={self.spec['tokens']} exceeds the model's maximum context {max_pos}"
            )
        captured = capture_qkv(ctx.model, ids)
        self.captured = captured
        self.info = {"dataset": tinfo, "windows": winfo}
        ctx.shared[key] = (captured, self.info)

    def run(self, ctx: Any, method: Method) -> Result:
        layers = range(len(self.captured)) if self.spec["layers"] == "all" else self.spec["layers"]
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
