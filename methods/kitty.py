"""``kitty``: Kitty, dynamic channel-wise precision boost (Xia et al., arXiv 2511.18643, MLSys'26;
code Summer-Summer/Kitty at dfd2c07).  docs/methods.md#kitty, docs/methods.md#average-bits, docs/methods.md#worked-example-7, docs/methods.md#worked-example-16.

Keys (post-RoPE) are quantized per channel in pages of ``group_size`` (G) tokens.  In every page
and every (batch row, KV head) the ``k = int(D * high_ratio + 1e-6)`` (= floor(D r)) channels with
the highest score get ``high_bits``, the rest ``low_bits``; the selection is recomputed for each
page (Kitty-sim ``build_promote_mask``).  Scores (``channel_selection``): ``magnitude`` = mean |K|
over the page's tokens (Kitty's default, 1), ``variance`` = variance over the page's tokens (2;
allowed by ``build_promote_mask``, rejected by Kitty's config validation), ``random`` (0, seeded
by ``seed`` and the layer index).  Ties go to the lower channel index.

Storage per page and (b, h) (Kitty's system layout, ``utils_kv_per_layer.py``): the codes of both
classes, one fp16 (scale, min) per channel, and one uint8 channel index per channel
(``ch_idx``, counted as metadata); see :mod:`kvbench.cache.mixed_channel`.

Flush rule (Kitty-sim ``kitty_simulate.py``): the first ``num_sink_tokens`` tokens stay full
precision; keys use :class:`~kvbench.cache.schedule.AllButNewestSchedule` (prefill: ``n - n mod G`` of
the ``n`` non-sink tokens when ``n > R``; decode: when the residual reaches R + 1 its oldest R are
quantized, so it cycles 1..R); values are KIVI-style per token with a sliding window of R
(``value_bits=16`` keeps them full precision).  Example 16: prefill 300, sinks 32 -> keys 256
quantized + 12 residual, values 140 quantized; key flushes at decode steps 117 and 245.

Defaults: the PN-Mix Table 10 Kitty row (high 4, low 2, r = 1/32, G = R = 128, N_s = 32, b_V = 16).
Nominal key bits (docs/methods.md#kitty and docs/methods.md#table-10-check): ``b_eff + 32/G + 8/G`` with the uint8 ch_idx term (8/G; 16/G for
D > 256, 0 when one class is empty) = 2.388 at D = 128, T_q = 32768 (reported 2.39) [RECON
accounting].  ``high_ratio = 0`` is KIVI with Kitty's sinks and flush rule.  Rounding is
half-to-even (Kitty's kernel rounds half up; docs/methods.md#common-conventions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import fields as kf
from kvbench.cache.blocks import Codec
from kvbench.cache.method import CacheConfig, Capabilities, Method
from kvbench.cache.mixed_channel import MixedChannelCodec, channel_scores, rank_classes
from kvbench.cache.schedule import AllButNewestSchedule

SELECTIONS = ("magnitude", "variance", "random")


@dataclass(frozen=True)
class KittyConfig(CacheConfig):
    """Kitty settings; common fields: :class:`kvbench.cache.method.CacheConfig`.

    Attributes
    ----------
    high_bits, low_bits : code widths of promoted / other channels (1..8, low < high).
    high_ratio : fraction r of channels promoted per page, in [0, 1]; ``floor(D r)`` channels.
    channel_selection : ``magnitude`` | ``variance`` | ``random``.
    seed : seed of the ``random`` selection (plus the layer index).
    """

    group_size: int = 128
    residual_length: int = 128
    num_sink_tokens: int = 32
    high_bits: int = kf.spec(4, int, low=1, high=8)
    low_bits: int = kf.spec(2, int, low=1, high=8)
    high_ratio: float = kf.spec(1 / 32, float, low=0, high=1)
    channel_selection: str = kf.spec("magnitude", str, choices=SELECTIONS)
    seed: int = kf.spec(0, int)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.low_bits >= self.high_bits:
            self.reject("low_bits", f"integers below high_bits={self.high_bits}")


def promoted_channels(head_dim: int, high_ratio: float) -> int:
    """Kitty's ``k_chan = int(D * promote_ratio + 1e-6)`` (floor; the 1e-6 guards 128 / 32)."""
    return int(head_dim * high_ratio + 1e-6)


class KittySelector:
    """Per-page selector: pages ``[B, H_kv, NP, G, D]`` -> classes ``[B, H_kv, NP, D]`` (0 =
    promoted to ``high_bits``, 1 = ``low_bits``)."""

    def __init__(self, k: int, mode: str, seed: int = 0) -> None:
        self.k, self.mode = k, mode
        self.generator = torch.Generator().manual_seed(seed)

    def scores(self, pages: torch.Tensor) -> torch.Tensor:
        """Channel scores ``[..., D]`` of pages ``[..., G, D]``."""
        if self.mode != "random":
            return channel_scores(pages, self.mode)
        shape = pages.shape[:-2] + pages.shape[-1:]
        return torch.rand(shape, generator=self.generator).to(pages.device)

    def __call__(self, pages: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
        d = pages.shape[-1]
        return rank_classes(self.scores(pages), [self.k, d - self.k])


class Kitty(Method):
    """Kitty: per-page dynamic promotion of the top channels to ``high_bits``."""

    Config = KittyConfig
    description = "Kitty: per-page top-r key channels at high bits, rest low bits, sinks"
    source = (
        "Xia et al., arXiv 2511.18643 (MLSys'26), Kitty-sim; PN-Mix Table 10; docs/methods.md#kitty"
    )
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> Codec:
        c = self.config
        k = promoted_channels(head_dim, c.high_ratio)
        sel = KittySelector(k, c.channel_selection, seed=c.seed + layer_idx)
        return MixedChannelCodec(
            [c.high_bits, c.low_bits],
            sel,
            group_size=c.group_size,
            scale_dtype=c.torch_scale_dtype,
            per_page=True,
            class_counts=(k, head_dim - k),
        )

    def key_schedule(self) -> object:
        c = self.config
        return AllButNewestSchedule(c.residual_length, c.group_size)
