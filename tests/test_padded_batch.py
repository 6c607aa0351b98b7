"""Left-padded batches through the transformers bridge (kvbench.hf.padding, docs/design.md#padding).

The right value of each row of a padded batch is that prompt generated alone (stock
transformers computes the same positions from the mask).  A tiny seeded random Llama (GQA:
4 query heads, 2 KV heads, 2 layers, head_dim 32 so that llama.cpp blocks of 32 channels fit),
small groups and residuals so that every method quantizes within the few tokens generated.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvbench
from kvbench.cache.method import Capabilities
from kvbench.cache.registry import get_method, get_method_class
from kvbench.hf.attention import use_kvbench_attention
from kvbench.hf.cache import QuantizedKVCache, cache_kwarg
from kvbench.hf.padding import PaddedBatchError

LENS = [9, 4, 7]
NEW = 8
PAD_ID = 0
SMALL = {"group_size": 4, "residual_length": 4, "num_sink_tokens": 2, "value_bits": 2, "bits": 2}
METHODS = ["full", "kivi", "per-token", "pn-mix", "int4-block", "fp8"]


# tiny models gain nothing from intra-op threads (tests/conftest.py: one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def toy() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=128,
        intermediate_size=128,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(0)
    return use_kvbench_attention(LlamaForCausalLM(cfg).eval())


def method(name: str):
    fields = {f.name for f in dataclasses.fields(get_method_class(name).Config)}
    cfg = {k: v for k, v in SMALL.items() if k in fields}
    return get_method(name, **cfg)


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 128, (n,), generator=g) for n in LENS]


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    p = max(len(r) for r in rows)
    ids = torch.full((len(rows), p), PAD_ID)
    mask = torch.zeros(len(rows), p, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, p - len(r) :], mask[b, p - len(r) :] = r, 1
    return ids, mask


def generate(m, ids, mask, cache):
    with torch.no_grad():
        return m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **cache_kwarg(cache, m),
        )


def first_divergence(a: torch.Tensor, b: torch.Tensor, logits) -> str:
    """Where two greedy continuations part, with the reference's top-2 logit margin there."""
    i = int((a != b).int().argmax())
    top = logits[i].topk(2).values
    return f"first divergence at step {i}: margin {float(top[0] - top[1]):.3g}"


@pytest.mark.parametrize("attend", [False, True], ids=["sdpa", "attend"])
@pytest.mark.parametrize("name", METHODS)
def test_padded_generation_equals_each_prompt_alone(name, attend):
    m = toy()
    rows = prompts()
    ids, mask = left_pad(rows)
    cache = QuantizedKVCache(method(name), m, attend=attend)
    batch = generate(m, ids, mask, cache)
    lc = cache.layer_caches()[0]
    assert lc.row_lengths == [n + NEW - 1 for n in LENS]  # the last token is not cached yet
    stored = 0
    for b, r in enumerate(rows):
        alone_cache = QuantizedKVCache(method(name), m, attend=attend)
        alone = generate(m, r.view(1, -1), torch.ones(1, len(r), dtype=torch.long), alone_cache)
        got, want = batch.sequences[b, max(LENS) :], alone.sequences[0, len(r) :]
        ref_logits = [x[0] for x in alone.logits]
        assert torch.equal(got, want), first_divergence(got, want, ref_logits)
        diff = max((x[b] - y).abs().max().item() for x, y in zip(batch.logits, ref_logits))
        assert diff <= 1e-5, (name, b, diff)  # float32 noise; pads in the stats: ~1e-4
        # the codes stored for the row are the row alone's (float noise of the batched
        # projections aside, which here leaves every code unchanged)
        for lb, la in zip(cache.layer_caches(), alone_cache.layer_caches()):
            for (s, c, x), (_, _, y) in zip(lb.rows[b].tensors(), la.tensors()):
                if c == "codes":
                    assert torch.equal(x, y), (name, b, s)
        stored += alone_cache.nbytes()["total"]
    assert cache.nbytes()["total"] == stored  # pads are not stored
    if name != "full":
        assert cache.quantized_tokens(0)[0] > 0


def test_beam_search_reorders_padded_rows():
    m = toy()
    ids, mask = left_pad(prompts())
    cache = QuantizedKVCache(method("kivi"), m)
    with torch.no_grad():
        out = m.generate(
            ids, attention_mask=mask, max_new_tokens=5, num_beams=2, do_sample=False,
            **cache_kwarg(cache, m),
        )  # fmt: skip
    for b, r in enumerate(prompts()):
        with torch.no_grad():
            one = m.generate(
                r.view(1, -1), max_new_tokens=5, num_beams=2, do_sample=False,
                **cache_kwarg(QuantizedKVCache(method("kivi"), m), m),
            )  # fmt: skip
        assert torch.equal(out[b, max(LENS) :], one[0, len(r) :])


def forward(m, ids, mask, cache):
    with torch.no_grad():
        return m(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwarg(cache, m))


