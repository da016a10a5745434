"""The full-batch MAP search (Laplace clients, the natural loops' server solves): stopping once the
loss stalls against running every one of its 200 L-BFGS steps.

``fedprob.inference.optim.minimize`` runs L-BFGS (zoom line search) in a ``lax.while_loop`` that stops
after ``STALL_STEPS`` steps in a row improving the best loss by at most ``STALL_TOL * eps * (1 + |loss|)``.
A converged L-BFGS otherwise spends each remaining step in a line search that cannot decrease the loss.
Measured side by side in one process: each setting ``fixed`` (``STALL_STEPS`` above the step count, so
all 200 steps run, as before the stop) and ``stall`` (the default), each compiled first, then timed
(best of ``--repeats`` runs of ``fp.run``), and the two answers compared (largest difference of the
posterior means in posterior sds, test accuracy where there is one).

Settings: PVI (diagonal family) and BayesADMM at their defaults on 4 clients of 4,000 correlated
linear-regression rows in float64 (the setting of tests/test_dual.py), and PVI / EP-MCMC(Laplace, diag)
at their defaults on digits, softmax regression (650 parameters), 10 Dirichlet(0.5) clients, float32.

    python benchmarks/map_search.py            # writes benchmarks/results/map_search.{json,md}
    python benchmarks/map_search.py --quick    # one setting, one repeat, writes nothing
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fedprob as fp                              # noqa: E402
from fedprob.engine import client_phase, local   # noqa: E402
from fedprob.inference import optim               # noqa: E402

SIGMA, PRIOR = 0.5, 1.0


def linreg_setting(n=4000, K=4, d=3, seed=0):
    rng = np.random.default_rng(seed)
    corr = 0.6 * np.ones((d, d)) + 0.4 * np.eye(d)
    Xs = [rng.normal(size=(n, d)) @ np.linalg.cholesky(corr).T + rng.normal(size=d) for _ in range(K)]
    w = rng.normal(size=d) * 2
    ys = [X @ w + SIGMA * rng.normal(size=n) for X in Xs]
    return fp.data.FederatedData.from_clients(list(zip(Xs, ys))), \
        fp.models.linear_regression(noise_scale=SIGMA, prior_scale=PRIOR, bias=False), None


def digits_setting():
    ds = fp.data.load_digits(seed=0)
    fed = fp.data.partition(*ds.train, num_clients=10, scheme="dirichlet", alpha=0.5, seed=0)
    return fed, fp.models.softmax_regression(10), ds.test


def timed(algo, model, fed, test, repeats, rounds=None):
    kw = dict(progress=False, seed=0, eval_data=test, rounds=rounds)
    first = time.perf_counter()
    res = fp.run(algo, model, fed, **kw)
    first = time.perf_counter() - first
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        res = fp.run(algo, model, fed, **kw)
        times.append(time.perf_counter() - t)
    return res, first, min(times)


def compare(name, algo, setting, repeats, rounds=None):
    fed, model, test = setting
    out = {"setting": name}
    results = {}
    default = optim.STALL_STEPS
    try:
        for mode, steps in (("fixed", 10 ** 9), ("stall", default)):
            optim.STALL_STEPS = steps          # read when a program is traced: forget every compiled one
            local.clear_cache()
            client_phase.clear_cache()
            jax.clear_caches()
            res, first, best = timed(algo, model, fed, test, repeats, rounds)
            results[mode] = res
            out[f"{mode}_first_s"] = first
            out[f"{mode}_s"] = best
            if test is not None:
                out[f"{mode}_accuracy"] = float(res.history[-1]["accuracy"])
    finally:
        optim.STALL_STEPS = default
    out["fixed_over_stall"] = out["fixed_s"] / out["stall_s"]
    a, b = results["fixed"].posterior, results["stall"].posterior
    sd = np.concatenate([np.ravel(np.asarray(v)) for v in a.sd.values()])
    diff = np.concatenate([np.ravel(np.asarray(a.mean[k]) - np.asarray(b.mean[k])) for k in a.mean])
    out["mean_diff_in_sd"] = float(np.max(np.abs(diff) / sd))
    out["rounds"] = len(results["stall"].history)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    repeats = 1 if args.quick else args.repeats
    rows = []
    jax.config.update("jax_enable_x64", True)
    try:
        lin = linreg_setting(n=200 if args.quick else 4000)
        cases = [("linreg 4 x 4000 rows, float64", "BayesADMM", fp.algorithms.BayesADMM(family="diag"))]
        if not args.quick:
            cases.append(("linreg 4 x 4000 rows, float64", "PVI(diag)", fp.algorithms.PVI(family="diag")))
        for setting, method, algo in cases:
            # --quick: 8 rounds (the default is 25): every round's search is timed the same way
            rows.append({"method": method, **compare(setting, algo, lin, repeats, 8 if args.quick else None)})
    finally:
        jax.config.update("jax_enable_x64", False)
    if not args.quick:
        dig = digits_setting()
        for method, algo in (("PVI", fp.algorithms.PVI()),
                             ("EPMCMC(Laplace, diag)", fp.algorithms.EPMCMC(
                                 client=fp.inference.Laplace(hessian="diag_ggn"), family="diag"))):
            rows.append({"method": method, **compare("digits, softmax, 10 clients, float32", algo, dig, repeats)})
    cols = ("setting", "method", "rounds", "fixed_s", "stall_s", "fixed_over_stall", "fixed_first_s",
            "stall_first_s", "mean_diff_in_sd", "fixed_accuracy", "stall_accuracy")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                       for c in cols) + " |")
    table = "\n".join(lines)
    print(table)
    env = {"backend": jax.default_backend(), "devices": str(jax.devices()), "python": platform.python_version(),
           "jax": jax.__version__, "quick": args.quick, "repeats": repeats}
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "map_search.json").write_text(json.dumps({"rows": rows, "env": env}, indent=1))
        (out / "map_search.md").write_text(
            "# Full-batch MAP search: stop when the loss stalls vs. all 200 L-BFGS steps\n\n" + table +
            f"\n\nSeconds per `fp.run` after compiling (best of {repeats}); `*_first_s`: the first run, "
            "compile included. `mean_diff_in_sd`: largest difference of the two posterior means in "
            "posterior sds.\n\n```\n" + json.dumps(env) + "\n```\n")
    return rows


if __name__ == "__main__":
    main()
