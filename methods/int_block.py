"""``int8-block`` / ``int4-block``: llama.cpp-style symmetric blocks (``-ctk`` / ``-ctv``).

Source: ggml-org/llama.cpp ``ggml/src/ggml-quants.c`` (``quantize_row_q8_0_ref``,
``quantize_row_q4_0_ref``) and ``ggml-common.h`` (``block_q8_0``, ``block_q4_0``: 32 elements and
one fp16 ``d`` per block); the KV-cache types are chosen with ``-ctk`` / ``-ctv`` in
{f16, q8_0, q4_0, ...}.  docs/methods.md#transformers-peers; zero or near-zero range group: division by zero, NaN: ggml-org/llama.cpp PR#7313 (fixes #7311), docs/methods.md#zero-or-near-zero-range-groups; fp16 scale underflow to a subnormal, reciprocal overflow, 0*inf = NaN: pytorch/ao#1766 (PR#1770), docs/methods.md#half-precision-scale-underflow-and-reciprocal-overflow; fault list in docs/methods.md#faults-seen-in-peer-projects; negative zero and tiny negatives in FNUZ fp8 formats: triton-lang/triton PR#3997, docs/methods.md#negative-zero-and-tiny-negatives-in-fnuz-formats; fp16 overflow in stored block metadata and in the scale range: ggml-org/llama.cpp PR#21652, docs/methods.md#float16-overflow-in-block-metadata-and-range.

Each key and value token is cut into blocks of ``block_size`` (32) consecutive channels along
head_dim, each with one float16 scale ``d``; keys and values are configured independently with
``key_type`` / ``value_type`` in {``f16``, ``q8_0``, ``q4_0``}:

* ``q8_0``: ``d = absmax / 127``, ``q = round(x / d)`` in [-127, 127], 1 byte per element;
  8 + 16/32 = **8.5 bits** per element.
* ``q4_0`` with ``q4_rule="llamacpp"`` (default: the method carries llama.cpp's name, so it uses
  llama.cpp's rule; tested equal to the ``gguf`` package's ``Q4_0`` quantizer): llama.cpp's exact rule: ``m`` = the signed element of
  largest magnitude (first on ties), ``d = m / -8``, ``q = min(15, floor(x / d + 8.5))`` in 0..15,
  dequantized ``(q - 8) * d``; the code range is asymmetric ([-8d, 7d], so the element opposite
  in sign to ``m`` and as large saturates at ``7|d|``).  Codes use fp32 ``d``, ``d`` is stored
  as fp16 (round to nearest), exactly as ``quantize_row_q4_0_ref``; 4 + 16/32 = **4.5 bits**.
* ``q4_0`` with ``q4_rule="absmax7"``: ``d = absmax / 7``, ``q = round(x / d)`` in [-7, 7] (15 of
  the 16 codes; ~15% higher RMS error than llama.cpp's rule on Gaussian blocks); kept as an option.
* ``f16``: that side is not quantized (kept in the model's dtype; 16 bits nominal).

``q8_0`` and ``absmax7`` use the core symmetric quantizer (``quantize_groups(symmetric=True)``
via :class:`~kvbench.cache.blocks.PerTokenCodec`), which differs from ``quantize_row_q8_0_ref`` in two
documented details: ties round half-to-even (llama.cpp: ``roundf``, half away from zero) and
the codes are computed from the stored fp16 scale, rounded up (llama.cpp: from fp32 ``d``).
Codes are packed as the core's LSB-first bit stream (llama.cpp's q4_0 puts element ``j`` and
``j + 16`` in one byte); the byte count is identical.

Channel order (``channel_order``): ``hf`` (default) blocks the key channels in the order the
model gives them.  ``gguf`` blocks them as llama.cpp does for a GGUF-converted Llama-family
model: ``convert_hf_to_gguf.py`` (``LlamaModel.permute``: ``w.reshape(n_head, 2, D // 2,
...).swapaxes(1, 2).reshape(w.shape)``) permutes the rows of the Q and K projections per head,
so llama.cpp's key channel ``2i`` holds HF channel ``i`` and ``2i + 1`` HF channel ``D/2 + i``
(:func:`gguf_key_order`); V is not permuted.  The permutation is the layer cache's key
transform (:meth:`Int8Block.rotation`, :mod:`kvbench.cache.rotation`): keys, sinks and residual
are stored in GGUF order and the query is permuted alike, so every attention backend reads
the same logits; ``keys_values`` gives keys back in HF order.  With ``rotation: hadamard`` the
order acts first and the Hadamard on the GGUF-ordered channels, then the blocks are quantized,
as llama.cpp rotates the K it holds in its own (GGUF) channel order (ggml-org/llama.cpp PR
#21038); values are only rotated.

Windows: ``residual_length`` R (default 0: llama.cpp quantizes every token on write; otherwise a
sliding window of the R newest tokens stays full precision) and ``num_sink_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import fields as kf
from kvbench.cache.blocks import AffineBlock, PerTokenCodec, affine_layout
from kvbench.cache.chunks import token_chunks
from kvbench.cache.finite import all_finite
from kvbench.cache.layout import BlockLayout
from kvbench.cache.method import Capabilities, Method, MethodConfig
from kvbench.cache.native_quant import q4_0
from kvbench.cache.quant import pack_bits, packed_size
from kvbench.cache.rotation import ChannelRotation, for_config
from kvbench.cache.schedule import NeverSchedule, SlidingSchedule

BLOCK_TYPES = ("f16", "q8_0", "q4_0")
Q4_RULES = ("absmax7", "llamacpp")
CODE_BITS = {"f16": 16, "q8_0": 8, "q4_0": 4}
CHANNEL_ORDERS = ("hf", "gguf")


def gguf_key_order(head_dim: int) -> torch.Tensor:
    """int64 ``[head_dim]`` (even): llama.cpp's key channel ``j`` of a GGUF-converted
    Llama-family model is HF channel ``order[j]`` (``order = [0, D/2, 1, D/2 + 1, ...]``; module
    docstring), so ``keys[..., order]`` is the GGUF order."""
    return torch.arange(head_dim).reshape(2, head_dim // 2).T.reshape(head_dim)


@dataclass
class LlamaCppQ4Codec:
    """llama.cpp's exact ``q4_0`` rule on blocks of ``block_size`` channels of each token.

    ``encode(x [B, H_kv, n, D]) -> AffineBlock`` (4-bit symmetric codes with offset 8, signed
    fp16 scale ``d`` ``[B, H_kv, n, D / block_size]``).  A block with NaN/Inf gets a NaN scale.
    Raises ``ValueError`` if ``block_size`` does not divide D or ``d`` overflows float16.
    """

    block_size: int = 32
    token_group: int = 1

    def prepare(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        return None

    def layout(self, head_dim: int, flush_tokens: int = 1) -> BlockLayout:
        """4-bit codes, one float16 scale per token per ``block_size`` channels (q4_0)."""
        return affine_layout(4, head_dim, torch.float16, True, 1, self.block_size)

    def encode(self, x: torch.Tensor) -> AffineBlock:
        b, h, n, dim = x.shape
        bs = self.block_size
        if dim % bs:
            raise ValueError(f"block_size={bs} does not divide head_dim={dim}")
        # token by token (each code and scale depends on its own 32-channel block), in chunks
        # along T (kvbench.cache.chunks): the codes of one pass, without its GiB-sized temporaries
        packed = torch.empty(b, h, n, packed_size(dim, 4), dtype=torch.uint8, device=x.device)
        d16 = torch.empty(b, h, n, dim // bs, dtype=torch.float16, device=x.device)
        for t0, t1 in token_chunks(b, h, n, dim):
            packed[:, :, t0:t1], d16[:, :, t0:t1] = self._encode_tokens(x[:, :, t0:t1])
        return AffineBlock(packed, d16, None, [1] * n, 4, dim, symmetric=True)

    def _encode_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed 4-bit codes ``[B, H_kv, n, D / 2]`` and signed fp16 scales ``[B, H_kv, n,
        D / block_size]`` of ``x [B, H_kv, n, D]`` by llama.cpp's rule (see the class)."""
        fast = q4_0(x, self.block_size)  # the same bytes in one C pass (or None: torch below)
        if fast is not None:
            return fast
        b, h, n, dim = x.shape
        bs = self.block_size
        xg = x.float().reshape(b, h, n, dim // bs, bs)
        # finite input (the common case): no masks; else non-finite elements count as 0 for
        # the block's max and its scale becomes NaN (the same values either way)
        ok = None if all_finite(x) else torch.isfinite(xg)
        xs = xg if ok is None else torch.where(ok, xg, torch.zeros((), device=x.device))
        m = xs.gather(-1, xs.abs().argmax(dim=-1, keepdim=True))  # signed max-magnitude element
        d = m / -8.0
        inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
        # (int8_t)(x*id + 8.5f), x*id + 8.5 >= 0: one product, then in place (same roundings)
        q = torch.mul(xs, inv).add_(8.5).floor_().clamp_(0, 15)
        d16 = d.to(torch.float16)
        if bool((~torch.isfinite(d16)).any()):
            raise ValueError("a q4_0 block scale overflows float16 (|max| > 524032)")
        if ok is not None:
            d16 = torch.where(ok.all(-1, keepdim=True), d16, torch.full_like(d16, float("nan")))
        codes = q.to(torch.uint8).reshape(b, h, n, dim)  # 0..15 by the clamp: exact, in range
        return pack_bits(codes, 4, check=False), d16.squeeze(-1)


@dataclass(frozen=True)
class Int8BlockConfig(MethodConfig):
    """Configuration of :class:`Int8Block` / :class:`Int4Block`.

    Attributes
    ----------
    key_type, value_type : ``f16`` | ``q8_0`` | ``q4_0`` (llama.cpp ``-ctk`` / ``-ctv``).
    q4_rule : ``llamacpp`` (d = max/-8, llama.cpp's q4_0; default) or ``absmax7`` (d = absmax/7,
        codes -7..7).
    block_size : channels per block (32 in llama.cpp); must divide head_dim.
    residual_length : R newest tokens kept in full precision (default 0).
    num_sink_tokens : N_s first tokens kept in full precision (default 0).
    channel_order : ``hf`` (default) or ``gguf``: the key channel order the blocks group
        (module docstring).
    """

    key_type: str = kf.spec("q8_0", str, choices=BLOCK_TYPES)
    value_type: str = kf.spec("q8_0", str, choices=BLOCK_TYPES)
    q4_rule: str = kf.spec("llamacpp", str, choices=Q4_RULES)
    block_size: int = kf.spec(32, int, low=1)
    residual_length: int = kf.spec(0, int, low=0)
    num_sink_tokens: int = kf.spec(0, int, low=0)
    channel_order: str = kf.spec("hf", str, choices=CHANNEL_ORDERS)

    omitted_defaults = (*MethodConfig.omitted_defaults, "channel_order")


@dataclass(frozen=True)
class Int4BlockConfig(Int8BlockConfig):
    """As :class:`Int8BlockConfig`, with ``q4_0`` keys and values by default."""

    key_type: str = "q4_0"
    value_type: str = "q4_0"


class Int8Block(Method):
    """llama.cpp-style symmetric blocks of 32 channels, one fp16 scale each (q8_0 default)."""

    Config = Int8BlockConfig
    description = "llama.cpp q8_0/q4_0 K and V: symmetric 32-channel blocks, fp16 scale"
    source = "ggml-org/llama.cpp ggml-quants.c quantize_row_q8_0_ref / q4_0_ref; -ctk/-ctv"
    capabilities = Capabilities()

    def _codec(self, kind: str, head_dim: int):
        c = self.config
        if kind == "f16":
            return None
        if head_dim % c.block_size:
            raise ValueError(
                f"block_size={c.block_size} does not divide head_dim={head_dim}; "
                f"use a divisor of {head_dim}"
            )
        if kind == "q4_0" and c.q4_rule == "llamacpp":
            return LlamaCppQ4Codec(c.block_size)
        return PerTokenCodec(
            CODE_BITS[kind], torch.float16, symmetric=True, channel_group=c.block_size
        )

    def rotation(self, head_dim: int) -> ChannelRotation | None:
        """The config's rotation with the keys in GGUF order first when ``channel_order`` is
        ``gguf`` (module docstring).  ``ValueError`` naming ``channel_order`` (gguf) for an odd
        head_dim, or ``rotation_block`` when it does not divide head_dim."""
        c = self.config
        if c.channel_order == "hf":
            return for_config(c, head_dim)
        if head_dim % 2:
            c.reject(
                "channel_order", f"'hf' for head_dim={head_dim} (gguf pairs channel i with D/2+i)"
            )
        return for_config(c, head_dim, gguf_key_order(head_dim))

    def key_codec(self, layer_idx: int, head_dim: int):
        return self._codec(self.config.key_type, head_dim)

    def value_codec(self, layer_idx: int, head_dim: int):
        return self._codec(self.config.value_type, head_dim)

    def _schedule(self, kind: str) -> object:
        return NeverSchedule() if kind == "f16" else SlidingSchedule(self.config.residual_length)

    def key_schedule(self) -> object:
        return self._schedule(self.config.key_type)

    def value_schedule(self) -> object:
        return self._schedule(self.config.value_type)


class Int4Block(Int8Block):
    """As :class:`Int8Block` with ``q4_0`` keys and values by default (4.5 bits)."""

    Config = Int4BlockConfig
    description = "llama.cpp q4_0 K and V: symmetric 32-channel blocks, fp16 scale"
