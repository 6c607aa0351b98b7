"""``kvbench export RESULTS --out FILE``: a compact, committable export of a result folder.

The export is one JSON file: ``{"export_version", "suite", "command", "machine", "wall_s",
"runs", "records"}`` where each record keeps ``run_id``, ``method``, ``config``, ``model``,
``workload``, ``metrics``, ``created`` and a manifest with machine-specific paths stripped (every
string that is an absolute path becomes ``<local>/<file name>``); ``per_layer`` data is dropped.
``runs`` holds the run-log entries of the result folders (``kvbench-run.jsonl``: command, start,
end, wall time, load average of each ``kvbench run``). The README's block, the provenance
(:mod:`kvbench.report.provenance`) above the headline table, is rendered from such a file
(:func:`readme_block`) and a test checks that the README shows exactly that rendering.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar

from kvbench.bench.manifest import cpu_model
from kvbench.bench.records import Record, load_records, write_atomic
from kvbench.report.headline import headline_table
from kvbench.report.provenance import provenance_block, run_logs
from kvbench.report.reading import reading

if TYPE_CHECKING:
    from kvbench.jsontypes import JSONValue

EXPORT_VERSION = 1
BEGIN = "<!-- kvbench-headline:begin {path} -->"
END = "<!-- kvbench-headline:end -->"
_ABS = re.compile(r"^(/|~|[A-Za-z]:[\\/])")
KEEP = ("run_id", "method", "config", "model", "workload", "metrics", "created")

#: a JSON value :func:`strip_paths` returns in the same shape
J = TypeVar("J", bound="JSONValue")


class Export(TypedDict):
    """An export file's object (module docstring): ``records`` are record JSON objects of the
    fields :data:`KEEP` plus the stripped ``manifest``; ``runs`` the run-log entries; ``wall_s``
    seconds; ``suite`` one path, or the sorted paths when the records name several."""

    export_version: int
    suite: str | list[str]
    command: str
    machine: str
    wall_s: float | None
    runs: list[dict[str, JSONValue]]
    records: list[dict[str, JSONValue]]


def strip_paths(obj: J) -> J:
    """``obj`` with every absolute path string replaced by ``<local>/<name>`` (recursively);
    dicts, lists and strings keep their shape."""
    if isinstance(obj, dict):
        return {k: strip_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [strip_paths(v) for v in obj]
    if isinstance(obj, str) and _ABS.match(obj):
        return "<local>/" + Path(obj.rstrip("/\\")).name
    return obj


def machine() -> str:
    """A one-line description of this machine: OS, CPU model, cores."""
    return f"{platform.system()} {platform.machine()}, {cpu_model()}, {os.cpu_count()} cores"


def make_export(
    records: list[Record],
    command: str,
    machine_desc: str,
    wall_s: float | None,
    runs: list[dict[str, JSONValue]] | None = None,
) -> Export:
    """The export dict of ``records`` (sorted by run id, so a rerun gives the same file);
    ``runs``: the run-log entries of their folders (:func:`kvbench.report.provenance.run_logs`),
    paths stripped like the manifests'."""
    recs = []
    for r in sorted(records, key=lambda r: r.run_id):
        data = r.to_json()
        out = {k: data[k] for k in KEEP}
        out["manifest"] = strip_paths(r.manifest)
        recs.append(out)
    suites = sorted({str(r.manifest.get("suite")) for r in records})
    return {
        "export_version": EXPORT_VERSION,
        "suite": strip_paths(suites[0]) if len(suites) == 1 else strip_paths(suites),
        "command": command,
        "machine": machine_desc,
        "wall_s": wall_s,
        "runs": strip_paths(runs or []),
        "records": recs,
    }


def load_export(path: str | Path) -> Export:
    """Read an export file; ValueError for another format or version."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("export_version") != EXPORT_VERSION:
        raise ValueError(f"{path}: not a kvbench export (export_version {EXPORT_VERSION})")
    return data


def readme_block(export_path: str | Path, rel: str) -> str:
    """The README block for the export at ``export_path`` (``rel``: its path in the repository):
    begin marker, the provenance (:func:`~kvbench.report.provenance.provenance_block` of the
    records and run log, with the export's command, wall time and machine) and the records' path,
    the headline table, its reading (:func:`~kvbench.report.reading.reading`, links from the
    repository's root, where the README is), end marker."""
    data = load_export(export_path)
    records = [Record.from_json(r) for r in data["records"]]
    head = provenance_block(
        records,
        data.get("runs"),
        command=data["command"],
        wall_s=data.get("wall_s"),
        machine=data["machine"],
    )
    return "\n".join(
        [
            BEGIN.format(path=rel),
            "#### Provenance",
            "",
            f"{head}\n- records: `{rel}`",
            "",
            headline_table(records),
            "",
            reading(records, root=""),
            END,
        ]
    )


def readme_blocks(text: str) -> dict[str, str]:
    """Every headline block in a README text: export path -> the block, markers included."""
    block = r"<!-- kvbench-headline:begin (\S+) -->.*?<!-- kvbench-headline:end -->"
    return {m.group(1): m.group(0) for m in re.finditer(block, text, flags=re.S)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="result folder(s) or record files")
    p.add_argument("--out", required=True, help="export JSON file to write")
    p.add_argument("--command", required=True, help="the command that produced the records")
    p.add_argument("--wall-s", type=float, default=None, help="wall time of that command (s)")
    p.add_argument("--machine", default=None, help="machine description (default: this one)")
    p.add_argument(
        "--readme-block",
        default=None,
        metavar="REL",
        help="also print the README block for the export, naming it REL in the repository",
    )


def main(args: argparse.Namespace) -> int:
    records = load_records(args.results)
    if not records:
        raise ValueError(f"no records in {args.results}")
    runs = run_logs(args.results)
    data = make_export(records, args.command, args.machine or machine(), args.wall_s, runs)
    write_atomic(args.out, data)
    print(f"wrote {args.out} ({len(data['records'])} records)")
    if args.readme_block:
        print(readme_block(args.out, args.readme_block))
    return 0
