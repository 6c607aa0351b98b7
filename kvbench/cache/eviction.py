"""Token eviction: methods that hold fewer tokens, composed with any quantizer
(docs/design.md#eviction).

An eviction method (a subclass of :class:`EvictionMethod`) builds its quantizer's layer cache
(``quantizer`` in its config: a method name or ``{name, config}``, default ``full``) and hands
it an :class:`~kvbench.cache.layer.Evictor` (:class:`ScoreEvictor`; :class:`DecodeEvictor` for
a method with a decode budget), which scores the held tokens and says which to drop at prefill
and, for a method with a decode budget, after each decode step.  The layer cache applies the decision to its full-precision parts and its
quantized blocks; positions and masks keep counting every token seen.

Budget (one of two fields): ``keep_ratio`` in (0, 1) (``None``: 0.5 unless ``budget_tokens``
is set), the prompt keeps ``max(int(P * keep_ratio), 1)`` tokens (kvpress's ``int(k_len * (1 - compression_ratio))``) and a method with
a decode budget then holds that many; or ``budget_tokens``, a token count: the prompt keeps
``min(budget_tokens, P)`` and a decode budget holds at most ``budget_tokens``.  Every layer and
KV head keeps the same number of tokens (the indices differ per head).  A decode budget applies
after every decode token, as one-token decode applies it: a decode call of several tokens fits
in the budget's room (:meth:`DecodeEvictor.decode_room`), and callers cut longer ones
(:meth:`kvbench.cache.layer.LayerCache.eviction_appends`).
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench import fields as kf
from kvbench.cache.layer import Evictor, LayerCache
from kvbench.cache.layout import BlockLayout
from kvbench.cache.method import Method, MethodConfig

#: what a ``quantizer`` field allows, in the words of its refusals
QUANTIZER_TEXT = (
    "a registered method name, or {name: <method>, config: {...}} (a method with a kvbench "
    "layer cache, keys_values and no calibration; not an eviction method)"
)


#: the fraction of the prompt kept when neither ``keep_ratio`` nor ``budget_tokens`` is set
KEEP_RATIO = 0.5


@dataclass(frozen=True)
class EvictionConfig(MethodConfig):
    """Fields every eviction method shares.

    Attributes
    ----------
    keep_ratio : fraction of the prompt's tokens kept, in (0, 1); ``None``: :data:`KEEP_RATIO`
        unless ``budget_tokens`` is set (setting both is refused).
    budget_tokens : tokens kept (a positive integer); ``None`` when ``keep_ratio`` is set.
    quantizer : the method that stores the kept tokens: a registered name or ``{name: ...,
        config: {...}}`` (stored as the latter); default ``full``.  Rotation, ``storage_dtype``
        and sinks are the quantizer's fields.
    """

    keep_ratio: float | None = kf.spec(
        None, float, low=0, high=1, low_open=True, high_open=True, optional=True,
        text="a number in (0, 1), or None (0.5 unless budget_tokens is set)",
    )  # fmt: skip
    budget_tokens: int | None = kf.spec(None, int, low=1, optional=True)
    quantizer: object = kf.spec("full", None, text=QUANTIZER_TEXT)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keep_ratio is not None and self.budget_tokens is not None:
            self.reject("budget_tokens", "None when keep_ratio is set (one budget)")
        for name, default in (("rotation", "none"), ("storage_dtype", None)):
            if getattr(self, name) != default:
                self.reject(name, f"{default!r} on the evictor; set it in the quantizer's config")
        if self.prefill_attention != "full":
            self.reject(
                "prefill_attention",
                "'full' (the prompt attends to itself, then the evictor drops tokens)",
            )
        object.__setattr__(self, "quantizer", _quantizer_entry(self))
        build_quantizer(self)  # refuse an unknown or unfit quantizer before any work

    @property
    def ratio(self) -> float | None:
        """The fraction kept: ``keep_ratio``, :data:`KEEP_RATIO` when neither budget field is
        set, ``None`` with ``budget_tokens``."""
        if self.budget_tokens is not None:
            return None
        return KEEP_RATIO if self.keep_ratio is None else self.keep_ratio

    def kept(self, tokens: int) -> int:
        """Tokens a prompt of ``tokens`` keeps (module docstring)."""
        if self.budget_tokens is None:
            return max(int(tokens * self.ratio), 1)
        return min(int(self.budget_tokens), tokens)


class QuantizerEntry(dict):
    """A config's ``quantizer``: ``{"name": str, "config": dict}``, a plain mapping (JSON, the
    suite's ``methods:`` form) that hashes by its JSON text, as every field of a frozen config
    must hash."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True))


