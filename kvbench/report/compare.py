"""``kvbench compare BASE NEW [--fail-on METRIC:THRESHOLD ...]``: regression gate.

BASE and NEW are result folders or record files.  Runs are matched by ``run_id``.  For each
``--fail-on METRIC:THRESHOLD`` (``5%`` relative to BASE, ``0.01`` absolute) the command fails
(exit 1) when METRIC moves in its bad direction (declared in each workload's ``METRICS``;
a ``none`` metric fails when it moves either way) by more than
THRESHOLD in any matched run, or when a BASE run is missing from NEW.  Two single records of
different runs are an error that names the differing keys.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

from kvbench.run.records import RecordError, load_records
from kvbench.workloads.metrics import HIGHER, NONE, direction


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
            raise ValueError(
                f"--fail-on: metric {metric!r} has no declared direction; "
                "each workload declares its metrics in its METRICS class attribute"
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


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def compare(base: list[dict], new: list[dict], gates: list[Gate]) -> tuple[list[str], list[str]]:
    """Return (report lines, failure lines)."""
    if len(base) == 1 and len(new) == 1 and base[0]["run_id"] != new[0]["run_id"]:
        keys = _diff_keys(
            {k: base[0].get(k) for k in ("model", "method", "config", "workload")},
            {k: new[0].get(k) for k in ("model", "method", "config", "workload")},
        )
        raise ValueError(f"the two records are different runs; differing keys: {keys}")
    by_id = {r["run_id"]: r for r in new}
    lines, failures = [], []
    for rb in base:
        rid, label = rb["run_id"], f"{rb['method']} {rb['run_id']}"
        rn = by_id.get(rid)
        if rn is None:
            failures.append(f"{label}: missing from NEW")
            continue
        for name in sorted(set(rb["metrics"]) & set(rn["metrics"])):
            b, n = float(rb["metrics"][name]), float(rn["metrics"][name])
            if b == n or (math.isnan(b) and math.isnan(n)):
                continue
            rel = f" ({(n - b) / abs(b):+.2%})" if b else ""
            lines.append(f"{label} {name}: {b:.6g} -> {n:.6g}{rel}")
        for g in gates:
            if g.metric in rb["metrics"] and g.metric in rn["metrics"]:
                b, n = float(rb["metrics"][g.metric]), float(rn["metrics"][g.metric])
                if g.regressed(b, n):
                    thr = f"{g.threshold:.2%}" if g.relative else f"{g.threshold:g}"
                    failures.append(f"{label} {g.metric}: {b:.6g} -> {n:.6g} exceeds {thr}")
    return lines, failures


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


def main(args: argparse.Namespace) -> int:
    gates = [Gate.parse(t) for t in args.fail_on]
    try:
        base, new = load_records(args.base), load_records(args.new)
    except RecordError as exc:
        raise ValueError(str(exc)) from exc
    if not base:
        raise ValueError(f"{args.base}: no records")
    lines, failures = compare(base, new, gates)
    matched = sum(1 for r in base if r["run_id"] in {x["run_id"] for x in new})
    print(
        f"compared {matched} matched run(s) of {len(base)} in BASE; {len(lines)} metric change(s)"
    )
    for line in lines:
        print("  " + line)
    if failures:
        print("REGRESSIONS:", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    return 0
