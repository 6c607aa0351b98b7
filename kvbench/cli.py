"""``kvbench`` command line: ``list``, ``bits``, and the suite commands when available.

Subcommands are registered by small functions here; heavier commands (``run``, ``report``,
``compare``) import their modules lazily so ``kvbench list`` stays fast.

Errors: a user error (bad suite, bad flag, unwritable folder) prints one line
``kvbench CMD: error: ...`` on stderr and exits 2; an unexpected failure prints one line naming
the exception and exits 3; ``--debug`` shows the traceback of either.  Ctrl-C exits 130 with a
line saying which records were kept and how to resume.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import textwrap
import threading
import traceback
from pathlib import Path

from kvbench.bench.manifest import cli_argv, dist_version, run_log
from kvbench.bench.records import Record, record_path
from kvbench.bench.suite import parse_set
from kvbench.cache.registry import get_method, list_methods


def _caps(caps: dict[str, bool]) -> str:
    shown = [k for k, v in caps.items() if v and k not in ("keys_values", "layer_cache", "padding")]
    if caps and not caps.get("layer_cache", True):
        shown.append("transformers-cache")
    if caps and not caps.get("padding", True):
        shown.append("no-padding")
    return ",".join(shown)


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
        caps = f"  [{caps}]" if caps else ""
        print(f"{r['name']:<{width}}  {r['distribution']:<{dwidth}}  {desc}{caps}")
    return 0


DESCRIPTION = """\
A benchmark suite for KV-cache quantization in LLM inference: bits, fidelity, perplexity,
generation, memory and decode latency of every registered method on a real model.

examples:
  kvbench list
  kvbench bits kivi --set bits=2 --set group_size=32
  kvbench run suites/smoke.yaml --set seed=1 --out results/smoke
  kvbench report results/smoke
  kvbench compare results/base results/new --fail-on attn_kl:5%
"""


def _positive(low: int, even: bool = False):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low or (even and v % 2):
            need = f"an {'even ' if even else ''}integer >= {low}"
            raise argparse.ArgumentTypeError(f"{v} must be {need}")
        return v

    return parse


def cmd_bits(args: argparse.Namespace) -> int:
    method = get_method(args.method, **parse_set(args.set))
    if method.capabilities.layer_cache and not method.needs_calibration:
        method.new_layer(0, 1, args.head_dim)  # a config that does not fit head_dim raises here
    report = method.average_bits(head_dim=args.head_dim, tokens=args.tokens)
    report = {"method": args.method, "config": method.config.to_dict(), **report}
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{args.method}: {report['key_bits']:.4f} bits/key element, "
            f"{report['value_bits']:.4f} bits/value element "
            f"(head_dim {args.head_dim}, {args.tokens} quantized tokens + "
            f"{report['num_sink_tokens']} sinks; residual excluded; docs/methods.md#average-bits)"
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
    p.add_argument(
        "--limit", type=_positive(1), default=None, help="examples/windows per task subset (>= 1)"
    )
    p.add_argument("--force", action="store_true", help="rerun runs whose record exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (records, flags, output folder) instead of the tables",
    )
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="skip workloads whose data cannot be loaded here (hub-only sets offline)",
    )
    p.add_argument(
        "--executor",
        choices=["local", "ray"],
        default="local",
        help="local: this process (default); ray: a Ray cluster (extra ray: pip install -e '.[ray]')",
    )
    p.add_argument("--address", default=None, help="Ray cluster: auto, HOST:PORT, ray://HOST:PORT")
    p.add_argument("--max-parallel", type=int, default=None, help="Ray workers at once")
    p.add_argument("--progress-workers", action="store_true", help="one line per Ray worker")
    p.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --executor ray: stop a run after SECONDS, record it failed (timed out) and "
        "go on; a rerun retries it",
    )


def workload_types_help() -> str:
    """The ``kvbench run --help`` epilog: every registered workload type (``WORKLOADS.names()``)
    with its parameters and their defaults (``PARAMS``; ``...`` marks a required one).  Loads
    every workload's entry point, so it is built only when the help is shown."""
    from kvbench.bench.workloads import WORKLOADS

    lines = [
        "workload types (a suite's `workloads:` entries, `{type: NAME, PARAM: VALUE, ...}`;",
        "each parameter with its default, `...` = required; kvbench/bench/workloads/NAME.py):",
    ]
    for name in WORKLOADS.names():
        try:
            params = WORKLOADS.get(name).PARAMS
        # anything a plugin's entry point raises on import (ImportError, a bad PARAMS...): a
        # broken plugin still lists the others; reported in its help line as [failed to load]
        except Exception as exc:  # noqa: BLE001 - plugin errors -> its "[failed to load]" line
            text = f"[failed to load] {type(exc).__name__}: {exc}"
        else:
            text = (
                ", ".join(f"{k}=..." if v is ... else f"{k}={v!r}" for k, v in params.items())
                or "(no parameters)"
            )
        lines += textwrap.wrap(
            text, width=96, initial_indent=f"  {name}: ", subsequent_indent="      "
        )
    return "\n".join(lines)


