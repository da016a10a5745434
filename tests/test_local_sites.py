"""Client-local sites (infer={"local": True}): the contract in the potential, PVI with Laplace clients
against the exact posterior of a conjugate normal-normal hierarchy, the refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedprob as fp
from fedprob.algorithms import PVI
from fedprob.inference import Laplace
from fedprob.potential import Potential

PRIOR_SD, TAU = 3.0, 0.7
SIZES = (3, 5, 8, 12, 17, 24, 31, 40)


def normal_normal(X, y=None):
    """mu ~ N(0, 3^2); a_k ~ N(0, 0.7^2) on each client; y ~ N(mu + a_k, 1)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    a = numpyro.sample("a", dist.Normal(0.0, TAU), infer={"local": True})
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(mu + a + 0.0 * X[:, 0], 1.0), obs=y)


def federation(seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(0.0, TAU, len(SIZES))
    clients = [(np.zeros((n, 1)), 1.3 + a[k] + rng.normal(size=n)) for k, n in enumerate(SIZES)]
    return fp.data.FederatedData.from_clients(clients, dtype=np.float64), clients


def exact_joint(clients):
    """Mean and covariance of (mu, a_1..a_K) by a dense Gaussian solve of the joint."""
    K = len(clients)
    P = np.zeros((K + 1, K + 1))
    b = np.zeros(K + 1)
    P[0, 0] = PRIOR_SD ** -2
    for k, (_, y) in enumerate(clients):
        n = len(y)
        P[0, 0] += n
        P[k + 1, k + 1] = TAU ** -2 + n
        P[0, k + 1] = P[k + 1, 0] = n
        b[0] += y.sum()
        b[k + 1] = y.sum()
    cov = np.linalg.inv(P)
    return cov @ b, cov


def test_closed_form_agrees_with_the_dense_solve():
    _, clients = federation()
    mean, cov = exact_joint(clients)
    # ybar_k ~ N(mu, tau^2 + 1/n_k) times the prior on mu
    v = np.array([TAU ** 2 + 1.0 / len(y) for _, y in clients])
    ybar = np.array([y.mean() for _, y in clients])
    prec = PRIOR_SD ** -2 + np.sum(1 / v)
    np.testing.assert_allclose(mean[0], np.sum(ybar / v) / prec, rtol=1e-12)
    np.testing.assert_allclose(cov[0, 0], 1 / prec, rtol=1e-12)


def test_potential_puts_global_sites_first_and_splits_the_prior():
    def model(X, y=None):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0).expand([2]).to_event(1), infer={"local": True})
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu + a[0] + a[1] * X[:, 0], s), obs=y)

    pot = Potential(model, np.ones((3, 1)), np.ones(3))
    assert pot.site_names == ("mu", "s", "a") and pot.local_sites == ("a",)
    assert (pot.dim_global, pot.dim_local, pot.dim) == (2, 2, 4)
    z = jnp.array([0.3, -0.2, 0.5, -1.0])
    full = pot.log_prior(z)
    glob = pot.log_prior_global(z[:2])
    local = dist.Normal(0.0, 1.0).log_prob(z[2:]).sum()
    np.testing.assert_allclose(full, glob + local, rtol=1e-6)
    # the prior share acts on the global block only; p(local | global) stays whole
    X, y = jnp.ones((3, 1)), jnp.array([0.1, 0.4, -0.3])
    data = fp.potential.ClientData(X, y, jnp.asarray(3))
    t = fp.potential.make_target(data, 4, prior_weight=0.25)
    ll = pot.log_likelihood(z, X, y)
    np.testing.assert_allclose(pot.log_density(z, t), 0.25 * glob + local + ll, rtol=1e-5)


