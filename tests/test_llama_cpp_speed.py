"""benchmarks/llama_cpp_speed.py: parsing llama.cpp's own outputs and pairing its rounds, on
hand-made outputs whose ratios are worked by hand (no llama.cpp binary needed)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "llama_cpp_speed", ROOT / "benchmarks/llama_cpp_speed.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_json(rows):
    """llama-bench ``-o json`` output: a list of test objects (only the fields the tool reads,
    plus one it does not)."""
    return json.dumps(
        [
            {
                "build_commit": "0c1e570",
                "n_threads": t,
                "n_depth": d,
                "type_k": k,
                "type_v": k,
                "n_gen": 64,
                "avg_ns": int(64e9 / ts),
                "avg_ts": ts,
            }  # fmt: skip
            for t, d, k, ts in rows
        ]
    )


def test_parse_bench_reads_tokens_per_second() -> None:
    T = _tool()
    out = T.parse_bench("build: 0c1e570\n" + _bench_json([(1, 4096, "q4_0", 80.0)]))
    assert out == [
        {
            "threads": 1,
            "depth": 4096,
            "type_k": "q4_0",
            "type_v": "q4_0",
            "n_gen": 64,
            "rep": 0,
            "tg_ts": 80.0,
            "ns": 800000000,
        }  # fmt: skip
    ]
    with pytest.raises(ValueError, match="no JSON list"):
        T.parse_bench("error: failed to load model")


def test_parse_bench_gives_one_sample_per_repetition() -> None:
    T = _tool()
    obj = {"n_threads": 2, "n_depth": 8, "type_k": "f16", "type_v": "f16", "n_gen": 64,
           "avg_ns": 600, "avg_ts": 15.0, "samples_ns": [400, 800], "samples_ts": [20.0, 10.0]}  # fmt: skip
    out = T.parse_bench(json.dumps([obj]))
    assert [(s["rep"], s["tg_ts"], s["ns"]) for s in out] == [(0, 20.0, 400), (1, 10.0, 800)]
    with pytest.raises(ValueError, match="samples_ts"):
        T.parse_bench(json.dumps([obj | {"samples_ns": [400]}]))


FAKE_BENCH = """#!{python}
import json, sys
a = sys.argv
ctype, reps = a[a.index("-ctk") + 1], int(a[a.index("-r") + 1])
log = {log!r}
with open(log, "a") as f:
    f.write(ctype + "\\n")
n = sum(1 for _ in open(log))  # calls so far: call n's repetition i runs at 10 * n + i t/s
ts = [10.0 * n + i for i in range(reps)]
print(json.dumps([{{"n_threads": 1, "n_depth": 8, "type_k": ctype, "type_v": ctype, "n_gen": 4,
                   "avg_ns": 1, "avg_ts": 1.0, "samples_ns": [1] * reps, "samples_ts": ts}}]))
