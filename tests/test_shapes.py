"""Shape models (kvbench.hf.shapes), synthetic K/V of a shape, and the memory workload at a
real model's shape: geometry equals the published configs, seeded weights are reproducible,
stored bytes equal a hand count, bad input is refused before anything loads or allocates."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvbench.bench import synthetic_kv
from kvbench.bench.context import RunContext
from kvbench.bench.runner import run_suite
from kvbench.bench.suite import parse_suite
from kvbench.bench.synthetic_kv import channel_outlier_ratio, inv_freq, rope_outlier_qkv
from kvbench.hf.shapes import ShapeError, build_shape_model, preset, preset_names, shape_config

# Published configs (the models' config.json on the hub), written out by hand:
# layers, hidden, q heads, KV heads, head_dim, intermediate, vocab, rope_theta, max context
TABLE = {
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256, 500000.0, 131072),
    "deepseek-r1-distill-llama-8b": (32, 4096, 32, 8, 128, 14336, 128256, 500000.0, 131072),
    "llama-3.1-70b": (80, 8192, 64, 8, 128, 28672, 128256, 500000.0, 131072),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936, 1000000.0, 40960),
    "qwen2.5-7b": (28, 3584, 28, 4, 128, 18944, 152064, 1000000.0, 32768),
    "mistral-7b-v0.3": (32, 4096, 32, 8, 128, 14336, 32768, 1000000.0, 32768),
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, 100000.0, 8192),
}
LLAMA3_ROPE = {"factor": 8.0, "original_max_position_embeddings": 8192}
LLAMA3_ROPE |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_type": "llama3"}


def test_presets_are_the_table():
    assert preset_names() == sorted(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_shape_model_geometry_equals_published_config(name):
    model, tok, info = build_shape_model(name, materialize=False)
    layers, hidden, hq, hkv, d, inter, vocab, theta, ctx = TABLE[name]
    cfg = model.config
    assert next(model.parameters()).device.type == "meta" and info["device"] == "meta"
    assert len(model.model.layers) == layers == info["num_hidden_layers"]
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == hq * d and attn.k_proj.out_features == hkv * d
    assert attn.v_proj.out_features == hkv * d and attn.o_proj.in_features == hq * d
    assert (info["num_attention_heads"], info["num_key_value_heads"], info["head_dim"]) == (
        hq,
        hkv,
        d,
    )
    assert cfg.hidden_size == hidden and model.model.layers[0].mlp.up_proj.out_features == inter
    assert model.lm_head.out_features == vocab and cfg.max_position_embeddings == ctx
    assert info["rope_theta"] == theta and info["rope_layout"] == "rotate_half"
    rope = {k: v for k, v in cfg.rope_parameters.items() if k != "rope_theta"}
    assert rope == (
        LLAMA3_ROPE if name.startswith(("llama", "deepseek")) else {"rope_type": "default"}
    )
    # the rotary module transformers built uses that RoPE
    assert model.model.rotary_emb.rope_type == rope["rope_type"]
    assert model.model.rotary_emb.config.rope_parameters["rope_theta"] == theta
    # model-specific attention features
    assert hasattr(attn, "q_norm") == (name == "qwen3-8b")
    assert (attn.q_proj.bias is not None) == (name == "qwen2.5-7b")
    assert (attn.k_proj.bias is not None) == (name == "qwen2.5-7b")
    if name == "mistral-7b-v0.3":
        assert cfg.sliding_window is None
    assert info["random_weights"] is True and info["shape_slice"] is None
    assert tok("ab")["input_ids"] == [97, 98]


def test_llama3_inverse_frequencies_by_hand():
    """Llama-3.1's RoPE scaling (factor 8, original 8192, low 1, high 4), float64 by hand."""
    cfg, _ = shape_config("llama-3.1-8b")
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    wavelen = 2 * math.pi / base
    lo_wl, hi_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    want = torch.where(wavelen > lo_wl, base / 8, base)
    mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
    want = torch.where(mid, (1 - smooth) * base / 8 + smooth * base, want)
    torch.testing.assert_close(inv_freq(cfg).double(), want, rtol=1e-6, atol=0)


