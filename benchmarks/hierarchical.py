"""A hierarchical model on real grouped data: PVI at its defaults against NUTS on the pooled program.

Data: UCI Bike Sharing by calendar week (:func:`fedprob.data.load_bike_weeks`):
105 clients, 5 train rows in every full week, 2 held-out rows per week.
Model: :func:`fedprob.models.hierarchical_linear` (non-centred varying
intercepts over weeks; then varying slopes on temperature; then also a
varying noise scale per week with ``--noise``, run with EP and NUTS clients:
its pooled program scores the best held-out NLL, and PVI's Laplace clients
collapse on it; see benchmarks/results/hierarchical.md).

Reference: NumPyro's NUTS on the pooled hierarchical program (the same model
with one ``z`` per week indexed by each row's week; 2 chains, 1000 warm-up,
2000 draws each). Reported, side by side in one run:

* global sites: ``|mean - NUTS mean| / NUTS sd`` (max over coordinates) and
  ``sd / NUTS sd`` (range);
* every client's local sites (``result.posterior.local_mean`` /
  ``local_sd``) against the pooled program's per-week ``z``;
* the new-client predictive (``client=None``: local sites drawn from their
  prior given each global draw) at the held-out inputs: mean shift in units
  of the pooled program's predictive sd, and sd ratio;
* held-out NLL (mean over the held-out rows of each week, under that week's
  own predictive) of the hierarchical model against no pooling (a Bayesian
  linear regression on each week's rows alone, NUTS per week, vmapped) and
  complete pooling (one regression on all rows, no local sites);
* wall times (after the imports, compile included): pooled NUTS, ``fp.run``.

``--quick``: the first 24 weeks, intercepts only, 1 chain; prints, writes
nothing. Otherwise writes ``benchmarks/results/hierarchical.{json,md}``.
Data from $FEDPROB_DATA or ../shared/data.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import fedprob as fp
from fedprob.algorithms.client_runs import run_clients
from fedprob.local_sites import sample_local

RESULTS = Path(__file__).resolve().parent / "results"


def data_root():
    env = os.environ.get("FEDPROB_DATA")
    here = Path(__file__).resolve().parents[2] / "shared" / "data"
    for p in (env, here):
        if p and Path(p).is_dir():
            return Path(p)
    return None


def pooled_program(num_groups: int, slopes: bool, slope_feature: int = 0, noise: bool = False):
    """The hierarchical model written over pooled rows: one ``z`` per group, indexed by the row's group."""

    def model(X, g, y=None):
        d = X.shape[1]
        mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 1.0))
        sigma_a = numpyro.sample("sigma_a", dist.LogNormal(0.0, 1.0))
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        z_a = numpyro.sample("z_a", dist.Normal(0.0, 1.0).expand([num_groups]).to_event(1))
        mean = mu_a + sigma_a * z_a[g] + X @ w
        if slopes:
            sigma_b = numpyro.sample("sigma_b", dist.LogNormal(0.0, 1.0))
            z_b = numpyro.sample("z_b", dist.Normal(0.0, 1.0).expand([num_groups]).to_event(1))
            mean = mean + sigma_b * z_b[g] * X[:, slope_feature]
        if noise:
            tau_s = numpyro.sample("tau_s", dist.LogNormal(math.log(0.5), 1.0))
            z_s = numpyro.sample("z_s", dist.Normal(0.0, 1.0).expand([num_groups]).to_event(1))
            sigma = sigma * jnp.exp(tau_s * z_s[g])
        numpyro.sample("y", dist.Normal(mean, sigma), obs=y)

    return model


def grouped(ds, weeks: int):
    """(train clients [(X_k, y_k)], test clients [(X_k, y_k)]) of the first ``weeks`` weeks."""
    train = [(ds.X_train[ds.group_train == k], ds.y_train[ds.group_train == k]) for k in range(weeks)]
    test = [(ds.X_test[ds.group_test == k], ds.y_test[ds.group_test == k]) for k in range(weeks)]
    return train, test


def new_client_moments(draws: dict, X, slopes: bool, slope_feature: int = 0):
    """Mean and sd at each row of X of a new group's predictive, from global draws (z_new integrated)."""
    w = np.asarray(draws["w"])
    mean_s = np.asarray(draws["mu_a"])[:, None] + w @ X.T                     # (S, n)
    noise = np.asarray(draws["sigma"])[:, None] ** 2
    if "tau_s" in draws:                     # E exp(2 tau z) = exp(2 tau^2) for a new client's z ~ N(0, 1)
        noise = noise * np.exp(2 * np.asarray(draws["tau_s"])[:, None] ** 2)
    var_s = np.asarray(draws["sigma_a"])[:, None] ** 2 + noise
    if slopes:
        var_s = var_s + (np.asarray(draws["sigma_b"])[:, None] * X[None, :, slope_feature]) ** 2
    mean = mean_s.mean(0)
    return mean, np.sqrt(var_s.mean(0) + mean_s.var(0))


