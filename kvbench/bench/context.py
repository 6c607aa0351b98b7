"""What the workloads of one model share: :class:`RunContext` and its :class:`Shared` state.

The runner makes one context per model of a suite (one per worker under ``--executor ray``);
every workload's ``prepare(ctx)`` and ``run(ctx, method)`` read the model, tokenizer and suite
settings from it.  What a workload computes once and another workload on the same model can
reuse (a capture of the same text, reference logits, selected examples, fitted calibrations)
goes into :attr:`RunContext.shared`, one named, typed field per kind of state, keyed by the
inputs that determine it.  Named fields (rather than one state object per workload) because
the reuse crosses workloads: sweep entries of ``fidelity`` that differ only in ``prefill``
share one capture, every ``memory`` context is cut from the longest capture of its text, and a
calibration fitted for one workload serves the next.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from kvbench.jsontypes import JSONValue

if TYPE_CHECKING:
    from typing import TypeAlias

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvbench.cache.method import Method
    from kvbench.hf.capture import CapturedQKV, PromptState
    from kvbench.hf.shapes import ByteTokenizer

    #: a suite model's tokenizer: a transformers tokenizer, or a shape model's byte stand-in
    Tokenizer: TypeAlias = PreTrainedTokenizerBase | ByteTokenizer

#: what determines a shared entry (workload name first, then the parameters it depends on)
Key = tuple[Hashable, ...]
#: provenance recorded in the manifest (dataset, windows, ...)
Info = dict[str, JSONValue]
#: one example of a task workload: its prompt fields, gold answer, and what its record row
#: carries (values of any type: a group key may be a tuple)
Example = dict[str, object]
#: per-layer tensors ``{layer: [1, H_kv, T, D]}``
LayerKV = dict[int, torch.Tensor]


@dataclass
class Capture:
    """Queries, keys and values captured from one forward of the model over ``tokens`` tokens
    of a text, and their provenance."""

    qkv: CapturedQKV
    info: Info
    tokens: int = 0


@dataclass
class Reference:
    """The full-precision reference of a perplexity workload: token ``windows`` ``[N, T]``
    (int64), each window's prompt state (K/V and last logits of its first ``prefill`` tokens)
    and its float32 reference log-probs ``[T - prefill, vocab]``."""

    windows: torch.Tensor
    prompts: list[PromptState]
    logprobs: list[torch.Tensor]
    info: Info


@dataclass
class BaselineChoice:
    """The ``latency`` pre-pass: two caches (copies A and B) of each baseline candidate
    (``full`` stored in each of ``baseline_storage_dtypes``) interleaved alone for the
    workload's rounds; ``storage_dtype`` is the candidate with the smallest steady median step
    over both copies (ms, ``medians``); ``steps_ms`` / ``steps_ms_b`` each candidate's copy A /
    copy B timed steps (ms, in round order).  The noise check: ``self_ratio`` = steady median
    of the chosen candidate's copy A / copy B's, ``self_interval`` its 95% paired interval over
    the ``self_rounds`` timed rounds (``None``: fewer than two steady steps a side)."""

    storage_dtype: str
    medians: dict[str, float]
    steps_ms: dict[str, list[float]]
    steps_ms_b: dict[str, list[float]]
    self_ratio: float
    self_interval: tuple[float, float] | None
    self_rounds: int


@dataclass
class Shared:
    """State computed once per model and reused by every workload that asks with the same key."""

    #: calibration text K/V ``({layer: k}, {layer: v}, info)`` (runner, :func:`calibrate`)
    calibration_kv: dict[Key, tuple[LayerKV, LayerKV, Info]] = field(default_factory=dict)
    #: a calibrated method (kept unchanged; runs get deep copies) and its provenance
    calibrated: dict[Key, tuple[Method, Info]] = field(default_factory=dict)
    #: model captures of a text (``fidelity``, ``memory``)
    captures: dict[Key, Capture] = field(default_factory=dict)
    #: prompt token ids ``[B, T]`` and their provenance (``latency``)
    token_ids: dict[Key, tuple[torch.Tensor, Info]] = field(default_factory=dict)
    #: per prompt: its ids, the full-precision continuation and its log-probs (``generation``)
    continuations: dict[Key, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )
    #: reference log-probs of token windows (``perplexity``)
    references: dict[Key, Reference] = field(default_factory=dict)
    #: a prompt's full-precision K/V, shared by every cache's prefill (``latency``)
    prompts: dict[Key, PromptState] = field(default_factory=dict)
    #: the faster baseline candidate, chosen once per context, step threads and baseline spec
    #: (``latency``)
    latency_baselines: dict[Key, BaselineChoice] = field(default_factory=dict)
    #: selected examples with rendered prompts, and their provenance (task workloads)
    examples: dict[Key, tuple[list[Example], Info]] = field(default_factory=dict)
    #: what workloads outside the core (``kvbench.integrations``, plugins) share, keyed by a
    #: tuple that starts with the workload's type (the core never reads these values)
    extra: dict[Key, object] = field(default_factory=dict)
    #: the layers a shape model's ``memory`` workload measures (what calibration captures)
    shape_layers_measured: tuple[int, ...] | None = None

    def snapshot(self) -> dict[str, set[Key] | bool]:
        """Which entries exist now (per field: its keys, or whether it is set)."""
        return {
            f.name: set(v) if isinstance(v := getattr(self, f.name), dict) else v is not None
            for f in fields(self)
        }

    def added_since(self, before: dict[str, set[Key] | bool]) -> dict[str, object]:
        """The entries added after :meth:`snapshot` returned ``before`` (field -> new entries,
        or the new value), for :meth:`merge` on another context of the same model."""
        out: dict[str, object] = {}
        for f in fields(self):
            value, had = getattr(self, f.name), before[f.name]
            if isinstance(value, dict):
                assert isinstance(had, set)
                new = {k: v for k, v in value.items() if k not in had}
                if new:
                    out[f.name] = new
            elif value is not None and not had:
                out[f.name] = value
        return out

    def merge(self, added: Mapping[str, object]) -> None:
        """Take entries another context computed (:meth:`added_since`)."""
        for name, value in added.items():
            mine = getattr(self, name)
            if isinstance(mine, dict):
                mine.update(value)
            else:
                setattr(self, name, value)


@dataclass
class RunContext:
    """One model of a suite and what its workloads share.

    ``model`` and ``tokenizer`` are ``None`` until the runner loads the model (and stay
    ``None`` in a model-free suite, ``model_spec`` ``None``); ``model_info`` is what
    :func:`kvbench.hf.models.model_info` reports (``head_dim``, ``max_position_embeddings``,
    ``model_id``, ``random_weights`` for a shape model, ...).  ``limit`` is ``--limit``: the
    most examples, windows or prompts a workload uses (``None``: its own count).
    """

    model: PreTrainedModel | None = None
    tokenizer: Tokenizer | None = None
    model_spec: dict[str, JSONValue] | None = None
    model_info: dict[str, JSONValue] = field(default_factory=dict)
    seed: int = 0
    limit: int | None = None
    shared: Shared = field(default_factory=Shared)

    @property
    def device(self) -> torch.device:
        """The suite's device for this model (``cpu`` model-free)."""
        return torch.device((self.model_spec or {}).get("device", "cpu"))

    @property
    def max_positions(self) -> int:
        """The model's longest context (``max_position_embeddings``; unbounded when unknown)."""
        return self.model_info.get("max_position_embeddings") or 1 << 30
