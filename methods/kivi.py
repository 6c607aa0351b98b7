"""``kivi``: KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
ICML 2024, arXiv 2402.02750; code jy-yuan/KIVI at 876b4d2).

Keys per-channel (one fp16 (scale, min) per channel per ``group_size`` tokens, §3.2), values
per-token (groups of ``value_group_size`` channels).  Flush rules exactly as docs/methods.md#kivi
(``models/llama_kivi.py``): at prefill the keys quantize ``T - T mod R`` tokens (all of them when
``T % R == 0``), the values all but the newest ``R``; while decoding the key residual cycles
0..R-1 (a full residual of R keys is quantized as R/G groups at the step's flush) and the
values keep a sliding window of exactly ``R`` tokens.  Under kvbench's default decode protocol,
``write-then-attend`` (docs/design.md#protocols), that flush runs before the step's queries
attend, so the step that fills the residual reads its new key quantized; KIVI's code flushes
after the step's attention (the step reads it in full precision), which is ``in-chunk-full``
at one token per call.

Defaults are the PN-Mix Table 10 key configuration (2 bits, G = R = 128, no sinks) with
``value_bits=16`` (the paper's main b_V = 16 setting); ``value_bits=2`` is KIVI-2.
Nominal key bits ``bits + 32 / G`` (2.25 / 2.50 / 3.00 for G = 128 / 64 / 32; Table 14).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench import fields as kf
from kvbench.cache.blocks import Codec, PerChannelCodec
from kvbench.cache.method import CacheConfig, Capabilities, Method
from kvbench.cache.quant import SUPPORTED_BITS


@dataclass(frozen=True)
class KIVIConfig(CacheConfig):
    """``bits``: key code width (1..8 or 16: :data:`kvbench.cache.quant.SUPPORTED_BITS`); other
    fields: :class:`kvbench.cache.method.CacheConfig`."""

    bits: int = kf.spec(2, int, choices=SUPPORTED_BITS)


class KIVI(Method):
    """KIVI: per-channel keys, per-token values, full-precision residual of R tokens."""

    Config = KIVIConfig
    description = "KIVI: per-channel keys (G tokens), per-token values, fp residual R"
    source = "Liu et al., ICML'24, arXiv 2402.02750, §3.2-3.3; docs/methods.md#kivi"
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int) -> Codec:
        c = self.config
        return PerChannelCodec(c.bits, c.torch_scale_dtype, group_size=c.group_size)
