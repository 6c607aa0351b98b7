"""benchmarks/decode_step.py: its target rules on hand-made rows, and a smoke run on a tiny
random model (the output files and their columns; no assertion reads real speed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("decode_step", ROOT / "benchmarks/decode_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(ctx, config, kind="kvbench", **kw):
    return {"context": ctx, "config": config, "kind": kind, **kw}


def test_targets_by_hand() -> None:
    B = _bench()
    rows = [
        _row(4096, "dynamic", "transformers", ratio_dynamic=1.0, ratio_quanto2=0.5),
        _row(4096, "uniform", ratio_dynamic=1.25, pct_ref=40.0),  # both limits are inclusive
        _row(4096, "pn-mix", ratio_dynamic=1.2, pct_ref=39.9),  # <= 1.25 but > 1.10
        _row(4096, "kitty", ratio_dynamic=1.05),
        _row(4096, "kivi-2", ratio_dynamic=0.8, ratio_quanto2=1.0),  # not below quanto2
        _row(8192, "kivi-2", ratio_dynamic=0.91, ratio_quanto2=0.7),
        _row(8192, "full", skipped=True, note="skipped"),
    ]
    got = {t["name"]: t["ok"] for t in B.evaluate_targets(rows)}
    assert got == {
        "T=4096 kitty <= 1.25x dynamic": True,
        "T=4096 kivi-2 <= 1.25x dynamic": True,
        "T=4096 pn-mix <= 1.25x dynamic": True,
        "T=4096 uniform <= 1.25x dynamic": True,
        "T=4096 pn-mix <= 1.1x dynamic": False,
        "T=4096 kitty <= 1.1x dynamic": True,
        "T=8192 kivi-2 <= 0.9x dynamic": False,
        "T=4096 kivi-2 < quanto2": False,
        "T=8192 kivi-2 < quanto2": True,
        "T=4096 uniform attention read >= 40% of contiguous read": True,
        "T=4096 pn-mix attention read >= 40% of contiguous read": False,
    }


def test_smoke_run_writes_every_column(tmp_path: Path) -> None:
    B = _bench()
    before = torch.get_num_threads()
    out = tmp_path / "ds"
    res = B.main(
        ["--tiny", "--quick", "--configs", "dynamic", "full", "kivi-2", "--out", str(out)]
        + ["--prefill-threads", "1"]
    )
    assert torch.get_num_threads() == before  # threads restored
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    rows = {r["config"]: r for r in saved["rows"]}
    assert set(rows) == {"dynamic", "full", "kivi-2"}
    for r in rows.values():
        assert r["threads"] == 1 and len(r["loadavg_before"]) == 3
        assert r["steps"] == 4 and len(r["step_ms"]) == 4 and len(r["attn_step_ms"]) == 4
        for k in ("median_ms", "p90_ms", "p99_ms", "attn_ms", "gbps", "ref_gbps", "pct_ref"):
            assert r[k] > 0, k
    assert rows["dynamic"]["ratio_dynamic"] == 1.0 and rows["dynamic"]["kind"] == "transformers"
    assert rows["kivi-2"]["kind"] == "kvbench" and rows["kivi-2"]["attend_path"]
    # the tiny model: 2 layers x 2 KV heads x 64 x 4 bytes per token and side; the first timed
    # step attends to 160 - 1 - 4 + 1 + 1 = 157 tokens
    dyn = rows["dynamic"]
    assert dyn["bytes_read"] == pytest.approx(2 * 2 * 2 * 64 * 4 * (157 + 1.5), rel=0.01)
    # kvbench caches read what they hold: KIVI-2 holds less than the full cache
    assert rows["kivi-2"]["bytes_read"] < rows["full"]["bytes_read"]
    md = out.with_suffix(".md").read_text()
    assert "## Context 160" in md and "| kivi-2 |" in md and "ref GB/s" in md
