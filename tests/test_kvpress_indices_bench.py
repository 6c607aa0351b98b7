"""benchmarks/kvpress_indices.py: the kept-indices reader and comparer on hand-made index sets
(Jaccard indices counted by hand), its refusals, the refusal to run without kvpress, and (only
where kvpress imports) that the recorded indices are those the press gathered."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    name = "benchmarks_kvpress_indices"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks/kvpress_indices.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _file(runs: list[dict], prompts: list[dict] | None = None) -> dict:
    return {
        "format": _bench().FORMAT,
        "prompts": prompts if prompts is not None else [{"id": "p0", "tokens_sha256": "aa"}],
        "runs": runs,
    }


# kvpress's snapkv at ratio 0.5 on prompt p0: 2 layers x 2 KV heads of 4 kept tokens (of 8)
REF_KEPT = [[[0, 1, 2, 3], [0, 1, 2, 3]], [[0, 1, 6, 7], [4, 5, 6, 7]]]
# a kvbench evictor: L0H0 equal; L0H1 shares 3 of 5 (J = 3/5); L1H0 disjoint (J = 0);
# L1H1 equal, listed in another order
CAND_KEPT = [[[0, 1, 2, 3], [0, 1, 2, 5]], [[2, 3, 4, 5], [7, 6, 5, 4]]]


def test_jaccard_by_hand() -> None:
    j = _bench().jaccard
    assert j([1, 2, 3], [1, 2, 3]) == 1.0
    assert j([1, 2, 3], [2, 3, 4]) == 2 / 4  # {2, 3} of {1, 2, 3, 4}
    assert j([0, 1], [2, 3]) == 0.0
    assert j([], []) == 1.0
    assert j([5], []) == 0.0


def test_compare_equal_partial_disjoint() -> None:
    b = _bench()
    ref = _file([{"press": "snapkv", "compression_ratio": 0.5, "prompt": "p0", "kept": REF_KEPT}])
    cand = _file([{"method": "snapkv", "keep_ratio": 0.5, "prompt": "p0", "kept": CAND_KEPT}])
    (row,) = b.compare(ref, cand)
    assert row["press"] == "snapkv" and row["compression_ratio"] == 0.5
    assert row["prompts"] == 1 and row["sets"] == 4 and row["missing"] == 0
    assert row["equal"] == 2 / 4
    assert row["mean_jaccard"] == pytest.approx((1 + 3 / 5 + 0 + 1) / 4)
    assert row["min_jaccard"] == 0.0
    # against itself: every set equal
    (same,) = b.compare(ref, ref)
    assert same["equal"] == 1.0 and same["mean_jaccard"] == 1.0 and same["min_jaccard"] == 1.0


def test_compare_maps_kvbench_names_and_counts_missing() -> None:
    b = _bench()
    ref = _file(
        [
            {
                "press": "observed_attention",
                "compression_ratio": 0.25,
                "prompt": "p0",
                "kept": REF_KEPT,
            },
            {
                "press": "observed_attention",
                "compression_ratio": 0.75,
                "prompt": "p0",
                "kept": REF_KEPT,
            },
        ]
    )
    # h2o keeping 75% is observed attention removing 25% (1 - 0.75 is not exact in binary)
    cand = _file([{"method": "h2o", "keep_ratio": 0.75, "prompt": "p0", "kept": REF_KEPT}])
    rows = b.compare(ref, cand)
    assert [(r["compression_ratio"], r["sets"], r["missing"]) for r in rows] == [
        (0.25, 4, 0),
        (0.75, 0, 1),
    ]
    assert rows[0]["equal"] == 1.0
    assert rows[1]["equal"] is None and rows[1]["mean_jaccard"] is None
    assert "| observed_attention | 0.75 | 0 | 0 | - | - | - | 1 |" in b.markdown(rows)


@pytest.mark.parametrize(
    ("cand", "prompts", "match"),
    [
        (
            {"method": "snapkv", "keep_ratio": 0.5, "prompt": "p0", "kept": REF_KEPT[:1]},
            None,
            "heads per layer",
        ),
        (
            {"method": "snapkv", "keep_ratio": 0.5, "prompt": "p0", "kept": REF_KEPT},
            [{"id": "p0", "tokens_sha256": "bb"}],
            "tokens_sha256",
        ),
        (
            {"method": "quest", "keep_ratio": 0.5, "prompt": "p0", "kept": REF_KEPT},
            None,
            "no kvpress press",
        ),
        ({"method": "snapkv", "prompt": "p0", "kept": REF_KEPT}, None, "keep_ratio"),
    ],
)
def test_compare_refuses(cand: dict, prompts: list | None, match: str) -> None:
    b = _bench()
    ref = _file([{"press": "snapkv", "compression_ratio": 0.5, "prompt": "p0", "kept": REF_KEPT}])
    with pytest.raises(ValueError, match=match):
        b.compare(ref, _file([cand], prompts))


def test_compare_refuses_duplicate_runs() -> None:
    b = _bench()
    run = {"press": "knorm", "compression_ratio": 0.5, "prompt": "p0", "kept": REF_KEPT}
    with pytest.raises(ValueError, match="twice"):
        b.compare(_file([run, dict(run)]), _file([]))


def test_load_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = _bench()
    ref, cand, bad = tmp_path / "ref.json", tmp_path / "cand.json", tmp_path / "bad.json"
    ref.write_text(
        json.dumps(
            _file([{"press": "tova", "compression_ratio": 0.5, "prompt": "p0", "kept": REF_KEPT}])
        )
    )
    cand.write_text(
        json.dumps(
            _file([{"method": "tova", "keep_ratio": 0.5, "prompt": "p0", "kept": CAND_KEPT}])
        )
    )
    bad.write_text(json.dumps({"format": "other", "runs": []}))
    assert b.main(["compare", str(ref), str(cand)]) == 0
    assert "| tova | 0.5 | 1 | 4 | 0.5000 | 0.6500 | 0.0000 | 0 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="format 'other'"):
        b.load(bad)


def test_run_refuses_without_kvpress(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress -> ImportError
    with pytest.raises(ImportError, match="docs/results/kvpress-crosscheck.md"):
        _bench().run(tmp_path / "out")


def test_record_gives_the_gathered_indices() -> None:
    """kvpress's KnormPress through the recorder on random keys: the recorded indices are the
    lowest-norm half of each head's tokens, and the press's output is unchanged."""
    kvpress = pytest.importorskip("kvpress")
    torch = pytest.importorskip("torch")

    class Module(torch.nn.Module):
        layer_idx, head_dim = 1, 8

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 10, 8, generator=g)
    values = torch.randn(1, 2, 10, 8, generator=g)
    press = kvpress.KnormPress(compression_ratio=0.5)
    got = _bench()._record(press, layers=2)
    k_out, v_out = press.compress(Module(), None, keys, values, None, {})
    want = [sorted(keys[0, h].norm(dim=-1).argsort()[:5].tolist()) for h in range(2)]
    assert got["kept"][1] == want and got["kept"][0] is None
    assert k_out.shape == (1, 2, 5, 8)
    for h in range(2):
        assert torch.equal(k_out[0, h].sort(dim=0).values, keys[0, h, want[h]].sort(dim=0).values)
    assert got["scores"][1].shape == (2, 10)


# ---------------------------------------------------------------- kvbench's evictors


def _toy_prompt(t: int = 96):
    import hashlib

    import torch

    ids = torch.randint(0, 96, (1, t), generator=torch.Generator().manual_seed(3))
    sha = hashlib.sha256(ids[0].numpy().tobytes()).hexdigest()
    return {"id": "toy-0", "text": "essays", "length": t, "start": 0, "tokens_sha256": sha}, ids


def test_kvbench_file_reads_back_through_compare(tmp_path: Path) -> None:
    """Every evictor's kept indices on a tiny Llama, written in the kept-indices format, read by
    ``load`` and ``compare``: against a kvpress-named copy of themselves every set is equal;
    a changed set and a differing prompt hash are seen."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_lm import toy_llama

    b = _bench()
    prompt, ids = _toy_prompt()
    wanted = [(press, r) for press in b.KVBENCH_METHODS for r in (0.25, 0.75)]
    out = tmp_path / "kvbench_kept"
    b.kvbench_file(toy_llama(), [prompt], {"toy-0": ids}, wanted, out, "toy")
    cand = b.load(f"{out}.json")
    assert cand["source"] == "kvbench" and (tmp_path / "kvbench_kept.npz").is_file()
    assert len(cand["runs"]) == len(wanted)
    for run in cand["runs"]:
        assert len(run["kept"]) == 2 and all(len(h) == run["n_kept"] for h in run["kept"][0][:1])
        assert run["n_kept"] == int(96 * run["keep_ratio"])
    ref = json.loads(json.dumps(cand))
    for run in ref["runs"]:
        run["press"], run["compression_ratio"] = b.run_id(run)[:2]
        del run["method"], run["keep_ratio"]
    rows = b.compare(ref, cand)
    assert [(r["press"], r["compression_ratio"]) for r in rows] == sorted(wanted)
    assert all(r["equal"] == 1.0 and r["min_jaccard"] == 1.0 and r["missing"] == 0 for r in rows)
    # streamingllm keeps the 4 sinks and the newest tokens, the same in every head
    stream = next(
        r for r in cand["runs"] if r["method"] == "streamingllm" and r["keep_ratio"] == 0.25
    )
    assert stream["kept"][0][0] == [0, 1, 2, 3] + list(range(96 - 20, 96))
    ref["runs"][0]["kept"][0][0] = list(range(len(ref["runs"][0]["kept"][0][0])))
    ref["prompts"][0]["tokens_sha256"] = "00"
    with pytest.raises(ValueError, match="tokens_sha256"):
        b.compare(ref, cand)


