"""Peers (transformers' caches as kvbench methods): byte counts against hand counts, the
capability that keeps them out of layer-cache workloads, configs and availability.

Right values are hand counts from the storage formats documented in transformers
``cache_utils.py`` (``DynamicLayer``, ``QuantoQuantizedLayer``, ``HQQQuantizedLayer``,
``Fp8QuantizedLayer``) and the packers of optimum-quanto / HQQ: b-bit codes of n elements take
n * b / 8 bytes; one scale and one shift/zero per group in the K/V dtype; fp8 one byte per
element plus one float32 scale per tensor.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig

import kvbench
from kvbench.bench.context import RunContext
from kvbench.bench.runner import skip_reason
from kvbench.bench.workloads.fidelity import Fidelity
from kvbench.bench.workloads.latency import Latency
from kvbench.bench.workloads.memory import Memory
from kvbench.hf.cache import make_hf_cache
from kvbench.hf.peers import (
    cache_nbytes,
    hf_layer_keys_values,
    hf_layer_nbytes,
    plain_tensors,
    storage_nbytes,
)

HAVE_QUANTO = importlib.util.find_spec("optimum") is not None and (
    importlib.util.find_spec("optimum.quanto") is not None
)
HAVE_HQQ = importlib.util.find_spec("hqq") is not None
needs_quanto = pytest.mark.skipif(not HAVE_QUANTO, reason="optimum-quanto not installed")
needs_hqq = pytest.mark.skipif(not HAVE_HQQ, reason="hqq not installed")


# tiny models gain nothing from intra-op threads (tests/conftest.py: one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _fed(name, shape, dtype, appends=0, **cfg):
    """A peer's layer after a prefill of ``shape`` and ``appends`` one-token updates."""
    layer = kvbench.get_method(name, **cfg).new_hf_layer()
    k, v = _kv(shape, dtype)
    layer.update(k, v)
    for i in range(appends):
        k1, v1 = _kv((*shape[:2], 1, shape[3]), dtype, seed=i + 1)
        layer.update(k1, v1)
    return layer


# ------------------------------------------------------------------ hand counts, shape A
# [B=1, H_kv=2, T=8, D=64] float16, prefill only: 1024 elements per side


def test_dynamic_bytes_shape_a() -> None:
    nb = hf_layer_nbytes(_fed("hf-dynamic", (1, 2, 8, 64), torch.float16))
    assert nb["total"] == 2 * 1024 * 2  # K and V, 2 bytes each
    assert nb["residual"] == 4096 and nb["codes"] == nb["scales"] == 0


@needs_quanto
@pytest.mark.parametrize("nbits, codes", [(2, 256), (4, 512)])
def test_quanto_bytes_shape_a(nbits: int, codes: int) -> None:
    layer = _fed("hf-quanto", (1, 2, 8, 64), torch.float16, nbits=nbits)
    nb = hf_layer_nbytes(layer)
    # axis 0, groups of 64 consecutive elements = 16 per-token groups per side:
    # codes 1024 * nbits / 8 bytes; fp16 scale + fp16 shift per group = 16 * 4 = 64 bytes
    assert nb["codes"] == 2 * codes
    assert nb["scales"] == 2 * 64
    assert nb["residual"] == 0 and nb["metadata"] == 0  # the whole prompt is quantized
    assert nb["key_total"] == nb["value_total"] == codes + 64
    # the subclass reports the logical full-precision size: a naive count would say 2048 B
    qk = layer._quantized_keys
    assert qk.numel() * qk.element_size() == 2048
    assert storage_nbytes(qk) == codes + 64


@needs_quanto
def test_quanto_bytes_after_append_shape_a() -> None:
    nb = hf_layer_nbytes(_fed("hf-quanto", (1, 2, 8, 64), torch.float16, appends=1, nbits=2))
    # one token in the full-precision residual per side: 2 heads x 64 x 2 bytes
    assert nb["residual"] == 2 * 256
    assert nb["total"] == 2 * (256 + 64) + 2 * 256


