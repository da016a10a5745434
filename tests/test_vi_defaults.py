"""SVI (every guide) and IVON at their DEFAULT arguments, small and large clients.

Oracles (Bayesian linear regression with known noise, exact posterior
N(mu, P^-1), conftest.linreg_exact_posterior):

* ``"full"`` guide, and ``"lowrank"`` (whose family, ``A (W W' + D) A'``
  with ``A A'`` the inverse curvature at the mode, holds every Gaussian):
  the exact posterior (mean and marginal sds);
* ``"normal"``, ``"diag"`` and IVON: the mean-field optimum of a Gaussian
  target, mean mu and precisions diag(P).

Problems: (a) one client of 240 rows (3 correlated features, padded to 256
rows of garbage), posterior sds 0.02-0.05; (b) 3 clients vmapped through
``run_clients``, 4 features with inputs ``2 + N(0, 1)`` (correlation 0.8),
posterior sds near 0.01, started at N(0, 1) draws (about 100 posterior sds
away). (b) runs at 1,000 rows per client (fast) and 4,000 (slow). (c)
tiny clients of 3, 8 and 20 rows, posterior sds up to 0.7.

Tolerances: mean error < 0.2 sds of the oracle, sd ratio in [0.85, 1.15].
Observed worst cases over 4 seeds at 1,000 rows (max over clients and
coordinates; SVI at 1,000 steps, half today's default): SVI means 0.10 sd,
sds 0.92-1.06; IVON 0.10 sd and 0.91-1.05 (also at 2,000 rows). At 240 rows
(2 seeds): SVI 0.06 sd and 0.96-1.02, IVON 0.05 sd and 0.96-1.03.
Before (the previous defaults, N(0, 1) starts): at 4,000 rows SVI sds were
2.7-7.2x exact (full guide) and 3.0-10x the mean-field optimum (diag), IVON
means 400 sds off; at 1,000 rows SVI sds were 1.8-4.0x and IVON passed on
this draw, so IVON's regression test is a 2,000-row draw where it was 56 sds
off.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import linreg_exact_posterior, linreg_model, padded_correlated_client

from fedprob.inference import IVON, SVI
from fedprob.inference.ivon import IVONInputs, ivon_hess_init
from fedprob.inference.svi import curvature_whitening
from fedprob.potential import ClientData, Potential, make_target

SIGMA, PRIOR = 0.5, 1.0
MEAN_TOL, SD_LO, SD_HI = 0.2, 0.85, 1.15
BACKENDS = {"normal": SVI(guide="normal"), "diag": SVI(guide="diag"), "full": SVI(guide="full"),
            "lowrank": SVI(guide="lowrank"), "ivon": IVON()}


def target_of(X, y, n):
    data = ClientData(jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(n))
    return make_target(data, X.shape[1])


def oracle(name, mu, cov):
    """(mean, marginal sds) the backend should reach (full and mean-field families)."""
    P = np.linalg.inv(cov)
    if name in ("full", "lowrank"):
        return mu, np.sqrt(np.diag(cov))
    return mu, 1.0 / np.sqrt(np.diag(P))


def marginal_sds(post):
    prec = np.asarray(post.precision, np.float64)
    if prec.ndim == 1:
        return 1.0 / np.sqrt(prec)
    return np.sqrt(np.diag(np.linalg.inv(prec)))


def check(name, res, mu, cov):
    assert not bool(res.diagnostics["nonfinite"])
    assert bool(res.diagnostics["converged"])
    got_mean = np.asarray(res.posterior.mean(), np.float64)
    sd = np.sqrt(np.diag(cov))
    np.testing.assert_allclose(np.asarray(res.params), got_mean, rtol=1e-4, atol=1e-4 * sd.min())
    want_mean, want_sd = oracle(name, mu, cov)
    err = np.abs(got_mean - want_mean) / want_sd
    ratio = marginal_sds(res.posterior) / want_sd
    assert err.max() < MEAN_TOL, (name, err, ratio)
    assert SD_LO < ratio.min() and ratio.max() < SD_HI, (name, err, ratio)


# -- (a) one client of 240 rows -----------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    n, n_max = 240, 256
    X, y = padded_correlated_client(0, n, n_max, np.array([1.0, -0.5, 0.3]), SIGMA)
    pot = Potential(linreg_model(PRIOR, SIGMA), X, y)
    mu, cov = linreg_exact_posterior([X[:n]], [y[:n]], SIGMA, PRIOR)
    return pot, target_of(X, y, n), mu, cov


@pytest.mark.parametrize("name", list(BACKENDS))
def test_defaults_on_240_rows(small, name):
    pot, target, mu, cov = small
    backend = BACKENDS[name]
    res = jax.jit(lambda k, t, z: backend.run(k, pot, t, z))(jax.random.PRNGKey(0), target,
                                                               jnp.zeros(3))
    check(name, res, mu, cov)
    if name == "full":
        # the reported ELBO is the ELBO in z (whitening's log |det A| included): log Z for the exact family
        lpz = float(pot.log_density(jnp.asarray(mu, jnp.float32), target))
        log_z = lpz + 1.5 * np.log(2 * np.pi) + 0.5 * np.linalg.slogdet(cov)[1]
        assert abs(float(res.diagnostics["elbo"]) - log_z) < 0.2


@pytest.mark.parametrize("name", ["full", "ivon"])
def test_defaults_with_minibatches_on_240_rows(small, name):
    """``batch_size=32`` and otherwise defaults (the mode search is Adam, the curvature full-data).
    Looser: means within 0.3 sd, sds within [0.8, 1.2]; observed over 4 seeds 0.19 sd, 0.89-1.09."""
    pot, target, mu, cov = small
    backend = SVI(guide="full", batch_size=32) if name == "full" else IVON(batch_size=32)
    res = jax.jit(lambda k, t, z: backend.run(k, pot, t, z))(jax.random.PRNGKey(0), target,
                                                               jnp.zeros(3))
    want_mean, want_sd = oracle(name, mu, cov)
    assert not bool(res.diagnostics["nonfinite"])
    err = np.abs(np.asarray(res.posterior.mean(), np.float64) - want_mean) / want_sd
    ratio = marginal_sds(res.posterior) / want_sd
    assert err.max() < 0.3 and 0.8 < ratio.min() and ratio.max() < 1.2, (err, ratio)


# the default run keeps SVI's default guide ("normal"), the exact family ("full") and IVON; the diag and
# lowrank guides (each checked at its defaults on 240 rows above) are slow here
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("diag", "lowrank") else n
                                  for n in BACKENDS])
def test_defaults_on_tiny_clients(small, name):
    """Clients of 3, 8 and 20 rows (posterior sds up to 0.7, prior-dominated), vmapped.
    Observed over 2 seeds: means 0.11 sd, sds 0.96-1.07."""
    pot = small[0]
    sizes = [3, 8, 20]
    clients = [padded_correlated_client(20 + k, n, 20, np.array([1.0, -0.5, 0.3]), SIGMA)
               for k, n in enumerate(sizes)]
    targets = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                     *[target_of(X, y, n) for (X, y), n in zip(clients, sizes)])
    backend = BACKENDS[name]
    res = jax.jit(lambda k, t, z: backend.run_clients(k, pot, t, z))(jax.random.PRNGKey(0), targets,
                                                                       jnp.zeros((3, 3)))
    for k, ((X, y), n) in enumerate(zip(clients, sizes)):
        mu, cov = linreg_exact_posterior([X[:n]], [y[:n]], SIGMA, PRIOR)
        check(name, jax.tree_util.tree_map(lambda a: a[k], res), mu, cov)


# -- (b) three clients of 1,000 (fast) or 4,000 (slow) rows, vmapped ------------------------------
def shifted_clients(n, K=3, d=4, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=d)
    out = []
    for _ in range(K):
        X = 2.0 + rng.normal(size=(n, d)) + 0.1 * rng.normal(size=(n, 1))
        out.append((X, X @ w + SIGMA * rng.normal(size=n)))
    return out


def run_big(name, n, seed=0):
    clients = shifted_clients(n)
    pot = Potential(linreg_model(PRIOR, SIGMA), *clients[0])
    targets = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[target_of(X, y, n) for X, y in clients])
    inits = jax.random.normal(jax.random.PRNGKey(100 + seed), (len(clients), 4))
    backend = BACKENDS[name]
    res = jax.jit(lambda k, t, z: backend.run_clients(k, pot, t, z))(jax.random.PRNGKey(seed),
                                                                       targets, inits)
    assert res.params.shape == (len(clients), 4)
    for k, (X, y) in enumerate(clients):
        mu, cov = linreg_exact_posterior([X], [y], SIGMA, PRIOR)
        assert np.sqrt(np.diag(cov)).max() < 0.03          # a client with small posterior sds
        check(name, jax.tree_util.tree_map(lambda a: a[k], res), mu, cov)


@pytest.mark.slow   # the default run covers 3 x 4,000 rows in test_backend_defaults.py
@pytest.mark.parametrize("name", list(BACKENDS))
def test_defaults_on_three_clients_of_1000_rows(name):
    run_big(name, 1000)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BACKENDS))
def test_defaults_on_three_clients_of_4000_rows(name):
    run_big(name, 4000)


def test_ivon_default_far_from_the_mode():
    """Regression: started ~150 posterior sds from the mode, the previous IVON defaults
    (h0 = 1, from ``init``) ended 56 sds off on this draw; now it starts at the mode."""
    run_big("ivon", 2000, seed=1)


# -- the pieces ---------------------------------------------------------------------------------
def test_ivon_hess_init_is_the_per_point_curvature():
    """h0 = diag(A) - u for the quadratic mean loss z'Az/2 (so lambda (h0 + delta) = lambda diag(A - U + Delta))."""
    rng = np.random.default_rng(1)
    B = rng.normal(size=(3, 3))
    A = jnp.asarray(B @ B.T * 20.0 + np.eye(3), jnp.float32)
    grad_fn = jax.value_and_grad(lambda t, k: 0.5 * t @ A @ t)
    inputs = IVONInputs(jnp.asarray(4000.0), jnp.zeros(3), jnp.asarray([0.5, 0.0, 0.0]),
                        jnp.zeros(3), jnp.asarray([0.0, 40.0, 0.0]))
    h0 = ivon_hess_init(grad_fn, inputs, jnp.asarray([0.3, -1.0, 2.0]))
    np.testing.assert_allclose(np.asarray(h0), np.diag(np.asarray(A)) - [0.5, 0.0, 0.0], rtol=1e-5)
    # min_hess floors h0 + delta (delta = [0, 0.01, 0]); entries above the floor are unchanged
    floor = float(np.median(np.diag(np.asarray(A)) - [0.5, 0.0, 0.0] + [0.0, 0.01, 0.0]))
    h0f = ivon_hess_init(grad_fn, inputs, jnp.asarray([0.3, -1.0, 2.0]), min_hess=floor)
    want = np.maximum(np.diag(np.asarray(A)) - [0.5, 0.0, 0.0] + [0.0, 0.01, 0.0], floor) - [0.0, 0.01, 0.0]
    np.testing.assert_allclose(np.asarray(h0f), want, rtol=1e-5)
    # a concave direction is floored: lambda (h0 + delta) stays positive
    h0 = ivon_hess_init(jax.value_and_grad(lambda t, k: -0.5 * jnp.sum(t * t)), inputs, jnp.ones(3))
    assert np.all(np.asarray(h0) + np.asarray(inputs.prior_precision) / 4000.0 > 0)


