"""benchmarks/llama_cpp_kl.py: its parser on llama-perplexity's real output (numbers copied by
hand from a run of llama.cpp 0c1e570), the command lines it builds, and a sweep through a fake
llama-perplexity (the files written, --resume)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# excerpt of `llama-perplexity ... -ctk q8_0 -ctv q8_0 --kl-divergence -lv 4` (stderr + stdout)
KL_LOG = """\
0.00.372.422 I llama_kv_cache: attn_rot_k = 1, n_embd_head_k_all = 64
0.00.372.422 I llama_kv_cache: attn_rot_v = 1, n_embd_head_k_all = 64
0.00.639.531 I kl_divergence: computing over 10 chunks, n_ctx=512, batch_size=512, n_seq=1
====== Perplexity statistics ======
Mean PPL(Q)                   :  24.944823 ±   1.426075
Mean PPL(base)                :  24.924395 ±   1.425437
Cor(ln(PPL(Q)), ln(PPL(base))):  99.71%
Mean ln(PPL(Q)/PPL(base))     :   0.000819 ±   0.001905
Mean PPL(Q)/PPL(base)         :   1.000820 ±   0.001906
Mean PPL(Q)-PPL(base)         :   0.020427 ±   0.047491

====== KL divergence statistics ======
Mean    KLD:   0.003914 ±   0.000070
Maximum KLD:   0.076992
99.9%   KLD:   0.050000
99.0%   KLD:   0.015041
Median  KLD:   0.003208
Minimum KLD:  -0.000030

