"""``kvbench run --executor ray`` on a local Ray cluster started inside the tests.

One cluster (``ray.init(num_cpus=2)``, bound to 127.0.0.1, no dashboard) serves every test of
the module.  The Ray records are checked against the local executor's (the same code path on
one process, an independent run), a worker is killed mid-run (retry, then a failed record), and
the driver is interrupted with SIGINT (resume completes the sweep, nothing duplicated or partial).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from kvbench.bench.records import Record, load_record
from kvbench.bench.runner import run_suite
from kvbench.bench.suite import parse_suite
from kvbench.integrations.ray import run_suite_ray
from kvbench.integrations.ray.connect import (
    ClusterAuthError,
    ClusterConnectError,
    RayUnavailableError,
    import_ray,
    slots,
)
from kvbench.integrations.ray.failed import failed_path
from kvbench.integrations.ray.scheduler import RayExecutor
from kvbench.integrations.ray.worker import ModelWorker

#: metrics that measure time (differ between any two runs); every other metric must be equal
TIMED = ("_ms", "_s", "tokens_per_s", "latency", "speedup")


def _suite(model, methods, workloads, **extra):
    return parse_suite(
        {"name": "t", "seed": 0, "threads": 1, "model": model, "methods": methods,
         "workloads": workloads, "resources": {"num_cpus": 1}, **extra},
        "t.yaml",
    )  # fmt: skip


BITS_METHODS = ["full", {"name": "kivi", "config": {"bits": [2, 4]}}, "per-token"]


def _model_free(workloads=None):
    return _suite("none", BITS_METHODS, workloads or [{"type": "bits"}])


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.glob("*.json")}


# ------------------------------------------------------------------ no cluster needed
def test_resources_key_is_validated() -> None:
    ok = _suite("none", ["full"], [{"type": "bits"}])
    assert ok.resources == {"num_cpus": 1}
    assert parse_suite({"model": "none", "methods": ["full"], "workloads": [{"type": "bits"}]})
    bad = {
        "gpus": "unknown resources key",
        "num_cpus": 0,
        "num_gpus": -1,
        "memory": "lots",
        "custom": {"tpu": 0},
    }
    for key, value in bad.items():
        res = {"gpus": 1} if key == "gpus" else {key: value}
        msg = "unknown resources key" if key == "gpus" else f"resources.{key.split('.')[0]}"
        with pytest.raises(ValueError, match=msg):
            _suite("none", ["full"], [{"type": "bits"}], resources=res)
    with pytest.raises(ValueError, match="'resources' is a mapping"):
        _suite("none", ["full"], [{"type": "bits"}], resources=[1])


def test_slots_count_whole_workers_per_node() -> None:
    nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 3.0, "GPU": 4.0}, {"CPU": 16.0}]
    assert slots(nodes, {"CPU": 1.0, "GPU": 1.0}) == 2 + 3 + 0
    assert slots(nodes, {"CPU": 2.0}) == 4 + 1 + 8
    assert slots(nodes, {"CPU": 1.0, "GPU": 0.5}) == 4 + 3 + 0
    assert slots(nodes, {"CPU": 32.0}) == 0


def test_without_ray_the_error_names_the_extra(monkeypatch, tmp_path: Path, capsys) -> None:
    from kvbench.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(
        RayUnavailableError, match=r"pip install -e '\.\[ray\]' in the kvbench clone"
    ):
        import_ray()
    suite = tmp_path / "s.yaml"
    suite.write_text("model: none\nmethods: [full]\nworkloads: [{type: bits}]\n")
    out = tmp_path / "out"
    assert main(["run", str(suite), "--executor", "ray", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    # kvbench is not on the package index: the hint must not send a new user there
    assert "pip install -e '.[ray]'" in err and "kvbench[ray]" not in err
    assert not out.exists()
    assert main(["run", str(suite), "--address", "auto", "--out", str(out)]) == 2
    assert "need --executor ray" in capsys.readouterr().err


def test_unreachable_address_fails_fast_and_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    import time

    out = tmp_path / "out"
    t0 = time.perf_counter()
    with pytest.raises(ClusterConnectError, match="127.0.0.1:1"):
        RayExecutor(_model_free(), out, address="127.0.0.1:1", connect_timeout_s=2).run()
    assert time.perf_counter() - t0 < 10
    assert not out.exists()


def _auth_failures(address: str) -> list[BaseException]:
    """What ``ray.init`` raises on a token-authentication failure (Ray 2.60's code paths,
    ray/_private/worker.py and node.py): with ``RAY_AUTH_MODE=token`` and no token here,
    ``AuthenticationError`` at once; without ``RAY_AUTH_MODE`` here, the head refuses the GCS
    calls (gRPC UNAUTHENTICATED) and ``ray.init`` raises a bare ``ConnectionError`` chained to
    the ``RuntimeError`` that carries the last connection error."""
    import ray.exceptions
    from ray._private.authentication.authentication_constants import (
        TOKEN_AUTH_ENABLED_BUT_NO_TOKEN_FOUND_ERROR_MESSAGE as NO_TOKEN,
    )

    missing = ray.exceptions.AuthenticationError(NO_TOKEN)
    inner = RuntimeError(
        "Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
        '  File "ray/_private/node.py", line 996, in _init_gcs_client\n'
        "ray.exceptions.RpcError: UNAUTHENTICATED: Invalid or missing authentication token\n"
    )
    bare = ConnectionError(f"Failed to connect to Ray cluster at {address}")
    bare.__cause__ = inner
    return [missing, bare]


def test_token_auth_failure_says_how_to_pass_the_token(monkeypatch, tmp_path, capsys) -> None:
    ray = pytest.importorskip("ray")
    import socket

    from kvbench.cli import main

    head = socket.socket()  # a listening "head", so the TCP probe of HOST:PORT passes
    head.bind(("127.0.0.1", 0))
    head.listen()
    address = f"127.0.0.1:{head.getsockname()[1]}"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    raised: list[BaseException] = []

    def init(**kwargs) -> None:
        raise raised[-1]

    monkeypatch.setattr(ray, "init", init)
    hints = ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN=<token>", "RAY_AUTH_TOKEN_PATH=<file>",
             "~/.ray/auth_token", "`ray get-auth-token`", "requires token authentication")  # fmt: skip
    try:
        for exc in _auth_failures(address):
            raised.append(exc)
            with pytest.raises(ClusterAuthError) as info:
                RayExecutor(_model_free(), tmp_path / "out", address=address).run()
            msg = str(info.value)
            assert all(h in msg for h in hints), msg
            assert f"--address {address!r}" in msg
            assert ("no authentication token was found" in msg) == (exc is raised[0])
            assert not (tmp_path / "out").exists()
        # through the CLI: exit 2 with the same explanation, nothing written
        suite = tmp_path / "s.yaml"
        suite.write_text("model: none\nmethods: [full]\nworkloads: [{type: bits}]\n")
        argv = ["run", str(suite), "--executor", "ray", "--address", address, "--quiet"]
        assert main([*argv, "--out", str(tmp_path / "out")]) == 2
        assert "RAY_AUTH_TOKEN_PATH=<file>" in capsys.readouterr().err
        assert not list((tmp_path / "out").rglob("*.json"))  # (the CLI makes the folder first)
        # any other failure to connect keeps its own message and is not called an auth error
        raised.append(ConnectionError(f"Failed to connect to Ray cluster at {address}"))
        with pytest.raises(ClusterConnectError) as info:
            RayExecutor(_model_free(), tmp_path / "out", address=address).run()
        assert not isinstance(info.value, ClusterAuthError)
        assert "Failed to connect to Ray cluster" in str(info.value)
    finally:
        head.close()


def test_ray_cluster_extra_brings_the_job_cli_and_is_documented() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["ray"] == ["ray>=2.40,<3"]  # plain ray stays the light extra
    assert extras["ray-cluster"] == ["ray[default]>=2.40,<3"]  # ray job submit, dashboard
    doc = (root / "docs" / "cluster.md").read_text()
    assert "pip install -e '.[ray-cluster]'" in doc  # kvbench is not on the package index
    submit = doc.index("ray job submit --address")
    assert doc.index("--executor ray", submit) - submit < 200  # the job runs kvbench run
    assert "RAY_AUTH_TOKEN_PATH" in doc and "--run-timeout" in doc


# ------------------------------------------------------------------ one local cluster
@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind to 127.0.0.1, not the LAN
    ray = pytest.importorskip("ray")
    import ray._private.ray_constants as rc

    rc.ENABLE_RAY_CLUSTER = False  # (read at call time too, in case ray was imported before)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # CrashingWorker below
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory) -> str:
    """A seeded 2-layer Llama (random weights) with a byte-level tokenizer, saved to a folder
    that ``load_model`` reads as a local model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=len(vocab),
        intermediate_size=128,
        max_position_embeddings=1024,
        eos_token_id=vocab["<eos>"],
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("toy") / "toy-llama"
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _assert_same_records(local: list[Record], remote: list[Record]) -> None:
    assert [r.run_id for r in local] == [r.run_id for r in remote]
    for a, b in zip(local, remote):
        assert (a.method, a.config, a.model, a.workload) == (
            b.method,
            b.config,
            b.model,
            b.workload,
        )
        keys = {k for k in a.metrics if not any(t in k for t in TIMED)}
        assert keys and keys == {k for k in b.metrics if not any(t in k for t in TIMED)}
        assert {k: a.metrics[k] for k in keys} == {k: b.metrics[k] for k in keys}
        assert a.per_layer == b.per_layer


