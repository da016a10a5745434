"""Every iterative algorithm at its defaults on heterogeneous convex federations, against the truth.

Federations (built here; every client's inputs correlated at 0.6 and shifted by its own N(0, 1) mean):

* ``logistic``: logistic regression (3 features and a bias), 8 clients of 20 to 3,000 rows; truth:
  NUTS on the pooled rows;
* ``linear``: linear regression with an unknown noise scale, the same 8 client sizes; truth: pooled NUTS;
* ``least_squares``: conjugate least squares (known noise 0.5, prior N(0, 10^2)), 5 clients of 30 to 500
  rows, inputs shifted by N(0, 1.5^2); truth: the exact posterior.

Every algorithm runs with no argument (its default rounds). Per (problem, algorithm, seed): the largest
|mean - truth mean| / truth sd over every coordinate, the range of sd / truth sd (point methods: none),
whether the run warned that it had not converged or that its Gaussian failed the k-hat check, and the
wall time. Bound (issue "iterative algorithms at their defaults"): posterior methods within 0.3 sd with
sds in [0.8, 1.25]; point methods within 0.3 sd or a warning that says they did not converge.

Usage::

    python benchmarks/defaults.py                 # 3 seeds, writes benchmarks/results/defaults.{json,md}
    python benchmarks/defaults.py --quick         # least squares, 1 seed, 3 algorithms; writes nothing
    python benchmarks/defaults.py --problems logistic --algorithms FedPA,PVI --seeds 1
"""
from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import fedprob as fp

ALGORITHMS = ("FedAvg", "FedProx", "FedDyn", "ADMM", "FedLap", "FedPA", "PVI", "FedLapCov", "BayesADMM")
POINT = ("FedAvg", "FedProx", "FedDyn", "ADMM", "FedLap")
PROBLEMS = ("logistic", "linear", "least_squares")
SIZES8 = (20, 50, 100, 200, 400, 800, 1500, 3000)
SIZES5 = (30, 60, 120, 250, 500)
SIGMA, PRIOR = 0.5, 10.0
#: draws of each method's posterior compared with the truth
DRAWS = 20000


def least_squares_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, SIGMA), obs=y)


def problem(name: str, seed: int):
    """(model, client list, pooled X, pooled y)."""
    rng = np.random.default_rng(seed)
    d = 3
    L = np.linalg.cholesky(np.full((d, d), 0.6) + 0.4 * np.eye(d))
    w, b = np.array([1.0, -0.5, 0.8]), 0.3
    sizes = SIZES5 if name == "least_squares" else SIZES8
    clients = []
    for n in sizes:
        shift = rng.normal(scale=1.5 if name == "least_squares" else 1.0, size=d)
        X = rng.normal(size=(n, d)) @ L.T + shift
        if name == "logistic":
            y = (rng.uniform(size=n) < 1 / (1 + np.exp(-(X @ w + b)))).astype(np.int32)
        elif name == "linear":
            y = (X @ w + b + 0.7 * rng.normal(size=n)).astype(np.float32)
        else:
            y = (X @ w + SIGMA * rng.normal(size=n)).astype(np.float32)
        clients.append((X.astype(np.float32), y))
    model = {"logistic": fp.models.logistic_regression(), "linear": fp.models.linear_regression(),
             "least_squares": least_squares_model}[name]
    X = np.concatenate([c[0] for c in clients])
    y = np.concatenate([c[1] for c in clients])
    return model, clients, X, y


def truth(name, model, clients, X, y, seed):
    """{site: (S, size) draws} of the reference posterior."""
    if name == "least_squares":
        P = np.eye(X.shape[1]) / PRIOR ** 2 + X.T.astype(np.float64) @ X / SIGMA ** 2
        cov = np.linalg.inv(P)
        mean = cov @ (X.T.astype(np.float64) @ y / SIGMA ** 2)
        return {"w": np.random.default_rng(seed).multivariate_normal(mean, cov, size=20000)}
    mcmc = MCMC(NUTS(model), num_warmup=1000, num_samples=4000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), jnp.asarray(X), jnp.asarray(y))
    return {k: np.asarray(v).reshape(v.shape[0], -1) for k, v in mcmc.get_samples().items()}


