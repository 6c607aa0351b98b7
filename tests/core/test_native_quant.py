"""The native one-pass quantizer (kvbench.cache.native_quant) against the torch path it replaces.

Every affine codec's block (packed codes, scales, zeros) must be bit for bit the one the torch
path (quantize_groups + pack_bits) makes, on random and adversarial inputs: exact ties at .5
(round half to even), constant groups (scale 0), float16 extremes and subnormals, signed
zeros, odd head dims (the generic bit-stream packing), strided inputs.  Non-finite inputs are
not served (the torch path's NaN/Inf policy applies); overflowing scales raise the same error.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvbench.cache import native_quant as nq
from kvbench.cache.blocks import PerChannelCodec, PerHeadCodec, PerTensorCodec, PerTokenCodec
from kvbench.cache.mixed_channel import MixedChannelCodec, rank_classes
from kvbench.clib import ENV_DISABLE, SOURCE_SYMBOL, source_digest

pytestmark = pytest.mark.skipif(not nq.available(), reason=str(nq.unavailable_reason()))


def torch_path(monkeypatch, codec, x):
    """``codec.encode(x)`` by the torch path (the native build hidden)."""
    with monkeypatch.context() as m:
        m.setattr(nq, "_load", lambda: None)
        return codec.encode(x)


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal values, dtypes, shapes and bit patterns (-0.0 differs from 0.0)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def same_block(a, b) -> bool:
    return (
        bitwise_equal(a.codes, b.codes)
        and bitwise_equal(a.scale, b.scale)
        and bitwise_equal(a.zero, b.zero)
        and a.group_len == b.group_len
        and (a.bits, a.head_dim, a.symmetric, a.midpoint, a.batch_shared)
        == (b.bits, b.head_dim, b.symmetric, b.midpoint, b.batch_shared)
    )


def adversarial(dtype: torch.dtype, d: int = 16, t: int = 32) -> torch.Tensor:
    """[2, 3, t, d]: random rows plus ties, constant groups, extremes, subnormals, -0.0."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, t, d, generator=g) * 2
    # exact ties: half steps over [0, 15], so a 4-bit group spanning [0, 15] (scale 1) has
    # codes at k + 0.5 (round half to even decides them)
    x[0, 0] = (torch.arange(t * d).reshape(t, d) % 31).float() * 0.5
    x[0, 1, :, 0] = 3.0  # a constant channel (scale 0 per channel)
    x[0, 1, 5] = -1.25  # a constant token (scale 0 per token)
    x[0, 2] = 0.0
    x[0, 2, ::2, 1::3] = -0.0  # signed zeros: min of mixed +-0 groups
    big = torch.finfo(dtype).max if dtype != torch.float32 else 3.0e4
    x[1, 0, 0, :4], x[1, 0, 1, :4] = big / 4, -big / 4
    tiny = torch.finfo(torch.float16).tiny
    x[1, 1] = torch.randn(t, d, generator=g) * tiny  # float16 subnormals
    x[1, 2, :, :2] = 65504.0 / 8 if dtype == torch.float16 else 1.0e3
    return x.to(dtype)


CODECS = [
    lambda bits, sym: PerChannelCodec(bits, torch.float32, symmetric=sym, group_size=8),
    lambda bits, sym: PerTokenCodec(bits, torch.float32, symmetric=sym, channel_group=4),
    lambda bits, sym: PerTokenCodec(bits, torch.float16, symmetric=sym, channel_group=16),
    lambda bits, sym: PerHeadCodec(bits, torch.float32, symmetric=sym),
    lambda bits, sym: PerTensorCodec(bits, torch.float32, symmetric=sym),
]


def outcome(fn, *args):
    """The block ``fn`` returns, or the message of the ValueError it raises."""
    try:
        return fn(*args)
    except ValueError as exc:
        return f"ValueError: {exc}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("which", range(len(CODECS)))
