"""Encoders that run chunk by chunk along T (kvbench.cache.chunks.token_chunks) give the block of
one pass, tensor for tensor, and their no-mask path for finite input gives what the masked
path (the one non-finite input takes) gives on the same finite input.

Each case encodes ``x [B, H_kv, T, D]`` once with the default chunk size (one chunk at these
sizes) and once with chunks of a few tokens (``CHUNK_ELEMENTS`` lowered: the helper reads it at
each call), then compares every stored tensor and the token-group bookkeeping; ``T`` is chosen
so the last chunk is short.  The second half forces the masked path by making the module's
``all_finite`` answer False.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbench.cache import chunks
from kvbench.cache.blocks import AffineBlock
from kvbench.methods import kvquant as kvq
from kvbench.methods import pm_kvq, qjl
from kvbench.methods import turboquant_mse as tq

B, H, T, D = 2, 3, 37, 16


def _x(seed: int = 0, dtype=torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g) * torch.exp(torch.randn(1, H, 1, D, generator=g))
    return x.to(dtype)


def _sketch(m: int = 24) -> torch.Tensor:
    return torch.randn(m, D, generator=torch.Generator().manual_seed(7))


def _lut_codec(tau: float) -> kvq.LUTCodec:
    center = torch.linspace(-0.5, 0.5, D).repeat(H, 1).half()
    half = torch.linspace(0.5, 2.0, D).repeat(H, 1).half()
    lut = torch.tensor([-1.0, -0.3, 0.2, 1.0]).half()
    return kvq.LUTCodec(2, tau, lut, center, half)


def _codecs():
    rot = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(3)))[0]
    cent = torch.tensor([-0.3, -0.1, 0.1, 0.3])
    return {
        "turboquant-mse": tq.TurboQuantCodec(2, rot, cent),
        "qjl": qjl.QJLKeyCodec(_sketch(), norm_dtype=torch.float32),
        "qjl-outliers": qjl.QJLKeyCodec(_sketch(), 4, 2, 8, torch.float32),
        "kvquant-tau<1": _lut_codec(0.9),
        "kvquant-tau=1": _lut_codec(1.0),
        "pm-kvq": pm_kvq.ProgressiveCodec(16, 2, D // 2),
    }


def _tensors(block) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(block):
        v = getattr(block, f.name)
        out[f.name] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t`` (NaNs compare by bit pattern)."""
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def _assert_same(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k, v in ta.items():
        w = tb[k]
        if isinstance(v, torch.Tensor):
            assert v.dtype == w.dtype and v.shape == w.shape, k
            assert torch.equal(_bits(v), _bits(w)), k
        else:
            assert v == w, k


def _cases():
    return list(_codecs().items())


def _n_tokens(codec) -> int:
    return 36 if getattr(codec, "outlier_channels", 0) else T  # whole outlier groups of 4


@pytest.mark.parametrize("name,codec", _cases(), ids=[n for n, _ in _cases()])
def test_chunked_encode_equals_one_pass(name, codec, monkeypatch):
    x = _x()[:, :, : _n_tokens(codec)]
    one = codec.encode(x)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 5 * B * H * D)  # 5 tokens (qjl: 4, a group)
    many = codec.encode(x)
    _assert_same(one, many)
    assert one.ntokens == x.shape[2]


@pytest.mark.parametrize("name,codec", _cases(), ids=[n for n, _ in _cases()])
def test_no_mask_path_equals_masked_path(name, codec, monkeypatch):
    x = _x(1)[:, :, : _n_tokens(codec)]
    fast = codec.encode(x)
    module = {"qjl": qjl, "qjl-outliers": qjl, "turboquant-mse": tq}.get(name, kvq)
    if name == "pm-kvq":
        pytest.skip("pm-kvq's encoder has no finite-input branch of its own")
    monkeypatch.setattr(module, "all_finite", lambda t: False)
    _assert_same(fast, codec.encode(x))


def test_lut_outliers_keep_their_flat_positions_across_chunks(monkeypatch):
    """KVQuant's outlier indices are flat positions in ``[n, B, H_kv, D]``: a chunk's must be
    offset by the tokens before it, so each index still names its own element."""
    codec = _lut_codec(0.6)
    x = _x(2)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 3 * B * H * D)
    blk = codec.encode(x)
    flat = x.permute(2, 0, 1, 3).reshape(-1)
    assert blk.out_idx.numel() > 0
    assert torch.equal(blk.out_val, flat[blk.out_idx.long()].half())
    assert bool((blk.out_idx[1:] > blk.out_idx[:-1]).all())  # ascending, as the kernel walks them


def test_affine_join_checks_settings():
    a = AffineBlock(torch.zeros(1, 1, 2, 4, dtype=torch.uint8), torch.ones(1, 1, 2, 1),
                    torch.zeros(1, 1, 2, 1), [1, 1], 4, 8)  # fmt: skip
    b = dataclasses.replace(a, bits=2, codes=torch.zeros(1, 1, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="different quantizer settings"):
        AffineBlock.join([a, b])
    j = AffineBlock.join([a, a, a])
    assert j.group_len == [1] * 6 and j.codes.shape[2] == 6 and j.zero.shape[2] == 6
