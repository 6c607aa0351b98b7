"""``KVBenchLM``: lm-evaluation-harness's ``HFLM`` with every request run through a kvbench cache.

Registered with lm-eval as ``--model kvbench`` when this module is imported (``kvbench lm-eval``
does that).  Tokenization, chat templates, stop sequences, request ordering and result caching
are ``HFLM``'s; kvbench overrides the three points where the KV cache is read:

* ``generate_until`` -> :meth:`KVBenchLM._model_generate`: ``model.generate`` with a fresh
  cache of the method per call.  The prompt is prefilled (its attention as the method's
  ``prefill_attention`` says: full precision by default, or the stored cache; docs/design.md
  "When quantization happens"); every generated token decodes through the method's cache
  under ``protocol`` (default ``write-then-attend``: the token is stored, a flush included,
  before it attends).
* ``loglikelihood`` and ``loglikelihood_rolling`` -> :meth:`KVBenchLM._loglikelihood_tokens`:
  one forward pass over context + continuation reads no cache, so quantization would change
  nothing.  Instead, per request, the context *without its last token* is prefilled into a fresh
  cache, then the last context token and the continuation tokens but the last are fed ``chunk``
  tokens at a time (default 1: exact decode; a chunk is cut where an evictor's decode budget
  drops a token, docs/design.md#eviction), each step attending to the cache's quantized past
  under ``protocol`` (as the ``perplexity`` workload does: with ``write-then-attend`` a chunk
  reads its own tokens as stored, so every ``chunk`` gives exact decode's numbers for a method
  whose stored form of a token does not depend on later tokens).  Every scored position
  therefore reads the quantized context once the context is longer than the method's
  full-precision residual.
* batches: one request at a time (``batch_size=1``); larger batches are refused with what to
  use instead (:data:`BATCH_REFUSAL`).

Model arguments (``--model_args k=v,...`` or keywords): ``pretrained`` (Hugging Face id, local
folder, ``default`` = HuggingFaceTB/SmolLM2-135M-Instruct, or a loaded model with
``tokenizer=``), ``method`` (a registered kvbench method name or a ``Method`` instance),
``method_config`` (a YAML file: a mapping of config fields, optionally ``method:`` and
``calibration: {text, tokens}``), any config field of the method (``bits=2,value_bits=2``),
``chunk``, ``protocol`` (``write-then-attend`` | ``in-chunk-full``), ``dtype`` (float32),
``device`` (cuda if available, else cpu),
``min_quantized_fraction`` (warn below it), and ``HFLM``'s own arguments (``max_length``,
``add_bos_token``, ...).  An unknown name is a ``ValueError`` naming
it, the method's config fields and the backend's arguments.

After a run, :attr:`KVBenchLM.request_log` holds one entry per request (task, doc id, request
type, context and scored tokens, and the quantized share of the past the scored positions read);
:meth:`KVBenchLM.get_model_info` puts its per-task aggregate into lm-eval's results
(``config.kvbench_kv_quantized_fraction``) and warns (:class:`LowQuantizedFractionWarning`, once
per backend) when a task's share is below ``min_quantized_fraction``.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from kvbench.cache.method import Method
from kvbench.cache.registry import get_method, get_method_class
from kvbench.hf.attention import register, use_kvbench_attention
from kvbench.hf.cache import (
    DEFAULT_PROTOCOL,
    PEER_PROTOCOL,
    STEP_PROTOCOL_FIELD,
    QuantizedKVCache,
    cache_kwarg,
    make_hf_cache,
)
from kvbench.hf.info import model_info
from kvbench.hf.models import DEFAULT_MODEL, load_model
from kvbench.integrations.lm_eval.coverage import (
    DEFAULT_MIN_QUANTIZED_FRACTION,
    LowQuantizedFractionWarning,
    RequestEntry,
    low_coverage_message,
    per_task,
    quantized_fraction,
)
from kvbench.jsontypes import JSONValue

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from transformers.cache_utils import Cache

#: what one of lm-eval's request kinds answers per request
_Answer = TypeVar("_Answer")

#: calibration text for methods that need it when none is configured (disjoint from the tasks)
DEFAULT_CALIBRATION = {"text": "essays-calib", "tokens": 2048}
#: this backend's own arguments (the rest go to the method config or to ``HFLM``)
OWN_ARGS = (
    "pretrained",
    "method",
    "method_config",
    "chunk",
    "protocol",
    "dtype",
    "device",
    "tokenizer",
    "min_quantized_fraction",
)
#: ``HFLM`` arguments that load or place a model from a string; meaningless here
_HFLM_LOADING = {
    "backend",
    "revision",
    "subfolder",
    "parallelize",
    "max_memory_per_gpu",
    "max_cpu_memory",
    "offload_folder",
    "tp_plan",
    "peft",
    "delta",
    "autogptq",
    "gptqmodel",
    "gguf_file",
    "trust_remote_code",
    "use_fast_tokenizer",
    "kwargs",
    "self",
    "pretrained",
    "tokenizer",
    "device",
    "dtype",
}
#: the error for ``batch_size`` other than 1: why, and what to use instead
BATCH_REFUSAL = (
    "batch_size={!r}: the kvbench backend scores one request at a time (batch_size=1). Why: "
    "each log-likelihood request is prefilled and then decoded token by token through its own "
    "cache, so that every scored position reads the context as the method stores it; batching "
    "would make requests of different lengths share those decode steps (left-padded prefill, "
    "positions from the mask, per-row accounting of what was read quantized: kvbench caches "
    "take left padding only, docs/design.md#padding), which this backend does not do. "
    "Instead: keep batch_size=1 and raise chunk (model_args chunk=C feeds C tokens per step), "
    "run on a GPU (device=cuda), or, for method=full only, use lm-eval's --model hf, which "
    "batches and gives the same scores."
)
HFLM_ARGS = tuple(
    sorted(set(inspect.signature(HFLM.__init__).parameters) - _HFLM_LOADING - {"batch_size"})
)


def read_method_config(path: str | Path) -> dict[str, object]:
    """The mapping of a ``method_config`` YAML file; ``ValueError`` when it is missing or not a
    mapping."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"method_config={str(path)!r}: no such file (a YAML mapping of fields)")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"method_config={str(path)!r} must be a YAML mapping of config fields")
    return data


