"""The ``fedprob`` command line.

    fedprob demo [--out DIR] [--rounds R] [--quick]
    fedprob run CONFIG.toml [--out DIR]
    fedprob report RUN_DIR

A run configuration is TOML with the tables ``[data]`` (``name``: digits,
mnist, fashion_mnist, credit_approval, heart_disease or a UCI regression set;
``root`` for files on disk), ``[partition]`` (``num_clients``, ``scheme`` and
its options), ``[model]`` (``name`` of a model in ``fedprob.models`` plus its
keyword arguments), ``[algorithm]`` (``name`` in ``fedprob.algorithms`` plus
keyword arguments), optional ``[client]`` (``name`` of a backend in
``fedprob.inference`` plus keyword arguments, passed as ``client=``) and
``[run]`` (``rounds``, ``seed``, ``clients_per_round``). A run directory
holds the configuration, ``history.json``, ``metrics.json`` and
``posterior.npz`` (arrays only, no pickle).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from .report import format_table

UCI_SETS = ("air_quality", "bike_sharing", "wine_quality", "real_estate", "forest_fires")


def load_dataset(cfg: dict):
    """A fedprob Dataset from the [data] table."""
    from . import data

    name = cfg.get("name", "digits")
    root = cfg.get("root")
    kw = {k: v for k, v in cfg.items() if k not in ("name", "root")}
    if name == "digits":
        return data.load_digits(**kw)
    if root is None:
        raise ValueError(f"data set '{name}' is read from disk: give [data] root = \"...\"")
    if name == "mnist":
        return data.load_mnist(root, **kw)
    if name == "fashion_mnist":
        return data.load_fashion_mnist(root, **kw)
    if name == "credit_approval":
        return data.load_credit_approval(root, **kw)
    if name == "heart_disease":
        return data.load_heart_disease(root, **kw)
    if name in UCI_SETS:
        return data.load_uci(name, root, **kw)
    raise ValueError(f"unknown data set '{name}'")


def _named(module, table: dict, what: str):
    if "name" not in table:
        raise ValueError(f"[{what}] needs a name")
    name = table["name"]
    obj = getattr(module, name, None)
    if obj is None or name.startswith("_"):
        raise ValueError(f"unknown {what} '{name}'")
    return obj, {k: v for k, v in table.items() if k != "name"}


def build_from_config(cfg: dict):
    """(algorithm, model, fed, eval_data, run kwargs) from a parsed configuration."""
    from . import algorithms, inference, models

    ds = load_dataset(cfg.get("data", {}))
    part = dict(cfg.get("partition", {}))
    scheme = part.pop("scheme", "iid")
    num_clients = part.pop("num_clients", None if scheme == "groups" else 10)
    fed = ds.partition(num_clients, scheme, **part)
    model_fn, model_kw = _named(models, cfg.get("model", {}), "model")
    if model_fn.__name__ in ("softmax_regression", "bnn_mlp", "cnn") and ds.num_classes is not None:
        model_kw.setdefault("num_classes", ds.num_classes)
    model = model_fn(**model_kw)
    algo_cls, algo_kw = _named(algorithms, cfg.get("algorithm", {}), "algorithm")
    if "client" in cfg:
        backend_cls, backend_kw = _named(inference, cfg["client"], "client")
        algo_kw["client"] = backend_cls(**backend_kw)
    algo = algo_cls(**algo_kw)
    run_kw = dict(cfg.get("run", {}))
    return algo, model, fed, ds.test, run_kw


def save_run(out: Path, cfg: dict, result, total_time: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    (out / "history.json").write_text(json.dumps(result.history, indent=2, default=float))
    final = {k: v for k, v in result.history[-1].items() if isinstance(v, (int, float))}
    final.update(total_time=total_time, compile_time=result.compile_time, init_time=result.init_time)
    (out / "metrics.json").write_text(json.dumps(final, indent=2))
    mean = {k: np.asarray(v) for k, v in result.posterior.mean.items()}
    np.savez(out / "posterior.npz", **{f"mean/{k}": v for k, v in mean.items()})


def cmd_run(args) -> int:
    import tomllib

    from .run import run

    cfg = tomllib.loads(Path(args.config).read_text())
    algo, model, fed, test, run_kw = build_from_config(cfg)
    t = time.perf_counter()
    result = run(algo, model, fed, eval_data=test, progress=not args.quiet, **run_kw)
    total = time.perf_counter() - t
    out = Path(args.out or Path("runs") / Path(args.config).stem)
    save_run(out, cfg, result, total)
    print(format_table([summary_row(type(algo).__name__, result, total)]))
    print(f"run directory: {out}")
    return 0


def cmd_report(args) -> int:
    d = Path(args.run_dir)
    if not (d / "history.json").exists():
        print(f"{d} is not a run directory (no history.json)", file=sys.stderr)
        return 2
    history = json.loads((d / "history.json").read_text())
    cols = [c for c in ("round", "time", "accuracy", "nll", "ece", "rmse", "coverage_95", "client_loss")
            if any(c in h for h in history)]
    rows = [{c: h.get(c, "") for c in cols} for h in history]
    print(format_table(rows))
    excluded = {h["round"]: h["excluded"] for h in history if h.get("excluded")}
    if excluded:
        print(f"clients left out (round: ids): {excluded}")
    return 0


def summary_row(name: str, result, total: float) -> dict:
    h = result.history[-1]
    row = {"method": name, "rounds": len(result.history)}
    for k in ("accuracy", "nll", "ece", "rmse", "coverage_95"):
        if k in h:
            row[k] = h[k]
    row["time_s"] = total
    row["compile_s"] = result.compile_time
    return row


def cmd_demo(args) -> int:
    from .demo import run_demo

    rows = run_demo(rounds=args.rounds, quick=args.quick, progress=not args.quiet)
    table = format_table(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "demo.json").write_text(json.dumps(rows, indent=2))
        (out / "demo.md").write_text(table + "\n")
        print(f"wrote {out / 'demo.json'} and {out / 'demo.md'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fedprob", description="Bayesian federated learning on NumPyro")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="digits, 10 clients, Dirichlet split: methods side by side")
    d.add_argument("--out", help="write demo.json and demo.md here")
    d.add_argument("--rounds", type=int, default=20, help="rounds of the multi-round methods")
    d.add_argument("--quick", action="store_true", help="a smaller, faster version")
    d.add_argument("--quiet", action="store_true")
    r = sub.add_parser("run", help="run a TOML configuration")
    r.add_argument("config")
    r.add_argument("--out")
    r.add_argument("--quiet", action="store_true")
    rep = sub.add_parser("report", help="summarise a run directory")
    rep.add_argument("run_dir")
    args = p.parse_args(argv)
    return {"demo": cmd_demo, "run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
