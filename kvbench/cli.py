"""``kvbench`` command line: ``list``, ``bits``, and the suite commands when available.

Subcommands are registered by small functions here; heavier commands (``run``, ``report``,
``compare``) import their modules lazily so ``kvbench list`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvbench.kv.registry import get_method, list_methods
from kvbench.run.suite import parse_set


def _caps(caps: dict[str, bool]) -> str:
    return ",".join(
        k
        for k, v in caps.items()
        if v and k not in ("cpu", "cuda", "gqa", "batch", "keys_values", "layer_cache")
    )


def cmd_list(args: argparse.Namespace) -> int:
    rows = list_methods()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows) if rows else 4
    dwidth = max(len(r["distribution"]) for r in rows) if rows else 4
    for r in rows:
        desc = r["description"] if r["error"] is None else f"[failed to load] {r['error']}"
        caps = _caps(r["capabilities"])
        if r["capabilities"] and not r["capabilities"].get("layer_cache", True):
            caps = ",".join(filter(None, [caps, "transformers-cache"]))
        caps = f"  [{caps}]" if caps else ""
        print(f"{r['name']:<{width}}  {r['distribution']:<{dwidth}}  {desc}{caps}")
    return 0


def cmd_bits(args: argparse.Namespace) -> int:
    method = get_method(args.method, **parse_set(args.set))
    report = method.average_bits(head_dim=args.head_dim, tokens=args.tokens)
    report = {"method": args.method, "config": method.config.to_dict(), **report}
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{args.method}: {report['key_bits']:.4f} bits/key element, "
            f"{report['value_bits']:.4f} bits/value element "
            f"(head_dim {args.head_dim}, {args.tokens} quantized tokens + "
            f"{report['num_sink_tokens']} sinks; residual excluded; spec §12)"
        )
    return 0


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", help="suite YAML file")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a suite field by dotted path (seed=1, model.dtype=bfloat16)",
    )
    p.add_argument("--out", default=None, help="result folder (default results/<suite name>)")
    p.add_argument("--limit", type=int, default=None, help="examples/windows per task subset")
    p.add_argument("--force", action="store_true", help="rerun runs whose record exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="skip workloads whose data cannot be loaded here (hub-only sets offline)",
    )
    p.add_argument(
        "--executor",
        choices=["local", "ray"],
        default="local",
        help="local: this process (default); ray: a Ray cluster (pip install 'kvbench[ray]')",
    )
    p.add_argument("--address", default=None, help="Ray cluster: auto, HOST:PORT, ray://HOST:PORT")
    p.add_argument("--max-parallel", type=int, default=None, help="Ray workers at once")
    p.add_argument("--progress-workers", action="store_true", help="one line per Ray worker")


def cmd_run(args: argparse.Namespace) -> int:
    from kvbench.run.runner import run_suite
    from kvbench.run.suite import load_suite

    suite = load_suite(args.suite, parse_set(args.set))
    paper_block = suite.raw.get("paper")
    if paper_block is not None:
        from kvbench.report.paper import validate

        validate(paper_block, suite.path)
    from kvbench.run.preflight import format_missing, preflight

    if missing := preflight(suite):  # every asset resolved before the first run
        print(format_missing(missing, suite.path), file=sys.stderr)
        return 2
    out = args.out or f"results/{suite.name}"
    runner = run_suite
    if getattr(args, "executor", "local") == "ray":  # same records and resume; docs/cluster.md
        from kvbench.run.ray_executor import runner_from_args

        runner = runner_from_args(args)
    elif getattr(args, "address", None) or getattr(args, "max_parallel", None):
        raise ValueError("--address and --max-parallel need --executor ray")
    try:
        records = runner(
            suite,
            out,
            limit=args.limit,
            force=args.force,
            quiet=args.quiet,
            skip_unavailable=getattr(args, "skip_unavailable", False),
        )
    except FileNotFoundError as exc:  # an asset that vanished after the pre-flight
        print(f"kvbench run: error: {exc}", file=sys.stderr)
        return 2
    from kvbench.report.tables import summary_table

    print(summary_table(records, suite=suite))
    print(f"\n{len(records)} record(s) in {out}")
    failed = getattr(runner, "failed", [])
    if failed:
        print(f"{len(failed)} run(s) failed: records in {out}/failed/ (a rerun retries them)")
    if paper_block is not None:  # a paper reproduction: the paper's numbers beside kvbench's
        from kvbench.report.paper import comparison_table, write_figures

        print("\n" + comparison_table(paper_block, records))
        for path in write_figures(paper_block, records, out):
            print(f"wrote {path}")
    return 1 if failed else 0


#: subcommands provided by other modules: name -> (module, help)
EXTERNAL = {
    "report": ("kvbench.report.tables", "summarize result records: Markdown table and plots"),
    "compare": ("kvbench.report.compare", "compare two result sets; non-zero exit on regression"),
    "export": ("kvbench.report.export", "compact committable export of a result folder"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("list", help="registered methods")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_list)
    pb = sub.add_parser("bits", help="nominal average bits per key and value element (spec §12)")
    pb.add_argument("method")
    pb.add_argument("--set", action="append", metavar="KEY=VALUE", help="config field")
    pb.add_argument("--head-dim", type=int, default=128)
    pb.add_argument("--tokens", type=int, default=32768, help="quantized tokens T_q")
    pb.add_argument("--json", action="store_true", help="one JSON object on stdout")
    pb.set_defaults(func=cmd_bits)
    pr = sub.add_parser("run", help="run a suite YAML")
    add_run_arguments(pr)
    pr.set_defaults(func=cmd_run)
    for name, (module, help_) in EXTERNAL.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        sp = sub.add_parser(name, help=help_)
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.main)
    from kvbench import lm_eval as lm_eval_cli  # light: imports lm-eval only when run

    # every argument goes to lm-eval's own CLI ('+' prefix: argparse leaves --options alone)
    sl = sub.add_parser("lm-eval", help="lm-eval's CLI with --model kvbench", prefix_chars="+")
    lm_eval_cli.add_arguments(sl)
    sl.set_defaults(func=lm_eval_cli.main)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError) as exc:
        print(f"kvbench {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
