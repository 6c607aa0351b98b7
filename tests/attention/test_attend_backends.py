"""Code-domain decode attention for every built-in layout, checked against an independent
float64 reference, and the attention-backend registry's choices and bad-input behaviour.

Right values: attention computed here in float64 over the cache's own ``keys_values(float64)``
(the dequantize path of each block, a different code path from the code-domain kernels), GQA by
``repeat_interleave``, causal mask aligned to each row's end; tolerance: ``max |out - ref| /
max |ref| <= 1e-5`` per query row, in float32.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import kvbench
from kvbench.attention import dispatch as registry
from kvbench.cache.blocks import AffineBlock, PerChannelCodec
from kvbench.cache.layer import LayerCache, Side
from kvbench.cache.mixed_channel import MixedChannelBlock
from kvbench.cache.schedule import BlockSchedule
from kvbench.kernels.cpu import codedomain as cpu
from kvbench.kernels.cpu import native
from kvbench.kernels.triton_backend import WholeCacheBackend
from kvbench.methods.qjl import QJLBlock
from kvbench.registry import Registry

HQ, HKV, B = 4, 2, 2
SMALL = dict(group_size=16, residual_length=16)
#: (method, config, prefill, decode steps): every built-in method whose blocks have a CPU
#: code-domain kernel, with sinks where the method has them
CASES = [
    ("kivi", dict(SMALL, bits=2, value_bits=2, num_sink_tokens=2), 45, 3),
    ("kivi", dict(SMALL, bits=3, value_bits=4), 40, 2),
    ("per-channel", dict(SMALL, bits=2), 40, 2),
    ("per-token", dict(SMALL, bits=2, value_bits=2, num_sink_tokens=2), 40, 3),
    ("uniform", dict(SMALL, bits=4, value_bits=4), 40, 2),
    ("per-head", dict(SMALL, bits=4, value_bits=2), 40, 2),
    ("int8-block", dict(num_sink_tokens=2), 30, 3),
    ("int4-block", dict(num_sink_tokens=2, residual_length=8), 30, 3),
    ("kitty", dict(SMALL, value_bits=2, num_sink_tokens=2), 45, 3),
    ("pn-mix", dict(SMALL, value_bits=2, num_sink_tokens=2), 45, 3),
    ("chanmix", dict(SMALL, value_bits=2), 45, 2),
    ("pm-kvq", dict(residual_length=16, num_sink_tokens=1), 40, 2),  # 16-bit codes
    ("pm-kvq", dict(residual_length=16, num_sink_tokens=1, init_bits=4), 40, 2),
    ("pm-kvq", dict(residual_length=16, init_bits=8, budget_tokens=24, on_overflow="allow"), 40, 2),
    ("turboquant-mse", dict(bits=2, residual_length=8, num_sink_tokens=2), 30, 3),
    ("turboquant-mse", dict(bits=3, apply_to="both"), 30, 2),
    ("polarquant", dict(SMALL, value_bits=2, num_sink_tokens=2), 45, 3),
    (
        "polarquant",
        dict(SMALL, radius_bits=3, angle_bits=4, pairing="interleaved", value_bits=4),
        40,
        2,
    ),
    ("fp8", dict(), 30, 2),
    ("semkv", dict(SMALL, num_sink_tokens=2), 45, 3),
    ("semkv", dict(SMALL, score="key-norm", mixed_values=False, value_bits=2), 45, 2),
    ("semkv", dict(SMALL, high_bits=4, low_bits=1, target_bits=2.0), 40, 2),
    ("fp8", dict(scale="amax", scale_granularity="per-token", num_sink_tokens=2), 30, 2),
    ("fp8", dict(scale="amax", scale_granularity="per-head", residual_length=8), 30, 9),
    ("fp8", dict(scale="amax", scale_granularity="per-tensor", format="e5m2"), 30, 2),
]
DIMS = (64, 96, 128, 256)
#: methods whose key and value blocks both have native kernels (kvbench.kernels.cpu.native)
NATIVE_BOTH = {"kivi", "per-token", "int8-block", "int4-block", "kitty", "pn-mix", "chanmix",
               "fp8", "semkv", "turboquant-mse", "pm-kvq", "polarquant"}  # fmt: skip


def auto_path(kinds=("native",)) -> str:
    """The path ``auto`` mode records for blocks whose kernels are ``kinds`` when the native
    kernels are built (else eager)."""
    return "cpu-" + "+".join(kinds) if native.available() else cpu.EAGER_PATH


def ref64(lc: LayerCache, query: torch.Tensor, lengths=None, scaling=None) -> torch.Tensor:
    """Float64 attention over ``lc.keys_values(float64)``; row ``b`` sees its first
    ``lengths[b]`` tokens, its queries being the last of them."""
    k, v = lc.keys_values(torch.float64)
    b, hq, nq, d = query.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = 1 / math.sqrt(d) if scaling is None else scaling
    out = torch.zeros(b, hq, nq, d, dtype=torch.float64)
    for i in range(b):
        t = k.shape[2] if lengths is None else int(lengths[i])
        lg = query[i].double() @ k[i, :, :t].transpose(-1, -2) * s  # [H_q, n_q, t]
        pos = torch.arange(t - nq, t).unsqueeze(1)
        lg = lg.masked_fill(torch.arange(t).unsqueeze(0) > pos, float("-inf"))
        out[i] = torch.softmax(lg, -1) @ v[i, :, :t]
    return out


def close_rows(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """Per query row: ``max |out - ref| <= rel * max |ref|``."""
    err = (out.double() - ref).abs().amax(-1)
    scale = ref.abs().amax(-1)
    assert bool((err <= rel * scale).all()), f"worst row error {(err / scale).max().item():.2e}"


def build(name, cfg, d, prefill, steps, seed=0):
    m = kvbench.get_method(name, **cfg)
    lc = m.new_layer(0, HKV, d)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, HKV, prefill + steps, d, generator=g) * 1.5 + 0.3
    k[..., 3] *= 6  # an outlier channel (mixed-precision selectors pick it)
    v = torch.randn(B, HKV, prefill + steps, d, generator=g)
    q = torch.randn(B, HQ, prefill, d, generator=g)
    lc.prefill(k[:, :, :prefill], v[:, :, :prefill], q if m.needs_queries else None)
    for t in range(prefill, prefill + steps):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lc.end_step()
    return lc, g


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name,cfg,prefill,steps", CASES, ids=lambda x: str(x)[:40])
def test_code_domain_matches_reference(name, cfg, prefill, steps, d):
    lc, g = build(name, cfg, d, prefill, steps)
    assert lc.k.block is not None and lc.v.block is not None or name == "per-channel"
    q = torch.randn(B, HQ, 1, d, generator=g)
    with cpu.cpu_attention_mode("eager"):
        out = lc.attend(q)
    assert lc.attend_path == cpu.EAGER_PATH, lc.attend_path_reason
    ref = ref64(lc, q)
    close_rows(out, ref)
    # several queries (a chunk): causal within them
    q3 = torch.randn(B, HQ, 3, d, generator=g)
    close_rows(cpu.code_domain_attend(lc, q3), ref64(lc, q3))
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    with cpu.cpu_attention_mode("native"):  # the C kernels (kernels/cpu/csrc/codes.c)
        close_rows(lc.attend(q), ref)
        kinds = cpu.path_kinds(lc.attend_path)
        close_rows(lc.attend(q3), ref64(lc, q3))
    assert kinds <= {"native", "native-fused", "eager"}
    if not isinstance(cpu.fused_parts(lc, q), str):  # one native call for the whole step
        assert kinds == {"native-fused"}, lc.attend_path
    elif name in NATIVE_BOTH:
        assert kinds == {"native"}, lc.attend_path


@pytest.mark.parametrize("d", [64, 128, 256])
def test_kitty_classes_take_the_per_class_kernels(d, monkeypatch):
    """Kitty's low class at head_dim 64 (62 channels at 2 bits) does not end on a whole code
    word; it is read as whole words with a zero query on the extra channels (the bit-stream
    kernel is never called) and agrees with the float64 reference.  (At head_dim 96 the 3
    high channels end inside a byte: that layout is read as one bit stream.)"""
    from kvbench.kernels.cpu import mixed_channel as mixed

    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    lc, g = build("kitty", dict(SMALL, value_bits=2, num_sink_tokens=2), d, 45, 3)
    blk = lc.k.block
    partial = any(n % native.code_layout(b)[1] for b, n in zip(blk.class_bits, blk.class_counts))
    assert partial == (d == 64)

    def no_stream(*a, **k):
        raise AssertionError("the bit-stream kernel ran")

    monkeypatch.setattr(native, "keys_stream_rows", no_stream)
    assert mixed._native_classes(blk)
    q = torch.randn(B, HQ, 1, d, generator=g)
    with cpu.cpu_attention_mode("native"):
        close_rows(lc.attend(q), ref64(lc, q))
    assert cpu.path_kinds(lc.attend_path) == {"native"}, lc.attend_path


def test_word_counts_of_class_layouts():
    from kvbench.kernels.cpu.mixed_channel import _word_counts

    # 1 + 16 bytes: room for 64 codes; the two 4-bit channels read as 8 (4 bytes, the next
    # class's bytes with a zero query) for the vectorised kernel
    assert _word_counts((4, 2), (2, 62), 17) == [8, 64]
    assert _word_counts((4,), (2,), 1) == [2]  # no room for 8: whole words
    assert _word_counts((4,), (2,), 4) == [8]  # trailing bytes in the row
    assert _word_counts((3, 1), (32, 32), 16) == [32, 32]  # whole words already
    assert _word_counts((2,), (62,), 15) is None  # 16 bytes of whole words do not fit 15
    assert _word_counts((3,), (10,), 6) == [16]  # 3-bit words: 8 codes in 3 bytes
    assert _word_counts((3,), (10,), 5) is None


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("kivi", dict(SMALL, value_bits=2, num_sink_tokens=2)),
        ("pn-mix", dict(SMALL, num_sink_tokens=2)),
        ("semkv", dict(SMALL, num_sink_tokens=2)),
    ],
)
def test_partly_filled_last_page(name, cfg):
    lc, g = build(name, cfg, 64, 50, 0)
    lc.crop(2 + 16 + 7)  # sinks + one whole page + 7 tokens of the next
    assert lc.k.residual is None and lc.k.block.ntokens == 23
    assert name == "semkv" or lc.k.block.group_len[-1] == 7
    q = torch.randn(B, HQ, 1, 64, generator=g)
    ref = ref64(lc, q)
    close_rows(cpu.code_domain_attend(lc, q), ref)
    with cpu.cpu_attention_mode("native"):  # native where built, else eager again
        close_rows(lc.attend(q), ref)


@pytest.mark.parametrize(
    "name,cfg", [c[:2] for c in CASES if c[0] in ("kivi", "kitty", "fp8", "semkv")][::2]
)
def test_per_row_lengths(name, cfg):
    lc, g = build(name, cfg, 64, 45, 2)
    t = lc.seq_length
    lengths = torch.tensor([t, t - 5])
    q = torch.randn(B, HQ, 2, 64, generator=g)
    ref = ref64(lc, q, lengths)
    close_rows(lc.attend(q, lengths=lengths), ref)
    fused = native.available() and not isinstance(cpu.fused_parts(lc, q), str)  # KIVI's
    assert lc.attend_path == (cpu.FUSED_PATH if fused else auto_path())
    with cpu.cpu_attention_mode("reference"):
        close_rows(lc.attend(q, lengths=lengths), ref)
    with pytest.raises(ValueError, match="lengths"):
        lc.attend(q, lengths=torch.tensor([t + 1, t]))


def test_fp8_table_equals_the_cast():
    from kvbench.kernels.cpu.fp8 import fp8_table
    from kvbench.methods.fp8 import FORMATS

    for fmt, dt in FORMATS.items():
        bytes_ = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        cast = bytes_.view(dt).to(torch.float32)
        lut = fp8_table(fmt)
        assert torch.equal(lut.isnan(), cast.isnan())
        assert torch.equal(lut[~cast.isnan()], cast[~cast.isnan()])


# ------------------------------------------------------------------------------ registry
class Opaque:
    """A block type no backend knows (delegates storage to an AffineBlock)."""

    def __init__(self, inner):
        self.inner = inner

    ntokens = property(lambda self: self.inner.ntokens)

    def dequantize(self, dtype):
        return self.inner.dequantize(dtype)

    def tensors(self):
        return self.inner.tensors()

    def cat(self, other):
        return Opaque(self.inner.cat(other.inner))


class OpaqueCodec(PerChannelCodec):
    def encode(self, x):
        return Opaque(super().encode(x))


def opaque_layer():
    lc = LayerCache(OpaqueCodec(2, group_size=4), None, BlockSchedule(4), num_kv_heads=2)
    g = torch.Generator().manual_seed(1)
    lc.prefill(torch.randn(1, 2, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g))
    return lc


def test_a_layout_without_backend_takes_the_reference_path_and_says_why():
    lc = opaque_layer()
    q = torch.randn(1, 4, 1, 16)
    close_rows(lc.attend(q), ref64(lc, q))
    assert lc.attend_path == registry.REFERENCE_PATH
    assert lc.attend_path_reason == "key block Opaque has no code-domain kernel"


def test_each_method_block_type_resolves_to_its_named_kernel(monkeypatch):
    """The kernels of the block types defined in a method's module are named, not imported
    (loading the backend loads no method): every name resolves, to the block type and kernel
    class it names (a misspelt one would send that method to the reference path)."""
    monkeypatch.setattr(cpu, "_KERNELS", dict(cpu._KERNELS))
    for (block_name, dev), kernel_name in cpu._METHOD_KERNELS.items():
        block_type = cpu._load(block_name)
        assert dev in cpu.kernel_devices(block_type)
        kernel = cpu.block_kernel(object.__new__(block_type), dev)
        assert type(kernel) is cpu._load(kernel_name), (block_name, dev)
        assert cpu.block_kernel(object.__new__(block_type), dev) is kernel  # kept


def test_a_plugin_block_type_with_its_registered_kernel(monkeypatch):
    """``register_block_kernel`` (the public way for a plugin's block type) puts the block on
    the code-domain path; the kernel here reads the wrapped affine block."""
    monkeypatch.setattr(cpu, "_KERNELS", dict(cpu._KERNELS))
    inner = cpu.block_kernel(opaque_layer().k.block.inner)

    class OpaqueKernel:
        def key_reason(self, block, d):
            return inner.key_reason(block.inner, d)

        value_reason = key_reason

        def key_logits(self, block, q):
            return inner.key_logits(block.inner, q)

    cpu.register_block_kernel(Opaque, OpaqueKernel(), ("cpu", "meta"))
    assert cpu.kernel_devices(Opaque) == ["cpu", "meta"]
    assert registry.backends_for(Opaque) == {"code-domain": ["cpu", "meta"]}
    lc = opaque_layer()
    q = torch.randn(1, 4, 1, 16)
    with cpu.cpu_attention_mode("eager"):
        out = lc.attend(q)
    assert lc.attend_path == cpu.EAGER_PATH and lc.attend_path_reason == ""
    close_rows(out, ref64(lc, q))


def test_a_backend_that_raises_is_reported_and_the_reference_runs(monkeypatch):
    class Broken:
        def key_reason(self, block, d):
            return None

        value_reason = key_reason

        def key_logits(self, block, q):
            raise RuntimeError("kernel bug")

    monkeypatch.setitem(cpu._KERNELS, (Opaque, "cpu"), Broken())
    lc = opaque_layer()
    q = torch.randn(1, 4, 1, 16)
    with pytest.warns(RuntimeWarning, match=r"keys=Opaque.*cpu.*kernel bug"):
        out = lc.attend(q)
    close_rows(out, ref64(lc, q))
    assert lc.attend_path == "reference" and "kernel bug" in lc.attend_path_reason


def test_backends_are_the_entry_points_of_kvbench_backends():
    """The built-in backends register exactly as a plugin would (pyproject.toml), every name
    in the order of preference is one of them, and an object that is not a backend is refused
    naming what it lacks."""
    entries = registry.BACKENDS.entries()
    assert {n: (e.value, e.dist) for n, e in entries.items()} == {
        "code-domain": ("kvbench.kernels.cpu.codedomain:BACKEND", "kvbench"),
        "triton": ("kvbench.kernels.triton_backend:BACKEND", "kvbench"),
    }
    for names in (*registry.PREFERENCE.values(), registry.OTHER_DEVICES, [registry.ESTIMATOR]):
        assert set(names) <= set(entries)
    with pytest.raises(TypeError, match=r"needs reason\(\), run\(\) and devices_for\(\)"):
        Registry("attention backend", check=registry.BACKENDS._check).register("x", object())


def with_backend(monkeypatch, backend: WholeCacheBackend) -> None:
    """Register ``backend`` for this test only, first in its device's order of preference."""
    fresh = Registry("attention backend")
    for name in registry.BACKENDS.names():
        fresh.register(name, registry.BACKENDS.get(name))
    fresh.register(backend.name, backend)
    monkeypatch.setattr(registry, "BACKENDS", fresh)
    monkeypatch.setitem(registry.PREFERENCE, backend.device, (backend.name, "code-domain"))


def test_whole_cache_backends_are_chosen_per_device_once(monkeypatch):
    calls = []

    def run(lc, q, s, ln):
        calls.append((lc, s))
        return torch.zeros(q.shape)

    # the kivi layout: the code-domain kernels on the CPU, the Triton backend on CUDA
    assert registry.backends_for(AffineBlock) == {"code-domain": ["cpu"], "triton": ["cuda"]}
    assert registry.backends_for(MixedChannelBlock) == {"code-domain": ["cpu"], "triton": ["cuda"]}
    assert registry.backends_for(QJLBlock) == {"code-domain": ["cpu", "cuda"]}
    be = WholeCacheBackend("fake", "meta", (AffineBlock,), lambda lc, q, ln: None, run)
    with_backend(monkeypatch, be)
    assert registry.backends_for(AffineBlock)["fake"] == ["meta"]
    lc, _ = build("kivi", CASES[0][1], 64, 45, 1)
    q = torch.empty(B, HQ, 1, 64, device="meta")
    assert lc.attend(q, 0.5).shape == q.shape and calls == [(lc, 0.5)]
    assert lc.attend_path == "fake" and lc.attend_path_reason == ""


def kvquant_layer(d, pre_rope, layout="rotate_half", seed=2, bits=4):
    """KVQuant with sparse outliers, sinks, B > 1, prefill + decode steps (residual 8)."""
    cfg = dict(pre_rope=pre_rope, rope_layout=layout, sparsity_threshold=0.9, bits=bits)
    m = kvbench.get_method("kvquant", **cfg, num_sink_tokens=2, residual_length=8)
    g = torch.Generator().manual_seed(seed)
    m = m.calibrate({0: torch.randn(2, HKV, 64, d, generator=g)})
    lc = m.new_layer(0, HKV, d)
    k = torch.randn(B, HKV, 43, d, generator=g) * 1.3
    v = torch.randn(B, HKV, 43, d, generator=g)
    lc.prefill(k[:, :, :40], v[:, :, :40])
    for t in range(40, 43):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lc.end_step()
    assert lc.k.block.out_idx.numel() > 0  # some outliers are stored sparsely
    return lc, g


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize(
    "pre_rope,layout,bits",
    [(False, "rotate_half", 4), (True, "rotate_half", 4), (True, "interleaved", 4),
     (True, "rotate_half", 3), (False, "interleaved", 3)],
)  # fmt: skip
def test_kvquant_lut_codes_with_sparse_outliers(d, pre_rope, layout, bits, monkeypatch):
    """Pre-RoPE codes: the reference re-rotates the dequantized keys (``keys_values``); the
    code-domain kernel rotates the query per token instead (KVQuant, arXiv 2401.18079 §3.1),
    eager and native (3-bit codes straddle bytes), the native kernel vectorised and scalar."""
    lc, g = kvquant_layer(d, pre_rope, layout, bits=bits)
    assert (lc.k.block.rotary is not None) == pre_rope
    q = torch.randn(B, HQ, 1, d, generator=g)
    with cpu.cpu_attention_mode("eager"):
        out = lc.attend(q)
    assert lc.attend_path == cpu.EAGER_PATH, lc.attend_path_reason
    close_rows(out, ref64(lc, q))
    with cpu.cpu_attention_mode("native"):
        out = lc.attend(q)
    assert lc.attend_path == auto_path(), lc.attend_path_reason
    close_rows(out, ref64(lc, q))
    with cpu.cpu_attention_mode("native"), monkeypatch.context() as mp:
        mp.setenv("KVBENCH_NATIVE_TILES", "0")  # the scalar loop
        close_rows(lc.attend(q), ref64(lc, q))
        assert lc.attend_path == auto_path(), lc.attend_path_reason
    q3 = torch.randn(B, HQ, 3, d, generator=g)
    lengths = torch.tensor([lc.seq_length, lc.seq_length - 4])
    close_rows(lc.attend(q3, lengths=lengths), ref64(lc, q3, lengths))
    lc.crop(2 + 13)  # the rotation keeps its positions after a crop and a new flush
    for _ in range(9):
        lc.append(torch.randn(B, HKV, 1, d, generator=g), torch.randn(B, HKV, 1, d, generator=g))
        lc.end_step()
    close_rows(lc.attend(q), ref64(lc, q))
    assert lc.attend_path == auto_path()
    lc.index_batch(torch.tensor([1, 0]))  # rows swapped (beam reorder): outliers stay ascending
    close_rows(lc.attend(q), ref64(lc, q))
    assert lc.attend_path == auto_path(), lc.attend_path_reason


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kernel", ["1", "0"])  # vectorised, scalar
@pytest.mark.parametrize("bits", [(2, 2), (3, 4), (2, 1), (5, 3)])
def test_polar_pages_native_after_a_crop(d, kernel, bits, monkeypatch):
    """A crop leaves a partly filled last page of polar codes; the native kernel reads its
    tokens with that page's terms, batched rows of different lengths included; radius and
    angle widths whose tables are selected (1, 2 bits) or gathered (3, 4), or read by the
    scalar loop (5 bits), vectorised and scalar."""
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", kernel)
    cfg = dict(SMALL, value_bits=2, num_sink_tokens=2, radius_bits=bits[0], angle_bits=bits[1])
    lc, g = build("polarquant", cfg, d, 60, 0)
    lc.crop(2 + 16 + 9)  # sinks, one whole page, 9 tokens of the next
    assert lc.k.block.radius.group_len == [16, 9] or lc.k.block.ntokens < 25
    q = torch.randn(B, HQ, 1, d, generator=g)
    with cpu.cpu_attention_mode("native"):
        close_rows(lc.attend(q), ref64(lc, q))
        assert lc.attend_path == auto_path(), lc.attend_path_reason
        q3 = torch.randn(B, HQ, 3, d, generator=g)
        lengths = torch.tensor([lc.seq_length, lc.seq_length - 5])
        close_rows(lc.attend(q3, lengths=lengths), ref64(lc, q3, lengths))


def test_pre_rope_blocks_read_post_rope_keys():
    """The block's layout says what is read: its dequantized keys are the RoPE rotation (by
    the float64 formula here) of its pre-RoPE codes at positions ``start + j``."""
    lc, _ = kvquant_layer(64, True)
    blk = lc.k.block
    pre = replace(blk, rotary=None).dequantize(torch.float64)  # [B, H, n, D]
    pos = torch.arange(blk.rotary.start, blk.rotary.start + blk.ntokens, dtype=torch.float64)
    inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    cos, sin = (pos[:, None] * inv).cos(), (pos[:, None] * inv).sin()
    a, b = pre[..., :32], pre[..., 32:]
    want = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    assert blk.rotary.start == 2  # after the two sinks
    torch.testing.assert_close(blk.dequantize(torch.float64), want, rtol=0, atol=1e-5)


class NegatedSide(Side):
    """A side whose reads are not its stored parts (keys negated on read)."""

    reads_transformed = "keys negated on read"

    def read(self, dtype):
        return -super().read(dtype)


def test_reads_transformed_declines_the_fast_backends():
    lc, g = build("kivi", CASES[0][1], 64, 45, 1)
    k = lc.k
    lc.k = NegatedSide(k.codec, k.schedule, k.sinks, k.block, k.residual)
    q = torch.randn(B, HQ, 1, 64, generator=g)
    close_rows(lc.attend(q), ref64(lc, q))
    assert lc.attend_path == "reference" and "negated" in lc.attend_path_reason


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("m", [64, 256, 60])
def test_qjl_estimator_in_the_code_domain(d, m):
    """QJL keys have no dequantized form: the reference is the estimator of QJL (Zandieh et
    al., arXiv 2406.03482, Eq. 2) written out here in float64 from the stored signs and norms:
    ``<q, k> ~ sqrt(pi/2) / m * |k| * <S q, sign(S k)>``.  Sketch widths that are whole bytes
    take the native per-token kernel; ``m = 60`` the eager estimator."""
    cfg = dict(SMALL, sketch_dim=m, num_sink_tokens=2, value_bits=2)
    lc, g = build("qjl", cfg, d, 45, 2)
    blk = lc.k.block
    q = torch.randn(B, HQ, 1, d, generator=g)
    rep = HQ // HKV
    s_mat = blk.sketch.double()
    signs = ((blk.signs.unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)[..., :m] * 2.0 - 1
    est = math.sqrt(math.pi / 2) / m * blk.norms.double().unsqueeze(-1) * signs.double()
    kq = torch.cat(
        [lc.k.sinks.double(), est @ s_mat, lc.k.residual.double()], 2
    )  # <q, k> = q . (S^T est)
    vv = lc.v.read(torch.float64)
    lg = q.double() @ kq.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(d)
    ref = torch.softmax(lg, -1) @ vv.repeat_interleave(rep, 1)
    close_rows(lc.attend(q), ref)
    assert lc.attend_path == auto_path(("native",) if m % 8 == 0 else ("native", "eager"))
    with cpu.cpu_attention_mode("eager"):  # the estimator in torch
        close_rows(lc.attend(q), ref)
    assert lc.attend_path == cpu.EAGER_PATH
    with cpu.cpu_attention_mode("reference"):  # the estimator is also the reference path
        close_rows(lc.attend(q), ref)
    assert lc.attend_path == "reference"


def test_semkv_scores_from_every_backend_and_records_the_path(monkeypatch):
    """SemKV's attention score reads each step's softmax through ``observe_attention``: the
    code-domain and the reference path give it the same statistics, both record their path,
    and a whole-cache backend (which cannot hand out probabilities) declines with the reason."""
    from kvbench.methods.semkv import MixedTokenBlock

    cfg = dict(SMALL, num_sink_tokens=2)
    fake = WholeCacheBackend("fake", "cpu", (MixedTokenBlock,), lambda lc, q, ln: None, None)
    with_backend(monkeypatch, fake)
    stats = {}
    for mode, path in (("eager", cpu.EAGER_PATH), ("reference", "reference")):
        lc, g = build("semkv", cfg, 64, 45, 0, seed=3)
        before = lc.stats.clone()
        q = torch.randn(B, HQ, 1, 64, generator=g)
        with cpu.cpu_attention_mode(mode):
            lc.attend(q)
        assert lc.attend_path == path
        assert "observes the attention" in lc.attend_path_reason
        stats[mode] = lc.stats - before
    r = stats["eager"].shape[2]
    assert r > 0 and torch.equal(stats["eager"][..., 1], torch.full((B, HKV, r), 1.0))
    assert float(stats["eager"][..., 0].sum()) > 0
    torch.testing.assert_close(stats["eager"], stats["reference"], rtol=1e-5, atol=1e-7)