def test_curvature_whitening_maps_back_exactly():
    rng = np.random.default_rng(2)
    B = rng.normal(size=(4, 4))
    H = B @ B.T + 0.1 * np.eye(4)
    m0 = rng.normal(size=4)
    for curv in (jnp.asarray(H), jnp.asarray(np.diag(H))):
        wh = curvature_whitening(curv, jnp.asarray(m0))
        A = np.asarray(wh.factor) if curv.ndim == 2 else np.diag(np.asarray(wh.factor))
        target = H if curv.ndim == 2 else np.diag(np.diag(H))
        np.testing.assert_allclose(A @ A.T, np.linalg.inv(target), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(wh.log_det), np.linalg.slogdet(A)[1], rtol=1e-5)
        # u ~ N(mu_u, P_u) maps to z = m0 + A u ~ N(m0 + A mu_u, A P_u^-1 A')
        mu_u = rng.normal(size=4)
        Pu = np.diag(rng.uniform(0.5, 2.0, size=4))
        post, mean = wh.gaussian(jnp.asarray(mu_u), jnp.asarray(Pu))
        np.testing.assert_allclose(np.asarray(mean), m0 + A @ mu_u, rtol=1e-5)
        np.testing.assert_allclose(np.linalg.inv(np.asarray(post.precision)),
                                   A @ np.linalg.inv(Pu) @ A.T, rtol=1e-4, atol=1e-6)
