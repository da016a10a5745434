"""EP with NUTS clients: rounds to convergence and their cost, against NUTS on the pooled program and
against one EPMCMC round with the same sampler settings.

Problems (hierarchical, a client-local site per client, exact answers known):

* ``normal-normal``: mu ~ N(0, 3^2), a_k ~ N(0, 0.7^2) local, y ~ N(mu + a_k, 1);
  80 clients of 1 to 9 rows (the shape of a grouped data set: many small
  groups). Exact posterior: a dense Gaussian solve.
* ``poisson``: mu ~ N(0, 1), l_k ~ N(mu, 0.5^2) local, y ~ Poisson(exp(l_k));
  20 clients of 2 to 10 rows (not conjugate). Exact posterior of mu and of
  every l_k: quadrature on grids.

Every client runs ``fp.inference.NUTS()`` at its defaults (500 warm-up, 500
draws, one chain); the pooled reference is NumPyro's NUTS on the whole
hierarchical program (all rows, every client's local site), same settings.
Rows:

* ``NUTS (pooled program)``: wall time of a compiled run (the second call);
* ``EPMCMC, 1 round``: the compiled round (every client's NUTS, vmapped, and
  its message), the median of 3 calls;
* ``EP``: ``fp.algorithms.EP()`` at its defaults (Stein moments, damping
  ``"auto"``: 1/K up to 22 clients, 0.045 above; averaging first steps),
  ``EP(moments="sample")`` (sample covariances) and ``EP(average=False)``
  (every step the damping, as PVI), run round by round with
  the local engine's round function for EP's default number of rounds; the
  median round time, the rounds to convergence (the first round from which on
  the global mean stays within 0.05 posterior sd of the exact one and its sd
  within 2%), the time to get there, the time of the default run
  (``run_s``: rounds x round time), and the error of the final answer (global
  mean in posterior sds, sd ratio; the worst client's local mean and sd, after
  the final refresh of the local posteriors).

Target (the issue): an EP round costs at most twice an EPMCMC round.

Usage::

    python benchmarks/ep.py            # writes benchmarks/results/ep.{json,md}
    python benchmarks/ep.py --quick    # 8 clients, 6 rounds, writes nothing
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from scipy.stats import norm, poisson

import fedprob as fp
from fedprob.algorithms.base import Context
from fedprob.engine.local import make_round_fn, refresh_local
from fedprob.potential import get_potential

PRIOR_SD, TAU = 3.0, 0.7


def normal_normal(X, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    a = numpyro.sample("a", dist.Normal(0.0, TAU), infer={"local": True})
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(mu + a + 0.0 * X[:, 0], 1.0), obs=y)


def poisson_hierarchy(X, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    lk = numpyro.sample("l", dist.Normal(mu, 0.5), infer={"local": True})
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(lk + 0.0 * X[:, 0])), obs=y)


def pooled_normal_normal(group, K, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    a = numpyro.sample("a", dist.Normal(0.0, TAU).expand([K]).to_event(1))
    numpyro.sample("y", dist.Normal(mu + a[group], 1.0), obs=y)


def pooled_poisson(group, K, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    lk = numpyro.sample("l", dist.Normal(mu, 0.5).expand([K]).to_event(1))
    numpyro.sample("y", dist.Poisson(jnp.exp(lk[group])), obs=y)


def make_problem(name: str, num_clients: int, seed: int = 0):
    """(model, pooled model, federation, clients, exact (K+1, 2) means and sds of the global site and
    every client's local site)."""
    rng = np.random.default_rng(seed)
    if name == "normal-normal":
        sizes = rng.integers(1, 10, num_clients)
        a = rng.normal(0.0, TAU, num_clients)
        clients = [(np.zeros((n, 1)), 1.3 + a[k] + rng.normal(size=n)) for k, n in enumerate(sizes)]
        K = num_clients
        P = np.zeros((K + 1, K + 1))
        b = np.zeros(K + 1)
        P[0, 0] = PRIOR_SD ** -2
        for k, (_, y) in enumerate(clients):
            P[0, 0] += len(y)
            P[k + 1, k + 1] = TAU ** -2 + len(y)
            P[0, k + 1] = P[k + 1, 0] = len(y)
            b[0] += y.sum()
            b[k + 1] = y.sum()
        cov = np.linalg.inv(P)
        exact = np.stack([cov @ b, np.sqrt(np.diag(cov))], 1)
        return normal_normal, pooled_normal_normal, clients, exact
    sizes = rng.integers(2, 11, num_clients)
    lt = 0.3 + 0.5 * rng.normal(size=num_clients)
    clients = [(np.zeros((n, 1)), rng.poisson(np.exp(lt[k]), n).astype(np.float64)) for k, n in enumerate(sizes)]
    return poisson_hierarchy, pooled_poisson, clients, poisson_quadrature(clients)


def poisson_quadrature(clients):
    mu = np.linspace(-4, 4, 801)
    lg = np.linspace(-7, 5, 1201)
    dl = lg[1] - lg[0]
    joint = [norm.logpdf(lg[None, :], mu[:, None], 0.5)
             + poisson.logpmf(y[None, :], np.exp(lg)[:, None]).sum(1)[None, :] for _, y in clients]
    logz = [np.logaddexp.reduce(M, 1) + np.log(dl) for M in joint]
    logp = norm.logpdf(mu) + np.sum(logz, 0)
    w = np.exp(logp - logp.max())
    w /= w.sum()
    m = (w * mu).sum()
    out = [(m, np.sqrt((w * (mu - m) ** 2).sum()))]
    for M, lz in zip(joint, logz):
        W = np.exp((logp - lz)[:, None] + M - ((logp - lz)[:, None] + M).max()).sum(0)
        W /= W.sum()
        e = (W * lg).sum()
        out.append((e, np.sqrt((W * (lg - e) ** 2).sum())))
    return np.array(out)


def pooled_nuts_time(pooled, clients, seed: int = 0) -> float:
    """Seconds of a compiled NumPyro NUTS run (500 + 500) on the pooled hierarchical program."""
    group = np.concatenate([np.full(len(y), k) for k, (_, y) in enumerate(clients)])
    y = np.concatenate([y for _, y in clients])
    K = len(clients)
    mcmc = numpyro.infer.MCMC(numpyro.infer.NUTS(pooled), num_warmup=500, num_samples=500, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), group, K, y=y)
    jax.block_until_ready(mcmc.get_samples())
    t = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed + 1), group, K, y=y)
    jax.block_until_ready(mcmc.get_samples())
    return time.perf_counter() - t


