"""The ``memory`` workload: bytes at rest against hand counts, effective vs nominal bits, the
transient peak of the decode path that runs, no full-precision copy of quantized tokens, bad input.

Hand counts follow the storage formats of kvbench.cache.blocks and the flush rules of docs/methods.md#kivi (KIVI)
and kvbench.cache.schedule: b-bit codes of D channels take ceil(D * b / 8) bytes per token and head;
every (scale, zero) pair takes 2 x 2 bytes (float16); residual and sinks are float16 tokens.
"""

from __future__ import annotations

import io
import json
import resource
import sys
from contextlib import redirect_stdout

import pytest
import torch

import kvbench
from kvbench.bench.context import RunContext
from kvbench.bench.synthetic_kv import channel_gaussian_qkv
from kvbench.bench.workloads.fidelity import Fidelity
from kvbench.bench.workloads.memory import Memory, Replay
from kvbench.cli import main as cli_main
from kvbench.measure.peak import transient_peak

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# tiny models gain nothing from intra-op threads (tests/conftest.py: one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _ctx(seed: int = 0):
    return RunContext(seed=seed, model_spec=None, model=None, model_info={})


def _workload(**params) -> Memory:
    w = Memory(Memory.validate({"type": "memory", "source": "synthetic", **params}))
    w.prepare(_ctx())
    return w


def _bytes(w: Memory, name: str, **cfg) -> dict[str, float]:
    return w.run(None, kvbench.get_method(name, **cfg)).metrics


# ------------------------------------------------------------------ shape 1
# one layer, B=1, H_kv=3, D=64, d=300 (296 prefill + 4 appends), float16
SHAPE1 = dict(context=300, appends=4, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64)
# KIVI keys (docs/methods.md#kivi): 296 -> 256 quantized + 40 residual; +4 -> 44 residual (< R, no flush)
K1 = 256 * 3 * 16 + 2 * 3 * 64 * 4 + 44 * 3 * 64 * 2  # codes + 2 pages of scales + residual
# sliding values: 296 -> 168 + 128; each append flushes one -> 172 quantized + 128 residual
V1_TOKEN = 172 * 3 * 16 + 172 * 3 * 1 * 4 + 128 * 3 * 64 * 2  # one 64-channel group per token
# per-tensor / per-head, 4 bits, blocks of R=128: 256 quantized in one flush + 44 residual
U1 = 256 * 3 * 32 + 44 * 3 * 64 * 2
CASES1 = [
    ("full", {}, 2 * 3 * 300 * 64 * 2),
    ("kivi", dict(bits=2, value_bits=2, value_group_size=64), K1 + V1_TOKEN),
    ("per-channel", dict(bits=2, value_bits=2), 2 * K1),
    ("per-token", dict(bits=2, value_bits=2), 2 * V1_TOKEN),
    ("uniform", dict(bits=4, value_bits=4), 2 * (U1 + 4)),  # one fp16 (scale, zero)
    ("per-head", dict(bits=4, value_bits=4), 2 * (U1 + 3 * 4)),  # one pair per head
]

