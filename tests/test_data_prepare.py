"""``kvbench data NAME --from FILE``: the byte-exact local copy of a hub text from the rows a user
downloaded (kvbench.data.prepare).  A stand-in text is registered with the SHA-256 of the rows
joined by hand, so the test needs no download; the real ``wikitext2`` pin is checked on the copy
in the data folder when one is given."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kvbench.cache.registry import get_method  # noqa: F401 - the CLI's import graph, loaded once
from kvbench.cli import main
from kvbench.data import prepare
from kvbench.data.catalog import TEXTS, DatasetSpec
from kvbench.data.loaders import load_text

ROWS = [{"text": " = Title = \n"}, {"text": ""}, {"text": " A line , with @-@ marks .\n"}]
#: joined by hand: "\n\n" between the three rows
JOINED = " = Title = \n" + "\n\n" + "" + "\n\n" + " A line , with @-@ marks .\n"


@pytest.fixture
def toy_text():
    spec = DatasetSpec(
        "toy-wiki",
        "text",
        hashlib.sha256(JOINED.encode()).hexdigest(),
        hub_id="example/toy-wiki",
        config="raw",
        split="test",
        local="toywiki/joined.txt",
    )
    TEXTS.register(spec.name, spec)
    yield spec
    TEXTS.unregister(spec.name)


def write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_rows_file_becomes_the_byte_exact_local_copy(tmp_path, toy_text, suffix):
    src = write_rows(tmp_path / f"test{suffix}", ROWS)
    dest = prepare.prepare_text("toy-wiki", src, tmp_path / "data")
    assert dest == tmp_path / "data" / "toywiki" / "joined.txt"
    assert dest.read_bytes() == JOINED.encode()
    text, info = load_text("toy-wiki", data_dir=tmp_path / "data")  # the loader accepts it
    assert text == JOINED and info["source"] == "local"
    assert [p.name for p in dest.parent.iterdir()] == ["joined.txt"]  # no temporary left


def test_other_rows_are_refused_naming_both_hashes(tmp_path, toy_text):
    src = write_rows(tmp_path / "train.jsonl", ROWS[:2])
    with pytest.raises(prepare.PrepareError) as err:
        prepare.prepare_text("toy-wiki", src, tmp_path / "data")
    got = hashlib.sha256("\n\n".join(r["text"] for r in ROWS[:2]).encode()).hexdigest()
    assert got in str(err.value) and toy_text.sha256 in str(err.value)
    assert "test split of example/toy-wiki" in str(err.value)
    assert not (tmp_path / "data").exists()


def test_rows_without_text_and_odd_files_are_refused(tmp_path, toy_text):
    with pytest.raises(prepare.PrepareError, match="'text' string"):
        prepare.prepare_text("toy-wiki", write_rows(tmp_path / "r.jsonl", [{"x": 1}]), tmp_path)
    odd = tmp_path / "rows.csv"
    odd.write_text("text\nx\n")
    with pytest.raises(prepare.PrepareError, match=r"\.parquet file, \.jsonl lines"):
        prepare.prepare_text("toy-wiki", odd, tmp_path)


def test_packaged_texts_need_no_preparing():
    with pytest.raises(prepare.PrepareError, match=r"texts to prepare: \['wikitext2'\]"):
        prepare.prepare_text("essays")


def test_cli_writes_into_the_data_folder_and_says_what_to_export(
    tmp_path, toy_text, monkeypatch, capsys
):
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(tmp_path / "d"))
    src = write_rows(tmp_path / "test.parquet", ROWS)
    assert main(["data", "toy-wiki", "--from", str(src)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"wrote {tmp_path / 'd' / 'toywiki' / 'joined.txt'}",
        f"export KVBENCH_DATA_DIR={tmp_path / 'd'}",
    ]
    assert (tmp_path / "d" / "toywiki" / "joined.txt").read_bytes() == JOINED.encode()


def test_the_real_wikitext2_pin_matches_the_copy_in_the_data_folder():
    folder = os.environ.get("KVBENCH_DATA_DIR")
    path = Path(folder or "/nonexistent") / TEXTS.get("wikitext2").local
    if not path.is_file():
        pytest.skip("no WikiText-2 copy in KVBENCH_DATA_DIR")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == TEXTS.get("wikitext2").sha256