def _quantizer_entry(config: EvictionConfig) -> QuantizerEntry:
    """``config.quantizer`` as a :class:`QuantizerEntry`; refusal naming the field."""
    q = config.quantizer
    if isinstance(q, str) and q:
        return QuantizerEntry(name=q, config={})
    if isinstance(q, Mapping) and set(q) <= {"name", "config"} and isinstance(q.get("name"), str):
        inner = q.get("config") or {}
        if isinstance(inner, Mapping):
            return QuantizerEntry(name=q["name"], config=dict(inner))
    config.reject("quantizer", QUANTIZER_TEXT)


def build_quantizer(config: EvictionConfig) -> Method:
    """The quantizer method of ``config`` (built from the registry).  Raises ``ValueError``
    naming ``quantizer`` for an unknown or unfit method (and the quantizer's own refusal of its
    config fields)."""
    from kvbench.cache.registry import get_method

    entry = config.quantizer
    try:
        method = get_method(entry["name"], **entry["config"])
    except ValueError as e:
        raise ValueError(f"{type(config).__name__}: field 'quantizer': {e}") from None
    caps = method.capabilities
    if isinstance(method, EvictionMethod) or not (
        caps.layer_cache and caps.keys_values and not caps.needs_calibration
    ):
        config.reject("quantizer", QUANTIZER_TEXT)
    return method


def choose_drop(scores: torch.Tensor, n: int, bounds: list[int]) -> torch.Tensor:
    """Which ``n`` held tokens to drop: int64 ``[B, H_kv, n]``, ascending per row and head.

    ``scores``: ``[B, H_kv, T]`` over the held tokens, higher = keep (``inf``: never drop).
    ``bounds``: :meth:`LayerCache.part_bounds`: tokens before ``bounds[0]`` are sinks (never
    dropped) and each part between two bounds must lose the same number of tokens in every
    row and head.  The plan: the ``n`` lowest scores of each row and head; where those counts
    per part differ between rows or heads (per-head decisions over tokens some of which are
    already quantized), each part loses the mean count over rows and heads (floors, the rest to
    the largest remainders) and each row and head drops its lowest scores within each part.

    Raises ``ValueError`` when fewer than ``n`` tokens may be dropped."""
    b, h, t = scores.shape
    ns = bounds[0]
    s = scores.clone()
    s[..., :ns] = math.inf
    if n > t - ns:
        raise ValueError(f"cannot drop {n} of {t} held tokens: {ns} are sinks, kept")
    drop = torch.topk(s, n, dim=-1, largest=False).indices.sort(-1).values
    segs = list(zip(bounds[:-1], bounds[1:], strict=True))
    if len(segs) <= 1:
        return drop
    counts = torch.stack([((drop >= lo) & (drop < hi)).sum(-1) for lo, hi in segs], -1)
    if bool((counts == counts[:1, :1]).all()):
        return drop
    mean = counts.double().mean((0, 1))
    plan = mean.floor().long()
    rest = n - int(plan.sum())
    plan[torch.argsort(mean.floor() - mean)[:rest]] += 1  # largest remainders first
    parts = [
        torch.topk(s[..., lo:hi], int(k), dim=-1, largest=False).indices + lo
        for (lo, hi), k in zip(segs, plan.tolist(), strict=True)
        if k
    ]
    return torch.cat(parts, -1).sort(-1).values


