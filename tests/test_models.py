"""The model zoo: every model through Potential (jit, vmap over padded clients, gradients),
its log joint against a float64 NumPy/SciPy transcription of the docstring's prior and
likelihood, prior scales, predictive shapes, and the conjugate linear-regression oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numpyro import handlers
from scipy import stats
from scipy.special import log_expit, log_softmax

import fedprob as fp
from fedprob.potential import ClientData, Potential, make_target

from conftest import linreg_exact_posterior

N, D, C = 20, 64, 10          # digits-like: 8x8 inputs, 10 classes


def _data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D)).astype(np.float32)
    return dict(X=X, img=X.reshape(N, 8, 8), y_reg=(X[:, 0] - 0.5 * X[:, 1] + 0.1 * rng.normal(size=N)).astype(np.float32),
                y_bin=rng.integers(0, 2, N).astype(np.int32), y_cls=rng.integers(0, C, N).astype(np.int32))


DATA = _data()

# name -> (model, X key, y key, site names in order, {site: prior std of its entries})
CASES = {
    "linear": (fp.models.linear_regression(prior_scale=2.0, noise_prior_scale=0.5), "X", "y_reg",
               ("w", "b", "sigma"), {"w": 2.0}),
    "linear_known_noise": (fp.models.linear_regression(noise_scale=0.3, bias=False), "X", "y_reg", ("w",),
                           {"w": 1.0}),
    "logistic": (fp.models.logistic_regression(prior_scale=0.5), "X", "y_bin", ("w", "b"), {"w": 0.5}),
    "softmax": (fp.models.softmax_regression(C), "X", "y_cls", ("W", "b"), {"W": 1.0, "b": 1.0}),
    # fan-in priors: W ~ N(0, 1/fan_in), b ~ N(0, 1)
    "mlp_classification": (fp.models.bnn_mlp((16,), num_classes=C, prior_scale=None), "X", "y_cls",
                           ("W0", "b0", "W1", "b1"), {"W0": 1 / 8, "b0": 1.0, "W1": 1 / 4, "b1": 1.0}),
    # the default prior: N(0, 1) on every weight and bias
    "mlp_default": (fp.models.bnn_mlp((16,), num_classes=C), "X", "y_cls", ("W0", "b0", "W1", "b1"),
                    {"W0": 1.0, "b0": 1.0, "W1": 1.0, "b1": 1.0}),
    "mlp_regression": (fp.models.bnn_mlp((16, 8), activation="tanh", prior_scale=0.7), "X", "y_reg",
                       ("W0", "b0", "W1", "b1", "W2", "b2", "sigma"),
                       {"W0": 0.7, "b0": 0.7, "W1": 0.7, "W2": 0.7}),
    # 8x8 -> conv(4) -> pool 4x4 -> conv(8) -> pool 2x2 -> 32 features -> 16 -> 10
    "cnn": (fp.models.cnn(C, channels=(4, 8), hidden=16, prior_scale=None), "img", "y_cls",
            ("conv0_W", "conv0_b", "conv1_W", "conv1_b", "W0", "b0", "W1", "b1"),
            {"conv0_W": 1 / 3, "conv0_b": 1.0, "conv1_W": 1 / 6, "W0": 1 / np.sqrt(32), "W1": 1 / 4}),
}


# ----------------------------------------------------------------------------- float64 references
def _conv_same(x, W):
    """Cross-correlation with SAME padding, NHWC x HWIO -> NHWC."""
    k = W.shape[0]
    p = (k - 1) // 2
    xp = np.pad(x, ((0, 0), (p, k - 1 - p), (p, k - 1 - p), (0, 0)))
    H, Wd = x.shape[1:3]
    out = np.zeros(x.shape[:3] + (W.shape[3],))
    for a in range(k):
        for b in range(k):
            out += np.einsum("nhwc,co->nhwo", xp[:, a:a + H, b:b + Wd], W[a, b])
    return out


def _maxpool(x):
    n, H, W, c = x.shape
    x = x[:, :H // 2 * 2, :W // 2 * 2]
    return x.reshape(n, H // 2, 2, W // 2, 2, c).max(axis=(2, 4))


def reference_log_joint(name, p, X, y):
    """The prior (with the log-Jacobian of sigma = exp(z)) plus likelihood as the docstrings state them."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    X = np.asarray(X, np.float64)
    lp = 0.0

    def normal(site, std):
        return stats.norm.logpdf(p[site], 0.0, std).sum()

    def dense(h, l, iso=None):
        nonlocal lp
        fan_in = p[f"W{l}"].shape[0]
        lp += normal(f"W{l}", iso or 1 / np.sqrt(fan_in)) + normal(f"b{l}", iso or 1.0)
        return h @ p[f"W{l}"] + p[f"b{l}"]

    def halfnormal_sigma(scale):
        return stats.halfnorm.logpdf(p["sigma"], scale=scale) + np.log(p["sigma"])

    if name == "linear":
        lp += normal("w", 2.0) + normal("b", 2.0) + halfnormal_sigma(0.5)
        return lp + stats.norm.logpdf(y, X @ p["w"] + p["b"], p["sigma"]).sum()
    if name == "linear_known_noise":
        return normal("w", 1.0) + stats.norm.logpdf(y, X @ p["w"], 0.3).sum()
    if name == "logistic":
        logit = X @ p["w"] + p["b"]
        return normal("w", 0.5) + normal("b", 0.5) + np.sum(y * log_expit(logit) + (1 - y) * log_expit(-logit))
    if name == "softmax":
        logits = X @ p["W"] + p["b"]
        return normal("W", 1.0) + normal("b", 1.0) + log_softmax(logits, -1)[np.arange(len(y)), y].sum()
    if name in ("mlp_classification", "mlp_default"):
        iso = 1.0 if name == "mlp_default" else None
        logits = dense(np.maximum(dense(X, 0, iso), 0), 1, iso)
        return lp + log_softmax(logits, -1)[np.arange(len(y)), y].sum()
    if name == "mlp_regression":
        h = np.tanh(dense(np.tanh(dense(X, 0, 0.7)), 1, 0.7))
        mean = dense(h, 2, 0.7)[:, 0]
        lp += halfnormal_sigma(1.0)
        return lp + stats.norm.logpdf(y, mean, p["sigma"]).sum()
    if name == "cnn":
        h = X.reshape(X.shape[0], 8, 8, 1)
        for l in range(2):
            W, b = p[f"conv{l}_W"], p[f"conv{l}_b"]
            lp += normal(f"conv{l}_W", 1 / np.sqrt(np.prod(W.shape[:3]))) + normal(f"conv{l}_b", 1.0)
            h = _maxpool(np.maximum(_conv_same(h, W) + b, 0))
        h = h.reshape(h.shape[0], -1)
        logits = dense(np.maximum(dense(h, 0), 0), 1)
        return lp + log_softmax(logits, -1)[np.arange(len(y)), y].sum()
    raise KeyError(name)


