"""Left-padded batches at the layer level (docs/design.md#padding, kvbench.cache.ragged).

The right value of a padded row is that row run alone: for every built-in method (enumerated
from the registry, not hand-listed), each row of a left-padded batch must store bit-identical
tensors (codes, scales, metadata, residual, sinks) to a cache that saw only that row's real
tokens, and its decode attention must agree within 1e-6 relative.  The pads hold huge values
(1e3 in keys, -1e3 in values, 50 in queries), so a pad that entered any statistic (min/max,
amax, saliency, pair selection, outliers, sinks, a budget) would change the codes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvbench
from kvbench.cache.method import require_padding
from kvbench.cache.registry import get_method, get_method_class

HQ, HKV, D = 4, 2, 32  # D = 32: llama.cpp blocks hold 32 channels
LENS = [11, 5, 8]  # row 1 is shorter than its sinks + one group + residual: a corner
STEPS = 3
#: small operating points applied where a method's config has the field; a field a method
#: refuses at these values is dropped (in this order) until its config validates
SMALL = {"group_size": 4, "residual_length": 4, "num_sink_tokens": 2, "value_bits": 2, "bits": 2}
DROP = ("value_bits", "bits", "num_sink_tokens")


def builtin_layer_methods() -> list[str]:
    """Built-in methods with kvbench layer caches, evicting ones excepted (they refuse padded
    batches, docs/design.md#eviction)."""
    return sorted(
        r["name"]
        for r in kvbench.list_methods()
        if r["distribution"] == "kvbench"
        and r["capabilities"].get("layer_cache", True)
        and not r["capabilities"].get("evicts", False)
    )


def small_method(name: str, g: torch.Generator):
    fields = {f.name for f in dataclasses.fields(get_method_class(name).Config)}
    cfg = {k: v for k, v in SMALL.items() if k in fields}
    for i in range(len(DROP) + 1):
        try:
            m = get_method(name, **{k: v for k, v in cfg.items() if k not in DROP[:i]})
            break
        except ValueError:
            if i == len(DROP):
                raise
    if m.needs_calibration:  # a disjoint random "calibration text"
        m.calibrate(
            {0: torch.randn(4, HKV, 64, D, generator=g)},
            {0: torch.randn(4, HKV, 64, D, generator=g)},
            source="random",
        )
    return m


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p, b = max(LENS), len(LENS)
    k = torch.randn(b, HKV, p + STEPS, D, generator=g) * 1.5 + 0.3
    k[..., 3] *= 6  # an outlier channel (mixed-precision selectors pick it)
    v = torch.randn(b, HKV, p + STEPS, D, generator=g)
    q = torch.randn(b, HQ, p + STEPS, D, generator=g)
    for row, n in enumerate(LENS):  # pads: values no statistic may see
        k[row, :, : p - n], v[row, :, : p - n], q[row, :, : p - n] = 1e3, -1e3, 50.0
    return g, k, v, q


def run(m, k, v, q, lengths=None):
    """Prefill ``k, v`` (first P positions) then decode STEPS tokens; attention outputs.
    A padded batch gets its prefill queries late (``provide_queries``, as the transformers
    bridge does), a row alone with the prefill."""
    p = k.shape[2] - STEPS
    lc = m.new_layer(0, HKV, D)
    late = lengths is not None and m.needs_queries
    early = m.needs_queries and not late
    lc.prefill(k[:, :, :p], v[:, :, :p], q[:, :, :p] if early else None, lengths=lengths)
    if late:
        assert lc.awaiting_queries
        lc.provide_queries(q[:, :, :p])
    assert not lc.awaiting_queries
    outs = []
    for t in range(p, p + STEPS):
        lc.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(lc.attend(q[:, :, t : t + 1]).double())
        lc.end_step()
    return lc, torch.cat(outs, dim=2)


def test_every_builtin_layer_method_is_covered():
    names = builtin_layer_methods()
    assert {"kivi", "pn-mix", "fp8", "kvquant", "semkv", "pm-kvq"} <= set(names)
    for name in names:
        require_padding(get_method(name))  # declared: padding supported


@pytest.mark.parametrize("name", builtin_layer_methods())
def test_padded_row_equals_the_row_alone(name):
    g, k, v, q = data()
    m = small_method(name, g)
    p = max(LENS)
    batch, out = run(m, k, v, q, lengths=torch.tensor(LENS))
    assert batch.seq_length == p + STEPS and batch.batch_size == len(LENS)
    assert batch.row_lengths == [n + STEPS for n in LENS]
    assert batch.padding_tokens == sum(p - n for n in LENS)
    kb, vb = batch.keys_values() if m.capabilities.keys_values else (None, None)
    stored = 0
    for row, n in enumerate(LENS):
        pad = p - n
        sl = slice(pad, None)
        alone, ref = run(
            m, k[row : row + 1, :, sl], v[row : row + 1, :, sl], q[row : row + 1, :, sl]
        )
        got, want = batch.rows[row].tensors(), alone.tensors()
        assert [(s, c, t.dtype, t.shape) for s, c, t in got] == [
            (s, c, t.dtype, t.shape) for s, c, t in want
        ]
        for (s, c, a), (_, _, b) in zip(got, want):
            assert torch.equal(a, b), (name, row, s, c)
        rel = (out[row] - ref[0]).norm() / ref[0].norm()
        assert rel <= 1e-6, (name, row, rel.item())
        if m.capabilities.keys_values:  # batch coordinates: the row's pads are zeros at the left
            ka, va = alone.keys_values()
            assert torch.equal(kb[row : row + 1, :, pad:], ka)
            assert torch.equal(vb[row : row + 1, :, pad:], va)
            assert not kb[row, :, :pad].any() and not vb[row, :, :pad].any()
        stored += alone.nbytes()["total"]
    assert batch.nbytes()["total"] == stored  # bytes of what the rows store, no pads
    assert batch.quantized_tokens()[0] > 0 or name == "full"  # the test reaches quantized pages


def test_reorder_and_crop_keep_rows_apart():
    g, k, v, q = data(1)
    m = get_method("kivi", **SMALL)
    p = max(LENS)
    batch, _ = run(m, k, v, q, lengths=LENS)
    batch.index_batch(torch.tensor([2, 0, 0]))  # beam search: row 0 twice
    assert batch.row_lengths == [LENS[2] + STEPS, LENS[0] + STEPS, LENS[0] + STEPS]
    x = torch.randn(3, HKV, 1, D, generator=g)
    batch.append(x, x)
    batch.end_step()
    row0, _ = run(m, k[:1, :, p - LENS[0] :], v[:1, :, p - LENS[0] :], q[:1, :, p - LENS[0] :])
    row0.append(x[1:2], x[1:2])
    row0.end_step()
    for r in (1, 2):  # both copies hold row 0 plus their own new token, and stay independent
        assert all(
            torch.equal(a[2], b[2]) for a, b in zip(batch.rows[r].tensors(), row0.tensors())
        ) == (r == 1)
    t = batch.seq_length
    batch.crop(t - 2)
    assert batch.seq_length == t - 2
    with pytest.raises(ValueError, match="row 0"):  # row 0 is padded by p - LENS[2] = 3
        batch.crop(p - LENS[2])


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([11, 0, 8], r"row 1 has 0 real tokens"),
        ([11, 12, 8], r"lengths\[1\]=12 exceeds"),
        ([11, 5], r"3 integers"),
        ([1.5, 2.0, 3.0], r"3 integers"),
    ],
)
def test_bad_lengths_name_the_row(lengths, match):
    _, k, v, _ = data()
    lc = get_method("kivi", **SMALL).new_layer(0, HKV, D)
    with pytest.raises(ValueError, match=match):
        lc.prefill(k[:, :, :11], v[:, :, :11], lengths=lengths)
    assert lc.seq_length == 0  # nothing stored


def test_attend_refuses_outer_lengths_on_a_padded_cache():
    _, k, v, q = data()
    batch, _ = run(get_method("per-token", **SMALL), k, v, q, lengths=LENS)
    with pytest.raises(ValueError, match="lengths=None"):
        batch.attend(q[:, :, -1:], lengths=torch.tensor(LENS))


def test_a_method_without_padding_is_refused_by_name():
    m = get_method("hf-dynamic")
    with pytest.raises(ValueError, match="'hf-dynamic' does not support padded batches"):
        require_padding(m)
