"""The protocol table of ``suites/protocols.yaml`` (docs/results/protocols.md).

Command::

    kvbench run suites/protocols.yaml --out results/protocols
    python benchmarks/protocol_table.py results/protocols > docs/results/protocols.md

One row per method label, next-token KL against the ``full`` cache under the same schedule
for every chunk C and protocol of the records (``wta`` = write-then-attend, ``icf`` =
in-chunk-full), the relative difference of write-then-attend at each C from C = 1 (exact decode
under the same protocol), and the effective key/value bits of the cache the last scored token
attended to (write-then-attend, C = 1).  The header names the run: commit, machine, threads,
load average (taken when the table is written; the records' wall and CPU time are summed).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from kvbench.bench.records import load_records

SHORT = {"write-then-attend": "wta", "in-chunk-full": "icf"}


def table(folder: Path) -> str:
    recs = [r for r in load_records(folder) if r.workload.get("type") == "perplexity"]
    if not recs:
        raise SystemExit(f"no perplexity records in {folder}")
    chunks = sorted({r.workload["chunk"] for r in recs})
    protos = [p for p in SHORT if any(r.workload["protocol"] == p for r in recs)]
    rows: dict[str, dict] = {}
    for r in recs:
        label = r.manifest.get("label") or r.method
        key = (r.workload["protocol"], r.workload["chunk"])
        rows.setdefault(label, {})[key] = r
    # a (protocol, C) column only where some record has it
    cols = [(p, c) for p in protos for c in chunks if any((p, c) in by for by in rows.values())]
    head = ["method"] + [f"KL {SHORT[p]} C={c}" for p, c in cols]
    head += [f"wta C={c} vs C=1" for c in chunks if c != 1]
    head += ["key bits", "value bits"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, by in rows.items():
        kl = {k: r.metrics["next_token_kl"] for k, r in by.items()}
        cells = [label] + [f"{kl[k]:.4g}" if k in kl else "–" for k in cols]
        exact = kl.get(("write-then-attend", 1))
        for c in chunks:
            if c == 1:
                continue
            got = kl.get(("write-then-attend", c))
            ok = exact is not None and got is not None and exact > 1e-6
            cells.append(f"{(got - exact) / exact:+.1%}" if ok else "–")
        last = by.get(("write-then-attend", 1))
        for side in ("key", "value"):
            v = None if last is None else last.metrics.get(f"effective_{side}_bits")
            cells.append("–" if v is None else f"{v:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    first = recs[0].manifest
    wall = sum(r.manifest.get("wall_s", 0) for r in recs)
    cpu = sum(r.manifest.get("cpu_s", 0) for r in recs)
    meta = [
        "# Decode protocols: chunk C vs exact decode (a measured record)",
        "",
        f"- command: `kvbench run suites/protocols.yaml --out {folder}` then "
        f"`python benchmarks/protocol_table.py {folder}`",
        f"- commit: {first.get('git_sha')}",
        f"- machine: {platform.machine()}, {first.get('device_name') or platform.processor()}, "
        f"{os.cpu_count()} cores; threads: {first.get('threads')}",
        f"- model: {first.get('model', {}).get('model_id')} ({first.get('model', {}).get('dtype')})",
        f"- runs: {len(recs)}; summed wall {wall / 60:.1f} min, CPU {cpu / 60:.1f} min",
        f"- load average when written: {[round(x, 2) for x in os.getloadavg()]}",
        "",
    ]
    return "\n".join(meta + lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table(Path(sys.argv[1] if len(sys.argv) > 1 else "results/protocols")))
