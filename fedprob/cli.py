"""The ``fedprob`` command line.

    fedprob demo [--out DIR] [--rounds R] [--quick] [--seed S]
    fedprob run CONFIG.toml [--out DIR] [--seed S] [--set table.key=value ...] [--force]
    fedprob report RUN_DIR [--out FILE.html] [--reference FILE.npz]
    fedprob flower app|split|certs|supernode|local ...   (:mod:`fedprob.flower_cli`)

The configuration keys are in :mod:`fedprob.config` (and ``fedprob run
--help``); run directories in :mod:`fedprob.rundir`. Errors are one line on
stderr with exit status 2, not tracebacks. ``demo`` and ``run`` keep compiled
programs in JAX's persistent compilation cache (:mod:`fedprob.compile_cache`;
``FEDPROB_COMPILATION_CACHE=off`` switches it off, a path moves it).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from . import config as C
from .names import closest, hint
from .table import format_table

UCI_SETS = C.UCI_SETS


def build_from_config(cfg: dict):
    """(algorithm, model, fed, eval_data, run kwargs) from a parsed configuration."""
    return C.build(cfg)


def cmd_run(args) -> int:
    from .demo import summary_row
    from .rundir import prepare, save_run
    from .run import run

    path = Path(args.config)
    if not path.exists():
        raise ValueError(f"no configuration file {path}")
    cfg = C.override(C.loads(path.read_text()), args.set)
    if args.seed is not None:
        cfg.setdefault("run", {})["seed"] = args.seed
    C.validate(cfg)
    out = Path(args.out or Path("runs") / path.stem)
    prepare(out, args.force)          # refuse an existing run directory before any work
    algo, model, fed, test, run_kw = C.build(cfg)
    t = time.perf_counter()
    result = run(algo, model, fed, eval_data=test, progress=not args.quiet, **run_kw)
    total = time.perf_counter() - t
    from .rundir import federation_info

    d, part = cfg.get("data", {}), cfg.get("partition", {})
    text = (f"{d.get('name', 'digits')}: {fed.num_rows} training rows over {fed.num_clients} clients, "
            f"{part.get('scheme', 'iid')} split; model {cfg.get('model', {}).get('name')}")
    save_run(out, result, cfg, total, name=type(algo).__name__, overwrite=True, federation=federation_info(fed, text))
    print(format_table([summary_row(type(algo).__name__, result, total)]))
    print(f"run directory: {out}")
    return 0


def cmd_report(args) -> int:
    from .report import html_report, reference_rows, summary_rows
    from .rundir import load_reference, load_runs

    d = Path(args.run_dir)
    runs = load_runs(d)
    out = Path(args.out) if args.out else (d / "report.html")
    ref = load_reference(args.reference if args.reference else d)
    html_report(runs, out, title=f"fedprob report: {d.name}", reference=ref)
    print(format_table(summary_rows(runs)))
    if ref is not None:
        rows = reference_rows(runs, ref[1])
        if rows:
            print(f"against the reference ({ref[0]}):")
            print(format_table(rows))
    for r in runs:
        excluded = {h["round"]: h["excluded"] for h in r["history"] if h.get("excluded")}
        if excluded:
            print(f"{r['name']}: clients left out (round: ids): {excluded}")
        for w in r.get("warnings", ())[:3]:
            print(f"{r['name']}: {w}")
    print(f"report: {out}")
    return 0


def cmd_demo(args) -> int:
    from .demo import COLUMNS, LEGEND, demo_methods, run_demo, select_methods, table_header, table_line

    select_methods(args.methods, demo_methods(4, True))     # an unknown name fails before anything is written
    out = None
    if args.out:
        from .rundir import prepare

        out = prepare(args.out, args.force)

    def start(text):
        print(text)
        print(table_header(), flush=True)

    rows = run_demo(rounds=args.rounds, quick=args.quick, progress=not args.quiet, seed=args.seed, out=out,
                    on_start=start, on_row=lambda row: print(table_line(row), flush=True), methods=args.methods)
    print()
    print(LEGEND)
    if out is not None:
        (out / "demo.json").write_text(json.dumps(rows, indent=2))
        (out / "demo.md").write_text(table_header(COLUMNS) + "\n" + "\n".join(table_line(r) for r in rows)
                                     + "\n\n" + LEGEND + "\n")
        print(f"wrote {out / 'demo.json'}, {out / 'demo.md'} and one run directory per method in {out}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedprob")
    except PackageNotFoundError:  # pragma: no cover - not installed
        return "unknown"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors name the closest flag or subcommand, in the usage of the
    (sub)command where the unknown name was given."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            flags = [o for a in self._actions for o in a.option_strings]
            first = extras[0]
            if first.startswith("-"):
                name = first.split("=", 1)[0]
                self.error(f"unrecognized argument {name!r}" + hint(name, flags).replace("(valid:", "(flags:"))
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def error(self, message):
        m = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(3))
            best = closest(m.group(2), choices)
            message = (f"unknown command {m.group(2)!r}" + (f"; did you mean {best!r}?" if best else "")
                       + f" (commands: {', '.join(choices)})")
        super().error(message)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="fedprob", description="Bayesian federated learning on NumPyro")
    p.add_argument("--version", action="version", version=f"fedprob {_version()}")
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="cmd", metavar="{demo,run,report,flower}")
    d = sub.add_parser("demo", help="digits, 10 clients, Dirichlet split: methods side by side")
    d.add_argument("--out", help="write demo.json, demo.md and one run directory per method here")
    d.add_argument("--rounds", type=_positive_int, default=None,
                   help="rounds of the multi-round methods (default 20; 4 with --quick)")
    d.add_argument("--quick", action="store_true",
                   help="a smaller, faster version: 4 rounds (unless --rounds), shorter sampler chains")
    d.add_argument("--methods", metavar="NAMES",
                   help="only these methods, comma-separated (a row's name, or its name before the parenthesis: "
                        "--methods FedAvg,PVI)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--force", action="store_true", help="overwrite an existing --out directory")
    d.add_argument("--quiet", action="store_true")
    r = sub.add_parser("run", help="run a TOML configuration", epilog=C.HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("config")
    r.add_argument("--out", help="run directory (default runs/<config name>)")
    r.add_argument("--seed", type=int, help="overrides [run] seed")
    r.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                   help="override a configuration key (repeatable)")
    r.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    r.add_argument("--quiet", action="store_true")
    rep = sub.add_parser("report", help="write RUN_DIR/report.html (one page, figures embedded)")
    rep.add_argument("run_dir", help="a run directory, or a directory of run directories (fedprob demo --out)")
    rep.add_argument("--out", help="the HTML file (default RUN_DIR/report.html)")
    rep.add_argument("--reference", help="draws of a reference posterior (.npz, fedprob.rundir.save_reference) "
                     "drawn beside each method's marginals (default RUN_DIR/reference.npz when present)")
    from . import flower_cli

    flower_cli.add_parser(sub)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.cmd is None:
        p.print_help()
        print("\nfedprob: choose a command, e.g. `fedprob demo --quick`", file=sys.stderr)
        return 2
    if args.cmd in ("demo", "run"):
        from .compile_cache import enable

        enable()
    try:
        if args.cmd == "flower":
            from .flower_cli import main as flower_main

            return flower_main(args)
        return {"demo": cmd_demo, "run": cmd_run, "report": cmd_report}[args.cmd](args)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError, ImportError) as e:
        if args.traceback:
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"fedprob {args.cmd}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
