"""The native C kernels of the code-domain decode attention (kvbench.kernels.cpu.native).

Right values: float64 attention terms computed here from the integer codes (drawn first, then
packed with :func:`kvbench.cache.quant.pack_bits` / :func:`kvbench.cache.mixed_channel.pack_mixed`) and the
affine terms or table, by broadcasting and matmul; tolerance ``max |out - ref| / max |ref| <=
1e-5`` (float32 sums over a few hundred tokens).  Fallbacks: a failed load, ``KVBENCH_NATIVE=0``
(a missing or stale build: tests/core/test_native_build.py).
"""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.mixed_channel import pack_mixed
from kvbench.cache.quant import pack_bits
from kvbench.clib import ENV_DISABLE
from kvbench.kernels.cpu import codedomain as cpu
from kvbench.kernels.cpu import native

B, H, T, M = 2, 3, 300, 5
pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels: {native.unavailable_reason()}"
)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def cases():
    for bits in range(1, 9):
        for d in (64, 96, 128, 256):
            if d % native.code_layout(bits)[1] == 0:
                yield bits, d


@pytest.fixture
def g():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("bits,d", list(cases()))
def test_affine_kernels_match_float64(bits, d, g):
    c = torch.randint(0, 1 << bits, (B, H, T, d), generator=g)
    pk = pack_bits(c, bits)
    q = torch.randn(B, H, M, d, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(B, H, M, T, generator=g, dtype=torch.float64), -1)
    # per-channel rows of L = 128 tokens (the last one partly filled), broadcast over B
    rows = -(-T // 128)
    a, z = torch.rand(1, H, rows, d, generator=g), torch.randn(1, H, rows, d, generator=g)
    x = c.double() * a.double().repeat_interleave(128, 2)[:, :, :T]
    x = x + z.double().repeat_interleave(128, 2)[:, :, :T]
    assert rel(native.keys_rows(pk, q.float(), a, z, 128, bits), q @ x.transpose(-1, -2)) < 1e-5
    # per-token groups of 32 channels (one group where a word holds more than 32 channels)
    dg = d // 32 if 32 % native.code_layout(bits)[1] == 0 else 1
    ag, zg = torch.rand(B, H, T, dg, generator=g), torch.randn(B, H, T, dg, generator=g)
    xg = c.double() * ag.double().repeat_interleave(d // dg, -1)
    xg = xg + zg.double().repeat_interleave(d // dg, -1)
    assert rel(native.keys_groups(pk, q.float(), ag, zg, bits), q @ xg.transpose(-1, -2)) < 1e-5
    assert rel(native.values_groups(pk, p.float(), ag, zg, bits, d), p @ xg) < 1e-5
    # a table of 2^bits levels (fp8 bytes, codebooks)
    lut = torch.randn(1 << bits, generator=g)
    y = lut.double()[c]
    assert rel(native.keys_lut(pk, q.float(), lut, bits), q @ y.transpose(-1, -2)) < 1e-5
    assert rel(native.values_lut(pk, p.float(), lut, bits, d), p @ y) < 1e-5
    # raw codes with one query per row (scales folded in by the caller)
    qs = torch.randn(B, H, M, rows, d, generator=g, dtype=torch.float64)
    qt = qs.repeat_interleave(128, 3)[:, :, :, :T]  # [B, H, M, T, D]
    ref = (qt * c.double().unsqueeze(2)).sum(-1)
    assert rel(native.keys_raw_rows(pk, qs.float(), 128, bits), ref) < 1e-5


def test_a_byte_slice_of_each_row(g):
    """A mixed-precision class: a view of bytes [4, 12) of 20-byte rows (strided codes)."""
    c = torch.randint(0, 16, (B, H, T, 16), generator=g)
    rows = torch.randint(0, 256, (B, H, T, 20), generator=g, dtype=torch.uint8)
    rows[..., 4:12] = pack_bits(c, 4)
    view = rows[..., 4:12]
    assert view.stride(2) == 20
    q = torch.randn(B, H, M, 16, generator=g)
    lut = torch.randn(16, generator=g)
    ref = q.double() @ lut.double()[c].transpose(-1, -2)
    assert rel(native.keys_lut(view, q, lut, 4), ref) < 1e-5


@pytest.mark.parametrize("widths", [(3, 1, 2), (4, 2, 1), (8, 3, 5)])
def test_bit_stream_of_mixed_widths(widths, g, monkeypatch):
    """Class boundaries off the byte (ChanMix's 12-channel classes): one LSB-first stream, in
    tiles of 8 tokens and token by token."""
    counts = (12, 12, 40)
    codes = [torch.randint(0, 1 << b, (B, H, T, n), generator=g) for b, n in zip(widths, counts)]
    pk = pack_mixed(codes, widths)
    w = torch.repeat_interleave(torch.tensor(widths), torch.tensor(counts))
    rows = -(-T // 64)
    qs = torch.randn(B, H, M, rows, sum(counts), generator=g, dtype=torch.float64)
    c = torch.cat(codes, -1).double()
    ref = (qs.repeat_interleave(64, 3)[:, :, :, :T] * c.unsqueeze(2)).sum(-1)
    assert rel(native.keys_stream_rows(pk, qs.float(), w, 64), ref) < 1e-5
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", "0")
    assert rel(native.keys_stream_rows(pk, qs.float(), w, 64), ref) < 1e-5
    monkeypatch.delenv("KVBENCH_NATIVE_TILES")
    with pytest.raises(ValueError, match="widths"):
        native.keys_stream_rows(pk, qs.float(), w.clamp(max=0), 64)
    with pytest.raises(ValueError, match="do not fit"):
        native.keys_stream_rows(pk[..., :-2], qs.float(), w, 64)
    with pytest.raises(ValueError, match="cover"):
        native.keys_stream_rows(pk, qs[:, :, :, :1].float(), w, 64)


def test_supports_names_the_limits():
    pk = torch.zeros(1, 1, 4, 16, dtype=torch.uint8)
    assert native.supports(pk, 2, 64)
    assert not native.supports(pk, 3, 60)  # 3-bit words hold 8 codes
    assert not native.supports(pk.to(torch.int16), 2, 64)
    assert not native.supports(pk, 16, 64)  # int16 codes: the eager kernels
    big = torch.zeros(1, 1, 4, 2048, dtype=torch.uint8)
    assert not native.supports(big, 8, 2048)  # above MAX_HEAD_DIM


def _reset(monkeypatch):
    monkeypatch.setattr(native._NATIVE, "lib", None)
    monkeypatch.setattr(native._NATIVE, "reason", None)


def test_a_failed_load_falls_back_to_eager(monkeypatch):
    import kvbench

    _reset(monkeypatch)

    def broken():
        raise OSError("_codes.so: wrong ELF class")

    monkeypatch.setattr(native, "_load_library", broken)
    assert not native.available()
    assert "_codes.so: wrong ELF class" in native.unavailable_reason()
    lc = kvbench.get_method("kivi", bits=2, group_size=16, residual_length=16).new_layer(0, H, 64)
    lc.prefill(torch.randn(1, H, 70, 64), torch.randn(1, H, 70, 64))
    q = torch.randn(1, 2 * H, 1, 64)
    out = lc.attend(q)
    assert lc.attend_path == cpu.EAGER_PATH
    with cpu.cpu_attention_mode("reference"):
        ref = lc.attend(q)
    assert rel(out, ref.double()) < 1e-5


def test_disabled_by_the_environment(monkeypatch):
    _reset(monkeypatch)
    monkeypatch.setenv(ENV_DISABLE, "0")
    assert not native.available() and native.unavailable_reason() == "KVBENCH_NATIVE=0"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_per_token_loop_where_tiles_apply(bits, g, monkeypatch):
    """The 8-token tiles (whole 32-bit words of 1, 2, 4, 8-bit codes; 32 codes in 3, 5, 6, 7
    words) and the per-token loop give the same logits."""
    d = 64
    c = torch.randint(0, 1 << bits, (B, H, T, d), generator=g)
    pk = pack_bits(c, bits)
    q = torch.randn(B, H, M, d, generator=g)
    a, z = torch.rand(B, H, T, 2, generator=g), torch.randn(B, H, T, 2, generator=g)
    lut = torch.randn(1 << bits, generator=g)
    ar, zr = torch.rand(B, H, 3, d, generator=g), torch.randn(B, H, 3, d, generator=g)

    p = torch.softmax(torch.randn(B, H, M, T, generator=g), -1)

    def run():
        return (
            native.keys_groups(pk, q, a, z, bits),
            native.keys_lut(pk, q, lut, bits),
            native.keys_rows(pk, q, ar, zr, 128, bits),
            native.values_groups(pk, p, a, z, bits, d),  # vectorised blocks vs token by token
            native.values_lut(pk, p, lut, bits, d),  # a vector permute (1, 2, 4 bits) vs loads
        )

    fastest = run()  # vectorised keys where they apply (1, 2, 4, 8 bits), else the tiles
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", "tiled")
    tiled = run()
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", "0")
    loop = run()
    # logits: the same sums in another order; values: centred codes with the group terms added
    # once (vectorised) vs per token (the loop), two float32 roundings of one sum
    for x, y, z, tol in zip(fastest, tiled, loop, (1e-6, 1e-6, 1e-6, 1e-5, 1e-6), strict=True):
        assert rel(x, z.double()) < tol
        assert rel(y, z.double()) < tol


def group_values_case(bits: int, d: int, groups: int, m: int, g):
    """Random ``bits``-bit codes ``c [B, H, T, d]`` with per-token terms ``a, z [B, H, T,
    groups]``, their float64 values ``x = c a + z`` (each group's terms over its ``d / groups``
    channels) and float64 softmax weights ``p [B, H, m, T]``."""
    c = torch.randint(0, 1 << bits, (B, H, T, d), generator=g)
    a, z = torch.rand(B, H, T, groups, generator=g), torch.randn(B, H, T, groups, generator=g)
    x = c.double() * a.double().repeat_interleave(d // groups, -1)
    x = x + z.double().repeat_interleave(d // groups, -1)
    p = torch.softmax(torch.randn(B, H, m, T, generator=g, dtype=torch.float64), -1)
    return c, a, z, x, p


@pytest.mark.parametrize("m", [1, 3, 4, 7, 9])
@pytest.mark.parametrize("groups", [1, 4])
def test_values_of_every_query_row_count(m, groups, g):
    """Values of per-token groups in blocks of 4 query rows x 16 channels: every row count
    (a last block of 1..4 rows) and channel groups per token, against float64."""
    bits, d = 2, 128
    c, a, z, x, p = group_values_case(bits, d, groups, m, g)
    out = native.values_groups(pack_bits(c, bits), p.float(), a, z, bits, d)
    assert rel(out, p @ x) < 1e-5


@pytest.mark.parametrize(("bits", "groups"), [(1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8)])
def test_values_of_groups_narrower_than_a_vector(bits, groups, g, monkeypatch):
    """Per-token groups of 1, 2 or 4 code words (e.g. SemKV's 1-bit upper plane in groups of
    32 channels: 4 bytes) take the vectorised values with one scale per lane; against float64
    and against the token-by-token loop."""
    d = 64
    c, a, z, x, p = group_values_case(bits, d, groups, M, g)
    out = native.values_groups(pack_bits(c, bits), p.float(), a, z, bits, d)
    assert rel(out, p @ x) < 1e-5
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", "0")
    loop = native.values_groups(pack_bits(c, bits), p.float(), a, z, bits, d)
    assert rel(out, loop.double()) < 1e-5 and not torch.equal(out, loop)  # two kernels ran


@pytest.mark.parametrize("d", [64, 128])
def test_signed_16_bit_codes(d, g, monkeypatch):
    """16-bit codes are stored as int16 ``c - 32768`` (kvbench.cache.quant.pack_bits) and read
    signed: ``x = (c - 32768) a + z`` per token group and per channel row, tiled and not."""
    c = torch.randint(0, 1 << 16, (B, H, T, d), generator=g)
    pk = pack_bits(c, 16).view(torch.uint8)
    v = (c - 32768).double()
    q = torch.randn(B, H, M, d, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(B, H, M, T, generator=g, dtype=torch.float64), -1)
    a, z = torch.rand(B, H, T, 2, generator=g) / 65535, torch.randn(B, H, T, 2, generator=g)
    x = v * a.double().repeat_interleave(d // 2, -1) + z.double().repeat_interleave(d // 2, -1)
    rows = -(-T // 128)
    ar, zr = torch.rand(1, H, rows, d, generator=g) / 65535, torch.randn(1, H, rows, d, generator=g)
    xr = v * ar.double().repeat_interleave(128, 2)[:, :, :T]
    xr = xr + zr.double().repeat_interleave(128, 2)[:, :, :T]
    for tiles in ("1", "0"):
        monkeypatch.setenv("KVBENCH_NATIVE_TILES", tiles)
        assert rel(native.keys_groups(pk, q.float(), a, z, 16), q @ x.transpose(-1, -2)) < 1e-5
        assert rel(native.values_groups(pk, p.float(), a, z, 16, d), p @ x) < 1e-5
        assert (
            rel(native.keys_rows(pk, q.float(), ar, zr, 128, 16), q @ xr.transpose(-1, -2)) < 1e-5
        )


@pytest.mark.parametrize("tiles", ["1", "0"])
def test_a_class_off_the_byte(tiles, g, monkeypatch):
    """One class of a bit stream read from its first bit (``bit0``), its channel count padded
    to whole tile units with a zero query, and the small classes' channels by explicit bit
    offsets: each agrees with float64 from the integer codes (ChanMix's class layout)."""
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", tiles)
    widths, counts = (4, 3, 2, 1), (6, 6, 46, 6)
    codes = [torch.randint(0, 1 << b, (B, H, T, n), generator=g) for b, n in zip(widths, counts)]
    pk = pack_mixed(codes, widths)
    rows = -(-T // 64)
    bo = 4 * 6 + 3 * 6  # the 2-bit class starts at bit 42: byte 5, bit 2
    qs = torch.randn(B, H, M, rows, 46, generator=g, dtype=torch.float64)
    ref = (qs.repeat_interleave(64, 3)[:, :, :, :T] * codes[2].double().unsqueeze(2)).sum(-1)
    qw = torch.nn.functional.pad(qs.float(), (0, 2))  # 48 = 3 words of 16 codes
    assert rel(native.keys_raw_rows(pk[..., bo // 8 :], qw, 64, 2, bit0=bo % 8), ref) < 1e-5
    # the 3-bit and 1-bit classes (bits 24.. and 134..) by offsets, in one stream call
    off = torch.cat([24 + 3 * torch.arange(6), 134 + torch.arange(6)])
    w = torch.tensor([3] * 6 + [1] * 6)
    q2 = torch.randn(B, H, M, rows, 12, generator=g, dtype=torch.float64)
    c2 = torch.cat([codes[1], codes[3]], -1).double()
    ref2 = (q2.repeat_interleave(64, 3)[:, :, :, :T] * c2.unsqueeze(2)).sum(-1)
    assert rel(native.keys_stream_rows(pk, q2.float(), w, 64, off), ref2) < 1e-5
    with pytest.raises(ValueError, match="bit0"):
        native.keys_raw_rows(pk, qw, 64, 2, bit0=8)


@pytest.mark.parametrize("bits,d", [(1, 72), (2, 48), (4, 24), (8, 20), (2, 40)])
@pytest.mark.parametrize("kernel", ["1", "tiled", "0"])
def test_rows_of_words_not_a_multiple_of_8(bits, d, kernel, g, monkeypatch):
    """A mixed-precision class whose words are not a whole number of 8-word vectors (Kitty's
    48 2-bit channels: 12 bytes), a view beside another class's (random) bytes and a
    contiguous tensor whose last row ends the storage: the vectorised keys read 8 channels
    at a time from their whole bytes (never a byte past the class).  Per-channel rows and raw
    codes with one query per row, against float64 from the integer codes; vectorised, tiled
    and token by token."""
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", kernel)
    c = torch.randint(0, 1 << bits, (B, H, T, d), generator=g)
    nb = d * bits // 8
    rows_ = torch.randint(0, 256, (B, H, T, nb + 5), generator=g, dtype=torch.uint8)
    rows_[..., :nb] = pack_bits(c, bits)
    view = rows_[..., :nb]  # the class's bytes, then 5 bytes of another class
    q = torch.randn(B, H, M, d, generator=g, dtype=torch.float64)
    nr = -(-T // 128)
    a, z = torch.rand(1, H, nr, d, generator=g), torch.randn(1, H, nr, d, generator=g)
    x = c.double() * a.double().repeat_interleave(128, 2)[:, :, :T]
    x = x + z.double().repeat_interleave(128, 2)[:, :, :T]
    assert rel(native.keys_rows(view, q.float(), a, z, 128, bits), q @ x.transpose(-1, -2)) < 1e-5
    qs = torch.randn(B, H, M, nr, d, generator=g, dtype=torch.float64)
    ref = (qs.repeat_interleave(128, 3)[:, :, :, :T] * c.double().unsqueeze(2)).sum(-1)
    assert rel(native.keys_raw_rows(view, qs.float(), 128, bits), ref) < 1e-5
    last = pack_bits(c, bits)  # contiguous: the last row ends the tensor's storage
    assert rel(native.keys_raw_rows(last, qs.float(), 128, bits), ref) < 1e-5


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("kernel", ["1", "0"])  # vectorised (outliers added as logit terms), scalar
def test_lut_outliers_in_dense_rows(rotated, kernel, g, monkeypatch):
    """KVQuant keys where outliers crowd some token rows (every channel of one row, both
    channels of RoPE pairs, the first and the last position) and miss others: the logits equal
    float64 ``q . x`` with the outliers written over the table values, then turned by RoPE
    (rotate_half pairs) at each token's angles."""
    monkeypatch.setenv("KVBENCH_NATIVE_TILES", kernel)
    bsz, h, t, d, m, bits = 2, 2, 9, 16, 3, 4
    c = torch.randint(0, 16, (bsz, h, t, d), generator=g)
    lut = torch.linspace(-1, 1, 16)
    half, center = torch.rand(h, d, generator=g) + 0.5, torch.randn(h, d, generator=g)
    x = (lut[c] * half[None, :, None] + center[None, :, None]).double()
    bhd = bsz * h * d
    idx = torch.tensor([0, *range(bhd + 16, bhd + 32), 3 * bhd + 5, 3 * bhd + 13, t * bhd - 1])
    val = torch.randn(idx.numel(), generator=g) * 8
    xt = x.permute(2, 0, 1, 3).reshape(-1).clone()
    xt[idx] = val.half().double()
    x = xt.reshape(t, bsz, h, d).permute(1, 2, 0, 3)
    q = torch.randn(bsz, h, m, d, generator=g)
    rope = None
    if rotated:
        ang = torch.rand(t, d // 2, generator=g) * 6
        cos, sin = ang.cos(), ang.sin()
        a, b = x[..., : d // 2], x[..., d // 2 :]
        x = torch.cat(
            [a * cos.double() - b * sin.double(), b * cos.double() + a * sin.double()], -1
        )
        rope = (cos, sin, torch.arange(d // 2), torch.arange(d // 2, d))
    out = native.keys_lut_outliers(
        pack_bits(c, bits), q, lut, half, center, idx.int(), val.half(), bits, rope
    )
    assert rel(out, q.double() @ x.transpose(-1, -2)) < 1e-5


def _upper_case(lb, ub, d, m, g, frac=0.4):
    """Low ``lb``-bit codes of every token, ``ub``-bit upper codes of a random ``frac`` of
    them (rows of ``up`` in ``[T, B, H]`` order, as SemKV stores them), per-token groups of 32
    channels; float64 ``x = (low + 2^lb up) a + z``."""
    low = torch.randint(0, 1 << lb, (B, H, T, d), generator=g)
    high = torch.rand(B, H, T, generator=g) < frac
    high[0, 0] = False  # a (row, head) with no upper codes at all
    up = torch.randint(0, 1 << ub, (B, H, T, d), generator=g) * high[..., None]
    order = high.permute(2, 0, 1)  # [T, B, H]
    rows = torch.full((T, B, H), -1, dtype=torch.int32)
    rows[order] = torch.arange(int(order.sum()), dtype=torch.int32)
    upper = native.Upper(
        pack_bits(up.permute(2, 0, 1, 3)[order], ub), rows.permute(1, 2, 0), ub, lb
    )
    ng = d // 32
    a, z = torch.rand(B, H, T, ng, generator=g), torch.randn(B, H, T, ng, generator=g)
    c = (low + (up << lb)).double()
    x = c * a.double().repeat_interleave(32, -1) + z.double().repeat_interleave(32, -1)
    q = torch.randn(B, H, m, d, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(B, H, m, T, generator=g, dtype=torch.float64), -1)
    return pack_bits(low, lb), upper, a, z, x, q, p


@pytest.mark.parametrize("lb,ub", [(2, 1), (1, 2), (4, 3), (2, 4), (8, 1), (3, 1)])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_an_upper_plane_of_some_tokens(lb, ub, d, g):
    """Per-token mixed precision in one call (SemKV's high tokens): the low plane of every
    token plus the upper codes of the tokens with a row, against float64 ``x = (low + 2^lb
    up) a + z``, keys and values, every query row count up to a vector of 4 and past it."""
    for m in (1, 3, 5, 9, 17):
        pk, upper, a, z, x, q, p = _upper_case(lb, ub, d, m, g)
        assert native.upper_fits(upper, lb, d, m, 32, values=True)
        assert rel(native.values_groups(pk, p.float(), a, z, lb, d, upper), p @ x) < 1e-5
        if native.upper_fits(upper, lb, d, m, 32, values=False):
            out = native.keys_groups(pk, q.float(), a, z, lb, upper)
            assert rel(out, q @ x.transpose(-1, -2)) < 1e-5
        else:
            assert lb == 3 or m > 16  # keys: the vectorised kernel only (<= 16 rows)


def test_an_upper_plane_the_kernels_do_not_take(g):
    """Upper codes of 5 bits (not 1..4) or channel groups of 4: refused by ``upper_fits``, and
    the C side refuses them too (never a silent low-plane-only result); rows that do not
    index the stored upper codes and shifts past 23 bits: refused before the C call."""
    pk, upper, a, z, x, q, p = _upper_case(2, 1, 64, 3, g)
    wide = upper._replace(bits=5)
    assert not native.upper_fits(wide, 2, 64, 3, 32, values=True)
    with pytest.raises(ValueError, match="upper plane"):
        native.values_groups(pk, p.float(), a, z, 2, 64, wide)
    with pytest.raises(ValueError, match="upper plane"):
        native.keys_groups(pk, q.float(), a, z, 2, wide)
    a4, z4 = a.repeat_interleave(8, -1), z.repeat_interleave(8, -1)  # groups of 4 channels
    assert not native.upper_fits(upper, 2, 64, 3, 4, values=True)
    with pytest.raises(ValueError, match="upper plane"):
        native.values_groups(pk, p.float(), a4, z4, 2, 64, upper)
    with pytest.raises(ValueError, match="do not fit"):
        native.values_groups(pk, p.float(), a, z, 2, 64, upper._replace(row=upper.row[:1]))
    past = upper.row.clone()
    past[0, 0, 0] = len(upper.codes)  # one row past the stored upper codes
    for bad, match in ((past, "must index"), (upper.row - 2, "must index")):
        with pytest.raises(ValueError, match=match):
            native.keys_groups(pk, q.float(), a, z, 2, upper._replace(row=bad))
    assert not native.upper_fits(upper._replace(shift=24), 2, 64, 3, 32, values=True)
    with pytest.raises(ValueError, match="shift"):
        native.values_groups(pk, p.float(), a, z, 2, 64, upper._replace(shift=24))
