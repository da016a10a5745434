"""Client-local sites beyond PVI: FedAvg/FedProx (local sites kept on their clients), FedPA and BayesADMM
(the global marginal aggregated, each client's local conditional kept), Ensemble/PredictiveBayes (each
client's own posterior), summary() rows per client, and models whose global terms read a local site.

Oracle: the conjugate normal-normal hierarchy of tests/test_local_sites.py (global mu ~ N(0, 3^2), local
a_k ~ N(0, 0.7^2), y ~ N(mu + a_k, 1), 8 clients of 3 to 40 rows), solved densely."""
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedprob as fp
from fedprob.algorithms import BayesADMM, Ensemble, FedAvg, FedPA, FedProx, PredictiveBayes
from fedprob.inference import NUTS, Laplace
from fedprob.potential import Potential
from test_local_sites import PRIOR_SD, SIZES, TAU, exact_joint, federation, normal_normal, pvi_laplace

N = np.array(SIZES)


def ybars(clients):
    return np.array([y.mean() for _, y in clients])


def conditional_mode(clients, mu):
    """argmax_a p(a | mu, D_k) = n_k (ybar_k - mu) / (n_k + 1/tau^2) for every client."""
    return N * (ybars(clients) - mu) / (N + TAU ** -2)


def tempered_joint(clients, temperature):
    """Mean and covariance of (mu, a) under p0(mu) prod_k [p(a_k) p(D_k | mu, a_k)]^(1/temperature)."""
    K = len(clients)
    t = 1.0 / temperature
    P = np.zeros((K + 1, K + 1))
    b = np.zeros(K + 1)
    P[0, 0] = PRIOR_SD ** -2
    for k, (_, y) in enumerate(clients):
        n = len(y)
        P[0, 0] += t * n
        P[k + 1, k + 1] = t * (TAU ** -2 + n)
        P[0, k + 1] = P[k + 1, 0] = t * n
        b[0] += t * y.sum()
        b[k + 1] = t * y.sum()
    cov = np.linalg.inv(P)
    return cov @ b, cov


# -- FedAvg / FedProx: partial personalization ---------------------------------------------------------

#: the FedAvg configuration of the first test; test_summary_has_one_row_per_client_for_local_sites reads the
#: same run (fedavg_run), so its round is compiled once for the module
FEDAVG = FedAvg(local_steps=20, batch_size=None, learning_rate=0.2)


@pytest.fixture(scope="module")
def fedavg_run():
    """The FedAvg run of FEDAVG over 8 rounds (double precision, as the x64 fixture)."""
    jax.config.update("jax_enable_x64", True)
    try:
        fed, clients = federation()
        return clients, fp.run(FEDAVG, normal_normal, fed, rounds=8, progress=False)
    finally:
        jax.config.update("jax_enable_x64", False)


