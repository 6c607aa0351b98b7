"""``chanmix``: ChanMix, channel-aware mixed-precision key quantization (ICLR'26; code
github.com/cxiliao/ChanMix, not retrievable).  docs/methods.md#chanmix and docs/methods.md#average-bits; PN-Mix Table 10 row (2.32 bits).

**A reconstruction** (``capabilities.reconstruction = True``): what is known [SRC pages] is that
key channels are classed by sensitivity as 4-bit "retrieval", 3-bit "outlier", 2-bit "normal"
and 1-bit "subnormal" channels, quantized per channel (KIVI-style keys, per-token values) with
FP8 scales, at about 2.32 average bits (PN-Mix Table 10: b_H = 4, b_L in {3, 2, 1}, r = 0.1,
G = N = 128, N_s = 0).  Everything below marked [RECON] is this project's choice, a config field:

* class sizes [RECON]: ``retrieval_ratio``, ``outlier_ratio``, ``subnormal_ratio`` = 0.1 of the
  channels each, the rest "normal".  Whole channels: ``class_rounding='floor'`` (default) stores
  12 channels per 0.1-class at D = 128 (92 normal): b_eff = 2.1875, 2.3125 bits with FP8 s/z;
  ``'round'`` stores 13 (89 normal): 2.328 bits.  Both are within 0.01 of the reported 2.32
  (the fractional 12.8 channels of docs/methods.md#chanmix would give 2.325).
* scale and zero [RECON]: FP8 e4m3 (``torch.float8_e4m3fn``, 1 byte each, ``key_scale_dtype``),
  m_q = 16 bits per 128-token group.  The zero (group min) is stored to nearest, so a value
  below it is off by up to half an fp8 step of the min; a group min or scale beyond +-448
  raises ``ValueError`` (use ``key_scale_dtype='float16'``).  Values, if quantized
  (``value_bits < 16``), use ``scale_dtype`` (float16).
* classification [RECON] (``classification``): ``prefill`` (default) ranks the channels of each
  (layer, batch row, KV head) once by a key statistic of the prefill keys (``score``:
  ``k-range`` default, ``k-magnitude``, ``k-absmax``; highest -> retrieval, then outlier,
  normal, lowest -> subnormal), fixed for the whole generation; ``calibrated`` takes a fixed
  per-(layer, KV head) assignment from :meth:`ChanMix.calibrate`, run on keys of a calibration
  text disjoint from the evaluation text (the runner chooses the text and passes its name).
* 1-bit reconstruction [RECON]: plain min-max (``midpoint_correction=False``); True applies
  PN-Mix's Eq. 7 midpoint.

Flush rule: KIVI's (docs/methods.md#kivi).  The class assignment is stored once per (layer, b, h) as a uint8
channel permutation (:mod:`kvbench.cache.mixed_channel`), m_sal = 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvbench import fields as kf
from kvbench.cache.blocks import Codec
from kvbench.cache.layout import BlockLayout
from kvbench.cache.method import CacheConfig, Capabilities, Method
from kvbench.cache.mixed_channel import (
    MixedChannelCodec,
    channel_scores,
    mixed_layout,
    rank_classes,
)

SCORES = {"k-range": "range", "k-magnitude": "magnitude", "k-absmax": "absmax"}
CLASSIFICATIONS = ("prefill", "calibrated")
ROUNDINGS = ("floor", "round")
KEY_SCALE_DTYPES = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
BITS_FIELDS = ("retrieval_bits", "outlier_bits", "normal_bits", "subnormal_bits")


@dataclass(frozen=True)
class ChanMixConfig(CacheConfig):
    """ChanMix settings [RECON]; common fields: :class:`kvbench.cache.method.CacheConfig`.

    Attributes
    ----------
    retrieval_bits, outlier_bits, normal_bits, subnormal_bits : class widths (1..8, strictly
        decreasing).
    retrieval_ratio, outlier_ratio, subnormal_ratio : fractions of channels, each in [0, 1],
        sum <= 1; the rest are normal.
    class_rounding : ``floor`` | ``round`` (channels per class = floor or round of ratio * D).
    key_scale_dtype : ``float8_e4m3fn`` | ``float16`` | ``bfloat16`` | ``float32``.
    classification : ``prefill`` | ``calibrated``.
    score : ``k-range`` | ``k-magnitude`` | ``k-absmax``.
    midpoint_correction : 1-bit classes use the midpoint reconstruction.
    """

    num_sink_tokens: int = 0
    retrieval_bits: int = kf.spec(4, int, low=1, high=8)
    outlier_bits: int = kf.spec(3, int, low=1, high=8)
    normal_bits: int = kf.spec(2, int, low=1, high=8)
    subnormal_bits: int = kf.spec(1, int, low=1, high=8)
    retrieval_ratio: float = kf.spec(0.1, float, low=0, high=1)
    outlier_ratio: float = kf.spec(0.1, float, low=0, high=1)
    subnormal_ratio: float = kf.spec(0.1, float, low=0, high=1)
    class_rounding: str = kf.spec("floor", str, choices=ROUNDINGS)
    key_scale_dtype: str = kf.spec("float8_e4m3fn", str, choices=tuple(KEY_SCALE_DTYPES))
    classification: str = kf.spec("prefill", str, choices=CLASSIFICATIONS)
    score: str = kf.spec("k-range", str, choices=tuple(SCORES))
    midpoint_correction: bool = kf.spec(False, bool)

    def __post_init__(self) -> None:
        super().__post_init__()
        bits = [getattr(self, f) for f in BITS_FIELDS]
        for name, hi, lo in zip(BITS_FIELDS[1:], bits, bits[1:]):
            if lo >= hi:
                self.reject(
                    name, f"integers below {hi} ({' > '.join(BITS_FIELDS)}: strictly decreasing)"
                )
        ratios = ("retrieval_ratio", "outlier_ratio", "subnormal_ratio")
        if sum(getattr(self, n) for n in ratios) > 1 + 1e-9:
            others = 1 - self.retrieval_ratio - self.outlier_ratio
            self.reject(
                "subnormal_ratio", f"numbers in [0, {others:g}] ({' + '.join(ratios)} <= 1)"
            )

    def class_counts(self, head_dim: int) -> list[int]:
        """Channels per class, best first (retrieval, outlier, normal, subnormal)."""

        def n(r: float) -> int:
            x = r * head_dim
            return int(x + 1e-6) if self.class_rounding == "floor" else int(x + 0.5)

        hi, out, sub = n(self.retrieval_ratio), n(self.outlier_ratio), n(self.subnormal_ratio)
        if hi + out + sub > head_dim:
            raise ValueError(f"class sizes {hi}+{out}+{sub} exceed head_dim={head_dim}")
        return [hi, out, head_dim - hi - out - sub, sub]

    @property
    def class_bits(self) -> list[int]:
        return [getattr(self, f) for f in BITS_FIELDS]


def _classes(keys: torch.Tensor, config: ChanMixConfig) -> torch.Tensor:
    """Channel classes ``[..., D]`` of keys ``[..., T, D]`` by the configured statistic.
    Raises ``ValueError`` for ``T == 0``."""
    if keys.shape[-2] == 0:
        raise ValueError("ChanMix classifies channels from at least one prefill token")
    scores = channel_scores(keys, SCORES[config.score])
    return rank_classes(scores, config.class_counts(keys.shape[-1]))


class ChanMix(Method):
    """ChanMix [RECON]: 4/3/2/1-bit key channel classes by sensitivity, FP8 scale and zero."""

    Config = ChanMixConfig
    description = "ChanMix [RECON]: key channels at 4/3/2/1 bits by sensitivity, FP8 s/z"
    source = "ChanMix (ICLR'26) [SRC pages]; PN-Mix Table 10 row; docs/methods.md#chanmix [RECON]"
    capabilities = Capabilities(reconstruction=True)

    def __init__(self, config: ChanMixConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self._calibrated: dict[int, torch.Tensor] = {}
        #: what :meth:`calibrate` used (``None`` until called); runners record it
        self.calibration: dict[str, Any] | None = None

    @property
    def needs_calibration(self) -> bool:
        """True with ``classification='calibrated'``: call :meth:`calibrate` before
        :meth:`new_layer`."""
        return self.config.classification == "calibrated"

    def calibrate(
        self,
        keys_by_layer: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
        values_by_layer: Mapping[int, torch.Tensor] | None = None,
        source: str = "",
    ) -> ChanMix:
        """Fix each layer's classes from calibration keys.

        Parameters
        ----------
        keys_by_layer : post-RoPE keys per layer index (a mapping, or a sequence indexed by
            layer), each ``[B, H_kv, T, D]`` or ``[H_kv, T, D]``; batch rows are pooled.  Use a
            text disjoint from the evaluation text.
        values_by_layer : unused (values are quantized per token, dynamically).
        source : a name of the calibration text, recorded in :attr:`calibration`.

        Returns ``self``.  Raises ``ValueError`` unless ``classification='calibrated'`` or on
        a bad shape.
        """
        if not self.needs_calibration:
            raise ValueError("calibrate() needs classification='calibrated'")
        items = (
            keys_by_layer.items()
            if isinstance(keys_by_layer, Mapping)
            else enumerate(keys_by_layer)
        )
        tokens = {}
        for layer, k in items:
            if k.dim() == 3:
                k = k.unsqueeze(0)
            if k.dim() != 4 or k.shape[2] == 0:
                raise ValueError(
                    f"calibration keys of layer {layer} must be [B, H_kv, T>0, D]; "
                    f"got {tuple(k.shape)}"
                )
            b, h, t, d = k.shape
            pooled = k.transpose(0, 1).reshape(h, b * t, d)
            self._calibrated[int(layer)] = _classes(pooled, self.config).unsqueeze(0)
            tokens[int(layer)] = b * t
        self.calibration = {"source": source, "layers": sorted(tokens), "tokens": tokens}
        return self

    def key_codec(self, layer_idx: int, head_dim: int) -> Codec:
        c = self.config
        c.class_counts(head_dim)  # raises if the class sizes do not fit head_dim
        kw = dict(
            class_counts=c.class_counts(head_dim),
            group_size=c.group_size,
            scale_dtype=KEY_SCALE_DTYPES[c.key_scale_dtype],
            midpoint=c.midpoint_correction,
        )
        if c.classification == "prefill":
            return MixedChannelCodec(c.class_bits, lambda k, q: _classes(k, c), **kw)
        classes = self._calibrated.get(layer_idx)
        if classes is None:
            raise ValueError(
                f"classification='calibrated' but layer {layer_idx} was not calibrated; call "
                "ChanMix.calibrate(keys_by_layer) first (capability needs_calibration)"
            )
        if classes.shape[-1] != head_dim:
            raise ValueError(f"layer {layer_idx} was calibrated with head_dim {classes.shape[-1]}")
        return MixedChannelCodec(c.class_bits, None, classes=classes, **kw)

    def key_layout(self, head_dim: int) -> BlockLayout:
        """The :class:`~kvbench.cache.mixed_channel.MixedChannelBlock` layout of the configured classes
        (known before any selection or calibration)."""
        c = self.config
        scale = KEY_SCALE_DTYPES[c.key_scale_dtype]
        return mixed_layout(c.class_bits, c.class_counts(head_dim), c.group_size, scale, False)