def test_codecs_bit_for_bit(monkeypatch, dtype, which):
    x = adversarial(dtype)
    served, real = [], nq.quantize_pack

    def spy(*args, **kw):
        served.append(False)
        got = real(*args, **kw)
        served[-1] = got is not None
        return got

    monkeypatch.setattr(nq, "quantize_pack", spy)
    n = 0
    for bits in range(1, 9):
        for sym in (False, True):
            if sym and bits < 2:
                continue
            codec = CODECS[which](bits, sym)
            if codec.scale_dtype == torch.float16:  # bfloat16 extremes: float32 scales only
                x = x.clamp(-30000, 30000)
            served.clear()
            fast = outcome(codec.encode, x)
            was_served = served == [True]
            ref = outcome(torch_path, monkeypatch, codec, x)
            if isinstance(ref, str):  # a scale that overflows float16: the same error
                assert fast == ref, (dtype, which, bits, sym)
            else:
                assert was_served and same_block(fast, ref), (dtype, which, bits, sym)
                n += 1
    assert n >= 10


def _by_magnitude(high: int):
    def select(pages, queries):
        return rank_classes(pages.float().abs().mean(-2), [high, pages.shape[-1] - high])

    return select


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "bits,high,midpoint,per_page",
    [((3, 1), 8, True, False), ((4, 2), 5, False, False), ((2, 1), 3, True, True)],
)
def test_mixed_classes_bit_for_bit(monkeypatch, dtype, bits, high, midpoint, per_page):
    """Mixed-precision channel classes (Kitty, ChanMix, PN-Mix with its 1-bit midpoint codes):
    each class's per-channel groups one code per byte from the native pass, packed together;
    the same block as the torch path, fixed or per-page classes, byte-aligned or not."""
    x = adversarial(dtype)
    codec = MixedChannelCodec(
        list(bits), _by_magnitude(high), group_size=8, midpoint=midpoint,
        scale_dtype=torch.float32, per_page=per_page,
    )  # fmt: skip
    codec.prepare(x, None)
    a, b = codec.encode(x), torch_path(monkeypatch, codec, x)
    for name in ("codes", "scale", "zero", "perm"):
        assert bitwise_equal(getattr(a, name), getattr(b, name)), name
    assert (a.class_counts, a.group_len) == (b.class_counts, b.group_len)
    assert nq.quantize_pack(x[..., :high], bits[0], 8, 1, packed=False)[0].shape == (
        *x.shape[:3], high,
    )  # fmt: skip


@pytest.mark.parametrize("d,bits", [(6, 3), (6, 2), (10, 5), (3, 7), (12, 1)])
def test_odd_head_dims_and_strided_input(monkeypatch, d, bits):
    """Packing of rows whose codes do not fill whole bytes or words; a strided view (a token
    slice of a longer tensor, KV heads transposed)."""
    g = torch.Generator().manual_seed(d * 10 + bits)
    whole = torch.randn(3, 2, 40, d, generator=g).half()
    for x in (whole[:, :, :24], whole.transpose(0, 1)[:, :, 8:32]):
        assert not x.is_contiguous()
        for codec in (PerChannelCodec(bits, group_size=8), PerTokenCodec(bits, channel_group=d)):
            assert same_block(codec.encode(x), torch_path(monkeypatch, codec, x))


def test_large_input_split_across_threads(monkeypatch):
    """Enough rows and elements that the rows are split across threads: the same block."""
    monkeypatch.setattr(nq, "MIN_PER_THREAD", 1 << 10)
    torch.manual_seed(0)
    x = torch.randn(2, 8, 256, 64).half()
    with torch.no_grad():
        n = torch.get_num_threads()
        torch.set_num_threads(3)
        try:
            assert len(nq._split(16, 256 * 64)) == 3
            for codec in (PerChannelCodec(2, group_size=128), PerTokenCodec(4, channel_group=32)):
                assert same_block(codec.encode(x), torch_path(monkeypatch, codec, x))
        finally:
            torch.set_num_threads(n)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_left_to_the_torch_policy(monkeypatch, bad):
    x = torch.randn(1, 2, 16, 8).half()
    x[0, 1, 3, 2] = bad
    assert nq.quantize_pack(x, 2, 8, 1) is None
    codec = PerChannelCodec(2, group_size=8)
    fast, ref = codec.encode(x), torch_path(monkeypatch, codec, x)
    assert same_block(fast, ref)
    assert torch.isnan(fast.scale).any()  # the torch policy ran: NaN terms for that group


