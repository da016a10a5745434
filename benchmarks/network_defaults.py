"""Posterior methods at their defaults on a network, against FedAvg at its defaults.

``bnn_mlp(hidden_sizes=(100,), num_classes=10)`` (7,510 parameters, N(0, 1) prior) on the digits
training rows split over 10 clients by Dirichlet(0.5) labels (partition seeds 0, 1, 2), 20 rounds,
every algorithm constructed with no argument; test accuracy and NLL on the digits test rows at
each method's default prediction (for PVI, FedLap-Cov and BayesADMM ``prediction="auto"``: the
chosen one is reported with the leave-one-client-out scores behind it, and the mean and the
average are both scored).

``--fmnist``: the Fashion-MNIST MLP of benchmarks/dual.py (MLP (200, 100), sigmoid, 10% of the
training rows over 10 clients, sizes Dir(1) and classes Dir(0.5), 2,000 test rows; ``--splits`` the
split seeds), every algorithm with no argument, scored after each of ``--stops`` rounds (a run
resumed from its checkpoint: the same states as one longer run), against the BayesADMM paper's
FedAvg and BayesADMM (Table 1). The paper reports each number averaged "over three seeds and the
three previous rounds"; ``--paper-window 3`` (the default) also scores rounds R-2 and R-1 of each
stop R and prints that mean beside the single readings. ``--update`` keeps the recorded rows of the
algorithms not run now.

Usage::

    python benchmarks/network_defaults.py            # 3 seeds; writes benchmarks/results/network_defaults.{json,md}
    python benchmarks/network_defaults.py --quick    # 1 seed, 3 rounds, FedAvg and PVI; writes nothing
    python benchmarks/network_defaults.py --fmnist --stops 10,25   # writes network_defaults_fmnist.{json,md}
    python benchmarks/network_defaults.py --fmnist --algorithms FedAvg,FedPA --splits 0,1,2   # three splits
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import numpy as np

import fedprob as fp
from fedprob.posteriors import GlobalPosterior

sys.path.insert(0, str(Path(__file__).parent))
from results_io import destination, write_results  # noqa: E402

ALGORITHMS = ("FedAvg", "FedPA", "PVI", "FedLapCov", "BayesADMM")


def score(posterior, X, y, prediction=None):
    lp = np.asarray(posterior.log_predictive_density(X, y, prediction=prediction))
    pr = np.asarray(posterior.predict(X, prediction=prediction))
    return float(np.mean(pr.argmax(1) == y)), float(-lp.mean())


def run_one(name, seed, rounds, ds):
    fed = fp.data.partition(ds.X_train, ds.y_train, num_clients=10, scheme="dirichlet", alpha=0.5, seed=seed,
                            num_classes=10)
    model = fp.models.bnn_mlp(hidden_sizes=(100,), num_classes=10)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = fp.run(getattr(fp.algorithms, name)(), model, fed, rounds=rounds, seed=0, progress=False)
    row = {"algorithm": name, "seed": seed, "rounds": rounds, "seconds": round(time.perf_counter() - t0, 1)}
    post = res.posterior
    y = np.asarray(ds.y_test)
    row["accuracy"], row["nll"] = score(post, ds.X_test, y)
    row["prediction"] = post.prediction
    choice = post.info.get("prediction_choice")
    if choice:
        row["choice"] = choice
        for p in ("mean", "average"):
            row[f"{p}_accuracy"], row[f"{p}_nll"] = score(post, ds.X_test, y, p)
    return row


def markdown(rows, meta, seeds, rounds):
    lines = ["# Posterior methods at their defaults on a network", "",
             f"{meta['machine']}; jax {meta['jax']}; {meta['date']}", "",
             f"`bnn_mlp(hidden_sizes=(100,), num_classes=10)` on digits, 10 Dirichlet(0.5) clients (partition "
             f"seeds {', '.join(map(str, range(seeds)))}), {rounds} rounds, every algorithm with no argument. "
             "Test accuracy % / NLL at the default prediction, averaged over seeds; for `prediction='auto'` "
             "the choice (count over seeds) and the mean and average scored beside it.", "",
             "| algorithm | accuracy | NLL | chosen | at the mean | averaged | s per run |", "|---|---|---|---|---|---|---|"]
    for a in dict.fromkeys(r["algorithm"] for r in rows):
        rs = [r for r in rows if r["algorithm"] == a]
        acc, nll = 100 * np.mean([r["accuracy"] for r in rs]), np.mean([r["nll"] for r in rs])
        if "choice" in rs[0]:
            picks = {p: sum(r["prediction"] == p for r in rs) for p in ("mean", "average")}
            chosen = ", ".join(f"{p} {c}/{len(rs)}" for p, c in picks.items() if c)
            at_mean = f"{100 * np.mean([r['mean_accuracy'] for r in rs]):.1f} / {np.mean([r['mean_nll'] for r in rs]):.3f}"
            avg = f"{100 * np.mean([r['average_accuracy'] for r in rs]):.1f} / {np.mean([r['average_nll'] for r in rs]):.3f}"
        else:
            chosen, at_mean, avg = rs[0]["prediction"], "", ""
        lines.append(f"| {a} | {acc:.1f} | {nll:.3f} | {chosen} | {at_mean} | {avg} | "
                     f"{np.mean([r['seconds'] for r in rs]):.0f} |")
    return "\n".join(lines) + "\n"


def run_fmnist(name, stops, fed, test, seed: int = 0, split: int = 0):
    """One algorithm with no argument on the Fashion-MNIST MLP: a row per round count in ``stops``."""
    model = fp.models.bnn_mlp((200, 100), num_classes=10, activation="sigmoid", prior_scale=1.0)
    algo, rows, spent = getattr(fp.algorithms, name)(), [], 0.0
    with tempfile.TemporaryDirectory() as ckpt:
        for r in stops:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = fp.run(algo, model, fed, rounds=r, seed=seed, progress=False,
                             checkpoint=fp.Checkpoint(os.path.join(ckpt, name)))
            spent += time.perf_counter() - t0
            post = res.posterior
            row = {"algorithm": name, "seed": seed, "split": split, "rounds": r, "seconds": round(spent, 1),
                   "round_seconds": round(float(np.median([h["time"] for h in res.history[1:]] or [0.0])), 2),
                   "prediction": post.prediction}
            row["accuracy"], row["nll"] = score(post, test[0], test[1])
            if post.info.get("iterate_average"):
                # the loop's own last-round Gaussian, scored at the same prediction, beside the average
                last = GlobalPosterior(post.potential, res.server_state.lam, prediction=post.prediction)
                row["last_round_accuracy"], row["last_round_nll"] = score(last, test[0], test[1])
                row["iterate_average"] = post.info["iterate_average"]
            choice = post.info.get("prediction_choice")
            if choice:
                row["choice"] = {k: v for k, v in choice.items() if k != "per_client"}
                for p in ("mean", "average"):
                    row[f"{p}_accuracy"], row[f"{p}_nll"] = score(post, test[0], test[1], p)
            rows.append(row)
            print(row, flush=True)
    return rows


#: BayesADMM paper, Table 1 (Fashion-MNIST MLP, accuracy %): FedAvg and BayesADMM at R = 10, 25, 50
FMNIST_PAPER = {"FedAvg": {10: 70.4, 25: 74.3, 50: 76.0}, "BayesADMM": {10: 77.0, 25: 81.5, 50: 82.3}}


def window_means(rows, algorithm: str, stop: int, window: int, prefix: str = ""):
    """``(accuracy %, NLL, splits)`` of the readings after rounds ``stop - window + 1 .. stop``, averaged
    over those rounds and then over the splits that have all of them (the paper's protocol); None
    where no split has every round. ``prefix="last_round_"``: the same for the last round's Gaussian
    of an averaging run."""
    per_split = {}
    for r in rows:
        if r["algorithm"] == algorithm and stop - window < r["rounds"] <= stop and f"{prefix}accuracy" in r:
            per_split.setdefault(r.get("split", 0), {})[r["rounds"]] = r
    full = [v for v in per_split.values() if len(v) == window]
    if not full or window < 2:
        return None
    acc = np.mean([np.mean([100 * x[f"{prefix}accuracy"] for x in v.values()]) for v in full])
    nll = np.mean([np.mean([x[f"{prefix}nll"] for x in v.values()]) for v in full])
    return float(acc), float(nll), len(full)


def fmnist_markdown(rows, meta, stops, splits=(0,), window: int = 3):
    lines = ["# Posterior methods at their defaults on the Fashion-MNIST MLP", "",
             f"{meta['machine']}; jax {meta['jax']}; {meta['date']}; 2 CPU cores", "",
             "MLP (200, 100), sigmoid, N(0, 1) prior, on 10% of the Fashion-MNIST training rows over 10 clients "
             f"(sizes Dir(1), classes Dir(0.5); benchmarks/dual.py's split, seeds {', '.join(map(str, splits))}), "
             "every algorithm constructed with no argument. Test accuracy % (NLL) on 2,000 test rows at the default "
             "prediction (averaged over the splits, the range of the accuracy in braces); the BayesADMM "
             "paper's accuracy (its tuned settings) in brackets; for `prediction='auto'` the choice and the mean "
             "and average scored beside it; s / round: median wall time of a round after the first.", "",
             "| algorithm | splits | " + " | ".join(f"R={r}" for r in stops) + " | chosen | "
             "at the mean / averaged (last R) | s / round |", "|---|---|" + "---|" * (len(stops) + 3)]
    for a in dict.fromkeys(r["algorithm"] for r in rows):
        by_r = {}
        for r in rows:
            if r["algorithm"] == a:
                by_r.setdefault(r["rounds"], []).append(r)
        rs = {k: v[0] for k, v in by_r.items()}
        cells = []
        for r in stops:
            xs = by_r.get(r, [])
            paper = FMNIST_PAPER.get(a, {}).get(r)
            accs = [100 * x["accuracy"] for x in xs]
            spread = f" {{{min(accs):.1f}-{max(accs):.1f}}}" if len(xs) > 1 else ""
            cells.append("" if not xs else f"{np.mean(accs):.1f} ({np.mean([x['nll'] for x in xs]):.3f})" + spread
                         + (f" [{paper}]" if paper else ""))
        last = rs[max(rs)]
        both = (f"{100 * last['mean_accuracy']:.1f} ({last['mean_nll']:.3f}) / "
                f"{100 * last['average_accuracy']:.1f} ({last['average_nll']:.3f})") if "choice" in last else ""
        lines.append(f"| {a} | {len(by_r[max(rs)])} | " + " | ".join(cells) + f" | {last['prediction']} | {both} | {last['round_seconds']:.1f} |")
    windowed = []
    for a, prefix in [(a, p) for a in dict.fromkeys(r["algorithm"] for r in rows) for p in ("", "last_round_")]:
        cells = [window_means(rows, a, r, window, prefix) for r in stops]
        if any(c is not None for c in cells):
            windowed.append(f"| {a}{' (its last round)' if prefix else ''} | " + " | ".join(
                "" if c is None else f"{c[0]:.2f} ({c[1]:.3f}) [{FMNIST_PAPER.get(a, {}).get(r, '')}]"
                for c, r in zip(cells, stops)) + f" | {max(c[2] for c in cells if c is not None)} |")
    if windowed:
        lines += ["", f"The paper's protocol: each reading averaged over the rounds R-{window - 1} to R of a run "
                      "and then over the splits (the BayesADMM paper: \"averaged over three seeds and the three "
                      "previous rounds\"), test accuracy % (NLL), the paper's number in brackets:", "",
                  "| algorithm | " + " | ".join(f"R={r}" for r in stops) + " | splits |",
                  "|---|" + "---|" * (len(stops) + 1)] + windowed
    notes = {r["algorithm"]: r["note"] for r in rows if r.get("note")}
    if notes:
        lines += [""] + [f"`{a}`: {n}." for a, n in notes.items()]
    for a in dict.fromkeys(r["algorithm"] for r in rows if "last_round_accuracy" in r):
        cells = []
        for r in stops:
            xs = [x for x in rows if x["algorithm"] == a and x["rounds"] == r and "last_round_accuracy" in x]
            if xs:
                accs = [100 * x["last_round_accuracy"] for x in xs]
                cells.append(f"R={r} {np.mean(accs):.1f} ({np.mean([x['last_round_nll'] for x in xs]):.3f})"
                             + (f" {{{min(accs):.1f}-{max(accs):.1f}}}" if len(xs) > 1 else ""))
        lines += ["", f"`{a}` reports the average of its rounds' Gaussians (`iterate_average`, its clients searching "
                      f"their modes on minibatches); the last round's Gaussian of the same runs scored "
                      + ", ".join(cells) + "."]
    if FMNIST_NOTES.exists():                 # measurements beside the table, kept by hand
        lines += ["", FMNIST_NOTES.read_text().rstrip("\n")]
    return "\n".join(lines) + "\n"


#: hand-kept notes appended to the Fashion-MNIST table (the pooled reference, changes tried)
FMNIST_NOTES = Path(__file__).resolve().parent / "results" / "network_defaults_fmnist.notes.md"


def kept_rows(a, dest, name: str, algs) -> list:
    """With ``--update``: the rows of ``<dest>/<name>.json`` of the algorithms not run now (in the JSON each
    row keeps the run it came from; the Markdown's date is this run's)."""
    path = Path(dest) / f"{name}.json" if dest else None
    if not (a.update and path is not None and path.exists()):
        return []
    return [r for r in json.loads(path.read_text())["rows"] if r["algorithm"] not in algs]


def main_fmnist(a, algs):
    from dual import find_data_root, fmnist_split

    root = find_data_root()
    if root is None:
        print("no data folder (../shared/data or FEDPROB_DATA): skipping the Fashion-MNIST part")
        return []
    stops = [int(x) for x in a.stops.split(",")]
    splits = [int(x) for x in a.splits.split(",")]
    run_stops = sorted({r - j for r in stops for j in range(max(a.paper_window, 1)) if r - j >= 1})
    rows = []
    for split in splits:
        fed, test = fmnist_split(root, seed=split)
        rows += [row for name in algs for row in run_fmnist(name, run_stops, fed, test, split=split)]
    for row in rows:            # rounds scored only for the paper's window: no column of their own
        if row["rounds"] not in stops:
            row["window_only"] = True
    meta = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d")}
    dest = destination(a.out, False)
    kept = kept_rows(a, dest, "network_defaults_fmnist", algs)
    if kept:
        rows = kept + rows
        splits = sorted({r.get("split", 0) for r in rows})
        stops = sorted(set(stops) | {r["rounds"] for r in kept if not r.get("window_only")})
    md = fmnist_markdown(rows, meta, stops, splits, a.paper_window)
    print(md)
    write_results(dest, "network_defaults_fmnist", {"meta": meta, "rows": rows}, [md.rstrip("\n")])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; none for --quick)")
    ap.add_argument("--fmnist", action="store_true", help="the Fashion-MNIST MLP part (one split, seed 0)")
    ap.add_argument("--stops", default="10,25,50", help="--fmnist: round counts scored")
    ap.add_argument("--splits", default="0", help="--fmnist: the split seeds (results averaged over them)")
    ap.add_argument("--paper-window", type=int, default=3,
                    help="--fmnist: also score rounds R-2.. of each stop R and print their mean (the BayesADMM "
                         "paper's protocol; 1: the stops alone)")
    ap.add_argument("--update", action="store_true",
                    help="keep the recorded rows of the algorithms not run now")
    a = ap.parse_args(argv)
    algs, seeds, rounds = a.algorithms.split(","), a.seeds, a.rounds
    if a.fmnist:
        return main_fmnist(a, algs)
    if a.quick:
        algs, seeds, rounds = ["FedAvg", "PVI"], 1, 3
    ds = fp.data.load_digits()
    rows = []
    for seed in range(seeds):
        for name in algs:
            rows.append(run_one(name, seed, rounds, ds))
            print(rows[-1], flush=True)
    meta = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d")}
    dest = destination(a.out, a.quick)
    for r in rows:
        r["date"] = meta["date"]
    rows = kept_rows(a, dest, "network_defaults", algs) + rows
    md = markdown(rows, meta, seeds, rounds)
    print(md)
    write_results(dest, "network_defaults", {"meta": meta, "rows": rows}, [md.rstrip("\n")])
    return rows


if __name__ == "__main__":
    main()