def test_toy_model_records_equal_local(cluster, toy_model: str, tmp_path: Path) -> None:
    suite = _suite(
        {"id": toy_model, "dtype": "float32", "device": "cpu"},
        BITS_METHODS,
        [{"type": "fidelity", "tokens": 96, "prefill": 64}],
    )
    local = run_suite(suite, tmp_path / "local", quiet=True)
    ex = run_suite_ray(suite, tmp_path / "ray", max_parallel=2, progress_workers=True)
    assert not ex.failed and len(ex.records) == 4
    _assert_same_records(local, ex.records)
    assert _files(tmp_path / "ray").keys() == _files(tmp_path / "local").keys()
    # ratios against the baseline were computed on the workers as locally
    fid = [r for r in ex.records if r.workload["type"] == "fidelity"]
    base = fid[0].metrics
    assert fid[0].method == "full" and base["key_mse"] == 0
    for r in fid[1:]:  # every ratio is against the baseline's value, computed by hand here
        m = r.metrics
        want = {f"{k}_ratio": m[k] / b for k, b in base.items() if b != 0 and k in m}
        want = {k: v for k, v in want.items() if "_ci_" not in k and not k.endswith("_ratio_ratio")}
        assert want and {k: m[k] for k in want} == pytest.approx(want, rel=1e-12)
    # the manifest names node and device; two workers shared one preparation per workload
    for r in ex.records:
        m = r.manifest
        assert m["executor"] == "ray" and m["node"]["ip"] == "127.0.0.1"
        assert m["device"] == "cpu" and m["threads"] == 1 and m["ray"]["attempt"] == 1
    assert len({r.manifest["ray"]["worker"] for r in ex.records}) == 2
    # w0 prepares and runs the baseline (the others wait for it), then w1 takes a run and
    # installs the preparation from the object store instead of recomputing it
    how = {r.manifest["ray"]["worker"]: r.manifest["ray"]["prepared"] for r in ex.records}
    assert how == {"w0": "here", "w1": "object store"}