# ----------------------------------------------------------------------------- every model
@pytest.mark.parametrize("name", list(CASES))
def test_model_through_potential(name):
    model, xkey, ykey, sites, prior_std = CASES[name]
    X, y = DATA[xkey], DATA[ykey]
    pot = Potential(model, X, y)
    assert pot.site_names == sites
    assert pot.task == ("regression" if ykey == "y_reg" else "classification")
    # two padded clients (20 and 13 rows) under one jitted vmap
    data = ClientData(jnp.stack([X, X]), jnp.stack([y, y]), jnp.array([N, 13]))
    keys = jax.random.split(jax.random.PRNGKey(1), 2)

    @jax.jit
    def run(data, keys, init_keys):
        draws = jax.lax.map(pot.sample_prior, init_keys)      # prior draws
        z = draws[0]

        def client(d, k):
            t = make_target(d, pot.dim)
            return pot.grad_log_density(z, t), pot.grad_log_density(z, t, k, batch_size=8)
        full, mini = jax.vmap(client)(data, keys)
        return dict(full=full, mini=mini, joint13=pot.log_joint(z, data.X[1, :13], data.y[1, :13]),
                    params=pot.constrain(z), pred=pot.predict(z, data.X[0]), draws=jax.vmap(pot.unravel)(draws))

    out = run(data, keys, jax.random.split(jax.random.PRNGKey(3), 16))
    (v, g), (vm, gm) = out["full"], out["mini"]
    assert v.shape == (2,) and g.shape == (2, pot.dim) and vm.shape == (2,)
    for a in (v, g, vm, gm):
        assert np.all(np.isfinite(a))
    np.testing.assert_allclose(v[1], out["joint13"], rtol=1e-5)

    # the log joint is the docstring's prior and likelihood (float64 reference)
    params = out["params"]
    assert {k: v.shape for k, v in params.items()} == {s.name: s.shape for s in pot.sites}
    ref = [reference_log_joint(name, params, X, y), reference_log_joint(name, params, X[:13], y[:13])]
    np.testing.assert_allclose(v, ref, rtol=2e-5, atol=1e-3)

    # predictive shapes and normalisation
    if pot.task == "classification":
        k = 2 if ykey == "y_bin" else C
        assert pot.num_classes == k and out["pred"].shape == (N, k)
        np.testing.assert_allclose(jnp.exp(out["pred"]).sum(-1), np.ones(N), rtol=1e-5)
    else:
        mean, var = out["pred"]
        assert mean.shape == (N,) and np.all(np.asarray(var) > 0)
        assert jnp.broadcast_to(var, (N,)).shape == (N,)

    # 16 prior draws have the stated scale (the checked sites have real support: z = value)
    for site, std in prior_std.items():
        a = np.asarray(out["draws"][site]).ravel()
        tol = 5 / np.sqrt(2 * a.size)             # 5 standard errors of a sample std
        assert abs(a.std() / std - 1) < tol, (site, a.std(), std)
        assert abs(a.mean()) < 5 * std / np.sqrt(a.size), (site, a.mean())