def setup(algo, model, fed, seed: int = 0):
    pot = get_potential(model, fed)
    ctx = Context(pot, fed.num_clients, np.asarray(fed.sizes), fed.num_rows)
    data = fed.client_data()
    server, clients = jax.jit(lambda k, d: algo.init(ctx, k, d))(jax.random.PRNGKey(seed), data)
    round_fn = jax.jit(make_round_fn(algo, ctx, fed.num_clients))
    return ctx, data, server, clients, round_fn


def epmcmc_round_time(model, fed, repeats: int = 3) -> float:
    algo = fp.algorithms.EPMCMC(client=fp.inference.NUTS())
    _, data, server, clients, round_fn = setup(algo, model, fed)
    jax.block_until_ready(round_fn(server, clients, data, jax.random.PRNGKey(0)))      # compile
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(round_fn(server, clients, data, jax.random.PRNGKey(r + 1)))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def run_ep(algo, model, fed, exact, rounds: int) -> dict:
    """Round by round: per-round time, the global mean's error (in exact sds) and sd ratio."""
    ctx, data, server, clients, round_fn = setup(algo, model, fed)
    key = jax.random.PRNGKey(1)
    t0 = time.perf_counter()
    jax.block_until_ready(round_fn.lower(server, clients, data, key).compile())
    compile_s = time.perf_counter() - t0
    times, z, ratio = [], [], []
    for r in range(rounds):
        t = time.perf_counter()
        server, clients, info = round_fn(server, clients, data, jax.random.fold_in(key, r))
        server = jax.block_until_ready(server)
        times.append(time.perf_counter() - t)
        g = server.lam
        z.append(float((g.mean()[0] - exact[0, 0]) / exact[0, 1]))
        ratio.append(float(np.sqrt(g.variance()[0]) / exact[0, 1]))
    ok = (np.abs(z) < 0.05) & (np.abs(np.asarray(ratio) - 1) < 0.02)
    bad = np.flatnonzero(~ok)
    converged = int(bad[-1] + 2 if bad.size else 1) if ok[-1] else None
    clients, _ = refresh_local(algo, ctx, server, clients, data, jax.random.fold_in(key, rounds))
    post = algo.posterior(ctx, server, jax.device_get(clients))
    name = ctx.potential.local_sites[0]
    lz = (np.asarray(post.local_mean[name]) - exact[1:, 0]) / exact[1:, 1]
    lr = np.asarray(post.local_sd[name]) / exact[1:, 1]
    med = float(np.median(times))
    return {"round_s": med, "compile_s": compile_s, "rounds": rounds, "rounds_to_converge": converged,
            "time_to_converge_s": None if converged is None else converged * med, "run_s": rounds * med,
            "global_mean_err_sd": z[-1], "global_sd_ratio": ratio[-1],
            "local_mean_err_sd_max": float(np.abs(lz).max()),
            "local_sd_ratio_min": float(lr.min()), "local_sd_ratio_max": float(lr.max())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 clients, 6 rounds, normal-normal only; writes nothing")
    args = p.parse_args(argv)
    problems = [("normal-normal", 8)] if args.quick else [("normal-normal", 80), ("poisson", 20)]
    rows = []
    for name, K in problems:
        model, pooled, clients, exact = make_problem(name, K)
        fed = fp.data.FederatedData.from_clients(clients)
        nuts_s = pooled_nuts_time(pooled, clients)
        epmcmc_s = epmcmc_round_time(model, fed)
        default_rounds = fp.algorithms.EP().rounds_for(K, fed.sizes, K)
        rounds = 6 if args.quick else default_rounds
        methods = [("EP", fp.algorithms.EP()), ("EP(moments='sample')", fp.algorithms.EP(moments="sample"))]
        if not args.quick:
            methods.append(("EP(average=False)", fp.algorithms.EP(average=False)))
        for label, algo in methods:
            r = run_ep(algo, model, fed, exact, rounds)
            row = {"problem": f"{name}, {K} clients", "method": label, "default_rounds": default_rounds,
                   "nuts_pooled_s": nuts_s, "epmcmc_round_s": epmcmc_s, **r,
                   "round_over_epmcmc_round": r["round_s"] / epmcmc_s,
                   "converge_over_nuts_pooled": (None if r["time_to_converge_s"] is None
                                                 else r["time_to_converge_s"] / nuts_s)}
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    cols = ["problem", "method", "nuts_pooled_s", "epmcmc_round_s", "round_s", "round_over_epmcmc_round",
            "rounds_to_converge", "rounds", "time_to_converge_s", "converge_over_nuts_pooled", "run_s",
            "global_mean_err_sd", "global_sd_ratio", "local_mean_err_sd_max", "local_sd_ratio_min",
            "local_sd_ratio_max"]

    def fmt(v):
        if v is None:
            return "not within"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    table = "\n".join(lines)
    print(table)
    out = {"rows": rows, "machine": platform.platform(), "jax": jax.__version__,
           "devices": [str(d) for d in jax.devices()]}
    if not args.quick:
        res = Path(__file__).parent / "results"
        (res / "ep.json").write_text(json.dumps(out, indent=1))
        (res / "ep.md").write_text(
            "# EP with NUTS clients: rounds to convergence and their cost\n\n"
            "`python benchmarks/ep.py` (module docstring: problems, settings, definitions). Times in seconds "
            "on " + platform.machine() + " CPU, compiled programs (compile times excluded): `nuts_pooled_s` "
            "NumPyro NUTS (500 + 500) on the pooled hierarchical program; `epmcmc_round_s` one EPMCMC round "
            "(every client's NUTS, same settings); `round_s` EP's median round; `run_s` its default run (rounds x "
            "`round_s`). `rounds_to_converge`: the "
            "first round from which on the global mean stays within 0.05 posterior sd of the exact one and "
            "its sd within 2% (`not within`: not by the last round); `rounds` the rounds run (EP's "
            "default). Errors of the final answer against the exact posterior (dense solve; quadrature for "
            "the Poisson hierarchy): the global mean in posterior sds, the sd ratio, the worst client's "
            "local mean (in sds) and the range of the local sd ratios.\n\n" + table + "\n")
    return out


if __name__ == "__main__":
    main()
