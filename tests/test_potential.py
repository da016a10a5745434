"""Oracles for fedprob.potential: minibatch scaling, gradients, padding, layout, errors.

Exact references: NumPyro's own ``potential_energy`` (the unconstrained log
joint with Jacobians), the full-data sum of log likelihoods, hand-written
closed forms (X w + b, softmax, sigmoid) and the Gaussian-term formula.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions.transforms import StickBreakingTransform
from numpyro.infer.util import potential_energy

import fedprob as fp
from fedprob.data.federated import FederatedData
from fedprob.potential import ClientData, Potential, make_target, mean_loss, minibatch


# ----------------------------------------------------------------------------- fixtures
def regression_data(n=12, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5][:d]) + 0.3 + 0.5 * rng.normal(size=n)).astype(np.float32)
    return X, y


def class_data(n=12, d=3, C=3, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, C, size=n).astype(np.int32)
    return X, y


def binary_data():
    X, y = class_data()
    return X, (y % 2).astype(np.int32)


def robust_model(X, y=None):
    """Constrained sites of several kinds: positive (sigma, nu) and a simplex (pi, 3 entries, 2 free)."""
    n, d = X.shape
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    nu = numpyro.sample("nu", dist.LogNormal(1.0, 0.5))
    pi = numpyro.sample("pi", dist.TransformedDistribution(             # logistic normal on the simplex
        dist.Normal(0.0, 1.0).expand([2]).to_event(1), StickBreakingTransform()))
    loc = X @ w + jnp.log(pi[0] / pi[1])
    with numpyro.plate("data", n):
        numpyro.sample("y", dist.StudentT(nu, loc, sigma), obs=y)


MODELS = {"linear_learned_noise": (fp.models.linear_regression(), regression_data),
          "mlp_regression": (fp.models.bnn_mlp((5,), activation="tanh"), regression_data),
          "mlp_classification": (fp.models.bnn_mlp((4, 3), num_classes=3), class_data),
          "robust_studentt_simplex": (robust_model, regression_data),
          "softmax": (fp.models.softmax_regression(3), class_data),
          "logistic": (fp.models.logistic_regression(), lambda: binary_data()),
          "linear_known_noise": (fp.models.linear_regression(noise_scale=0.3), regression_data)}


@functools.lru_cache(maxsize=None)
def potential(which):
    """Potentials built once (construction traces the model eagerly, which compiles op by op)."""
    model, data = MODELS[which]
    return Potential(model, *data())


def random_z(pot, seed=0, scale=0.5):
    return scale * jax.random.normal(jax.random.PRNGKey(seed), (pot.dim,))


# ----------------------------------------------------------------------------- 1. minibatch scaling
def test_partition_of_minibatches_sums_to_full_loglik():
    X, y = regression_data(n=12)
    pot = potential("linear_learned_noise")
    z = random_z(pot)
    n, b = 12, 4
    batches = np.random.default_rng(3).permutation(n).reshape(n // b, b)
    X, y = jnp.asarray(X), jnp.asarray(y)
    data = ClientData(X, y, jnp.asarray(n))

    @jax.jit
    def quantities(z):
        ll = jax.vmap(lambda i: pot.log_likelihood(z, X[i], y[i], jnp.full((b,), n / b)))(batches)
        target = make_target(data, pot.dim)
        return dict(batches=ll, full=pot.log_likelihood(z, X, y),
                    pointwise=pot.pointwise_log_likelihood(z, X, y), prior=pot.log_prior(z),
                    joint=pot.log_joint(z, X, y), density=pot.log_density(z, target),
                    loss=mean_loss(pot, z, target))

    q = quantities(z)
    assert q["batches"].shape == (3,) and q["pointwise"].shape == (12,)
    np.testing.assert_allclose(jnp.mean(q["batches"]), q["full"], rtol=1e-5)
    # the full-data log likelihood is the sum of the pointwise ones
    np.testing.assert_allclose(jnp.sum(q["pointwise"]), q["full"], rtol=1e-5)
    # log_density on a full batch equals log_joint = log prior + log likelihood
    np.testing.assert_allclose(q["density"], q["joint"], rtol=1e-6)
    np.testing.assert_allclose(q["joint"], q["prior"] + q["full"], rtol=1e-6)
    np.testing.assert_allclose(q["loss"], -q["joint"] / n, rtol=1e-6)


def test_minibatch_rows_and_weights():
    X, y = regression_data(n=12)
    data = ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(7))   # rows 7: are padding
    Xb, yb, w = minibatch(jax.random.PRNGKey(0), data, 64)
    assert Xb.shape == (64, 3) and yb.shape == (64,)
    np.testing.assert_allclose(w, np.full(64, 7 / 64), rtol=1e-6)
    rows = [int(np.flatnonzero(np.all(X == r, axis=1))[0]) for r in np.asarray(Xb)]
    assert max(rows) < 7 and len(set(rows)) > 3
    Xf, yf, wf = minibatch(None, data, None)
    np.testing.assert_array_equal(wf, (np.arange(12) < 7).astype(np.float32))


# ----------------------------------------------------------------------------- 2. gradients vs NumPyro
@pytest.mark.parametrize("which", ["linear_learned_noise", "mlp_regression", "mlp_classification",
                                   "robust_studentt_simplex"])
def test_log_joint_and_gradient_match_numpyro_potential_energy(which):
    pot = potential(which)
    model = pot.model
    X, y = MODELS[which][1]()
    with jax.enable_x64(True):
        X = jnp.asarray(X, jnp.float64)
        y = jnp.asarray(y, jnp.float64 if y.dtype.kind == "f" else jnp.int32)
        z = 0.7 * jax.random.normal(jax.random.PRNGKey(5), (pot.dim,), jnp.float64)

        target = make_target(ClientData(X, y, jnp.asarray(X.shape[0])), pot.dim, dtype=jnp.float64)

        def neg_energy(z):
            return -potential_energy(model, (X, y), {}, pot.unravel(z))

        @jax.jit
        def both(z):
            return (jax.value_and_grad(neg_energy)(z),
                    jax.value_and_grad(lambda z: pot.log_joint(z, X, y))(z),
                    pot.grad_log_density(z, target))

        (ref, g_ref), (v, g), (v2, g2) = both(z)
        np.testing.assert_allclose(v, ref, rtol=1e-12)
        np.testing.assert_allclose(g, g_ref, rtol=1e-10, atol=1e-10)
        # and through a LocalTarget on the full batch
        np.testing.assert_allclose(v2, ref, rtol=1e-12)
        np.testing.assert_allclose(g2, g_ref, rtol=1e-10, atol=1e-10)
        assert np.count_nonzero(g_ref) > g_ref.size // 2


# ----------------------------------------------------------------------------- 3. padding and vmap
@pytest.fixture(scope="module")
def federation():
    rng = np.random.default_rng(7)
    sizes = (5, 9, 3)
    clients = []
    for n in sizes:
        X = rng.normal(size=(n, 3)).astype(np.float32)
        y = rng.integers(0, 3, size=n)
        clients.append((X, y))
    fed = FederatedData.from_clients(clients, num_classes=3)
    pot = Potential(fp.models.softmax_regression(3), fed.X[0], fed.y[0])
    return fed, pot


def garbage_padded(fed):
    """The same federation with padded rows set to huge inputs and out-of-range labels."""
    X, y = np.array(fed.X), np.array(fed.y)
    for k, n in enumerate(fed.sizes):
        X[k, n:] = 1e6
        y[k, n:] = 99
    return ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(fed.sizes))


def test_vmapped_padded_log_density_equals_unpadded(federation):
    fed, pot = federation
    z = random_z(pot, 1)

    @jax.jit
    def per_client(z, data):
        return jax.vmap(lambda d: pot.grad_log_density(z, make_target(d, pot.dim)))(data)

    v, g = per_client(z, fed.client_data())
    assert fed.X.shape[1] == 9 and v.shape == (3,) and g.shape == (3, pot.dim)
    unpadded = jax.jit(jax.value_and_grad(pot.log_joint))
    for k in range(fed.num_clients):
        ref, gref = unpadded(z, *fed.client(k))
        np.testing.assert_allclose(v[k], ref, rtol=1e-5)
        np.testing.assert_allclose(g[k], gref, rtol=1e-4, atol=1e-5)
    # huge values / invalid labels in the padded rows change nothing
    v2, g2 = per_client(z, garbage_padded(fed))
    np.testing.assert_array_equal(v2, v)
    np.testing.assert_array_equal(g2, g)


def test_vmapped_minibatch_estimator_unbiased_and_ignores_padding(federation):
    fed, pot = federation
    z = random_z(pot, 2)
    M, b = 4000, 4
    keys = jax.random.split(jax.random.PRNGKey(0), M)

    @jax.jit
    def estimates(data):
        def one_client(d):
            t = make_target(d, pot.dim, prior_weight=0.0)
            return jax.vmap(lambda k: pot.log_density(z, t, k, batch_size=b))(keys)
        return jax.vmap(one_client)(data)

    est = estimates(fed.client_data())                          # (K, M)
    assert est.shape == (3, M)
    full = jax.jit(jax.vmap(lambda d: pot.log_density(z, make_target(d, pot.dim, prior_weight=0.0))))
    exact = np.asarray(full(fed.client_data()))
    mean, sem = est.mean(1), est.std(1) / np.sqrt(M)
    assert np.all(np.abs(mean - exact) < 4 * sem + 1e-4), (mean, exact, sem)
    assert np.all(est.std(1) > 0)
    # the same keys on garbage padding give bit-identical estimates: no padded row is drawn
    np.testing.assert_array_equal(estimates(garbage_padded(fed)), est)


# ----------------------------------------------------------------------------- 4. layout, maps, init, predict
def test_layout_follows_model_order():
    pot = potential("robust_studentt_simplex")
    assert pot.site_names == ("w", "sigma", "nu", "pi")
    shapes = {s.name: (s.shape, s.unconstrained_shape, s.offset, s.size) for s in pot.sites}
    assert shapes == {"w": ((3,), (3,), 0, 3), "sigma": ((), (), 3, 1), "nu": ((), (), 4, 1),
                      "pi": ((3,), (2,), 5, 2)}
    assert pot.dim == 7 and pot.observed == ("y",) and pot.task == "regression"
    z = jnp.arange(7.0)
    u = pot.unravel(z)
    np.testing.assert_array_equal(u["w"], [0, 1, 2])
    np.testing.assert_array_equal(u["pi"], [5, 6])
    np.testing.assert_array_equal(pot.ravel(u), z)
    mlp = potential("mlp_regression")
    assert mlp.site_names == ("W0", "b0", "W1", "b1", "sigma")
    assert [s.shape for s in mlp.sites] == [(3, 5), (5,), (5, 1), (1,), ()]


def test_constrain_unconstrain_round_trip():
    pot = potential("robust_studentt_simplex")
    z = random_z(pot, 3, scale=1.0)
    constrain, unconstrain = jax.jit(pot.constrain), jax.jit(pot.unconstrain)
    p = constrain(z)
    u = pot.unravel(z)
    np.testing.assert_allclose(p["w"], u["w"], rtol=1e-6)
    np.testing.assert_allclose(p["sigma"], jnp.exp(u["sigma"]), rtol=1e-6)
    np.testing.assert_allclose(p["nu"], jnp.exp(u["nu"]), rtol=1e-6)
    assert p["pi"].shape == (3,) and np.all(p["pi"] > 0)
    np.testing.assert_allclose(jnp.sum(p["pi"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(unconstrain(p), z, rtol=1e-5, atol=1e-5)
    q = {"w": jnp.array([1.0, 2.0, 3.0]), "sigma": jnp.array(0.5), "nu": jnp.array(4.0),
         "pi": jnp.array([0.2, 0.3, 0.5])}
    back = constrain(unconstrain(q))
    for name in q:
        np.testing.assert_allclose(back[name], q[name], rtol=1e-5)


def test_init_strategies():
    pot = potential("robust_studentt_simplex")
    np.testing.assert_array_equal(pot.init(jax.random.PRNGKey(0), "zeros"), np.zeros(pot.dim))
    a = pot.init(jax.random.PRNGKey(0))
    b = pot.init(jax.random.PRNGKey(0), "prior")
    c = pot.init(jax.random.PRNGKey(1))
    assert a.shape == (pot.dim,) and np.all(np.isfinite(a))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    p = pot.constrain(a)
    assert p["sigma"] > 0 and p["nu"] > 0
    np.testing.assert_allclose(jnp.sum(p["pi"]), 1.0, rtol=1e-6)
    # "prior" starts constrained sites at the centre of their unconstrained space (scale 1) ...
    np.testing.assert_allclose(p["sigma"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(p["pi"], np.full(3, 1 / 3), rtol=1e-5)
    # ... while "prior_full" is an honest prior draw of every site
    full = pot.constrain(pot.init(jax.random.PRNGKey(0), "prior_full"))
    np.testing.assert_array_equal(pot.init(jax.random.PRNGKey(0), "prior_full"),
                                  pot.sample_prior(jax.random.PRNGKey(0)))
    assert not np.isclose(full["sigma"], 1.0)
    real = [s.name for s in pot.sites if s.name not in ("sigma", "nu", "pi")]
    for name in real:
        np.testing.assert_array_equal(p[name], full[name])
    with pytest.raises(ValueError, match="unknown init strategy"):
        pot.init(jax.random.PRNGKey(0), "uniform")


def test_predict_classification_probabilities():
    X, _ = class_data()
    X = jnp.asarray(X)
    pot = potential("softmax")
    assert pot.task == "classification" and pot.num_classes == 3
    z = random_z(pot, 4, 1.0)
    lp = jax.jit(pot.predict)(z, X)
    assert lp.shape == (12, 3)
    np.testing.assert_allclose(jnp.exp(lp).sum(-1), np.ones(12), rtol=1e-5)
    p = pot.constrain(z)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(X @ p["W"] + p["b"]), rtol=1e-5, atol=1e-5)

    pot2 = potential("logistic")
    assert pot2.task == "classification" and pot2.num_classes == 2
    z2 = random_z(pot2, 5, 1.0)
    lp2 = jax.jit(pot2.predict)(z2, X)
    assert lp2.shape == (12, 2)
    np.testing.assert_allclose(jnp.exp(lp2).sum(-1), np.ones(12), rtol=1e-5)
    p2 = pot2.constrain(z2)
    np.testing.assert_allclose(jnp.exp(lp2[:, 1]), jax.nn.sigmoid(X @ p2["w"] + p2["b"]), rtol=1e-5)


@pytest.mark.parametrize("param", ["logits", "probs"])
def test_categorical_predict_is_log_prob_at_every_class_bit_for_bit(param):
    """A categorical's class log-probabilities are read off its normalised logits instead of scoring
    the enumerated classes (a C-fold broadcast and gather): the same numbers, bit for bit."""
    X, y = class_data()

    def model(X, y=None):
        W = numpyro.sample("W", dist.Normal(0.0, 3.0).expand([X.shape[1], 3]).to_event(2))
        with numpyro.plate("data", X.shape[0]):
            f = X @ W
            kw = {"logits": f} if param == "logits" else {"probs": jax.nn.softmax(f, -1)}
            numpyro.sample("y", dist.Categorical(**kw), obs=y)

    pot = Potential(model, X, y)
    z = random_z(pot, 4, 2.0)
    X = jnp.asarray(X)
    fn = pot.predictive_distribution(z, X)
    assert type(fn).__name__ == ("CategoricalLogits" if param == "logits" else "CategoricalProbs")
    enumerated = jnp.moveaxis(fn.log_prob(fn.enumerate_support(expand=False)), 0, -1)
    np.testing.assert_array_equal(np.asarray(pot.predict(z, X)), np.asarray(enumerated))
    np.testing.assert_array_equal(np.asarray(jax.jit(pot.predict)(z, X)),
                                  np.asarray(jax.jit(lambda z: jnp.moveaxis(
                                      pot.predictive_distribution(z, X).log_prob(jnp.arange(3)[:, None]), 0, -1))(z)))


def test_predict_regression_mean_and_variance():
    X, _ = regression_data()
    X = jnp.asarray(X)
    pot = potential("linear_learned_noise")
    z = random_z(pot, 6, 1.0)
    p = pot.constrain(z)
    mean, var = jax.jit(pot.predict)(z, X)
    assert mean.shape == (12,)
    np.testing.assert_allclose(mean, X @ p["w"] + p["b"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.broadcast_to(var, (12,)), np.full(12, p["sigma"] ** 2), rtol=1e-5)
    known = potential("linear_known_noise")
    assert known.site_names == ("w", "b")
    _, var = jax.jit(known.predict)(jnp.zeros(known.dim), X)
    np.testing.assert_allclose(jnp.broadcast_to(var, (12,)), np.full(12, 0.09), rtol=1e-5)


# ----------------------------------------------------------------------------- 5. clear errors
def _no_plate(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)


def _wrong_plate_name(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("obs", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def _observed_outside(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    numpyro.sample("extra", dist.Normal(0.0, 1.0), obs=0.0)


def _param_site(X, y=None):
    w = numpyro.param("w", jnp.zeros(X.shape[1]))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, s), obs=y)


def _latent_in_plate(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(X @ w + u, 1.0), obs=y)


def _discrete_latent(X, y=None):
    k = numpyro.sample("k", dist.Bernoulli(0.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(k * X[:, 0], 1.0), obs=y)


def _plate_no_obs(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0))


@pytest.mark.parametrize("model, match", [
    (_no_plate, "outside the plate named 'data'"),
    (_wrong_plate_name, "outside the plate named 'data'"),
    (_observed_outside, "observed site 'extra' is outside the plate named 'data'"),
    (_param_site, "site 'w' is a numpyro.param"),
    (_latent_in_plate, "latent site 'u' lies inside the 'data' plate"),
    (_discrete_latent, "latent site 'k' is discrete"),
    (_plate_no_obs, "latent site 'y' lies inside the 'data' plate"),
])
def test_clear_errors(model, match):
    X, y = regression_data(n=4)
    with pytest.raises(ValueError, match=match):
        Potential(model, X, y)


def test_error_without_any_observation_or_plate():
    def prior_only(X, y=None):
        numpyro.sample("w", dist.Normal(0, 1))
    X, y = regression_data(n=4)
    with pytest.raises(ValueError, match="no numpyro.plate named 'data'"):
        Potential(prior_only, X, y)


# ----------------------------------------------------------------------------- 6. Gaussian term and weights
@pytest.mark.parametrize("full", [False, True])
def test_local_target_gaussian_term_and_weights(full):
    X, y = regression_data()
    X, y = jnp.asarray(X), jnp.asarray(y)
    pot = potential("linear_learned_noise")
    d = pot.dim
    rng = np.random.default_rng(11)
    z = rng.normal(size=d) * 0.5
    lin = 3.0 * rng.normal(size=d)
    if full:
        A = rng.normal(size=(d, d))
        P = A @ A.T + np.eye(d)
        Pz = P @ z
    else:
        P = rng.uniform(0.5, 2.0, size=d)
        Pz = P * z
    gauss = lin @ z - 0.5 * z @ Pz                     # float64 reference of the Gaussian term
    data = ClientData(X, y, jnp.asarray(12))
    target = make_target(data, d, prior_weight=0.3, likelihood_weight=0.7, linear=lin, precision=P)
    assert target.precision.shape == ((d, d) if full else (d,))

    @jax.jit
    def quantities(z, target):
        return (pot.grad_log_density(z, target), jax.value_and_grad(pot.log_prior)(z),
                jax.value_and_grad(lambda z: pot.log_likelihood(z, X, y))(z))

    (v, g), (lp, glp), (ll, gll) = quantities(jnp.asarray(z, jnp.float32), target)
    np.testing.assert_allclose(v, 0.3 * lp + 0.7 * ll + gauss, rtol=1e-5)
    np.testing.assert_allclose(g, 0.3 * glp + 0.7 * gll + lin - Pz, rtol=1e-4, atol=1e-4)
    assert abs(lin @ z) > 0.5 and z @ Pz > 0.5      # both parts of the Gaussian term matter here