def test_slice_builds_first_layers_and_is_recorded():
    model, _, info = build_shape_model("llama-3.1-8b", layers=2, materialize=False)
    assert len(model.model.layers) == 2 and info["num_hidden_layers"] == 2
    assert info["shape_num_hidden_layers"] == 32 and info["shape_slice"] == "first 2 of 32 layers"
    for bad in (33, 0, -1, 2.0, True):
        with pytest.raises(ShapeError, match=r"layers=.* must be an integer in \[1, 32\]"):
            shape_config("llama-3.1-8b", layers=bad)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ShapeError) as err:
        shape_config("llama-9")
    for name in TABLE:
        assert name in str(err.value)


def test_hub_id_offline_names_the_presets(monkeypatch):
    monkeypatch.setenv("KVBENCH_OFFLINE", "1")
    with pytest.raises(ShapeError, match="KVBENCH_OFFLINE=1.*known presets: .*qwen3-8b"):
        shape_config("someone/some-model")


def test_same_seed_same_weights():
    """A materialized slice: bit-identical for one seed, different for another; the caller's
    RNG state is left untouched."""
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, _, info = build_shape_model("smollm2-135m", layers=1, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    b, _, _ = build_shape_model("smollm2-135m", layers=1, seed=7)
    c, _, _ = build_shape_model("smollm2-135m", layers=1, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert info["weights_seed"] == 7 and info["materialized"] and info["device"] == "cpu"
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    w = "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(sa[w], sc[w]) and sa[w].std() > 0
    with torch.no_grad():  # it runs a forward on CPU
        out = a(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 49152) and torch.isfinite(out).all()


# The repositories whose config.json each row of TABLE comes from (the alias has its own)
HUB = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "deepseek-r1-distill-llama-8b": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "mistral-7b-v0.3": "mistralai/Mistral-7B-Instruct-v0.3",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
# every config key that sets a shape the cache or the attention sees (token ids do not)
SHAPE_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rope_theta",
    "max_position_embeddings",
)


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def test_presets_name_their_hub_ids():
    for name, hub_id in HUB.items():
        p = preset(name)
        assert p["hub_id"] == hub_id or hub_id in p["note"], name
        for k in SHAPE_FIELDS:
            assert k in p["config"], (name, k)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_presets_match_published_config_json(name):
    """With the hub reachable: the preset's shape fields equal the published config.json,
    and both equal TABLE.  Offline (or a gated repository without a token) it skips, naming
    the hub id."""
    from kvbench.data.hub import hf_offline_env, hub_reachable, offline_requested

    hub_id = HUB[name]
    if offline_requested() or hf_offline_env() or not hub_reachable():
        pytest.skip(f"{hub_id}: hub unreachable, its published config.json cannot be read")
    from huggingface_hub import hf_hub_download

    try:
        with open(hf_hub_download(hub_id, "config.json")) as f:
            published = json.load(f)
    except Exception as exc:  # gated repository without a token, rate limit
        pytest.skip(f"{hub_id}: config.json not readable ({type(exc).__name__})")
    cfg = preset(name)["config"]
    for k in SHAPE_FIELDS:
        assert cfg[k] == published[k], (hub_id, k)
    assert _head_dim(cfg) == _head_dim(published), hub_id
    assert cfg.get("rope_scaling") == published.get("rope_scaling"), hub_id
    for k in ("sliding_window", "use_sliding_window", "attention_bias", "tie_word_embeddings"):
        if k in published:
            assert cfg.get(k) == published[k], (hub_id, k)
    layers, hidden, hq, hkv, d, inter, vocab, theta, ctx = TABLE[name]
    got = [published[k] for k in SHAPE_FIELDS[1:]]
    assert got == [layers, hidden, hq, hkv, inter, vocab, theta, ctx], hub_id
    assert _head_dim(published) == d, hub_id


# ----------------------------------------------------------------------------- synthetic K/V
def test_synthetic_keys_have_fixed_outlier_pairs_and_rope():
    cfg, _ = shape_config("llama-3.1-8b")
    q, k, v = rope_outlier_qkv(cfg, 2048, batch=1, seed=0)
    assert q.shape == (1, 32, 2048, 128) and k.shape == v.shape == (1, 8, 2048, 128)
    assert k.dtype == torch.float16
    assert 4.0 < channel_outlier_ratio(k) < 5.5 and channel_outlier_ratio(v) < 2.5
    # undo RoPE independently (float64, rotate-half): the per-channel spread over tokens is
    # then the fixed scale, 4.5x the median on two pairs (i, i + 64) per head, i >= 32
    pos = torch.arange(2048, dtype=torch.float64)[:, None] * inv_freq(cfg).double()[None]
    cos, sin = torch.cat([pos.cos()] * 2, -1), torch.cat([pos.sin()] * 2, -1)
    kd = k.double()
    rot = torch.cat([kd[..., 64:], -kd[..., :64]], -1)  # inverse rotation
    pre = kd * cos + rot * sin
    std = pre.std(dim=2)[0]  # [H_kv, D]
    # the per-channel offsets are fixed before RoPE: fast-rotating pairs average them out of
    # the stored keys, and undoing RoPE with the shape's frequencies brings them back
    assert kd[..., :16].mean(2).abs().mean() < 0.1 < 0.25 < pre[..., :16].mean(2).abs().mean()
    for h in range(8):
        top = sorted(std[h].topk(4).indices.tolist())
        assert top[2:] == [top[0] + 64, top[1] + 64] and top[0] >= 32
        ratio = std[h, top] / std[h].median()
        assert ((ratio > 4.0) & (ratio < 5.0)).all()
    # a shorter draw is a prefix; K/V do not depend on whether queries are drawn
    _, k2, v2 = rope_outlier_qkv(cfg, 1500, batch=1, seed=0, queries=False)
    assert torch.equal(k2, k[:, :, :1500]) and torch.equal(v2, v[:, :, :1500])


def test_synthetic_draw_equals_the_plain_formula_bit_for_bit():
    # the draw works in place with half-size RoPE temporaries; it must equal, bit for bit,
    # the plain float32 formula x * cos + rotate_half(x) * sin on the same generator draws
    # (keys mu + s_k z, values s_v z, queries z_q), cast to float16 at the end
    from kvbench.bench import synthetic_kv as skv

    cfg, _ = shape_config("qwen3-8b")
    b, t, hq, hkv, d = 2, skv.CHUNK + 37, 32, 8, 128
    q, k, v = rope_outlier_qkv(cfg, t, batch=b, seed=3, layer=1)
    base = skv._base_seed(3, 1, b)
    g = torch.Generator().manual_seed(base)
    mu, s_k = (
        0.5 * torch.randn(hkv, d, generator=g),
        torch.exp(0.25 * torch.randn(hkv, d, generator=g)),
    )
    s_k = s_k / s_k.median(dim=-1, keepdim=True).values
    s_v = torch.exp(0.25 * torch.randn(hkv, d, generator=g))
    for h in range(hkv):
        pairs = d // 4 + torch.randperm(d // 2 - d // 4, generator=g)[: skv.OUTLIER_PAIRS]
        for i in pairs.tolist():
            s_k[h, i] = s_k[h, i + d // 2] = skv.OUTLIER_SCALE
            mu[h, i] = mu[h, i + d // 2] = (
                0.5 * skv.OUTLIER_SCALE * float(torch.randn(1, generator=g))
            )
    for c0 in range(0, t, skv.CHUNK):
        n = min(skv.CHUNK, t - c0)
        cos, sin = skv._chunk_rope(inv_freq(cfg), c0, n)

        def plain(x, cos=cos, sin=sin):
            return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

        gkv = torch.Generator().manual_seed(skv._chunk_seed(base, c0))
        z = torch.randn(b, 2 * hkv, skv.CHUNK, d, generator=gkv)[:, :, :n]
        gq = torch.Generator().manual_seed(skv._chunk_seed(base, c0) + 1)
        zq = torch.randn(b, hq, skv.CHUNK, d, generator=gq)[:, :, :n]
        sl = slice(c0, c0 + n)
        assert torch.equal(
            k[:, :, sl], plain(mu[None, :, None] + s_k[None, :, None] * z[:, :hkv]).half()
        )
        assert torch.equal(v[:, :, sl], (s_v[None, :, None] * z[:, hkv:]).half())
        assert torch.equal(q[:, :, sl], plain(zq).half())


# ----------------------------------------------------------------------------- suites
def _suite(workloads, methods=("full",), model=None):
    model = model or {"shape": "llama-3.1-8b", "dtype": "float16"}
    return parse_suite({"model": model, "methods": list(methods), "workloads": workloads})


@pytest.mark.parametrize("wl", ["perplexity", "fidelity", "gsm8k", "passkey"])
def test_accuracy_workload_refuses_shape_model(wl):
    with pytest.raises(ValueError, match="random weights: accuracy is meaningless"):
        _suite([{"type": wl}])


def test_runner_refuses_before_loading(monkeypatch, tmp_path):
    """A suite built without parse_suite's check still fails before any model loads."""
    import kvbench.bench.runner as runner

    suite = _suite([{"type": "memory", "context": 64}])
    suite.workloads.append({"type": "perplexity"})

    def no_load(*a, **k):
        raise AssertionError("model loaded")

    monkeypatch.setattr(runner, "_load_model", no_load)
    with pytest.raises(ValueError, match="random weights: accuracy is meaningless"):
        run_suite(suite, tmp_path, quiet=True)


def test_suite_shape_errors():
    with pytest.raises(ValueError, match=r"model.*unknown model shape 'nope'.*qwen3-8b"):
        _suite([{"type": "memory"}], model={"shape": "nope"})
    with pytest.raises(ValueError, match=r"layers=99 must be an integer in \[1, 36\]"):
        _suite([{"type": "memory"}], model={"shape": "qwen3-8b", "layers": 99})
    with pytest.raises(ValueError, match="unknown shape-model key"):
        _suite([{"type": "memory"}], model={"shape": "qwen3-8b", "id": "x"})


def test_memory_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(synthetic_kv, "available_bytes", lambda device="cpu": 1 << 30)
    cfg, info = shape_config("llama-3.1-8b")
    info = {**info, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    info["model_id"] = "shape:llama-3.1-8b"
    calls = []
    monkeypatch.setattr(synthetic_kv, "rope_outlier_qkv", lambda *a, **k: calls.append(a))
    with pytest.raises(MemoryError, match=r"batch 8 x context 32768.*needs about \d+\.\d+ GiB"):
        synthetic_kv.shape_inputs(cfg, info, 32768, 8, "all", torch.float16, "cpu", 0)
    assert calls == []


def _kivi2_bytes_per_head(d: int, appends: int, head_dim: int = 128) -> dict[str, int]:
    """KIVI-2 (K and V 2-bit, G = 128 per-channel keys, value groups of 64 channels per token,
    R = 128, fp16 scales and mins, no sinks) after the memory protocol: prefill d - appends
    tokens, then ``appends`` decode steps.  Keys: prefill quantizes p - p mod R tokens, the
    rest and the decode tokens wait in the residual (flushed R at a time); values keep exactly
    the newest R in fp16 and quantize the older ones token by token."""
    p, r, g, vg = d - appends, 128, 128, 64
    kq = p - p % r
    kres = d - kq
    assert kres < r  # no key flush during the appends (the test picks such d)
    vq = d - r
    return {
        "codes": kq * head_dim * 2 // 8 + vq * head_dim * 2 // 8,
        "scales": (kq // g) * head_dim * 2 * 2 + vq * (head_dim // vg) * 2 * 2,
        "residual": kres * head_dim * 2 + r * head_dim * 2,
    }


def test_memory_bytes_at_llama_shape_equal_hand_count(tmp_path):
    """One layer of the Llama-3.1-8B shape, batch 2 x 516 tokens (float16): full = 2 sides x
    B x 8 heads x T x 128 x 2 bytes per layer; KIVI-2 by category; ``bytes_total`` and every
    category are the whole cache: 32 layers x the one layer measured (``bytes_per_layer``)."""
    b, d, hkv = 2, 516, 8
    kivi2 = {"bits": 2, "value_bits": 2, "group_size": 128, "value_group_size": 64}
    kivi2 |= {"residual_length": 128, "scale_dtype": "float16"}
    suite = parse_suite(
        {
            "seed": 0,
            "model": {"shape": "llama-3.1-8b", "dtype": "float16"},
            "methods": ["full", {"name": "kivi", "config": kivi2}],
            "workloads": [{"type": "memory", "context": d, "batch": b, "appends": 4}],
        }
    )
    recs = {r.method: r for r in run_suite(suite, tmp_path, quiet=True)}
    full, kivi = recs["full"].metrics, recs["kivi"].metrics
    assert full["bytes_per_layer"] == 2 * b * hkv * d * 128 * 2
    assert full["bytes_total"] == 32 * 2 * b * hkv * d * 128 * 2
    assert full["effective_bits"] == 16
    hand = {k: n * b * hkv for k, n in _kivi2_bytes_per_head(d, 4).items()}
    for cat, n in hand.items():
        assert kivi[f"bytes_{cat}"] == 32 * n, cat
    assert kivi["bytes_metadata"] == kivi["bytes_sinks"] == 0
    assert kivi["bytes_per_layer"] == sum(hand.values())
    assert kivi["bytes_total"] == 32 * sum(hand.values())
    assert kivi["effective_bits"] == 8 * sum(hand.values()) / (2 * b * hkv * d * 128)
    for m in (full, kivi):  # the sides add up to the whole cache too
        assert m["bytes_key_total"] + m["bytes_value_total"] == m["bytes_total"]
        assert "bytes_total_all_layers" not in m
    man = recs["kivi"].manifest
    assert man["model"]["random_weights"] and man["model"]["shape"] == "llama-3.1-8b"
    assert man["layers_measured"] == [0] and "32 layers x" in man["bytes_total_is"]
    # the headline's 16-bit cache of the record (32 layers x 8 heads x 128 x B x T, K and V,
    # 2 bytes) is exactly full's float16 bytes
    from kvbench.report.headline import bytes_vs_16bit

    assert bytes_vs_16bit(recs["full"]) == 1.0
    assert man["model"]["materialized"] is False  # memory reads only the config: meta device
    # the arithmetic extrapolation to the paper's setting: 32 layers, batch 1, 32K, FP16
    assert 32 * 2 * 1 * hkv * 32768 * 128 * 2 == 4 * 2**30


def test_memory_peers_at_llama_shape_count_their_inner_storage(tmp_path):
    """transformers peers in the memory workload at the Llama-3.1-8B shape, batch 2 x 516
    tokens (512 prefill + 4 appends), bytes from the tensors inside their cache layers:
    ``hf-dynamic`` holds fp16 K/V (the full cache's count); ``hf-quanto`` 2-bit (when
    installed) quantizes the whole prompt in per-token groups of 64 elements (2-bit codes +
    fp16 scale and shift per group) and keeps the 4 appended tokens in fp16 (residual 128 not
    reached)."""
    import importlib.util

    b, d, hkv, p = 2, 516, 8, 512
    methods = ["hf-dynamic"]
    quanto = importlib.util.find_spec("optimum") is not None and (
        importlib.util.find_spec("optimum.quanto") is not None
    )
    if quanto:
        methods.append({"name": "hf-quanto", "config": {"nbits": 2}})
    suite = parse_suite(
        {
            "seed": 0,
            "model": {"shape": "llama-3.1-8b", "dtype": "float16"},
            "methods": methods,
            "workloads": [{"type": "memory", "context": d, "batch": b, "appends": 4}],
        }
    )
    recs = {r.method: r.metrics for r in run_suite(suite, tmp_path, quiet=True)}
    dyn = recs["hf-dynamic"]
    assert dyn["bytes_per_layer"] == 2 * b * hkv * d * 128 * 2
    assert dyn["bytes_total"] == dyn["bytes_residual"] == 32 * 2 * b * hkv * d * 128 * 2
    if quanto:
        q = recs["hf-quanto"]
        side = {
            "codes": b * hkv * p * 128 * 2 // 8,
            "scales": b * hkv * p * 128 // 64 * (2 + 2),
            "residual": b * hkv * (d - p) * 128 * 2,
        }
        for cat, n in side.items():
            assert q[f"bytes_{cat}"] == 32 * 2 * n, cat
        assert q["bytes_total"] == 32 * 2 * sum(side.values())


def test_latency_runs_a_materialized_shape_slice(tmp_path):
    """Latency runs a forward: the runner materializes the slice (seeded, on the target
    device); the record names the shape, the slice and the random weights."""
    suite = parse_suite(
        {
            "threads": 1,
            "model": {"shape": "smollm2-135m", "layers": 1},
            "methods": ["full"],
            "workloads": [{"type": "latency", "context": 24, "steps": 2, "warmup": 1}],
        }
    )
    (rec,) = run_suite(suite, tmp_path, quiet=True)
    m = rec.manifest["model"]
    assert rec.model["id"] == m["model_id"] == "shape:smollm2-135m[layers=1]"
    assert m["materialized"] and m["random_weights"] and m["shape_slice"] == "first 1 of 30 layers"
    assert rec.metrics["decode_ms_p50"] > 0


def test_memory_shapes_prints_pn_mix_table5_beside_the_cache_bytes(tmp_path):
    """The suite's paper block, run at a short context: PN-Mix Table 5's peaks (19.80 GB FP16,
    15.95 GB PN-Mix) beside kvbench's KV-cache bytes of the Qwen3-8B shape, the value setting
    compared named, and what the paper's peak holds that cache bytes do not."""
    import yaml

    from kvbench.integrations.paper import comparison_table

    raw = yaml.safe_load(open("suites/memory_shapes.yaml"))
    block, d = raw["paper"], 260
    for col in block["columns"]:
        if "where" in col:
            assert col["where"] == {"batch": None, "context": 32768}  # the paper's setting
            col["where"] = {"batch": None, "context": d}
    keep = {"full", "pn-mix", "kivi-2bit K+V"}
    methods = [m for m in raw["methods"] if (m if isinstance(m, str) else m.get("label")) in keep]
    suite = parse_suite(
        {
            "seed": 0,
            "model": {"shape": "qwen3-8b", "dtype": "float16"},
            "methods": methods,
            "workloads": [{"type": "memory", "context": d, "appends": 4, "dtype": "float16"}],
        }
    )
    recs = run_suite(suite, tmp_path, quiet=True)
    text = comparison_table(block, recs)
    rows = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    # FP16 cache by hand: 36 layers x K and V x 8 KV heads x d tokens x 128 x 2 bytes
    fp16_gb = 36 * 2 * 8 * d * 128 * 2 * 1e-9
    assert rows["FP16"] == f"| FP16 | 19.80 | {fp16_gb:.2f} | 16.00 |"
    assert rows["PN-Mix (1), b_V = 16"].startswith("| PN-Mix (1), b_V = 16 | 15.95 | ")
    assert rows["KIVI-2 (K and V 2-bit)"].startswith("| KIVI-2 (K and V 2-bit) |  | ")
    assert "Song & Yoo, PN-Mix, arXiv 2610.19605, Table 5" in text
    assert "A100-40GB" in text and "shape:qwen3-8b" in text
    note = " ".join(text.split())
    assert "FP16 values (b_V = 16)" in note  # the value setting compared
    for held in ("weights", "activations", "allocator"):  # what the peak has, bytes do not
        assert held in note
    by = {r.label: r.metrics for r in recs}
    # the row's method stores FP16 values (measured); the KIVI-2 row quantizes them
    assert by["pn-mix"]["effective_value_bits"] == 16.0
    assert by["pn-mix"]["effective_key_bits"] < 16.0
    assert by["kivi-2bit K+V"]["effective_value_bits"] < 16.0


@pytest.mark.parametrize("name", ["kivi", "semkv", "hf-dynamic"])
def test_memory_errors_at_batch_above_one_read_back_row_zero(name):
    """A shape model at batch 2: bytes and peak from both rows, ``key_mse``/``value_mse`` from
    batch row 0 (``errors_cover`` says so), equal to the float64 error of row 0 of a full
    read-back of the same replay (an independent cache fed the same tensors)."""

    import kvbench
    from kvbench.bench.workloads.memory import Memory, Replay

    model, _, info = build_shape_model("llama-3.1-8b", materialize=False)
    spec = {**Memory.PARAMS, "context": 260, "batch": 2, "appends": 4}
    Memory.check(spec, "")
    w = Memory(spec)
    w.prepare(RunContext(model=model, model_info=info, model_spec={}, seed=0))
    method = kvbench.get_method(name).for_model(info)
    res = w.run(None, method)
    assert res.info["errors_cover"].startswith("batch rows [0, 1) of 2")
    q, k, v = w.qkv[0]
    r = Replay(method, 0, 8, 128, torch.float16, torch.device("cpu"))
    r.prefill(k[:, :, :256], v[:, :, :256], w._prefill_queries(method, 0, q, 256, r))
    for t in range(256, 260):  # as the workload: the last two steps read, earlier ones store
        kt, vt, qt = k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t - 256 : t - 255]
        r.step(kt, vt, qt) if t >= 258 else r.store(kt, vt)
    assert sum(n for _, _, n in r.nbytes()) == res.metrics["bytes_per_layer"]  # both rows
    assert res.metrics["bytes_total"] == 32 * res.metrics["bytes_per_layer"]  # 32 layers
    kq, vq = r.read()
    assert kq.shape[0] == 2
    for ref, got, key in ((k, kq, "key_mse"), (v, vq, "value_mse")):
        err = ((ref[:1].double() - got[:1].double()) ** 2).mean().item()
        assert res.metrics[key] == pytest.approx(err, rel=1e-12), key


def test_memory_shapes_pm_kvq_budget_covers_the_suite_context():
    """pm-kvq's budget (budget_bits 2 named by default) holds the suite's context: a run of T
    tokens keeps 2 bits when budget_tokens >= T + (16/2 - 1)(R + N_s) (methods/pm_kvq.py;
    at the default budget_tokens = T = 32768 the layer overflows and raises MemoryError)."""
    import yaml

    import kvbench

    raw = yaml.safe_load(open("suites/memory_shapes.yaml"))
    (ctx,) = {w["context"] for w in raw["workloads"]}
    (pm,) = [m for m in raw["methods"] if isinstance(m, dict) and m["name"] == "pm-kvq"]
    c = kvbench.get_method("pm-kvq", **pm["config"]).config
    assert c.budget_tokens >= ctx + 7 * (c.residual_length + c.num_sink_tokens)