class _RunHelp(argparse.Action):
    """``kvbench run -h``: the help with the workload types appended (built on demand, so other
    commands do not load every workload)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.epilog = workload_types_help()
        parser.print_help()
        parser.exit()


def run_summary(records: list[Record], out: str, suite_path: str) -> dict:
    """The machine-readable summary ``kvbench run --json`` prints."""
    return {
        "suite": suite_path,
        "out": out,
        "records": [
            {
                "run_id": r.run_id,
                "label": r.label,
                "method": r.method,
                "config": r.config,
                "workload": r.workload,
                "metrics": r.metrics,
                "flags": r.flags,
                "path": str(record_path(out, r.run_id)),
            }
            for r in records
        ],
    }


def cmd_run(args: argparse.Namespace) -> int:
    from kvbench.bench.preflight import (
        check_contexts,
        check_token_limits,
        format_missing,
        preflight,
    )
    from kvbench.bench.runner import run_suite
    from kvbench.bench.suite import load_suite
    from kvbench.bench.validate import check_devices, check_output

    # every error of the suite in one refusal, before the asset pre-flight: the fields, then
    # devices (nothing else matters without one), contexts beyond a model's maximum and beyond
    # a method's token limit
    suite = load_suite(
        args.suite, parse_set(args.set), checks=(check_devices, check_contexts, check_token_limits)
    )
    paper_block = suite.raw.get("paper")
    if paper_block is not None:
        from kvbench.integrations.paper import validate

        validate(paper_block, suite.path)
    from kvbench.bench.outlock import output_lock

    if missing := preflight(suite):  # every asset resolved before the first run
        print(format_missing(missing, suite.path), file=sys.stderr)
        return 2
    out = args.out or f"results/{suite.name}"
    timeout = args.run_timeout
    if timeout is not None and args.executor != "ray":
        raise ValueError(
            "--run-timeout needs --executor ray: the local executor runs each run in this "
            "process and cannot stop a hung one; add --executor ray (without --address it "
            "starts a Ray instance on this machine; extra ray: pip install -e '.[ray]')"
        )
    if timeout is not None and not timeout > 0:
        raise ValueError(f"--run-timeout must be > 0 seconds, got {timeout:g}")
    runner = run_suite
    ray_runner = None  # the Ray runner lists failed runs in .failed; run_suite raises
    if args.executor == "ray":  # same records and resume; docs/cluster.md
        from kvbench.integrations.ray import runner_from_args

        # checks ray and the address before anything is written
        runner = ray_runner = runner_from_args(args)
    elif args.address or args.max_parallel:
        raise ValueError("--address and --max-parallel need --executor ray")
    check_output(out)
    args._out = out  # for the Ctrl-C message
    try:
        with output_lock(out), run_log(out, suite.path) as logged:  # one --out, one run at once
            records = runner(
                suite,
                out,
                limit=args.limit,
                force=args.force,
                quiet=args.quiet,
                skip_unavailable=args.skip_unavailable,
            )
            logged["records"] = len(records)
    except FileNotFoundError as exc:  # an asset that vanished after the pre-flight
        print(f"kvbench run: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(run_summary(records, out, suite.path), default=str))
        return 0
    from kvbench.report.tables import summary_table

    print(summary_table(records, suite=suite))
    print(f"\n{len(records)} record(s) in {out}")
    failed = [] if ray_runner is None else ray_runner.failed
    if failed:
        print(f"{len(failed)} run(s) failed: records in {out}/failed/ (a rerun retries them)")
    if paper_block is not None:  # a paper reproduction: the paper's numbers beside kvbench's
        from kvbench.integrations.paper import comparison_table, write_figures

        print("\n" + comparison_table(paper_block, records))
        for path in write_figures(paper_block, records, out):
            print(f"wrote {path}", file=sys.stderr)
    return 1 if failed else 0


#: subcommands provided by other modules: name -> (module, help)
EXTERNAL = {
    "report": ("kvbench.report.tables", "summarize result records: Markdown table and plots"),
    "plot": ("kvbench.report.plots", "draw the report's PNG figures of result records"),
    "compare": ("kvbench.report.compare", "compare two result sets; non-zero exit on regression"),
    "export": ("kvbench.report.export", "compact committable export of a result folder"),
    "data": ("kvbench.data.prepare", "build the local copy of a hub text (wikitext2)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    version = dist_version("kvbench") or "unknown (not installed)"
    p.add_argument("--version", action="version", version=f"%(prog)s {version}")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    p.set_defaults(_out=None)  # `kvbench run` sets it: the folder its Ctrl-C message names
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pl = sub.add_parser("list", help="registered methods")
    pl.add_argument(
        "--json",
        action="store_true",
        help="print every method as JSON (name, distribution, description, capabilities, "
        "load error) instead of one line each",
    )
    pl.set_defaults(func=cmd_list)
    pb = sub.add_parser("bits", help="nominal average bits per key and value element")
    pb.add_argument("method", help="a registered method name (see `kvbench list`), e.g. kivi")
    pb.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a field of the method's config (bits=2); repeat for several",
    )
    pb.add_argument(
        "--head-dim", type=_positive(2, even=True), default=128, help="channels per head D"
    )
    pb.add_argument(
        "--tokens", type=_positive(1), default=32768, help="quantized tokens T_q (>= 1)"
    )
    pb.add_argument("--json", action="store_true", help="one JSON object on stdout")
    pb.set_defaults(func=cmd_bits)
    pr = sub.add_parser(
        "run",
        help="run a suite YAML",
        description="Run every (model, method, workload) of a suite: one JSON record per run\n"
        "in --out; a rerun skips the runs whose record exists.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    pr.add_argument(
        "-h",
        "--help",
        action=_RunHelp,
        nargs=0,
        help="show this help, with the workload types and their parameters, and exit",
    )
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
    for sp in sub.choices.values():  # `kvbench run X --debug` as well as `kvbench --debug run X`
        sp.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show the Python traceback of an error",
        )
    from kvbench.integrations.lm_eval import cli as lm_eval_cli  # light: imports lm-eval when run

    # every argument goes to lm-eval's own CLI ('+' prefix: argparse leaves --options alone)
    sl = sub.add_parser("lm-eval", help="lm-eval's CLI with --model kvbench", prefix_chars="+")
    lm_eval_cli.add_arguments(sl)
    sl.set_defaults(func=lm_eval_cli.main)
    return p


def _interrupted(args: argparse.Namespace) -> str:
    out = args._out
    if args.command != "run" or out is None:
        return f"kvbench {args.command}: interrupted"
    kept = len(list(Path(out).glob("*.json"))) if Path(out).is_dir() else 0
    again = " ".join(["kvbench", *sys.argv[1:]]) if sys.argv[1:] else "the same command"
    return (
        f"kvbench run: interrupted; {kept} finished record(s) kept in {out} (the run in "
        f"progress was discarded); resume with: {again}"
    )


#: exceptions that are the user's to fix (bad input, missing files, permissions)
USER_ERRORS = (ValueError, RuntimeError, OSError, LookupError)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, a batch scheduler), handled as Ctrl-C is: the run log
    says ``interrupted``, finished records stay, the exit status is 143 (128 + 15)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        with cli_argv(argv):  # records and run logs name this command line
            return int(args.func(args) or 0)
    except KeyboardInterrupt as exc:
        if args.debug:
            traceback.print_exc()
        print(f"\n{_interrupted(args)}", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except BrokenPipeError:  # `kvbench list | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit flush
        return 141  # 128 + SIGPIPE, as a shell tool killed by it
    except USER_ERRORS as exc:
        if args.debug:
            traceback.print_exc()
        print(f"kvbench {args.command}: error: {exc}", file=sys.stderr)
        return 2
    # any other exception of a command (a bug, not the user's to fix): reported as one line on
    # stderr naming it (the traceback with --debug), exit status 3
    except Exception as exc:  # noqa: BLE001 - bugs -> one stderr line, exit 3
        if args.debug:
            traceback.print_exc()
        print(
            f"kvbench {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 3
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
