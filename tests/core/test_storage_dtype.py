"""``storage_dtype`` (docs/design.md#storage-dtype): full-precision parts stored in float16 /
bfloat16 while the model computes in float32.

Right values are computed here independently: bytes by hand (tokens x heads x head_dim x 2
bytes for sinks and residual; b-bit codes of D channels take D * b / 8 bytes per token and
head; every float16 (scale, zero) pair 4 bytes), attention as a float64 softmax over K/V
rounded to float16, and every method's float16-stored cache against the same method computing
in float32 over K/V rounded to float16 beforehand (then the stored parts and the codec inputs
are the same numbers, so the outputs agree to float32 round-off).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_padding import HKV, HQ, builtin_layer_methods, small_method

import kvbench
from kvbench.bench.context import RunContext
from kvbench.bench.records import Record
from kvbench.bench.workloads.memory import Memory
from kvbench.cache.registry import get_method
from kvbench.report.headline import bytes_vs_16bit
from kvbench.testing import reference_attention64

D = 32
FP = ("residual", "sinks")


def _qkv(t: int, seed: int = 0, b: int = 1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, HKV, t, D, generator=g) * 1.5 + 0.3
    v = torch.randn(b, HKV, t, D, generator=g)
    q = torch.randn(b, HQ, t, D, generator=g)
    return k, v, q


def _run(m, k, v, q, p: int):
    """Prefill ``p`` tokens, then decode the rest one by one; the layer and the outputs."""
    lc = m.new_layer(0, HKV, D)
    lc.prefill(k[:, :, :p], v[:, :, :p], q[:, :, :p] if m.needs_queries else None)
    outs = []
    for t in range(p, k.shape[2]):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(lc.attend(q[:, :, t : t + 1]))
    lc.end_step()
    return lc, torch.cat(outs, dim=2) if outs else None


def _fp_dtypes(lc) -> set[torch.dtype]:
    return {t.dtype for _, cat, t in lc.tensors() if cat in FP}


# ------------------------------------------------------------------ bytes by hand
def test_full_float16_bytes_and_dtypes() -> None:
    k, v, q = _qkv(23)
    lc, _ = _run(get_method("full", storage_dtype="float16"), k, v, q, 20)
    assert _fp_dtypes(lc) == {torch.float16}
    assert lc.nbytes()["total"] == 2 * 23 * HKV * D * 2  # K and V, 2 bytes each
    assert lc.nbytes()["residual"] == lc.nbytes()["total"]
    kk, vv = lc.keys_values()
    assert kk.dtype == vv.dtype == torch.float32  # read back in the compute dtype
    assert torch.equal(kk, k.half().float()) and torch.equal(vv, v.half().float())


def test_kivi_float16_bytes_by_hand() -> None:
    g, r, bits = 8, 8, 2
    m = get_method(
        "kivi", bits=bits, value_bits=bits, group_size=g, residual_length=r, storage_dtype="float16"
    )
    k, v, q = _qkv(23)
    lc, _ = _run(m, k, v, q, 20)
    # keys, blocks of R: 20 -> 16 quantized + 4; +3 decode -> residual 7 (< R, no flush)
    kq, kr = 16, 7
    # values, sliding R: 20 -> 12 + 8; each decode flushes one -> 15 + 8
    vq, vr = 15, 8
    cg = min(g, D)  # per-token value groups of min(G, D) channels
    key = kq * HKV * D * bits // 8 + (kq // g) * HKV * D * 4 + kr * HKV * D * 2
    val = vq * HKV * D * bits // 8 + vq * HKV * (D // cg) * 4 + vr * HKV * D * 2
    nb = lc.nbytes()
    assert nb["residual"] == (kr + vr) * HKV * D * 2
    assert nb["key_total"] == key and nb["value_total"] == val
    assert nb["total"] == key + val
    assert _fp_dtypes(lc) == {torch.float16}


def test_pn_mix_float16_sinks_and_residual() -> None:
    cfg = dict(group_size=8, residual_length=8, num_sink_tokens=3)
    k, v, q = _qkv(23)
    lc16, _ = _run(get_method("pn-mix", storage_dtype="float16", **cfg), k, v, q, 20)
    lc32, _ = _run(get_method("pn-mix", **cfg), k.half().float(), v.half().float(), q, 20)
    assert {t.dtype for _, c, t in lc16.tensors() if c == "sinks"} == {torch.float16}
    assert {t.dtype for _, c, t in lc16.tensors() if c == "residual"} == {torch.float16}
    nb16, nb32 = lc16.nbytes(), lc32.nbytes()
    assert nb16["sinks"] == 2 * 3 * HKV * D * 2  # 3 sinks, K and V
    fp_tokens = sum(t.shape[2] for _, c, t in lc16.tensors() if c in FP)
    assert nb16["residual"] + nb16["sinks"] == fp_tokens * HKV * D * 2
    for cat in ("codes", "scales", "metadata"):  # the quantized part is what float32 stores
        assert nb16[cat] == nb32[cat]
    assert nb16["total"] == nb32["total"] - (nb32["residual"] + nb32["sinks"]) // 2


def _memory_record(name: str, **cfg) -> Record:
    spec = dict(context=40, appends=4, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32)
    params = {"type": "memory", "source": "synthetic", "dtype": "float32", **spec}
    w = Memory(Memory.validate(params))
    w.prepare(RunContext(seed=0, model_spec=None, model=None, model_info={}))
    metrics = w.run(None, kvbench.get_method(name, **cfg)).metrics
    return Record(
        run_id="x", method=name, config=cfg, workload=params, model={},
        metrics=metrics,
    )  # fmt: skip


def test_full_float16_is_one_times_16bit_bytes() -> None:
    assert bytes_vs_16bit(_memory_record("full", storage_dtype="float16")) == 1.0
    assert bytes_vs_16bit(_memory_record("full")) == 2.0  # float32 as computed
    rec = _memory_record("kivi", group_size=8, residual_length=8, storage_dtype="float16")
    m = rec.metrics
    assert m["bytes_residual"] > 0
    assert m["analytic_bits"] == pytest.approx(m["effective_bits"], rel=0.05)


# ------------------------------------------------------------------ attention
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_over_stored_residual_is_the_rounded_reference(dtype: str) -> None:
    tdt = getattr(torch, dtype)
    k, v, q = _qkv(21, seed=3)
    lc, out = _run(get_method("full", storage_dtype=dtype), k, v, q, 17)
    assert _fp_dtypes(lc) == {tdt}
    for i, t in enumerate(range(17, 21)):
        ref = reference_attention64(
            q[:, :, t : t + 1], k[:, :, : t + 1].to(tdt).double(),
            v[:, :, : t + 1].to(tdt).double(), None,
        )  # fmt: skip
        torch.testing.assert_close(out[:, :, i : i + 1].double(), ref, rtol=1e-5, atol=1e-6)
    # and not the unrounded reference: the storage is real (float16 keys move the logits)
    t = 20
    raw = reference_attention64(q[:, :, t:], k, v, None)
    assert (out[:, :, -1:].double() - raw).abs().max() > 1e-5


# ------------------------------------------------------------------ default: unchanged
def test_default_stores_in_the_compute_dtype_and_keeps_run_ids() -> None:
    m = get_method("kivi", group_size=8, residual_length=8, num_sink_tokens=2)
    assert m.config.storage_dtype is None and "storage_dtype" not in m.config.to_dict()
    assert "storage_dtype" in get_method("full", storage_dtype="float16").config.to_dict()
    for dt in (torch.float32, torch.float16):
        k, v, q = (x.to(dt) for x in _qkv(23))
        lc, _ = _run(m, k, v, q, 20)
        assert _fp_dtypes(lc) == {dt}


# ------------------------------------------------------------------ every method
@pytest.mark.parametrize("name", builtin_layer_methods())
def test_every_method_stores_float16_or_refuses(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    m = small_method(name, g)
    try:
        m16 = type(m)(dataclasses.replace(m.config, storage_dtype="float16"))
    except ValueError as e:
        assert "field 'storage_dtype'" in str(e) and "None (the compute dtype)" in str(e)
        assert type(m).storage_dtype_refusal, f"{name} refused without a declared reason"
        return
    m16.name = name
    if m.needs_calibration:  # plugin-free: share the fitted state
        m16.__dict__.update({a: b for a, b in m.__dict__.items() if a != "config"})
    k, v, q = _qkv(23, seed=1)
    k16, v16 = k.half().float(), v.half().float()
    lc16, out16 = _run(m16, k, v, q, 20)
    lc32, out32 = _run(m, k16, v16, q, 20)
    assert _fp_dtypes(lc16) == {torch.float16}
    assert torch.isfinite(out16).all() and out16.dtype == torch.float32
    torch.testing.assert_close(out16, out32, rtol=1e-5, atol=1e-6)
    fp32 = sum(t.numel() for _, c, t in lc32.tensors() if c in FP)
    assert lc16.nbytes()["total"] == lc32.nbytes()["total"] - fp32 * 2


# ------------------------------------------------------------------ methods with their own paths
def _calibrated(m, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    keys = {0: torch.randn(4, HKV, 64, D, generator=g) * 1.5 + 0.3}
    return m.calibrate(keys, {0: torch.randn(4, HKV, 64, D, generator=g)}, source="random")


def test_kvquant_float16_bytes_by_hand() -> None:
    """Pre-RoPE LUT keys (no outliers at tau = 1), per-token values; 1 sink, R = 4 sliding."""
    cfg = dict(bits=2, value_bits=2, group_size=8, residual_length=4, sparsity_threshold=1.0)
    m16 = _calibrated(get_method("kvquant", storage_dtype="float16", **cfg))
    m32 = _calibrated(get_method("kvquant", **cfg))
    k, v, q = _qkv(23)
    lc16, out16 = _run(m16, k, v, q, 20)
    lc32, out32 = _run(m32, k.half().float(), v.half().float(), q, 20)
    # 20 -> 1 sink + 15 coded + 4 residual; each decode flushes one: 18 coded + 4 residual
    n, r, s = 18, 4, 1
    fp = (r + s) * HKV * D * 2  # sinks and residual of one side, float16
    key = n * HKV * D * 2 // 8 + 2 * HKV * D * 2 + 4 * 2 + fp  # codes, center+half, LUT
    val = n * HKV * D * 2 // 8 + n * HKV * (D // 8) * 4 + fp  # codes, (scale, zero) per 8
    nb = lc16.nbytes()
    assert nb["key_total"] == key and nb["value_total"] == val
    assert nb["residual"] == 2 * r * HKV * D * 2 and nb["sinks"] == 2 * s * HKV * D * 2
    assert _fp_dtypes(lc16) == {torch.float16}
    assert {t.dtype for _, c, t in lc16.tensors() if c == "scales"} == {torch.float16}
    for cat in ("codes", "scales", "metadata"):  # the coded part is what float32 codes
        assert nb[cat] == lc32.nbytes()[cat]
    torch.testing.assert_close(out16, out32, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lc16.keys_values()[0], lc32.keys_values()[0])


@pytest.mark.parametrize("budget_tokens, bits", [(48, 4), (40, 2)])
def test_pm_kvq_float16_bytes_by_hand_and_same_widths(budget_tokens: int, bits: int) -> None:
    """Budget 4 bits of ``budget_tokens`` tokens = 4/8 x 2 x HKV x D x tokens bytes; the
    window and the sink count at 16 bits per element whatever they are stored in, so float16
    and float32 storage reach the same width: 16 coded + 4 held (256 B per token of K and V at
    16 bits) fit 4 bits (2048 B) at 48 and 40 tokens; 3 decode tokens more (2816 B) fit 3072
    (48) but not 2560 (40), where the cache halves to 2 bits."""
    cfg = dict(
        residual_length=8, num_sink_tokens=1, budget_bits=4, budget_tokens=budget_tokens,
        on_overflow="allow",
    )  # fmt: skip
    k, v, q = _qkv(23)
    lc16, out16 = _run(get_method("pm-kvq", storage_dtype="float16", **cfg), k, v, q, 20)
    lc32, out32 = _run(get_method("pm-kvq", **cfg), k.half().float(), v.half().float(), q, 20)
    assert lc16.bits == lc32.bits == bits
    assert lc16.budget_used() == lc32.budget_used()
    # 20 -> 1 sink + 16 coded (two windows of 8) + 3 residual; +3 decode: residual 6
    n, r, s = 16, 6, 1
    side = n * HKV * D * bits // 8 + n * HKV * 1 * 4 + (r + s) * HKV * D * 2  # one 32-ch group
    nb = lc16.nbytes()
    assert nb["key_total"] == nb["value_total"] == side and nb["total"] == 2 * side
    assert _fp_dtypes(lc16) == {torch.float16}
    assert nb["total"] == lc32.nbytes()["total"] - (r + s) * HKV * D * 2 * 2
    torch.testing.assert_close(out16, out32, rtol=1e-5, atol=1e-6)


def test_semkv_float16_bytes_by_hand() -> None:
    """Key-norm ranking, 1 sink, R = 4 sliding: 18 coded tokens per (row, head), 9 of them at
    3 bits (f = 1/2 of an even count), K and V at their token's width."""
    cfg = dict(score="key-norm", residual_length=4, num_sink_tokens=1, value_group_size=8)
    k, v, q = _qkv(23)
    lc16, out16 = _run(get_method("semkv", storage_dtype="float16", **cfg), k, v, q, 20)
    lc32, out32 = _run(get_method("semkv", **cfg), k.half().float(), v.half().float(), q, 20)
    n, hi, r, s = 18, 9, 4, 1
    assert lc16.k.block.high_count().tolist() == [[hi] * HKV]
    side = (
        n * HKV * D * 2 // 8  # the 2-bit plane of every token
        + hi * HKV * D * 1 // 8  # the upper bit of the high tokens
        + HKV * -(-n // 8)  # 1-bit high mask per token
        + n * HKV * (D // 8) * 4  # float16 (scale, zero) per 8 channels
        + (r + s) * HKV * D * 2  # sinks and residual, float16
    )
    nb = lc16.nbytes()
    assert nb["key_total"] == nb["value_total"] == side
    assert _fp_dtypes(lc16) == {torch.float16}
    for cat in ("codes", "scales", "metadata"):
        assert nb[cat] == lc32.nbytes()[cat]
    torch.testing.assert_close(out16, out32, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ perplexity: what is stored
def test_perplexity_reads_the_stored_dtype_and_keeps_a_float32_reference() -> None:
    """The perplexity workload reads the dtype the full-precision tensors were held in
    (``ScoredState.full_precision_dtype``): float16 for ``full`` with ``storage_dtype``,
    float32 for a transformers peer (which cannot be told: recorded, not assumed).  Against the
    float32 ``full`` reference, float16 storage moves the log-probs a little (KL small, > 0),
    and its bytes are half of float32's."""
    from tiny_lm import toy_llama

    from kvbench.bench.workloads.perplexity import chunked_logits

    model = toy_llama()
    ids = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(3))
    ref, s32 = chunked_logits(model, ids, get_method("full"), 32, 16)
    lp16, s16 = chunked_logits(model, ids, get_method("full", storage_dtype="float16"), 32, 16)
    _, peer = chunked_logits(model, ids, get_method("hf-dynamic"), 32, 16)
    assert [s[-1].full_precision_dtype for s in (s32, s16, peer)] == [
        "float32", "float16", "float32",
    ]  # fmt: skip
    assert s16[-1].nbytes["total"] * 2 == s32[-1].nbytes["total"] == peer[-1].nbytes["total"]
    kl = (ref.double().exp() * (ref.double() - lp16.double())).sum(-1).mean().item()
    assert 0 < kl < 1e-3