@pytest.mark.parametrize(
    ("row_mask", "match"),
    [
        ([1, 1, 1, 1, 0, 0], r"row 1 .*right padding at position 4"),
        ([0, 1, 1, 0, 1, 1], r"row 1 .*a hole at position 3"),
        ([0, 0, 0, 0, 0, 0], r"row 1 .*no real token"),
    ],
)
def test_masks_that_are_not_left_padding_name_the_row(row_mask, match):
    m = toy()
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 6, row_mask])
    with pytest.raises(PaddedBatchError, match=match):
        forward(m, ids, mask, QuantizedKVCache(method("kivi"), m))


def test_decode_steps_that_add_pads_name_the_row():
    m = toy()
    ids, mask = left_pad(prompts())
    cache = QuantizedKVCache(method("kivi"), m)
    forward(m, ids, mask, cache)
    step = torch.tensor([[5], [6], [7]])
    bad = torch.cat([mask, torch.tensor([[1], [1], [0]])], dim=1)  # row 2's new token a pad
    with pytest.raises(PaddedBatchError, match=r"row 2 .*right padding followed by decode"):
        forward(m, step, bad, cache)
    cache = QuantizedKVCache(method("kivi"), m)
    forward(m, ids, mask, cache)
    with pytest.raises(PaddedBatchError, match="without its attention_mask"):
        forward(m, step, None, cache)
    # an unpadded prefill then a padded step: right padding after decode
    full = torch.ones(3, 9, dtype=torch.long)
    cache = QuantizedKVCache(method("kivi"), m)
    forward(m, torch.randint(1, 128, (3, 9)), full, cache)
    with pytest.raises(PaddedBatchError, match=r"row 1 .*right padding followed by decode"):
        forward(m, step, torch.cat([full, torch.tensor([[1], [0], [1]])], 1), cache)


def test_a_method_without_padding_is_refused_by_name():
    class NoPad(type(get_method("kivi"))):
        capabilities = Capabilities(padding=False)

    meth = NoPad(**SMALL)
    meth.name = "no-pad"
    m = toy()
    ids, mask = left_pad(prompts())
    with pytest.raises(PaddedBatchError, match="'no-pad' does not support padded batches"):
        forward(m, ids, mask, QuantizedKVCache(meth, m))
    # unpadded batches still run
    forward(m, ids, torch.ones_like(mask), QuantizedKVCache(meth, m))


def test_builtin_methods_declare_padding():
    rows = [r for r in kvbench.list_methods() if r["distribution"] == "kvbench"]
    for r in rows:
        caps = r["capabilities"]  # evicting methods refuse padded batches (docs/design.md#eviction)
        assert caps["padding"] == (caps["layer_cache"] and not caps["evicts"]), r["name"]


@pytest.mark.parametrize("rows_apart", [True, False])
def test_rows_apart_keeps_per_tensor_statistics_per_row(rows_apart):
    """``uniform`` has one scale per flushed tensor: in an unpadded batch it is shared by the
    rows unless ``rows_apart`` caches each row alone (as batched workloads do)."""
    m = toy()
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    meth = get_method("uniform", bits=2, residual_length=4)
    cache = QuantizedKVCache(meth, m, rows_apart=rows_apart)
    forward(m, ids, torch.ones_like(ids), cache)
    lc = cache.layer_caches()[0]
    assert (lc.rows is not None) == rows_apart
    same = []
    for b in range(2):
        alone = QuantizedKVCache(meth, m)
        forward(m, ids[b : b + 1], None, alone)
        want = [t for _, c, t in alone.layer_caches()[0].tensors() if c == "scales"]
        src = lc.rows[b] if rows_apart else lc  # shared: the batch's one scale per flush
        got = [t for _, c, t in src.tensors() if c == "scales"]
        assert got and len(got) == len(want)
        same.append(same_fp16_scales(got, want))
    assert all(same) if rows_apart else not all(same)