def _nll_from_draws(potential, draws, X, y):
    """Mean held-out NLL of one client's rows under the mixture of its draws (S, d)."""
    ll = jax.vmap(lambda z: potential.pointwise_log_likelihood(z, X, y))(draws)        # (S, n)
    return -float(jnp.mean(jax.scipy.special.logsumexp(ll, 0) - math.log(ll.shape[0])))


def run(weeks: int = 105, slopes: bool = False, chains: int = 2, seed: int = 0, root=None,
        noise: bool = False, algorithm: str = "PVI") -> dict:
    """The comparison on the first ``weeks`` weeks (module docstring), in float64 (restored after)."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        return _run(weeks, slopes, chains, seed, root, noise, algorithm)
    finally:
        jax.config.update("jax_enable_x64", before)


def _run(weeks, slopes, chains, seed, root, noise, algorithm) -> dict:
    ds = fp.data.load_bike_weeks(root if root is not None else data_root())
    train, test = grouped(ds, weeks)
    K = weeks
    # the reference: NUTS on the pooled hierarchical program
    rows = np.concatenate([np.full(len(y), k) for k, (_, y) in enumerate(train)])
    X_all = np.concatenate([x for x, _ in train]).astype(np.float64)
    y_all = np.concatenate([y for _, y in train]).astype(np.float64)
    t = time.perf_counter()
    mcmc = MCMC(NUTS(pooled_program(K, slopes, noise=noise)), num_warmup=1000, num_samples=2000, num_chains=chains,
                chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed + 1), X_all, rows, y_all)
    ref = {k: np.asarray(v) for k, v in mcmc.get_samples().items()}
    nuts_s = time.perf_counter() - t
    # the federation, PVI at its defaults
    fed = fp.data.FederatedData.from_clients(train, dtype=np.float64)
    model = fp.models.hierarchical_linear(varying_slopes=slopes, varying_noise=noise)
    t = time.perf_counter()
    result = fp.run(getattr(fp.algorithms, algorithm)(), model, fed, seed=seed, progress=False)
    run_s = time.perf_counter() - t
    post = result.posterior
    draws = {k: np.asarray(v) for k, v in post.sample(jax.random.PRNGKey(seed + 2), 4000).items()}
    global_sites = ["mu_a", "sigma_a", "w", "sigma"] + (["sigma_b"] if slopes else []) + (["tau_s"] if noise else [])
    out = {"weeks": K, "slopes": slopes, "noise": noise, "algorithm": algorithm, "train_rows": int(len(y_all)), "nuts_s": nuts_s, "run_s": run_s,
           "rounds": len(result.history), "local_refresh_s": result.info.get("local_refresh", {}).get("time_s"),
           "global": {}, "local": {}}
    for s in global_sites:
        m, sd = ref[s].mean(0), ref[s].std(0)
        z = np.atleast_1d((draws[s].mean(0) - m) / sd)
        r = np.atleast_1d(draws[s].std(0) / sd)
        out["global"][s] = {"max_abs_z": float(np.abs(z).max()), "sd_ratio_min": float(r.min()),
                            "sd_ratio_max": float(r.max())}
    for s in ["z_a"] + (["z_b"] if slopes else []) + (["z_s"] if noise else []):
        m, sd = ref[s].mean(0), ref[s].std(0)
        z = (np.asarray(post.local_mean[s]) - m) / sd
        r = np.asarray(post.local_sd[s]) / sd
        out["local"][s] = {"max_abs_z": float(np.abs(z).max()), "sd_ratio_min": float(r.min()),
                           "sd_ratio_max": float(r.max())}
    # a new client's predictive at the held-out inputs
    X_te = np.concatenate([x for x, _ in test]).astype(np.float64)
    m_ref, s_ref = new_client_moments(ref, X_te, slopes)
    m_fed, s_fed = new_client_moments(draws, X_te, slopes)
    out["new_client"] = {"max_abs_shift_sd": float(np.max(np.abs(m_fed - m_ref) / s_ref)),
                         "sd_ratio_min": float(np.min(s_fed / s_ref)), "sd_ratio_max": float(np.max(s_fed / s_ref))}
    # held-out NLL: hierarchical (each week's own predictive), no pooling, complete pooling
    has_test = [k for k in range(K) if len(test[k][1])]
    n_te = sum(len(test[k][1]) for k in has_test)
    pot = post.potential
    hier = 0.0
    for k in has_test:
        cond = jax.tree_util.tree_map(lambda a: a[k], post.local)
        zg = post.form.sample(jax.random.PRNGKey(100 + k), 2000)
        zl = sample_local(cond, zg, jax.random.PRNGKey(200 + k))
        Xk, yk = jnp.asarray(test[k][0], jnp.float64), jnp.asarray(test[k][1], jnp.float64)
        hier += _nll_from_draws(pot, jnp.concatenate([zg, zl], -1), Xk, yk) * len(yk)
    ref_nll = 0.0
    for k in has_test:
        Xk, yk = test[k][0].astype(np.float64), test[k][1].astype(np.float64)
        mean = (ref["mu_a"][:, None] + ref["sigma_a"][:, None] * ref["z_a"][:, k:k + 1] + ref["w"] @ Xk.T)
        if slopes:
            mean = mean + ref["sigma_b"][:, None] * ref["z_b"][:, k:k + 1] * Xk[None, :, 0]
        sig = ref["sigma"][:, None] * (np.exp(ref["tau_s"] * ref["z_s"][:, k])[:, None] if noise else 1.0)
        ll = jax.scipy.stats.norm.logpdf(yk[None], mean, sig)
        ref_nll -= float(np.sum(jax.scipy.special.logsumexp(ll, 0) - math.log(ll.shape[0])))
    flat = fp.models.linear_regression()
    runs = run_clients(fp.inference.NUTS(num_warmup=500, num_samples=1000), flat, fed, seed=seed)
    pot_flat = runs.context.potential
    alone = 0.0
    for k in has_test:
        dk = np.asarray(runs.results.posterior.draws[k]).reshape(-1, pot_flat.dim)
        alone += _nll_from_draws(pot_flat, jnp.asarray(dk), jnp.asarray(test[k][0], jnp.float64),
                                 jnp.asarray(test[k][1], jnp.float64)) * len(test[k][1])
    mc = MCMC(NUTS(flat), num_warmup=1000, num_samples=2000, num_chains=1, progress_bar=False)
    mc.run(jax.random.PRNGKey(seed + 3), X_all, y_all)
    zs = jax.vmap(pot_flat.unconstrain)(mc.get_samples())
    pooled_nll = _nll_from_draws(pot_flat, zs, jnp.asarray(X_te), jnp.asarray(
        np.concatenate([y for _, y in test]), jnp.float64))
    out["heldout_nll"] = {"hierarchical": hier / n_te, "hierarchical_nuts": ref_nll / n_te, "no_pooling": alone / n_te, "complete_pooling": pooled_nll,
                          "rows": n_te}
    return out


def label(r: dict) -> str:
    return ("varying intercepts" + (", slopes" if r["slopes"] else "") + (", noise" if r.get("noise") else "")
            + f" ({r.get('algorithm', 'PVI')})")


def table(results: list) -> str:
    lines = ["| model | clients | rows | sites | max abs(z) | sd ratio |", "|---|---|---|---|---|---|"]
    for r in results:
        name = label(r)
        for kind in ("global", "local"):
            for s, v in r[kind].items():
                lines.append(f"| {name} | {r['weeks']} | {r['train_rows']} | {kind} `{s}` | {v['max_abs_z']:.3f} | "
                             f"{v['sd_ratio_min']:.2f}-{v['sd_ratio_max']:.2f} |")
        v = r["new_client"]
        lines.append(f"| {name} | {r['weeks']} | {r['train_rows']} | new client's predictive | "
                     f"{v['max_abs_shift_sd']:.3f} | {v['sd_ratio_min']:.2f}-{v['sd_ratio_max']:.2f} |")
    lines += ["", "| model (algorithm) | held-out NLL: hierarchical, federated | hierarchical (pooled NUTS) | no pooling | "
                  "complete pooling | fp.run s | rounds | pooled NUTS s |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = label(r)
        h = r["heldout_nll"]
        lines.append(f"| {name} | {h['hierarchical']:.3f} | {h['hierarchical_nuts']:.3f} | {h['no_pooling']:.3f} | {h['complete_pooling']:.3f} | "
                     f"{r['run_s']:.1f} | {r['rounds']} | {r['nuts_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="24 weeks, intercepts only; writes nothing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", action="store_true", help="also the model with a varying noise scale per week, "
                   "with EP (NUTS clients) at its defaults (about 30 minutes on 2 loaded cores)")
    a = p.parse_args(argv)
    if data_root() is None:
        print("hierarchical: no data folder (set FEDPROB_DATA or place ../shared/data beside the checkout)")
        return []
    configs = [dict(weeks=24, slopes=False, chains=1)] if a.quick else [
        dict(weeks=105, slopes=False, chains=2), dict(weeks=105, slopes=True, chains=2)] + (
        [dict(weeks=105, slopes=True, noise=True, chains=1, algorithm="EP")] if a.noise else [])
    results = [run(seed=a.seed, **c) for c in configs]
    text = table(results)
    print(text)
    if not a.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "hierarchical.json").write_text(json.dumps(results, indent=2))
        (RESULTS / "hierarchical.md").write_text(
            "# Hierarchical model on bike-sharing weeks: PVI at its defaults against pooled NUTS\n\n"
            "Generated by `benchmarks/hierarchical.py` (see its docstring for the set-up).\n\n" + text + "\n")
    return results


if __name__ == "__main__":
    main()