def _abstract_sites(model, X, y):
    """{site: shape} of a model's sample sites by abstract evaluation (nothing is compiled)."""
    shapes = {}

    def f():
        tr = handlers.trace(handlers.seed(model, 0)).get_trace(X, y)
        shapes.update({k: v["value"].shape for k, v in tr.items() if v["type"] == "sample"})
        return 0

    jax.eval_shape(f)
    return shapes


def test_input_shapes_and_mnist_sized_cnn():
    # the MLP flattens trailing dims: 8x8 images in, (64, 16) first layer
    assert _abstract_sites(fp.models.bnn_mlp((16,), num_classes=C), DATA["img"], DATA["y_cls"])["W0"] == (64, 16)
    # the CNN on MNIST-sized images in all three input formats
    expected = {"conv0_W": (3, 3, 1, 8), "conv0_b": (8,), "conv1_W": (3, 3, 8, 16), "conv1_b": (16,),
                "W0": (7 * 7 * 16, 64), "b0": (64,), "W1": (64, C), "b1": (C,), "y": (4,)}
    y = np.zeros(4, np.int32)
    for X in (np.zeros((4, 28, 28), np.float32), np.zeros((4, 28, 28, 1), np.float32),
              np.zeros((4, 784), np.float32)):
        assert _abstract_sites(fp.models.cnn(C), X, y) == expected
    flat = _abstract_sites(fp.models.cnn(C, image_shape=(8, 8, 1)), DATA["X"], DATA["y_cls"])
    assert flat["conv0_W"] == (3, 3, 1, 8) and flat["W0"] == (2 * 2 * 16, 64)


@pytest.mark.parametrize("factory, kwargs, match", [
    (fp.models.linear_regression, dict(prior_scale=-1.0), "prior_scale"),
    (fp.models.linear_regression, dict(noise_scale=0.0), "noise_scale"),
    (fp.models.logistic_regression, dict(prior_scale="big"), "prior_scale"),
    (fp.models.softmax_regression, dict(num_classes=1), "num_classes"),
    (fp.models.bnn_mlp, dict(activation="relux"), "unknown activation"),
    (fp.models.bnn_mlp, dict(hidden_sizes=(10, 0)), "hidden_sizes"),
    (fp.models.bnn_mlp, dict(num_classes=2.5), "num_classes"),
    (fp.models.cnn, dict(num_classes=10, pool="median"), "pool"),
    (fp.models.cnn, dict(num_classes=10, kernel_size=0), "kernel_size"),
])
def test_bad_arguments(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="image_shape"):
        Potential(fp.models.cnn(C), np.zeros((4, 50), np.float32), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="does not hold images"):
        Potential(fp.models.cnn(C, image_shape=(7, 7)), np.zeros((4, 64), np.float32), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="too small to pool"):
        _abstract_sites(fp.models.cnn(C, channels=(2, 2, 2, 2)), DATA["img"], DATA["y_cls"])
    with pytest.raises(ValueError, match="X must have shape"):
        _abstract_sites(fp.models.bnn_mlp(), np.zeros(4, np.float32), None)
    for model in (fp.models.linear_regression(), fp.models.bnn_mlp((4,)), fp.models.cnn(C)):
        with pytest.raises(ValueError, match=r"y must have shape \(20,\)"):
            _abstract_sites(model, DATA["img"], DATA["y_reg"][:, None])


