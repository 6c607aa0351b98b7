"""CI regression gate: rerun ``suites/ci_gate.yaml`` (model-free, seeded) and compare it with the
committed baseline ``tests/baseline/`` through ``kvbench compare`` (docs/design.md#records).

The suite holds every built-in method (transformers peers other than hf-dynamic, and plugins,
excluded) at one operating point; :func:`test_every_builtin_method_is_gated` fails when a
built-in method is missing from it, naming the entry to add, the files and the make targets
(``gate_suites.how_to_gate``).  Deterministic metrics are gated: bytes and bits exactly,
key/value MSE, attention KL and attention-output error within 1% (the float64 reference is
exact on one machine; 1% absorbs another CPU's kernels).  Timing is not part of this suite.
After an intended change, regenerate the baseline with ``make baseline``;
:func:`test_baseline_is_not_stale` fails while it holds other runs than the suite expands to.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from gate_suites import GATE, gated_builtins, how_to_gate, missing_from

from kvbench.bench.records import Record, load_record, load_records, write_record
from kvbench.bench.runner import run_suite
from kvbench.bench.suite import load_suite
from kvbench.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "baseline"
GATES = [
    "bytes_total:0",
    "bytes_codes:0",
    "bytes_scales:0",
    "bytes_metadata:0",
    "bytes_residual:0",
    "bytes_sinks:0",
    "bytes_key_total:0",
    "bytes_value_total:0",
    "effective_bits:0",
    "effective_key_bits:0",
    "effective_value_bits:0",
    "nominal_key_bits:0",
    "nominal_value_bits:0",
    "key_mse:1%",
    "value_mse:1%",
    "attn_kl:1%",
    "attn_out_rel_err:1%",
]


def _compare(base: Path, new: Path) -> int:
    args = ["compare", str(base), str(new)]
    for g in GATES:
        args += ["--fail-on", g]
    return cli_main(args)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    before = torch.get_num_threads()
    out = tmp_path_factory.mktemp("ci_gate")
    try:
        run_suite(load_suite(ROOT / GATE), out, quiet=True)
    finally:
        torch.set_num_threads(before)
    return out


def test_baseline_is_committed() -> None:
    recs = sorted(BASELINE.glob("*.json"))
    assert recs, "tests/baseline/ has no records; run the suite into it (module docstring)"
    methods = {load_record(p).method for p in recs}
    assert {"full", "kivi", "hf-dynamic", "per-channel", "kvquant"} <= methods


def test_every_builtin_method_is_gated() -> None:
    assert len(gated_builtins()) >= 18, sorted(gated_builtins())  # the registry was enumerated
    missing = missing_from(GATE)
    assert not missing, how_to_gate(missing)


def test_missing_method_message_says_what_to_do() -> None:
    """The message of a built-in method missing from the gates names both suites, the entry
    to add (the gates' group_size and residual_length where the config has them) and both make
    targets with what the model one needs."""
    text = how_to_gate({"kivi", "full"})
    for words in (
        "['full', 'kivi'] missing",
        "suites/ci_gate.yaml",
        "suites/ci_gate_model.yaml",
        "\n  - full\n",
        "\n  - {name: kivi, config: {group_size: 32, residual_length: 32}}\n",
        "`make baseline`",
        "`make baseline-model`",
        "offline",
    ):
        assert words in text, (words, text)
    assert "  - {name: fp8, config: {residual_length: 32}}" in how_to_gate({"fp8"})


def _pairs() -> list[tuple[str, dict, Record | None, Record | None]]:
    """``(method, config, fidelity record, memory record)`` per configuration of the baseline
    (a suite entry: the same method may run in several configurations, e.g. an evictor alone
    and composed with a quantizer)."""
    by: dict[tuple[str, str, str], Record] = {}
    configs: dict[tuple[str, str], dict] = {}
    for rec in load_records(BASELINE):
        by[(rec.method, rec.config_key, rec.workload_type)] = rec
        configs[(rec.method, rec.config_key)] = rec.config
    return [
        (name, config, by.get((name, key, "fidelity")), by.get((name, key, "memory")))
        for (name, key), config in sorted(configs.items())
    ]


def test_gate_records_cover_quantization() -> None:
    """Each gated configuration has a fidelity record with an attention metric and a memory
    record with bytes by category, and exercises its method's family (declared by the method,
    ``capabilities.evicts``): a quantizing method quantized most key tokens in the fidelity run
    and stores fewer than 16 bits per element; an evicting method held fewer tokens than it saw
    in both runs, its bytes counted against the 16-bit cache of every token seen (below it),
    and one composed with a quantizer other than ``full`` quantized most of the keys it held."""
    from kvbench.cache.registry import get_method_class
    from kvbench.report.headline import bytes_vs_16bit

    assert not missing_from(GATE), how_to_gate(missing_from(GATE))
    pairs = _pairs()
    unrun = sorted(
        {m for m in gated_builtins()}
        - {name for name, _, fid, mem in pairs if fid is not None and mem is not None}
    )
    assert not unrun, f"tests/baseline has no records of {unrun} (in {GATE}): run `make baseline`"
    for name, config, fid_rec, mem_rec in pairs:
        if fid_rec is None or mem_rec is None or name not in gated_builtins():
            continue
        what, fid, mem = (name, config), fid_rec.metrics, mem_rec.metrics
        assert mem["bytes_total"] == sum(
            mem[f"bytes_{c}"] for c in ("codes", "scales", "metadata", "residual", "sinks")
        ), what
        assert "attn_kl" in fid or "attn_out_rel_err" in fid, what
        if get_method_class(name).capabilities.evicts:
            for metrics in (fid, mem):
                assert 0 < metrics["held_token_fraction"] < 1, (what, metrics)
            assert bytes_vs_16bit(mem_rec) < 1 and mem["effective_bits"] < 16, what
            if config["quantizer"]["name"] != "full":
                assert fid["quantized_key_fraction"] >= 0.5, (what, fid["quantized_key_fraction"])
        elif name != "full":
            assert fid["quantized_key_fraction"] >= 0.5, (what, fid["quantized_key_fraction"])
            assert mem["effective_bits"] < 16, what


def test_gate_passes_on_rerun(fresh: Path, capsys: pytest.CaptureFixture) -> None:
    n, base = len(list(fresh.glob("*.json"))), len(list(BASELINE.glob("*.json")))
    assert n == base, f"{GATE} runs {n} runs, tests/baseline holds {base}: run `make baseline`"
    assert _compare(BASELINE, fresh) == 0, capsys.readouterr().err


def _inject(src: Path, dst: Path, method: str, metric: str, factor: float) -> None:
    shutil.copytree(src, dst)
    for p in dst.glob("*.json"):
        rec = load_record(p)
        if rec.method == method and metric in rec.metrics:
            rec.metrics[metric] *= factor
            write_record(p, rec)
            return
    raise AssertionError(f"no {method} record with {metric}")


@pytest.mark.parametrize(
    "metric, factor",
    [("bytes_total", 1.0001), ("effective_bits", 1.01), ("key_mse", 1.02), ("attn_kl", 1.02)],
)
def test_gate_fails_on_injected_regression(
    fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture, metric: str, factor: float
) -> None:
    bad = tmp_path / "bad"
    _inject(fresh, bad, "kivi", metric, factor)
    assert _compare(BASELINE, bad) == 1
    err = capsys.readouterr().err
    assert "kivi" in err and metric in err


def test_gate_tolerates_mse_noise_below_threshold(fresh: Path, tmp_path: Path) -> None:
    ok = tmp_path / "ok"
    _inject(fresh, ok, "kivi", "key_mse", 1.005)  # +0.5% < 1%
    assert _compare(BASELINE, ok) == 0


def test_baseline_is_not_stale() -> None:
    """The baseline holds exactly the runs the suite expands to (``make baseline`` rebuilds it):
    a method or workload added to, removed from or reconfigured in the suite fails here."""
    from kvbench.bench.records import make_run_id
    from kvbench.bench.runner import skip_reason
    from kvbench.bench.workloads import WORKLOADS
    from kvbench.cache.registry import get_method

    suite = load_suite(ROOT / GATE)
    want = set()
    for model in suite.models:
        for w in suite.workloads:
            wl = WORKLOADS.get(w["type"])(w)
            for m in suite.methods:
                method = get_method(m.name, **m.config)
                if not skip_reason(method, wl):
                    want.add(make_run_id(model or {}, m.name, method.config.to_dict(), w))
    have = {r.run_id for r in load_records(BASELINE)}
    assert have == want, (
        f"tests/baseline is stale: missing {sorted(want - have)}, extra {sorted(have - want)}; "
        "run `make baseline`"
    )
