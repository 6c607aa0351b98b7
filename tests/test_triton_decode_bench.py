"""benchmarks/triton_decode.py (the device check's benchmark) on CPU, in the Triton interpreter
at tiny sizes: timing rows with their guard, the Markdown table, and the shell wrapper
benchmarks/device_check.sh."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "triton_decode.py"

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install triton)",
)


@pytest.fixture
def B(monkeypatch):
    """The script as a module (it imports the kernel modules only when ``main`` runs);
    ``TRITON_INTERPRET=1`` for the test, as ``--interpret`` sets it, put back afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("triton_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_triton
def test_interpret_dry_run(B, tmp_path):
    assert B.main(["--interpret", "--out", str(tmp_path)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert "correctness" not in kinds  # correctness is tests/kernels' job
    assert kinds.count("step") == 4 and kinds.count("flush") == 2 and "error" not in kinds
    steps = [r for r in rows if r["kind"] == "step"]
    methods = [r["method"] for r in steps]
    assert methods[1] == "split-KV Triton (control)" and methods[2:] == ["KIVI-2", "PN-Mix (1)"]
    # the guard: each timed fused kernel was compared with the reference of its cache
    assert all(r["err"] is not None and r["err"] <= B.GUARD for r in steps[2:])
    md = (tmp_path / "RESULTS.md").read_text()
    for heading in ("## Decode attention step", "## Quantize-and-pack on flush", "- triton: "):
        assert heading in md
    assert json.loads((tmp_path / "env.json").read_text())["mode"].startswith("interpret")


def test_guard_marks_a_wrong_kernel(B, tmp_path):
    """A timed kernel whose output is off is recorded as failing and its time not returned."""
    rec = B.Recorder(tmp_path, {})
    timer = B.Timer(B.torch.device("cpu"), reps=1, warmup=0)
    us = B._step_row(rec, timer, {}, None, 64, 1, "m", "k", "v", 100, lambda: None, err=0.5)
    assert us is None and rec.rows[-1]["err"] == 0.5
    assert "0.5" not in B._err(1e-4) and "FAIL" in B._err(0.5)


def test_shapes_put_the_targets_first(B):
    shapes = B.parse_shapes("4096,16384,32768,65536", "1,8")
    assert shapes[:2] == [(32768, 8), (32768, 1)]
    assert shapes[2:] == [(4096, 8), (4096, 1), (16384, 8), (16384, 1), (65536, 8), (65536, 1)]


def test_markdown_targets_and_ratios(B):
    env = {"device": "X"}
    rows = [
        {
            "kind": "step",
            "context": 32768,
            "batch": 8,
            "method": "PN-Mix (1)",
            "keys": "2.26 b",
            "values": "fp16",
            "bytes": 6e8,
            "us": 200.0,
            "p10": 190.0,
            "p90": 210.0,
            "gbps": 3000.0,
            "pct_copy": 75.0,
            "vs_sdpa": 1.5,
            "vs_control": 1.2,
            "timing": "graph",
            "err": 2e-4,
        },
        {
            "kind": "target",
            "name": "T=32768 B=8 PN-Mix (1) keys, V16: >= 1.3x vs sdpa",
            "measured": "1.50x",
            "ok": True,
        },
    ]
    md = B.render_markdown(env, rows)
    assert (
        "| 32768 | 8 | PN-Mix (1) | 2.26 b | fp16 | 600.0 | 200.0 | 190.0–210.0 | 3000 | 75 "
        "| 1.50x | 1.20x | graph | 2.0e-04 |" in md
    )
    assert "| T=32768 B=8 PN-Mix (1) keys, V16: >= 1.3x vs sdpa | 1.50x | yes |" in md


def test_device_check_script_is_valid_bash():
    script = ROOT / "benchmarks" / "device_check.sh"
    assert script.stat().st_mode & 0o111, "device_check.sh must be executable"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (
        "benchmarks/triton_decode.py" in script.read_text() and "PYTHONPATH" in script.read_text()
    )
