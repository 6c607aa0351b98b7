"""RoPE-pair saliency studies of PN-Mix on captured full-precision states (no quantization).

``score_agreement`` (PN-Mix Table 1): how well the separable pair-norm score (Eq. 5,
``qk-pair-norm``) ranks RoPE pairs like the causal-joint score (``qk-pair-norm-causal``) over
the prefill states.  Per sample, layer and KV head: Spearman's rho of the two D/2-vectors
(``scipy.stats.spearmanr``) and the top-10% / top-50% overlap ``|A ∩ B| / n`` with
``n = floor(r D/2)`` pairs (ties to the lower pair index, as PN-Mix's selection).  Averaged
over layers and KV heads per sample, then mean and standard deviation across samples
(``spearman_rho``, ``top10_overlap``, ``top50_overlap`` and ``*_std``; overlaps are fractions,
the paper prints percent).  The compared score is the method's ``score`` (a ``pn-mix`` config),
else ``score``; the reference is ``reference``.

``selection_stability`` (PN-Mix Table 11): overlap between the pairs selected once from the
prefill and a step-wise reference during decoding.  A sample's prompt (P tokens) is continued
by ``decode_steps`` greedy tokens of the full-precision model (``continuation: generate``;
``text`` teacher-forces the text that follows a text window), and one forward pass over the
whole sequence captures the post-RoPE q and k of every position (equal to the decode-step
states of a full-precision cache).  For each decode query t >= P (every ``query_stride``-th),
query head g and layer, the reference score of pair i sums over the decode keys
``P <= s <= t`` of g's KV head [RECON: the paper's aggregation over s is not published]:

* ``norm``: ``sum_s ||q_i^t|| ||k_i^s||``;
* ``dot``: ``sum_s |<q_i^t, k_i^s>|``.

The reference top-r% pairs are compared with the prefill selection of g's KV head made by the
method's criterion (``pn-mix`` ``score``: ``qk-pair-norm``, ``k-range``, ``k-magnitude``,
``k-pair-norm``; computed with the method's ``pair_scores`` hook (PN-Mix's Eq. 5 scores) on the P prefill
tokens).  Overlap ``|ref ∩ sel| / n`` is averaged over layers, query heads and the steps of
each bin of ``bin`` decode steps: ``sel_<ref>_r<pct>_b<i>``, over all steps
``sel_<ref>_r<pct>``, and the spread over bins ``sel_<ref>_r<pct>_spread`` (max - min).

Sources (``source``): a text of :func:`kvbench.data.loaders.load_text` (windows of ``tokens`` tokens)
or a math/GSM8K row set (``aime25``, ``aime24``, ``math500``, ``amc23``, ``gsm8k``: each
problem as a chat prompt with the math workload's instruction, as the paper's AIME25 prompts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from kvbench.bench.context import Info, RunContext
from kvbench.bench.workloads import HIGHER, LAYERS, LOWER, NONE, Result, Workload, reject
from kvbench.cache.method import Method
from kvbench.cache.mixed_channel import high_pairs, pair_channels
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue

ROW_SOURCES = ("aime25", "aime24", "math500", "amc23", "gsm8k")
TEXT_SOURCES = ("wikitext2", "essays")
QK_SCORES = ("qk-pair-norm", "qk-pair-norm-causal", "k-range", "k-magnitude", "k-pair-norm")
REFERENCES = ("norm", "dot")
#: the rules both pair-analysis workloads share
SHARED_FIELDS = {
    "source": Field(str, choices=ROW_SOURCES + TEXT_SOURCES),
    "samples": Field(int, low=1),
    "tokens": Field(int, low=1),
    "layers": LAYERS,
    "score": Field(str, choices=QK_SCORES),
    "ratios": Field(float, low=0, high=1, low_open=True, shape="list"),
}


def sample_prompts(
    ctx: RunContext, source: str, samples: int, tokens: int, extra: int = 0
) -> tuple[list[torch.Tensor], Info]:
    """Token ids ``[1, n]`` of up to ``samples`` prompts (``ctx.limit`` caps the count).

    Text sources give windows of ``tokens + extra`` tokens; row sources give each problem with
    the chat template (``extra`` ignored).  Returns the ids and a manifest dict.
    """
    from kvbench.bench.tasks.workload import encode_text, render_prompt
    from kvbench.bench.workloads.math_task import DEFAULT_TEMPLATE
    from kvbench.data.loaders import load_rows, load_text, token_windows

    n = samples if ctx.limit is None else min(samples, ctx.limit)
    if source in TEXT_SOURCES:
        text, tinfo = load_text(source)
        ids, winfo = token_windows(ctx.tokenizer, text, tokens + extra, n)
        return [w[None] for w in ids], {"dataset": tinfo, "windows": winfo}
    rows, info = load_rows(source)
    out = []
    for r in rows[:n]:
        body = DEFAULT_TEMPLATE.format(problem=r.get("problem") or r["question"])
        text, templated = render_prompt(
            ctx.tokenizer, body, [{"role": "user", "content": body}], True
        )
        out.append(encode_text(ctx.tokenizer, text, templated))
    return out, {
        "dataset": info,
        "prompt_template": DEFAULT_TEMPLATE,
        "prompt_tokens": [int(x.shape[1]) for x in out],
    }


def top_mask(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Boolean ``[..., m]`` mask of the ``n`` largest entries (ties: lower index first)."""
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :n]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)


