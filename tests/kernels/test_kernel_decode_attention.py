"""Fused decode attention (interpreter) against a float64 reference on the same dequantized K/V.

The kernel reads the layer cache's packed codes; the reference reads ``keys_values(dtype)``
(what ``LayerCache.attend``'s reference path reads) and computes softmax attention in float64.
Outputs are poisoned (NaN) before launch, so an element the kernel does not write fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvbench import get_method
from kvbench.kernels import decode_attention as DA
from kvbench.kernels import dispatch
from kvbench.kernels.quantize import quantize_keys, quantize_values
from kvbench.kernels.triton_backend import LAYOUTS

TOL = 1e-3


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def build(name, cfg, b, hkv, hq, d, prefill, steps, gen, dtype=torch.float16):
    m = get_method(name, **cfg)
    lc = m.new_layer(0, hkv, d, dtype=dtype)

    def r(*s):
        return torch.randn(*s, generator=gen).to(dtype)

    lc.prefill(r(b, hkv, prefill, d), r(b, hkv, prefill, d), r(b, hq, prefill, d))
    for _ in range(steps):
        lc.append(r(b, hkv, 1, d), r(b, hkv, 1, d))
    return lc, r(b, hq, 1, d)


SMALL = dict(group_size=16, residual_length=16)
CASES = [  # (method, config, D, H_q, H_kv, prefill, decode steps); lengths not page multiples
    ("kivi", dict(SMALL), 64, 4, 1, 45, 3),
    ("kivi", dict(SMALL, value_bits=2, num_sink_tokens=5), 64, 6, 2, 50, 2),
    ("kivi", dict(SMALL, value_bits=4, bits=3), 64, 2, 2, 37, 4),
    ("kitty", dict(SMALL, num_sink_tokens=4), 64, 4, 2, 47, 1),
    ("kitty", dict(SMALL, value_bits=2, num_sink_tokens=3, high_ratio=0.25), 64, 2, 1, 52, 2),
    ("pn-mix", dict(SMALL, num_sink_tokens=4), 64, 4, 2, 45, 2),
    ("pn-mix", dict(SMALL, value_bits=2, num_sink_tokens=2), 128, 3, 1, 38, 3),
]


@pytest.mark.parametrize("name,cfg,d,hq,hkv,prefill,steps", CASES)
def test_fused_matches_float64_reference(name, cfg, d, hq, hkv, prefill, steps, gen, poison):
    lc, q = build(name, cfg, 2, hkv, hq, d, prefill, steps, gen)
    nk, nv = lc.quantized_tokens()
    assert nk > 0 and (nv > 0) == (cfg.get("value_bits", 16) != 16)
    out = dispatch.fused_attend(lc, q, None, layouts=LAYOUTS, num_splits=3, block_n=16)
    k, v = lc.keys_values(q.dtype)
    ref = DA.decode_attention_reference(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL
    # query head h reads KV head h // (H_q / H_kv): a tiled mapping must give another result
    if hq // hkv > 1 and hkv > 1:
        tiled = DA.decode_attention_reference(
            q, k.repeat(1, hq // hkv, 1, 1), v.repeat(1, hq // hkv, 1, 1)
        )
        assert rel_err(out, tiled) > 10 * TOL


def test_float32_and_scaling(gen, poison):
    lc, q = build("kivi", dict(SMALL, value_bits=2), 1, 2, 4, 64, 40, 1, gen, torch.float32)
    out = dispatch.fused_attend(lc, q, 0.3, layouts=LAYOUTS, num_splits=2, block_n=16)
    k, v = lc.keys_values(torch.float32)
    assert rel_err(out, DA.decode_attention_reference(q, k, v, 0.3)) < TOL


def _quantized_parts(gen, b=3, h=2, d=64, g=16):
    def r(*s):
        return torch.randn(*s, generator=gen).half()

    kc, ks, kz = quantize_keys(r(b, h, 3 * g, d), g, (2,))
    vc, vs, vz = quantize_values(r(b, h, 2 * g + 5, d), 4, 32)
    kq = DA.QuantKeys(kc, ks, kz, g, (2,), (d,))
    vq = DA.QuantValues(vc, vs, vz, 4)
    return kq, vq, r


def test_per_sequence_lengths(gen, poison):
    # sequences with their own (S, KQ, KR, VQ, VR), KQ + KR == VQ + VR: quantized values ending
    # inside the quantized keys (rows 0-2) or inside the key residual (row 3)
    kq, vq, r = _quantized_parts(gen, b=4, h=1)
    b, h, d = 4, 1, 64
    sk, sv, rk, rv = r(b, h, 4, d), r(b, h, 4, d), r(b, h, 9, d), r(b, h, 20, d)
    lens = torch.tensor(
        [[4, 48, 9, 37, 20], [1, 21, 0, 19, 2], [0, 35, 5, 24, 16], [3, 16, 9, 22, 3]]
    )
    q = r(b, 4, 1, d)
    out = DA.fused_decode_attention(
        q,
        k_sinks=sk,
        k_quant=kq,
        k_residual=rk,
        v_sinks=sv,
        v_quant=vq,
        v_residual=rv,
        lengths=lens,
        num_splits=2,
        block_n=16,
    )
    kd, vd = DA.dequantize_keys_reference(kq, q.dtype), DA.dequantize_values_reference(vq, q.dtype)
    for i, (s, nkq, nkr, nvq, nvr) in enumerate(lens.tolist()):
        k = torch.cat([sk[i, :, :s], kd[i, :, :nkq], rk[i, :, :nkr]], 1)[None]
        v = torch.cat([sv[i, :, :s], vd[i, :, :nvq], rv[i, :, :nvr]], 1)[None]
        assert rel_err(out[i : i + 1], DA.decode_attention_reference(q[i : i + 1], k, v)) < TOL


@pytest.mark.parametrize("kbits,vbits,mid", [(1, 8, True), (4, 3, False), (8, 1, False)])
def test_other_bit_widths(kbits, vbits, mid, gen, poison):
    # uniform keys at 1 (midpoint), 4, 8 bits and values at 8, 3, 1 bits; no sinks/residual
    def r(*s):
        return torch.randn(*s, generator=gen).half()

    kc, ks, kz = quantize_keys(r(1, 1, 32, 64), 16, (kbits,), midpoint=mid)
    vc, vs, vz = quantize_values(r(1, 1, 32, 64), vbits, 16)
    kq = DA.QuantKeys(kc, ks, kz, 16, (kbits,), (64,), midpoint=mid)
    vq = DA.QuantValues(vc, vs, vz, vbits)
    q = r(1, 2, 1, 64)
    out = DA.fused_decode_attention(q, k_quant=kq, v_quant=vq, num_splits=2, block_n=16)
    k = DA.dequantize_keys_reference(kq, q.dtype)
    v = DA.dequantize_values_reference(vq, q.dtype, head_dim=64)
    assert rel_err(out, DA.decode_attention_reference(q, k, v)) < TOL


def test_control_and_merge(gen, poison):
    # the split-KV control over fp16 K/V with per-sequence lengths; more splits than tiles so
    # some splits are empty (lse = -inf); the torch merge of the partials gives the output
    b, hkv, hq, t, d = 2, 2, 4, 70, 128
    k, v, q = (
        torch.randn(*s, generator=gen).half()
        for s in ((b, hkv, t, d), (b, hkv, t, d), (b, hq, 1, d))
    )
    lens = torch.tensor([70, 19])
    out, (po, pl) = DA.split_kv_attention(
        q, k, v, seq_lens=lens, num_splits=7, block_n=16, return_partials=True
    )
    assert rel_err(out, DA.decode_attention_reference(q, k, v, seq_lens=lens)) < TOL
    assert torch.isinf(pl[1]).any() and not torch.isnan(pl).any()
    assert torch.allclose(DA.merge_reference(po, pl), out.float(), rtol=2e-3, atol=1e-3)


def test_merge_reference_by_hand():
    # two splits over logits (base 2) {0, 1} and {1}: lse = log2(1 + 2) and 1; outputs are
    # the split means of values weighted by 2^logit
    po = torch.tensor([[[[1 / 3], [5.0]]]])  # [B=1, H=1, S=2, D=1]
    pl = torch.tensor([[[math.log2(3.0), 1.0]]])
    # total: values (v0=1 w1, v1=0 w2) then (v2=5 w2): (1*1 + 0*2 + 5*2) / 5 = 2.2
    assert DA.merge_reference(po, pl).item() == pytest.approx(2.2)


def test_rejected_layouts(gen):
    q = torch.randn(1, 2, 1, 96).half()
    k = torch.randn(1, 1, 40, 96).half()
    with pytest.raises(
        ValueError, match="head_dim=96"
    ):  # kernel hard-codes head_dim / block size: triton-lang/triton#621, docs/methods.md#kernel-hard-codes-the-head-dimension: never truncated
        DA.split_kv_attention(q, k, k)
    q64, k64 = torch.randn(1, 2, 2, 64).half(), torch.randn(1, 1, 40, 64).half()
    with pytest.raises(ValueError, match="one decode token"):
        DA.split_kv_attention(q64, k64, k64)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        DA.split_kv_attention(
            torch.randn(1, 3, 1, 64).half(),
            torch.randn(1, 2, 9, 64).half(),
            torch.randn(1, 2, 9, 64).half(),
        )
    with pytest.raises(ValueError, match="counts after the sinks"):
        DA.fused_decode_attention(q64[:, :, :1], k_residual=k64, v_residual=k64[:, :, :39])
    with pytest.raises(ValueError, match="lengths"):
        DA.fused_decode_attention(
            q64[:, :, :1], k_residual=k64, v_residual=k64, lengths=torch.zeros(2, 5)
        )
    for bad_lens in ([[0, 0, 41, 0, 41]], [[0, 0, 40, 0, 39]]):  # beyond storage / K != V
        with pytest.raises(ValueError, match="stored counts|KQ"):
            DA.fused_decode_attention(
                q64[:, :, :1], k_residual=k64, v_residual=k64, lengths=torch.tensor(bad_lens)
            )
    with pytest.raises(ValueError, match="empty"):
        DA.fused_decode_attention(q64[:, :, :1])
    with pytest.raises(ValueError, match="block_n"):
        DA.split_kv_attention(q64[:, :, :1], k64, k64, block_n=24)
    with pytest.raises(ValueError, match="num_splits"):
        DA.split_kv_attention(q64[:, :, :1], k64, k64, num_splits=129)
    kq, _, _ = _quantized_parts(gen, b=1, h=1, g=16)
    with pytest.raises(ValueError, match="block_n=32 must divide"):
        DA.fused_decode_attention(
            q64[:, :, :1], k_quant=kq, v_residual=torch.zeros(1, 1, 48, 64), block_n=32
        )
    pages8 = kq.scale.repeat_interleave(2, dim=2)  # 6 pages of 8 tokens
    bad = DA.QuantKeys(kq.codes, pages8, pages8, 8, (2,), (64,))
    with pytest.raises(ValueError, match="group_size=8"):
        DA.fused_decode_attention(q64[:, :, :1], k_quant=bad, v_residual=torch.zeros(1, 1, 48, 64))


def test_dispatch_paths(gen, monkeypatch):
    lc, q = build("pn-mix", dict(SMALL, num_sink_tokens=2), 1, 1, 2, 64, 40, 1, gen)
    # CPU tensors: the reference path, without launching anything (device placement before a kernel launch (CPU tensor to Triton): jy-yuan/KIVI#24 and #13, docs/methods.md#device-placement-before-a-kernel-launch)
    assert dispatch.try_fused_attend(lc, q, layouts=LAYOUTS) is None
    assert dispatch.attend_path(lc) == "reference" and lc.attend_path_reason == "CPU tensors"
    # unsupported layouts: a reason, no kernel
    ph = get_method("per-head", bits=4).new_layer(0, 1, 64)
    ph.prefill(torch.randn(1, 1, 300, 64), torch.randn(1, 1, 300, 64))
    with pytest.raises(ValueError, match="not per-channel"):  # per-head keys: one group
        dispatch.fused_attend(ph, torch.randn(1, 2, 1, 64), layouts=LAYOUTS)
    with pytest.raises(ValueError, match="head_dim=32"):
        dispatch.fused_attend(ph, torch.randn(1, 2, 1, 32), layouts=LAYOUTS)
    # the switch off
    monkeypatch.setenv(dispatch.ENV_SWITCH, "0")

    class FakeCuda:
        is_cuda = True

    assert dispatch.try_fused_attend(lc, FakeCuda(), layouts=LAYOUTS) is None
    assert lc.attend_path_reason == f"{dispatch.ENV_SWITCH}=0"


def test_check_device_refuses_cpu_for_compiled_kernels():
    from kvbench.kernels._triton import check_device

    class CompiledKernel:  # not an InterpretedFunction
        pass

    with pytest.raises(ValueError, match="CUDA tensors"):
        check_device(CompiledKernel(), torch.zeros(2))