# ----------------------------------------------------------------------------- conjugate oracle
def test_linear_regression_map_matches_closed_form_posterior_mean():
    rng = np.random.default_rng(4)
    n, d, sigma, prior_scale = 50, 3, 0.5, 1.5
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + 0.7 + sigma * rng.normal(size=n)).astype(np.float32)
    pot = Potential(fp.models.linear_regression(noise_scale=sigma, prior_scale=prior_scale), X, y)
    assert pot.site_names == ("w", "b") and pot.dim == d + 1
    mean, cov = linreg_exact_posterior([np.c_[X, np.ones(n)]], [y], sigma, prior_scale)

    steps = 300
    opt = optax.adam(optax.cosine_decay_schedule(0.1, steps, 1e-3))
    loss = lambda z: -pot.log_joint(z, X, y) / n

    @jax.jit
    def fit(z):
        def step(carry, _):
            z, s = carry
            g = jax.grad(loss)(z)
            u, s = opt.update(g, s, z)
            return (optax.apply_updates(z, u), s), None
        return jax.lax.scan(step, (z, opt.init(z)), None, length=steps)[0][0]

    z = fit(jnp.zeros(pot.dim))
    p = pot.constrain(z)
    est = np.r_[np.asarray(p["w"]), np.asarray(p["b"])[None]]
    np.testing.assert_allclose(est, mean, rtol=1e-4)
    # and the known-noise log joint has the conjugate posterior's curvature: -Hessian = precision
    H = jax.jit(jax.hessian(lambda z: pot.log_joint(z, X, y)))(z)
    np.testing.assert_allclose(-np.asarray(H), np.linalg.inv(cov), rtol=1e-4)


