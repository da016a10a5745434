"""The Laplace-marginal of a client's global block against the closed-form marginal of a hierarchical
scale: y_i ~ N(a, 1), a ~ N(mu, sigma^2) local, so ybar ~ N(mu, sigma^2 + 1/n) once a is integrated."""
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from fedprob.inference import laplace_marginal as lm
from fedprob.inference.laplace import Laplace
from fedprob.local_sites import split_joint
from fedprob.potential import ClientData, Potential, make_target


def scale_model(X, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    a = numpyro.sample("a", dist.Normal(mu, sigma), infer={"local": True})
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(a + 0.0 * X[:, 0], 1.0), obs=y)


@pytest.fixture(scope="module")
def client():
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(3)
    n = 6
    y = 1.5 + rng.normal(size=n)
    X = np.zeros((n, 1))
    pot = Potential(scale_model, X, y)
    data = ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(n))
    target = make_target(data, pot.dim, prior_weight=1.0)
    start = jnp.zeros(pot.dim)
    out = jax.jit(lambda s: lm.laplace_marginal(pot, target, s))(start)
    yield pot, target, y, out
    jax.config.update("jax_enable_x64", False)


def exact_log_marginal(g, y):
    """log p(mu, log sigma) + log N(y | mu, I + sigma^2 11') in unconstrained (mu, log sigma), with the
    Jacobian of the log transform (the potential's coordinates)."""
    mu, s = g[0], g[1]
    sigma = jnp.exp(s)
    n = y.shape[0]
    cov = jnp.eye(n) + sigma ** 2 * jnp.ones((n, n))
    lik = jax.scipy.stats.multivariate_normal.logpdf(y, mu * jnp.ones(n), cov)
    prior = jax.scipy.stats.norm.logpdf(mu, 0.0, 2.0) + jax.scipy.stats.norm.logpdf(s, 0.0, 1.0)
    return lik + prior


def test_mode_and_curvature_equal_the_exact_marginal(client):
    pot, target, y, (g_gauss, mode, cond, diag) = client
    y = jnp.asarray(y)
    f = lambda g: exact_log_marginal(g, y)
    newton = jax.jit(lambda g: g - jnp.linalg.solve(jax.hessian(f)(g), jax.grad(f)(g)))
    g = jnp.zeros(2)
    for _ in range(50):                                  # Newton on the closed form (one compiled step)
        g = newton(g)
    P = -jax.jit(jax.hessian(f))(g)
    np.testing.assert_allclose(g_gauss.mean(), g, atol=1e-6)
    np.testing.assert_allclose(g_gauss.precision, P, rtol=1e-4, atol=1e-6)
    assert float(diag["grad_norm"]) < 1e-5 and int(diag["num_clipped"]) == 0


def test_local_conditional_is_the_exact_one(client):
    pot, target, y, (g_gauss, mode, cond, diag) = client
    n, ybar = len(y), float(np.mean(y))

    def post_mean(g):
        prec = n + jnp.exp(-2 * g[1])
        return (n * ybar + g[0] * jnp.exp(-2 * g[1])) / prec

    g = g_gauss.mean()
    np.testing.assert_allclose(cond.mean[0], post_mean(g), rtol=1e-6)
    np.testing.assert_allclose(cond.slope[0], jax.grad(post_mean)(g), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(cond.cov[0, 0], 1.0 / (n + np.exp(-2 * float(g[1]))), rtol=1e-6)


def test_the_joint_laplace_misses_the_scale_normalizer(client):
    """The Schur complement at the joint mode is the profile's curvature: its scale is far off the
    exact marginal's (why the marginal is the default for Laplace clients with local sites)."""
    pot, target, y, (g_gauss, *_rest) = client
    # jitted: one compile instead of running the search op by op (10 s eager, loaded 2-core machine)
    res = jax.jit(lambda k, z: Laplace(hessian="full").run(k, pot, target, z))(jax.random.PRNGKey(0),
                                                                               jnp.zeros(pot.dim))
    marginal, _ = split_joint(res.posterior, res.params, pot.dim_global)
    assert abs(float(marginal.mean()[1] - g_gauss.mean()[1])) > 0.3


def test_applies_only_to_small_blocks_with_local_sites(client):
    pot = client[0]
    assert lm.applies(pot)

    def no_local(X, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu + 0.0 * X[:, 0], 1.0), obs=y)

    assert not lm.applies(Potential(no_local, np.zeros((2, 1)), np.zeros(2)))
    with pytest.raises(ValueError, match="local must be"):
        Laplace(local="profile")
