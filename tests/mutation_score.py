"""Mutation score per file from mutmut's results in ``mutants/`` (``make mutants`` prints it).

Reads the ``mutants/**/*.py.meta`` files mutmut 3 writes (one exit code per mutant) and prints
a markdown table per mutated file: mutants, killed, survived, timeout, crash, no tests, not yet
run, and the score ``killed / (mutants run)`` with timeouts and crashes counted as killed (a
mutant that makes the tests hang, or crashes the test process in a native kernel, is
detected).  For the workload modules only the functions that compute the record's metrics are
scored (``SCOPE``); their validation and data loading (``check``, ``prepare``) are exercised by
other tests than the fast core selection.  Of the native quantizer's module only the functions
that choose the path and shape its results are scored.

Then it lists every survivor that ``docs/mutation.md`` does not name as equivalent, so a new
survivor is either killed by a test or explained there (exit status 1 when one is unlisted).

    .venv/bin/python tests/mutation_score.py [--all]   # --all: also the out-of-scope functions
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: exit code -> status, as mutmut.stats.status_by_exit_code (3.x) defines them
STATUS = {1: "killed", 3: "killed", 0: "survived", 33: "no tests", 5: "no tests", None: "not run"}
STATUS |= dict.fromkeys((36, -24, 24, 152, 255), "timeout")
#: the test process killed by a signal (mutmut's "segfault"; SIGABRT, SIGFPE too): a mutant
#: that hands the native kernels a bad pointer or row range crashes the run, which detects it
STATUS |= dict.fromkeys((-6, -8, -9, -11), "crash")

#: workload modules: the functions whose mutants are scored (the metric code)
SCOPE = {
    "kvbench/bench/workloads/perplexity.py": ("xǁPerplexityǁrun",),
    "kvbench/bench/workloads/generation.py": ("xǁGenerationǁrun", "x_run_batched"),
    "kvbench/bench/workloads/fidelity.py": (
        "x_layer_fidelity",
        "x_attn_out_rel_err",
        "x_storage_metrics",
        "xǁFidelityǁrun",
    ),
    "kvbench/bench/workloads/passkey.py": ("xǁPasskeyǁrun",),
    # the Python glue that decides which quantizer path runs and shapes its results; the
    # build-and-load code (``build``, ``_load``) is not scored
    "kvbench/cache/native_quant.py": ("x_quantize_pack", "x__c_affine_terms", "x__split", "x__run"),
}


def _in_scope(path: str, name: str) -> bool:
    funcs = SCOPE.get(path)
    return funcs is None or name.split(".")[-1].rsplit("__mutmut_", 1)[0] in funcs


def _listed(doc: str) -> set[str]:
    """Mutant names of the equivalence table rows ``| `<function>` | 3, 17 | <reason> |``."""
    out = set()
    for fn, nums in re.findall(r"^\| `(kvbench\.[\wǁ.]+)` \| ([\d, ]+) \|", doc, re.M):
        out |= {f"{fn}__mutmut_{n.strip()}" for n in nums.split(",")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="score every mutated function")
    args = ap.parse_args()
    metas = sorted((ROOT / "mutants").glob("**/*.py.meta"))
    if not metas:
        print("no mutmut results in mutants/: run `make mutants` first", file=sys.stderr)
        return 2
    listed = _listed((ROOT / "docs/mutation.md").read_text())
    print("| file | mutants | killed | survived | timeout | crash | no tests | not run | score |")
    print("|---|---|---|---|---|---|---|---|---|")
    unlisted = []
    for meta in metas:
        path = str(meta.relative_to(ROOT / "mutants"))[: -len(".meta")]
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        codes = {k: v for k, v in codes.items() if args.all or _in_scope(path, k)}
        n = Counter(STATUS.get(v, "suspicious") for v in codes.values())
        ran = len(codes) - n["not run"]
        score = f"{(n['killed'] + n['timeout'] + n['crash']) / ran:.1%}" if ran else "-"
        row = [len(codes), n["killed"], n["survived"], n["timeout"], n["crash"], n["no tests"],
               n["not run"]]  # fmt: skip
        print(f"| `{path}` | " + " | ".join(map(str, row)) + f" | {score} |")
        unlisted += sorted(k for k, v in codes.items() if v == 0 and k not in listed)
    if unlisted:
        print(f"\n{len(unlisted)} survivors not listed in docs/mutation.md:")
        print("\n".join(f"  {k}" for k in unlisted))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