def same_fp16_scales(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Float16 scales equal up to one float16 ulp each.  A row cached apart gets its K/V from
    the batched forward, whose linear layers have another shape than the row alone's and may
    round differently in float32 (~1e-7 relative, far below half a float16 ulp, 2^-11): a scale
    then lands at most on the neighbouring float16 value.  A scale shared by the batch's rows
    differs by far more."""
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype == torch.float16 and x.shape == y.shape
        ulp = torch.nextafter(y.abs(), torch.tensor(torch.inf, dtype=y.dtype)) - y.abs()
        if not bool(((x.float() - y.float()).abs() <= ulp.float()).all()):
            return False
    return True


@functools.cache
def sdpa_toy() -> LlamaForCausalLM:
    """The toy of issue #41: head_dim 16, stock ``attn_implementation="sdpa"`` (no kvbench mask
    function, so the cache never sees the 2-D attention_mask)."""
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        intermediate_size=128,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


KIVI_41 = {"bits": 2, "group_size": 4, "residual_length": 4}  # issue #41's kivi; no sinks


def method41(name: str):
    fields = {f.name for f in dataclasses.fields(get_method_class(name).Config)}
    return get_method(name, **{k: v for k, v in KIVI_41.items() if k in fields})


def prefill_keys(m, ids, mask, name: str, row: int, n: int) -> torch.Tensor:
    """Layer 0's ``keys_values()`` keys of ``row``'s ``n`` real tokens after one prefill."""
    cache = QuantizedKVCache(method41(name), m)
    pos = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        m(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwarg(cache, m))
    keys, _ = cache.layer_caches()[0].keys_values()
    return keys[row : row + 1, :, keys.shape[2] - n :]


@pytest.mark.filterwarnings("ignore:QuantizedKVCache is used without")
@pytest.mark.parametrize(
    ("name", "differs"), [("kivi", True), ("per-token", False), ("full", False)]
)
def test_without_kvbench_attention_pads_enter_kivi_groups(name, differs):
    """The measured cause behind the refusal below: under stock sdpa the cache cannot see the
    mask, so a left-padded row is stored with its pads.  KIVI's per-channel key groups (G = 4
    tokens) and R-blocks then hold pads beside the row's real tokens, and the real tokens'
    codes change; a per-token codec quantizes each token alone, so its real tokens are equal."""
    m = sdpa_toy()
    rows = prompts()
    ids, mask = left_pad(rows)
    b, n = 1, LENS[1]  # 4 real tokens after 5 pads: alone, one whole group of 4
    got = prefill_keys(m, ids, mask, name, b, n)
    want = prefill_keys(m, rows[b].view(1, -1), None, name, 0, n)
    diff = float((got - want).abs().max())
    if differs:
        assert diff > 1e-2, (name, diff)
    else:  # stored unquantized (per-token: the residual): equal up to the projection's noise
        assert ((got - want).abs() <= layer0_key_roundoff(m, rows[b].view(1, -1))).all(), diff


def layer0_key_roundoff(m, ids: torch.Tensor) -> torch.Tensor:
    """``[1, H_kv, T, D]``: how far layer 0's float32 keys of ``ids`` may move when ``k_proj``
    runs in a batch of another shape (BLAS may sum the hidden-size products in another order;
    the embedding, RMSNorm and RoPE are per token and run the same arithmetic).  Each order of
    ``k = h W^T`` is within ``gamma_H sum_i |h_i W_ji|`` of the exact sum (``u = 2^-24``,
    ``gamma_H = H u / (1 - H u)``), so two differ by twice that; RoPE's ``k_j cos + k_p sin``
    (``p = j +- D/2``) adds channel ``p``'s difference and each side's roundings of the two
    products and the sum (``<= 2 u (|k_j| + |k_p|)``)."""
    layer, u = m.model.layers[0], 2.0**-24
    with torch.no_grad():
        h = layer.input_layernorm(m.model.embed_tokens(ids)).double()
    w = layer.self_attn.k_proj.weight.double()
    hid, d = w.shape[1], m.config.head_dim
    delta = 2 * hid * u / (1 - hid * u) * (h.abs() @ w.abs().T)  # [1, T, H_kv * D]
    k = (h @ w.T).abs()

    def heads(x: torch.Tensor) -> torch.Tensor:  # [1, T, H_kv * D] -> [1, H_kv, T, D]
        return x.view(1, x.shape[1], -1, d).transpose(1, 2)

    delta, k = heads(delta), heads(k)
    return delta + delta.roll(d // 2, -1) + 2 * u * (k + k.roll(d // 2, -1))


@pytest.mark.filterwarnings("ignore:QuantizedKVCache is used without")
@pytest.mark.parametrize("name", ["kivi", "per-token", "full"])
def test_batched_decode_without_kvbench_attention_is_refused(name):
    """Issue #41: a left-padded batch through stock sdpa gave kivi's padded rows other logits
    than the rows alone (pads in its key groups, test above); the cache cannot tell padded
    from unpadded rows without the mask, so every decode of more than one row is refused
    there, before a wrong logit is produced, and one row at a time still runs."""
    m = sdpa_toy()
    rows = prompts()
    ids, mask = left_pad(rows)
    with pytest.raises(
        PaddedBatchError, match="batch of 3 rows needs attn_implementation='kvbench'"
    ):
        generate(m, ids, mask, QuantizedKVCache(method41(name), m))
    # a single row decodes under sdpa as under kvbench's attention function
    one = rows[1].view(1, -1)
    ones = torch.ones_like(one)
    sd = generate(m, one, ones, QuantizedKVCache(method41(name), m))
    kv = use_kvbench_attention(copy.deepcopy(m))  # its own config: m stays on sdpa
    assert m.config._attn_implementation == "sdpa"
    ref = generate(kv, one, ones, QuantizedKVCache(method41(name), kv))
    assert torch.equal(sd.sequences, ref.sequences)