def check_fedavg_local(clients, res):
    post = res.posterior
    assert np.shape(res.server_state[0]) == (1,)                       # the server never holds a local site
    mu = float(post.mean["mu"])
    np.testing.assert_allclose(post.local_mean["a"], conditional_mode(clients, mu), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(res.client_states.local[:, 0], post.local_mean["a"], rtol=1e-12)
    assert np.all(np.asarray(post.local_sd["a"]) == 0) and np.isnan(post.sd["mu"])
    assert res.info["local_refresh"]["not_finite"] == []
    X = np.zeros((3, 1))
    for k in (0, 5):
        m, v = post.predict(X, client=k)
        np.testing.assert_allclose(m, mu + post.local_mean["a"][k], rtol=1e-9)
        np.testing.assert_allclose(v, 1.0, rtol=1e-9)
    # a new client: a ~ N(0, tau^2) at the point mu (num_predictive_draws draws of it)
    m, v = post.predict(X)
    np.testing.assert_allclose(m, mu, atol=4 * TAU / np.sqrt(post.num_predictive_draws))
    assert 1.0 + 0.5 * TAU ** 2 < float(v[0]) < 1.0 + 1.6 * TAU ** 2


def test_fedavg_keeps_local_sites_on_their_clients(x64, fedavg_run):
    """The server holds the global block only; each client's local value is its conditional mode given
    the final averaged mu (the refresh pass); predict(client=k) uses client k's value. FedProx, the same
    checks: test_fedprox_keeps_local_sites_on_their_clients (slow)."""
    check_fedavg_local(*fedavg_run)


@pytest.mark.slow
def test_fedprox_keeps_local_sites_on_their_clients(x64):
    """test_fedavg_keeps_local_sites_on_their_clients for FedProx (its own compiled round)."""
    fed, clients = federation()
    algo = FedProx(local_steps=20, batch_size=None, learning_rate=0.2, mu=0.5)
    check_fedavg_local(clients, fp.run(algo, normal_normal, fed, rounds=8, progress=False))


def test_fedavg_local_blocks_persist_across_rounds(x64):
    """Without the refresh pass a client's local value is what its own training left; a client that never
    took part keeps the starting value (the prior centre, 0), and the others moved away from it."""
    fed, clients = federation()
    res = fp.run(FedAvg(local_steps=20, batch_size=None, learning_rate=0.2, refresh_steps=0), normal_normal,
                 fed, rounds=2, clients_per_round=3, progress=False)
    took_part = sorted({k for h in res.history for k in h["participants"]})
    a = np.asarray(res.posterior.local_mean["a"])
    never = [k for k in range(8) if k not in took_part]
    assert np.all(a[never] == 0.0) and np.all(a[took_part] != 0.0)
    assert "local_refresh" in res.info and "last round" in res.posterior.info["local_posterior"]


# -- FedPA and BayesADMM: the global marginal, each client's conditional ----------------------------------

#: the clients' sampler of the FedPA tests
FEDPA_NUTS = NUTS(num_warmup=200, num_samples=500)


def test_fedpa_matches_the_exact_posterior_within_monte_carlo_error():
    """NUTS clients sample (mu, a_k) under the 1/K prior share; the delta uses the mu draws. At the
    default (full) family a sampling round is a Newton step onto the product of the clients' global
    marginals, and the three rounds' products are averaged; each client's a_k | mu, regressed on its
    draws, is averaged over the final Gaussian of mu. The paper's diagonal form:
    test_fedpa_paper_diag_form_matches_the_exact_posterior (slow)."""
    fed, clients = federation()
    mean, cov = exact_joint(clients)
    check_fedpa_local(FedPA(client=FEDPA_NUTS), fed, mean, np.sqrt(np.diag(cov)))


@pytest.mark.slow
def test_fedpa_paper_diag_form_matches_the_exact_posterior():
    """The paper's diagonal form with the shrinkage weight rho_l = 1/l and the server step N / P (P the
    posterior precision of mu) is the same Newton step in one dimension: the checks of
    test_fedpa_matches_the_exact_posterior_within_monte_carlo_error."""
    fed, clients = federation()
    mean, cov = exact_joint(clients)
    algo = FedPA(client=FEDPA_NUTS, shrinkage=1.0, normalize=False, family="diag",
                 server_learning_rate=float(N.sum() * cov[0, 0]), burn_in_rounds=0)
    check_fedpa_local(algo, fed, mean, np.sqrt(np.diag(cov)))


def check_fedpa_local(algo, fed, mean, sd):
    res = fp.run(algo, normal_normal, fed, rounds=3, progress=False)
    post = res.posterior
    assert abs(float(post.mean["mu"]) - mean[0]) < 0.25 * sd[0]
    assert 0.85 < float(post.sd["mu"]) / sd[0] < 1.15
    np.testing.assert_array_less(np.abs(np.asarray(post.local_mean["a"]) - mean[1:]) / sd[1:], 0.3)
    ratio = np.asarray(post.local_sd["a"]) / sd[1:]
    assert np.all((ratio > 0.85) & (ratio < 1.15)), ratio
    assert res.info["local_refresh"]["clients"] == 8 and "regressed" in post.info["local_posterior"]


def check_bayes_admm(algo, rounds, rtol, m, c):
    fed, _ = federation()
    post = fp.run(algo, normal_normal, fed, rounds=rounds, progress=False).posterior
    np.testing.assert_allclose(post.mean["mu"], m[0], rtol=rtol)
    np.testing.assert_allclose(post.form.variance()[0], c[0, 0], rtol=rtol)
    np.testing.assert_allclose(post.local_mean["a"], m[1:], rtol=rtol, atol=rtol * 1e-2)
    np.testing.assert_allclose(post.local_sd["a"], np.sqrt(np.diag(c)[1:]), rtol=rtol)


def test_bayes_admm_is_exact_for_global_and_local_sites(x64):
    """Prop. 3.2 (rho = damping = 1/K, Laplace clients): exact in one round, mu and every a_k; at the
    defaults (rho = 1, damping 0.3) BayesADMM converges to the same answer. The tempered posterior:
    test_bayes_admm_tempered_is_exact (slow)."""
    _, clients = federation()
    K = len(SIZES)
    check_bayes_admm(BayesADMM(client=Laplace(hessian="full"), rho=1 / K, damping=None), 1, 1e-6,
                     *exact_joint(clients))
    check_bayes_admm(BayesADMM(), 60, 1e-3, *exact_joint(clients))


@pytest.mark.slow
def test_bayes_admm_tempered_is_exact(x64):
    """tau = 0.5 with Prop. 3.2's rho = damping = 1/K gives, in one round, the exact posterior of the model
    tempered by 1/tau (the local conditional's covariance undone from the solve's 1/rho)."""
    _, clients = federation()
    K = len(SIZES)
    check_bayes_admm(BayesADMM(rho=1 / K, damping=None, tau=0.5), 1, 1e-6, *tempered_joint(clients, 0.5))


# -- Ensemble and PredictiveBayes: each client's own posterior -----------------------------------------

#: one client backend for both methods: their client phases share one compiled sampler
SAMPLER = NUTS(num_samples=500, num_chains=2)


@pytest.fixture(scope="module")
def one_round():
    fed, clients = federation()
    return (clients, fp.run(Ensemble(client=SAMPLER), normal_normal, fed, progress=False),
            fp.run(PredictiveBayes(client=SAMPLER), normal_normal, fed, progress=False))


def test_ensemble_and_predictive_bayes_predict_with_each_clients_own_posterior(one_round):
    """Client k's predictive is its own posterior's (its data alone): f = mu + a_k has prior
    N(0, 3^2 + tau^2) and ybar_k ~ N(f, 1/n_k); its a_k given ybar_k alone is the regression of a on
    ybar. A new client's predictive under the ensemble is the mixture of N(E[mu | D_k], ...) over
    clients weighted by size. Tolerances: 4 Monte Carlo sds at an ESS of ~250 per client."""
    clients, ens, pb = one_round
    ens, pb = ens.posterior, pb.posterior
    yb = ybars(clients)
    v0 = PRIOR_SD ** 2 + TAU ** 2
    var_f = 1 / (1 / v0 + N)
    mean_f = var_f * N * yb
    mean_a = TAU ** 2 / (v0 + 1 / N) * yb
    sd_a = np.sqrt(TAU ** 2 - TAU ** 4 / (v0 + 1 / N))
    var_mu = 1 / (PRIOR_SD ** -2 + 1 / (TAU ** 2 + 1 / N))
    mean_mu = var_mu * yb / (TAU ** 2 + 1 / N)
    X = np.zeros((2, 1))
    se = 4 / np.sqrt(250)
    for post in (ens, pb):
        for k in (0, 3, 7):
            m, v = post.predict(X, client=k)
            assert abs(float(m[0]) - mean_f[k]) < se * np.sqrt(var_f[k]), (k, m, mean_f[k])
            assert abs(float(v[0]) / (var_f[k] + 1) - 1) < 0.1
            lpd = post.log_predictive_density(X, np.ones(2), client=k)
            np.testing.assert_allclose(lpd, -0.5 * np.log(2 * np.pi * (var_f[k] + 1))
                                       - 0.5 * (1 - mean_f[k]) ** 2 / (var_f[k] + 1), atol=0.05)
        np.testing.assert_array_less(np.abs(np.asarray(post.local_mean["a"]) - mean_a) / sd_a, 2 * se)
        ratio = np.asarray(post.local_sd["a"]) / sd_a       # a client alone barely separates mu and a_k:
        assert np.all((ratio > 0.75) & (ratio < 1.33)), ratio   # its a draws mix slowly (ESS ~ 100)
        assert post.sample_local(jax.random.PRNGKey(0), 7)["a"].shape == (7, 8)
        assert set(post.mean) == {"mu"}
        with pytest.raises(ValueError, match=r"client must be None .* \[0, 8\)"):
            post.predict(X, client=8)
    # a new client under the ensemble: the size-weighted mixture of the clients' new-client predictives
    w = N / N.sum()
    m, v = ens.predict(X)
    mix_var = np.sum(w * (var_mu + TAU ** 2 + 1 + mean_mu ** 2)) - np.sum(w * mean_mu) ** 2
    assert abs(float(m[0]) - np.sum(w * mean_mu)) < se * np.sqrt(mix_var)
    assert abs(float(v[0]) / mix_var - 1) < 0.1
    # PredictiveBayes pools the new-client predictives: its new local sites are prior draws, not a client's
    new = np.asarray(pb.new_client_draws())
    np.testing.assert_array_equal(new[..., 0], np.asarray(pb.client_draws)[..., 0])
    assert abs(float(np.std(new[..., 1])) / TAU - 1) < 0.05
    m, v = pb.predict(X)
    assert np.all(np.isfinite(m)) and np.all(np.asarray(v) > 1.0)


# -- summary() -------------------------------------------------------------------------------------------

def test_summary_has_one_row_per_client_for_local_sites(x64, fedavg_run):
    """Rows mu, a[0]..a[7] (az.summary's labels for to_arviz()'s client dim): exact for PVI's Gaussian,
    the values with NaN spread for a point estimate, the client's own draws for an ensemble."""
    fed, clients = federation()
    mean, cov = exact_joint(clients)
    res = fp.run(pvi_laplace("full"), normal_normal, fed, rounds=1, progress=False)   # test_local_sites's
    rows = res.summary().rows
    assert [r["parameter"] for r in rows] == ["mu"] + [f"a[{k}]" for k in range(8)]
    assert all(r["basis"] == "exact" for r in rows)
    np.testing.assert_allclose([r["mean"] for r in rows], mean, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose([r["sd"] for r in rows], np.sqrt(np.diag(cov)), rtol=1e-6)
    lo = [r["eti_3%"] for r in rows]
    np.testing.assert_allclose(lo, mean - 1.8807936 * np.sqrt(np.diag(cov)), rtol=1e-5, atol=1e-6)
    assert [r["parameter"] for r in res.posterior.summary().rows] == [r["parameter"] for r in rows]
    fa = fedavg_run[1]                         # the run of test_fedavg_keeps_local_sites_on_their_clients
    rows = fa.summary().rows
    assert [r["parameter"] for r in rows][1:] == [f"a[{k}]" for k in range(8)]
    np.testing.assert_allclose([r["mean"] for r in rows[1:]], fa.posterior.local_mean["a"], rtol=1e-12)
    assert all(np.isnan(r["sd"]) and r["basis"] == "point estimate" for r in rows)


def test_ensemble_summary_rows_are_each_clients_own_draws(one_round):
    res = one_round[1]
    rows = {r["parameter"]: r for r in res.summary().rows}
    post = res.posterior
    a = np.asarray(post.client_draws)[:, :, 1]                         # (K, S) each client's own a draws
    for k in range(8):
        r = rows[f"a[{k}]"]
        assert r["basis"] == "client draws" and np.isfinite(r["r_hat"])
        np.testing.assert_allclose(r["mean"], a[k].mean(), rtol=1e-5)
        np.testing.assert_allclose(r["sd"], a[k].std(ddof=1), rtol=1e-5)


# -- bad input: a global term that reads a local site ------------------------------------------------------

def test_a_global_term_that_reads_a_local_site_is_refused_naming_both():
    def global_reads_local(X, y=None):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0), infer={"local": True})
        mu = numpyro.sample("mu", dist.Normal(a, 1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu + a, 1.0), obs=y)

    def factor_reads_local(X, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        a = numpyro.sample("a", dist.Normal(mu, 1.0).expand([2]).to_event(1), infer={"local": True})
        numpyro.factor("penalty", -(a ** 2).sum())
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu + a[0], 1.0), obs=y)

    def fine(X, y=None):                      # local sites may read global ones and each other
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        a = numpyro.sample("a", dist.Normal(mu, s).expand([2]).to_event(1), infer={"local": True})
        b = numpyro.sample("b", dist.Normal(a.sum(), s), infer={"local": True})
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu + a[0] + b, 1.0), obs=y)

    X, y = np.zeros((4, 1)), np.zeros(4)
    assert Potential(fine, X, y).local_sites == ("a", "b")
    with pytest.raises(ValueError, match="global site 'mu' depends on the client-local site 'a'"):
        Potential(global_reads_local, X, y)
    with pytest.raises(ValueError, match="numpyro.factor 'penalty' outside the 'data' plate depends on the "
                                         "client-local site 'a'"):
        Potential(factor_reads_local, X, y)
    fed, _ = federation()
    with pytest.raises(ValueError, match="global site 'mu' depends on the client-local site 'a'"):
        fp.run(FedAvg(), global_reads_local, fed, progress=False)
