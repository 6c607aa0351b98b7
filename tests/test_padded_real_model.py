"""Left-padded greedy generation on the real default model (SmolLM2-135M-Instruct, run in
float64 on the CPU) equals each prompt generated alone (docs/design.md#padding).

Three prompts of different lengths in one left-padded batch, 8 greedy tokens, for ``full``,
``kivi``, ``per-token``, ``pn-mix``, ``int4-block`` and ``fp8`` with small groups and residuals so
that every method holds quantized tokens while generating.  The right value of each row is the
prompt generated alone (no padding, no mask).

Why float64: a row of a batched matmul sums its products in another order than the row alone,
so its K/V differ from the row alone by round-off, and a quantizer rounds a value that lies
within that round-off of a level boundary to the other level.  Every later token that attends
to the flipped code moves: in float32, 2-bit KIVI flipped 9 codes of row 1 across the 30 layers
and moved its logits by 0.04, with no padding involved (the same run in float64 stores
bit-identical codes and logits).  In float64 the round-off is 2**29 times smaller, so a flip is
out of reach and padding that leaked into any statistic (~1e-1 and more on this model) stands
out against the bound.

Where a token differs, the test reports the first divergence and passes only if there the alone
run's logit margin between its token and the batch's is below round-off, bounded as

    NOISE = 2 * n_layers * sqrt(hidden_size) * eps * max|logit|

(eps = 2**-52 in float64): the relative rounding error of a ``hidden_size``-long sum in another
order is about sqrt(hidden_size) * eps (random-walk accumulation); each layer has two
matmul-dominated blocks (attention and MLP), and the errors are added linearly over the layers
(no amplification assumed), relative to the logits' magnitude.  The same bound caps the logit
difference at every step before a divergence.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvbench.cache.registry import get_method, get_method_class
from kvbench.hf.cache import QuantizedKVCache, cache_kwarg

pytestmark = pytest.mark.slow

METHODS = ["full", "kivi", "per-token", "pn-mix", "int4-block", "fp8"]
SMALL = {"group_size": 8, "residual_length": 8, "num_sink_tokens": 2, "bits": 2, "value_bits": 2}
NEW = 8
PROMPTS = [
    "The lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Water boils at one hundred degrees Celsius at sea level, but high on a mountain it boils at",
    "In 1843 Ada Lovelace published notes on the Analytical Engine, including a method for "
    "computing Bernoulli numbers that many call the first program. Her notes",
]


@pytest.fixture(scope="module")
def model_tok():
    from kvbench.hf.attention import register
    from kvbench.hf.models import load_model

    model, tok, _ = load_model(attn_implementation=register())
    return model.eval().to(torch.float64), tok


def method(name: str):
    fields = {f.name for f in dataclasses.fields(get_method_class(name).Config)}
    return get_method(name, **{k: v for k, v in SMALL.items() if k in fields})


def generate(model, ids, mask, name):
    cache = QuantizedKVCache(method(name), model, attend=True)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **cache_kwarg(cache, model),
        )
    return out, cache


def noise_bound(model, logits: torch.Tensor) -> float:
    cfg = model.config
    eps = torch.finfo(logits.dtype).eps
    return 2 * cfg.num_hidden_layers * math.sqrt(cfg.hidden_size) * eps * float(logits.abs().max())


@pytest.mark.parametrize("name", METHODS)
def test_padded_greedy_batch_equals_each_prompt_alone(model_tok, name):
    from kvbench.bench.batching import left_pad

    model, tok = model_tok
    rows = [tok(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
    lens = [r.shape[1] for r in rows]
    assert len(set(lens)) == 3
    ids, mask, _ = left_pad(rows, 0)
    batch, cache = generate(model, ids, mask, name)
    lc = cache.layer_caches()[0]
    assert lc.row_lengths == [n + NEW - 1 for n in lens]
    if name != "full":
        assert all(r.quantized_tokens()[0] > 0 for r in lc.rows)
    report = []
    for b, r in enumerate(rows):
        alone, _ = generate(model, r, torch.ones_like(r), name)
        got, want = batch.sequences[b, ids.shape[1] :], alone.sequences[0, r.shape[1] :]
        ref = torch.stack([x[0] for x in alone.logits])  # [NEW, V]
        mine = torch.stack([x[b] for x in batch.logits])
        bound = noise_bound(model, ref)
        same = got == want
        k = NEW if bool(same.all()) else int((~same).int().argmax())
        # up to and including the first divergence the two runs saw the same tokens
        upto = min(k + 1, NEW)
        diff = float((mine[:upto] - ref[:upto]).abs().max())
        assert diff <= bound, f"{name} row {b}: logits differ by {diff:.3g} > noise {bound:.3g}"
        if k < NEW:
            margin = float(ref[k, want[k]] - ref[k, got[k]])
            report.append(f"row {b} step {k}: margin {margin:.3g} (noise {bound:.3g})")
            assert margin <= bound, f"{name}: first divergence {report[-1]} above round-off"
    if report:
        print(f"{name}: divergences within round-off: {report}")
