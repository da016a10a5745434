"""Example-style NumPyro programs at every algorithm's defaults, against NUTS on the pooled rows.

Models (written as a NumPyro user writes them; "data" plate, likelihood inside):

* ``robust``: Student-t regression (nu = 4), the likelihood masked on ~20% of rows;
* ``zip``: zero-inflated Poisson regression;
* ``ordinal``: ordinal logistic regression, cutpoints from Dirichlet class probabilities
  (a ``numpyro.deterministic`` site);
* ``binomial``: binomial regression, integer trial counts and an integer group index;
* ``known_scales``: a normal mean with a known sd per row read from the inputs;
* ``factor``: a Poisson GLM written as a ``numpyro.factor``;
* ``horseshoe``: logistic regression under a horseshoe prior (far from Gaussian);
* ``funnel``: eight schools, centred (a funnel; 4 clients of 2 schools).

4 clients of equal size (iid), except the funnel. Every algorithm runs with no argument. Per
(model, algorithm): the largest |mean - NUTS mean| / NUTS sd over every coordinate of every
latent site (constrained), the range of sd / NUTS sd (point estimates: none), whether a
Pareto k-hat warning was raised, the wall time, or the error raised.

Done-when bounds (the near-Gaussian models): mean within 0.5 sd, sds within [0.7, 1.4] (point
estimates: within 0.5 sd, or a warning that the run has not converged, fedprob.convergence);
on the horseshoe and the funnel every Gaussian-family method warns.

Usage::

    python benchmarks/any_model.py                 # writes benchmarks/results/any_model.{json,md}
    python benchmarks/any_model.py --quick         # 2 models x 3 algorithms, writes nothing
    python benchmarks/any_model.py --models zip --algorithms PVI,FedPA   # replaces those rows of the table
"""
from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import MCMC, NUTS

import fedprob as fp
from fedprob.models import examples as ex

NEAR_GAUSSIAN = ("robust", "zip", "ordinal", "binomial", "known_scales", "factor")
FAR = ("horseshoe", "funnel")
ALGORITHMS = ("FedAvg", "PVI", "FedLap", "FedLapCov", "BayesADMM", "FedPA", "EPMCMC", "ConsensusMC",
              "Ensemble", "PredictiveBayes", "EP")
POINT = ("FedAvg", "FedLap")             # FedLap: the point w_g (its family fixes the covariance)
# no global parameter posterior by design: their parameter rows are the union of the client draws (a
# mixture of client posteriors, about sqrt(K) times as wide); their bound is a finite predictive
MIXTURES = ("Ensemble", "PredictiveBayes")
GAUSSIAN_FAMILY = ("PVI", "FedLapCov", "BayesADMM", "FedPA", "EPMCMC", "EP")


# -- models (fedprob.models.examples) ----------------------------------------------------------------
robust = ex.robust_regression
zip_model = ex.zero_inflated_poisson
ordinal = ex.ordinal_regression
binomial = ex.binomial_groups
known_scales = ex.known_scales
factor = ex.factor_poisson
horseshoe = ex.horseshoe_logistic
schools = ex.eight_schools
G = ex.NUM_GROUPS


