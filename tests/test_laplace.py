"""Laplace client and its curvatures against exact answers.

Oracles: Bayesian linear regression with known noise (the Laplace
approximation is the exact posterior; GGN equals the Hessian), logistic and
softmax regression (canonical links: GGN equals the Hessian at any point),
a Normal likelihood with a learned scale (hand-computed GGN), and the product
with a Gaussian term. Exactness checks run in float64.
"""
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from conftest import linreg_exact_posterior, linreg_model

from fedprob.data.federated import FederatedData
from fedprob.inference import Laplace, minimize
from fedprob.inference.laplace import clip_precision, curvature
from fedprob.posteriors import Gaussian
from fedprob.potential import ClientData, Potential, make_target

PRIOR, SIGMA, D = 1.0, 0.5, 3
W_TRUE = np.array([1.0, -0.5, 0.3])
N, N_VALID = 30, 25          # one padded client: rows 25..29 must not count


linreg = linreg_model(PRIOR, SIGMA)


def logreg(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def softmax_reg(X, y=None):
    W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([X.shape[1], 3]).to_event(2))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=X @ W), obs=y)


def linreg_learned_noise(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR).expand([D]).to_event(1))
    s = numpyro.sample("s", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, s), obs=y)


def student_reg(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(4.0, X @ w, 1.0), obs=y)


@pytest.fixture(scope="module")
def linreg_data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D))
    y = X @ W_TRUE + SIGMA * rng.normal(size=N)
    return X, y


@pytest.fixture(scope="module")
def exact(linreg_data):
    X, y = linreg_data
    mean, cov = linreg_exact_posterior([X[:N_VALID]], [y[:N_VALID]], SIGMA, PRIOR)
    return mean, np.linalg.inv(cov)


def x64_target(X, y, n, dim=D, **kw):
    data = ClientData(jnp.asarray(X, jnp.float64), jnp.asarray(y), jnp.asarray(n))
    return make_target(data, dim, dtype=jnp.float64, **kw)


def test_all_curvatures_exact_on_linear_regression(linreg_data, exact):
    """At the MAP: full = GGN = exact precision, diag = diag GGN = its diagonal (x64)."""
    X, y = linreg_data
    mean, P = exact
    with jax.enable_x64(True):
        pot = Potential(linreg, X, y)
        target = x64_target(X, y, N_VALID)
        opt = jax.jit(lambda t, z: minimize(pot, t, z))(target, jnp.zeros(D))
        np.testing.assert_allclose(opt.params, mean, rtol=1e-6, atol=1e-8)
        assert float(opt.grad_norm) < 1e-8
        assert int(opt.num_rejected) == 0
        curv = jax.jit(lambda t, z, h: curvature(pot, t, z, h), static_argnums=2)
        for h in ("full", "ggn"):
            np.testing.assert_allclose(curv(target, opt.params, h), P, rtol=1e-10, err_msg=h)
        for h in ("diag", "diag_ggn"):
            np.testing.assert_allclose(curv(target, opt.params, h), np.diag(P), rtol=1e-10, err_msg=h)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_full_batch_search_stops_when_the_loss_stalls_at_the_fixed_length_answer(linreg_data, dtype):
    """The full-batch L-BFGS loop stops once its loss stalls, at the point 200 plain optax steps reach;
    a step budget (max_steps) is kept."""
    import optax

    from fedprob.potential import mean_loss

    X, y = linreg_data
    with jax.enable_x64(dtype == "float64"):
        pot = Potential(linreg, X, y)
        target = x64_target(X, y, N_VALID) if dtype == "float64" else make_target(
            ClientData(jnp.asarray(X, jnp.float32), jnp.asarray(y), jnp.asarray(N_VALID)), D)
        z0 = jnp.zeros(D, dtype)
        opt = jax.jit(lambda t, z: minimize(pot, t, z))(target, z0)

        def fn(z):
            return mean_loss(pot, z, target)
        tx = optax.lbfgs()
        vg = optax.value_and_grad_from_state(fn)

        def step(carry, _):
            z, state = carry
            value, grad = vg(z, state=state)
            updates, state = tx.update(grad, state, z, value=value, grad=grad, value_fn=fn)
            return (optax.apply_updates(z, updates), state), None
        (z200, _), _ = jax.jit(lambda z: jax.lax.scan(step, (z, tx.init(z)), None, length=200))(z0)
        assert int(opt.num_steps) < 40                   # 200 asked for
        # among losses equal to rounding, the smallest gradient is kept
        assert float(opt.grad_norm) < (1e-9 if dtype == "float64" else 1e-5)
        tol = 1e-10 if dtype == "float64" else 1e-4
        np.testing.assert_allclose(opt.params, z200, rtol=tol, atol=tol)
        assert float(fn(opt.params)) <= float(fn(z200)) + 1e-6 * abs(float(fn(z200)))
        short = jax.jit(lambda t, z: minimize(pot, t, z, max_steps=jnp.array(3)))(target, z0)
        assert int(short.num_steps) == 3