# ------------------------------------------------------------------ shape 2
# two layers, B=1, H_kv=2, D=32, d=200 (196 prefill + 4 appends), float16, G = R = 64
SHAPE2 = dict(context=200, appends=4, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
# 4-bit keys: 196 -> 192 quantized (3 pages) + 4, +4 -> 8 residual
K2 = 192 * 2 * 16 + 3 * 2 * 32 * 4 + 8 * 2 * 32 * 2
# 2-bit values, groups of 16 channels: 196 -> 132 + 64, +4 -> 136 + 64
V2 = 136 * 2 * 8 + 136 * 2 * 2 * 4 + 64 * 2 * 32 * 2
# 3-bit codes of 32 channels: 12 bytes per token and head
PC2 = 192 * 2 * 12 + 3 * 2 * 32 * 4 + 8 * 2 * 32 * 2
PT2 = 136 * 2 * 12 + 136 * 2 * 2 * 4 + 64 * 2 * 32 * 2
U2 = 192 * 2 * 8 + 8 * 2 * 32 * 2  # 2 bits, one flush of 192 tokens
W2 = dict(group_size=64, residual_length=64)
CASES2 = [
    ("full", {}, 2 * 2 * 2 * 200 * 32 * 2),
    ("kivi", dict(bits=4, value_bits=2, value_group_size=16, **W2), 2 * (K2 + V2)),
    ("per-channel", dict(bits=3, value_bits=3, **W2), 2 * 2 * PC2),
    ("per-token", dict(bits=3, value_bits=3, value_group_size=16, **W2), 2 * 2 * PT2),
    ("uniform", dict(bits=2, value_bits=2, residual_length=64), 2 * 2 * (U2 + 4)),
    ("per-head", dict(bits=2, value_bits=2, residual_length=64), 2 * 2 * (U2 + 2 * 4)),
]


@pytest.fixture(scope="module")
def w1() -> Memory:
    return _workload(**SHAPE1)


@pytest.fixture(scope="module")
def w2() -> Memory:
    return _workload(**SHAPE2)


@pytest.mark.parametrize("name, cfg, expected", CASES1, ids=[c[0] for c in CASES1])
def test_bytes_hand_count_shape1(w1: Memory, name: str, cfg: dict, expected: int) -> None:
    m = _bytes(w1, name, **cfg)
    assert m["bytes_total"] == expected
    parts = ("codes", "scales", "metadata", "residual", "sinks")
    assert sum(m[f"bytes_{p}"] for p in parts) == expected
    assert m["effective_bits"] == pytest.approx(8 * expected / (2 * 3 * 300 * 64))


@pytest.mark.parametrize("name, cfg, expected", CASES2, ids=[c[0] for c in CASES2])
def test_bytes_hand_count_shape2(w2: Memory, name: str, cfg: dict, expected: int) -> None:
    assert _bytes(w2, name, **cfg)["bytes_total"] == expected


def test_kivi_breakdown_shape1(w1: Memory) -> None:
    m = _bytes(w1, "kivi", bits=2, value_bits=2, value_group_size=64)
    assert m["bytes_codes"] == 256 * 3 * 16 + 172 * 3 * 16
    assert m["bytes_scales"] == 2 * 3 * 64 * 4 + 172 * 3 * 4
    assert m["bytes_residual"] == (44 + 128) * 3 * 64 * 2
    assert m["bytes_metadata"] == m["bytes_sinks"] == 0
    assert m["bytes_key_total"] == K1 and m["bytes_value_total"] == V1_TOKEN


def _bits_cli(name: str, sets: list[str], head_dim: int, tokens: int) -> dict:
    args = ["bits", name, "--head-dim", str(head_dim), "--tokens", str(tokens), "--json"]
    for s in sets:
        args += ["--set", s]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(args) == 0
    return json.loads(buf.getvalue())


def test_kivi_8k_effective_vs_analytic_and_dynamic() -> None:
    """KIVI 2-bit K and V at 8K on head_dim 64 (G 128, value groups 64, R 128, fp16 scales):
    keys all quantized (8192 % 128 == 0): 2 + 32/128 = 2.25 bits; values 8064 quantized at
    2 + 32/64 = 2.5 bits + 128 fp16 residual tokens at 16 bits.  Analytic K+V average:
    (2.25 + (8064 * 2.5 + 128 * 16) / 8192) / 2 = 2.48047 bits; <= 0.16 x a 16-bit
    DynamicCache measured the same way."""
    w = _workload(context=8192, appends=4, num_layers=1, num_heads=3, num_kv_heads=1)
    cfg = dict(
        bits=2,
        value_bits=2,
        group_size=128,
        value_group_size=64,
        residual_length=128,
        scale_dtype="float16",
    )
    m = _bytes(w, "kivi", **cfg)
    sets = [f"{k}={v}" for k, v in cfg.items()]
    nominal = _bits_cli("kivi", sets, 64, 8192)
    assert nominal["key_bits"] == pytest.approx(2.25) and nominal["value_bits"] == 2.5
    analytic = (nominal["key_bits"] + (8064 * nominal["value_bits"] + 128 * 16) / 8192) / 2
    assert analytic == pytest.approx(2.48047, abs=1e-5)
    assert m["effective_bits"] == pytest.approx(analytic, rel=0.01)
    assert m["effective_key_bits"] == pytest.approx(2.25)  # formula and storage agree
    assert m["analytic_bits"] == pytest.approx(analytic)
    dyn = _bytes(w, "hf-dynamic")
    assert dyn["effective_bits"] == 16.0
    assert m["bytes_total"] <= 0.16 * dyn["bytes_total"]


def test_effective_equals_cli_bits_when_all_quantized() -> None:
    """Per-channel K and V with d a multiple of R: every token is quantized, no residual, so the
    measured bits equal ``kvbench bits`` exactly (8192 tokens, D 64: 2 + 32/128 = 2.25)."""
    w = _workload(context=1024, appends=4, num_layers=1, num_heads=3, num_kv_heads=1)
    m = _bytes(w, "per-channel", bits=2, value_bits=2)
    nominal = _bits_cli("per-channel", ["bits=2", "value_bits=2"], 64, 1024)
    assert m["effective_key_bits"] == pytest.approx(nominal["key_bits"]) == pytest.approx(2.25)
    assert m["effective_value_bits"] == pytest.approx(nominal["value_bits"])
    assert m["bytes_residual"] == 0


def test_sinks_are_counted_and_explained() -> None:
    """KIVI keys with 4 sinks, d = 260 (256 prefill + 4): the 4 sinks leave 252 tokens ->
    128 quantized + 124 residual, +4 -> 128 flushed: 256 quantized, 0 residual.  Analytic key
    bits = (256 * 2.25 + 4 * 16) / 260."""
    w = _workload(context=260, appends=4, num_layers=1, num_heads=3, num_kv_heads=1)
    m = _bytes(w, "kivi", bits=2, num_sink_tokens=4)
    assert m["bytes_sinks"] == 2 * 4 * 64 * 2  # keys and values (values fp16 entirely)
    assert m["analytic_key_bits"] == pytest.approx((256 * 2.25 + 4 * 16) / 260)
    assert m["effective_key_bits"] == pytest.approx(m["analytic_key_bits"])


def test_key_mse_is_the_replayed_error(w1: Memory) -> None:
    """key_mse against an independent float64 recomputation from the cache's own
    ``keys_values()`` and the replayed float16 keys (0 for the full cache)."""
    method = kvbench.get_method("per-channel", bits=2, value_bits=2)
    m = w1.run(None, method).metrics
    q, k, v = (x.to(torch.float16) for x in w1.qkv[0])
    r = Replay(method, 0, 3, 64, torch.float16, torch.device("cpu"))
    r.prefill(k[:, :, :296], v[:, :, :296], q[:, :, :296])
    for t in range(296, 300):
        r.step(k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
    kq, vq = r.read()
    ref = ((k.double() - kq.double()) ** 2).mean().item()
    assert m["key_mse"] == pytest.approx(ref, rel=1e-12)
    assert _bytes(w1, "full")["key_mse"] == 0.0


def test_transient_peak_counts_live_allocations() -> None:
    """A step that allocates 4 MB, then 8 MB while the first is alive, then frees the first:
    the peak is 12 MB (4e6 + 8e6 bytes of float32)."""
    x = torch.ones(1000, 1000)

    def step():
        y = x * 2
        z = torch.cat([y, y])
        del y
        return z

    peak, how = transient_peak(step, torch.device("cpu"))
    assert peak == 12_000_000 and "profiler" in how


def test_transient_peak_ignores_the_free_of_an_older_block_of_the_same_size() -> None:
    """A block allocated during an earlier profiling session (the profiler's allocator then
    knows its size) is freed inside the measured call between two 4 MB allocations of the
    same size: the call's own live bytes peak at 8 MB.  Pairing frees by size would match the
    older block's free with the call's first allocation and report 4 MB (the order-dependent
    half peak of the full cache's step, whose old K has a new K's size from an earlier test)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        older = [torch.ones(1000, 1000)]
    x = torch.ones(1000, 1000)

    def step():
        y = x + x
        older.clear()  # frees the older 4 MB block inside the call
        z = y + x
        return y, z

    peak, how = transient_peak(step, torch.device("cpu"))
    assert peak == 8_000_000 and "address" in how


def test_peak_step_of_full_copies_no_cache() -> None:
    """On the reference path the full cache's last step writes its token into the room its
    K and V grew at the first append (296 + 1 tokens -> room for 512,
    docs/design.md#memory) and reads them as stored: less than one token of K and V (3 * 64 *
    2 bytes each) is allocated, where a concatenation reallocated all 300 tokens of both."""
    w = _workload(**SHAPE1, path="reference")
    res = w.run(None, kvbench.get_method("full"))
    assert res.metrics["peak_step_bytes"] < 2 * 3 * 64 * 2
    assert res.info["peak_step_path"] == [
        "append + LayerCache.keys_values() (dequantized K/V for sdpa) + end_step"
    ]


@pytest.mark.parametrize("path, reads", [("attend", ["attend"]), ("reference", ["keys_values"])])
def test_peak_step_measures_the_path_that_runs(monkeypatch, path: str, reads: list) -> None:
    """The measured step reads the cache the way the chosen path does (by default
    ``LayerCache.attend``, what the model runs), once per step, and the record names it."""
    from kvbench.cache.layer import LayerCache

    seen: list[str] = []
    for name in ("attend", "keys_values"):
        orig = getattr(LayerCache, name)

        def spy(self, *a, orig=orig, name=name, **k):
            seen.append(name)
            return orig(self, *a, **k)

        monkeypatch.setattr(LayerCache, name, spy)
    w = _workload(**{**SHAPE1, "appends": 1}, path=path)
    seen.clear()
    res = w.run(None, kvbench.get_method("kivi", bits=2, value_bits=2))
    # one step, then the end-of-run read for the error metrics
    assert seen == reads + ["keys_values"]
    assert res.info["peak_step_path"][0].startswith(
        "append + LayerCache.attend(query)" if path == "attend" else "append + LayerCache.keys"
    )


def _builtin_layer_methods() -> list[str]:
    rows = kvbench.list_methods()
    out = []
    for r in rows:
        caps = r["capabilities"]
        if r["distribution"] == "kvbench" and caps.get("layer_cache", True) and r["error"] is None:
            if not caps.get("needs_calibration"):
                out.append(r["name"])
    return out


@pytest.mark.parametrize("name", _builtin_layer_methods())
def test_no_full_precision_copy(name: str) -> None:
    """After a replay of d = 300 tokens: every stored tensor owns its allocation (no view that
    keeps the prompt alive) but a residual or quantized block grown in place, whose allocation
    is its tokens and then the room ``spare_bytes()`` reports (docs/design.md#memory),
    full-precision tokens held (residual + sinks) plus quantized tokens equal the tokens held on
    each side (d; fewer for an evicting method), and no code tensor is a floating-point copy."""
    (q, k, v) = (x.to(torch.float16) for x in channel_gaussian_qkv(1, 6, 2, 300, 64, seed=3)[0])
    method = kvbench.get_method(name)
    r = Replay(method, 0, 2, 64, torch.float16, torch.device("cpu"))
    r.prefill(k[:, :, :296], v[:, :, :296], q[:, :, :296])
    for t in range(296, 300):
        r.step(k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
    lc = r.layer
    held = lc.seq_length
    assert lc.seen_tokens == 300 and (held == 300 or method.capabilities.evicts), (held, name)
    token_bytes = 2 * 64 * 2  # H_kv x D x float16
    quantized = dict(zip(("key", "value"), lc.quantized_tokens()))
    for side in ("key", "value"):
        fp = sum(
            t.numel() * t.element_size()
            for s, c, t in lc.tensors()
            if s == side and c in ("residual", "sinks")
        )
        assert fp % token_bytes == 0
        assert fp // token_bytes + quantized[side] == held, side
    spare = 0
    for _, cat, t in lc.tensors():
        extra = t.untyped_storage().nbytes() - t.numel() * t.element_size()
        assert extra == 0 or t.storage_offset() == 0, (name, cat)
        spare += extra
        if cat == "codes":
            assert t.dtype not in FLOAT_DTYPES, f"{name}: float codes {t.dtype}"
    assert spare == lc.spare_bytes(), name


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "params, match",
    [
        (
            {"context": 4, "appends": 4},
            r"field 'appends': 4 .*allowed: integers 1\.\.3 \(< context=4\)",
        ),
        ({"appends": 0}, "field 'appends': 0 is not allowed; allowed: integers >= 1"),
        ({"source": "disk"}, "allowed"),
        ({"dtype": "int8"}, "allowed"),
        (
            {"path": "fast"},
            "field 'path': 'fast' is not allowed; allowed: \\['attend', 'reference'\\]",
        ),
        ({"layers": 3}, "layers"),
        (
            {"source": "synthetic", "num_kv_heads": 0},
            "field 'num_kv_heads': 0 is not allowed; allowed: integers >= 1",
        ),
        ({"source": "synthetic", "num_heads": 8, "num_kv_heads": 3}, "multiple"),
        ({"contex": 5}, "unknown parameter"),
        (
            {"fill": "chunked"},
            r"field 'fill': 'chunked' is not allowed; allowed: \['steps', 'chunks'\]",
        ),
        (
            {"fill": "chunks", "context": 10, "chunk": 4},
            r"field 'prefill': None is not allowed; allowed: integers 1\.\.8 .*fill: chunks",
        ),
        (
            {"fill": "chunks", "context": 10, "prefill": 9, "chunk": 1},
            r"field 'prefill': 9 is not allowed; allowed: integers 1\.\.8",
        ),
        (
            {"fill": "chunks", "context": 10, "prefill": 5},
            r"field 'chunk': None is not allowed; allowed: integers 1\.\.5 ",
        ),
        (
            {"fill": "chunks", "context": 10, "prefill": 5, "chunk": 6},
            r"field 'chunk': 6 is not allowed; allowed: integers 1\.\.5 ",
        ),
        ({"fill": "chunks", "prefill": 5, "chunk": 0}, r"field 'chunk': 0 .*integers >= 1"),
        (
            {"fill": "chunks", "prefill": 5, "chunk": 4, "appends": 2},
            r"field 'appends': 2 is not allowed; allowed: unset with fill: chunks",
        ),
        ({"prefill": 5}, r"field 'prefill': 5 is not allowed; allowed: unset with fill: steps"),
        ({"chunk": 4}, r"field 'chunk': 4 is not allowed; allowed: unset with fill: steps"),
    ],
)
def test_bad_params(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Memory.validate({"type": "memory", **params})


@pytest.mark.parametrize("cls", [Memory, Fidelity])
def test_spec_keeps_only_what_its_source_reads(cls: type) -> None:
    """With ``source: model`` the drawn geometry leaves the spec (the model gives it), with
    ``source: synthetic`` the captured text does: neither the record, nor its run id, nor the
    asset pre-flight carries a setting the run does not read."""
    geometry = {"num_layers", "num_heads", "num_kv_heads", "head_dim"}
    model = cls.validate({"type": cls.type})
    assert model["source"] == "model" and not geometry & set(model)
    assert {"text", "window"} <= set(model)
    synth = cls.validate({"type": cls.type, "source": "synthetic", "head_dim": 32})
    assert geometry <= set(synth) and synth["head_dim"] == 32
    assert not {"text", "window"} & set(synth)
    with pytest.raises(ValueError, match=r"head_dim, num_heads apply only to source: synthetic"):
        cls.validate({"type": cls.type, "head_dim": 128, "num_heads": 32})
    with pytest.raises(ValueError, match=r"text apply only to source: model .*source: synthetic"):
        cls.validate({"type": cls.type, "source": "synthetic", "text": "essays"})


def test_context_beyond_model_maximum() -> None:
    w = Memory(Memory.validate({"type": "memory", "context": 9000}))
    ctx = RunContext(
        seed=0,
        model_spec={"device": "cpu"},
        model=object(),
        model_info={"max_position_embeddings": 8192, "model_id": "m"},
    )
    with pytest.raises(ValueError, match="exceeds the model's maximum context 8192"):
        w.prepare(ctx)


def test_model_source_without_model() -> None:
    w = Memory(Memory.validate({"type": "memory", "context": 64}))
    with pytest.raises(ValueError, match="source: synthetic"):
        w.prepare(_ctx())


_FAULTS = """
import resource, torch
from kvbench.measure.heap import heap_reuse

def faults_of_alloc():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(16 << 20)  # 64 MiB, touched
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

outside = [faults_of_alloc() for _ in range(8)]
with heap_reuse() as applied:
    inside = [faults_of_alloc() for _ in range(24)]
print(applied, " ".join(map(str, outside)), " ".join(map(str, inside)), sep=";")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_heap_reuse_serves_a_freed_large_block_without_new_page_faults() -> None:
    """Outside ``heap_reuse`` a 64 MiB tensor is a fresh mmap each time (~16K page faults on
    first touch, every time); inside, once the heap has grown to hold it, later ones reuse the
    freed heap pages (almost no faults).  How many allocations grow the heap first depends on the
    process's earlier small allocations (its environment and path lengths: 1 to 5 of them seen in
    fresh processes, and once in a long run a late one); so of 24 allocations inside, at most
    half may fault, against all 8 outside.  In a fresh process: a long-lived one's heap may hold
    trimmed (unbacked) free chunks."""
    import subprocess

    got = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    applied, outside, inside = got.stdout.strip().split(";")
    pages = (64 << 20) // resource.getpagesize()
    faulted_outside = [int(f) > pages // 2 for f in outside.split()]
    faulted_inside = [int(f) > pages // 10 for f in inside.split()]
    assert applied == "True"
    assert all(faulted_outside), outside  # default: mapped and faulted in again
    assert sum(faulted_inside) <= len(faulted_inside) // 2, inside  # the freed block is reused


def test_heap_reuse_changes_no_metric(monkeypatch) -> None:
    """The memory workload's bytes, bits, peak and errors with and without ``heap_reuse``."""
    from contextlib import nullcontext

    import kvbench.measure.heap as heap

    w = _workload(context=300, appends=4, num_layers=2, num_heads=3, num_kv_heads=1)
    for name in ("kivi", "full", "semkv"):
        res = w.run(None, kvbench.get_method(name))
        assert res.info["allocator"].startswith("glibc heap reuse")
        monkeypatch.setattr(heap, "heap_reuse", lambda: nullcontext(False))
        plain = w.run(None, kvbench.get_method(name))
        monkeypatch.undo()
        assert plain.info["allocator"] == "default"
        assert plain.metrics == res.metrics, name


@pytest.mark.parametrize(
    "env, first, want",
    [({}, "kvbench", "6"), ({"KINETO_LOG_LEVEL": "3"}, "kvbench", "3"), ({}, "torch", None)],
)
def test_kineto_level_set_only_when_unset_and_before_torch(env, first, want) -> None:
    """Imported before torch, kvbench silences kineto's per-profile USDT lines (level 6) unless
    the user chose a level; imported after torch it cannot (kineto has read it) and sets none.
    A profiled run then prints no ``USDT`` line."""
    import os
    import subprocess

    code = (
        f"import {first}, kvbench, os, torch\n"
        "from torch.profiler import profile, ProfilerActivity\n"
        "with profile(activities=[ProfilerActivity.CPU], profile_memory=True):\n"
        "    torch.ones(8)\n"
        "print(os.environ.get('KINETO_LOG_LEVEL'))\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(want)
    if want == "6":
        assert "USDT" not in out.stderr


# ------------------------------------------------------------------ fill: chunks


def test_fill_spec_keeps_run_ids() -> None:
    """``fill: steps`` (the default) leaves the spec as before the option (run ids of earlier
    records kept); ``fill: chunks`` carries prefill and chunk, not ``appends``."""
    steps = Memory.validate({"type": "memory", "context": 64})
    assert not {"fill", "prefill", "chunk"} & set(steps) and steps["appends"] == 4
    assert Memory.validate({"type": "memory", "context": 64, "fill": "steps"}) == steps
    chunks = Memory.validate(
        {"type": "memory", "context": 64, "fill": "chunks", "prefill": 32, "chunk": 8}
    )
    assert (chunks["fill"], chunks["prefill"], chunks["chunk"]) == ("chunks", 32, 8)
    assert "appends" not in chunks


QUANTO = dict(nbits=2, q_group_size=16, residual_length=8)


def _quanto_fills(prefill: int, chunk: int, tokens: int) -> tuple[int, int, int]:
    """hf-quanto's bytes at rest after the perplexity workload's fill of a toy Llama (its own
    cache: :func:`chunked_logits`, bytes by :func:`cache_nbytes`), after the memory workload's
    ``fill: chunks`` of the same K/V (captured once from the same ids) and after its ``fill:
    steps``: the two caches hold ``tokens - 1`` tokens."""
    pytest.importorskip("optimum.quanto")
    from kvbench.bench.workloads.perplexity import chunked_logits
    from kvbench.hf.cache import EXACT_CHUNKED
    from kvbench.hf.capture import capture_qkv
    from tests.tiny_lm import toy_llama

    model = toy_llama(max_positions=256)
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(5))
    _, states = chunked_logits(
        model, ids, kvbench.get_method("hf-quanto", **QUANTO), prefill, chunk,
        path="reference", protocol=EXACT_CHUNKED,
    )  # fmt: skip
    captured = capture_qkv(model, ids[:, : tokens - 1])
    geo = dict(source="synthetic", context=tokens - 1, num_layers=2, num_heads=4)
    got = []
    for fill in ({"fill": "chunks", "prefill": prefill, "chunk": chunk}, {"appends": 4}):
        w = _workload(**geo, num_kv_heads=2, head_dim=16, dtype="float32", **fill)
        w.qkv = list(zip(captured.queries, captured.keys, captured.values))
        w.layer_ids = list(captured.layer_ids)
        got.append(w.run(None, kvbench.get_method("hf-quanto", **QUANTO)).metrics)
    assert got[0]["bytes_total"] == got[0]["bytes_key_total"] + got[0]["bytes_value_total"]
    return states[-1].nbytes["total"], int(got[0]["bytes_total"]), int(got[1]["bytes_total"])


@pytest.mark.parametrize("prefill, chunk, tokens", [(40, 6, 100), (33, 5, 71), (20, 1, 50)])
def test_quanto_chunks_fill_holds_the_perplexity_cache(prefill: int, chunk: int, tokens: int):
    """transformers' quanto cache re-quantizes everything when its residual reaches
    ``residual_length``, so what it holds depends on how the tokens arrived: the memory
    workload's ``fill: chunks`` measures the bytes that the perplexity workload's cache held
    after the same fill, counted apart (the transformers cache of a model run vs the replay
    of captured K/V).  ``fill: steps`` (prefill d - 4, then 4 steps) holds another residual
    where the chunks leave one that ``residual_length`` does not divide."""
    ppl, chunks, steps = _quanto_fills(prefill, chunk, tokens)
    assert chunks == ppl
    if chunk > 1:
        assert steps != ppl


def test_chunks_fill_of_a_sliding_window_equals_one_token_steps() -> None:
    """A kvbench cache takes each chunk in exact-chunked calls (a sliding value window keeps
    its chunk, with views): the bytes and errors equal those of one token per call."""
    geo = dict(context=300, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64)
    one = _workload(**geo, fill="chunks", prefill=100, chunk=1)
    many = _workload(**geo, fill="chunks", prefill=100, chunk=16)
    for name, cfg in (("kivi", dict(bits=2, value_bits=2)), ("per-head", dict(bits=4))):
        a, b = (w.run(None, kvbench.get_method(name, **cfg)) for w in (one, many))
        assert a.metrics == b.metrics, name
        assert b.info["fill"].startswith("the perplexity workload's fill")
        assert b.info["peak_step_tokens"] == 1 and b.info["prefill_tokens"] == 100
