"""prediction="auto" (PVI, FedLap-Cov, BayesADMM): mean or average, chosen by each client's rows under its
cavity, against the closed-form leave-one-client-out predictive of a conjugate regression."""
import warnings

import numpy as np
import pytest
from conftest import linreg_exact_posterior, linreg_model, skip_khat_check

import fedprob as fp
from fedprob.algorithms import PVI, BayesADMM
from fedprob.engine import local

SIGMA, PRIOR = 0.5, 1.0


@pytest.fixture(autouse=True)
def _no_khat():
    """No test here reads the runs' Pareto k-hats (their warnings are ignored): skip the check, a fifth
    of each fp.run's time here (its own compiled program per configuration)."""
    with skip_khat_check():
        yield


def small_clients(seed=0, sizes=(4, 5, 6, 8, 10), d=5):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=d)
    Xs = [rng.normal(size=(n, d)) + rng.normal(size=d) for n in sizes]
    ys = [X @ w + SIGMA * rng.normal(size=len(X)) for X in Xs]
    return Xs, ys, fp.data.FederatedData.from_clients(list(zip(Xs, ys)))


def loo_client_scores(Xs, ys, prior=PRIOR):
    """Per row: the plug-in log density at the exact cavity mean and the exact cavity predictive
    N(x' m_-k, sigma^2 + x' S_-k x), each client's mean over its rows averaged over the clients."""
    at_mean = averaged = 0.0
    for k, (X, y) in enumerate(zip(Xs, ys)):
        rest = [j for j in range(len(Xs)) if j != k]
        m, S = linreg_exact_posterior([Xs[j] for j in rest], [ys[j] for j in rest], SIGMA, prior)
        mu, v = X @ m, SIGMA ** 2 + np.einsum("ni,ij,nj->n", X, S, X)
        at_mean += np.mean(-0.5 * np.log(2 * np.pi * SIGMA ** 2) - (y - mu) ** 2 / (2 * SIGMA ** 2))
        averaged += np.mean(-0.5 * np.log(2 * np.pi * v) - (y - mu) ** 2 / (2 * v))
    return at_mean / len(Xs), averaged / len(Xs)


