"""``kvbench compare BASE NEW [--fail-on METRIC:THRESHOLD ...]``: the regression gate of
docs/design.md#regression-gate (result folders or record files, runs matched by ``run_id``,
``5%`` relative to BASE or ``0.01`` absolute; exit 1 on a regression or a BASE run missing from
NEW), warning on stderr where the sets differ in provenance (docs/design.md#provenance).

Runs are named by their label and workload (``kivi[bits=2] / fidelity (prefill=1152,
tokens=1280)``).  Only metrics that moved are listed: a relative change of at least
``--min-change`` (default 0.01%), or any change from an exact 0.  ``--json`` prints one object
(changes, failures, counts, ``provenance_differs``).  A metric whose direction is ``none`` fails
when it moves either way.  Two single records of different runs are an error that names the
differing keys; two sets with no run in common are an error (exit 2) that says how many records
each side has.  The provenance warning never changes the exit status.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from kvbench.bench.metrics import HIGHER, NONE, direction
from kvbench.bench.records import Record, RecordError, load_records
from kvbench.registry import did_you_mean
from kvbench.report.provenance import differences, differences_text
from kvbench.report.tables import workload_label

if TYPE_CHECKING:
    from kvbench.jsontypes import JSONValue


def declared_names() -> list[str]:
    """Every metric name the registered workloads declare literally (no ``*`` patterns)."""
    from kvbench.bench.workloads import WORKLOADS, declared_metrics

    for kind in WORKLOADS.names():
        WORKLOADS.get(kind)
    names = {m for c in WORKLOADS.loaded().values() for m in declared_metrics(c)}
    return sorted(m for m in names if "*" not in m)


@dataclass(frozen=True)
class Gate:
    """One ``METRIC:THRESHOLD`` rule."""

    metric: str
    threshold: float
    relative: bool

    @classmethod
    def parse(cls, text: str) -> Gate:
        if ":" not in text:
            raise ValueError(f"--fail-on expects METRIC:THRESHOLD (e.g. attn_kl:5%), got {text!r}")
        metric, thr = text.rsplit(":", 1)
        if direction(metric) is None:
            hint = did_you_mean(metric, declared_names(), cutoff=0.6)
            raise ValueError(
                f"--fail-on: unknown metric {metric!r}: no workload declares it{hint} (each "
                "workload declares its metrics in its METRICS class attribute)"
            )
        relative = thr.endswith("%")
        try:
            value = float(thr[:-1]) / 100 if relative else float(thr)
        except ValueError:
            raise ValueError(
                f"--fail-on: threshold {thr!r} must be a number or a percentage"
            ) from None
        if value < 0:
            raise ValueError(f"--fail-on: threshold {thr!r} must be >= 0")
        return cls(metric, value, relative)

    def regressed(self, base: float, new: float) -> bool:
        """Did ``new`` move past the threshold in the metric's bad direction?"""
        if math.isnan(new) and not math.isnan(base):
            return True
        d = direction(self.metric)
        worse = abs(new - base) if d == NONE else (base - new) if d == HIGHER else (new - base)
        limit = self.threshold * abs(base) if self.relative else self.threshold
        return worse > limit + 1e-12 * max(abs(base), 1.0)


class Change(TypedDict):
    """One metric that moved between a BASE and a NEW run (:func:`changes`): ``relative`` is
    (new - base) / |base|, ``None`` from a base of 0 or with a NaN."""

    run: str
    run_id: str
    metric: str
    base: float
    new: float
    relative: float | None


def run_keys(r: Record) -> dict[str, JSONValue]:
    """What defines a run (hashed into its ``run_id``): model, method, config, workload."""
    return {"model": r.model, "method": r.method, "config": r.config, "workload": r.workload}