def mean_field_sd(ref):
    """The sds of the best diagonal (mean-field) Gaussian of the reference, ``1 / sqrt(diag(Sigma^-1))``
    over every coordinate of every site: what a diagonal family reaches at best (its conditional
    precisions), in the order of :func:`compare`."""
    flat = np.concatenate([r for r in ref.values()], axis=1)
    return 1.0 / np.sqrt(np.diag(np.linalg.inv(np.atleast_2d(np.cov(flat.T)))))


def compare(draws, ref, point, scale=None):
    """(largest |mean error| / truth sd, sd ratio range against the truth's sds, or against ``scale``)."""
    errs, sds, truth_sds = [], [], []
    for k, r in ref.items():
        d = np.asarray(draws[k]).reshape(np.shape(draws[k])[0], -1)
        errs.append(np.abs(d.mean(0) - r.mean(0)) / r.std(0))
        sds.append(d.std(0))
        truth_sds.append(r.std(0))
    err = float(np.max(np.concatenate(errs)))
    if point:
        return err, None, None
    ratios = np.concatenate(sds) / (np.concatenate(truth_sds) if scale is None else scale)
    return err, float(ratios.min()), float(ratios.max())


def run_one(pname, alg_name, model, fed, ref, seed):
    row = {"problem": pname, "algorithm": alg_name, "seed": seed}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            res = fp.run(getattr(fp.algorithms, alg_name)(), model, fed, seed=seed, progress=False)
            # 20,000 draws: the sd ratios' own Monte Carlo error about 0.5% (4,000 put FedLapCov's 0.807 on the
            # linear problem, seed 0, at 0.799, under the bound's 0.8)
            draws = res.posterior.sample(jax.random.PRNGKey(seed + 1), DRAWS)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["rounds"] = len(res.history)
        point = alg_name in POINT
        err, lo, hi = compare(draws, ref, point)
        row.update(mean_err_sd=round(err, 3), sd_ratio_min=None if lo is None else round(lo, 3),
                   sd_ratio_max=None if hi is None else round(hi, 3))
        row["not_converged_warning"] = any("has not converged" in str(w.message) for w in rec)
        row["khat_warning"] = any("Pareto k-hat" in str(w.message) for w in rec)
        row["diagonal"] = "diagonal_check" in res.info
        row["diagonal_warning"] = any("diagonal Gaussian" in str(w.message) for w in rec)
        if "mode_distance_sd" in res.info:
            row["mode_distance_sd"] = round(float(res.info["mode_distance_sd"]), 3)
        if row["diagonal"] and not point:
            # a diagonal family keeps conditional precisions: its best is the truth's mean-field sds
            _, mlo, mhi = compare(draws, ref, point, scale=mean_field_sd(ref))
            row.update(mf_ratio_min=round(mlo, 3), mf_ratio_max=round(mhi, 3))
        if row["diagonal"] and not point:
            within = err <= 0.3 and 0.8 <= mlo and mhi <= 1.25 and (row["diagonal_warning"] or 0.8 <= lo)
        else:
            within = err <= 0.3 and (point or (0.8 <= lo and hi <= 1.25))
        row["meets_bound"] = bool(within or (point and row["not_converged_warning"]))
    except Exception as e:                      # noqa: BLE001 - the table records what a user would see
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def markdown(rows, meta, seeds):
    lines = ["# Iterative algorithms at their defaults on heterogeneous convex federations", "",
             f"{meta['machine']}; jax {meta['jax']}; {meta['date']}; seeds {seeds}", "",
             "mean err: largest |mean - truth mean| / truth sd (worst seed); sd ratio: range of sd / truth sd "
             "over seeds (point methods: -); mean-field: for a diagonal family, sd over the truth's "
             "mean-field sd (1 / sqrt(diag(Sigma^-1)), the best a diagonal Gaussian reaches); warned: "
             "'has not converged' (point methods), k-hat, or (diagonal families) the run's warning that "
             "its sds are the conditional ones; bound: within 0.3 sd with sds in [0.8, 1.25] (diagonal "
             "families: of the mean-field sds, and a warning where the truth's fall outside), or (point "
             "methods) within 0.3 sd or warned; s: mean wall time of a run.", "",
             "| problem | algorithm | rounds | mean err (sd) | sd ratio | mean-field | warned | bound | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = []
    for r in rows:
        if (r["problem"], r["algorithm"]) not in keys:
            keys.append((r["problem"], r["algorithm"]))
    for p, a in keys:
        rs = [r for r in rows if r["problem"] == p and r["algorithm"] == a]
        if any("error" in r for r in rs):
            lines.append(f"| {p} | {a} | - | error | | | | **no** | |")
            continue
        err = max(r["mean_err_sd"] for r in rs)
        lo = [r["sd_ratio_min"] for r in rs if r["sd_ratio_min"] is not None]
        hi = [r["sd_ratio_max"] for r in rs if r["sd_ratio_max"] is not None]
        sd = f"{min(lo):.2f}-{max(hi):.2f}" if lo else "-"
        mlo = [r["mf_ratio_min"] for r in rs if "mf_ratio_min" in r]
        mhi = [r["mf_ratio_max"] for r in rs if "mf_ratio_max" in r]
        mf = f"{min(mlo):.2f}-{max(mhi):.2f}" if mlo else "-"
        warned = sum(r["not_converged_warning"] or r["khat_warning"] or r.get("diagonal_warning", False)
                     for r in rs)
        ok = all(r["meets_bound"] for r in rs)
        secs = np.mean([r["seconds"] for r in rs])
        rounds = sorted({r["rounds"] for r in rs})
        lines.append(f"| {p} | {a} | {'/'.join(map(str, rounds))} | {err:.3g} | {sd} | {mf} | {warned}/{len(rs)} | "
                     f"{'yes' if ok else '**no**'} | {secs:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="least squares, 1 seed, 3 algorithms; writes nothing")
    ap.add_argument("--problems", default=None)
    ap.add_argument("--algorithms", default=None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of the existing defaults.json whose (problem, algorithm) this run leaves out")
    a = ap.parse_args(argv)
    problems = a.problems.split(",") if a.problems else list(PROBLEMS)
    algs = a.algorithms.split(",") if a.algorithms else list(ALGORITHMS)
    seeds = a.seeds
    if a.quick:
        problems, algs, seeds = ["least_squares"], ["FedAvg", "FedPA", "PVI"], 1
    rows = []
    for p in problems:
        for seed in range(seeds):
            model, clients, X, y = problem(p, seed)
            fed = fp.data.FederatedData.from_clients(clients)
            ref = truth(p, model, clients, X, y, seed)
            for alg in algs:
                row = run_one(p, alg, model, fed, ref, seed)
                rows.append(row)
                print(row, flush=True)
    meta = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d")}
    seeds_note = str(seeds)
    if a.merge and not a.quick and (Path(a.out) / "defaults.json").exists():
        done = {(r["problem"], r["algorithm"]) for r in rows}
        old = json.loads((Path(a.out) / "defaults.json").read_text())
        kept = [r for r in old["rows"] if (r["problem"], r["algorithm"]) not in done]
        order = {(p, al): i for i, (p, al) in enumerate((p, al) for p in PROBLEMS for al in ALGORITHMS)}
        rows = sorted(kept + rows, key=lambda r: (order.get((r["problem"], r["algorithm"]), 1 << 30), r["seed"]))
        if kept:
            seeds_note = f"{seeds} ({', '.join(sorted({r['algorithm'] for r in kept}))}: the rows of {old['meta']['date']})"
    md = markdown(rows, meta, seeds_note)
    print(md)
    if not a.quick:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "defaults.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "defaults.md").write_text(md)
    return rows


if __name__ == "__main__":
    main()
