"""The docs as a reader meets them: every shell block parses as bash, the blocks marked to run
do run, every relative link points at a file of the repository, and every name and path the
docs cite exists.

A block is a fenced ```bash / ```sh / ```shell block, or the ``$ `` command lines of a
```console block (with their ``\\`` continuations), in README.md, CONTRIBUTING.md and
docs/**/*.md.  ``bash -n`` checks each one (a recipe that aborts on a syntax error is a
broken recipe).  A block preceded by the line ``<!-- docs-test: run -->`` is also run with
bash from the repository root (``set -e``), and must exit 0.

Cited names (:func:`cited_names`): in those files every dotted name of the package
(``kvbench.cache.layer.LayerCache``, in a code span or a fenced block) imports as a module or
resolves as module + attributes, and a code span that starts with a module of ``kvbench/`` or
``methods/`` (``semkv.MixedTokenCodec``) resolves under ``kvbench.methods.`` or ``kvbench.``;
every repository path in a code span (``kvbench/...``, ``methods/...``, ``tests/...``,
``suites/...``, ``benchmarks/...``, ``docs/...``, ``kernels/...``, ``examples/...``, also as
``path:line``, ``path::test`` or ``path#anchor``) exists.  The docstrings of ``kvbench/``,
``methods/`` and ``kernels/`` get the same name check for their ````kvbench.…```` names and
Sphinx roles.  ``X.md#anchor`` references, in the docs and in the Python sources' text, name a
heading of X.  :data:`TO_CREATE` and :data:`RECORDED` list the only exceptions.
"""

from __future__ import annotations

import ast
import importlib
import os
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


# ----------------------------------------------------------------- names and paths the docs cite

#: files and names the guides present for the reader to create, not files of this repository
TO_CREATE = frozenset(
    {
        "methods/my_method.py",  # CONTRIBUTING.md: a built-in method's file
        "tests/methods/test_my_method.py",  # CONTRIBUTING.md: its tests
        "kvbench.methods.my_method.MyMethod",  # CONTRIBUTING.md: its entry point
        "kvbench.kernels.my_backend.BACKEND",  # CONTRIBUTING.md: a backend's entry point
    }
)
#: (doc, name) that a measured record keeps as it was when measured (a rerun renews it)
RECORDED = {
    ("docs/mutation.md", "kvbench.cache.blocks.xǁAffineBlockǁexpanded"): (
        "mutmut's name in the survivor table's run; 7e0758e merged it into expand_groups"
    ),
}

FENCED = re.compile(r"^```.*?^```", re.M | re.S)
#: an inline code span (may wrap a line, never a paragraph)
CODE_SPAN = re.compile(r"(?<!`)`([^`]+?)`(?!`)")
#: a dotted name of the package; ``module:attr`` (an entry-point value) is module + attribute
KV_NAME = re.compile(r"(?<![\w./-])~?(kvbench(?:\.\w+)+)(?::(\w+))?")
#: a code span that starts with a dotted name (``semkv.MixedTokenCodec(...)``)
LEADING_NAME = re.compile(r"~?([a-z_]\w*)((?:\.\w+)+)")
#: a file name, not a module path (``cli.py``, ``methods.md``)
FILE_NAME = re.compile(r"\w+\.(?:py|md|yaml|yml|json|toml|txt|sh|c|so)$")
REPO_PATH = re.compile(
    r"(?<![\w./~$-])((?:kvbench|methods|tests|suites|benchmarks|docs|kernels|examples)/"
    r"[^\s`'\"),;]*)"
)
#: a mutmut mutant's key: ``x_func`` or ``xǁClassǁmethod`` (``__mutmut_N`` optional)
MUTMUT_METHOD = re.compile(r"xǁ(\w+?)ǁ(\w+?)(?:__mutmut_\d+)?")
MUTMUT_FUNC = re.compile(r"x_(\w+?)(?:__mutmut_\d+)?")
#: a docstring's ````kvbench.…```` name, or a Sphinx role's ``:class:`~kvbench.…```
DOCSTRING_NAMES = (
    re.compile(r"``~?(kvbench(?:\.\w+)+)(?::(\w+))?"),
    re.compile(r":\w+:`~?(kvbench(?:\.\w+)+)()`"),
)
MD_ANCHOR = re.compile(r"([\w./-]*\.md)#([\w-]+)")


@dataclass(frozen=True)
class Citation:
    """A name or path cited at ``where`` (``doc:line``)."""

    where: str
    text: str


