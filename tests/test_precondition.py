"""Laplace preconditioning and control variates of the SG-MCMC clients against exact answers.

Oracle: the conjugate linear regression of ``conftest.linreg_model`` (noise sd 0.5, prior N(0, 1)) on
one client whose 4 features are equicorrelated at 0.9 and shifted by 2 (condition number of the
posterior precision about 220), where the posterior is ``N(P^-1 X'y / s^2, P^-1)``,
``P = I + X'X / s^2``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import linreg_model
from fedprob.inference import SGHMC, SGLD
from fedprob.inference.sgmcmc import effective_sample_size
from fedprob.inference.sgmcmc.precondition import (PreconditionedPotential, laplace_preconditioner,
                                                   resolve_precondition)
from fedprob.potential import ClientData, Potential, make_target

SIGMA, PRIOR, D = 0.5, 1.0, 4


def ill_conditioned_client(n=400, seed=0):
    rng = np.random.default_rng(seed)
    corr = np.full((D, D), 0.9) + 0.1 * np.eye(D)
    X = rng.normal(size=(n, D)) @ np.linalg.cholesky(corr).T + 2.0
    y = X @ np.array([1.0, -0.5, 0.25, 0.0]) + SIGMA * rng.normal(size=n)
    X, y = X.astype(np.float32), y.astype(np.float32)
    P = np.eye(D) / PRIOR ** 2 + X.T.astype(np.float64) @ X / SIGMA ** 2
    mean = np.linalg.solve(P, X.T.astype(np.float64) @ y / SIGMA ** 2)
    pot = Potential(linreg_model(PRIOR, SIGMA), X, y)
    data = ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(n))
    return pot, make_target(data, D), mean, P


def test_preconditioner_is_the_exact_laplace_factor():
    pot, target, mean, P = ill_conditioned_client()
    assert np.linalg.cond(P) > 200
    pre = jax.jit(lambda z: laplace_preconditioner(pot, target, z, "full", False, jax.random.PRNGKey(0)))(
        jnp.zeros(D))
    A = np.asarray(pre.factor, np.float64)
    sd = np.sqrt(np.diag(np.linalg.inv(P)))
    assert not bool(pre.failed)
    assert np.max(np.abs(np.asarray(pre.shift) - mean) / sd) < 1e-2          # the mode is the mean
    np.testing.assert_allclose(A.T @ P @ A, np.eye(D), atol=2e-3)               # A A' = P^-1
    pre_d = jax.jit(lambda z: laplace_preconditioner(pot, target, z, "diag", False, jax.random.PRNGKey(0)))(
        jnp.zeros(D))
    np.testing.assert_allclose(np.asarray(pre_d.factor), 1.0 / np.sqrt(np.diag(P)), rtol=2e-3)
    assert resolve_precondition("auto", 256) == "full" and resolve_precondition("auto", 257) is None


def test_control_variate_gradient_is_exact_at_the_mode_and_unbiased_elsewhere():
    pot, target, mean, P = ill_conditioned_client()
    pre = laplace_preconditioner(pot, target, jnp.asarray(mean, jnp.float32), None, True, jax.random.PRNGKey(0))
    cv = PreconditionedPotential(pot, pre)
    keys = jax.random.split(jax.random.PRNGKey(1), 400)

    def grads(potential, z):
        return jax.vmap(lambda k: jax.grad(potential.log_density)(z, target, k, 16))(keys)

    at_mode = np.asarray(grads(cv, jnp.zeros(D)), np.float64)         # identity factor: u = z - m
    full_at_mode = np.asarray(jax.grad(pot.log_density)(pre.shift, target))
    np.testing.assert_allclose(at_mode, np.broadcast_to(full_at_mode, at_mode.shape), atol=1e-2)
    # a typical posterior draw's distance: Mahalanobis 2 from the mode
    off = jnp.asarray(2.0 * np.linalg.cholesky(np.linalg.inv(P)) @ np.ones(D) / np.sqrt(D), jnp.float32)
    g_cv, g_plain = np.asarray(grads(cv, off)), np.asarray(grads(pot, pre.shift + off))
    exact = -P @ (np.asarray(pre.shift + off, np.float64) - mean)
    se = g_cv.std(0) / np.sqrt(len(keys))
    assert np.all(np.abs(g_cv.mean(0) - exact) < 4 * se + 1e-2 * np.abs(exact).max())
    assert np.all(g_cv.var(0) < 0.01 * g_plain.var(0))                     # the variance it removes


@pytest.mark.parametrize("backend", [SGHMC, pytest.param(SGLD, marks=pytest.mark.slow)], ids=["SGHMC", "SGLD"])
def test_whitened_chain_mixes_where_the_plain_one_does_not(backend):
    """(SGHMC, the default sampler, in the default run; SGLD, same assertions, with the slow tests.)"""
    pot, target, mean, P = ill_conditioned_client()
    sd = np.sqrt(np.diag(np.linalg.inv(P)))

    def run(pc):
        b = backend(precondition=pc, num_burnin=500, num_samples=200)
        res = jax.jit(lambda k: b.run(k, pot, target, jnp.zeros(D)))(jax.random.PRNGKey(3))
        draws = np.asarray(res.posterior.draws, np.float64)
        return draws, float(np.min(effective_sample_size(jnp.asarray(draws))))

    plain, ess_plain = run(None)
    white, ess_white = run("full")
    assert ess_white > 5 * ess_plain, (ess_white, ess_plain)
    assert ess_white > 80
    err = np.abs(white.mean(0) - mean) / sd
    ratio = white.std(0, ddof=1) / sd
    assert err.max() < 3.0 / np.sqrt(ess_white) + 0.1, err
    assert np.abs(ratio - 1).max() < 3.0 / np.sqrt(2 * ess_white) + 0.12, ratio