@needs_hqq
@pytest.mark.parametrize("nbits, codes", [(2, 256), (4, 512)])
def test_hqq_bytes_shape_a(nbits: int, codes: int) -> None:
    layer = _fed("hf-hqq", (1, 2, 8, 64), torch.float16, nbits=nbits)
    nb = hf_layer_nbytes(layer)
    # 1024 elements in groups of 64 = 16 groups: codes 1024 * nbits / 8 bytes (uint8 packing),
    # scale and zero in the fp16 compute dtype inside the meta dict: 16 * (2 + 2) bytes
    assert nb["codes"] == 2 * codes
    assert nb["scales"] == 2 * 64
    assert nb["residual"] == 0
    q, meta = layer._quantized_keys
    assert q.dtype == torch.uint8 and q.numel() == codes
    assert {p for p, _ in plain_tensors(layer._quantized_keys)} == {"0", "1.scale", "1.zero"}


def test_fp8_bytes_shape_a() -> None:
    if kvbench.get_method("hf-fp8").unavailable_reason():
        pytest.skip("transformers without the fp8 QuantizedCache backend")
    nb = hf_layer_nbytes(_fed("hf-fp8", (1, 2, 8, 64), torch.float16, appends=2))
    # 10 tokens x 2 heads x 64 = 1280 one-byte codes per side, one float32 scale per side
    assert nb["codes"] == 2 * 1280
    assert nb["scales"] == 2 * 4
    assert nb["total"] == 2 * 1284


# ------------------------------------------------------------------ hand counts, shape B
# [B=2, H_kv=3, T=40, D=32] float32: 7680 elements per side


def test_dynamic_bytes_shape_b() -> None:
    nb = hf_layer_nbytes(_fed("hf-dynamic", (2, 3, 40, 32), torch.float32, appends=3))
    assert nb["total"] == 2 * (2 * 3 * 43 * 32) * 4


@needs_quanto
def test_quanto_bytes_shape_b() -> None:
    nb = hf_layer_nbytes(
        _fed("hf-quanto", (2, 3, 40, 32), torch.float32, appends=2, nbits=4, q_group_size=32)
    )
    # 240 rows of 32 -> 240 groups: codes 7680 / 2 = 3840 B; float32 scale and shift 240 * 8 B;
    # two appended tokens stay in the float32 residual: 2 * 3 * 2 * 32 * 4 B
    assert nb["codes"] == 2 * 3840
    assert nb["scales"] == 2 * 240 * 8
    assert nb["residual"] == 2 * (2 * 3 * 2 * 32 * 4)


@needs_hqq
def test_hqq_bytes_shape_b() -> None:
    nb = hf_layer_nbytes(
        _fed(
            "hf-hqq",
            (2, 3, 40, 32),
            torch.float32,
            nbits=4,
            q_group_size=32,
            axis_key=1,
            axis_value=1,
        )
    )
    # axis 1: groups of 32 channels of a token, 240 groups; float32 compute dtype
    assert nb["codes"] == 2 * 3840
    assert nb["scales"] == 2 * 240 * 8
    assert nb["total"] == 2 * (3840 + 1920)