@runtime_checkable
class PairScorer(Protocol):
    """A method that scores RoPE channel pairs (PN-Mix): the pair studies' hook."""

    def pair_scores(
        self, keys: torch.Tensor, queries: torch.Tensor | None, score: str, pairing: str
    ) -> torch.Tensor:
        """Scores ``[B, H_kv, D/2]`` of the pairs of ``keys [B, H_kv, T, D]`` by criterion
        ``score`` (``queries [B, H_q, T, D]`` for the query-aware ones) under ``pairing``."""
        ...


def _pair_scores(
    method: Method,
) -> Callable[[torch.Tensor, torch.Tensor | None, str, str], torch.Tensor]:
    """The method's RoPE-pair scoring hook ``method.pair_scores(keys, queries, score, pairing)
    -> [B, H_kv, D/2]`` (:class:`PairScorer`; PN-Mix provides it).  Raises ``ValueError`` for a
    method without one."""
    if not isinstance(method, PairScorer) or not callable(method.pair_scores):
        name = method.name or type(method).__name__
        raise ValueError(
            f"method {name!r} has no pair_scores(keys, queries, score, pairing) hook; the "
            "pair studies (score_agreement, selection_stability) need a method that selects "
            "RoPE pairs, e.g. pn-mix"
        )
    return method.pair_scores


def _criterion(method: Method, default: str) -> str:
    # ``score`` and ``pairing`` are fields of some method configs only (PN-Mix's among them)
    score = getattr(method.config, "score", None)
    return score if score in QK_SCORES else default


def _pairing(method: Method) -> str:
    p = getattr(method.config, "pairing", "rotate-half")
    return {"rotate_half": "rotate-half"}.get(p, p)


class ScoreAgreement(Workload):
    type = "score_agreement"
    METRICS = {
        "spearman_rho": HIGHER,
        "top*_overlap": HIGHER,  # top<k>_overlap for each configured k
        "*_std": NONE,  # spread over samples
        "samples": NONE,
    }
    LIST_PARAMS = frozenset({"layers", "ratios"})
    PARAMS = {
        "source": "aime25",
        "samples": 8,
        "tokens": 512,
        "layers": "all",
        "score": "qk-pair-norm",
        "reference": "qk-pair-norm-causal",
        "ratios": [0.1, 0.5],
    }
    FIELDS = {**SHARED_FIELDS, "reference": Field(str, choices=QK_SCORES)}

    def prepare(self, ctx: RunContext) -> None:
        from kvbench.hf.capture import capture_qkv

        key = (
            "score_agreement",
            self.spec["source"],
            self.spec["samples"],
            self.spec["tokens"],
            ctx.limit,
        )
        if key not in ctx.shared.extra:
            prompts, info = sample_prompts(
                ctx, self.spec["source"], self.spec["samples"], self.spec["tokens"]
            )
            caps = []
            for ids in prompts:
                c = capture_qkv(ctx.model, ids)
                caps.append((c.queries, c.keys))  # values are not needed
            ctx.shared.extra[key] = (caps, info)
        self.captured, self.info = ctx.shared.extra[key]

    def run(self, ctx: RunContext, method: Method) -> Result:
        from scipy.stats import spearmanr

        scores = _pair_scores(method)
        score = _criterion(method, self.spec["score"])
        ref, pairing = self.spec["reference"], _pairing(method)
        ratios = self.spec["ratios"]
        names = ["spearman_rho"] + [f"top{round(100 * r)}_overlap" for r in ratios]
        per_sample: dict[str, list[float]] = {k: [] for k in names}
        per_layer: dict[str, list[list[float]]] = {k: [] for k in names}
        for qs, ks in self.captured:
            layers = range(len(ks)) if self.spec["layers"] == "all" else self.spec["layers"]
            acc: dict[str, list[float]] = {k: [] for k in names}
            for li in layers:
                q, k = qs[li].double(), ks[li].double()
                a = scores(k, q, score, pairing)[0]  # [H_kv, D/2]
                b = scores(k, q, ref, pairing)[0]
                npairs = a.shape[-1]
                vals: dict[str, list[float]] = {x: [] for x in names}
                for h in range(a.shape[0]):
                    rho = spearmanr(a[h].numpy(), b[h].numpy()).statistic
                    vals["spearman_rho"].append(float(rho))
                    for r, name in zip(ratios, names[1:]):
                        n = max(high_pairs(2 * npairs, r), 1)
                        inter = (top_mask(a[h], n) & top_mask(b[h], n)).sum().item()
                        vals[name].append(inter / n)
                for x in names:
                    finite = [v for v in vals[x] if not math.isnan(v)]
                    layer_mean = sum(finite) / len(finite) if finite else float("nan")
                    acc[x].append(layer_mean)
            for x in names:
                finite = [v for v in acc[x] if not math.isnan(v)]
                per_sample[x].append(sum(finite) / len(finite) if finite else float("nan"))
                per_layer[x].append(acc[x])
        metrics: dict[str, float] = {}
        for x in names:
            v = torch.tensor(per_sample[x], dtype=torch.float64)
            metrics[x] = v.mean().item()
            metrics[f"{x}_std"] = v.std(unbiased=False).item() if v.numel() > 1 else 0.0
        metrics["samples"] = len(self.captured)
        info = {
            **self.info,
            "score": score,
            "reference": ref,
            "pairing": pairing,
            "std": "population std across samples (ddof=0)",
        }
        return Result(metrics, {"per_sample": per_sample, "per_sample_layer": per_layer}, info)


