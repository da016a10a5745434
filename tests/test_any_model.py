"""NumPyro programs beyond the built-in models: integer inputs, inputs that carry scales,
likelihoods without a closed-form GGN, deterministic sites and factor likelihoods.

Oracles: pooled NUTS (numpyro's own, on the pooled rows), the exact Hessian, and values
computed by hand from the draws.
"""
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS

import fedprob as fp
from fedprob.potential import Potential, make_target
from fedprob.inference.laplace import curvature, ggn_supported
from fedprob.models.examples import NUM_GROUPS, binomial_groups, factor_poisson, known_scales

G = NUM_GROUPS


def robust_masked(X, y=None):
    """Student-t regression whose likelihood is masked where column 1 is 0."""
    w = numpyro.sample("w", dist.Normal(0.0, 3.0))
    b = numpyro.sample("b", dist.Normal(0.0, 3.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    numpyro.deterministic("sigma2", sigma ** 2)
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(4.0, w * X[:, 0] + b, sigma).mask(X[:, 1] > 0), obs=y)


def poisson_glm(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(w * X[:, 0])), obs=y)


def _binomial_data(seed=0, n=240):
    rng = np.random.default_rng(seed)
    g = rng.integers(0, G, n)
    total = rng.integers(5, 20, n)
    p = 1 / (1 + np.exp(-np.array([-1.0, 0.3, 1.2])[g]))
    y = rng.binomial(total, p)
    return np.stack([g, total], 1).astype(np.int64), y.astype(np.int64)


def _pooled_nuts(model, X, y, seed=0):
    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), jnp.asarray(X), jnp.asarray(y))
    return mcmc.get_samples()


def test_integer_inputs_stay_integer_and_index_the_model():
    X, y = _binomial_data()
    fed = fp.data.partition(X, y, num_clients=4, seed=0)
    assert np.issubdtype(fed.X.dtype, np.integer) and np.issubdtype(fed.y.dtype, np.integer)
    res = fp.run(fp.algorithms.PVI(), binomial_groups, fed, seed=0, progress=False)
    draws = res.posterior.sample(jax.random.PRNGKey(1), 2000)["a"]
    ref = _pooled_nuts(binomial_groups, X, y)["a"]
    sd = np.asarray(ref.std(0))
    assert np.all(np.abs(np.asarray(draws.mean(0) - ref.mean(0))) < 0.5 * sd)
    assert np.all((np.asarray(draws.std(0)) / sd > 0.7) & (np.asarray(draws.std(0)) / sd < 1.4))


def test_model_traced_at_real_rows_not_zeros():
    rng = np.random.default_rng(1)
    X = np.stack([np.zeros(30), rng.uniform(0.5, 2.0, 30)], 1).astype(np.float32)
    y = (3.0 + X[:, 1] * rng.standard_normal(30)).astype(np.float32)
    pot = Potential(known_scales, X, y)
    # an all-zeros row would give Normal(mu, 0): NaN log densities and a failed validation
    z = pot.init(jax.random.PRNGKey(0), "prior_full")
    assert np.isfinite(float(pot.log_prior(z)))
    assert set(pot.constrain(z)) == {"mu"}
    fed = fp.data.partition(X, y, num_clients=3, seed=0)
    res = fp.run(fp.algorithms.PVI(), known_scales, fed, seed=0, progress=False)
    w = 1 / X[:, 1] ** 2                        # the conjugate posterior of mu (prior N(0, 10^2))
    prec = w.sum() + 1 / 100.0
    mean, sd = (w * y).sum() / prec, prec ** -0.5
    got = res.posterior.mean["mu"]
    assert abs(float(got) - mean) < 0.05 * sd


def test_laplace_without_closed_form_ggn_uses_the_exact_hessian():
    rng = np.random.default_rng(2)
    X = np.stack([rng.standard_normal(50), (rng.uniform(size=50) > 0.2)], 1).astype(np.float32)
    y = (0.5 * X[:, 0] + 1 + 0.7 * rng.standard_t(4, 50)).astype(np.float32)
    pot = Potential(robust_masked, X, y)
    assert not ggn_supported(pot) and not ggn_supported(Potential(factor_poisson, X[:, :1], y))
    assert not ggn_supported(Potential(binomial_groups, *_binomial_data(n=10)))
    assert ggn_supported(Potential(poisson_glm, X[:, :1], np.round(np.abs(y))))
    from fedprob.potential import ClientData
    target = make_target(ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(50)), pot.dim)
    z = jnp.array([0.4, 0.9, -0.2])
    np.testing.assert_allclose(curvature(pot, target, z, "ggn"), curvature(pot, target, z, "full"),
                               rtol=1e-5)
    np.testing.assert_allclose(curvature(pot, target, z, "diag_ggn"),
                               jnp.diagonal(curvature(pot, target, z, "full")), rtol=1e-5)


def test_robust_masked_model_and_its_deterministic_site():
    rng = np.random.default_rng(3)
    n = 200
    X = np.stack([rng.standard_normal(n), (rng.uniform(size=n) > 0.2)], 1).astype(np.float32)
    y = (0.5 * X[:, 0] + 1 + 0.7 * rng.standard_t(4, n)).astype(np.float32)
    fed = fp.data.partition(X, y, num_clients=4, seed=0)
    res = fp.run(fp.algorithms.PVI(), robust_masked, fed, seed=0, progress=False)
    draws = res.posterior.sample(jax.random.PRNGKey(1), 4000)
    np.testing.assert_allclose(draws["sigma2"], draws["sigma"] ** 2, rtol=1e-5)
    assert "sigma2" in res.posterior.mean
    ref = _pooled_nuts(robust_masked, X, y)
    for site in ("w", "b", "sigma"):
        sd = float(ref[site].std())
        assert abs(float(draws[site].mean() - ref[site].mean())) < 0.5 * sd, site
        assert 0.7 < float(draws[site].std()) / sd < 1.4, site
    idata = res.to_arviz(num_draws=50, num_chains=2)
    assert "sigma2" in idata.posterior


