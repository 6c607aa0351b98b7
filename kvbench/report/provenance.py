"""Provenance of a result set: what produced its records, rendered at the top of every report.

:func:`provenance_block` renders a Markdown list from the records' ``manifest`` and the run log
of their folder (:func:`kvbench.bench.manifest.read_run_log`): the sweep's command, date, wall
time and load average, then one line per field of :data:`FIELDS`.  :func:`differences` lists the
fields in which two result sets differ (``kvbench compare`` warns with :func:`differences_text`):
numbers from another machine, commit or library version are not comparable without saying so.
What each line says and how disagreeing records read: docs/design.md#provenance.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvbench.bench.manifest import read_run_log
from kvbench.bench.records import Record

if TYPE_CHECKING:
    from kvbench.jsontypes import JSONValue

NOT_RECORDED = "not recorded"
MODEL_FREE = "none (model-free)"
RANDOM_WEIGHTS = "none (random weights)"


def _text(d: JSONValue, key: str) -> str | None:
    """``d[key]`` as text; ``"none"`` when present but null; ``None`` when absent."""
    if not isinstance(d, dict) or key not in d:
        return None
    return "none" if d[key] is None else str(d[key])


def _model_field(key: str, shape_text: str | None = None) -> Callable[[Record], str | None]:
    """A field of the loaded model's information (``manifest.model``), falling back to the
    suite's model entry; model-free records say so; ``shape_text`` for a shape model."""

    def get(r: Record) -> str | None:
        info = r.manifest.get("model") or {}
        if not r.model and not info:
            return MODEL_FREE
        if shape_text is not None and info.get("random_weights"):
            return shape_text
        got = _text(info, key)
        return got if got is not None else _text(r.model, {"model_id": "id"}.get(key, key))

    return get


def _gpu(r: Record) -> str | None:
    device = str(r.manifest.get("device", ""))
    return _text(r.manifest, "device_name") if device.startswith("cuda") else "none"


def _manifest(key: str) -> Callable[[Record], str | None]:
    return lambda r: _text(r.manifest, key)


#: record-level provenance fields: name -> the field's value in a record (``None``: not recorded)
FIELDS: dict[str, Callable[[Record], str | None]] = {
    "command": _manifest("command"),
    "kvbench": _manifest("kvbench_version"),
    "commit": _manifest("git_sha"),
    "model": _model_field("model_id"),
    "model sha256": _model_field("weights_sha256", RANDOM_WEIGHTS),
    "dtype": _model_field("dtype"),
    "python": _manifest("python"),
    "torch": _manifest("torch"),
    "transformers": _manifest("transformers"),
    "triton": _manifest("triton"),
    "CPU": _manifest("cpu_model"),
    "cores": _manifest("cpu_count"),
    "GPU": _gpu,
    "threads": _manifest("threads"),
}
#: fields left out of the block when no record has a value (a CPU-only sweep has no GPU)
OPTIONAL = {"GPU"}
#: fields shown as code
CODE = {"command", "commit", "model sha256"}


def values(records: list[Record]) -> dict[str, Counter[str]]:
    """Per field of :data:`FIELDS`: how many records have each value (:data:`NOT_RECORDED`
    for a record without it)."""
    return {name: Counter(get(r) or NOT_RECORDED for r in records) for name, get in FIELDS.items()}


def _show(name: str, value: str) -> str:
    special = value in (NOT_RECORDED, MODEL_FREE, RANDOM_WEIGHTS)
    return f"`{value}`" if name in CODE and not special else value


def _field_line(name: str, counts: Counter[str]) -> str | None:
    if name in OPTIONAL and set(counts) <= {"none", NOT_RECORDED}:
        return None
    if len(counts) == 1:
        return f"- {name}: {_show(name, next(iter(counts)))}"
    parts = ", ".join(
        f"{_show(name, v)} ({n} record{'s' if n != 1 else ''})" for v, n in sorted(counts.items())
    )
    return f"- {name}: differs between records: {parts}"


def _load(avg: list[float] | None) -> str | None:
    """Load averages (1, 5, 15 min) as ``"0.50/0.40/0.30"``; ``None`` when not recorded."""
    return "/".join(f"{x:.2f}" for x in avg) if avg else None