def build_method(
    method: str | Method,
    fields: dict[str, object],
    method_config: str | Path | Mapping[str, object] | None = None,
) -> tuple[Method, dict[str, object] | None]:
    """The method from a name plus config fields (``method_config``: a YAML file or mapping,
    overridden by ``fields``), or a given instance (then no fields).  Returns (method,
    calibration settings or ``None``).

    Raises ``ValueError`` for an unknown method (with the registered names), unknown fields
    (with the allowed ones), or fields given with an instance."""
    cfg: dict[str, object] = dict(method_config) if isinstance(method_config, dict) else {}
    if isinstance(method_config, (str, Path)):
        cfg = read_method_config(method_config)
    calibration = cfg.pop("calibration", None)
    name = cfg.pop("method", None)
    if isinstance(method, Method):
        if fields or cfg:
            raise ValueError(
                f"config fields {sorted({**cfg, **fields})} were given with a Method instance; "
                "pass a method name to configure it here"
            )
        return method, calibration
    name = method if method is not None else (name or "full")
    if not isinstance(name, str):
        raise ValueError(f"method={name!r} must be a registered method name or a Method")
    return get_method(name, **{**cfg, **fields}), calibration


def calibrate_method(
    method: Method,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    spec: Mapping[str, object] | None,
) -> dict[str, JSONValue]:
    """Calibrate ``method`` on captured full-precision K/V of one window of ``spec['tokens']``
    tokens of ``spec['text']`` (default :data:`DEFAULT_CALIBRATION`); returns the provenance."""
    from kvbench.data.loaders import load_text, token_windows
    from kvbench.hf.capture import capture_qkv

    spec = {**DEFAULT_CALIBRATION, **(spec or {})}
    text, tinfo = load_text(spec["text"])
    ids, winfo = token_windows(tokenizer, text, int(spec["tokens"]), 1)
    cap = capture_qkv(model, ids)
    keys = dict(zip(cap.layer_ids, cap.keys))
    values = dict(zip(cap.layer_ids, cap.values))
    method.calibrate(keys, values, source=f"{spec['text']}[:{spec['tokens']} tokens]")
    return {"dataset": tinfo, "windows": winfo}


def quantized_read(cache: Cache) -> float | None:
    """Tokens the next step reads from quantized storage, averaged over layers (a token counts
    when its key or its value is quantized); ``None`` for caches that are not kvbench's."""
    if not isinstance(cache, QuantizedKVCache):
        return None
    layers = cache.layer_caches()
    counts = [max(lc.quantized_tokens()) if lc is not None else 0 for lc in layers]
    return sum(counts) / max(len(counts), 1)


