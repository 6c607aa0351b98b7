"""The CI gate on data tests (tests/conftest.py): with KVBENCH_REQUIRE_DATA=1 a skipped test
marked ``data`` fails; without it the skip stands; other skips are untouched. Run in a separate
pytest process on a copy of the conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CASES = """
import pytest

@pytest.mark.data
def test_needs_data():
    pytest.skip("needs dataset 'wikitext2'")

def test_other_skip():
    pytest.skip("no GPU")
"""


def _run(tmp_path: Path, require: bool) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    data: needs a dataset\n")
    env = {k: v for k, v in os.environ.items() if k != "KVBENCH_REQUIRE_DATA"}
    if require:
        env["KVBENCH_REQUIRE_DATA"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_skipped_data_test_fails_when_data_is_required(tmp_path):
    out = _run(tmp_path, require=True)
    assert out.returncode == 1, out.stdout
    assert "1 failed, 1 skipped" in out.stdout
    assert "data test skipped while KVBENCH_REQUIRE_DATA=1" in out.stdout
    assert "needs dataset 'wikitext2'" in out.stdout


def test_skips_stand_without_the_requirement(tmp_path):
    out = _run(tmp_path, require=False)
    assert out.returncode == 0, out.stdout
    assert "2 skipped" in out.stdout


def _ci_script() -> Path:
    return Path(__file__).resolve().parents[1] / ".ci" / "run"


def test_ci_script_parses():
    """``bash -n`` on ``.ci/run`` and every shell script in the repository: a syntax error there
    fails CI after 0 s, before any test runs."""
    root = _ci_script().parents[1]
    scripts = [_ci_script(), *sorted(p for p in root.rglob("*.sh") if ".venv" not in p.parts)]
    for script in scripts:
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script}: {out.stderr}"


def test_ci_script_finds_a_data_folder_beside_the_checkout(tmp_path):
    """Run the data-folder part of ``.ci/run`` (up to ``make lint``) on a fake checkout with a
    data folder where ``.ci/run`` looks for one (beside the checkout; ``.ci/run`` is the only file
    that names that path): it must export that folder and the requirement flag."""
    text = _ci_script().read_text()
    head = text.split("make lint", 1)[0]
    checkout = tmp_path / "repo"
    (checkout / ".ci").mkdir(parents=True)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (checkout / ".ci" / "run").write_text(
        head + 'echo "DATA=${KVBENCH_DATA_DIR:-} REQUIRE=${KVBENCH_REQUIRE_DATA:-}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBENCH_")}
    out = subprocess.run(
        ["bash", str(checkout / ".ci" / "run")], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert f"DATA={(tmp_path / 'shared' / 'data').resolve()} REQUIRE=1" in out.stdout
    # Without the folder nothing is exported.
    (tmp_path / "shared" / "data").rmdir()
    out = subprocess.run(
        ["bash", str(checkout / ".ci" / "run")], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "DATA= REQUIRE=" in out.stdout
