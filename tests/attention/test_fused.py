"""The fused decode attention (``kv_attend_fused`` in kernels/cpu/csrc/codes.c, through
:func:`kvbench.kernels.cpu.native.attend_fused`): one native call per layer for llama.cpp
``q4_0`` / ``q8_0`` block caches (int4-block, int8-block), checked against float64.

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


@pytest.mark.parametrize("name,cfg", LAYOUTS, ids=lambda x: str(x)[:40])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("tokens", [14, 17, 33, 100])  # block: below, at, past a 16-token tile
@pytest.mark.parametrize("b,hq,hkv", [(1, 3, 3), (2, 9, 3), (1, 8, 2)])  # GQA 1, 3, 4
def test_fused_matches_float64(name, cfg, d, tokens, b, hq, hkv):
    lc, g = build(name, cfg, b, hkv, d, tokens)
    for nq in (1, 3):  # one query, and a chunk of queries (causal among them)
        q = torch.randn(b, hq, nq, d, generator=g)
        ref = ref64(lc, q)
        for isa in isas():
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(native.ENV_ISA, isa)
                out = lc.attend(q)
            assert lc.attend_path == cpu.FUSED_PATH, lc.attend_path_reason
            close_rows(out, ref)


@pytest.mark.parametrize("isa", isas())
def test_padded_rows(isa, monkeypatch):
    """Per-row valid lengths (a padded batch): each row reads only its own tokens."""
    monkeypatch.setenv(native.ENV_ISA, isa)
    lc, g = build("int4-block", dict(num_sink_tokens=1, residual_length=4), 3, 2, 64, 60)
    lengths = torch.tensor([60, 41, 3])
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
    lc, g = build("kivi", dict(group_size=16, residual_length=16), 1, 2, 64, 60)
    q = torch.randn(1, 4, 1, 64, generator=g)
    assert isinstance(cpu.fused_parts(lc, q), str)
    lc.attend(q)
    assert lc.attend_path == cpu.NATIVE_PATH
    lc, g = build("int8-block", {}, 1, 2, 96, 40)  # head_dim 96: not a fused head_dim
    q = torch.randn(1, 4, 1, 96, generator=g)
    assert "head_dim 96" in cpu.fused_parts(lc, q)
    lc.attend(q)
    assert lc.attend_path == cpu.NATIVE_PATH
    lc, g = build("int8-block", dict(value_type="f16"), 1, 2, 64, 40)  # no value block
    q = torch.randn(1, 4, 1, 64, generator=g)
    assert cpu.fused_parts(lc, q) == "no quantized block on both sides"
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
