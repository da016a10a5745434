"""Posterior methods at their defaults on a network, against FedAvg at its defaults.

``bnn_mlp(hidden_sizes=(100,), num_classes=10)`` (7,510 parameters, N(0, 1) prior) on the digits
training rows split over 10 clients by Dirichlet(0.5) labels (partition seeds 0, 1, 2), 20 rounds,
every algorithm constructed with no argument; test accuracy and NLL on the digits test rows at
each method's default prediction (for PVI, FedLap-Cov and BayesADMM ``prediction="auto"``: the
chosen one is reported with the leave-one-client-out scores behind it, and the mean and the
average are both scored).

Usage::

    python benchmarks/network_defaults.py            # 3 seeds; writes benchmarks/results/network_defaults.{json,md}
    python benchmarks/network_defaults.py --quick    # 1 seed, 3 rounds, FedAvg and PVI; writes nothing
"""
from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import jax
import numpy as np

import fedprob as fp

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    algs, seeds, rounds = a.algorithms.split(","), a.seeds, a.rounds
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
    md = markdown(rows, meta, seeds, rounds)
    print(md)
    if not a.quick:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "network_defaults.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "network_defaults.md").write_text(md)
    return rows


if __name__ == "__main__":
    main()