"""


def test_main_numbers_rounds_by_round_and_repetition(tmp_path: Path) -> None:
    """Round r's call of a type gives ``--reps`` samples numbered r * reps + i, so each
    repetition pairs with the same repetition of f16's call of that round; the types rotate
    which goes first each round."""
    import sys

    T = _tool()
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_BENCH.format(python=sys.executable, log=str(tmp_path / "calls")))
    fake.chmod(0o755)
    out = tmp_path / "speed"
    T.main(["--bench", str(fake), "--model", "m.gguf", "--depths", "8", "--threads", "1",
            "--rounds", "2", "--reps", "2", "--out", str(out)])  # fmt: skip
    assert (tmp_path / "calls").read_text().split() == [
        "f16", "q8_0", "q4_0", "q8_0", "q4_0", "f16"]  # fmt: skip
    doc = json.loads(out.with_suffix(".json").read_text())
    got = {(s["type_k"], s["round"]): s["tg_ts"] for s in doc["samples"]}
    assert got == {
        ("f16", 0): 10.0, ("f16", 1): 11.0, ("q8_0", 0): 20.0, ("q8_0", 1): 21.0,
        ("q4_0", 0): 30.0, ("q4_0", 1): 31.0, ("q8_0", 2): 40.0, ("q8_0", 3): 41.0,
        ("q4_0", 2): 50.0, ("q4_0", 3): 51.0, ("f16", 2): 60.0, ("f16", 3): 61.0,
    }  # fmt: skip
    assert (
        "-r" in doc["commands"][0] and doc["commands"][0][doc["commands"][0].index("-r") + 1] == "2"
    )

    # tabulating that run again beside kvbench's decode_step output runs no llama.cpp: the
    # samples are the earlier run's, and kvbench's q4_0 row pairs its two rounds (2 ms over 1 ms)
    calls = (tmp_path / "calls").read_text()
    step = {"env": {"threads": 1}, "contexts": [8], "rows": [
        {"context": 8, "config": "full-fp16", "step_ms": [1.0, 1.0], "median_ms": 1.0},
        {"context": 8, "config": "int4-block-llama", "step_ms": [2.0, 2.0], "median_ms": 2.0}]}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(step))
    T.main(["--samples-from", str(out.with_suffix(".json")), "--kvbench", str(tmp_path / "ds.json"),
            "--out", str(tmp_path / "again")])  # fmt: skip
    again = json.loads((tmp_path / "again.json").read_text())
    assert (tmp_path / "calls").read_text() == calls
    assert again["samples"] == doc["samples"] and again["env"] == doc["env"]
    assert again["kvbench_ratios"][json.dumps([8, 1, "q4_0"])]["ratio"] == pytest.approx(2.0)
    assert again["llama_ratios"] == doc["llama_ratios"]
    with pytest.raises(SystemExit):
        T.main(["--samples-from", str(out.with_suffix(".json")), "--bench", str(fake),
                "--out", str(tmp_path / "x")])  # fmt: skip


def test_llama_ratios_pair_rounds_by_hand() -> None:
    T = _tool()
    samples = []
    # f16 at 100, 50, 100 t/s -> 10, 20, 10 ms; q4_0 at half the speed in each round -> ratio 2
    # exactly in every resample; q8_0: 10/12.5 -> medians 12.5 ms and 10 ms over the 3 rounds
    for rnd, (f16, q4, q8) in enumerate(
        [(100.0, 50.0, 80.0), (50.0, 25.0, 40.0), (100.0, 50.0, 80.0)]
    ):
        for ctype, ts in (("f16", f16), ("q4_0", q4), ("q8_0", q8)):
            samples.append(
                {"depth": 1024, "threads": 1, "type_k": ctype, "tg_ts": ts, "round": rnd}
            )
    r = T.llama_ratios(samples)
    q4 = r[(1024, 1, "q4_0")]
    assert q4["ratio"] == pytest.approx(2.0)
    assert (q4["ci_low"], q4["ci_high"]) == (pytest.approx(2.0), pytest.approx(2.0))
    assert q4["ms"] == pytest.approx(20.0) and q4["base_ms"] == pytest.approx(10.0)
    assert r[(1024, 1, "q8_0")]["ratio"] == pytest.approx(12.5 / 10.0)
    assert (1024, 1, "f16") not in r


def test_llama_ratios_keep_only_rounds_both_sides_ran() -> None:
    T = _tool()
    samples = [
        {"depth": 8, "threads": 2, "type_k": "f16", "tg_ts": 100.0, "round": 0},
        {"depth": 8, "threads": 2, "type_k": "q4_0", "tg_ts": 50.0, "round": 0},
        {"depth": 8, "threads": 2, "type_k": "q4_0", "tg_ts": 10.0, "round": 1},  # f16 missing
    ]
    r = T.llama_ratios(samples)[(8, 2, "q4_0")]
    assert r["rounds"] == 1 and r["ratio"] == pytest.approx(2.0)
    assert r["ci_low"] is None  # one round has no interval


def test_ratio_row_refuses_unpaired_rounds() -> None:
    with pytest.raises(ValueError, match="unpaired"):
        _tool().ratio_row([1.0, 2.0], [1.0])


OPS = """\
Testing 1 devices

Backend 1/1: CPU
  FLASH_ATTN_EXT(hsk=64,hsv=64,nh=8,nr23=[8,1],kv=7680,nb=1,mask=1,sinks=0,max_bias=0.000000,logit_softcap=0.000000,prec=f32,type_K=f16,type_V=f16,permute=[0,1,2,3],kv_view=0,v_is_view_of_k=0,n_kv_max=0):          4096 runs -    50.00 us/run -  63.00 MFLOP/run -   1.26 TFLOPS
  FLASH_ATTN_EXT(hsk=64,hsv=64,nh=8,nr23=[8,1],kv=7680,nb=1,mask=1,sinks=0,max_bias=0.000000,logit_softcap=0.000000,prec=f32,type_K=q4_0,type_V=q4_0,permute=[0,1,2,3],kv_view=0,v_is_view_of_k=0,n_kv_max=0):        2048 runs -   140.00 us/run -  63.00 MFLOP/run -   0.45 TFLOPS
  FLASH_ATTN_EXT(hsk=64,hsv=64,nh=8,nr23=[8,1],kv=7680,nb=512,mask=1,sinks=0,max_bias=0.000000,logit_softcap=0.000000,prec=f32,type_K=q8_0,type_V=q8_0,permute=[0,1,2,3],kv_view=0,v_is_view_of_k=0,n_kv_max=0):       64 runs -  9000.00 us/run - 1.0 GFLOP/run - 0.1 TFLOPS
  FLASH_ATTN_EXT(hsk=64,hsv=64,nh=8,nr23=[8,1],kv=7680,nb=1,mask=1,sinks=0,max_bias=0.000000,logit_softcap=0.000000,prec=f32,type_K=q8_0,type_V=q8_0,permute=[0,1,2,3],kv_view=0,v_is_view_of_k=0,n_kv_max=0):   not supported
  Backend CPU: OK