def test_bad_local_sites_are_refused_naming_the_site():
    def per_row(X, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", X.shape[0]):
            b = numpyro.sample("b", dist.Normal(0.0, 1.0), infer={"local": True})
            numpyro.sample("y", dist.Normal(mu + b, 1.0), obs=y)

    def sized_by_rows(X, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([X.shape[0]]).to_event(1), infer={"local": True})
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu + b, 1.0), obs=y)

    def discrete(X, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        c = numpyro.sample("c", dist.Bernoulli(0.5), infer={"local": True})
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu + c, 1.0), obs=y)

    X, y = np.zeros((4, 1)), np.zeros(4)
    with pytest.raises(ValueError, match="local site 'b' lies inside the 'data' plate"):
        Potential(per_row, X, y)
    with pytest.raises(ValueError, match="local site 'b' has shape .* depends on the client's row count"):
        Potential(sized_by_rows, X, y)
    with pytest.raises(ValueError, match="local site 'c' is discrete"):
        Potential(discrete, X, y)


@pytest.mark.parametrize("algo", [fp.algorithms.FedLap(), fp.algorithms.ADMM(), fp.algorithms.FedDyn(),
                                  fp.algorithms.OneShotAverage()],
                         ids=lambda a: type(a).__name__)
def test_algorithms_without_local_sites_refuse_before_compiling(algo):
    fed, _ = federation()
    with pytest.raises(ValueError, match=r"'a' as client-local .*" + type(algo).__name__ + ".*use fp.algorithms.PVI"):
        fp.run(algo, normal_normal, fed, rounds=1, progress=False)


def pvi_laplace(hessian="full"):
    """PVI with Laplace clients, one exact round; num_predictive_draws for test_local_results_predict_and_refresh,
    so that it and the "full" case here run one compiled round (the draws do not change the posterior)."""
    return PVI(client=Laplace(hessian=hessian), damping=1.0, num_predictive_draws=4000)