def test_kvbench_knorm_keeps_what_float64_norms_keep() -> None:
    """knorm's kept indices equal the ``int(T * keep_ratio)`` smallest float64 L2 norms of the
    keys the model's own prefill stores in a transformers ``DynamicCache``."""
    import torch
    from transformers import DynamicCache

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_lm import toy_llama

    from kvbench.hf.cache import cache_kwarg
    from kvbench.hf.capture import capture_prompt

    b = _bench()
    model = toy_llama()
    _, ids = _toy_prompt(80)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_kwarg(ref, model), use_cache=True)
    captured = capture_prompt(model, ids).captured
    for keep_ratio in (0.25, 0.5, 0.75):
        kept, scores = b.evictor_kept(model, captured, "knorm", {"keep_ratio": keep_ratio})
        n = int(80 * keep_ratio)
        for layer in range(2):
            keys = ref.layers[layer].keys[0].double()  # [H_kv, T, D]
            norms = keys.pow(2).sum(-1).sqrt()
            want = torch.topk(-norms, n, dim=-1).indices.sort(-1).values.tolist()
            assert kept[layer] == want, (keep_ratio, layer)
            assert torch.allclose(scores[layer].double(), -norms, rtol=1e-6)


def test_kvbench_refuses_other_tokens() -> None:
    b = _bench()

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(5000))}

    ref = {"prompts": [{"id": "essays-64-0", "text": "essays", "length": 64, "start": 0,
                        "tokens_sha256": "00"}]}  # fmt: skip
    with pytest.raises(ValueError, match="other tokens"):
        b.reference_prompts(ref, Tok())