def exact_pvi(fed):
    """PVI with the full family and damping 1 on the conjugate regression: exact in one round, so every
    cavity is the exact posterior without its client."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fp.run(PVI(family="full", damping=1.0), linreg_model(PRIOR, SIGMA), fed, rounds=1, seed=0,
                      progress=False)


def test_auto_scores_are_the_exact_leave_one_client_out_predictives(x64):
    """PVI (full family, damping 1: exact in one round) on 5 clients of 4 to 10 rows, 5 features: each cavity is
    the exact posterior without that client, so the plug-in score is the closed form to float
    precision and the averaged one (64 draws of each cavity) within its Monte Carlo error; with so
    few rows the parameter uncertainty matters and the average is chosen."""
    Xs, ys, fed = small_clients()
    res = exact_pvi(fed)
    choice = res.posterior.info["prediction_choice"]
    at_mean, averaged = loo_client_scores(Xs, ys)
    np.testing.assert_allclose(choice["elpd_mean"], at_mean, rtol=1e-6)
    np.testing.assert_allclose(choice["elpd_average"], averaged, atol=0.05)
    assert averaged > at_mean + 0.15                      # the oracle's own verdict
    assert choice["prediction"] == "average" and res.posterior.prediction == "average"
    assert choice["clients"] == 5


def test_cavities_that_predict_worse_than_the_prior_mean_do_not_vote(x64):
    """Two clients with opposite weights (y = X w and y = -X w): each cavity is the other client's exact
    posterior, and its mean predicts the held-out client's rows worse than the prior mean (w = 0) does.
    Under such cavities the softer predictive wins whatever q_g is (the oracle's own average beats its
    plug-in here), so the clients' scores are no evidence for the average: auto predicts at the mean
    and says why. The three scores are the closed forms."""
    rng = np.random.default_rng(3)
    w = np.array([0.2, -0.2, 0.1])
    Xs = [rng.normal(size=(12, 3)) for _ in range(2)]
    ys = [s * X @ w + SIGMA * rng.normal(size=12) for s, X in zip((1.0, -1.0), Xs)]
    fed = fp.data.FederatedData.from_clients(list(zip(Xs, ys)))
    res = exact_pvi(fed)
    c = res.posterior.info["prediction_choice"]
    at_mean, averaged = loo_client_scores(Xs, ys)
    at_prior = np.mean([np.mean(-0.5 * np.log(2 * np.pi * SIGMA ** 2) - y ** 2 / (2 * SIGMA ** 2)) for y in ys])
    np.testing.assert_allclose([c["elpd_mean"], c["elpd_prior"]], [at_mean, at_prior], rtol=1e-6)
    np.testing.assert_allclose(c["elpd_average"], averaged, rtol=0.1)     # 64 draws: log-mean-exp biased low
    assert at_mean < at_prior and averaged > at_mean          # the oracle: uninformative folds favour the average
    assert c["prediction"] == "mean" and res.posterior.prediction == "mean" and "prior mean" in c["reason"], c
    np.testing.assert_allclose(np.mean(c["per_client"]["mean"]), at_mean, rtol=1e-6)


def test_auto_picks_the_mean_when_the_gaussian_is_far_wider_than_the_posterior(x64):
    """BayesADMM at tau = 200 under a flat prior (sd 1,000) is the posterior of a likelihood tempered
    200-fold: the same mean, 14 times the sds, so its average predicts the clients' rows worse than
    its mean and auto predicts at the mean (and says so); tau = 1 keeps the average (the two nearly
    agree on 100 rows per client); an explicit prediction is never overridden."""
    Xs, ys, fed = small_clients(sizes=(100,) * 4, d=3)
    model = linreg_model(1e3, SIGMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hot = fp.run(BayesADMM(tau=200.0, family="full"), model, fed, rounds=20, seed=0, progress=False)
        cold = fp.run(BayesADMM(family="full"), model, fed, rounds=20, seed=0, progress=False)
        compiled = dict(local.COMPILE_COUNT)
        fixed = fp.run(BayesADMM(tau=200.0, family="full", prediction="average"), model, fed, rounds=20,
                       seed=0, progress=False)
    # prediction shapes the posterior alone: the run with it fixed reuses hot's compiled init and round
    assert dict(local.COMPILE_COUNT) == compiled
    np.testing.assert_array_equal(np.asarray(fixed.server_state.lam.linear), np.asarray(hot.server_state.lam.linear))
    c = hot.posterior.info["prediction_choice"]
    assert c["prediction"] == "mean" and hot.posterior.prediction == "mean", c
    assert c["elpd_mean"] > c["elpd_average"] + 0.1, c
    at_mean, _ = loo_client_scores(Xs, ys, prior=1e3)
    np.testing.assert_allclose(c["elpd_mean"], at_mean, atol=0.02)      # the tempered cavity keeps the mean
    c1 = cold.posterior.info["prediction_choice"]
    assert c1["prediction"] == "average" and abs(c1["elpd_mean"] - c1["elpd_average"]) < 0.05, c1
    assert fixed.posterior.prediction == "average" and "prediction_choice" not in fixed.posterior.info


def test_auto_is_the_average_with_nothing_to_choose_from():
    """One client (its cavity is the prior) and the point families keep the default average / the point."""
    Xs, ys, fed = small_clients(sizes=(20,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = fp.run(PVI(family="full", damping=1.0), linreg_model(PRIOR, SIGMA), fed, rounds=1, progress=False)
    assert res.posterior.prediction == "average" and "prediction_choice" not in res.posterior.info
    with pytest.raises(ValueError, match="prediction must be one of"):
        PVI(prediction="median")