def entry_point_groups() -> frozenset[str]:
    """The entry-point groups of pyproject.toml (``kvbench.methods``, ...): names, not modules."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return frozenset(re.findall(r'^\[project\.entry-points\."([^"]+)"\]', text, re.M))


def package_modules() -> frozenset[str]:
    """The first components a short name may start with: modules of kvbench/ and methods/."""
    out = set()
    for folder in (ROOT / "kvbench", ROOT / "methods"):
        for p in folder.iterdir():
            if p.suffix == ".py" or (p / "__init__.py").exists():
                out.add(p.stem)
    return frozenset(out - {"__init__"})


def mutmut_target(name: str) -> str:
    """``pkg.mod.xǁClassǁmethod__mutmut_3`` -> ``pkg.mod.Class.method`` (else ``name``)."""
    head, _, last = name.rpartition(".")
    if m := MUTMUT_METHOD.fullmatch(last):
        return f"{head}.{m.group(1)}.{m.group(2)}"
    if m := MUTMUT_FUNC.fullmatch(last):
        return f"{head}.{m.group(1)}"
    return name


def resolve(name: str) -> str | None:
    """``None`` when ``name`` imports as a module or resolves as module + attributes, else why
    not."""
    parts = mutmut_target(name).split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue  # not a module: an attribute of the shorter prefix
            return f"importing {module} failed: {e}"
        for k, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[: i + k])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def code_spans(text: str) -> list[tuple[int, str]]:
    """``(line, content)`` of the inline code spans outside fenced blocks."""
    blanked = FENCED.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return [
        (line_of(blanked, m.start()), m.group(1))
        for m in CODE_SPAN.finditer(blanked)
        if "\n\n" not in m.group(1)
    ]


def cited_names(path: Path) -> list[Citation]:
    """The Python names ``path`` cites, each as it must resolve (``kvbench.…``; a short name
    as ``kvbench.methods.X|kvbench.X``)."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT).as_posix()
    out = []
    for m in FENCED.finditer(text):
        for n in KV_NAME.finditer(m.group(0)):
            name = n.group(1) + (f".{n.group(2)}" if n.group(2) else "")
            out.append(Citation(f"{rel}:{line_of(text, m.start() + n.start())}", name))
    short = package_modules()
    for line, span in code_spans(text):
        for n in KV_NAME.finditer(span):
            name = n.group(1) + (f".{n.group(2)}" if n.group(2) else "")
            out.append(Citation(f"{rel}:{line}", name))
        m = LEADING_NAME.match(span.strip())
        if m and m.group(1) in short and not FILE_NAME.match(span.strip()):
            name = m.group(1) + m.group(2)
            out.append(Citation(f"{rel}:{line}", f"kvbench.methods.{name}|kvbench.{name}"))
    return sorted(out, key=lambda c: int(c.where.rpartition(":")[2]))


def cited_paths(path: Path) -> list[Citation]:
    """The repository paths in ``path``'s code spans, ``:line``, ``::test`` and ``#anchor``
    cut off (placeholders with ``<...>`` or ``{...}`` left out)."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT).as_posix()
    out = []
    for line, span in code_spans(text):
        for m in REPO_PATH.finditer(span):
            target = re.split(r"::|#|:(?=\d)", m.group(1))[0].rstrip(".:")
            if not re.search(r"[<>{}]", target):
                out.append(Citation(f"{rel}:{line}", target))
    return out


def name_error(c: Citation, groups: frozenset[str]) -> str | None:
    """Why ``c`` (a name, or alternatives joined by ``|``) does not resolve, or ``None``."""
    if c.text in groups or c.text in TO_CREATE or (c.where.split(":")[0], c.text) in RECORDED:
        return None
    errors = []
    for alternative in c.text.split("|"):
        if (err := resolve(alternative)) is None:
            return None
        errors.append(err)
    return "; ".join(errors)


def path_missing(c: Citation) -> bool:
    if c.text in TO_CREATE:
        return False
    if "*" in c.text:
        return not any(ROOT.glob(c.text))
    return not (ROOT / c.text).exists()


def stale_names(files: list[Path]) -> list[str]:
    groups = entry_point_groups()
    out = []
    for f in files:
        for c in cited_names(f):
            if (err := name_error(c, groups)) is not None:
                out.append(f"{c.where}: `{c.text}`: {err}")
    return out


def stale_paths(files: list[Path]) -> list[str]:
    return [
        f"{c.where}: `{c.text}` does not exist"
        for f in files
        for c in cited_paths(f)
        if path_missing(c)
    ]


def test_cited_names_resolve():
    bad = stale_names(doc_files())
    assert not bad, "names the docs cite that do not resolve:\n" + "\n".join(bad)


def test_cited_paths_exist():
    bad = stale_paths(doc_files())
    assert not bad, "paths the docs cite that do not exist:\n" + "\n".join(bad)


def source_files(*tops: str) -> list[Path]:
    """The .py files under ``tops`` (symlinked folders, ``kvbench/methods`` -> ``methods/``,
    not followed: each file once)."""
    out = []
    for top in tops:
        for folder, dirs, files in os.walk(ROOT / top):
            dirs[:] = sorted(d for d in dirs if not (Path(folder) / d).is_symlink())
            out += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return out


def docstring_names(path: Path) -> list[Citation]:
    """The ````kvbench.…```` names and Sphinx-role targets of ``path``'s docstrings."""
    rel = path.relative_to(ROOT).as_posix()
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc:
            continue
        first = node.body[0].lineno
        for rx in DOCSTRING_NAMES:
            for m in rx.finditer(doc):
                name = m.group(1) + (f".{m.group(2)}" if m.group(2) else "")
                out.append(Citation(f"{rel}:{first + doc.count(chr(10), 0, m.start())}", name))
    return out


