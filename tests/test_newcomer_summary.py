"""posterior.summary() / result.summary() and posterior.sd against exact answers, for every posterior kind."""
from __future__ import annotations

import math
import statistics

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import linreg_exact_posterior, linreg_federation, linreg_model

import fedprob as fp
from fedprob import diagnostics as D
from fedprob.algorithms.ensemble import EnsemblePosterior
from fedprob.posteriors import Gaussian, GlobalPosterior, Samples

Z94 = statistics.NormalDist().inv_cdf(0.97)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(50, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * RNG.normal(size=50)).astype(np.float32)
MU, COV = linreg_exact_posterior([X], [Y], 0.5, 1.0)
POT = fp.Potential(linreg_model(), X, Y)


def _rows(table):
    return {r["parameter"]: r for r in table.rows}


def test_gaussian_summary_is_exact_for_real_sites():
    post = GlobalPosterior(POT, Gaussian.from_moments(MU, COV), info={"kind": "full Gaussian"})
    t = post.summary()
    rows = _rows(t)
    sd = np.sqrt(np.diag(COV))
    assert list(rows) == ["w[0]", "w[1]", "w[2]"]
    for i in range(3):
        r = rows[f"w[{i}]"]
        assert r["basis"] == "exact"
        np.testing.assert_allclose([r["mean"], r["sd"]], [MU[i], sd[i]], rtol=1e-4)
        np.testing.assert_allclose([r["eti_3%"], r["eti_97%"]], [MU[i] - Z94 * sd[i], MU[i] + Z94 * sd[i]],
                                   rtol=1e-4, atol=1e-6)
        assert math.isnan(r["ess_bulk"]) and math.isnan(r["r_hat"])
    np.testing.assert_allclose(np.asarray(post.sd["w"]), sd, rtol=1e-4)
    assert any("Gaussian" in n for n in t.notes)
    df = t.to_pandas()
    assert df.loc["w[1]", "mean"] == pytest.approx(MU[1], rel=1e-4)


def test_gaussian_summary_of_a_constrained_site_matches_the_lognormal():
    def model(X, y=None):
        s = numpyro.sample("s", dist.LogNormal(0.0, 1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    pot = fp.Potential(model, X, Y)
    m, v = -0.3, 0.04                                   # log s ~ N(m, v): s is log-normal
    post = GlobalPosterior(pot, Gaussian.from_moments(np.array([m]), np.array([v])))
    r = post.summary(num_draws=20000).rows[0]
    assert r["parameter"] == "s" and r["basis"] == "gaussian draws"
    mean = math.exp(m + v / 2)
    sd = math.sqrt((math.exp(v) - 1) * math.exp(2 * m + v))
    assert r["mean"] == pytest.approx(mean, rel=0.01)
    assert r["sd"] == pytest.approx(sd, rel=0.03)
    assert r["eti_3%"] == pytest.approx(math.exp(m - Z94 * math.sqrt(v)), rel=0.02)
    assert float(post.sd["s"]) == pytest.approx(sd, rel=0.03)


def test_draws_summary_has_ess_and_rhat_over_the_chains():
    z = RNG.multivariate_normal(MU, COV, size=4 * 500).astype(np.float32)
    post = GlobalPosterior(POT, Samples(z), info={"num_chains": 4})
    rows = _rows(post.summary())
    x = z.reshape(4, 500, 3)
    for i in range(3):
        r = rows[f"w[{i}]"]
        assert r["basis"] == "draws"
        np.testing.assert_allclose([r["mean"], r["sd"]], [z[:, i].mean(), z[:, i].std(ddof=1)], rtol=1e-4)
        np.testing.assert_allclose([r["eti_3%"], r["eti_97%"]], np.quantile(z[:, i], [0.03, 0.97]), rtol=1e-4)
        assert r["ess_bulk"] == pytest.approx(float(D.ess(x[..., i])), rel=1e-6)
        assert r["ess_tail"] == pytest.approx(float(D.ess(x[..., i], "tail")), rel=1e-6)
        assert abs(r["r_hat"] - 1) < 0.01
    shifted = (x + np.arange(4)[:, None, None]).reshape(-1, 3)       # chains that disagree
    bad = GlobalPosterior(POT, Samples(shifted), info={"num_chains": 4}).summary()
    assert min(bad.column("r_hat")) > 1.5
    one = GlobalPosterior(POT, Samples(z)).summary()                 # one chain: no R-hat
    assert all(math.isnan(v) for v in one.column("r_hat")) and any("2 chains" in n for n in one.notes)


def test_point_estimate_says_so():
    post = GlobalPosterior(POT, Samples(np.asarray(MU, np.float32)[None]), info={"kind": "point estimate"})
    t = post.summary()
    assert set(t.column("basis")) == {"point estimate"}
    np.testing.assert_allclose(t.column("mean"), MU, rtol=1e-5)
    assert all(math.isnan(v) for v in t.column("sd") + t.column("eti_3%") + t.column("ess_bulk"))
    assert any("point estimate" in n for n in t.notes)
    assert np.all(np.isnan(np.asarray(post.sd["w"])))


def test_ensemble_summary_is_the_weighted_mixture():
    S = 4000
    a = RNG.normal(size=(S, 3)) * 0.5 + np.array([0.0, 1.0, 2.0])
    b = RNG.normal(size=(S, 3)) * 0.5 + np.array([2.0, 1.0, 0.0])
    w = np.array([0.25, 0.75])
    post = EnsemblePosterior(POT, np.stack([a, b]).astype(np.float32), w)
    rows = _rows(post.summary())
    for i in range(3):
        mean = w[0] * a[:, i].mean() + w[1] * b[:, i].mean()
        var = w[0] * a[:, i].var() + w[1] * b[:, i].var() + w[0] * w[1] * (a[:, i].mean() - b[:, i].mean()) ** 2
        assert rows[f"w[{i}]"]["mean"] == pytest.approx(mean, abs=1e-3)
        assert rows[f"w[{i}]"]["sd"] == pytest.approx(math.sqrt(var), rel=2e-3)
        assert rows[f"w[{i}]"]["basis"] == "mixture of client draws"
    # the 3% quantile of w[0]: the mixture CDF 0.25 Phi(x/0.5) + 0.75 Phi((x-2)/0.5) = 0.03
    lo = rows["w[0]"]["eti_3%"]
    cdf = 0.25 * statistics.NormalDist(0, 0.5).cdf(lo) + 0.75 * statistics.NormalDist(2, 0.5).cdf(lo)
    assert cdf == pytest.approx(0.03, abs=0.005)


def test_result_summary_of_a_run_is_the_exact_posterior():
    fed = linreg_federation(120, 3)
    result = fp.run(fp.algorithms.PVI(family="full", damping=1.0), linreg_model(), fed, rounds=1, progress=False)
    t = result.summary()
    assert t.title == "posterior summary: PVI"
    pooled = fed.pooled()
    mu, cov = linreg_exact_posterior([pooled[0]], [pooled[1]], 0.5, 1.0)
    np.testing.assert_allclose(t.column("mean"), mu, rtol=2e-3)
    np.testing.assert_allclose(t.column("sd"), np.sqrt(np.diag(cov)), rtol=2e-3)
    np.testing.assert_allclose(np.asarray(result.posterior.sd["w"]), np.sqrt(np.diag(cov)), rtol=2e-3)
