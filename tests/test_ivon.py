"""IVON client backend and its pure step against exact answers.

Oracles:
* one ``ivon_step`` against the update of the module docstring computed by
  hand in numpy (same Gaussian draws), with every input nonzero;
* Bayesian linear regression with known noise (d = 3, correlated features):
  on a Gaussian target IVON's fixed point is the mean-field optimum, i.e.
  the exact posterior mean mu and the precisions diag(P) of the exact
  precision P (conftest.linreg_exact_posterior);
* the same with the LocalTarget's Gaussian term as the prior (prior_weight 0),
  with a full Gaussian term with a negative diagonal entry, with a tempered
  ess, and with BayesADMM's client inputs (App. D of the BayesADMM paper),
  each against its own closed-form Gaussian.

Tolerances: means within 0.2 posterior sd, precision diagonals within 20%
of diag(P). Observed worst cases over 8 seeds at these settings: 0.05 sd and 12%.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import linreg_exact_posterior, linreg_model, padded_correlated_client

from fedprob.algorithms.bayes_admm import bayes_admm_client_inputs
from fedprob.inference import IVON, ivon_init, ivon_step
from fedprob.inference.ivon import (IVONInputs, IVONState, ivon_gaussian, ivon_solve,
                                    local_target_inputs)
from fedprob.potential import ClientData, Potential, make_target

PRIOR, SIGMA, D = 1.0, 0.5, 3
W_TRUE = np.array([1.0, -0.5, 0.3])
N_MAX = 40
BACKEND = IVON(num_steps=3000, mc_samples=4)
MEAN_TOL, PREC_TOL = 0.2, 0.20


linreg = linreg_model(PRIOR, SIGMA)


def make_client(seed, n):
    """(X, y) padded to N_MAX rows (rows n: are garbage that must not count)."""
    return padded_correlated_client(seed, n, N_MAX, W_TRUE, SIGMA)


def target_of(X, y, n, **kw):
    data = ClientData(jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(n))
    return make_target(data, D, **kw)


def lik_natural(X, y):
    """(X'X / sigma^2, X'y / sigma^2): the likelihood's natural parameters."""
    return X.T @ X / SIGMA ** 2, X.T @ y / SIGMA ** 2


@pytest.fixture(scope="module")
def problem():
    X, y = make_client(0, N_MAX)
    return Potential(linreg, X, y), X, y


def fit(backend, pot, target, seed=1):
    return jax.jit(lambda k, t, z: backend.run(k, pot, t, z))(jax.random.PRNGKey(seed), target,
                                                                jnp.zeros(D))


def check_mean_field(res, P, lin):
    """IVON's answer against the mean-field optimum of N(P^-1 lin, P^-1)."""
    mu = np.linalg.solve(P, lin)
    sd = np.sqrt(np.diag(np.linalg.inv(P)))
    assert not bool(res.diagnostics["nonfinite"])
    assert res.posterior.is_diag
    np.testing.assert_allclose(np.asarray(res.params), mu, atol=MEAN_TOL * sd.min())
    np.testing.assert_allclose(np.asarray(res.posterior.mean()), np.asarray(res.params), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(res.posterior.precision), np.diag(P), rtol=PREC_TOL)


