"""Predictive-space methods for likelihoods without finite moments, and masked likelihoods.

Oracles: where every client's predictive is Gaussian (identical draws within a client) the grid's
product, mixture and log densities equal the closed forms; a heavy-tailed Student-t with inferred
degrees of freedom (nu <= 2 under some draws) against pooled NUTS's exact predictive mixture.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS

import fedprob as fp
from fedprob.algorithms import predictive_grid
from fedprob.algorithms.ensemble import EnsemblePosterior, mixture_prediction, client_predictive
from fedprob.algorithms.predictive_bayes import PredictiveBayesPosterior
from fedprob.posteriors import mixture_log_density
from fedprob.potential import Potential


def linear(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0))
    log_s = numpyro.sample("log_s", dist.Normal(-0.5, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(w * X[:, 0], jnp.exp(log_s)), obs=y)


def robust_nu(X, y=None):
    """Student-t regression with inferred degrees of freedom, masked where column 1 is 0."""
    w = numpyro.sample("w", dist.Normal(0.0, 3.0))
    b = numpyro.sample("b", dist.Normal(0.0, 3.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    nu = numpyro.sample("nu", dist.Gamma(2.0, 0.1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(nu, w * X[:, 0] + b, sigma).mask(X[:, 1] > 0), obs=y)


def _rows(n, seed=0):
    rng = np.random.default_rng(seed)
    X = np.stack([rng.normal(size=n), (rng.uniform(size=n) > 0.2)], 1).astype(np.float32)
    y = (1.5 * X[:, 0] - 0.5 + 0.5 * rng.standard_t(1.5, size=n)).astype(np.float32)
    return X, y


def _gaussian_clients(pot, K=3, S=4):
    """(K, S, d) draws, identical within a client: each client's predictive is exactly Gaussian."""
    w = jnp.array([0.8, 1.1, 1.3])[:K]
    log_s = jnp.array([-0.9, -0.6, -0.3])[:K]
    z = jnp.stack([w, log_s], -1)
    return jnp.broadcast_to(z[:, None], (K, S, pot.dim))