class CrashingWorker(ModelWorker):
    """Dies (``os._exit``, as an OOM kill would) in the middle of chosen runs: ``kivi[bits=2]``
    on its first attempt only, ``per-token`` on every attempt.  Attempts are counted in files
    (each attempt runs in a fresh process)."""

    marks: Path | None = None

    def run(self, run, baseline, state_ref):  # type: ignore[override]
        label = run.method.label
        if label in ("kivi[bits=2]", "per-token"):
            done = [m for m in os.listdir(self.marks) if m.startswith(label + ".")]
            mark = self.marks / f"{label}.{len(done)}"
            mark.touch()
            if label == "per-token" or mark.name.endswith(".0"):
                os._exit(1)
        return super().run(run, baseline, state_ref)


def test_worker_death_is_retried_once_then_recorded_failed(cluster, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    worker = type("Crashing", (CrashingWorker,), {"marks": marks})
    out = tmp_path / "out"
    suite = _model_free()
    ex = run_suite_ray(suite, out, max_parallel=1, quiet=True, worker_cls=worker)
    by_label = {r.manifest["label"]: r for r in ex.records}
    assert set(by_label) == {"full", "kivi[bits=2]", "kivi[bits=4]"}
    assert by_label["kivi[bits=2]"].manifest["ray"]["attempt"] == 2  # the retry succeeded
    assert by_label["full"].manifest["ray"]["attempt"] == 1
    assert sorted(p.name for p in marks.iterdir()) == [
        "kivi[bits=2].0",
        "kivi[bits=2].1",
        "per-token.0",
        "per-token.1",  # retried once, not more
    ]
    (failed,) = ex.failed
    assert failed["status"] == "failed" and failed["attempts"] == 2
    assert "died" in failed["error"] and failed["method"] == "per-token"
    path = failed_path(out, failed["run_id"])
    assert json.loads(path.read_text())["error"] == failed["error"]
    assert not (out / f"{failed['run_id']}.json").exists()  # never mistaken for finished
    assert len(_files(out)) == 3
    # resume: only the failed run is computed again, and its failed record goes away
    before = _files(out)
    again = run_suite_ray(suite, out, quiet=True)
    assert [t["title"] for t in again.timings] == ["per-token / bits"]
    assert not again.failed and not path.exists() and len(again.records) == 4
    assert {k: v for k, v in _files(out).items() if k in before} == before


class FailingPrepare(ModelWorker):
    """Its ``workload.prepare`` raises (as a broken data file would)."""

    def prepare(self, index, spec):  # type: ignore[override]
        raise RuntimeError("prepare broke")


def test_failed_preparation_fails_each_run_once(cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ex = run_suite_ray(_model_free(), out, max_parallel=1, quiet=True, worker_cls=FailingPrepare)
    assert ex.records == []
    labels = ["full", "kivi[bits=2]", "kivi[bits=4]", "per-token"]
    assert sorted(f["label"] for f in ex.failed) == labels  # each once, the baseline included
    for f in ex.failed:  # the cause, not "baseline 'full' failed"
        assert (
            f["error"].startswith("workload preparation failed: ") and "prepare broke" in f["error"]
        )
    assert len(list((out / "failed").glob("*.json"))) == 4 and not list(out.glob("*.json"))


class InterruptingExecutor(RayExecutor):
    """Sends itself SIGINT (Ctrl-C) right after the ``stop_after``-th record is written."""

    stop_after = 2

    def _collect(self, ref, task) -> None:
        super()._collect(ref, task)
        if len(self.timings) == self.stop_after:
            signal.raise_signal(signal.SIGINT)


def test_interrupted_driver_resumes_without_duplicates(cluster, tmp_path: Path) -> None:
    from kvbench.cli import main

    out = tmp_path / "out"
    workloads = [{"type": "bits", "head_dim": [64, 128]}]
    suite = _model_free(workloads)
    ex = InterruptingExecutor(suite, out, max_parallel=2, quiet=True)
    # Ctrl-C must reach the driver as KeyboardInterrupt even if a library imported by an
    # earlier test replaced the process's SIGINT handler (seen only in whole-suite runs)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            ex.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ex.workers == [] and len(ex.handles) == 2
    for handle in ex.handles:  # every worker killed, which cancels its running task
        assert _dies(cluster, handle)
    first = _files(out)
    assert len(first) == 2 and not list(out.glob(".*"))  # complete records, no temp file
    for name in first:
        load_record(out / name)
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({**suite.raw, "name": "t"}))
    argv = ["run", str(path), "--out", str(out), "--executor", "ray", "--max-parallel", "2"]
    assert main([*argv, "--quiet"]) == 0
    final = _files(out)
    assert len(final) == 8 and {k: final[k] for k in first} == first  # nothing recomputed
    assert not (out / "failed").exists()
    recs = [load_record(out / n) for n in final]
    assert len({r.run_id for r in recs}) == 8
    # a finished sweep needs no cluster at all (an unreachable address is not even probed)
    done = RayExecutor(suite, out, address="127.0.0.1:1", quiet=True).run()
    assert sorted(r.run_id + ".json" for r in done) == sorted(final)


def _dies(ray, handle, within_s: float = 60.0) -> bool:
    """Whether the actor is dead within ``within_s`` (``ray.kill`` takes effect
    asynchronously: a call submitted right after it may still be answered)."""
    import time

    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            ray.get(handle.describe.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.5)
    return False


def test_request_beyond_every_node_is_refused_before_submission(cluster, tmp_path) -> None:
    suite = _suite("none", ["full"], [{"type": "bits"}], resources={"num_cpus": 64})
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"run 'full / bits'.*'CPU': 64\.0"):
        run_suite_ray(suite, out, quiet=True)
    assert not out.exists()
    gpu = _suite("none", ["full"], [{"type": "bits"}], resources={"num_gpus": 1})
    with pytest.raises(ValueError, match="'GPU': 1.0"):
        run_suite_ray(gpu, out, quiet=True)


@pytest.mark.slow
def test_default_model_through_ray_equals_local(cluster, tmp_path: Path) -> None:
    suite = _suite(
        "default",
        ["full", {"name": "kivi", "config": {"bits": 2}}],
        [{"type": "fidelity", "tokens": 160, "prefill": 128, "layers": [0, 15]}],
    )
    local = run_suite(suite, tmp_path / "local", quiet=True)
    ex = run_suite_ray(suite, tmp_path / "ray", quiet=True)
    assert not ex.failed
    _assert_same_records(local, ex.records)
    assert ex.records[0].manifest["model"]["num_hidden_layers"] == 30