def test_one_step_matches_hand_computation():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(D, D))
    A = A @ A.T + np.eye(D)
    b = rng.normal(size=D)
    m, h, g = rng.normal(size=D), np.array([0.5, 2.0, 1.0]), rng.normal(size=D)
    lam, v, u = 30.0, rng.normal(size=D), np.array([0.1, -0.2, 0.3])
    mp, sp = rng.normal(size=D), np.array([3.0, 0.0, 6.0])
    b1, b2, lr, mc = 0.9, 0.99, 0.3, 2
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    inputs = IVONInputs(f32(lam), f32(v), f32(u), f32(mp), f32(sp))
    state = IVONState(f32(m), f32(h), f32(g), jnp.asarray(2, jnp.int32))

    def grad_fn(theta, key):
        return jax.value_and_grad(lambda t: 0.5 * t @ f32(A) @ t - f32(b) @ t)(theta)

    key = jax.random.PRNGKey(4)
    for clip in (math.inf, 0.05):
        new, info = ivon_step(key, state, grad_fn, inputs, lr, beta1=b1, beta2=b2, mc_samples=mc,
                              clip_radius=clip)
        eps = np.asarray(jax.random.normal(jax.random.split(key)[0], (mc, D)), np.float64)
        delta = sp / lam
        sigma = 1.0 / np.sqrt(lam * (h + delta))
        theta = m + sigma * eps
        grads = theta @ A - b
        g_hat = grads.mean(0)
        h_hat = (grads * (theta - m) / sigma ** 2).mean(0) - u
        g_new = b1 * g + (1 - b1) * g_hat
        h_new = b2 * h + (1 - b2) * h_hat + 0.5 * (1 - b2) ** 2 * (h - h_hat) ** 2 / (h + delta)
        step = (g_new / (1 - b1 ** 3) + v - u * m + delta * (m - mp)) / (h_new + delta)
        m_new = m - lr * np.clip(step, -clip, clip)
        np.testing.assert_allclose(np.asarray(new.momentum), g_new, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(new.hess), h_new, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(new.mean), m_new, rtol=1e-4, atol=1e-5)
        assert int(new.count) == 3
        losses = [0.5 * t @ A @ t - b @ t for t in theta]
        np.testing.assert_allclose(float(info.loss), np.mean(losses), rtol=1e-4)
    assert np.any(np.abs(step) > 0.05)          # the clip case did clip


def test_conjugate_mean_and_mean_field_precision(problem):
    pot, X, y = problem
    res = fit(BACKEND, pot, target_of(X, y, N_MAX))
    mu, cov = linreg_exact_posterior([X], [y], SIGMA, PRIOR)
    P = np.linalg.inv(cov)
    # informative: the mean-field precisions are well above the inverse marginal variances
    assert np.all(np.diag(P) > 1.4 / np.diag(cov))
    check_mean_field(res, P, P @ mu)


def test_gaussian_term_acts_as_prior(problem):
    pot, X, y = problem
    s0 = np.array([2.0, 300.0, 20.0])
    m0 = np.array([0.5, 1.0, -1.0])
    res = fit(BACKEND, pot, target_of(X, y, N_MAX, prior_weight=0.0, linear=s0 * m0, precision=s0))
    A, c = lik_natural(X, y)
    check_mean_field(res, A + np.diag(s0), c + s0 * m0)


def test_full_gaussian_term_with_negative_diagonal(problem):
    pot, X, y = problem
    P0 = np.array([[-20.0, 10.0, 0.0], [10.0, 40.0, 5.0], [0.0, 5.0, 0.0]])
    b0 = np.array([3.0, -20.0, 1.0])
    res = fit(BACKEND, pot, target_of(X, y, N_MAX, linear=b0, precision=P0))
    A, c = lik_natural(X, y)
    P = A + np.eye(D) / PRIOR ** 2 + P0
    assert np.all(np.linalg.eigvalsh(P) > 0)
    check_mean_field(res, P, c + b0)


def test_ess_tempers_the_likelihood(problem):
    pot, X, y = problem
    res = fit(IVON(num_steps=3000, mc_samples=4, ess=N_MAX / 4), pot, target_of(X, y, N_MAX))
    A, c = lik_natural(X, y)
    check_mean_field(res, A / 4 + np.eye(D) / PRIOR ** 2, c / 4)


def test_bayes_admm_client_inputs(problem):
    pot, X, y = problem
    n, rho, tau = N_MAX, 0.5, 2.0
    rng = np.random.default_rng(7)
    v_k, u_k = rng.normal(size=D) * 10.0, np.array([5.0, -10.0, 20.0])
    m_g, s_g = rng.normal(size=D), np.array([30.0, 80.0, 10.0])
    inputs = bayes_admm_client_inputs(n, rho, tau, v_k, u_k, m_g, s_g)
    np.testing.assert_allclose(float(inputs.ess), n / (rho * tau))
    np.testing.assert_allclose(np.asarray(inputs.v), tau * v_k / n, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inputs.u), tau * u_k / n, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inputs.prior_precision), s_g)
    # the mean loss -log p(D|theta)/N_k of the client's data (no model prior)
    grad_fn, _ = local_target_inputs(pot, target_of(X, y, n, prior_weight=0.0))
    inputs = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), inputs)
    state, _ = jax.jit(lambda k: BACKEND.solve(k, grad_fn, inputs, jnp.zeros(D)))(jax.random.PRNGKey(3))
    got = jax.tree_util.tree_map(np.asarray, ivon_gaussian(state, inputs))
    # E_q[l_k/tau + v_k'th - th'(u_k th)/2] + rho KL(q || N(m_g, 1/s_g)): Gaussian optimum
    A, c = lik_natural(X, y)
    S = A / (rho * tau) - np.diag(u_k) / rho + np.diag(s_g)
    lin = c / (rho * tau) - v_k / rho + s_g * m_g
    mu, sd = np.linalg.solve(S, lin), np.sqrt(np.diag(np.linalg.inv(S)))
    np.testing.assert_allclose(np.asarray(state.mean), mu, atol=MEAN_TOL * sd.min())
    np.testing.assert_allclose(got.precision, np.diag(S), rtol=PREC_TOL)