def test_grid_mixture_equals_the_exact_mixture():
    X = jnp.linspace(-2, 2, 7)[:, None].astype(jnp.float32)
    pot = Potential(linear, X, jnp.zeros(7))
    rng = np.random.default_rng(1)
    draws = jnp.asarray(np.stack([rng.normal(1.0, 0.2, (3, 50)), rng.normal(-0.7, 0.2, (3, 50))], -1),
                        jnp.float32)
    w = jnp.array([0.2, 0.3, 0.5])
    post = EnsemblePosterior(pot, draws, w)
    with pytest.warns(RuntimeWarning, match="no finite mean or variance"):
        points, lp, lp0 = post.grid_parts(X, draws, None)
    assert lp0 is None and points.shape == (predictive_grid.GRID_SIZE, 7)
    log_z, mean, var = predictive_grid.normalise(predictive_grid.pooled(lp, w, None, 0.0), points)
    m_ref, v_ref = mixture_prediction("regression", client_predictive(pot, draws, X), w)
    np.testing.assert_allclose(log_z, 0.0, atol=2e-3)                 # the range holds the mass
    np.testing.assert_allclose(mean, m_ref, atol=2e-3 * float(jnp.sqrt(v_ref.max())))
    np.testing.assert_allclose(var, v_ref, rtol=5e-3)
    y = jnp.asarray(rng.normal(size=7), jnp.float32)
    at = predictive_grid.client_log_pdf(pot, draws, X, y[None])
    exact = jax.scipy.special.logsumexp(
        jax.vmap(lambda d: mixture_log_density(pot, d, X, y))(draws) + jnp.log(w)[:, None], 0)
    np.testing.assert_allclose(predictive_grid.pooled(at, w, None, 0.0)[0], exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prior", [False, True])
def test_grid_product_equals_the_gaussian_product(prior):
    X = jnp.linspace(-1, 1, 5)[:, None].astype(jnp.float32)
    pot = Potential(linear, X, jnp.zeros(5))
    draws = _gaussian_clients(pot)
    prior_draws = jnp.broadcast_to(jnp.array([0.0, 0.6]), (8, 2)) if prior else None
    post = PredictiveBayesPosterior(pot, draws, jnp.full((3,), 1 / 3), prior_draws, pooling="product",
                                    regression="observed")
    (m_ref, v_ref), _ = post.components(X)
    with pytest.warns(RuntimeWarning):
        points, s = post._grid_pooled(X)
    log_z, mean, var = predictive_grid.normalise(s, points)
    np.testing.assert_allclose(mean, m_ref, atol=1e-3)
    np.testing.assert_allclose(var, v_ref, rtol=5e-3)
    y = jnp.linspace(-0.5, 0.5, 5)
    exact = -0.5 * (jnp.log(2 * jnp.pi * v_ref) + (y - m_ref) ** 2 / v_ref)
    np.testing.assert_allclose(post._grid_log_density(X, y, 1.0), exact, atol=2e-3)


def test_masked_rows_are_scored_unmasked():
    X, y = _rows(40)
    pot = Potential(robust_nu, X, y)
    assert pot.masked_likelihood
    z = pot.sample_prior(jax.random.PRNGKey(0))
    vals = pot.constrain(z)
    ref = dist.StudentT(vals["nu"], vals["w"] * X[:, 0] + vals["b"], vals["sigma"]).log_prob(y)
    np.testing.assert_allclose(pot.predictive_log_likelihood(z, X, y), ref, rtol=1e-5)
    masked = X[:, 1] == 0
    assert masked.any() and np.all(np.asarray(pot.pointwise_log_likelihood(z, X, y))[masked] == 0)


@pytest.mark.slow     # 47 s cold; the grid's exact answers are tested in the default run above
def test_heavy_tailed_likelihood_at_defaults_against_pooled_nuts():
    X, y = _rows(300)
    Xt, yt = _rows(200, seed=7)
    fed = fp.data.partition(X, y, num_clients=3, seed=0)
    mcmc = MCMC(NUTS(robust_nu), num_warmup=400, num_samples=600, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), jnp.asarray(X), jnp.asarray(y))
    pot = Potential(robust_nu, X, y)
    ref_draws = jax.vmap(pot.unconstrain)(mcmc.get_samples())
    ref = float(jnp.mean(mixture_log_density(pot, ref_draws, jnp.asarray(Xt), jnp.asarray(yt))))
    assert float(mcmc.get_samples()["nu"].min()) < 2.0          # some draws have no finite variance
    for alg in (fp.algorithms.PredictiveBayes(), fp.algorithms.Ensemble()):
        res = fp.run(alg, robust_nu, fed, seed=0, progress=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mean, var = res.posterior.predict(Xt)
            lpd = res.posterior.log_predictive_density(Xt, yt)
        assert any("no finite mean or variance" in str(c.message) for c in caught), type(alg).__name__
        assert np.all(np.isfinite(mean)) and np.all(np.isfinite(var)) and np.all(np.isfinite(lpd))
        assert np.all(np.asarray(lpd)[Xt[:, 1] == 0] != 0.0)      # masked rows scored unmasked
        assert np.corrcoef(np.asarray(mean), 1.5 * Xt[:, 0] - 0.5)[0, 1] > 0.99
        # the mixture is exact here (-1.460 against -1.460); a product of heavy-tailed predictives is
        # lighter-tailed than the global predictive, so its outliers score lower: tempered -1.69, the
        # plain product -2.63
        tol = 0.02 if isinstance(alg, fp.algorithms.Ensemble) else 0.3
        assert abs(float(jnp.mean(lpd)) - ref) < tol, (type(alg).__name__, float(jnp.mean(lpd)), ref)


def test_fit_beta_on_the_grid_is_the_brute_force_maximiser():
    """Held-out beta on the grid: golden section equals the best of 101 betas, evaluated one by one."""
    X, y = _rows(60)
    Xv, yv = _rows(40, seed=3)
    pot = Potential(robust_nu, X, y)
    rng = np.random.default_rng(2)
    clients = []
    for w, b in ((1.4, -0.6), (1.5, -0.4), (1.6, -0.5)):     # overlapping clients: the best beta is inside
        vals = {"w": jnp.asarray(w + 0.3 * rng.normal(size=20), jnp.float32),
                "b": jnp.asarray(b + 0.3 * rng.normal(size=20), jnp.float32),
                "sigma": jnp.asarray(np.exp(0.1 * rng.normal(size=20)), jnp.float32),
                "nu": jnp.asarray(rng.uniform(1.2, 4.0, size=20), jnp.float32)}   # some without a variance
        clients.append(jax.vmap(pot.unconstrain)(vals))
    draws = jnp.stack(clients)
    post = PredictiveBayesPosterior(pot, draws, jnp.full((3,), 1 / 3), None, pooling="tempered",
                                    regression="observed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert post.on_grid(jnp.asarray(Xv))
        log_density = post._grid_log_density_fn(jnp.asarray(Xv), jnp.asarray(yv))
        betas = np.linspace(0.0, 1.0, 101)
        # the 99 interior betas in one compiled program (the pooled formula with a traced beta); the
        # ends as the library evaluates them (beta 0 and 1 select the mixture and the product exactly)
        inner = jax.jit(jax.vmap(lambda b: jnp.mean(log_density(b))))(jnp.asarray(betas[1:-1], jnp.float32))
        values = np.concatenate([[float(jnp.mean(log_density(float(betas[0]))))], np.asarray(inner, np.float64),
                                 [float(jnp.mean(log_density(float(betas[-1]))))]])
        beta = post.fit_beta(Xv, yv)
        at_fit = float(jnp.mean(post._grid_log_density(jnp.asarray(Xv), jnp.asarray(yv), beta)))
    assert np.all(np.isfinite(values))
    assert values.max() - values.min() > 0.1                      # the choice of beta matters here
    assert 0.1 < beta < 0.3                                       # measured 0.20: neither end
    assert at_fit >= values.max() - 1e-4
    assert abs(beta - betas[values.argmax()]) <= 0.02
    assert post.pooling == "beta" and post.info["beta"] == beta