@pytest.mark.parametrize("hessian", ["full", pytest.param("diag_ggn", marks=pytest.mark.slow)])
def test_pvi_laplace_is_exact_in_one_round_for_global_and_local_sites(x64, hessian):
    """Laplace's default curvature ("full") in the default run; the closed-form GGN diagonal is slow."""
    fed, clients = federation()
    mean, cov = exact_joint(clients)
    res = fp.run(pvi_laplace(hessian), normal_normal, fed, rounds=1, progress=False)
    post = res.posterior
    np.testing.assert_allclose(post.mean["mu"], mean[0], rtol=1e-6)
    np.testing.assert_allclose(post.form.variance()[0], cov[0, 0], rtol=1e-6)
    np.testing.assert_allclose(post.local_mean["a"], mean[1:], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(post.local_sd["a"], np.sqrt(np.diag(cov)[1:]), rtol=1e-6)
    # a second round changes nothing: the sites are already exact
    res2 = fp.run(pvi_laplace(hessian), normal_normal, fed, rounds=2, progress=False)
    np.testing.assert_allclose(res2.posterior.local_mean["a"], mean[1:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(res2.posterior.mean["mu"], mean[0], rtol=1e-6)


def test_local_results_predict_and_refresh(x64):
    """Per-client and new-client predictives, local draws, the refresh pass, sequential PVI."""
    fed, clients = federation()
    mean, cov = exact_joint(clients)
    algo = pvi_laplace("full")
    res = fp.run(algo, normal_normal, fed, rounds=1, progress=False)
    post = res.posterior
    assert res.info["local_refresh"]["clients"] == 8 and res.info["local_refresh"]["not_finite"] == []
    assert set(post.mean) == {"mu"} and post.local_mean["a"].shape == (8,)
    np.testing.assert_allclose(post.sd["mu"], np.sqrt(cov[0, 0]), rtol=0.05)
    X = np.zeros((2, 1))
    for k in (0, 7):
        m, v = post.predict(X, prediction="mean", client=k)
        np.testing.assert_allclose(m, mean[0] + mean[k + 1], rtol=1e-6)
        m, v = post.predict(X, client=k)
        var = 1.0 + cov[0, 0] + cov[k + 1, k + 1] + 2 * cov[0, k + 1]
        sd_f = np.sqrt(var - 1.0)
        np.testing.assert_allclose(m, mean[0] + mean[k + 1], atol=4 * sd_f / np.sqrt(4000))
        np.testing.assert_allclose(v, var, rtol=0.06)
    # a new client: a ~ N(0, tau^2) given each global draw
    m, v = post.predict(X)
    np.testing.assert_allclose(m, mean[0], atol=4 * np.sqrt(cov[0, 0] + TAU ** 2) / np.sqrt(4000))
    np.testing.assert_allclose(v, 1.0 + cov[0, 0] + TAU ** 2, rtol=0.06)
    with pytest.raises(ValueError, match="client must be None .* \\[0, 8\\)"):
        post.predict(X, client=8)
    draws = post.sample_local(jax.random.PRNGKey(1), 4000)["a"]
    assert draws.shape == (4000, 8)
    np.testing.assert_allclose(draws.mean(0), mean[1:], atol=4 * np.sqrt(np.diag(cov)[1:].max() / 4000))
    np.testing.assert_allclose(draws.std(0), np.sqrt(np.diag(cov)[1:]), rtol=0.06)
    seq = fp.algorithms.pvi.run_sequential(algo, normal_normal, fed, sweeps=1)
    np.testing.assert_allclose(seq.posterior.local_mean["a"], mean[1:], rtol=1e-6, atol=1e-6)
    assert "local_refresh" in seq.info


def test_predict_client_needs_local_sites():
    def shared(X, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu + 0.0 * X[:, 0], 1.0), obs=y)

    fed, _ = federation()
    res = fp.run(PVI(damping=1.0), shared, fed, rounds=1, progress=False)
    assert "local_refresh" not in res.info
    with pytest.raises(ValueError, match="client=... needs a model with client-local sites"):
        res.posterior.predict(np.zeros((1, 1)), client=0)
    with pytest.raises(ValueError, match="no client-local sites"):
        res.posterior.local_mean


@pytest.mark.parametrize("algo", [fp.algorithms.EPMCMC(client=fp.inference.NUTS()),
                                  pytest.param(fp.algorithms.ConsensusMC(client=fp.inference.NUTS()),
                                               marks=pytest.mark.slow)],
                         ids=lambda a: type(a).__name__)
def test_one_round_sampling_methods_match_the_exact_posterior_within_monte_carlo_error(algo):
    """NUTS clients sample (mu, a_k) jointly; the server combines the mu draws, each client keeps
    a_k | mu regressed on its draws. Tolerances: about 3 Monte Carlo sds at the clients' ESS (~100).
    EPMCMC (the parametric default) in the default run; ConsensusMC (its own client phase: the 1/K prior
    share) is slow."""
    fed, clients = federation()
    mean, cov = exact_joint(clients)
    post = fp.run(algo, normal_normal, fed, progress=False).posterior
    sd = np.sqrt(np.diag(cov))
    assert abs(post.mean["mu"] - mean[0]) < 0.3 * sd[0]
    assert 0.85 < post.sd["mu"] / sd[0] < 1.15
    np.testing.assert_array_less(np.abs(post.local_mean["a"] - mean[1:]) / sd[1:], 0.5)
    ratio = np.asarray(post.local_sd["a"]) / sd[1:]
    assert np.all((ratio > 0.8) & (ratio < 1.25)), ratio
    assert "local_posterior" in post.info


def test_pvi_refuses_mean_field_clients_with_local_sites():
    fed, _ = federation()
    with pytest.raises(ValueError, match="'a' as client-local.*IVON clients .*mean-field"):
        fp.run(PVI(client=fp.inference.IVON()), normal_normal, fed, progress=False)


def test_one_round_methods_refuse_gaussian_clients_and_kernel_products_with_local_sites():
    fed, _ = federation()
    with pytest.raises(ValueError, match="'a' as client-local.*sampling clients only"):
        fp.run(fp.algorithms.ConsensusMC(client=Laplace()), normal_normal, fed, progress=False)
    with pytest.raises(ValueError, match="'a' as client-local.*method='nonparametric'"):
        fp.run(fp.algorithms.EPMCMC(method="nonparametric"), normal_normal, fed, progress=False)
    runs = fp.algorithms.client_runs.run_clients(fp.inference.SGLD(num_samples=10, num_burnin=10),
                                                 normal_normal, fed)
    with pytest.raises(ValueError, match="aggregate\\(\\) does not take client-local sites"):
        fp.algorithms.client_runs.aggregate([fp.algorithms.EPMCMC()], runs)