# -- data --------------------------------------------------------------------------------------------
def problem(name: str, seed: int = 0):
    """(model, X, y, federation)."""
    rng = np.random.default_rng(seed)
    n = 400
    if name == "funnel":
        y = np.array([28, 8, -3, 7, -1, 1, 18, 12.0], np.float32)
        sd = np.array([15, 10, 16, 11, 9, 11, 10, 18.0], np.float32)
        X = np.stack([np.arange(8.0), sd], 1).astype(np.float32)
        fed = fp.data.partition(X, y, num_clients=4, scheme="groups", groups=np.arange(8) // 2)
        return schools, X, y, fed
    if name == "robust":
        X = np.stack([rng.normal(size=n), rng.uniform(size=n) > 0.2], 1).astype(np.float32)
        y = (1.5 * X[:, 0] - 0.5 + 0.5 * rng.standard_t(4, size=n)).astype(np.float32)
        model = robust
    elif name == "zip":
        X = rng.normal(size=(n, 1)).astype(np.float32)
        y = np.where(rng.uniform(size=n) < 0.3, 0, rng.poisson(np.exp(0.7 * X[:, 0] + 0.5))).astype(np.int32)
        model = zip_model
    elif name == "ordinal":
        X = rng.normal(size=(n, 1)).astype(np.float32)
        eta = 1.2 * X[:, 0] + rng.logistic(size=n)
        y = np.digitize(eta, [-1.0, 0.0, 1.2]).astype(np.int32)
        model = ordinal
    elif name == "binomial":
        grp = rng.integers(0, G, size=n)
        trials = rng.integers(1, 20, size=n)
        a = np.array([-1.0, 0.3, 1.2])
        y = rng.binomial(trials, 1 / (1 + np.exp(-a[grp]))).astype(np.int32)
        X = np.stack([grp, trials], 1).astype(np.int32)
        model = binomial
    elif name == "known_scales":
        sd = rng.uniform(0.5, 3.0, size=n).astype(np.float32)
        X = np.stack([np.ones(n, np.float32), sd], 1)
        y = (1.3 + sd * rng.normal(size=n)).astype(np.float32)
        model = known_scales
    elif name == "factor":
        X = rng.normal(size=(n, 1)).astype(np.float32)
        y = rng.poisson(np.exp(0.6 * X[:, 0] + 0.3)).astype(np.float32)
        model = factor
    elif name == "horseshoe":
        n = 200
        X = rng.normal(size=(n, 5)).astype(np.float32)
        w = np.array([2.0, 0, 0, 0, -1.5])
        y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ w))).astype(np.int32)
        model = horseshoe
    else:
        raise ValueError(name)
    return model, X, y, fp.data.partition(X, y, num_clients=4, scheme="iid", seed=0)


MODELS = {"robust", "zip", "ordinal", "binomial", "known_scales", "factor", "horseshoe", "funnel"}


def pooled_nuts(model, X, y, seed=0):
    mcmc = MCMC(NUTS(model), num_warmup=1000, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), jnp.asarray(X), jnp.asarray(y))
    return {k: np.asarray(v).reshape(v.shape[0], -1) for k, v in mcmc.get_samples().items()}


def compare(draws: dict, ref: dict, point: bool):
    errs, ratios = [], []
    for k, r in ref.items():
        if k not in draws:
            continue
        d = np.asarray(draws[k]).reshape(np.shape(draws[k])[0], -1)
        sd = r.std(0)
        errs.append(np.abs(d.mean(0) - r.mean(0)) / sd)
        if not point:
            ratios.append(d.std(0) / sd)
    err = float(np.max(np.concatenate(errs)))
    if point:
        return err, None, None
    ratios = np.concatenate(ratios)
    return err, float(ratios.min()), float(ratios.max())


def run_one(model_name, alg_name, model, X, y, fed, ref):
    alg = getattr(fp.algorithms, alg_name)()
    row = {"model": model_name, "algorithm": alg_name}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            res = fp.run(alg, model, fed, seed=0, progress=False)
            draws = res.posterior.sample(jax.random.PRNGKey(1), 2000)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        err, lo, hi = compare(draws, ref, alg_name in POINT)
        row.update(mean_err_sd=round(err, 3), sd_ratio_min=None if lo is None else round(lo, 3),
                   sd_ratio_max=None if hi is None else round(hi, 3))
        row["khat_warning"] = any("Pareto k-hat" in str(w.message) for w in rec)
        row["warnings"] = sorted({str(w.message).split(":")[0][:80] for w in rec
                                  if issubclass(w.category, (UserWarning, RuntimeWarning))})
        ok = row["khat_warning"] if model_name in FAR and alg_name in GAUSSIAN_FAMILY else None
        row["not_converged_warning"] = any("has not converged" in str(w.message) for w in rec)
        if model_name in NEAR_GAUSSIAN and alg_name not in MIXTURES:
            ok = err <= 0.5 and (lo is None or (0.7 <= lo and hi <= 1.4))
            if alg_name in POINT:               # a point estimate: near the mode, or it says it is not
                ok = err <= 0.5 or row["not_converged_warning"]
        if alg_name in MIXTURES:
            Xt, yt = X[:50], y[:50]
            try:
                lpd = np.asarray(res.posterior.log_predictive_density(Xt, yt))
                row["finite_predictive"] = bool(np.all(np.isfinite(lpd)))
            except ValueError as e:          # a refusal that names the construct (a factor likelihood)
                row["finite_predictive"] = None
                row["predictive_refused"] = str(e)[:200]
            ok = row["finite_predictive"] is not False
        row["meets_bound"] = ok
    except Exception as e:                      # noqa: BLE001 - the table records what a user would see
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["traceback"] = traceback.format_exc(limit=3)[-600:]
    return row