====== Token probability statistics ======
Mean    Δp: -0.017 ± 0.029 %
RMS Δp    :  1.475 ± 0.056 %
Same top p: 95.647 ± 0.404 %
"""

BASE_LOG = """\
0.04.719.921 I perplexity: calculating perplexity over 10 chunks, n_ctx=512, batch_size=512, n_seq=1
0.40.749.158 I perplexity: 35.91 seconds per pass - ETA 3.58.436.216 I Final estimate: PPL = 24.9244 +/- 1.42544
"""


def _bench():
    name = "benchmarks_llama_cpp_kl"
    if name not in sys.modules:  # its dataclasses resolve their annotations through sys.modules
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks/llama_cpp_kl.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_parse_kl_run() -> None:
    got = _bench().parse_output(KL_LOG)
    assert got == {
        "kld": 0.003914,
        "kld_se": 0.000070,
        "same_top_p": 95.647,
        "same_top_p_se": 0.404,
        "ppl_ratio": 1.000820,
        "ppl_ratio_se": 0.001906,
        "ln_ppl_ratio": 0.000819,
        "ln_ppl_ratio_se": 0.001905,
        "ppl": 24.944823,
        "ppl_se": 1.426075,
        "ppl_base": 24.924395,
        "ppl_base_se": 1.425437,
        "rms_dp": 1.475,
        "rms_dp_se": 0.056,
        "kld_p99": 0.015041,
        "kld_max": 0.076992,
        "kld_median": 0.003208,
        "rot_k": 1,
        "rot_v": 1,
        "chunks": 10,
    }


def test_parse_base_run_and_version() -> None:
    B = _bench()
    assert B.parse_output(BASE_LOG) == {"final_ppl": 24.9244, "final_ppl_se": 1.42544, "chunks": 10}
    version = "version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0\n"
    assert B.parse_output(version) == {"version": "0.5.0-dev", "build": 1, "commit": "0c1e570"}
    assert B.parse_output("Mean    KLD:  -0.000000 ±   0.000000\n") == {"kld": 0.0, "kld_se": 0.0}


def test_commands() -> None:
    B = _bench()
    logs = Path("L")
    by = {c.name: c for c in B.CONFIGS}
    argv, env = B.command(by["f16 (base)"], "bin", "m.gguf", "t.txt", 512, 10, 2, logs)
    want = "bin -m m.gguf -f t.txt -c 512 -b 512 -ub 512 --chunks 10 -t 2 -fa on -lv 4 "
    assert argv == (want + "-ctk f16 -ctv f16 --kl-divergence-base L/base-f16.kld").split()
    assert env == {}
    argv, env = B.command(by["q4_0 K+V, no rotation"], "bin", "m", "t", 512, 10, 2, logs)
    assert env == {"LLAMA_ATTN_ROT_DISABLE": "1"}
    assert argv[-6:] == ["q4_0", "-ctv", "q4_0", "--kl-divergence-base", "L/base-f16.kld"] + [
        "--kl-divergence"
    ]
    argv, _ = B.command(by["f16 vs f32 base, no FA"], "bin", "m", "t", 512, 10, 2, logs)
    assert argv[argv.index("-fa") + 1] == "off" and "L/base-f32-nofa.kld" in argv
    argv, _ = B.command(by["f16 vs f16 base, 1 thread"], "bin", "m", "t", 512, 10, 2, logs)
    assert argv[argv.index("-t") + 1] == "1"
    argv, _ = B.command(by["f16 vs f16 base, -ub 32"], "bin", "m", "t", 512, 10, 2, logs)
    assert argv[argv.index("-ub") + 1] == "32" and argv[argv.index("-b") + 1] == "512"
    line = B.shell_line(["a b", "c"], {"LLAMA_ATTN_ROT_DISABLE": "1"})
    assert line == "LLAMA_ATTN_ROT_DISABLE=1 'a b' c"


def test_every_base_is_written_before_it_is_read() -> None:
    written: set[str] = set()
    names = [c.name for c in _bench().CONFIGS]
    assert len(names) == len(set(names))
    for c in _bench().CONFIGS:
        if c.writes_base:
            written.add(c.base)
        else:
            assert c.base in written, c.name
        # llama.cpp quantizes V only under flash attention
        assert c.fa or c.ctv in ("f16", "f32"), c.name


def test_sweep_through_a_fake_binary(tmp_path: Path) -> None:
    B = _bench()
    calls = tmp_path / "calls"
    fake = tmp_path / "llama-perplexity"
    (tmp_path / "kl.txt").write_text(KL_LOG)
    (tmp_path / "base.txt").write_text(BASE_LOG)
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "version: 0.5.0-dev (build 1, commit 0c1e570)"; '
        "exit 0; fi\n"
        f'echo "$LLAMA_ATTN_ROT_DISABLE $*" >> {calls}\n'
        'case "$*" in *--kl-divergence\\ *|*--kl-divergence) '
        f"cat {tmp_path / 'kl.txt'};; *) cat {tmp_path / 'base.txt'} >&2;; esac\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    text = tmp_path / "t.txt"
    text.write_text("x")
    out = tmp_path / "res"
    common = ["--perplexity", str(fake), "--model", "m.gguf", "--text", str(text)]
    common += ["--chunks", "3", "--out", str(out)]
    pick = ["--configs", "f16 (base)", "q8_0 K+V, no rotation"]
    assert B.main(common + pick) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["version"] == {"version": "0.5.0-dev", "build": 1, "commit": "0c1e570"}
    assert [r["name"] for r in doc["rows"]] == ["f16 (base)", "q8_0 K+V, no rotation"]
    assert doc["rows"][0]["parsed"]["final_ppl"] == 24.9244
    assert doc["rows"][1]["parsed"]["kld"] == 0.003914
    assert doc["rows"][1]["command"].startswith(f"LLAMA_ATTN_ROT_DISABLE=1 {fake} -m m.gguf")
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and lines[1].startswith("1 ") and not lines[0].startswith("1")
    assert "--chunks 3" in lines[0]
    md = out.with_suffix(".md").read_text()
    assert "| q8_0 K+V, no rotation | q8_0 | q8_0 | on | 1/1 | f16 | 0.003914 ± 0.000070 |" in md
    assert (out.with_suffix(".logs") / "q8-0-k-v-no-rotation.log").read_text() == KL_LOG
    # --resume keeps the finished rows and runs only the new one
    assert B.main(common + pick + ["q4_0 K+V", "--resume"]) == 0
    assert len(calls.read_text().splitlines()) == 3
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [r["name"] for r in doc["rows"]] == ["f16 (base)", "q8_0 K+V, no rotation", "q4_0 K+V"]
    assert os.environ.get("LLAMA_ATTN_ROT_DISABLE") is None  # the env change stays in the child


def test_write_f32_gguf_dequantizes_by_hand(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 64)).astype(np.float32)  # 2 rows of 2 q8_0 blocks
    b = rng.normal(size=(5,)).astype(np.float32)
    src, dst = tmp_path / "q.gguf", tmp_path / "f.gguf"
    writer = gguf.GGUFWriter(str(src), arch="llama")
    writer.add_uint32("general.file_type", 7)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert _bench().write_f32_gguf(src, dst) == {"dequantized": 1, "copied": 1}
    # q8_0 by hand: each 34-byte block is a float16 scale d and 32 int8 codes q; x = d * q
    raw = np.frombuffer(q8.tobytes(), dtype=np.uint8).reshape(-1, 34)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)
    q = raw[:, 2:].copy().view(np.int8).astype(np.float32)
    want = (d * q).reshape(2, 64)
    r = gguf.GGUFReader(str(dst))
    got = {t.name: t for t in r.tensors}
    assert got["w"].tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(np.asarray(got["w"].data), want)
    assert np.abs(want - w).max() < 0.02  # and it is the weight, to q8_0's step
    assert np.array_equal(np.asarray(got["b"].data), b)
    assert r.get_field("general.file_type").contents() == 0
    assert r.get_field("general.name").contents() == "tiny"
    assert r.get_field("tokenizer.ggml.tokens").contents() == ["a", "b"]


def test_a_sweep_names_what_it_lacks(capsys) -> None:
    with pytest.raises(SystemExit):
        _bench().main(["--model", "m.gguf", "--text", "t.txt"])
    assert "a sweep needs --perplexity, --out" in capsys.readouterr().err


def test_parse_nan_uncertainty() -> None:
    # a ratio of two identical runs: llama.cpp prints -nan for the uncertainty of a 0 variance
    got = _bench().parse_output("Mean PPL(Q)/PPL(base)         :   0.999998 ±       -nan\n")
    assert got["ppl_ratio"] == 0.999998 and math.isnan(got["ppl_ratio_se"])
    assert _bench()._finite({"a": [float("nan"), 1.5], "b": float("-inf")}) == {
        "a": [None, 1.5],
        "b": None,
    }