def _sweep_lines(
    records: list[Record], runs: list[dict[str, JSONValue]], wall_s: float | None
) -> list[str]:
    """Date (UTC), wall time and load average of the sweep: from the run log when there is
    one (first start to last end; wall times summed), else from the records (``created`` of
    the first and last; their runs' load averages)."""
    summed = ""
    if runs:
        first, last = runs[0], runs[-1]
        start, end = first.get("started"), last.get("ended")
        load0, load1 = first.get("loadavg_start"), last.get("loadavg_end")
        if wall_s is None and all(e.get("wall_s") is not None for e in runs):
            wall_s = sum(e["wall_s"] for e in runs)
            summed = f" over {len(runs)} `kvbench run` invocations" if len(runs) > 1 else ""
    else:
        by_time = sorted((r for r in records if r.created), key=lambda r: r.created)
        start = by_time[0].created if by_time else None
        end = by_time[-1].created if by_time else None
        load0 = by_time[0].manifest.get("loadavg_start") if by_time else None
        load1 = by_time[-1].manifest.get("loadavg_end") if by_time else None
    date = NOT_RECORDED if not start else start if start == end or not end else f"{start} to {end}"
    if wall_s is None:
        wall = NOT_RECORDED
    else:
        wall = (f"{wall_s:.1f} s" if wall_s < 60 else f"{wall_s / 60:.1f} min") + summed
    a, b = _load(load0), _load(load1)
    load = (
        NOT_RECORDED
        if a is None and b is None
        else f"{a or NOT_RECORDED} at the start, {b or NOT_RECORDED} at the end (1/5/15 min)"
    )
    return [f"- date (UTC): {date}", f"- wall time: {wall}", f"- load average: {load}"]


def provenance_block(
    records: list[Record],
    runs: list[dict[str, JSONValue]] | None = None,
    *,
    command: str | None = None,
    wall_s: float | None = None,
    machine: str | None = None,
) -> str:
    """Markdown list of the provenance of ``records`` (see the module docstring).

    ``runs``: the entries of the folder's run log (:func:`run_logs`), oldest first.
    ``command``, ``wall_s`` (seconds), ``machine``: given by the caller (``kvbench export
    --command/--wall-s/--machine``), they replace the recorded command and wall time, and add a
    ``machine`` line."""
    counts = values(records)
    if command is not None:
        counts["command"] = Counter({command: len(records)})
    lines = [_field_line("command", counts.pop("command"))]
    lines += _sweep_lines(records, runs or [], wall_s)
    if machine is not None:
        lines.append(f"- machine: {machine}")
    lines += [_field_line(name, c) for name, c in counts.items()]
    return "\n".join(line for line in lines if line is not None)


def run_logs(paths: list[str | Path]) -> list[dict[str, JSONValue]]:
    """The run-log entries of every result folder among ``paths`` (record files have none),
    ordered by start time."""
    out = [e for p in map(Path, paths) if p.is_dir() for e in read_run_log(p)]
    return sorted(out, key=lambda e: str(e.get("started", "")))


def differences(base: list[Record], new: list[Record]) -> list[tuple[str, list[str], list[str]]]:
    """The fields of :data:`FIELDS` whose sets of values differ between ``base`` and ``new``:
    ``(field, base values, new values)``, values sorted.  Per-run quantities (timestamps, wall
    times, load averages) are not fields and never differ here."""
    vb, vn = values(base), values(new)
    return [
        (name, sorted(vb[name]), sorted(vn[name]))
        for name in FIELDS
        if set(vb[name]) != set(vn[name])
    ]


def differences_text(diffs: list[tuple[str, list[str], list[str]]]) -> str:
    """The warning ``kvbench compare`` prints for :func:`differences` (empty when none)."""
    if not diffs:
        return ""
    lines = ["warning: BASE and NEW differ in provenance; their numbers may not be comparable:"]
    for name, b, n in diffs:
        show = ", ".join(_show(name, v) for v in b), ", ".join(_show(name, v) for v in n)
        lines.append(f"  {name}: {show[0]} (BASE) vs {show[1]} (NEW)")
    return "\n".join(lines)