@register_model("kvbench")
class KVBenchLM(HFLM):
    """lm-eval model backend running every request through a kvbench method's cache.

    Parameters
    ----------
    pretrained : Hugging Face id, local folder, ``"default"`` (:data:`DEFAULT_MODEL`), or a
        loaded causal LM (then pass ``tokenizer``).
    method : registered kvbench method name (``kvbench list``; built, fitted to the model and,
        when it needs calibration, calibrated here) or a configured ``Method`` instance (used
        as is: calibrate it first).  Default ``full``.
    method_config : YAML file (or mapping) of config fields, plus optional ``method`` and
        ``calibration: {text, tokens}``; keyword fields override it.
    chunk : tokens fed per step while scoring log-likelihoods (1 = exact decode).
    protocol : decode protocol of the method's cache (:data:`kvbench.hf.cache.STEP_PROTOCOLS`;
        default ``write-then-attend``); a peer runs its own cache's ``update``.
    dtype, device : model dtype (default float32) and device (default cuda when available).
    min_quantized_fraction : warn (:class:`LowQuantizedFractionWarning`, once) when a task's
        ``kv_quantized_fraction`` ends below it (default 0.5; 0 = never).  Not for methods that
        store K/V exactly (16 nominal bits: ``full``).
    batch_size : must be 1 (:data:`BATCH_REFUSAL`).
    **kwargs : config fields of the method, then ``HFLM`` arguments (:data:`HFLM_ARGS`).

    Raises
    ------
    ValueError
        Unknown method, config field or argument (each named with the allowed values);
        ``batch_size`` other than 1; ``chunk`` < 1; ``min_quantized_fraction`` outside [0, 1];
        ``protocol`` not in :data:`kvbench.hf.cache.STEP_PROTOCOLS`.
    """

    def __init__(
        self,
        pretrained: str | PreTrainedModel = "default",
        method: str | Method = "full",
        method_config: str | dict[str, object] | None = None,
        chunk: int = 1,
        protocol: str = DEFAULT_PROTOCOL,
        dtype: str = "float32",
        device: str | None = None,
        batch_size: int | str = 1,
        tokenizer: PreTrainedTokenizerBase | None = None,
        min_quantized_fraction: float = DEFAULT_MIN_QUANTIZED_FRACTION,
        **kwargs: object,
    ) -> None:
        if str(batch_size) != "1":
            raise ValueError(BATCH_REFUSAL.format(batch_size))
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} must be an integer >= 1 (1 = exact decode)")
        STEP_PROTOCOL_FIELD.check(protocol, "protocol", "kvbench backend")
        self.protocol = protocol
        mqf = min_quantized_fraction
        if isinstance(mqf, bool) or not isinstance(mqf, (int, float)) or not 0 <= mqf <= 1:
            raise ValueError(f"min_quantized_fraction={mqf!r} must be a number in [0, 1]")
        self.min_quantized_fraction = float(mqf)
        self._coverage_warned = False
        name = method.name if isinstance(method, Method) else method
        cls = None if isinstance(method, Method) else self._method_class(method, method_config)
        fields = {f.name for f in dataclasses.fields(cls.Config)} if cls is not None else set()
        method_fields = {k: v for k, v in kwargs.items() if k in fields}
        hflm = {k: v for k, v in kwargs.items() if k not in fields}
        unknown = sorted(set(hflm) - set(HFLM_ARGS))
        if unknown:
            raise ValueError(
                f"kvbench backend: unknown model_args field(s) {unknown} for method {name!r}; "
                f"method config fields: {sorted(fields)}; backend arguments: "
                f"{sorted(set(OWN_ARGS) | {'batch_size'} | set(HFLM_ARGS))}"
            )
        self.method, calibration = build_method(method, method_fields, method_config)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI defaults to cuda:0; on a machine without CUDA run on the CPU
            warnings.warn(f"device={device!r} but CUDA is not available: using cpu", stacklevel=2)
            device = "cpu"
        if isinstance(pretrained, str):
            spec = DEFAULT_MODEL if pretrained == "default" else pretrained
            model, tok, info = load_model(
                spec, dtype=dtype, device=device, attn_implementation=register()
            )
            tokenizer = tokenizer or tok
        else:
            if tokenizer is None:
                raise ValueError("a loaded model as pretrained needs tokenizer=")
            model, info = use_kvbench_attention(pretrained), {"model_id": None}
        self.model_load_info = {**info, **model_info(model)}
        self.method = self.method.for_model(self.model_load_info)
        self.calibration_info = None
        if self.method.needs_calibration and not isinstance(method, Method):
            # a method built here is calibrated here; a given instance is the caller's
            self.calibration_info = calibrate_method(self.method, model, tokenizer, calibration)
        self.chunk = chunk
        self.request_log: list[RequestEntry] = []
        self._current: RequestEntry = {}
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=1, **hflm)

    @staticmethod
    def _method_class(
        method: object, method_config: str | Path | Mapping[str, object] | None
    ) -> type[Method]:
        if method is None or method == "":
            cfg = (
                read_method_config(method_config)
                if isinstance(method_config, (str, Path))
                else dict(method_config or {})
            )
            method = cfg.get("method", "full")
        if not isinstance(method, str):
            raise ValueError(f"method={method!r} must be a registered method name or a Method")
        return get_method_class(method)

    # ------------------------------------------------------------------ request bookkeeping
    def _per_request(
        self,
        requests: list[Instance],
        kind: str,
        fn: Callable[[list[Instance]], list[_Answer]],
        disable_tqdm: bool,
    ) -> list[_Answer]:
        """Run ``fn([request])`` for each request in order, recording which one is current."""
        out = []
        for i, req in enumerate(
            tqdm(requests, disable=disable_tqdm or self.rank != 0, desc=f"kvbench {kind}")
        ):
            self._current = {
                "task": req.task_name,
                "doc_id": req.doc_id,
                "idx": req.idx,
                "request_type": kind,
                "index": i,
                "reads": [],
                "context_tokens": 0,
                "scored_tokens": 0,
            }
            out.extend(fn([req]))
            reads = self._current.pop("reads")
            past = sum(p for _, p in reads)
            quant = [q for q, _ in reads]
            self._current["quantized_fraction"] = (
                None if None in quant else (sum(quant) / past if past else 0.0)
            )
            self._current["past_tokens_read"] = past
            self.request_log.append(self._current)
        self._current = {}
        return out

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        sup = super().loglikelihood
        return self._per_request(
            requests, "loglikelihood", lambda r: sup(r, disable_tqdm=True), disable_tqdm
        )

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        sup = super().loglikelihood_rolling
        return self._per_request(
            requests, "loglikelihood_rolling", lambda r: sup(r, disable_tqdm=True), disable_tqdm
        )

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        sup = super().generate_until
        return self._per_request(
            requests, "generate_until", lambda r: sup(r, disable_tqdm=True), disable_tqdm
        )

    def _note(self, quantized: float | None, past: int) -> None:
        if "reads" in self._current:
            self._current["reads"].append((quantized, past))

    # ------------------------------------------------------------------ the cache protocol
    @property
    def cache_protocol(self) -> str:
        """The decode protocol the method's caches run: :attr:`protocol`, or
        :data:`kvbench.hf.cache.PEER_PROTOCOL` for a peer (its transformers cache's own
        ``update``)."""
        if self.method.transformers_cache(self.model) is None:
            return self.protocol
        return PEER_PROTOCOL

    def new_cache(self) -> Cache:
        """A fresh transformers cache of the method for this model (one per request)."""
        return make_hf_cache(self.method, self.model, protocol=self.protocol)

    def _model_generate(
        self,
        context: torch.Tensor,
        max_length: int,
        stop: list[str],
        **kw: Any,  # lm-eval's generation kwargs, handed on to transformers' generate
    ) -> torch.Tensor:
        """``HFLM._model_generate`` with a fresh method cache passed to ``generate``."""
        if context.shape[0] != 1:
            raise ValueError(
                f"the kvbench backend generates one prompt at a time, got {context.shape[0]}"
            )
        from transformers import LogitsProcessorList

        cache = self.new_cache()
        prompt = context.shape[1]
        backend = self

        class _Reads:  # after each forward: what the next decode step will read
            def __init__(self) -> None:
                self.steps: list[tuple[float | None, int]] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.steps.append((quantized_read(cache), input_ids.shape[1]))
                return scores

        reads = _Reads()
        procs = LogitsProcessorList([*kw.pop("logits_processor", []), reads])
        out = super()._model_generate(
            context,
            max_length,
            stop,
            logits_processor=procs,
            **kw,
            **cache_kwarg(cache, self.model),
        )
        # generated token i>0 came from a decode step reading what followed forward i-1; the
        # first came from the prefill (past: the prompt, all full precision)
        backend._note(0.0 if reads.steps and reads.steps[0][0] is not None else None, prompt - 1)
        for q, seen in reads.steps[:-1]:
            backend._note(q, seen)
        self._current["context_tokens"] = self._current.get("context_tokens", 0) + prompt
        self._current["scored_tokens"] = self._current.get("scored_tokens", 0) + (
            out.shape[1] - prompt
        )
        return out

    @torch.no_grad()
    def score_tokens(
        self, context: list[int], continuation: list[int]
    ) -> tuple[torch.Tensor, list]:
        """Log-probabilities ``[len(continuation), V]`` (float32) of the continuation's
        positions under the protocol above, and ``(quantized tokens read, past tokens)`` per
        scored position.  ``context`` + ``continuation`` is truncated from the left to
        ``max_length + 1`` tokens, as ``HFLM`` does."""
        tokens = (list(context) + list(continuation))[-(self.max_length + 1) :]
        n = len(continuation)
        inp = torch.tensor([tokens[:-1]], dtype=torch.long, device=self.device)
        total = inp.shape[1]
        p = max(total - n, 1)  # prefill: the context without its last token
        cache = self.new_cache()
        kw = cache_kwarg(cache, self.model)
        out = self.model(input_ids=inp[:, :p], use_cache=True, **kw)
        logits = [out.logits[:, -1:]]
        reads: list[tuple[float | None, int]] = [
            (0.0 if quantized_read(cache) is not None else None, p - 1)
        ]
        ours = isinstance(cache, QuantizedKVCache)
        for s in range(p, total, self.chunk):
            e = min(s + self.chunk, total)
            q = quantized_read(cache)
            reads.extend((q, s + j) for j in range(e - s))
            while s < e:  # one call, cut where a decode budget drops a token (eviction)
                m = s + 1 + cache.eviction_appends(e - s - 1) if ours else e
                logits.append(self.model(input_ids=inp[:, s:m], use_cache=True, **kw).logits)
                s = m
        lp = F.log_softmax(torch.cat(logits, dim=1)[0, -n:], dim=-1, dtype=torch.float32)
        return lp, reads[-n:]

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """``(log-likelihood, is greedy)`` per ``(key, context tokens, continuation tokens)``,
        scored through a fresh method cache each (protocol in the module docstring)."""
        res = []
        for key, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("loglikelihood requests need a non-empty context and continuation")
            lp, reads = self.score_tokens(ctx, cont)
            target = torch.tensor(cont, device=lp.device)
            ll = float(lp.gather(1, target[:, None]).sum())
            greedy = bool((lp.argmax(-1) == target).all())
            for q, past in reads:
                self._note(q, past)
            if self._current:
                self._current["context_tokens"] += len(ctx)
                self._current["scored_tokens"] += len(cont)
            res.append((ll, greedy))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, (ll, greedy))
        return res

    def get_model_info(self) -> dict:
        """Model and method information for lm-eval's results (no hub query: the weights'
        sha256 comes from kvbench's loader)."""
        return {
            "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
            "model_dtype": str(self._model.dtype),
            "model_id": self.model_load_info.get("model_id"),
            "model_source": self.model_load_info.get("source"),
            "weights_sha256": self.model_load_info.get("weights_sha256"),
            "kvbench_method": self.method.name,
            "kvbench_config": self.method.config.to_dict(),
            "kvbench_chunk": self.chunk,
            "kvbench_protocol": self.cache_protocol,
            **self.coverage(),
        }

    def coverage(self) -> dict[str, JSONValue]:
        """``kvbench_kv_quantized_fraction`` (task -> share of the past read quantized, over
        :attr:`request_log`; ``None`` for a cache that is not kvbench's), its overall value and
        ``kvbench_min_quantized_fraction``; warns once per backend when a task is below the
        threshold (module docstring)."""
        tasks = per_task(self.request_log)
        out = {
            "kvbench_kv_quantized_fraction": tasks,
            "kvbench_kv_quantized_fraction_all": (
                quantized_fraction(self.request_log) if self.request_log else None
            ),
            "kvbench_min_quantized_fraction": self.min_quantized_fraction,
        }
        head_dim = self.model_load_info.get("head_dim") or 128
        bits = self.method.average_bits(head_dim=head_dim)
        exact = min(bits["key_bits"], bits["value_bits"]) >= 16
        if not exact and not self._coverage_warned:
            msg = low_coverage_message(
                tasks,
                self.request_log,
                self.min_quantized_fraction,
                self.method.name,
                getattr(self.method.config, "residual_length", None),  # some configs only
            )
            if msg is not None:
                self._coverage_warned = True
                warnings.warn(msg, LowQuantizedFractionWarning, stacklevel=2)
        return out