def test_laplace_full_with_gaussian_term_and_prior_share_is_exact_product(linreg_data):
    """prior_weight = 1/K and a full Gaussian term (linear, Lambda): the product is exact."""
    X, y = linreg_data
    K = 4
    rng = np.random.default_rng(1)
    A = rng.normal(size=(D, D))
    Lam = A @ A.T + 0.5 * np.eye(D)
    lin = rng.normal(size=D)
    P = np.eye(D) / (K * PRIOR ** 2) + X[:N_VALID].T @ X[:N_VALID] / SIGMA ** 2 + Lam
    b = X[:N_VALID].T @ y[:N_VALID] / SIGMA ** 2 + lin
    with jax.enable_x64(True):
        pot = Potential(linreg, X, y)
        target = x64_target(X, y, N_VALID, prior_weight=1.0 / K, linear=lin, precision=Lam)
        res = jax.jit(lambda k, t, z: Laplace(hessian="full").run(k, pot, t, z))(
            jax.random.PRNGKey(0), target, jnp.ones(D))
        assert isinstance(res.posterior, Gaussian) and not res.posterior.is_diag
        np.testing.assert_allclose(res.posterior.precision, P, rtol=1e-10)
        np.testing.assert_allclose(res.posterior.linear, b, rtol=1e-6)
        np.testing.assert_allclose(res.params, np.linalg.solve(P, b), rtol=1e-6)
        d = res.diagnostics
        assert int(d["num_clipped"]) == 0 and bool(d["finite"])
        assert float(d["grad_norm"]) < 1e-8
        # final loss is -log pi(m) / n at the mode
        lp = float(pot.log_density(res.params, target))
        np.testing.assert_allclose(float(d["final_loss"]), -lp / N_VALID, rtol=1e-10)