class SelectionStability(Workload):
    type = "selection_stability"
    METRICS = {
        "sel_*": HIGHER,  # sel_<ref>_r<pct> and its per-bin sel_<ref>_r<pct>_b<i>
        "sel_*_spread": LOWER,  # max - min of the stability over bins
    }
    LIST_PARAMS = frozenset({"layers", "ratios", "references"})
    PARAMS = {
        "source": "aime25",
        "samples": 1,
        "tokens": 96,
        "decode_steps": 2048,
        "continuation": "generate",
        "bin": 512,
        "query_stride": 1,
        "layers": "all",
        "ratios": [0.5, 0.1],
        "references": ["norm", "dot"],
        "score": "qk-pair-norm",
    }
    FIELDS = {
        **SHARED_FIELDS,
        "decode_steps": Field(int, low=1),
        "bin": Field(int, low=1),
        "query_stride": Field(int, low=1),
        "continuation": Field(str, choices=("generate", "text")),
        "references": Field(str, choices=REFERENCES, shape="list"),
    }

    @classmethod
    def check(cls, spec: dict[str, JSONValue], pre: str) -> None:
        if spec["continuation"] == "text" and spec["source"] not in TEXT_SOURCES:
            reject(
                pre,
                "continuation",
                "text",
                f"'generate', or 'text' with a text source {list(TEXT_SOURCES)}",
            )

    @torch.no_grad()
    def _continue(self, ctx: RunContext, ids: torch.Tensor) -> torch.Tensor:
        n = self.spec["decode_steps"]
        if self.spec["continuation"] == "text":
            return ids
        out = ctx.model.generate(
            ids.to(ctx.model.device), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
        return out.cpu()

    def prepare(self, ctx: RunContext) -> None:
        from kvbench.hf.capture import capture_qkv

        s = self.spec
        key = (
            "selection_stability",
            s["source"],
            s["samples"],
            s["tokens"],
            s["decode_steps"],
            s["continuation"],
            s["query_stride"],
            repr(s["ratios"]),
            repr(s["references"]),
            repr(s["layers"]),
            ctx.limit,
        )
        if key in ctx.shared.extra:
            self.data, self.info = ctx.shared.extra[key]
            return
        extra = s["decode_steps"] if s["continuation"] == "text" else 0
        prompts, info = sample_prompts(ctx, s["source"], s["samples"], s["tokens"], extra)
        data = []
        for ids in prompts:
            p = ids.shape[1] - extra
            full = self._continue(ctx, ids)
            c = capture_qkv(ctx.model, full)
            layers = range(len(c.keys)) if s["layers"] == "all" else s["layers"]
            refs: dict[tuple[str, float], list[torch.Tensor]] = {}
            for li in layers:
                for ref in s["references"]:
                    score = self._reference(c.queries[li], c.keys[li], p, ref)
                    for r in s["ratios"]:
                        n = max(high_pairs(score.shape[-1] * 2, r), 1)
                        refs.setdefault((ref, r), []).append(top_mask(score, n))
            refs_t = {k: torch.stack(v) for k, v in refs.items()}  # [L, H_q, steps, D/2] bool
            data.append(
                {
                    "prefill": p,
                    "total": int(full.shape[1]),
                    "q_prefill": [c.queries[li][:, :, :p] for li in layers],
                    "k_prefill": [c.keys[li][:, :, :p] for li in layers],
                    "refs": refs_t,
                }
            )
        info = {
            **info,
            "decode_steps": s["decode_steps"],
            "continuation": s["continuation"],
            "query_stride": s["query_stride"],
            "prefill_tokens": [d["prefill"] for d in data],
            "reference_aggregation": "sum over decode keys P <= s <= t [RECON]",
        }
        self.data, self.info = data, info
        ctx.shared.extra[key] = (data, info)

    def _reference(self, q: torch.Tensor, k: torch.Tensor, p: int, ref: str) -> torch.Tensor:
        """Reference pair scores ``[H_q, steps, D/2]`` of the decode queries ``p..T-1`` (every
        ``query_stride``-th) over the decode keys ``p..t``; ``q [1, H_q, T, D]``,
        ``k [1, H_kv, T, D]``."""

        _, hq, t, d = q.shape
        rep = hq // k.shape[1]
        pc = pair_channels(d)
        qd = q[0, :, p::, :].double()[:, :: self.spec["query_stride"]]  # [H_q, S', D]
        kd = k[0, :, p:, :].double().repeat_interleave(rep, dim=0)  # [H_q, S, D]
        steps = torch.arange(p, t)[:: self.spec["query_stride"]] - p  # t - p of each query
        qa, qb = qd[..., pc[:, 0]], qd[..., pc[:, 1]]
        ka, kb = kd[..., pc[:, 0]], kd[..., pc[:, 1]]
        if ref == "norm":
            kn = torch.hypot(ka, kb).cumsum(dim=1)  # [H_q, S, D/2]: sum over s <= t
            score = torch.hypot(qa, qb) * kn[:, steps]
        else:  # |q_i . k_i| for every (t, s <= t), summed over s; float32, chunks of queries
            score = torch.empty_like(qa)
            qa32, qb32, ka32, kb32 = (x.float() for x in (qa, qb, ka, kb))
            for c0 in range(0, qa.shape[1], 256):
                c1 = min(c0 + 256, qa.shape[1])
                causal = (torch.arange(kd.shape[1])[None, :] <= steps[c0:c1, None]).float()
                for i in range(d // 2):
                    dots = torch.baddbmm(
                        qa32[:, c0:c1, i, None] * ka32[:, None, :, i],
                        qb32[:, c0:c1, i, None],
                        kb32[:, None, :, i],
                    )
                    score[:, c0:c1, i] = (dots.abs() * causal).sum(-1).double()
        return score

    def run(self, ctx: RunContext, method: Method) -> Result:

        s = self.spec
        scores = _pair_scores(method)
        crit, pairing = _criterion(method, s["score"]), _pairing(method)
        metrics: dict[str, float] = {}
        curves: dict[str, list[float]] = {}
        for ref in s["references"]:
            for r in s["ratios"]:
                name = f"sel_{ref}_r{round(100 * r)}"
                num = None
                for d in self.data:
                    sel = []
                    for q, k in zip(d["q_prefill"], d["k_prefill"]):
                        sc = scores(k.double(), q.double(), crit, pairing)[0]  # [H_kv, D/2]
                        n = max(high_pairs(2 * sc.shape[-1], r), 1)
                        rep = q.shape[1] // k.shape[1]
                        sel.append(top_mask(sc, n).repeat_interleave(rep, dim=0))  # [H_q, D/2]
                    sel_t = torch.stack(sel)[:, :, None, :]  # [L, H_q, 1, D/2]
                    refm = d["refs"][(ref, r)]
                    ov = (refm & sel_t).sum(-1).double() / refm.sum(-1).double()
                    curve = ov.mean(dim=(0, 1))  # [steps']
                    num = curve if num is None else num[: curve.numel()] + curve[: num.numel()]
                curve = (num / len(self.data)).tolist()
                curves[name] = curve
                stride = s["query_stride"]
                per_bin = max(s["bin"] // stride, 1)
                bins = [curve[i : i + per_bin] for i in range(0, len(curve), per_bin)]
                means = [sum(b) / len(b) for b in bins if b]
                for i, m in enumerate(means):
                    metrics[f"{name}_b{i}"] = m
                metrics[name] = sum(curve) / len(curve)
                metrics[f"{name}_spread"] = max(means) - min(means)
        info = {
            **self.info,
            "criterion": crit,
            "pairing": pairing,
            "bin": s["bin"],
            "bins": "decode steps [i*bin, (i+1)*bin) after the prefill",
        }
        return Result(metrics, {"curves": curves}, info)
