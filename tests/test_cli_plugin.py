"""CLI (`kvbench list`, `kvbench bits`) and the third-party plugin path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kvbench
from kvbench.cli import main, parse_set


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvbench.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(("group", "expected"), [(128, 2.25), (64, 2.50), (32, 3.00)])
def test_bits_kivi_json(group: int, expected: float) -> None:
    # docs/methods.md#kivi and docs/methods.md#average-bits: b + 32/G with fp16 scale and zero, residual excluded, no sinks
    out = run_cli(
        "bits",
        "kivi",
        "--set",
        "bits=2",
        "--set",
        f"group_size={group}",
        "--set",
        f"residual_length={group}",
        "--head-dim",
        "128",
        "--tokens",
        "32768",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1  # exactly one JSON object on stdout
    report = json.loads(lines[0])
    assert report["key_bits"] == pytest.approx(expected, abs=1e-9)
    assert report["value_bits"] == 16.0


def test_bits_with_sinks_matches_formula(capsys: pytest.CaptureFixture) -> None:
    # (N_s*16 + T_q*(2 + 32/128)) / (T_q + N_s), N_s = 32, T_q = 1024, by hand
    assert main(["bits", "kivi", "--set", "num_sink_tokens=32", "--tokens", "1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["key_bits"] == pytest.approx((32 * 16 + 1024 * 2.25) / (1024 + 32))


def test_parse_set_yaml_scalars() -> None:
    assert parse_set(["high_ratio=0.03125", "bits=3", "scale_dtype=float32", "x=true"]) == {
        "high_ratio": 0.03125,
        "bits": 3,
        "scale_dtype": "float32",
        "x": True,
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_set(["bits"])


def test_bits_bad_input_exit_code(capsys: pytest.CaptureFixture) -> None:
    assert main(["bits", "kivy"]) == 2
    assert "did you mean 'kivi'" in capsys.readouterr().err
    assert main(["bits", "kivi", "--set", "bitz=2"]) == 2
    err = capsys.readouterr().err
    assert "bitz" in err and "group_size" in err
    assert main(["bits", "kivi", "--set", "bits=9"]) == 2
    assert "field 'bits': 9 is not allowed; allowed: 1..8 or 16" in capsys.readouterr().err


def test_list_shows_builtins_and_plugin(capsys: pytest.CaptureFixture) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for name in ("full", "kivi", "per-channel", "per-token", "per-head", "uniform"):
        assert rows[name].split()[1] == "kvbench"
    assert rows["example-sign"].split()[1] == "kvbench-example-plugin"


def test_plugin_via_get_method() -> None:
    m = kvbench.get_method("example-sign", bits=4, residual_length=2)
    assert type(m).__module__ == "kvbench_example_plugin"
    layer = m.new_layer(0, num_kv_heads=1, head_dim=8)
    k = torch.tensor([[[[1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -7.0]] * 3]])
    layer.prefill(k, k.clone())
    keys, _ = layer.keys_values()
    # symmetric 4-bit absmax: scale = 7/7 = 1, integers come back exactly; 1 token quantized
    assert layer.quantized_tokens() == (1, 0)
    assert torch.equal(keys, k)
