"""Build the local copy of a hub text (``kvbench data NAME``): the byte-exact file that the
loaders read from the data folder, made from a download the user has or from the hub.

A hub text (``wikitext2``: ``Salesforce/wikitext``, config ``wikitext-2-raw-v1``, split
``test``) is its rows' ``text`` column joined with ``"\\n\\n"``, as the GPTQ/KIVI perplexity
scripts build it.  The rows come from ``--from FILE`` (the split as the hub publishes it: a
``.parquet`` file, or ``.jsonl`` / ``.json`` rows with a ``text`` field) or, without a file, from
the hub (:func:`kvbench.data.loaders.hub_rows`).  The joined text must have the pinned SHA-256
of :mod:`kvbench.data.catalog`; it is then written atomically to ``<folder>/<spec.local>``
(``wikitext2/wiki.test.joined.txt``), where ``<folder>`` is ``--out``, else
``$KVBENCH_DATA_DIR``, else ``./data``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvbench.data.catalog import TEXTS, DatasetSpec
from kvbench.data.loaders import DATA_DIR_ENV, hub_rows, sha256_text
from kvbench.paths import atomic_file

#: the text column of a hub text's rows
TEXT_FIELD = "text"


class PrepareError(ValueError):
    """The rows cannot make the pinned text (wrong file, wrong split, edited copy)."""


def read_rows(path: Path) -> list[dict]:
    """Rows of ``path``: ``.parquet`` (through ``datasets``), ``.jsonl`` (one object a line) or
    ``.json`` (a list of objects).  Raises :class:`PrepareError` for another suffix."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import datasets

        return datasets.Dataset.from_parquet(str(path)).to_list()
    if suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    if suffix == ".json":
        rows = json.loads(path.read_text("utf-8"))
        if isinstance(rows, list):
            return rows
    raise PrepareError(
        f"{path}: rows must be a .parquet file, .jsonl lines or a .json list of objects with a "
        f"{TEXT_FIELD!r} field"
    )


def joined_text(rows: list[dict], where: str) -> str:
    """The rows' ``text`` joined with ``"\\n\\n"``; :class:`PrepareError` naming ``where`` when
    a row has no text."""
    try:
        return "\n\n".join(r[TEXT_FIELD] for r in rows)
    except (KeyError, TypeError) as exc:
        raise PrepareError(f"{where}: every row needs a {TEXT_FIELD!r} string") from exc


def target_folder(out: str | os.PathLike | None) -> Path:
    """``out``, else ``$KVBENCH_DATA_DIR``, else ``./data``."""
    return Path(out or os.environ.get(DATA_DIR_ENV) or "data")


def prepare_text(
    name: str, source: str | os.PathLike | None = None, out: str | os.PathLike | None = None
) -> Path:
    """Write the local copy of hub text ``name`` and return its path.

    Parameters
    ----------
    name : a text of :data:`kvbench.data.catalog.TEXTS` that has a hub source and a local file
        (``wikitext2``).
    source : a file of the rows (see :func:`read_rows`); ``None`` reads them from the hub.
    out : the data folder (see :func:`target_folder`).

    Raises
    ------
    kvbench.registry.UnknownName
        ``name`` is not a text.
    PrepareError
        ``name`` has no hub source or no local file (a packaged text needs no preparing), the rows
        lack a text field, or the joined text's SHA-256 differs from the pin (both hashes named).
    """
    spec: DatasetSpec = TEXTS.get(name)
    if not (spec.hub_id and spec.local):
        raise PrepareError(
            f"text {name!r} is not prepared from hub rows (it comes from "
            f"{spec.how_to_provide()}); texts to prepare: "
            f"{[n for n in TEXTS.names() if TEXTS.get(n).hub_id and TEXTS.get(n).local]}"
        )
    if source is None:
        where = f"hub {spec.hub_id} ({spec.config}, {spec.split})"
        rows = hub_rows(spec.hub_id, spec.config, spec.split or "test")
    else:
        where = str(source)
        rows = read_rows(Path(source))
    text = joined_text(rows, where)
    got = sha256_text(text)
    if got != spec.sha256:
        raise PrepareError(
            f"{where}: the joined text of {len(rows)} rows has sha256 {got}, but {name!r} is "
            f"pinned to {spec.sha256}: use the {spec.split} split of {spec.hub_id} "
            f"(config {spec.config}) as published"
        )
    dest = target_folder(out) / spec.local
    with atomic_file(dest, "wb") as f:
        f.write(text.encode("utf-8"))
    return dest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the text to prepare (wikitext2)")
    p.add_argument(
        "--from",
        dest="source",
        metavar="FILE",
        help="the published rows you downloaded (.parquet, .jsonl or .json); default: the hub",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help=f"the data folder to write into (default: ${DATA_DIR_ENV}, else ./data)",
    )


def main(args: argparse.Namespace) -> int:
    path = prepare_text(args.name, args.source, args.out)
    print(f"wrote {path}")
    print(f"export {DATA_DIR_ENV}={path.parents[len(Path(TEXTS.get(args.name).local).parts) - 1]}")
    return 0
