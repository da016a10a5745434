"""Stein moments in the one-round Gaussian products (EPMCMC, ConsensusMC) against exact answers.

Oracles: (a) exact Gaussian draws with their exact scores: the Stein fit returns the precision and mean
to float precision from a handful of draws, where sample moments carry their Monte Carlo error; (b) a
federation of conjugate linear regressions whose pooled posterior is a dense solve: the product of
sampling clients at their defaults is within 0.3 posterior sd with sds in [0.8, 1.25] (the issue's
bound), here on 6 clients with inputs equicorrelated at 0.8 and shifted per client; variational (SVI)
clients are refined by one natural-gradient step from their own draws.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedprob as fp
from fedprob.algorithms.messages import fitted_gaussian
from fedprob.algorithms.stein import stein_gaussian
from fedprob.inference import SGHMC, SGLD, CyclicalSGHMC

SIGMA = 0.5


def test_stein_fit_is_exact_on_a_gaussian():
    rng = np.random.default_rng(0)
    d, S = 5, 12
    B = rng.normal(size=(d, d))
    P = B @ B.T + d * np.eye(d)
    m = rng.normal(size=d)
    x = rng.multivariate_normal(m, np.linalg.inv(P), size=S)
    g = -(x - m) @ P
    fit, resid, ok = stein_gaussian(jnp.asarray(x), jnp.asarray(g), False)
    assert bool(ok)
    np.testing.assert_allclose(np.asarray(fit.precision), P, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(fit.mean()), m, atol=1e-5)
    np.testing.assert_allclose(np.asarray(resid), np.broadcast_to(m, (S, d)), atol=1e-5)   # zero MC error
    mm = fp.gaussian.moment_match(jnp.asarray(x), warn=False)
    assert np.abs(np.asarray(mm.mean()) - m).max() > 1e-2          # what sample moments leave
    # draws of another Gaussian q (a variational answer off in mean and scale): the regression under q is
    # one natural-gradient step, exact for a Gaussian target
    xq = rng.multivariate_normal(m + 0.5, 2.0 * np.linalg.inv(P), size=S)
    fit_q, _, ok_q = stein_gaussian(jnp.asarray(xq), jnp.asarray(-(xq - m) @ P), False)
    assert bool(ok_q)
    np.testing.assert_allclose(np.asarray(fit_q.precision), P, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(fit_q.mean()), m, atol=1e-5)
    diag_fit, _, _ = stein_gaussian(jnp.asarray(x), jnp.asarray(g), True)
    # per coordinate the identity gives 1 / Var(x_i) at the population level; for a Gaussian the
    # regression slope of g_i on x_i is P_ii + sum_j P_ij Cov(x_j, x_i) / Var(x_i), exactly 1 / Var(x_i)
    v = x - x.mean(0)
    exact_diag = -np.sum((g - g.mean(0)) * v, 0) / np.sum(v * v, 0)
    np.testing.assert_allclose(np.asarray(diag_fit.precision), exact_diag, rtol=1e-4)


def test_a_fit_that_is_not_positive_definite_falls_back_to_sample_moments():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(50, 3)))
    g = jnp.asarray(rng.normal(size=(50, 3)))            # scores of no density: regression slope ~ 0
    fit = stein_gaussian(x, g, False)
    assert not bool(fit[2])
    gauss, cov, fallback = fitted_gaussian(x, fit, False, 1e-6, "test")
    mm = fp.gaussian.moment_match(x, warn=False)
    np.testing.assert_allclose(np.asarray(gauss.precision), np.asarray(mm.precision), rtol=1e-6)
    assert float(fallback) == 1.0


def correlated_federation(K=6, n=500, d=5, rho=0.8, seed=0):
    rng = np.random.default_rng(seed)
    L = np.linalg.cholesky(np.full((d, d), rho) + (1 - rho) * np.eye(d))
    w = rng.normal(size=d)
    clients = []
    for _ in range(K):
        X = rng.normal(size=(n, d)) @ L.T + rng.normal(size=d)
        y = X @ w + 0.3 + SIGMA * rng.normal(size=n)
        clients.append((X.astype(np.float32), y.astype(np.float32)))
    X = np.concatenate([c[0] for c in clients]).astype(np.float64)
    y = np.concatenate([c[1] for c in clients]).astype(np.float64)
    A = np.concatenate([X, np.ones((len(X), 1))], 1)
    P = np.eye(d + 1) + A.T @ A / SIGMA ** 2
    cov = np.linalg.inv(P)
    return fp.data.FederatedData.from_clients(clients), cov @ (A.T @ y / SIGMA ** 2), np.sqrt(np.diag(cov))


def errors(res, mean, sd):
    draws = res.posterior.sample(jax.random.PRNGKey(1), 20000)
    flat = np.concatenate([np.asarray(draws["w"]), np.asarray(draws["b"])[:, None]], 1)
    return np.abs(flat.mean(0) - mean) / sd, flat.std(0) / sd


CASES = [("EPMCMC", SGHMC), ("EPMCMC", SGLD), ("EPMCMC", CyclicalSGHMC), ("ConsensusMC", SGHMC)]
#: EP-MCMC over SGHMC clients stays in the default run; the other products (same assertions) run with the
#: slow tests (``pytest -m slow``): each compiles its own client phase or round.
DEFAULT_RUN_CASES = {("EPMCMC", SGHMC)}


@pytest.mark.parametrize("agg,backend", [c if c in DEFAULT_RUN_CASES else pytest.param(*c, marks=pytest.mark.slow)
                                         for c in CASES], ids=[f"{a}-{b.__name__}" for a, b in CASES])
def test_products_of_sampling_clients_at_their_defaults(agg, backend):
    fed, mean, sd = correlated_federation()
    model = fp.models.linear_regression(noise_scale=SIGMA)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        res = fp.run(getattr(fp.algorithms, agg)(client=backend()), model, fed, seed=0, progress=False)
    err, ratio = errors(res, mean, sd)
    assert err.max() < 0.3, err
    assert 0.8 <= ratio.min() and ratio.max() <= 1.25, ratio
    assert res.posterior.info["moments"] == "stein" and res.posterior.info["stein_fallbacks"] == 0
    assert not [w for w in rec if "Monte Carlo error" in str(w.message)]


@pytest.mark.parametrize("agg", ["EPMCMC", pytest.param("ConsensusMC", marks=pytest.mark.slow)])
def test_variational_clients_are_refined_by_their_own_draws(agg):
    """``SVI(guide="full")`` clients: the product of their Gaussians as SVI returns them (``moments="sample"``)
    carries the optimiser's noise; refined by one natural-gradient step from their draws (the default) it is
    exact on Gaussian clients. (EPMCMC in the default run, ConsensusMC with the slow tests.)"""
    fed, mean, sd = correlated_federation()
    model = fp.models.linear_regression(noise_scale=SIGMA)
    client = fp.inference.SVI(guide="full", num_steps=500)
    plain = fp.run(getattr(fp.algorithms, agg)(client=client, moments="sample"), model, fed, seed=0, progress=False)
    refined = fp.run(getattr(fp.algorithms, agg)(client=client), model, fed, seed=0, progress=False)
    err_plain, _ = errors(plain, mean, sd)
    err_refined, ratio = errors(refined, mean, sd)
    assert err_refined.max() < 0.06 < err_plain.max(), (err_refined.max(), err_plain.max())
    assert 0.9 <= ratio.min() and ratio.max() <= 1.1, ratio


def test_sample_moments_are_what_the_stein_fit_improves_on():
    """The same sampler with ``moments="sample"``: its product carries the draws' Monte Carlo error (which
    the run reports), the Stein product does not."""
    fed, mean, sd = correlated_federation()
    model = fp.models.linear_regression(noise_scale=SIGMA)
    client = SGLD(precondition=None, num_samples=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sample = fp.run(fp.algorithms.EPMCMC(client=client, moments="sample"), model, fed, seed=0, progress=False)
        stein = fp.run(fp.algorithms.EPMCMC(client=client), model, fed, seed=0, progress=False)
    err_sample, _ = errors(sample, mean, sd)
    err_stein, _ = errors(stein, mean, sd)
    assert err_stein.max() < 0.05 < 0.2 < err_sample.max(), (err_stein.max(), err_sample.max())
    assert stein.posterior.info["mc_error_sd_ratio"] < 1e-2 < sample.posterior.info["mc_error_sd_ratio"]