def _diff_keys(a: JSONValue, b: JSONValue, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def run_name(r: Record) -> str:
    """A run as a reader knows it: its label and workload."""
    return f"{r.label} / {workload_label(r.workload)}"


def moved(b: float, n: float, min_change: float) -> bool:
    """Whether a metric moved: both NaN is no move; from 0 any change; else a relative change
    of at least ``min_change``."""
    if math.isnan(b) and math.isnan(n):
        return False
    if math.isnan(b) or math.isnan(n):
        return True
    if b == 0:
        return n != 0
    return abs(n - b) / abs(b) >= min_change


def changes(
    base: list[Record], new: list[Record], gates: list[Gate], min_change: float = 1e-4
) -> tuple[list[Change], list[str]]:
    """Return (changes, failure lines); a change is ``{"run", "run_id", "metric", "base",
    "new", "relative"}``."""
    if len(base) == 1 and len(new) == 1 and base[0].run_id != new[0].run_id:
        keys = _diff_keys(run_keys(base[0]), run_keys(new[0]))
        raise ValueError(f"the two records are different runs; differing keys: {keys}")
    by_id = {r.run_id: r for r in new}
    out: list[Change] = []
    failures: list[str] = []
    for rb in base:
        rid, name = rb.run_id, run_name(rb)
        rn = by_id.get(rid)
        if rn is None:
            failures.append(f"{name}: missing from NEW (run {rid})")
            continue
        for metric in sorted(set(rb.metrics) & set(rn.metrics)):
            b, n = float(rb.metrics[metric]), float(rn.metrics[metric])
            if moved(b, n, min_change):
                rel = (n - b) / abs(b) if b and not math.isnan(b + n) else None
                out.append(
                    {
                        "run": name,
                        "run_id": rid,
                        "metric": metric,
                        "base": b,
                        "new": n,
                        "relative": rel,
                    }
                )
        for g in gates:
            if g.metric in rb.metrics and g.metric in rn.metrics:
                b, n = float(rb.metrics[g.metric]), float(rn.metrics[g.metric])
                if g.regressed(b, n):
                    thr = f"{g.threshold:.2%}" if g.relative else f"{g.threshold:g}"
                    failures.append(f"{name} {g.metric}: {b:.6g} -> {n:.6g} exceeds {thr}")
    return out, failures


def compare(
    base: list[Record], new: list[Record], gates: list[Gate], min_change: float = 1e-4
) -> tuple[list[str], list[str]]:
    """Return (report lines, failure lines)."""
    found, failures = changes(base, new, gates, min_change)
    lines = []
    for c in found:
        rel = f" ({c['relative']:+.2%})" if c["relative"] is not None else ""
        lines.append(f"{c['run']} {c['metric']}: {c['base']:.6g} -> {c['new']:.6g}{rel}")
    return lines, failures


def _fraction(text: str) -> float:
    try:
        v = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or a percentage") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", help="result folder or record file (the reference)")
    p.add_argument("new", help="result folder or record file (the candidate)")
    p.add_argument(
        "--fail-on",
        action="append",
        default=[],
        metavar="METRIC:THRESHOLD",
        help="e.g. attn_kl:5%% (relative) or bytes_total:0 (absolute)",
    )
    p.add_argument(
        "--min-change",
        type=_fraction,
        default=1e-4,
        metavar="FRACTION",
        help="smallest relative change listed (default 0.01%%; '1%%' or 0.01)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def main(args: argparse.Namespace) -> int:
    gates = [Gate.parse(t) for t in args.fail_on]
    try:
        base, new = load_records(args.base), load_records(args.new)
    except RecordError as exc:
        raise ValueError(str(exc)) from exc
    if not base:
        raise ValueError(f"{args.base}: no records")
    min_change = args.min_change
    found, failures = changes(base, new, gates, min_change)
    matched = sum(1 for r in base if r.run_id in {x.run_id for x in new})
    if not matched:  # nothing to compare: a gate that checks nothing must not pass
        raise ValueError(
            f"no records in common: {args.base} has {len(base)} record(s), {args.new} has "
            f"{len(new)}, and no run_id is in both (different suites, models or --set "
            "values?); nothing was compared"
        )
    diffs = differences(base, new)
    if diffs:
        print(differences_text(diffs), file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "provenance_differs": {n: {"base": b, "new": v} for n, b, v in diffs},
                    "matched": matched,
                    "base_runs": len(base),
                    "changes": found,
                    "failures": failures,
                    "min_change": min_change,
                }
            )
        )
        return 1 if failures else 0
    lines, _ = compare(base, new, gates, min_change)
    print(
        f"compared {matched} matched run(s) of {len(base)} in BASE; {len(lines)} metric(s) "
        f"moved by >= {min_change:.2%}"
    )
    for line in lines:
        print("  " + line)
    if failures:
        print("REGRESSIONS:", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    return 0
