"""The docs as a reader meets them: every shell block parses as bash, the blocks marked to run
do run, and every relative link points at a file of the repository.

A block is a fenced ```bash / ```sh / ```shell block, or the ``$ `` command lines of a
```console block (with their ``\\`` continuations), in README.md, CONTRIBUTING.md and
docs/**/*.md.  ``bash -n`` checks each one (a recipe that aborts on a syntax error is a
broken recipe).  A block preceded by the line ``<!-- docs-test: run -->`` is also run with
bash from the repository root (``set -e``), and must exit 0.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_MARK = "<!-- docs-test: run -->"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    script: str
    run: bool

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def console_commands(body: str) -> str:
    """The ``$ `` command lines of a console block, continuations joined."""
    out: list[str] = []
    cont = False
    for line in body.splitlines():
        if cont:
            out.append(line)
            cont = line.rstrip().endswith("\\")
        elif line.startswith("$ "):
            out.append(line[2:])
            cont = line.rstrip().endswith("\\")
    return "\n".join(out) + ("\n" if out else "")


def blocks_of(path: Path) -> list[Block]:
    """The shell blocks of one Markdown file."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        lang, body = m.group(1), m.group(2)
        if lang in ("bash", "sh", "shell"):
            script = body
        elif lang == "console":
            script = console_commands(body)
        else:
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append(Block(path, line, lang, script, before == RUN_MARK))
    return out


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.exists()]


BLOCKS = [b for f in doc_files() for b in blocks_of(f)]


def test_docs_have_shell_blocks():
    assert len(BLOCKS) >= 10, [b.name for b in BLOCKS]
    assert any(b.lang == "console" for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_shell_block_parses(block: Block):
    r = subprocess.run(["bash", "-n"], input=block.script, text=True, capture_output=True)
    assert r.returncode == 0, f"{block.name}: bash -n: {r.stderr.strip()}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.run], ids=lambda b: b.name)
def test_marked_block_runs(block: Block):
    bindir = str(Path(sys.executable).parent)
    if shutil.which("kvbench", path=bindir) is None:
        pytest.skip("the kvbench command is not installed beside this Python")
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        ["bash", "-e"],
        input=block.script,
        text=True,
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, f"{block.name}: exit {r.returncode}\n{r.stderr[-2000:]}"


def test_extraction_finds_what_it_must(tmp_path):
    """The extractor sees a broken line in each kind of block, and the run mark."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n```bash\nexport A=/a b (c)\n```\n"
        f"{RUN_MARK}\n```console\n$ echo one \\\n  two\noutput (not a command\n$ true\n```\n"
        "```python\nnot shell (\n```\n"
    )
    found = blocks_of(doc)
    assert [(b.lang, b.line, b.run) for b in found] == [("bash", 2, False), ("console", 6, True)]
    assert found[1].script == "echo one \\\n  two\ntrue\n"
    bad = subprocess.run(["bash", "-n"], input=found[0].script, text=True, capture_output=True)
    assert bad.returncode != 0  # the cluster recipe's old `export X=/the local data folder (...)`
    ok = subprocess.run(["bash", "-n"], input=found[1].script, text=True, capture_output=True)
    assert ok.returncode == 0


LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(path: Path) -> list[str]:
    """Relative Markdown links of ``path`` whose file does not exist (anchors not checked)."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            out.append(
                f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {target}"
            )
    return out


def test_relative_links_resolve():
    bad = [b for f in doc_files() for b in broken_links(f)]
    assert not bad, bad


def test_link_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("[ok](a.md#x) [web](https://x.org) [bad](docs/design.md#y)\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert broken_links(tmp_path / "a.md") == ["a.md:1: docs/design.md#y"]
    finally:
        ROOT = root