"""  # noqa: E501


def test_backend_ops_rows_pair_with_f16_by_shape() -> None:
    T = _tool()
    rows = T.parse_backend_ops(OPS)
    assert [(r["params"]["type_K"], r["params"]["nb"], r["us"]) for r in rows] == [
        ("f16", "1", 50.0),
        ("q4_0", "1", 140.0),
        ("q8_0", "512", 9000.0),
    ]
    assert rows[0]["params"]["nr23"] == "[8,1]" and rows[0]["params"]["permute"] == "[0,1,2,3]"
    ratios = T.op_ratios(rows)
    # the q8_0 row's shape (nb=512) has no f16 partner; q4_0's is 140 / 50
    assert [(r["type"], r["ratio"]) for r in ratios] == [("q4_0", pytest.approx(2.8))]
    assert "kv=7680" in ratios[0]["shape"] and "nb=1" in ratios[0]["shape"]


def _step_doc(threads, rows):
    return {
        "env": {"threads": threads},
        "contexts": sorted({r[0] for r in rows}),
        "rows": [
            {"context": c, "config": cfg, "step_ms": ms, "median_ms": sorted(ms)[len(ms) // 2]}
            for c, cfg, ms in rows
        ],
    }


def test_kvbench_ratios_use_full_fp16_as_the_16bit_row() -> None:
    T = _tool()
    doc = _step_doc(
        1,
        [
            (4096, "full-fp16", [10.0, 12.0, 10.0]),
            (4096, "full", [5.0, 5.0, 5.0]),  # not the baseline
            (4096, "int4-block-llama", [9.0, 10.8, 9.0]),
            (4096, "int8-block-llama", [11.0, 13.2, 11.0]),
        ],
    )
    r = T.kvbench_ratios(doc)
    assert r[(4096, 1, "q4_0")]["ratio"] == pytest.approx(0.9)
    assert r[(4096, 1, "q8_0")]["ratio"] == pytest.approx(1.1)
    assert r[(4096, 1, "q4_0")]["ci_low"] == pytest.approx(0.9)


def test_markdown_verdict_compares_kvbench_to_llama() -> None:
    T = _tool()
    key = json.dumps([4096, 1, "q4_0"])
    row = {"ci_low": None, "ci_high": None, "rounds": 1, "ms": 2.0, "base_ms": 1.0}
    doc = {
        "llama_ratios": {
            key: row | {"ratio": 1.4},
            json.dumps([4096, 1, "q8_0"]): row | {"ratio": 1.0},
        },
        "kvbench_ratios": {
            key: row | {"ratio": 0.9},
            json.dumps([4096, 1, "q8_0"]): row | {"ratio": 1.2},
        },
        "op_ratios": [],
    }
    md = T.markdown(doc)
    line = next(x for x in md.splitlines() if x.startswith("| 4096 | 1 |"))
    assert "q8_0 no" in line and "q4_0 yes" in line
    assert "| 1.40 |" in line and "| 0.90 |" in line


@pytest.mark.parametrize(
    ("kvbench", "verdict"),
    [
        (1.25, "yes"),  # a tie is "at or below": kills ``<`` (and ``>``)
        (math.nextafter(1.25, 2.0), "no"),  # the next float above: kills ``>=`` (and ``!=``)
        (math.nextafter(1.25, 0.0), "yes"),  # the next float below
    ],
)
def test_markdown_verdict_at_the_tie(kvbench: float, verdict: str) -> None:
    """The verdict column is ``kvbench ratio <= llama.cpp ratio``, decided at the boundary:
    exactly equal ratios (1.25 is exact in binary) and one ulp either side."""
    T = _tool()
    key = json.dumps([8192, 2, "q8_0"])
    row = {"ci_low": None, "ci_high": None, "rounds": 1, "ms": 2.5, "base_ms": 2.0}
    doc = {
        "llama_ratios": {key: row | {"ratio": 1.25}},
        "kvbench_ratios": {key: row | {"ratio": kvbench}},
        "op_ratios": [],
    }
    line = next(x for x in T.markdown(doc).splitlines() if x.startswith("| 8192 | 2 |"))
    # both ratios print alike (f16 2.00 ms; no q4_0 row): only the verdict tells them apart
    assert line == f"| 8192 | 2 | 2.00 | 1.25 | 1.25 | - | - | q8_0 {verdict} |"
