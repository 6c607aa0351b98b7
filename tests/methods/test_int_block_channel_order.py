"""``int4-block`` / ``int8-block`` with ``channel_order: gguf``: the key blocks group the
channels as llama.cpp's do for a GGUF-converted Llama model.

Right values: the conversion's permutation written here as ggml-org/llama.cpp
``convert_hf_to_gguf.py`` (``LlamaModel.permute``) writes it, applied with numpy to the rows of a
K (and Q) projection; the model's GGUF keys are then those of the permuted projection.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbench

D, HKV, HQ, HIDDEN, T = 8, 2, 4, 12, 6


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of convert_hf_to_gguf.py (rows of a Q/K projection)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def project(x: np.ndarray, w: np.ndarray, heads: int) -> torch.Tensor:
    """``x [T, hidden] @ w.T`` as ``[1, heads, T, D]`` float32."""
    y = (x @ w.T).reshape(x.shape[0], heads, D).transpose(1, 0, 2)
    return torch.tensor(y[None], dtype=torch.float32)


def stored(lc) -> list[tuple[str, str, torch.Tensor]]:
    return lc.tensors()


@pytest.fixture
def model():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, HIDDEN))
    wk = rng.standard_normal((HKV * D, HIDDEN))
    wq = rng.standard_normal((HQ * D, HIDDEN))
    wv = rng.standard_normal((HKV * D, HIDDEN))
    hf = {"k": project(x, wk, HKV), "q": project(x, wq, HQ), "v": project(x, wv, HKV)}
    gguf = {  # what llama.cpp computes from the converted file: Q and K rows permuted, V not
        "k": project(x, permute(wk, HKV), HKV),
        "q": project(x, permute(wq, HQ), HQ),
        "v": project(x, wv, HKV),
    }
    return hf, gguf


@pytest.mark.parametrize("rotation", [dict(), dict(rotation="hadamard", rotation_block=4)])
@pytest.mark.parametrize("name", ["int4-block", "int8-block"])
def test_gguf_order_stores_llamacpp_blocks_and_reads_hf_order(model, name, rotation):
    """HF keys into a ``gguf`` layer store exactly what an ``hf`` layer stores for the keys
    llama.cpp computes (rotation, if on, acting on the GGUF order); reads give HF order back and
    attention with HF queries equals attention of GGUF queries over GGUF keys."""
    hf, gguf = model
    ours = kvbench.get_method(name, block_size=4, channel_order="gguf", **rotation)
    theirs = kvbench.get_method(name, block_size=4, **rotation)
    a, b = ours.new_layer(0, HKV, D), theirs.new_layer(0, HKV, D)
    a.prefill(hf["k"][:, :, :4], hf["v"][:, :, :4])
    b.prefill(gguf["k"][:, :, :4], gguf["v"][:, :, :4])
    for t in (4, 5):
        a.append(hf["k"][:, :, t : t + 1], hf["v"][:, :, t : t + 1])
        b.append(gguf["k"][:, :, t : t + 1], gguf["v"][:, :, t : t + 1])
    a.end_step(), b.end_step()
    assert a.quantized_tokens() == (T, T)
    assert [(s, c) for s, c, _ in stored(a)] == [(s, c) for s, c, _ in stored(b)]
    for (_, _, x), (_, _, y) in zip(stored(a), stored(b)):
        assert torch.equal(x, y)
    ka, va = a.keys_values(torch.float64)
    kb, vb = b.keys_values(torch.float64)
    # back to HF order: the inverse of the conversion (rows (D/2, 2) -> (2, D/2))
    unperm = kb.numpy().reshape(1, HKV, T, D // 2, 2).swapaxes(3, 4).reshape(1, HKV, T, D)
    assert torch.allclose(ka, torch.from_numpy(unperm), atol=1e-6)
    assert torch.allclose(va, vb, atol=1e-6)
    rel = lambda x: float(((ka - x.double()) ** 2).mean() / (x.double() ** 2).mean())  # noqa: E731
    assert rel(hf["k"]) < 0.02 < 0.5 < rel(gguf["k"])  # HF order, up to quantization
    q_hf, q_gguf = hf["q"][:, :, -1:], gguf["q"][:, :, -1:]
    assert torch.allclose(a.attend(q_hf), b.attend(q_gguf), atol=1e-5)


def test_gguf_order_changes_the_blocks_of_a_head_whose_halves_differ():
    """Channels 0..3 small, 4..7 large: in HF order the two blocks of 4 have a small and a
    large scale; in GGUF order (0, 4, 1, 5 | 2, 6, 3, 7) both blocks hold large channels."""
    k = torch.cat([torch.full((1, 1, 1, 4), 0.1), torch.full((1, 1, 1, 4), 2.0)], -1)
    k = k * torch.tensor([1.0, -1.0, 0.5, 0.25, 1.0, 0.5, -0.75, 0.25])
    blocks = {}
    for order in ("hf", "gguf"):
        lc = kvbench.get_method("int8-block", block_size=4, channel_order=order).new_layer(0, 1, D)
        lc.prefill(k, k.clone())
        blocks[order] = [t for s, c, t in lc.tensors() if s == "key"]
    scales = {o: blocks[o][1].float().flatten() for o in blocks}
    assert torch.allclose(scales["hf"], torch.tensor([0.1, 2.0]) / 127, rtol=1e-3)
    assert torch.allclose(scales["gguf"], torch.tensor([2.0, 1.5]) / 127, rtol=1e-3)
    assert not torch.equal(blocks["hf"][0], blocks["gguf"][0])


def test_channel_order_refusals_and_record():
    with pytest.raises(ValueError) as e:
        kvbench.get_method("kivi", channel_order="gguf")
    msg = str(e.value)
    assert "unknown config field(s) ['channel_order'] for KIVIConfig; allowed: [" in msg
    assert "'rotation'" in msg and "'bits'" in msg
    with pytest.raises(
        ValueError,
        match=r"field 'channel_order': 'llama' is not allowed; allowed: \['hf', 'gguf'\]",
    ):
        kvbench.get_method("int4-block", channel_order="llama")
    odd = kvbench.get_method("int4-block", block_size=3, channel_order="gguf")
    with pytest.raises(
        ValueError,
        match=r"field 'channel_order': 'gguf' is not allowed; allowed: 'hf' for head_dim=9",
    ):
        odd.new_layer(0, 1, 9)
    # the default stays out of the record (run ids of existing int-block runs unchanged)
    assert "channel_order" not in kvbench.get_method("int4-block").config.to_dict()
    c = kvbench.get_method("int4-block", channel_order="gguf").config
    assert c.to_dict()["channel_order"] == "gguf" and type(c).from_dict(c.to_dict()) == c
