"""Regenerate ``bits_snapshot.json``: ``kvbench bits --json`` of every built-in method (default
config, and the PN-Mix Table 10 rows) at head_dim 64 and 128.  Run only when a change of the
bit accounting is intended:  python tests/attention/make_bits_snapshot.py"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from kvbench.cli import main

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "bits_snapshot.json"
BUILT_IN = [
    "chanmix", "fp8", "full", "int4-block", "int8-block", "kitty", "kivi", "kvquant",
    "per-channel", "per-head", "per-token", "pm-kvq", "pn-mix", "polarquant", "qjl", "semkv",
    "turboquant-mse", "uniform",
]  # fmt: skip
#: PN-Mix Table 10 rows (suites/paper/table10.yaml)
TABLE10 = {
    "kivi": ["bits=2", "group_size=128", "residual_length=128"],
    "polarquant": ["radius_bits=2", "angle_bits=2", "group_size=128", "residual_length=128"],
    "chanmix": [],
    "kitty": ["high_bits=4", "low_bits=2", "high_ratio=0.03125", "num_sink_tokens=32"],
    "pn-mix": ["high_bits=3", "low_bits=1", "high_ratio=0.5", "num_sink_tokens=32"],
}


def bits_json(method: str, sets: list[str], head_dim: int) -> dict:
    argv = ["bits", method, "--json", "--head-dim", str(head_dim)]
    for s in sets:
        argv += ["--set", s]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())


def cases() -> dict[str, tuple[str, list[str], int]]:
    out = {f"{m}@{d}": (m, [], d) for m in BUILT_IN for d in (64, 128)}
    out |= {f"table10:{m}": (m, s, 128) for m, s in TABLE10.items()}
    return out


if __name__ == "__main__":
    snap = {k: bits_json(*v) for k, v in cases().items()}
    SNAPSHOT.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(snap)} reports to {SNAPSHOT}")