def test_docstring_names_resolve():
    groups = entry_point_groups()
    bad = [
        f"{c.where}: ``{c.text}``: {err}"
        for f in source_files("kvbench", "methods", "kernels")
        for c in docstring_names(f)
        if (err := name_error(c, groups)) is not None
    ]
    assert not bad, "names docstrings cite that do not resolve:\n" + "\n".join(bad)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces -> ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (repeats numbered ``-1``, ``-2``, as GitHub does)."""
    text = FENCED.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a (?:name|id)="([^"]+)"', text))
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        s = slug(m.group(1))
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.add(s if k == 0 else f"{s}-{k}")
    return out


def stale_anchors(files: list[Path]) -> list[str]:
    """``X.md#anchor`` references of ``files`` (X relative to the file, the repository or
    docs/) whose X has no such heading; ``(#anchor)`` links within a Markdown file too."""
    out = []
    cache: dict[Path, set[str]] = {}
    for f in files:
        text = f.read_text(encoding="utf-8")
        refs = [(m.start(), m.group(1), m.group(2)) for m in MD_ANCHOR.finditer(text)]
        if f.suffix == ".md":
            refs += [(m.start(), "", m.group(1)) for m in re.finditer(r"\]\(#([\w-]+)\)", text)]
        for pos, target, anchor in refs:
            if not target:
                doc = f
            else:
                found = [p for p in (f.parent / target, ROOT / target, ROOT / "docs" / target)]
                doc = next((p for p in found if p.is_file()), None)
                if doc is None:
                    continue  # a missing file: the link and path checks report it
            if anchor not in cache.setdefault(doc, anchors(doc)):
                where = f"{f.relative_to(ROOT).as_posix()}:{line_of(text, pos)}"
                out.append(f"{where}: {target or f.name}#{anchor}: no such heading")
    return out


def test_cited_anchors_exist():
    files = doc_files() + source_files("kvbench", "methods", "kernels", "benchmarks")
    bad = stale_anchors(files)
    assert not bad, "anchors cited that no heading has:\n" + "\n".join(bad)


def test_citation_checks_see_stale_names(tmp_path, monkeypatch):
    """Each check names the doc, the line and what is stale; a placeholder and a group pass."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "x.md").write_text(
        "# Top\n\nSee `kvbench.cache.layer.LayerCache` and `semkv.MixedTokenCodec`,\n"
        "`kvbench.cache.layer.NoSuchCache`, `semkv.MixedCodec(bits)` and `kvbench.methods`.\n"
        "Files: `kvbench/cache/layer.py:12`, `methods/no_such.py#x`, `tests/<name>.py`,\n"
        "`methods/my_method.py`, `kvbench.testing.check_method(method)`.\n\n"
        "```python\nfrom kvbench.no_such import thing\n```\n"
        "[a](#top) [b](#bottom) `docs/x.md#top`\n",
        encoding="utf-8",
    )
    for rel in ("kvbench", "methods", "pyproject.toml"):
        (tmp_path / rel).symlink_to(ROOT / rel)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    doc = docs / "x.md"
    names = stale_names([doc])
    assert [n.split(": ")[0] + ": " + n.split(": ")[1] for n in names] == [
        "docs/x.md:4: `kvbench.cache.layer.NoSuchCache`",
        "docs/x.md:4: `kvbench.methods.semkv.MixedCodec|kvbench.semkv.MixedCodec`",
        "docs/x.md:9: `kvbench.no_such`",
    ], names
    assert names[0].endswith("kvbench.cache.layer has no attribute 'NoSuchCache'")
    assert stale_paths([doc]) == ["docs/x.md:5: `methods/no_such.py` does not exist"]
    assert stale_anchors([doc]) == ["docs/x.md:11: x.md#bottom: no such heading"]
    assert mutmut_target("kvbench.cache.layer.xǁSideǁflush__mutmut_7") == (
        "kvbench.cache.layer.Side.flush"
    )
    assert resolve(mutmut_target("kvbench.cache.quant.x_pack_bits")) is None