# ----------------------------------------------------------------------------- real MNIST (slow)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "bnn_mlp"])
def test_mnist_map_training_reaches_accuracy(name, data_root):
    """Maximum likelihood by minibatch Adam on 2,000 MNIST images reaches > 85% test accuracy.

    prior_weight=0 tests the network and its likelihood on real data; with the full
    fan-in prior (precision fan_in per weight) the MAP on 2,000 images is heavily
    shrunk (about 0.7 / 0.8 for MLP / CNN).
    """
    ds = fp.data.load_mnist(data_root)                     # flat (n, 784) in [0, 1]
    X, y = ds.X_train[:2000], ds.y_train[:2000]
    model = fp.models.cnn(10) if name == "cnn" else fp.models.bnn_mlp((100,), num_classes=10)
    pot = Potential(model, X, y)
    target = make_target(ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(2000)), pot.dim,
                         prior_weight=0.0)
    opt = optax.adam(1e-3)
    loss = lambda z, k: -pot.log_density(z, target, k, batch_size=64) / 2000

    @jax.jit
    def fit(z, key):
        def step(carry, k):
            z, s = carry
            u, s = opt.update(jax.grad(loss)(z, k), s, z)
            return (optax.apply_updates(z, u), s), None
        return jax.lax.scan(step, (z, opt.init(z)), jax.random.split(key, 400))[0][0]

    z = fit(pot.init(jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
    logp = jax.jit(pot.predict)(z, jnp.asarray(ds.X_test[:1000]))
    assert logp.shape == (1000, 10)
    acc = float(jnp.mean(jnp.argmax(logp, -1) == ds.y_test[:1000]))
    assert acc > 0.85, acc


@pytest.mark.parametrize("pool", ["max", "avg"])
def test_pooling_2x2_drops_odd_edges(pool):
    from fedprob.models.cnn import pool2x2
    h = np.arange(2 * 5 * 4 * 3, dtype=np.float32).reshape(2, 5, 4, 3)
    blocks = h[:, :4].reshape(2, 2, 2, 2, 2, 3)
    ref = blocks.max((2, 4)) if pool == "max" else blocks.mean((2, 4))
    np.testing.assert_allclose(pool2x2(jnp.asarray(h), pool), ref)


# ----------------------------------------------------------------------------- initialisation
@pytest.mark.parametrize("prior_scale", [None, 1.0, 5.0])
def test_network_start_is_separate_from_the_prior(prior_scale):
    """Weights start at LeCun scale 1/sqrt(fan_in) and biases at 0 whatever the prior, under both
    "center" (point estimates) and "prior" (samplers); distinct keys break the hidden-unit symmetry."""
    X = np.zeros((2, 64), np.float32)
    pot = Potential(fp.models.bnn_mlp((200,), num_classes=10, prior_scale=prior_scale), X, np.zeros(2, np.int32))
    for strategy in ("center", "prior"):
        p = pot.constrain(pot.init(jax.random.PRNGKey(0), strategy))
        assert abs(float(p["W0"].std()) * 8.0 - 1) < 0.05                   # 1/sqrt(64)
        assert abs(float(p["W1"].std()) * np.sqrt(200) - 1) < 0.1
        if strategy == "center":
            assert float(jnp.abs(p["b0"]).max()) == 0.0 and float(jnp.abs(p["b1"]).max()) == 0.0
        # hidden units differ (an all-zero start would leave them identical forever)
        assert float(jnp.min(jnp.std(p["W0"], axis=0))) > 0.05
    z0, z1 = pot.init(jax.random.PRNGKey(0), "center"), pot.init(jax.random.PRNGKey(1), "center")
    assert float(jnp.max(jnp.abs(z0 - z1))) > 0.1
    # an explicit init_scale, and the prior itself unchanged by it
    pot2 = Potential(fp.models.bnn_mlp((200,), num_classes=10, prior_scale=prior_scale, init_scale=0.3), X,
                     np.zeros(2, np.int32))
    assert abs(float(pot2.constrain(pot2.init(jax.random.PRNGKey(0), "center"))["W0"].std()) / 0.3 - 1) < 0.05
    draws = pot.constrain(pot.sample_prior(jax.random.PRNGKey(2)))["W0"]
    assert abs(float(draws.std()) / (1 / 8 if prior_scale is None else prior_scale) - 1) < 0.05


def test_cnn_start_is_separate_from_the_prior():
    img = np.zeros((2, 8, 8), np.float32)
    pot = Potential(fp.models.cnn(10, channels=(4, 8), hidden=16), img, np.zeros(2, np.int32))
    p = pot.constrain(pot.init(jax.random.PRNGKey(0), "center"))
    assert abs(float(p["conv1_W"].std()) * np.sqrt(9 * 4) - 1) < 0.15      # 1/sqrt(k*k*C_in)
    assert float(jnp.abs(p["conv0_b"]).max()) == 0.0
    assert abs(float(pot.constrain(pot.sample_prior(jax.random.PRNGKey(1)))["conv1_W"].std()) - 1) < 0.15


@pytest.mark.slow
def test_mnist_map_with_the_default_prior_is_not_shrunk(data_root):
    """The full posterior (prior weight 1) MAP on 2,000 MNIST images: the default N(0, 1) prior leaves
    the network free (measured 0.882), the fan-in prior shrinks it (measured 0.727)."""
    ds = fp.data.load_mnist(data_root)
    X, y = ds.X_train[:2000], ds.y_train[:2000]
    accs = {}
    for name, ps in (("default", 1.0), ("fan_in", None)):
        pot = Potential(fp.models.bnn_mlp((100,), num_classes=10, prior_scale=ps), X, y)
        target = make_target(ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(2000)), pot.dim)
        opt = optax.adam(1e-3)
        loss = lambda z, k, pot=pot, target=target: -pot.log_density(z, target, k, batch_size=64) / 2000

        @jax.jit
        def fit(z, key, loss=loss):
            def step(carry, k):
                z, s = carry
                u, s = opt.update(jax.grad(loss)(z, k), s, z)
                return (optax.apply_updates(z, u), s), None
            return jax.lax.scan(step, (z, opt.init(z)), jax.random.split(key, 400))[0][0]

        z = fit(pot.init(jax.random.PRNGKey(0), "center"), jax.random.PRNGKey(1))
        logp = jax.jit(pot.predict)(z, jnp.asarray(ds.X_test[:1000]))
        accs[name] = float(jnp.mean(jnp.argmax(logp, -1) == ds.y_test[:1000]))
    assert accs["default"] > 0.85 and accs["default"] > accs["fan_in"] + 0.05, accs
