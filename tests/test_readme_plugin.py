"""The plugin guide's "A complete plugin" (docs/plugins.md; the README links to it) works from
the page alone: its code blocks are extracted, written as a package to a temporary folder,
registered through a dist-info (the entry point comes from the page's own pyproject.toml), and
`kvbench bits` and a tiny suite run on it.  The examples/ folder must hold exactly the page's
files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


GUIDE = ROOT / "docs" / "plugins.md"


def guide_files() -> dict[str, str]:
    """``{relative path: text}`` of the code blocks of the "A complete plugin" section of
    docs/plugins.md whose first line is a comment naming the file."""
    text = GUIDE.read_text()
    section = text.split("## A complete plugin\n", 1)[1].split("\n## ", 1)[0]
    files = {}
    for body in re.findall(r"```(?:python|toml)\n(.*?)```", section, flags=re.S):
        first, rest = body.split("\n", 1)
        m = re.fullmatch(r"# (\S+\.(?:py|toml))", first.strip())
        if m:
            files[m.group(1)] = rest
    return files


def test_guide_has_the_whole_plugin_and_examples_match() -> None:
    files = guide_files()
    assert set(files) == {"kvbench_example_plugin/__init__.py", "pyproject.toml"}
    example = ROOT / "examples" / "kvbench-example-plugin"
    for rel, text in files.items():
        assert (example / rel).read_text() == text, f"examples/ differs from docs/plugins.md: {rel}"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """The guide's plugin on a fresh path, registered by a dist-info built from its toml."""
    root = tmp_path_factory.mktemp("plugin")
    files = guide_files()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    meta = tomllib.loads(files["pyproject.toml"])["project"]
    dist = root / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
    )
    eps = meta["entry-points"]["kvbench.methods"]
    (dist / "entry_points.txt").write_text(
        "[kvbench.methods]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
    )
    return root


def kvbench(plugin_path: Path, *args: str, warnings: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{plugin_path}{os.pathsep}{ROOT}"}
    if warnings:  # e.g. "always": show DeprecationWarnings raised outside __main__
        env["PYTHONWARNINGS"] = f"{warnings}::DeprecationWarning"
    return subprocess.run(
        [sys.executable, "-m", "kvbench.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=plugin_path,
    )


def test_the_plugin_is_the_guides(plugin_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{plugin_path}{os.pathsep}{ROOT}"}
    code = (
        "import kvbench, kvbench_example_plugin as p; "
        "print(p.__file__); print(type(kvbench.get_method('example-sign')).__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    path, module = out.stdout.split()
    assert Path(path).is_relative_to(plugin_path) and module == "kvbench_example_plugin"


@pytest.mark.parametrize(
    ("sets", "key_bits"),
    [
        # b + m_q / group: one float16 scale per 128-channel group (G = 128 = D)
        (["bits=3"], 3 + 16 / 128),
        # a float32 scale is 32 bits wide
        (["bits=3", "scale_dtype=float32"], 3 + 32 / 128),
        (["bits=2", "group_size=32"], 2 + 16 / 32),
    ],
)
def test_bits_on_the_guide_plugin(plugin_path: Path, sets: list[str], key_bits: float) -> None:
    args = [a for s in sets for a in ("--set", s)]
    out = kvbench(plugin_path, "bits", "example-sign", *args, "--json", warnings="always")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["key_bits"] == pytest.approx(key_bits, abs=1e-12)
    # the bits come from the codec's stored layout, not a deprecated key_bit_terms override
    assert "key_bit_terms is deprecated" not in out.stderr


@pytest.mark.parametrize("bits", ["0", "1", "3.5", "9", "16"])
def test_the_core_checks_reject_bad_bits(plugin_path: Path, bits: str) -> None:
    out = kvbench(plugin_path, "bits", "example-sign", "--set", f"bits={bits}")
    want = f"SignMagnitudeConfig: field 'bits': {bits} is not allowed; allowed: integers 2..8"
    assert out.returncode == 2 and want in out.stderr, out.stderr  # the plugin's own rule
    assert "1..8 or 16" not in out.stderr and "Traceback" not in out.stderr


def test_a_tiny_suite_on_the_guide_plugin(plugin_path: Path) -> None:
    suite = {
        "name": "plugin",
        "model": "none",
        "threads": 1,
        "methods": [
            "full",
            {"name": "example-sign", "config": {"bits": [2, 8], "residual_length": 16}},
        ],
        "workloads": [
            {"type": "bits", "head_dim": 64, "tokens": 1024},
            {
                "type": "memory",
                "source": "synthetic",
                "context": 96,
                "appends": 2,
                "num_layers": 1,
                "num_heads": 2,
                "num_kv_heads": 1,
                "head_dim": 64,
                "dtype": "float32",
            },
        ],
    }
    path = plugin_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = kvbench(
        plugin_path, "run", str(path), "--out", str(plugin_path / "res"), "--quiet", "--json"
    )
    assert out.returncode == 0, out.stderr
    recs = {
        (r["label"], r["workload"]["type"]): r["metrics"] for r in json.loads(out.stdout)["records"]
    }
    assert recs[("example-sign[bits=2]", "bits")]["nominal_key_bits"] == 2 + 16 / 64
    # measured: 8-bit codes hold more bytes than 2-bit ones, both fewer than float32 full
    mem = {lab: m["bytes_total"] for (lab, t), m in recs.items() if t == "memory"}
    assert mem["example-sign[bits=2]"] < mem["example-sign[bits=8]"] < mem["full"]