def test_overflow_raises_the_reference_error(monkeypatch):
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 0, 0], x[0, 0, 1, 0] = 1.0e5, -1.0e5  # min -1e5 overflows a float16 zero
    codec = PerChannelCodec(2, torch.float16, group_size=8)
    with pytest.raises(ValueError) as fast:
        codec.encode(x)
    with pytest.raises(ValueError) as ref:
        torch_path(monkeypatch, codec, x)
    assert str(fast.value) == str(ref.value) and "zero (group min)" in str(fast.value)


def test_not_served_cases():
    x = torch.randn(1, 1, 8, 8)
    assert nq.quantize_pack(x.double(), 2, 8, 1) is None  # float64
    assert nq.quantize_pack(x, 16, 8, 1) is None  # 16-bit codes (int16 storage)
    assert nq.quantize_pack(x, 1, 8, 1, symmetric=True) is None
    assert nq.quantize_pack(x.transpose(-1, -2), 2, 8, 1) is None  # strided channels
    with pytest.raises(ValueError, match="do not tile"):
        nq.quantize_pack(x, 2, 3, 1)
    assert nq.quantize_pack(x, 2, 8, 1, midpoint=True) is None  # midpoint: 1-bit codes only


def build_variant(out: Path, *defines: str) -> Path:
    """``out``: affine.c built as setup.py builds it (``nq.FLAGS``, the source digest symbol),
    plus ``defines``; skips the test without a C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (cc) on PATH")
    digest = out.with_suffix(".sha256.c")
    digest.write_text(f'const char {SOURCE_SYMBOL}[65] = "{source_digest(nq.SOURCE)}";\n')
    cmd = [*shlex.split(cc), *nq.FLAGS, *defines, str(nq.SOURCE), str(digest), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out


def test_portable_float16_conversion_matches_the_compiler(tmp_path):
    """The conversion used without compiler _Float16 support, on every finite float16 value
    (normal, subnormal, signed zeros): the same min/max, scales, zeros and codes."""
    portable = nq.load(build_variant(tmp_path / "_affine_portable.so", "-DKQ_NO_FLOAT16"))
    bits16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    vals = bits16.view(torch.float16)
    vals = vals[torch.isfinite(vals)]
    x = vals[: vals.numel() // 64 * 64].reshape(1, 1, -1, 64)
    for tokens, channels in ((1, 8), (16, 1)):
        a = nq.quantize_pack(x, 8, tokens, channels, scale_dtype=torch.float32)
        b = nq.quantize_pack(x, 8, tokens, channels, scale_dtype=torch.float32, lib=portable)
        assert all(bitwise_equal(u, v) for u, v in zip(a, b))
    ref = (x.float().reshape(-1, 8).amin(-1)).reshape(1, 1, -1, 8)
    got = nq.quantize_pack(x, 8, 1, 8, scale_dtype=torch.float32, lib=portable)[2]
    assert bitwise_equal(got, ref) or torch.equal(got, ref)


def test_disabled(monkeypatch):
    monkeypatch.setattr(nq._NATIVE, "lib", None)
    monkeypatch.setattr(nq._NATIVE, "reason", None)
    monkeypatch.setenv(ENV_DISABLE, "0")
    assert not nq.available() and nq.unavailable_reason() == "KVBENCH_NATIVE=0"
    assert nq.quantize_pack(torch.randn(1, 1, 8, 8), 2, 8, 1) is None
    x = torch.randn(1, 1, 8, 8).half()
    assert PerChannelCodec(2, group_size=8).encode(x).codes.shape == (1, 1, 8, 2)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_c_affine_terms_are_the_torch_helpers(bits, scale_dtype):
    """The small-input terms in C (``kq_affine_terms``) equal
    :func:`kvbench.cache.quant.affine_terms` bit for bit: random groups over 12 decades, minima
    halfway between two float16 values (round to even), ranges whose scale is exactly a
    float16 (no bump) or just above one (the next float16 up), empty ranges; an overflowing
    zero or scale gives ``None`` (the torch helper then raises)."""
    from kvbench.cache.quant import affine_terms

    g = torch.Generator().manual_seed(bits)
    n = 20000
    mn = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 5, (n,), generator=g)
    mx = mn + torch.rand(n, generator=g) * 10.0 ** torch.randint(-8, 5, (n,), generator=g)
    h = torch.tensor([1.0, 1.0009765625, 2.0, 1000.0]).half()  # float16 neighbours + half step
    tie = (h.float() + torch.nextafter(h, torch.full_like(h, 60000)).float()) / 2
    qmax = (1 << bits) - 1
    exact = torch.tensor([0.5, 0.25, 3.0]) * qmax  # scale exactly 0.5, 0.25, 3
    mn = torch.cat([mn, tie, torch.zeros(3), torch.full((2,), 7.0)])
    mx = torch.cat([mx, tie + 1, exact, torch.nextafter(exact[:2], exact[:2] + 1)])
    lib = nq._load()
    got = nq._c_affine_terms(lib, mn, mx, bits, scale_dtype)
    for r, o in zip(affine_terms(mn, mx, bits, scale_dtype), got, strict=True):
        assert bitwise_equal(r, o)
    if scale_dtype == torch.float16:
        big = torch.tensor([70000.0])
        assert nq._c_affine_terms(lib, big, big + 1, bits, scale_dtype) is None
        assert nq._c_affine_terms(lib, torch.zeros(1), big * qmax, bits, scale_dtype) is None
    assert nq._c_affine_terms(lib, mn, mx, bits, torch.bfloat16) is None  # the torch helper


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_c_symmetric_terms_are_the_torch_helper(bits, scale_dtype):
    """``kq_symmetric_terms`` equals :func:`kvbench.cache.quant.symmetric_terms` bit for bit:
    random groups over 12 decades of either sign, signed zeros, absmax halfway between two
    float16 values times qmax, scales exactly a float16 or just above one; an overflowing scale
    gives ``None`` (the torch helper then raises)."""
    from kvbench.cache.quant import symmetric_terms

    g = torch.Generator().manual_seed(bits)
    n = 20000
    a = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 5, (n,), generator=g)
    b = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 5, (n,), generator=g)
    mn, mx = torch.minimum(a, b), torch.maximum(a, b)
    qmax = (1 << (bits - 1)) - 1
    h = torch.tensor([1.0, 1.0009765625, 2.0, 1000.0]).half()
    tie = (h.float() + torch.nextafter(h, torch.full_like(h, 60000)).float()) / 2 * qmax
    exact = torch.tensor([0.5, 0.25, 3.0]) * qmax
    mn = torch.cat(
        [mn, -tie, torch.tensor([-0.0, 0.0, -0.0]), -exact, -torch.nextafter(exact, exact + 1)]
    )
    mx = torch.cat([mx, tie / 2, torch.tensor([-0.0, -0.0, 0.0]), exact / 3, torch.zeros(3)])
    lib = nq._load()
    got = nq._c_symmetric_terms(lib, mn, mx, bits, scale_dtype)
    for r, o in zip(symmetric_terms(mn, mx, bits, scale_dtype), got, strict=True):
        assert bitwise_equal(r, o)
    if scale_dtype == torch.float16:
        big = torch.tensor([70000.0 * qmax])
        assert nq._c_symmetric_terms(lib, -big, big, bits, scale_dtype) is None
    assert nq._c_symmetric_terms(lib, mn, mx, bits, torch.bfloat16) is None  # the torch helper


def q4_torch(monkeypatch, x: torch.Tensor, block_size: int = 32):
    """llama.cpp's q4_0 (``int4-block``'s codec) by its torch path: (codes, scales), or the
    message of the ValueError it raises."""
    import kvbench.methods.int_block as ib

    with monkeypatch.context() as m:
        m.setattr(ib, "q4_0", lambda *a: None)
        return outcome(ib.LlamaCppQ4Codec(block_size)._encode_tokens, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [32, 16])
def test_q4_0_bit_for_bit(monkeypatch, dtype, block_size):
    """``kq_q4_0`` equals the torch path of llama.cpp's rule on random and adversarial blocks:
    magnitude ties of either sign (the first wins), all-zero and signed-zero blocks (d = 0),
    elements on the x / d + 8.5 integer boundaries, float16 extremes and subnormals, one token
    (a decode step's flush) and many; the codec serves its tokens from it."""
    import kvbench.methods.int_block as ib

    g = torch.Generator().manual_seed(7)
    adv = adversarial(dtype, d=64, t=32)
    xs = [adv, adv[:, :, 5:6], adv[:, :, 7:12]]
    tie = torch.randn(1, 2, 3, 64, generator=g)
    tie[0, 0, :, 3], tie[0, 0, :, 9] = 7.0, -7.0  # equal magnitudes, the positive first
    tie[0, 1, :, 40], tie[0, 1, :, 41] = -5.0, 5.0  # the negative first
    tie[0, 1, 2, :32] = 0.0
    tie[0, 1, 2, 7] = -0.0
    xs.append(tie.to(dtype))
    xs.append((torch.randint(-16, 17, (1, 2, 9, 64), generator=g) / 2).to(dtype))  # boundaries
    for x in xs:
        got, want = nq.q4_0(x, block_size), q4_torch(monkeypatch, x, block_size)
        if isinstance(want, str):  # bfloat16's max / 4 overflows a float16 scale: not served
            assert got is None and "overflows float16" in want and dtype == torch.bfloat16
            continue
        assert got is not None
        assert all(bitwise_equal(u, v) for u, v in zip(got, want))
        assert all(
            bitwise_equal(u, v)
            for u, v in zip(ib.LlamaCppQ4Codec(block_size)._encode_tokens(x), want)
        )


def test_q4_0_not_served_cases(monkeypatch):
    """Non-finite input (the torch path's NaN policy), a subnormal scale (its reciprocal may
    overflow), a float16-overflowing scale (the torch path raises), float64, an odd block:
    ``None``, and the codec's result is the torch path's."""
    import kvbench.methods.int_block as ib

    x = torch.randn(1, 2, 3, 64)
    nan = x.clone()
    nan[0, 1, 2, 5] = float("nan")
    sub = x * 1e-38
    big = x.clone()
    big[0, 0, 1, 3] = 1e7
    for bad in (nan, sub, big):
        assert nq.q4_0(bad, 32) is None
    assert nq.q4_0(x.double(), 32) is None and nq.q4_0(x, 33) is None
    codec = ib.LlamaCppQ4Codec(32)
    for bad in (nan, sub):
        got, want = codec._encode_tokens(bad), q4_torch(monkeypatch, bad)
        assert all(bitwise_equal(u, v) for u, v in zip(got, want))
    with pytest.raises(ValueError, match="overflows float16"):
        codec._encode_tokens(big)


@pytest.mark.parametrize("name", ["int4-block", "int8-block", "per-token"])
def test_decode_steps_store_and_attend_as_the_torch_path(monkeypatch, name):
    """A prefill and one-token decode steps (the flush of each step through the C terms and
    q4_0 codes) leave every stored tensor and every attention output bit for bit as the torch
    path's (the native build hidden)."""
    import kvbench

    def run():
        g = torch.Generator().manual_seed(11)
        lc = kvbench.get_method(name).new_layer(0, 3, 64)
        lc.prefill(torch.randn(1, 3, 40, 64, generator=g), torch.randn(1, 3, 40, 64, generator=g))
        outs = []
        for _ in range(6):
            k, v = torch.randn(1, 3, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g)
            lc.append(k, v)
            lc.end_step()
            outs.append(lc.attend(torch.randn(1, 9, 1, 64, generator=g), 0.125))
        return [t for _, _, t in lc.tensors()], outs

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(nq, "_load", lambda: None)
        ref = run()
    for got, want in zip(fast, ref, strict=True):
        assert len(got) == len(want)
        assert all(bitwise_equal(u, v) for u, v in zip(got, want))