class ScoreEvictor(abc.ABC):
    """An :class:`~kvbench.cache.layer.Evictor` that drops the lowest-scored tokens at prefill.

    Subclasses define :meth:`prefill_scores`: ``[B, H_kv, P]`` over the prompt's tokens,
    higher = keep.  The budget is the config's (module docstring).  No decode eviction: an
    evictor that keeps a fixed budget while decoding derives from :class:`DecodeEvictor`."""

    needs_queries: ClassVar[bool] = False
    evicts_at_decode: ClassVar[bool] = False
    observes_attention: ClassVar[bool] = False

    def __init__(self, config: EvictionConfig) -> None:
        self.config = config
        self.limit: int | None = None  # the decode budget, set at prefill

    def check_prompt(self, tokens: int) -> None:
        """Refuse (``ValueError`` naming the field) a budget a prompt of ``tokens`` tokens
        cannot meet: ``budget_tokens`` above ``tokens`` for an evictor without a decode
        budget (it would keep more tokens than it saw)."""
        c = self.config
        if not self.evicts_at_decode and c.budget_tokens is not None and c.budget_tokens > tokens:
            c.reject(
                "budget_tokens",
                f"at most the prompt's {tokens} tokens (this method evicts at prefill only); "
                "or set keep_ratio in (0, 1)",
            )

    @abc.abstractmethod
    def prefill_scores(self, keys: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
        """``[B, H_kv, P]`` scores of the prompt's keys ``[B, H_kv, P, D]``."""

    def at_prefill(
        self, layer: LayerCache, keys: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor | None:
        t = keys.shape[2]
        keep = self.config.kept(t)
        budget = self.config.budget_tokens
        self.limit = keep if budget is None else budget
        if keep >= t:
            return None
        return choose_drop(self.prefill_scores(keys, queries), t - keep, layer.part_bounds())

    def at_step(self, layer: LayerCache) -> torch.Tensor | None:
        return None

    def decode_room(self, layer: LayerCache) -> int | None:
        """``None``: no decode budget, :meth:`at_step` drops nothing."""
        return None

    def observe(self, layer: LayerCache, probs: torch.Tensor, lengths: torch.Tensor | None) -> None:
        return None

    def reset(self) -> None:
        self.limit = None


class DecodeEvictor(ScoreEvictor):
    """A :class:`ScoreEvictor` that also keeps a fixed budget while decoding: after every
    decode step the layer holds at most the prefill's kept count (``keep_ratio``) or
    ``budget_tokens``, dropping the lowest :meth:`step_scores`.

    Subclasses define :meth:`step_scores` and may define :meth:`dropped` (their per-token
    state follows the held tokens)."""

    evicts_at_decode = True

    def over_budget(self, layer: LayerCache) -> int:
        """Tokens ``layer`` holds above the decode budget (0: none, or no budget yet)."""
        if self.limit is None or layer.seq_length <= self.limit:
            return 0
        return layer.seq_length - self.limit

    @abc.abstractmethod
    def step_scores(self, layer: LayerCache) -> torch.Tensor:
        """``[B, H_kv, T]`` scores of the held tokens after a decode step (only asked when the
        layer is over budget)."""

    def dropped(self, drop: torch.Tensor) -> None:
        """Called with the decode decision ``drop [B, H_kv, n]`` (default: nothing)."""
        return None

    def decode_room(self, layer: LayerCache) -> int | None:
        """Tokens ``layer`` can take before a decode step drops one: the budget less the
        tokens held (0 once it is full; ``None`` before the prefill set the budget)."""
        if self.limit is None:
            return None
        return max(self.limit - layer.seq_length, 0)

    def at_step(self, layer: LayerCache) -> torch.Tensor | None:
        n = self.over_budget(layer)
        if not n:
            return None
        drop = choose_drop(self.step_scores(layer), n, layer.part_bounds())
        self.dropped(drop)
        return drop


class ObservingEvictor(DecodeEvictor):
    """A :class:`DecodeEvictor` whose decode decisions read the attention of the steps
    (``observes_attention``): :meth:`observed` refuses a decision when no step's attention
    arrived since the last one (a path that hands none over)."""

    needs_queries = True
    observes_attention = True

    def __init__(self, config: EvictionConfig) -> None:
        super().__init__(config)
        self.fresh = True  # scores arrived since the last decode decision (the prefill's count)

    def observe(self, layer: LayerCache, probs: torch.Tensor, lengths: torch.Tensor | None) -> None:
        self.fresh = True

    def observed(self, name: str) -> None:
        """Raise ``ValueError`` unless scores arrived since the last decision; then consume
        them."""
        if not self.fresh:
            raise ValueError(
                f"{name} scores tokens by the attention decode steps read, and none arrived "
                "since its last eviction: run decode attention through LayerCache.attend "
                "(QuantizedKVCache does for this method), not over keys_values()"
            )
        self.fresh = False

    def reset(self) -> None:
        super().reset()
        self.fresh = True


def attention_probs(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Causal softmax ``[B, H_q, n_q, T]`` of the last ``n_q`` positions' post-RoPE
    ``queries [B, H_q, n_q, D]`` over ``keys [B, H_kv, T, D]`` (GQA: query head ``h`` reads
    KV head ``h // (H_q / H_kv)``), as eager attention computes it: logits in the keys' dtype
    scaled by ``1/sqrt(D)``, softmax in float32, cast back to the queries' dtype."""
    b, hkv, t, d = keys.shape
    nq = queries.shape[2]
    k = keys.repeat_interleave(queries.shape[1] // hkv, dim=1)
    logits = torch.matmul(queries, k.transpose(2, 3)) / math.sqrt(d)
    mask = torch.triu(torch.full_like(logits, -math.inf), diagonal=t - nq + 1)
    return torch.softmax(logits + mask, dim=-1, dtype=torch.float32).to(queries.dtype)


def pad_new(scores: torch.Tensor, held: int) -> torch.Tensor:
    """``scores [B, H, T0]`` extended to ``held`` tokens with ``inf`` for the tokens stored
    since (never dropped before they were scored)."""
    extra = held - scores.shape[2]
    return torch.nn.functional.pad(scores, (0, extra), value=math.inf) if extra > 0 else scores


def kept_after(scores: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``scores [B, H, T]`` of the tokens left after dropping ``drop [B, H, n]``."""
    keep = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    keep.scatter_(2, drop.to(scores.device), False)
    return scores[keep].reshape(*scores.shape[:2], -1)


class EvictionMethod(Method, abc.ABC):
    """Base of the eviction methods: the config's quantizer stores the tokens, :meth:`evictor`
    says which to drop.  Bits, layouts and sinks are the quantizer's; padded batches are
    refused (``capabilities.padding`` False)."""

    Config: ClassVar[type[MethodConfig]] = EvictionConfig

    def __init__(self, config: MethodConfig | None = None, **overrides: object) -> None:
        super().__init__(config, **overrides)
        self.quantizer = build_quantizer(self.config)

    @abc.abstractmethod
    def evictor(self, layer_idx: int) -> Evictor:
        """The evictor of layer ``layer_idx`` (a fresh one per layer)."""

    @property
    def needs_queries(self) -> bool:
        return self.capabilities.needs_queries or self.quantizer.needs_queries

    def for_model(self, info: Mapping[str, object]) -> Method:
        self.quantizer = self.quantizer.for_model(info)
        return self

    def new_layer(
        self, layer_idx: int, num_kv_heads: int, head_dim: int, *args: object, **kwargs: object
    ) -> LayerCache:
        """The quantizer's layer cache with this method's :meth:`evictor`: the arguments of
        :meth:`Method.new_layer` (``dtype``, ``device`` after the three sizes) go to the
        quantizer's ``new_layer`` as given, so the two signatures cannot drift apart."""
        layer = self.quantizer.new_layer(layer_idx, num_kv_heads, head_dim, *args, **kwargs)
        if self.observes_attention and (
            type(layer).observe_attention is not LayerCache.observe_attention
            or type(layer).observes_attention is not LayerCache.observes_attention
        ):
            self.config.reject(
                "quantizer",
                f"a method whose layer cache leaves observe_attention to the evictor "
                f"({type(layer).__name__} observes attention for itself)",
            )
        layer.needs_queries = layer.needs_queries or self.capabilities.needs_queries
        layer.evictor = self.evictor(layer_idx)
        return layer

    def key_layout(self, head_dim: int) -> BlockLayout:
        return self.quantizer.key_layout(head_dim)

    def value_layout(self, head_dim: int) -> BlockLayout:
        return self.quantizer.value_layout(head_dim)

    def average_bits(
        self, head_dim: int = 128, tokens: int = 32768
    ) -> dict[str, float | dict[str, float]]:
        """The quantizer's nominal bits per held element (eviction changes how many tokens are
        held, not how each is stored)."""
        return self.quantizer.average_bits(head_dim, tokens)