def test_laplace_vmap_clients_diag_ggn_float32():
    """Several clients of different sizes at once; diag GGN = diag of each exact precision."""
    rng = np.random.default_rng(2)
    clients = []
    for n in (8, 20, 35):
        X = rng.normal(size=(n, D))
        clients.append((X, X @ W_TRUE + SIGMA * rng.normal(size=n)))
    fd = FederatedData.from_clients(clients)
    pot = Potential(linreg, fd.X[0], fd.y[0])
    targets = jax.vmap(lambda dd: make_target(dd, D))(fd.client_data())
    lap = Laplace(hessian="diag_ggn")
    res = jax.jit(lambda k, t, z: lap.run_clients(k, pot, t, z))(
        jax.random.PRNGKey(0), targets, jnp.zeros((3, D)))
    assert res.posterior.precision.shape == (3, D) and res.posterior.is_diag
    for k, (X, y) in enumerate(clients):
        mean, cov = linreg_exact_posterior([X], [y], SIGMA, PRIOR)
        P = np.linalg.inv(cov)
        np.testing.assert_allclose(res.params[k], mean, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(res.posterior.precision[k], np.diag(P), rtol=1e-5)
        np.testing.assert_allclose(res.posterior.linear[k], np.diag(P) * np.asarray(res.params[k]),
                                   rtol=1e-6)
    assert np.all(res.diagnostics["num_clipped"] == 0)
    assert np.all(res.diagnostics["grad_norm"] < 1e-3)


def test_minibatch_map_full_batch_curvature(linreg_data, exact):
    """Adam on minibatches finds the mode roughly; the curvature still uses all rows."""
    X, y = linreg_data
    mean, P = exact
    pot = Potential(linreg, X, y)
    data = ClientData(jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(N_VALID))
    # an optax transformation with a decaying step size (constant-step Adam keeps jittering)
    lap = Laplace(hessian="full", batch_size=5, num_steps=1500,
                  optimizer=optax.adam(optax.cosine_decay_schedule(0.05, 1500)))
    res = jax.jit(lambda k, t, z: lap.run(k, pot, t, z))(jax.random.PRNGKey(3), make_target(data, D),
                                                          jnp.zeros(D))
    sd = np.sqrt(np.diag(np.linalg.inv(P)))
    assert np.all(np.abs(np.asarray(res.params) - mean) < 0.2 * sd)
    np.testing.assert_allclose(res.posterior.precision, P, rtol=1e-4)


def test_unset_map_search_follows_the_client_size(monkeypatch):
    """Unset, the search is full-batch L-BFGS up to FULL_BATCH_MAX_WORK row-parameters and minibatch
    Adam beyond (any setting given is kept); on a conjugate regression of 600 rows pushed past the
    threshold the minibatch search runs its fixed 200 steps and lands near the exact mode (its
    largest coordinate error over 16 keys: 0.36 posterior sd on average, at most 0.60; with a
    constant step 0.99 and 1.94), and the curvature (all rows) is the exact precision."""
    from fedprob.inference import laplace as lap_mod
    from fedprob.inference.laplace import AUTO_BATCH_SIZE, FULL_BATCH_MAX_WORK, map_search_settings

    tx, lr, bs = map_search_settings(None, None, None, 2555, 178_110)
    assert isinstance(tx, optax.GradientTransformation) and lr is None and bs == AUTO_BATCH_SIZE
    assert map_search_settings(None, None, None, 6000, 7850) == (None, None, None)     # MNIST softmax
    assert map_search_settings(None, None, None, 100, FULL_BATCH_MAX_WORK) == (None, None, None)  # <= a batch
    assert map_search_settings(None, 0.1, None, 2555, 178_110) == (None, 0.1, None)
    assert map_search_settings("lbfgs", None, None, 2555, 178_110) == ("lbfgs", None, None)

    rng = np.random.default_rng(5)
    n, w = 600, np.array([0.08, -0.05, 0.03])
    X = rng.normal(size=(n, D))
    y = X @ w + SIGMA * rng.normal(size=n)
    mean, cov = linreg_exact_posterior([X], [y], SIGMA, PRIOR)
    pot = Potential(linreg, X, y)
    data = ClientData(jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(n))
    target = make_target(data, D)
    full = jax.jit(lambda k, t, z: Laplace(hessian="ggn").run(k, pot, t, z))(
        jax.random.PRNGKey(0), target, jnp.zeros(D))
    monkeypatch.setattr(lap_mod, "FULL_BATCH_MAX_WORK", 100)
    # the minibatch answer depends on the batches drawn: 16 keys in one vmapped program
    mini = jax.jit(jax.vmap(lambda k: Laplace(hessian="ggn").run(k, pot, target, jnp.zeros(D))))(
        jax.random.split(jax.random.PRNGKey(0), 16))
    assert int(full.diagnostics["num_steps"]) < 200 and np.all(np.asarray(mini.diagnostics["num_steps"]) == 200)
    sd = np.sqrt(np.diag(cov))
    assert np.all(np.abs(np.asarray(full.params) - mean) < 0.01 * sd)
    err = np.max(np.abs(np.asarray(mini.params) - mean) / sd, axis=1)
    assert err.mean() < 0.5 and err.max() < 1.0, err
    np.testing.assert_allclose(mini.posterior.precision[0], np.linalg.inv(cov), rtol=1e-4)


CURV = jax.jit(curvature, static_argnums=(0, 3))


def test_ggn_equals_hessian_for_canonical_links():
    """Bernoulli and Categorical logits are linear in the weights: GGN = Hessian anywhere."""
    rng = np.random.default_rng(4)
    n = 40
    X = rng.normal(size=(n, D))
    yb = (rng.random(n) < 0.5).astype(np.int32)
    yc = rng.integers(0, 3, size=n).astype(np.int32)
    with jax.enable_x64(True):
        for model, y, dim in ((logreg, yb, D + 1), (softmax_reg, yc, 3 * D)):
            pot = Potential(model, X, y)
            target = x64_target(X, y, n - 3, dim=dim)
            z = jnp.asarray(rng.normal(size=dim))
            full = CURV(pot, target, z, "full")
            np.testing.assert_allclose(CURV(pot, target, z, "ggn"), full, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(CURV(pot, target, z, "diag_ggn"), np.diag(full),
                                       rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(CURV(pot, target, z, "diag"), np.diag(full),
                                       rtol=1e-9, atol=1e-12)
        # and at the MAP the Laplace run returns the same natural parameters
        pot = Potential(logreg, X, yb)
        target = x64_target(X, yb, n, dim=D + 1)
        res = jax.jit(lambda k, t, z: Laplace(hessian="ggn").run(k, pot, t, z))(
            jax.random.PRNGKey(0), target, jnp.zeros(D + 1))
        full = CURV(pot, target, res.params, "full")
        np.testing.assert_allclose(res.posterior.precision, full, rtol=1e-9)
        assert float(res.diagnostics["grad_norm"]) < 1e-6


def test_ggn_learned_noise_scale_hand_computed():
    """Normal(Xw, s), s = exp(u) ~ LogNormal(0, 1): natural-parameter GGN is
    blockdiag(X'X / s^2 + I / prior^2, 2 n + 1) (Fisher 2 per row for log s, prior 1)."""
    rng = np.random.default_rng(5)
    n = 20
    X = rng.normal(size=(n, D))
    y = rng.normal(size=n)
    with jax.enable_x64(True):
        pot = Potential(linreg_learned_noise, X, y)
        target = x64_target(X, y, n, dim=D + 1)
        u = -0.3
        z = jnp.concatenate([jnp.asarray(rng.normal(size=D)), jnp.array([u])])
        s2 = np.exp(2 * u)
        expected = np.zeros((D + 1, D + 1))
        expected[:D, :D] = X.T @ X / s2 + np.eye(D) / PRIOR ** 2
        expected[D, D] = 2 * n + 1
        ggn = CURV(pot, target, z, "ggn")
        np.testing.assert_allclose(ggn, expected, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(CURV(pot, target, z, "diag_ggn"), np.diag(expected), rtol=1e-10)
        assert np.all(np.linalg.eigvalsh(np.asarray(ggn)) > 0)


def test_clipping_guard():
    # vector: entries below the floor (NaN too) are raised and counted
    P, n = clip_precision(jnp.array([-1.0, 0.0, 2.0, jnp.nan]), 1e-3)
    np.testing.assert_allclose(P, [1e-3, 1e-3, 2.0, 1e-3])
    assert int(n) == 3
    # matrix: eigenvalues (-1, 3) -> (floor, 3)
    Q = np.array([[np.cos(0.3), -np.sin(0.3)], [np.sin(0.3), np.cos(0.3)]])
    M = Q @ np.diag([-1.0, 3.0]) @ Q.T
    P, n = clip_precision(jnp.asarray(M, jnp.float32), 1e-2)
    np.testing.assert_allclose(P, Q @ np.diag([1e-2, 3.0]) @ Q.T, atol=1e-5)
    assert int(n) == 1
    Pd = jnp.array([[2.0, 0.5], [0.5, 1.0]])
    P, n = clip_precision(Pd, 1e-6)
    np.testing.assert_array_equal(P, Pd)
    assert int(n) == 0


def test_laplace_reports_clipped_precision(linreg_data, exact):
    """A Gaussian term with a negative precision (an over-subtracted cavity) makes the
    curvature indefinite: the entry is floored and reported."""
    X, y = linreg_data
    mean, P = exact
    lam = np.zeros(D)
    lam[0] = -(P[0, 0] + 1.0)
    pot = Potential(linreg, X, y)
    data = ClientData(jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(N_VALID))
    lap = Laplace(hessian="diag", optimizer="sgd", num_steps=0, min_precision=1e-3)
    res = jax.jit(lambda k, t, z: lap.run(k, pot, t, z))(
        jax.random.PRNGKey(0), make_target(data, D, precision=lam), jnp.zeros(D))
    assert int(res.diagnostics["num_clipped"]) == 1
    np.testing.assert_allclose(res.posterior.precision, [1e-3, P[1, 1], P[2, 2]], rtol=1e-5)


def test_bad_input_fails_early(linreg_data):
    X, y = linreg_data
    with pytest.raises(ValueError, match="unknown hessian"):
        Laplace(hessian="kfac")
    with pytest.raises(ValueError, match="lbfgs"):
        Laplace(optimizer="lbfgs", batch_size=4)
    with pytest.raises(ValueError, match="unknown optimizer"):
        Laplace(optimizer="rmsprop-ish")
    with pytest.raises(ValueError, match="min_precision"):
        Laplace(min_precision=0.0)
    pot = Potential(student_reg, X, y)
    data = ClientData(jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(N))
    # no closed-form GGN for a StudentT likelihood: the exact curvature is used instead of refusing
    t = make_target(data, D)
    np.testing.assert_allclose(np.asarray(curvature(pot, t, jnp.zeros(D), "ggn")),
                               np.asarray(curvature(pot, t, jnp.zeros(D), "full")), rtol=1e-4, atol=1e-4)


def test_hessian_diag_estimate_exact_below_threshold_and_unbiased_above():
    """Starting curvatures of IVON/SVI: exact for small d, a d-independent Hutchinson cost above."""
    from fedprob.inference.laplace import hessian_diag_estimate

    rng = np.random.default_rng(0)
    for d in (40, 700):
        B = rng.normal(size=(d, d)) / np.sqrt(d)
        H = jnp.asarray(B @ B.T + np.diag(rng.uniform(1.0, 50.0, size=d)), jnp.float32)
        est = hessian_diag_estimate(lambda z: 0.5 * z @ H @ z, jnp.zeros(d), jax.random.PRNGKey(1))
        rel = np.abs(np.asarray(est) / np.diag(np.asarray(H)) - 1.0)
        if d <= 512:
            assert rel.max() < 1e-4
        else:
            # off-diagonal mass sum_k H_ik^2 ~ 1 per row against diagonals of 1 to 50: a few per cent
            assert np.median(rel) < 0.1 and rel.max() < 0.6 and np.all(np.asarray(est) > 0)


def hierarchical_logreg(X, y=None):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    w = numpyro.sample("w", dist.Normal(0.0, s).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def test_prior_curvature_one_product_when_diagonal_exact_otherwise():
    """The diagonal-GGN prior term: ``H 1`` for independent elementwise priors (Normal weights,
    a LogNormal noise scale), the d-product diagonal for a hierarchical prior (the weights' scale
    is a site): both equal the diagonal of the dense prior Hessian."""
    from fedprob.inference.laplace import prior_curvature_diag, prior_hessian_is_diagonal

    rng = np.random.default_rng(6)
    n = 12
    X = rng.normal(size=(n, D))
    yb = (rng.random(n) < 0.5).astype(np.int32)
    with jax.enable_x64(True):
        for model, y, diagonal in ((logreg, yb, True), (linreg_learned_noise, rng.normal(size=n), True),
                                   (hierarchical_logreg, yb, False)):
            pot = Potential(model, X, y)
            assert prior_hessian_is_diagonal(pot) is diagonal
            z = jnp.asarray(rng.normal(size=pot.dim))
            dense = -np.asarray(jax.hessian(pot.log_prior)(z))
            if not diagonal:
                assert np.abs(dense - np.diag(np.diag(dense))).max() > 0.1
            np.testing.assert_allclose(prior_curvature_diag(pot, z), np.diag(dense), rtol=1e-10, atol=1e-12)
            if model is logreg:      # canonical link: the diagonal GGN is the Hessian's diagonal
                target = x64_target(X, y, n, dim=pot.dim)
                np.testing.assert_allclose(CURV(pot, target, z, "diag_ggn"),
                                           np.diag(CURV(pot, target, z, "full")), rtol=1e-9)


def test_diag_ggn_on_a_network_exact_by_cotangents_and_unbiased_by_sampled_labels():
    """A tanh MLP with 4 classes (not a canonical link): the diagonal GGN (one reverse pass per row and
    output, no Jacobian formed) equals the diagonal of the full GGN (per-row Jacobians); the Monte
    Carlo Fisher (labels drawn from the model's predictive) is unbiased for it: with 200 labels per row
    its error is within 4 of its own standard errors; the automatic rule is exact for small Jacobians."""
    import fedprob as fp
    from fedprob.inference.laplace import EXACT_GGN_MAX_JACOBIAN, fisher_sample_count, ggn_likelihood
    from fedprob.potential import get_potential, minibatch

    rng = np.random.default_rng(7)
    n, p, C = 24, 3, 4
    X = rng.normal(size=(n, p)).astype(np.float32)
    y = rng.integers(0, C, size=n).astype(np.int32)
    model = fp.models.bnn_mlp((5,), num_classes=C, activation="tanh")
    fed = FederatedData.from_clients([(X, y)], num_classes=C)
    pot = get_potential(model, fed)
    data = jax.tree_util.tree_map(lambda a: a[0], fed.client_data())
    Xb, yb, w = minibatch(None, make_target(data, pot.dim).data, None)
    z = jnp.asarray(rng.normal(size=pot.dim), jnp.float32)
    with jax.enable_x64(True):
        z64, X64, w64 = z.astype(jnp.float64), jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), Xb), \
            w.astype(jnp.float64)
        full = jax.jit(lambda z: ggn_likelihood(pot, z, X64, yb, w64, False, 8))(z64)
        exact = jax.jit(lambda z: ggn_likelihood(pot, z, X64, yb, w64, True, 8, 0, jax.random.PRNGKey(0)))(z64)
        np.testing.assert_allclose(exact, np.diag(full), rtol=1e-9, atol=1e-12)
        S = 200
        per_sample = jax.jit(lambda k: ggn_likelihood(pot, z64, X64, yb, w64, True, 8, 1, k))
        draws = np.stack([np.asarray(per_sample(jax.random.PRNGKey(i))) for i in range(S)])
        est, se = draws.mean(0), draws.std(0) / np.sqrt(S)
        big = np.asarray(exact) > 1e-3
        assert np.all(np.abs(est - exact)[big] <= 4 * se[big] + 1e-9)
        many = jax.jit(lambda k: ggn_likelihood(pot, z64, X64, yb, w64, True, 8, S, k))(jax.random.PRNGKey(1))
        assert np.median(np.abs(np.asarray(many) - exact)[big] / np.asarray(exact)[big]) < 0.1
    assert fisher_sample_count(C, pot.dim) == 0 and fisher_sample_count(1, 10 ** 9) == 0
    assert fisher_sample_count(10, EXACT_GGN_MAX_JACOBIAN) == 1 and fisher_sample_count(10, 10, 3) == 3
    with pytest.raises(ValueError, match="fisher_samples"):
        Laplace(hessian="diag_ggn", fisher_samples=-1)