def markdown(rows, meta):
    lines = [f"# Example-style models at every algorithm's defaults against pooled NUTS", "",
             f"{meta['machine']}; jax {meta['jax']}; {meta['date']}", "",
             "mean err: largest |mean - NUTS mean| / NUTS sd over every coordinate; sd ratio: range of "
             "sd / NUTS sd (point estimates: -); k-hat: the Pareto k-hat warning was raised; bound: mean "
             "within 0.5 sd and sds within [0.7, 1.4] (near-Gaussian models; point estimates, FedAvg and "
             "FedLap: within 0.5 sd or a 'has not converged' warning, the run's mode distance in the "
             "last column), the warning raised "
             "(horseshoe, funnel, Gaussian-family methods); Ensemble and PredictiveBayes have no global "
             "parameter posterior (their rows are the union of client draws): their bound is a finite "
             "predictive density on 50 training rows, or a refusal naming the construct.", "",
             "| model | algorithm | mean err (sd) | sd ratio | k-hat warned | bound | s | error / not converged |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sd = "-" if r.get("sd_ratio_min") is None else f"{r['sd_ratio_min']:.2f}-{r['sd_ratio_max']:.2f}"
        bound = {True: "yes", False: "**no**", None: "-"}[r.get("meets_bound")]
        lines.append(f"| {r['model']} | {r['algorithm']} | {r.get('mean_err_sd', '-')} | {sd} | "
                     f"{'yes' if r.get('khat_warning') else 'no'} | {bound} | {r['seconds']} | "
                     f"{r.get('error', '')[:120]}{' not converged (warned)' if r.get('not_converged_warning') else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 models x 3 algorithms; writes nothing")
    ap.add_argument("--models", default=None, help="comma-separated subset")
    ap.add_argument("--algorithms", default=None, help="comma-separated subset")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    models = a.models.split(",") if a.models else sorted(MODELS, key=list(NEAR_GAUSSIAN + FAR).index)
    algs = a.algorithms.split(",") if a.algorithms else list(ALGORITHMS)
    if a.quick:
        models, algs = ["known_scales", "zip"], ["PVI", "EPMCMC", "Ensemble"]
    rows = []
    for m in models:
        model, X, y, fed = problem(m)
        ref = pooled_nuts(model, X, y)
        for alg in algs:
            row = run_one(m, alg, model, X, y, fed, ref)
            rows.append(row)
            print({k: v for k, v in row.items() if k not in ("traceback", "warnings")}, flush=True)
    meta = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    md = markdown(rows, meta)
    print(md)
    if not a.quick:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        if (a.models or a.algorithms) and (out / "any_model.json").exists():
            rows = merged_rows(json.loads((out / "any_model.json").read_text())["rows"], rows)
            md = markdown(rows, meta)
        (out / "any_model.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "any_model.md").write_text(md)
    return rows


def merged_rows(old, new):
    """The stored table with the (model, algorithm) rows of a subset run replaced (new pairs appended)."""
    fresh = {(r["model"], r["algorithm"]): r for r in new}
    out = [fresh.pop((r["model"], r["algorithm"]), r) for r in old]
    return out + list(fresh.values())


if __name__ == "__main__":
    main()
