"""The method interface: a frozen config, capabilities, layer caches and the bit budget.

A method is a class registered under the entry-point group ``kvbench.methods``.  It declares
``Config`` (a frozen dataclass, validated in ``__post_init__``), ``capabilities``, a one-line
``description``, and builds one :class:`~kvbench.cache.layer.LayerCache` per attention layer.  The
common machinery (residual window, sinks, value quantization, flush schedules, bit formula)
lives here; a method usually only supplies its key codec (and a schedule): its nominal bits are
derived from the codec's stored layout (:mod:`kvbench.cache.layout`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Concatenate, NoReturn, ParamSpec

import torch

from kvbench import fields as kf
from kvbench.cache import finite, rotation
from kvbench.cache.blocks import Codec, PerTokenCodec
from kvbench.cache.layer import LayerCache
from kvbench.cache.layout import BlockLayout, average_bits, bit_terms
from kvbench.cache.quant import SUPPORTED_BITS, resolve_scale_dtype
from kvbench.cache.rotation import BLOCKS, ROTATIONS, ChannelRotation
from kvbench.cache.schedule import BlockSchedule, NeverSchedule, SlidingSchedule

if TYPE_CHECKING:  # annotations only: the core imports transformers where it uses it
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.cache_utils import Cache

P = ParamSpec("P")

#: the wrappers made by :func:`_rotating`
_ROTATING: weakref.WeakSet[Callable[..., object]] = weakref.WeakSet()

#: bits of one (scale, zero) pair by scale dtype, the ``m_q`` of docs/methods.md#average-bits
PAIR_BITS = {"float16": 32, "bfloat16": 32, "float32": 64}


@dataclass(frozen=True)
class Capabilities:
    """What a method supports; the runner and the reports read these, never method names.

    Which attention kernels read a method's stored blocks is not declared here: it follows
    from the block types' registrations (``kvbench.attention.dispatch.backends_for``), and each
    decode step records the backend that ran (``attend_path``)."""

    needs_queries: bool = False
    keys_values: bool = True
    needs_calibration: bool = False
    reconstruction: bool = False  # parts of the algorithm are [RECON] ([reconstruction] markers, docs/methods.md (introduction))
    #: builds kvbench LayerCaches (``new_layer``); False for peers that wrap a transformers
    #: cache (:mod:`kvbench.hf.peers`), which run only in workloads that accept
    #: ``make_hf_cache`` (memory, latency)
    layer_cache: bool = True
    #: a left-padded batch (prompts of different lengths) gives each row the results of that row
    #: run alone (docs/design.md#padding); False: padded batches are refused, naming the method
    padding: bool = True
    #: holds fewer tokens than it saw (token eviction, docs/design.md#eviction): the layer
    #: cache's ``seq_length`` falls below its ``seen_tokens``; workloads compare what it holds
    #: with every token seen and record ``held_token_fraction``
    evicts: bool = False

    def to_dict(self) -> dict[str, bool]:
        return dataclasses.asdict(self)


#: ``prefill_attention`` values (docs/design.md#when-quantization-happens): ``full``, the
#: prompt's queries read its full-precision K/V, which are then stored (how KIVI-style methods
#: deploy); ``stored``, the prompt is stored first (prefill and its flush) and its queries read
#: what the cache holds (llama.cpp)
PREFILL_ATTENTION = ("full", "stored")

#: ``storage_dtype`` values (docs/design.md#storage-dtype): the dtype the full-precision parts
#: (sinks, residual, ``full``'s K/V) are stored in; ``None`` (the default) is the compute dtype
STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method config: frozen, typed, validated, serializable.

    Each field declares what it allows with :func:`kvbench.fields.spec`; ``__post_init__``
    checks them all (:func:`kvbench.fields.validate`, errors prefixed with the class name).  A
    subclass adds its cross-field rules after ``super().__post_init__()`` and raises them through
    :meth:`reject`.

    Every method has the keyword-only rotation fields ``rotation``, ``rotation_block`` and
    ``rotation_seed`` (docs/methods.md#rotation; QuaRot arXiv:2404.00456), applied by the layer
    cache (:mod:`kvbench.cache.rotation`), ``prefill_attention`` (:data:`PREFILL_ATTENTION`),
    honoured by kvbench's transformers attention function (:mod:`kvbench.hf.attention`), and
    ``storage_dtype`` (:data:`STORAGE_DTYPES` or ``None``: the compute dtype), the dtype the
    layer cache stores its full-precision parts in (docs/design.md#storage-dtype); a method
    that cannot honour it names why in :attr:`Method.storage_dtype_refusal`.
    """

    _: KW_ONLY
    rotation: str = kf.spec("none", str, choices=ROTATIONS)
    rotation_block: int = kf.spec(64, int, choices=BLOCKS, text="powers of two 2..4096")
    rotation_seed: int | None = kf.spec(None, int, low=0, optional=True)
    prefill_attention: str = kf.spec("full", str, choices=PREFILL_ATTENTION)
    storage_dtype: str | None = kf.spec(
        None, str, choices=tuple(STORAGE_DTYPES), optional=True,
        text="None (the compute dtype), float16 or bfloat16",
    )  # fmt: skip

    # The windows of a config that declares no such field: plain class attributes, not
    # dataclass fields (a subclass declares the field with its own default: CacheConfig).
    #: N_s, first tokens kept in full precision (0: no sinks)
    num_sink_tokens = 0
    #: R, newest tokens kept in full precision (``None``: the config has no residual window)
    residual_length = None
    #: G, tokens per key group (``None``: the config has no token groups)
    group_size = None

    #: fields left out of :meth:`to_dict` while they hold their default: fields added after
    #: records existed, so the config (and the ``run_id`` hashed from it) of a run that does not
    #: use them stays what it was (docs/design.md#run-id)
    omitted_defaults: ClassVar[tuple[str, ...]] = (
        "rotation",
        "rotation_block",
        "rotation_seed",
        "prefill_attention",
        "storage_dtype",
    )

    def __post_init__(self) -> None:
        kf.validate(self, type(self).__name__)
        if self.rotation == "none":
            if self.rotation_seed is not None:
                self.reject("rotation_seed", "None unless rotation='hadamard'")
            if self.rotation_block != 64:
                self.reject("rotation_block", "64 (the default) unless rotation='hadamard'")

    def reject(self, name: str, allowed: str) -> NoReturn:
        """Raise the refusal of field ``name`` (its current value) with ``allowed`` in words:
        for rules that relate several fields (:func:`kvbench.fields.reject`)."""
        kf.reject(type(self).__name__, name, getattr(self, name), allowed)

    @classmethod
    def from_dict(cls, values: Mapping[str, object], where: str = "") -> MethodConfig:
        """Build from a mapping; unknown keys raise ``ValueError`` naming them and the allowed
        fields (``where`` is prefixed, e.g. a suite file name)."""
        cls.check_names(values, where)
        return cls(**values)

    @classmethod
    def check_names(cls, values: Mapping[str, object], where: str = "") -> None:
        """Raise the ``ValueError`` of :meth:`from_dict` for keys of ``values`` that are not
        fields."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            pre = f"{where}: " if where else ""
            raise ValueError(
                f"{pre}unknown config field(s) {unknown} for {cls.__name__}; allowed: {allowed}"
            )

    def to_dict(self) -> dict[str, object]:
        """The fields as a dict, without those of :attr:`omitted_defaults` at their default."""
        out = dataclasses.asdict(self)
        for f in fields(self):
            if f.name in self.omitted_defaults and out[f.name] == f.default:
                del out[f.name]
        return out


def require_padding(method: Method) -> None:
    """Raise ``ValueError`` naming ``method`` unless its ``capabilities.padding`` is True (a
    padded batch would give its rows results that depend on their padding)."""
    if not method.capabilities.padding:
        name = method.name or type(method).__name__
        raise ValueError(
            f"method {name!r} does not support padded batches (capabilities.padding=False): "
            "run prompts of different lengths one at a time (batch_size: 1), or batch only "
            "prompts of equal length"
        )


@dataclass(frozen=True)
class CacheConfig(MethodConfig):
    """Fields every quantized cache shares (docs/design.md#names).

    Attributes
    ----------
    group_size : G, tokens per per-channel key group (and the page size).
    residual_length : R, newest tokens kept in full precision; a multiple of G for token-axis
        groups.
    num_sink_tokens : N_s, first tokens kept in full precision.
    value_bits : 1..8 (per-token values, KIVI style) or 16 (values in full precision).
    value_group_size : channels per per-token value group; ``None`` = min(G, head_dim).
    scale_dtype : storage of scales and zeros: ``float16`` (default), ``bfloat16``, ``float32``.
    """

    group_size: int = kf.spec(128, int, low=1)
    residual_length: int = kf.spec(128, int, low=0)
    num_sink_tokens: int = kf.spec(0, int, low=0)
    value_bits: int = kf.spec(16, int, choices=SUPPORTED_BITS)
    value_group_size: int | None = kf.spec(None, int, low=1, optional=True)
    scale_dtype: str = kf.spec("float16", str, choices=tuple(sorted(PAIR_BITS)))

    #: whether the method's keys use token-axis groups (then R must be a multiple of G)
    token_axis_keys: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_axis_keys and (
            self.residual_length == 0 or self.residual_length % self.group_size
        ):
            self.reject(
                "residual_length",
                f"a positive multiple of group_size={self.group_size} (per-channel key groups "
                "hold G tokens)",
            )

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return resolve_scale_dtype(self.scale_dtype)

    def channel_group(self, head_dim: int) -> int:
        """Per-token group width: ``value_group_size`` or min(G, head_dim); must divide D."""
        cg = self.value_group_size or min(self.group_size, head_dim)
        if head_dim % cg:
            raise ValueError(
                f"value_group_size={cg} does not divide head_dim={head_dim}; "
                f"use a divisor of {head_dim}"
            )
        return cg


def _rotating(
    new_layer: Callable[Concatenate[Method, P], LayerCache],
) -> Callable[Concatenate[Method, P], LayerCache]:
    """Wrap a ``Method.new_layer``: check :meth:`Method.rotation` for the head_dim first, then
    hand it to the layer cache it returns (``layer.rotation``), with the config's
    ``storage_dtype`` (``layer.storage_dtype``)."""
    if inspect.unwrap(new_layer, stop=_ROTATING.__contains__) in _ROTATING:  # wrapped already
        return new_layer

    @functools.wraps(new_layer)
    def wrapper(self: Method, *args: P.args, **kwargs: P.kwargs) -> LayerCache:
        rot = self.rotation(args[2] if len(args) > 2 else kwargs["head_dim"])
        layer = new_layer(self, *args, **kwargs)
        if rot is not None:
            layer.rotation = rot
        storage = self.config.storage_dtype
        if storage is not None:
            layer.storage_dtype = STORAGE_DTYPES[storage]
        return layer

    _ROTATING.add(wrapper)
    return wrapper


#: what ``Method.calibrate`` takes per side: ``[..., D]`` tensors by layer index, or in layer
#: order
CalibrationData = Mapping[int, torch.Tensor] | Sequence[torch.Tensor]
#: a ``Method.calibrate``: ``(method, keys, values, source=...)`` -> the calibrated method
Calibrate = Callable[..., "Method"]


def _rotated_calibration(calibrate: Calibrate) -> Calibrate:
    """Wrap a ``Method.calibrate``: its keys and values (a mapping or a sequence of ``[...,
    D]`` tensors) are rotated as the layer caches will store them."""

    def rotate(
        method: Method, data: CalibrationData | None, side: str
    ) -> dict[int, torch.Tensor] | list[torch.Tensor] | None:
        if data is None:
            return None

        def one(x: torch.Tensor) -> torch.Tensor:
            rot = method.rotation(x.shape[-1])
            return x if rot is None else rot.forward(x, side)

        if isinstance(data, Mapping):
            return {k: one(x) for k, x in data.items()}
        return [one(x) for x in data]

    @functools.wraps(calibrate)
    def wrapper(
        self: Method,
        keys_by_layer: CalibrationData,
        values_by_layer: CalibrationData | None = None,
        *a: object,
        **kw: object,
    ) -> Method:
        keys, values = rotate(self, keys_by_layer, "keys"), rotate(self, values_by_layer, "values")
        return calibrate(self, keys, values, *a, **kw)

    return wrapper


class Method:
    """Base class of KV-cache quantization methods.

    Subclasses set ``Config``, ``description``, ``source`` and ``capabilities`` and implement
    :meth:`key_codec` (or override :meth:`new_layer`).  The nominal bits follow from
    :meth:`key_layout` / :meth:`value_layout`, by default the layouts of the codecs; a method
    whose codec cannot be built without data (calibration) overrides those two.
    """

    Config: ClassVar[type[MethodConfig]] = CacheConfig
    description: ClassVar[str] = ""
    source: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: why this method cannot store its full-precision parts in ``storage_dtype`` (its layer
    #: cache keeps them outside the common sinks/residual path), or ``None``: it can.  A config
    #: that sets ``storage_dtype`` is refused with this reason (so is any for a method without
    #: a layer cache, ``capabilities.layer_cache=False``)
    storage_dtype_refusal: ClassVar[str | None] = None
    #: the method scores tokens by the attention decode steps read (an eviction method's
    #: evictor, docs/design.md#eviction): a transformers cache routes its decode attention
    #: through ``LayerCache.attend``, which hands the probabilities over
    observes_attention: ClassVar[bool] = False
    name: str = ""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "new_layer" in cls.__dict__:  # caches know their layer (NaN/Inf messages), rotation
            cls.new_layer = _rotating(finite.named_layers(cls.__dict__["new_layer"]))
        if "calibrate" in cls.__dict__:  # calibration sees the space the cache stores
            cls.calibrate = _rotated_calibration(cls.__dict__["calibrate"])

    def __init__(self, config: MethodConfig | None = None, **overrides: object) -> None:
        if config is None:
            config = self.Config.from_dict(overrides)
        elif overrides:
            type(config).check_names(overrides)  # replace() would raise a bare TypeError
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, self.Config):
            raise ValueError(
                f"config must be a {self.Config.__name__}, got {type(config).__name__}"
            )
        if config.rotation != "none" and not self.capabilities.layer_cache:
            config.reject(
                "rotation",
                f"'none' ({type(self).__name__} wraps a transformers cache, capabilities."
                "layer_cache=False, and rotations are applied by kvbench's LayerCache)",
            )
        storage = config.storage_dtype
        if storage is not None:
            why = self.storage_dtype_refusal
            if not self.capabilities.layer_cache:
                why = (
                    f"{type(self).__name__} wraps a transformers cache (capabilities."
                    "layer_cache=False) and stores K/V in its own dtypes"
                )
            if why is not None:
                config.reject("storage_dtype", f"None (the compute dtype) for this method: {why}")
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    @property
    def needs_queries(self) -> bool:
        """Whether this configured method needs post-RoPE queries at prefill.

        Defaults to ``capabilities.needs_queries``; a method whose need depends on its config
        (PN-Mix: query scores vs key-only scores) overrides it.  Runners and :meth:`new_layer`
        read this property, not the class capability."""
        return self.capabilities.needs_queries

    def for_model(self, info: Mapping[str, object]) -> Method:
        """Fill config fields that depend on the model (``kvbench.hf.info.model_info``: head_dim,
        rope_theta, ...) and that the user left unset; returns the method (default: as is)."""
        return self

    @property
    def needs_calibration(self) -> bool:
        """Whether this configured method must be calibrated before building caches
        (default ``capabilities.needs_calibration``)."""
        return self.capabilities.needs_calibration

    def calibrate(
        self,
        keys_by_layer: dict[int, torch.Tensor],
        values_by_layer: dict[int, torch.Tensor] | None = None,
        source: str = "",
    ) -> Method:
        """Fit static parameters from full-precision post-RoPE keys (and values)
        ``[N, H_kv, T, D]`` per layer index, captured on a calibration text disjoint from the
        evaluation text (named in ``source`` and recorded by the runner).  Returns the method.

        Raises ``ValueError`` for methods that take no calibration."""
        raise ValueError(f"method {self.name or type(self).__name__!r} takes no calibration")

    # ----------------------------------------------------------- layer construction
    def key_codec(self, layer_idx: int, head_dim: int) -> Codec | None:
        """The codec of layer ``layer_idx``'s keys, or ``None`` for full-precision keys.

        A method supplies its keys one of two ways: this codec (the default :meth:`new_layer`
        and :meth:`key_layout` read it) or an override of :meth:`new_layer` together with
        :meth:`key_layout`.  Raises ``TypeError`` naming both when a class does neither."""
        raise TypeError(
            f"method class {type(self).__name__} defines no key_codec(layer_idx, head_dim): "
            "return a codec (or None for full-precision keys), or override new_layer and "
            "key_layout"
        )

    def key_schedule(self) -> object:
        """Default: KIVI's key schedule (blocks of R tokens, docs/methods.md#kivi)."""
        return BlockSchedule(self.config.residual_length)

    def value_codec(self, layer_idx: int, head_dim: int) -> Codec | None:
        """Default values: KIVI-style per-token groups of ``value_group_size`` channels."""
        c = self.config
        if c.value_bits == 16:
            return None
        return PerTokenCodec(
            c.value_bits, c.torch_scale_dtype, channel_group=c.channel_group(head_dim)
        )

    def value_schedule(self) -> object:
        c = self.config
        return NeverSchedule() if c.value_bits == 16 else SlidingSchedule(c.residual_length)

    def rotation(self, head_dim: int) -> ChannelRotation | None:
        """The channel rotation this method's layer caches apply for ``head_dim`` channels
        (:func:`kvbench.cache.rotation.for_config` of the config; ``None``: none).  Raises
        ``ValueError`` naming ``rotation_block`` when it does not divide ``head_dim``.  A method
        that reorders its key channels (``int4-block``'s GGUF order) overrides it."""
        return rotation.for_config(self.config, head_dim)

    @_rotating
    @finite.named_layers
    def new_layer(
        self,
        layer_idx: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> LayerCache:
        """One empty :class:`LayerCache` for layer ``layer_idx`` with ``num_kv_heads`` heads of
        ``head_dim`` channels.  Raises ``ValueError`` if the config does not fit ``head_dim``.

        Every override is wrapped (``__init_subclass__``): the cache knows its ``layer_idx`` and
        gets :meth:`rotation` (checked before the layer is built) as ``layer.rotation``."""
        return self.layer_cache(layer_idx, num_kv_heads, head_dim)

    def layer_cache(
        self,
        layer_idx: int,
        num_kv_heads: int,
        head_dim: int,
        cls: type[LayerCache] = LayerCache,
        **extra: object,
    ) -> LayerCache:
        """``cls`` (a :class:`LayerCache` subclass taking LayerCache's arguments, then
        ``extra``) built from this method's parts: :meth:`key_codec`, :meth:`value_codec`,
        :meth:`key_schedule`, :meth:`value_schedule`, the config's ``num_sink_tokens`` (0 if
        it has none) and :attr:`needs_queries`.  The one place a method's layer is assembled;
        a ``new_layer`` override that needs its own layer class calls this."""
        return cls(
            self.key_codec(layer_idx, head_dim),
            self.value_codec(layer_idx, head_dim),
            self.key_schedule(),
            self.value_schedule(),
            num_sink_tokens=self.config.num_sink_tokens,
            needs_queries=self.needs_queries,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            **extra,
        )

    def transformers_cache(
        self, model: PreTrainedModel | PretrainedConfig, attend: bool = False
    ) -> Cache | None:
        """A transformers ``Cache`` of the method's own for ``model`` (a model or its config), or
        ``None`` (the default): then :func:`kvbench.hf.cache.make_hf_cache` builds kvbench's
        ``QuantizedKVCache`` over :meth:`new_layer`.  The transformers peers return their cache
        here."""
        return None

    def unavailable_reason(self) -> str | None:
        """Why this method cannot run here (a missing optional package), or ``None``.  The
        runner skips a method that gives a reason and says why."""
        return None

    def token_limit(self) -> tuple[str, object, int] | None:
        """The most tokens per sequence this configured method's cache holds before a run
        fails (a budget sized for fewer tokens: PM-KVQ's ``budget_tokens``), as ``(config
        field, its value, tokens)``, or ``None`` (the default): no such limit.
        :func:`kvbench.bench.preflight.check_token_limits` refuses a suite whose longest
        context is above it before any work."""
        return None

    # ----------------------------------------------------------- bit budget
    def _codec_layout(self, codec: Codec | None, side: str, head_dim: int) -> BlockLayout:
        if codec is None:
            return BlockLayout.full_precision(head_dim)
        if not callable(getattr(codec, "layout", None)):  # a plugin codec without it
            raise TypeError(
                f"{type(self).__name__}: {side} codec {type(codec).__name__} has no "
                f"layout(head_dim, flush_tokens) to derive the nominal bits from; implement it "
                f"(kvbench.cache.layout, docs/design.md#stored-layouts) or override {side}_layout()"
            )
        # tokens per flush, for codecs whose group is a whole flush: R, at least 1
        return codec.layout(head_dim, max(self.config.residual_length or 1, 1))

    def key_layout(self, head_dim: int) -> BlockLayout:
        """What a key block stores for ``head_dim`` channels (:class:`~kvbench.cache.layout.BlockLayout`).

        Default: the layout of :meth:`key_codec` (layer 0); full precision without a codec.
        Raises ``TypeError`` for a codec without ``layout``."""
        return self._codec_layout(self.key_codec(0, head_dim), "key", head_dim)

    def value_layout(self, head_dim: int) -> BlockLayout:
        """What a value block stores; default: the layout of :meth:`value_codec`."""
        return self._codec_layout(self.value_codec(0, head_dim), "value", head_dim)

    def key_bit_terms(self, head_dim: int) -> dict[str, float]:
        """Terms of docs/methods.md#average-bits for keys (``b_eff``, ``m_q``, ``group`` elements,
        ``m_sal``), derived from :meth:`key_layout` (a method describes its stored layout; it
        does not restate the formula)."""
        return bit_terms(self.key_layout(head_dim)).to_dict()

    def value_bit_terms(self, head_dim: int) -> dict[str, float]:
        """As :meth:`key_bit_terms` for values (:meth:`value_layout`)."""
        return bit_terms(self.value_layout(head_dim)).to_dict()

    def average_bits(
        self, head_dim: int = 128, tokens: int = 32768
    ) -> dict[str, float | dict[str, float]]:
        """Nominal bits per key and value element (docs/methods.md#average-bits) for ``tokens`` quantized tokens.

        Returns ``{"key_bits", "value_bits", "key_terms", "value_terms", "num_sink_tokens",
        "tokens", "head_dim"}``; the terms are :func:`kvbench.cache.layout.bit_terms` of
        :meth:`key_layout` / :meth:`value_layout`.
        """
        ns = self.config.num_sink_tokens
        kt, vt = self.key_bit_terms(head_dim), self.value_bit_terms(head_dim)
        return {
            "key_bits": average_bits(**kt, n_sink=ns, tokens=tokens),
            "value_bits": average_bits(**vt, n_sink=ns, tokens=tokens),
            "key_terms": kt,
            "value_terms": vt,
            "num_sink_tokens": ns,
            "tokens": tokens,
            "head_dim": head_dim,
        }