@needs_quanto
def test_requantize_all_on_flush() -> None:
    """transformers' QuantizedLayer re-quantizes everything when the residual fills (docs/methods.md#transformers-peers):
    with residual_length 4, the 4th decode token empties the residual."""
    layer = _fed("hf-quanto", (1, 2, 8, 64), torch.float16, appends=3, nbits=2, residual_length=4)
    assert hf_layer_nbytes(layer)["residual"] == 2 * 3 * 2 * 64 * 2
    k1, v1 = _kv((1, 2, 1, 64), torch.float16, seed=9)
    layer.update(k1, v1)
    nb = hf_layer_nbytes(layer)
    assert nb["residual"] == 0
    assert nb["codes"] == 2 * (12 * 2 * 64 * 2 // 8)  # 12 tokens, 2 bits
    k, v = hf_layer_keys_values(layer)
    assert k.shape == (1, 2, 12, 64)


def test_cache_nbytes_sums_layers() -> None:
    cfg = LlamaConfig(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=256,
        head_dim=64,
        vocab_size=64,
    )
    cache = make_hf_cache(kvbench.get_method("hf-dynamic"), cfg)
    k, v = _kv((1, 2, 5, 64), torch.float16)
    for i in range(3):
        cache.update(k, v, i)
    assert cache_nbytes(cache)["total"] == 3 * 2 * (2 * 5 * 64 * 2)


# ------------------------------------------------------------------ integration with workloads


def test_memory_workload_counts_peers_like_full() -> None:
    """hf-dynamic and kvbench's full cache hold the same bytes; a 2-bit quanto cache at
    d = 320 (316 prefill + 4 appends, residual 128) matches its hand count."""
    spec = Memory.validate(
        {
            "type": "memory",
            "source": "synthetic",
            "context": 320,
            "num_layers": 1,
            "num_heads": 4,
            "num_kv_heads": 2,
        }
    )
    w = Memory(spec)
    ctx = RunContext(seed=0, model_spec=None)
    w.prepare(ctx)
    full = w.run(ctx, kvbench.get_method("full")).metrics
    dyn = w.run(ctx, kvbench.get_method("hf-dynamic")).metrics
    assert dyn["bytes_total"] == full["bytes_total"] == 2 * 2 * 320 * 64 * 2
    assert dyn["effective_bits"] == 16.0 and dyn["key_mse"] == 0.0
    if HAVE_QUANTO:
        q = w.run(ctx, kvbench.get_method("hf-quanto", nbits=2)).metrics
        # 316 tokens quantized: 316 * 2 heads groups of 64 -> codes 316*2*16 B, scales 316*2*4 B;
        # 4 residual tokens at fp16: 4*2*64*2 B; per side
        side = 316 * 2 * 16 + 316 * 2 * 4 + 4 * 2 * 64 * 2
        assert q["bytes_total"] == 2 * side
        assert q["effective_bits"] == pytest.approx(8 * side / (2 * 320 * 64))
        assert q["effective_bits"] == pytest.approx(q["analytic_bits"])


def test_peers_need_no_layer_cache_but_refuse_new_layer() -> None:
    m = kvbench.get_method("hf-dynamic")
    assert not m.capabilities.layer_cache
    with pytest.raises(ValueError, match="layer_cache=False"):
        m.new_layer(0, 2, 64)
    assert "layer_cache=False" in skip_reason(m, Fidelity(Fidelity.validate({"type": "fidelity"})))
    assert skip_reason(m, Memory(Memory.validate({"type": "memory"}))) is None
    assert skip_reason(m, Latency(Latency.validate({"type": "latency"}))) is None
    assert skip_reason(kvbench.get_method("kivi"), Fidelity({"type": "fidelity"})) is None


def test_bits_of_peers() -> None:
    r = kvbench.get_method("hf-quanto", nbits=2, q_group_size=64).average_bits(64, 1024)
    assert r["key_bits"] == pytest.approx(2 + 32 / 64)
    assert kvbench.get_method("hf-dynamic").average_bits(64)["value_bits"] == 16
    assert kvbench.get_method("hf-fp8").average_bits(64)["key_bits"] == 8


# ------------------------------------------------------------------ configs and availability


@pytest.mark.parametrize(
    "name, field, value",
    [
        ("hf-quanto", "nbits", 3),
        ("hf-quanto", "axis_key", 1),
        ("hf-quanto", "axis_value", 2),
        ("hf-quanto", "q_group_size", 0),
        ("hf-quanto", "residual_length", -1),
        ("hf-hqq", "nbits", 5),
        ("hf-hqq", "axis_key", -1),
    ],
)
def test_bad_config(name: str, field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        kvbench.get_method(name, **{field: value})


def test_unknown_field() -> None:
    with pytest.raises(ValueError, match="allowed"):
        kvbench.get_method("hf-dynamic", bits=2)


def test_missing_backend_is_a_clear_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n.startswith("hqq") else real(n, *a)
    )
    m = kvbench.get_method("hf-hqq")
    why = m.unavailable_reason()  # kvbench is not on the package index: no 'kvbench[peers]'
    assert "needs hqq" in why and "pip install 'hqq" in why and "kvbench[" not in why
    with pytest.raises(ValueError, match="hqq"):
        m.new_hf_layer()
    from transformers import cache_utils

    monkeypatch.delattr(cache_utils, "Fp8QuantizedLayer", raising=False)
    assert "fp8" in kvbench.get_method("hf-fp8").unavailable_reason()


def test_a_peer_without_its_transformers_hooks_cannot_be_built() -> None:
    """``new_hf_layer`` and ``transformers_cache`` are abstract on :class:`HFPeer`."""
    from kvbench.cache.method import MethodConfig
    from kvbench.hf.peers import HFPeer

    class Half(HFPeer):
        Config = MethodConfig

        def new_hf_layer(self):
            return None

    with pytest.raises(TypeError, match="abstract method '?transformers_cache\\b"):
        Half()