def test_vmapped_clients_match_their_own_posteriors(problem):
    pot, _, _ = problem
    sizes = [40, 25, 12]
    clients = [make_client(10 + k, n) for k, n in enumerate(sizes)]
    targets = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                     *[target_of(X, y, n) for (X, y), n in zip(clients, sizes)])
    res = jax.jit(lambda k, t, z: BACKEND.run_clients(k, pot, t, z))(
        jax.random.PRNGKey(2), targets, jnp.zeros((len(sizes), D)))
    assert res.params.shape == (len(sizes), D)
    for k, ((X, y), n) in enumerate(zip(clients, sizes)):
        mu, cov = linreg_exact_posterior([X[:n]], [y[:n]], SIGMA, PRIOR)
        P = np.linalg.inv(cov)
        check_mean_field(jax.tree_util.tree_map(lambda a: a[k], res), P, P @ mu)


def test_solve_warm_start_and_init():
    st = ivon_init(jnp.ones(D), 0.3)
    assert st.hess.shape == (D,) and float(st.hess[0]) == pytest.approx(0.3)
    assert int(st.count) == 0 and float(jnp.sum(jnp.abs(st.momentum))) == 0.0
    inputs = IVONInputs(jnp.asarray(10.0), jnp.zeros(D), jnp.zeros(D), jnp.zeros(D), jnp.ones(D))
    grad_fn = jax.value_and_grad(lambda t, k: 0.5 * jnp.sum(4.0 * t * t))
    state, losses = ivon_solve(jax.random.PRNGKey(0), grad_fn, inputs, st, num_steps=5,
                               hess_init=100.0)
    assert losses.shape == (5,) and int(state.count) == 5
    # a warm start keeps its h: the first step used h = 0.3, not hess_init = 100
    one, _ = ivon_solve(jax.random.PRNGKey(0), grad_fn, inputs, st, num_steps=1, hess_init=100.0)
    ref, _ = ivon_step(jax.random.split(jax.random.PRNGKey(0), 1)[0], st, grad_fn, inputs, 0.1)
    np.testing.assert_allclose(np.asarray(one.mean), np.asarray(ref.mean), rtol=1e-6)


def test_bad_arguments_fail_early():
    for kw, word in [(dict(learning_rate=0.0), "learning_rate"), (dict(hess_init=-1.0), "hess_init"),
                     (dict(beta2=1.0), "beta2"), (dict(ess=0.0), "ess"),
                     (dict(schedule="linear"), "schedule"), (dict(mc_samples=0), "mc_samples"),
                     (dict(batch_size=0), "batch_size"), (dict(min_hess=-0.1), "min_hess")]:
        with pytest.raises(ValueError, match=word):
            IVON(**kw)
    assert IVON().output == "gaussian"
    assert IVON(num_steps=2000).resolved_beta2 == pytest.approx(0.995)
    assert IVON(num_steps=10 ** 7).resolved_beta2 == pytest.approx(0.99999)
    # short local runs (<= 100 steps): h averages about 10 steps' estimates
    assert IVON(num_steps=38).resolved_beta2 == pytest.approx(0.9)
    assert IVON(num_steps=100).resolved_beta2 == pytest.approx(0.9)
    assert IVON(num_steps=101).resolved_beta2 == pytest.approx(0.99)
    assert IVON(num_steps=400).resolved_beta2 == pytest.approx(0.99)
