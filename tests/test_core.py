"""The core layer: compiled-function identity, the potential's contract, atomic rounds, predictive densities.

Each test pins one behaviour that an earlier version got wrong (the wrong
number is quoted where there was one).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer.util import potential_energy
from scipy.special import gammaln

import fedprob as fp
from conftest import linreg_exact_posterior
from fedprob.algorithms.base import Algorithm
from fedprob.engine import local
from fedprob.posteriors import GlobalPosterior, Samples


SIGMA = 0.5


def kw_linreg(X, y=None, prior_scale=1.0):
    """The conjugate linear regression with its prior scale as a model keyword argument."""
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, SIGMA), obs=y)


def clients(K=2, n=30, d=2, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(K):
        X = rng.normal(size=(n, d)) + k
        y = X @ np.array([1.0, -0.5][:d]) + SIGMA * rng.normal(size=n)
        out.append((X.astype(np.float32), y.astype(np.float32)))
    return out


# -- compiled functions are keyed on everything that changes the program ------------------------------

def test_model_kwargs_change_the_compiled_program():
    """Same model, prior_scale 1.0 then 0.01: the second run must not reuse the first's clients."""
    cl = clients()
    fed = fp.data.FederatedData.from_clients(cl)
    algo = fp.algorithms.EPMCMC(client=fp.inference.Laplace(hessian="full"))
    for scale in (1.0, 0.01):
        r = fp.run(algo, kw_linreg, fed, seed=0, progress=False, model_kwargs={"prior_scale": scale})
        assert r.compile_time > 0.0
        mu, cov = linreg_exact_posterior([c[0] for c in cl], [c[1] for c in cl], SIGMA, scale)
        m = np.asarray(r.posterior.form.mean())
        np.testing.assert_array_less(np.abs(m - mu) / np.sqrt(np.diag(cov)), 0.01)
    # an equal configuration is served from the cache
    r = fp.run(algo, kw_linreg, fed, seed=1, progress=False, model_kwargs={"prior_scale": 0.01})
    assert r.compile_time == 0.0


def test_potentials_compare_by_program():
    X, y = np.zeros((3, 2), np.float32), np.zeros(3, np.float32)
    a = fp.Potential(kw_linreg, X, y, {"prior_scale": 1.0})
    b = fp.Potential(kw_linreg, X, y, {"prior_scale": 1.0})
    c = fp.Potential(kw_linreg, X, y, {"prior_scale": 0.5})
    d = fp.Potential(kw_linreg, X, y, {"prior_scale": np.float32(1.0)})
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a != fp.Potential(kw_linreg, np.zeros((3, 3), np.float32), y, {"prior_scale": 1.0})
    assert d == fp.Potential(kw_linreg, X, y, {"prior_scale": np.float32(1.0)})


def closure_linreg(prior_scale):
    """A model factory, as fp.models' and most users' are: a new closure per call."""
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, SIGMA), obs=y)
    return model


def test_a_model_factory_called_again_compiles_nothing_new():
    """Each call of a factory returns a new function object; before, each was a new program, so a notebook
    cell rebuilding ``fp.models.logistic_regression()`` recompiled every client phase and round. Equal
    closures (same code, equal captured values and types) are one program; a different captured value
    (or an int where a float was) is another, and its answer is its own."""
    X, y = np.zeros((3, 2), np.float32), np.zeros(3, np.float32)
    P = lambda m: fp.Potential(m, X, y)
    a, b = P(closure_linreg(1.0)), P(closure_linreg(1.0))
    assert a == b and hash(a) == hash(b)
    assert P(closure_linreg(1.0)) != P(closure_linreg(0.5))
    assert P(closure_linreg(1.0)) != P(closure_linreg(1))
    assert P(closure_linreg(np.float32(0.5))) == P(closure_linreg(np.float32(0.5)))
    assert P(closure_linreg(np.float32(0.5))) != P(closure_linreg(np.float64(0.5)))
    yc = np.zeros(3, np.int32)
    assert fp.Potential(fp.models.bnn_mlp(hidden_sizes=(5,), num_classes=3), X, yc) == \
        fp.Potential(fp.models.bnn_mlp(hidden_sizes=(5,), num_classes=3), X, yc)
    assert fp.Potential(fp.models.bnn_mlp(hidden_sizes=(5,), num_classes=3), X, yc) != \
        fp.Potential(fp.models.bnn_mlp(hidden_sizes=(6,), num_classes=3), X, yc)

    cl = clients()
    fed = fp.data.FederatedData.from_clients(cl)
    algo = fp.algorithms.EPMCMC(client=fp.inference.Laplace(hessian="full"))
    first = fp.run(algo, closure_linreg(0.01), fed, seed=0, progress=False)
    again = fp.run(algo, closure_linreg(0.01), fed, seed=1, progress=False)
    other = fp.run(algo, closure_linreg(1.0), fed, seed=0, progress=False)
    assert first.compile_time > 0.0 and again.compile_time == 0.0 and other.compile_time > 0.0
    for scale, r in ((0.01, again), (1.0, other)):
        mu, cov = linreg_exact_posterior([c[0] for c in cl], [c[1] for c in cl], SIGMA, scale)
        m = np.asarray(r.posterior.form.mean())
        np.testing.assert_array_less(np.abs(m - mu) / np.sqrt(np.diag(cov)), 0.01)


