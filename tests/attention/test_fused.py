"""The fused decode attention (``kv_attend_fused`` in kernels/cpu/csrc/codes.c, through
:func:`kvbench.kernels.cpu.native.attend_fused`): one native call per layer for llama.cpp
``q4_0`` / ``q8_0`` block caches (int4-block, int8-block) and KIVI's affine layouts (2- and
4-bit per-channel keys in groups of G tokens; per-token values or full-precision values; keys
and values split at different tokens), checked against float64.

Right values: attention computed here in float64 over the cache's own ``keys_values(float64)``
(the dequantize path of each block, independent of the kernel), GQA by ``repeat_interleave``,
causal mask aligned to each row's end; tolerance ``max |out - ref| <= 1e-5 max |ref|`` per query
row, as tests/attention/test_attend_backends.py.  Every instruction-set variant the CPU has is
run (``isa``); the ``base`` variant is the build's own target.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvbench
from kvbench.kernels.cpu import codedomain as cpu
from kvbench.kernels.cpu import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def isas() -> list[str]:
    """The instruction sets this CPU runs (``base`` always)."""
    out = []
    for isa in ("base", "avx2", "avx512"):
        try:
            native.fused_isa(isa)
        except RuntimeError:
            continue
        out.append(isa)
    return out


def ref64(lc, query, lengths=None) -> torch.Tensor:
    k, v = lc.keys_values(torch.float64)
    b, hq, nq, d = query.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.zeros(b, hq, nq, d, dtype=torch.float64)
    for i in range(b):
        t = k.shape[2] if lengths is None else int(lengths[i])
        lg = query[i].double() @ k[i, :, :t].transpose(-1, -2) / math.sqrt(d)
        pos = torch.arange(t - nq, t).unsqueeze(1)
        lg = lg.masked_fill(torch.arange(t).unsqueeze(0) > pos, float("-inf"))
        out[i] = torch.softmax(lg, -1) @ v[i, :, :t]
    return out


def close_rows(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    err = (out.double() - ref).abs().amax(-1)
    scale = ref.abs().amax(-1)
    assert bool((err <= rel * scale).all()), f"worst row error {(err / scale).max().item():.2e}"


def build(name, cfg, b, hkv, d, tokens, seed=0):
    lc = kvbench.get_method(name, **cfg).new_layer(0, hkv, d)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, tokens, d, generator=g) * 1.5 + 0.3
    k[..., 3] *= 6  # an outlier channel
    v = torch.randn(b, hkv, tokens, d, generator=g)
    lc.prefill(k[:, :, : tokens - 2], v[:, :, : tokens - 2])
    for t in range(tokens - 2, tokens):  # two decode steps after the prompt
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lc.end_step()
    return lc, g


LAYOUTS = [
    ("int4-block", {}),
    ("int8-block", {}),
    ("int8-block", dict(key_type="q4_0")),  # 4-bit keys, 8-bit values
    ("int4-block", dict(value_type="q8_0", num_sink_tokens=2, residual_length=8)),
    ("int4-block", dict(block_size=16, channel_order="gguf")),
]


#: KIVI's layouts (keys per channel per G tokens, values per token per channel group, or in
#: full precision; residual R; sinks), G and R small so that a few dozen tokens give key and
#: value blocks that end at different tokens and a key group cut by a value boundary
KIVI_LAYOUTS = [
    ("kivi", dict(group_size=16, residual_length=32)),  # K2, values in full precision
    ("kivi", dict(group_size=16, residual_length=16, value_bits=2, value_group_size=16)),
    (
        "kivi",
        dict(
            bits=4,
            group_size=8,
            residual_length=16,
            value_bits=4,
            value_group_size=16,
            num_sink_tokens=3,
        ),
    ),
    ("kivi", dict(bits=2, group_size=32, residual_length=32, value_bits=4, scale_dtype="float32")),
    ("kivi", dict(bits=4, group_size=16, residual_length=16, value_bits=2, scale_dtype="bfloat16")),
    ("kivi", dict(bits=4, group_size=16, residual_length=16)),  # K4, values in full precision
]


def fused_matches_on_every_isa(lc, q: torch.Tensor) -> None:
    """``lc.attend(q)`` runs the fused kernel and matches the float64 reference on every
    instruction set this CPU has."""
    ref = ref64(lc, q)
    for isa in isas():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(native.ENV_ISA, isa)
            out = lc.attend(q)
        assert lc.attend_path == cpu.FUSED_PATH, lc.attend_path_reason
        close_rows(out, ref)


@pytest.mark.parametrize("name,cfg", KIVI_LAYOUTS, ids=lambda x: str(x)[:60])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("tokens", [41, 58, 100])  # not multiples of G; values cut key groups
@pytest.mark.parametrize("b,hq,hkv", [(1, 3, 3), (2, 9, 3), (1, 8, 2)])  # GQA 1, 3, 4
def test_fused_kivi_matches_float64(name, cfg, d, tokens, b, hq, hkv):
    lc, g = build(name, cfg, b, hkv, d, tokens)
    parts = cpu.fused_parts(lc, torch.zeros(b, hq, 1, d))
    assert not isinstance(parts, str), parts
    assert any(p.k.kind == "channel" for p in parts)
    for nq in (1, 3):
        fused_matches_on_every_isa(lc, torch.randn(b, hq, nq, d, generator=g) * 2)


def test_kivi_parts_split_where_either_side_changes():
    """KIVI-2 at 100 tokens (G 16, R 32): keys hold 96 quantized + 4 residual, values 68
    quantized (a sliding window of R = 32 in full precision): three parts, the middle one a
    key block read from row 4 of its terms, 2 tokens into that row."""
    cfg = dict(group_size=16, residual_length=32, value_bits=2, value_group_size=16)
    lc, g = build("kivi", cfg, 1, 2, 64, 100)
    parts = cpu.fused_parts(lc, torch.zeros(1, 4, 1, 64))
    got = [(p.k.kind, p.v.kind, p.k.ntokens, p.k.phase) for p in parts]
    assert got == [
        ("channel", "token", 68, 0),
        ("channel", "float", 28, 4),
        ("float", "float", 4, 0),
    ]
    assert parts[1].k.scale.shape[2] == 6 - 4  # rows 4 and 5 of the key terms


def test_kivi_equals_the_unfused_kernels_to_round_off():
    lc, g = build("kivi", dict(value_bits=2, value_group_size=64), 1, 3, 64, 3000)
    q = torch.randn(1, 9, 1, 64, generator=g) * 3
    fused = lc.attend(q)
    assert lc.attend_path == cpu.FUSED_PATH
    close_rows(fused, cpu._attend(lc, q, None).double())
    close_rows(fused, ref64(lc, q))


@pytest.mark.parametrize("name,cfg", LAYOUTS, ids=lambda x: str(x)[:40])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("tokens", [14, 17, 33, 100])  # block: below, at, past a 16-token tile
@pytest.mark.parametrize("b,hq,hkv", [(1, 3, 3), (2, 9, 3), (1, 8, 2)])  # GQA 1, 3, 4
def test_fused_matches_float64(name, cfg, d, tokens, b, hq, hkv):
    lc, g = build(name, cfg, b, hkv, d, tokens)
    for nq in (1, 3):  # one query, and a chunk of queries (causal among them)
        fused_matches_on_every_isa(lc, torch.randn(b, hq, nq, d, generator=g))


PADDED = [
    ("int4-block", dict(num_sink_tokens=1, residual_length=4), [60, 41, 3]),
    ("kivi", dict(group_size=16, residual_length=16, value_bits=2, value_group_size=32),
     [75, 50, 17]),
]  # fmt: skip


@pytest.mark.parametrize("name,cfg,rows", PADDED, ids=lambda x: str(x)[:40])
@pytest.mark.parametrize("isa", isas())
def test_padded_rows(isa, name, cfg, rows, monkeypatch):
    """Per-row valid lengths (a padded batch): each row reads only its own tokens."""
    monkeypatch.setenv(native.ENV_ISA, isa)
    lc, g = build(name, cfg, 3, 2, 64, rows[0])
    lengths = torch.tensor(rows)
    for nq in (1, 3):
        q = torch.randn(3, 6, nq, 64, generator=g)
        out = lc.attend(q, lengths=lengths)
        assert lc.attend_path == cpu.FUSED_PATH, lc.attend_path_reason
        close_rows(out, ref64(lc, q, lengths))


def test_equals_the_unfused_kernels_to_round_off():
    """The fused step and the per-block native kernels (the path it replaces) agree to float32
    round-off on a long cache."""
    lc, g = build("int4-block", {}, 1, 3, 64, 3000)
    q = torch.randn(1, 9, 1, 64, generator=g) * 3
    fused = lc.attend(q)
    assert lc.attend_path == cpu.FUSED_PATH
    parts = cpu.fused_parts(lc, q)
    assert not isinstance(parts, str)
    unfused = cpu._attend(lc, q, None)
    close_rows(fused, unfused.double())
    close_rows(fused, ref64(lc, q))


def test_other_layouts_keep_their_path():
    """Layouts the fused kernel does not read keep the per-block kernels, and say why."""
    lc, g = build("kivi", dict(bits=3, group_size=16, residual_length=16), 1, 2, 64, 60)
    q = torch.randn(1, 4, 1, 64, generator=g)
    assert cpu.fused_parts(lc, q) == "keys: affine codes other than 2 or 4 bits"
    lc.attend(q)
    assert lc.attend_path == cpu.NATIVE_PATH
    cfg = dict(group_size=16, residual_length=16, value_bits=2, value_group_size=8)
    lc, g = build("kivi", cfg, 1, 2, 64, 60)  # value groups of 8 channels: half a vector
    assert "whole vectors of 16 channels" in cpu.fused_parts(lc, q)
    lc.attend(q)
    assert lc.attend_path == cpu.NATIVE_PATH
    lc, g = build("kivi", dict(group_size=16, residual_length=16), 1, 2, 64, 12)
    assert cpu.fused_parts(lc, q) == "no quantized block"  # all tokens in the residual
    lc, g = build("int8-block", {}, 1, 2, 96, 40)  # head_dim 96: not a fused head_dim
    q = torch.randn(1, 4, 1, 96, generator=g)
    assert "head_dim 96" in cpu.fused_parts(lc, q)
    lc.attend(q)
    assert lc.attend_path == cpu.NATIVE_PATH
    lc, g = build("int8-block", dict(value_type="f16"), 1, 2, 64, 40)  # no value block
    q = torch.randn(1, 4, 1, 64, generator=g)
    assert cpu.fused_parts(lc, q) == "block-8 keys with float-0 values"
    lc.attend(q)
    assert lc.attend_path == cpu.NATIVE_PATH


def test_nan_scale_gives_nan_rows_like_the_reference():
    lc, g = build("int8-block", {}, 1, 2, 64, 40)
    lc.k.block.scale[0, 1, 5, 0] = float("nan")
    q = torch.randn(1, 4, 1, 64, generator=g)
    out = lc.attend(q)
    assert lc.attend_path == cpu.FUSED_PATH
    ref = ref64(lc, q)
    assert torch.equal(out.isnan(), ref.isnan())
    assert bool(out[:, :2].isfinite().all()) and bool(out[:, 2:].isnan().all())


def test_bad_isa_and_shapes():
    with pytest.raises(ValueError, match="KVBENCH_NATIVE_ISA"):
        native.fused_isa("avx9")
    assert native.fused_isa() in ("base", "avx2", "avx512")
    lc, g = build("int4-block", {}, 1, 2, 64, 20)
    parts = cpu.fused_parts(lc, torch.zeros(1, 4, 1, 64))
    q = torch.zeros(1, 2, 2, 64)
    with pytest.raises(ValueError, match="do not fit"):
        native.attend_fused(parts, q, 1, torch.empty(1, 2, 3, 64))
    with pytest.raises(ValueError, match="lengths"):
        native.attend_fused(parts, q, 1, torch.empty_like(q), torch.tensor([99]))