def test_factor_likelihood_runs_under_laplace_and_predictive_bayes_refuses_it():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(200).astype(np.float32)
    y = rng.poisson(np.exp(0.4 * x + 0.5)).astype(np.float32)
    fed = fp.data.partition(x[:, None], y, num_clients=4, seed=0)
    res = fp.run(fp.algorithms.PVI(), factor_poisson, fed, seed=0, progress=False)
    ref = _pooled_nuts(factor_poisson, x[:, None], y)
    draws = res.posterior.sample(jax.random.PRNGKey(1), 4000)
    for site in ("w", "b"):
        sd = float(ref[site].std())
        assert abs(float(draws[site].mean() - ref[site].mean())) < 0.5 * sd, site
        assert 0.7 < float(draws[site].std()) / sd < 1.4, site
    with pytest.raises(ValueError, match="numpyro.factor"):
        fp.run(fp.algorithms.PredictiveBayes(), factor_poisson, fed, seed=0, progress=False)


# -- several inputs: a tuple or dict of arrays, each its own dtype ----------------------------------

def admissions(dept, male, apps, admit=None):
    """The UC Berkeley admissions regression as NumPyro writes it: three inputs, integer totals."""
    a = numpyro.sample("a", dist.Normal(0.0, 2.0).expand([3]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", dept.shape[0]):
        numpyro.sample("admit", dist.Binomial(apps, logits=a[dept] + b * male), obs=admit)


def _admissions_data(n=90, seed=0):
    rng = np.random.default_rng(seed)
    dept = rng.integers(0, 3, n)
    male = rng.integers(0, 2, n).astype(np.float32)
    apps = rng.integers(5, 50, n)
    admit = rng.binomial(apps, 1 / (1 + np.exp(-(np.array([-1.0, 0.0, 1.0])[dept] + 0.3 * male))))
    return dept, male, apps, admit


def test_tuple_and_dict_inputs_keep_their_dtypes_and_match_pooled_nuts():
    dept, male, apps, admit = _admissions_data()
    fed = fp.data.partition((dept, male, apps), admit, num_clients=3, seed=0)
    assert [a.dtype for a in fed.X] == [np.int32, np.float32, np.int32]
    # a full covariance: a and b are correlated, and a diagonal Gaussian's marginal sds are ~0.67x
    r = fp.run(fp.algorithms.PVI(family="full"), admissions, fed, progress=False,
               eval_data=((dept, male, apps), admit))
    mc = MCMC(NUTS(admissions), num_warmup=300, num_samples=1000, progress_bar=False)
    mc.run(jax.random.PRNGKey(0), dept, male, apps, admit)
    ref = mc.get_samples()
    for name in ("a", "b"):
        z = np.abs(np.asarray(r.posterior.mean[name]) - np.asarray(ref[name].mean(0))) / np.asarray(ref[name].std(0))
        assert np.all(z < 0.5), (name, z)
        ratio = np.asarray(r.posterior.sd[name]) / np.asarray(ref[name].std(0))
        assert np.all((ratio > 0.7) & (ratio < 1.4)), (name, ratio)
    assert np.isfinite(r.history[-1]["rmse"])
    # the same inputs by name give the same answer
    fed_d = fp.data.partition({"dept": dept, "male": male, "apps": apps}, admit, num_clients=3, seed=0)
    r_d = fp.run(fp.algorithms.PVI(family="full"), admissions, fed_d, progress=False)
    np.testing.assert_allclose(r_d.posterior.mean["a"], r.posterior.mean["a"], rtol=1e-5, atol=1e-6)
    mean, var = r.posterior.predict((dept[:4], male[:4], apps[:4]))
    assert mean.shape == (4,) and np.all(np.asarray(var) > 0)
    with pytest.raises(ValueError, match="rows of shape|one array|inputs"):
        r.posterior.predict(np.zeros((4, 3)))
    # from_clients takes the same structure per client
    fed_c = fp.data.FederatedData.from_clients([((dept[:30], male[:30], apps[:30]), admit[:30]),
                                                ((dept[30:], male[30:], apps[30:]), admit[30:])])
    assert fed_c.client_sizes.tolist() == [30, 60] and fed_c.X[0].dtype == np.int32
    with pytest.raises(ValueError, match="different numbers of rows"):
        fp.data.partition((dept, male[:10], apps), admit, num_clients=3)


def test_a_plate_sized_from_the_data_gets_a_model_argument_hint():
    def grouped(X, y=None):
        num_groups = int(X[:, 0].max()) + 1          # read from the rows: one client holds only some groups
        with numpyro.plate("groups", num_groups):
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(a[X[:, 0]], 1.0), obs=y)

    X = np.stack([np.arange(12) % 4, np.zeros(12, int)], 1)
    fed = fp.data.partition(X, np.zeros(12, np.float32), num_clients=2, seed=0)
    with pytest.raises(ValueError, match="model argument") as e:
        fp.run(fp.algorithms.PVI(), grouped, fed, progress=False)
    assert "model_kwargs" in str(e.value)