# -- the potential honours NumPyro's semantics ------------------------------------------------------

def _scaled_likelihood(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        with handlers.scale(scale=2.0):
            numpyro.sample("y", dist.Normal(X @ w, SIGMA), obs=y)


def _prior_factor(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.factor("shrink", -0.5 * jnp.sum(w ** 2))           # a prior term outside the plate
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, SIGMA), obs=y)


@pytest.mark.parametrize("model", [_scaled_likelihood, _prior_factor])
def test_log_density_equals_numpyro(model):
    """handlers.scale on the likelihood (was ignored: -12.68 vs NumPyro -20.26) and numpyro.factor."""
    X, y = clients(K=1, n=7)[0]
    pot = fp.Potential(model, X, y)
    z = jnp.array([0.3, -0.8])
    target = fp.potential.make_target(fp.potential.ClientData(jnp.asarray(X), jnp.asarray(y), jnp.array(7)),
                                      pot.dim)
    ours = pot.log_density(z, target)
    ref = -potential_energy(model, (X, y), {}, {"w": z})
    np.testing.assert_allclose(float(ours), float(ref), rtol=1e-5)


def _poisson(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w)), obs=y)


def test_count_likelihood_is_not_classification():
    """Poisson regression was typed "classification" and predict/eval raised NotImplementedError."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 2)).astype(np.float32) * 0.5
    y = rng.poisson(np.exp(X @ np.array([0.8, -0.4]))).astype(np.int32)
    fed = fp.data.partition(X[:150], y[:150], num_clients=3, scheme="iid", seed=0)
    pot = fp.run.__globals__["get_potential"](_poisson, fed)
    assert pot.task == "count" and pot.num_classes is None
    r = fp.run(fp.algorithms.EPMCMC(client=fp.inference.Laplace(hessian="full")), _poisson, fed,
               progress=False, eval_data=(X[150:], y[150:]))
    mean, var = r.posterior.predict(X[150:])
    assert mean.shape == (50,) and np.all(np.asarray(var) >= np.asarray(mean) - 1e-4)   # Poisson + parameter spread
    h = r.history[-1]
    assert set(h) >= {"rmse", "nll"} and "coverage_95" not in h
    # the NLL is the mixture's over the posterior draws, computed by hand here
    draws = np.asarray(r.posterior._predictive_draws(), np.float64)     # (S, 2); the oracle in numpy
    rate = np.exp(X[150:].astype(np.float64) @ draws.T).T                # (S, 50)
    ll = y[150:] * np.log(rate) - rate - gammaln(y[150:] + 1.0)         # Poisson log pmf
    ref = -np.mean(np.logaddexp.reduce(ll, 0) - np.log(len(draws)))
    np.testing.assert_allclose(h["nll"], ref, rtol=1e-4)


def test_poisson_regression_model_matches_a_hand_written_one():
    X = np.random.default_rng(1).normal(size=(5, 2)).astype(np.float32)
    y = np.array([0, 1, 3, 0, 2], np.int32)
    zoo = fp.Potential(fp.models.poisson_regression(bias=False), X, y)
    mine = fp.Potential(_poisson, X, y)
    assert zoo.task == "count"
    z = jnp.array([0.4, -0.2])
    np.testing.assert_allclose(float(zoo.log_likelihood(z, X, y)), float(mine.log_likelihood(z, X, y)),
                               rtol=1e-6)


def _subsampled(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0], subsample_size=1):
        numpyro.sample("y", dist.Normal(w, 1.0), obs=y)


def _hard_coded(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", 20):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def test_plate_mistakes_fail_early_with_the_fix():
    """subsample_size failed later with 'mul got incompatible shapes'; a fixed plate size with a broadcast error."""
    X, y = np.zeros((20, 2), np.float32), np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="subsample_size"):
        fp.Potential(_subsampled, X, y)
    with pytest.raises(ValueError, match=r"X.shape\[0\]"):
        fp.Potential(_hard_coded, X, y)


# -- a rejected round changes no state ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _CountingAlgorithm(Algorithm):
    """Clients count their updates; the server update is NaN in round 2 (server state 1 -> 2)."""

    default_rounds = 3

    def init(self, ctx, key, data):
        return jnp.zeros(()), jnp.zeros((ctx.num_clients,))

    def client_update(self, ctx, server_state, client_state, data, key):
        return client_state + 1.0, jnp.ones(()), {}

    def server_update(self, ctx, server_state, messages, weights, mask):
        new = server_state + 1.0
        return jnp.where(server_state == 1.0, jnp.nan, new)

    def posterior(self, ctx, server_state, client_states):
        return GlobalPosterior(ctx.potential, Samples(jnp.zeros((1, ctx.dim))))


def test_client_states_commit_only_with_the_server_update():
    fed = fp.data.FederatedData.from_clients(clients(K=3))
    r = fp.run(_CountingAlgorithm(), kw_linreg, fed, rounds=3, progress=False)
    assert [h["server_update_ok"] for h in r.history] == [True, False, False]
    # round 1 counted; the rejected rounds 2 and 3 left the clients untouched
    np.testing.assert_array_equal(np.asarray(r.client_states), [1.0, 1.0, 1.0])
    assert float(r.server_state) == 1.0


# -- predictive densities of mixtures ----------------------------------------------------------------

def _location(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 3.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(w, 0.1), obs=y)


def test_regression_nll_is_the_mixture_density():
    """Components N(+-2, 0.1^2) at y = 2: log density +0.69 (a moment-matched Gaussian gave -2.11)."""
    X, y = np.zeros((1, 1), np.float32), np.array([2.0], np.float32)
    pot = fp.Potential(_location, X, y)
    post = GlobalPosterior(pot, Samples(jnp.array([[-2.0], [2.0]])))
    lpd = float(post.log_predictive_density(X, y)[0])
    np.testing.assert_allclose(lpd, np.log(0.5 / (0.1 * np.sqrt(2 * np.pi))), rtol=1e-5)
    assert fp.metrics.evaluate(post, X, y)["nll"] == pytest.approx(-lpd, rel=1e-5)


def test_ensemble_nll_is_the_weighted_mixture_density():
    from fedprob.algorithms.ensemble import EnsemblePosterior

    X, y = np.zeros((1, 1), np.float32), np.array([2.0], np.float32)
    pot = fp.Potential(_location, X, y)
    post = EnsemblePosterior(pot, jnp.array([[[-2.0], [-2.0]], [[2.0], [1.9]]]), jnp.array([0.25, 0.75]))
    dens = lambda m: np.exp(-0.5 * ((2.0 - m) / 0.1) ** 2) / (0.1 * np.sqrt(2 * np.pi))  # noqa: E731
    ref = np.log(0.25 * dens(-2.0) + 0.75 * 0.5 * (dens(2.0) + dens(1.9)))
    np.testing.assert_allclose(float(post.log_predictive_density(X, y)[0]), ref, rtol=1e-5)


def test_import_is_silent(tmp_path):
    """ArviZ 0.23 warns once a day on import (a stamp in the user cache): a fresh cache shows it
    (1.x does not warn); importing it through fedprob is silent on both."""
    import os
    import subprocess
    import sys

    from fedprob.diagnostics import arviz_major

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    bare = subprocess.run([sys.executable, "-c", "import arviz"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    if arviz_major() < 1:
        assert "FutureWarning" in bare.stderr        # the check below can fail
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache2"))
    out = subprocess.run([sys.executable, "-c", "import fedprob, fedprob.diagnostics as d; d._az()"],
                         capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0 and "FutureWarning" not in out.stderr, out.stderr
