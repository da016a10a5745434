"""Result.to_arviz: groups, chains per client, honest labels; ArviZ's own statistics run on it."""
import warnings

import numpy as np
import pytest

import fedprob as fp
from fedprob import algorithms as A, inference as I
from fedprob.diagnostics import _az, elpd, group, group_names
from conftest import linreg_exact_posterior, linreg_model

SIGMA = 0.5
# one model object for the module: equal potentials share their compiled client phases and to_arviz's
# compiled per-draw likelihood (the Gaussian and the ensemble posteriors below have the same draw shapes)
MODEL = linreg_model(sigma=SIGMA)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 2)).astype(np.float32)
    y = (X @ np.array([1.0, -0.5]) + SIGMA * rng.normal(size=240)).astype(np.float32)
    fed = fp.data.partition(X[:200], y[:200], num_clients=2, scheme="iid", seed=0)
    return fed, (X[200:], y[200:])


@pytest.fixture(scope="module")
def nuts_result(problem):
    fed, ev = problem
    algo = A.Ensemble(client=I.NUTS(num_warmup=300, num_samples=500, num_chains=4))
    return fp.run(algo, MODEL, fed, eval_data=ev, progress=False)


def test_nuts_four_chains_per_client(problem, nuts_result):
    az = _az()
    fed, ev = problem
    idata = nuts_result.to_arviz()
    assert {"posterior", "client_posterior", "sample_stats", "observed_data", "posterior_predictive",
            "log_likelihood"} <= set(group_names(idata))
    cp = group(idata, "client_posterior")
    assert cp["w"].shape == (4, 500, 2, 2)                      # chain, draw, client, w_dim_0
    # client R-hat is real (4 chains each) and below 1.01 on this conjugate problem
    assert float(az.rhat(cp)["w"].max()) < 1.01
    assert float(az.ess(cp, method="bulk")["w"].min()) > 400
    # each client's draws match its exact local posterior
    for k in range(2):
        m, c = linreg_exact_posterior([fed.client(k)[0]], [fed.client(k)[1]], SIGMA, 1.0)
        w = np.asarray(cp["w"])[:, :, k].reshape(-1, 2)
        assert np.all(np.abs(w.mean(0) - m) / np.sqrt(np.diag(c)) < 0.15)
        assert np.all(np.abs(w.std(0) / np.sqrt(np.diag(c)) - 1) < 0.1)
    summary = az.summary(idata)
    assert np.all(np.isfinite(np.asarray(summary[["mean", "sd", "ess_bulk", "ess_tail", "r_hat"]], float)))
    assert float(summary["r_hat"].max()) < 1.01
    loo = az.loo(idata)
    assert np.isfinite(elpd(loo)) and loo.n_data_points == 40
    ll = group(idata, "log_likelihood")["y"]
    assert ll.shape == (4, 1000, 40)                            # each chain holds both clients' chain c
    st = group(idata, "sample_stats")
    assert st["accept_prob"].shape == (1, 2)
    assert np.all((np.asarray(st["accept_prob"]) > 0.6) & (np.asarray(st["accept_prob"]) < 1))
    assert int(np.asarray(st["num_divergences"]).sum()) == 0 and not np.asarray(st["excluded"]).any()
    np.testing.assert_array_equal(np.asarray(group(idata, "observed_data")["y"]), ev[1])
    assert idata.attrs["kind"] == "ensemble"
    table = nuts_result.diagnostics(warn=False)
    assert [r["scope"] for r in table.rows] == ["global", "client 0", "client 1"]
    assert all(r["rhat"] < 1.01 and r["num_divergences"] == 0 for r in table.rows[1:])
    assert "<table>" in table._repr_html_() and "| scope |" in table._repr_markdown_()


def _bfmi(out):
    """az.bfmi's per-chain values (an array on 0.23, a DataTree or Dataset with ``energy`` on 1.x)."""
    return np.asarray(out if isinstance(out, np.ndarray) else out["energy"], np.float64)


def test_per_draw_statistics_beside_the_client_draws(problem, nuts_result, tmp_path):
    """client_sample_stats holds NUTS's per-draw statistics (chain, draw, client), aligned with
    client_posterior; the per-round scalars are their summaries; one client's view is an ordinary
    ArviZ run (az.bfmi, az.summary)."""
    from fedprob.arviz_io import client_view

    az = _az()
    fed, _ = problem
    idata = nuts_result.to_arviz()
    cs = group(idata, "client_sample_stats")
    assert set(cs.data_vars) == {"diverging", "acceptance_rate", "step_size", "n_steps", "tree_depth", "energy", "lp"}
    assert all(cs[v].dims == ("chain", "draw", "client") and cs[v].shape == (4, 500, 2) for v in cs.data_vars)
    assert cs["diverging"].dtype == bool
    st = group(idata, "sample_stats")
    assert st["accept_prob"].dims == ("round", "client")
    np.testing.assert_array_equal(np.asarray(cs["diverging"]).sum((0, 1)), np.asarray(st["num_divergences"])[0])
    np.testing.assert_allclose(np.asarray(cs["acceptance_rate"]).mean((0, 1)), np.asarray(st["accept_prob"])[0],
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cs["n_steps"]).mean((0, 1)), np.asarray(st["num_steps"])[0], rtol=1e-5)
    # lp is each draw's log posterior: minus the conjugate one by hand, one constant per client
    cp = group(idata, "client_posterior")
    for k in range(2):
        X, y = (np.asarray(a, np.float64) for a in fed.client(k))
        w = np.asarray(cp["w"], np.float64)[:, :, k]                                 # (chain, draw, 2)
        r = y - np.einsum("nd,csd->csn", X, w)
        hand = -0.5 * (r ** 2).sum(-1) / SIGMA ** 2 - 0.5 * (w ** 2).sum(-1)
        gap = np.asarray(cs["lp"], np.float64)[:, :, k] - hand
        assert np.ptp(gap) < 1e-2, np.ptp(gap)
    one = client_view(idata, 1)
    assert group(one, "posterior")["w"].shape == (4, 500, 2)
    e = np.asarray(group(one, "sample_stats")["energy"], np.float64)                # (chain, draw)
    bfmi = _bfmi(az.bfmi(one))
    np.testing.assert_allclose(bfmi, np.square(np.diff(e, axis=1)).mean(1) / e.var(1, ddof=1), rtol=1e-5)
    assert np.all(bfmi > 0.5)                                  # a Gaussian target: no energy problem
    summary = az.summary(one)
    assert np.all(np.isfinite(np.asarray(summary[["ess_bulk", "r_hat"]], float)))
    with pytest.raises(ValueError, match="client 5 has no draws"):
        client_view(idata, 5)
    # NetCDF round trip (a run directory's posterior.nc): every group, booleans stay booleans
    from fedprob.diagnostics import from_netcdf, to_netcdf

    to_netcdf(idata, tmp_path / "posterior.nc")
    back = from_netcdf(tmp_path / "posterior.nc")
    assert set(group_names(back)) == set(group_names(idata))
    back_cs = group(back, "client_sample_stats")
    assert back_cs["diverging"].dtype == bool
    for v in cs.data_vars:
        np.testing.assert_array_equal(np.asarray(back_cs[v]), np.asarray(cs[v]))
    np.testing.assert_array_equal(np.asarray(group(back, "client_posterior")["w"]), np.asarray(cp["w"]))
    assert back.attrs["kind"] == "ensemble"


def test_point_estimate_is_one_draw_and_gaussian_gives_independent_chains(problem):
    az = _az()
    fed, ev = problem
    model = MODEL
    fa = fp.run(A.FedAvg(local_epochs=1, learning_rate=0.5), model, fed, rounds=2, eval_data=ev, progress=False)
    idata = fa.to_arviz()
    post = group(idata, "posterior")
    assert post["w"].shape == (1, 1, 2) and post.attrs["kind"] == "point estimate"
    assert "log_likelihood" not in group_names(idata)             # no draws: az.loo does not apply
    assert group(idata, "sample_stats")["participated"].shape == (2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isnan(np.asarray(az.ess(post)["w"])).all() or np.asarray(az.ess(post)["w"]).max() <= 1
    ep = fp.run(A.EPMCMC(client=I.Laplace()), model, fed, eval_data=ev, progress=False)
    idata = ep.to_arviz(num_draws=4000, num_chains=4)
    post = group(idata, "posterior")
    assert post["w"].shape == (4, 1000, 2) and post.attrs["kind"] == "gaussian"
    assert float(az.rhat(post)["w"].max()) < 1.01
    assert float(az.ess(post)["w"].min()) > 3000                  # independent draws: ESS about 4000
    m, c = linreg_exact_posterior([fed.client(k)[0] for k in range(2)], [fed.client(k)[1] for k in range(2)],
                                  SIGMA, 1.0)
    w = np.asarray(post["w"]).reshape(-1, 2)
    assert np.all(np.abs(w.mean(0) - m) / np.sqrt(np.diag(c)) < 0.15)
    assert np.isfinite(elpd(az.loo(idata)))


def test_predictive_space_method_has_no_parameter_posterior(problem):
    fed, ev = problem
    pb = fp.run(A.PredictiveBayes(client=I.Laplace()), MODEL, fed, eval_data=ev, progress=False)
    idata = pb.to_arviz(num_draws=300)
    names = group_names(idata)
    assert "posterior" not in names and "log_likelihood" not in names
    assert "predictive space" in idata.attrs["no_posterior"]
    pp = group(idata, "posterior_predictive")["y"]
    assert pp.shape == (1, 300, 40)
    mean, var = pb.posterior.predict(ev[0])
    # the draws come from the pooled predictive: their mean and sd match it
    z = (np.asarray(pp)[0].mean(0) - np.asarray(mean)) / np.sqrt(np.asarray(var) / 300)
    assert np.abs(z).max() < 4.5
    assert group(idata, "client_posterior")["w"].shape[2] == 2


def test_num_chains_validation():
    from fedprob.protocols import num_chains

    assert num_chains(I.NUTS()) == 1 and num_chains(I.NUTS(num_chains=3)) == 3
    with pytest.raises(ValueError, match="num_chains"):
        num_chains(I.NUTS(num_chains=0))
    with pytest.raises(ValueError, match="positive integer"):
        num_chains(I.HMC(num_chains=1.5))


@pytest.mark.slow
def test_fedpa_posterior_is_its_gaussian_at_the_server_point(problem):
    az = _az()
    fed, ev = problem
    pa = fp.run(A.FedPA(), MODEL, fed, rounds=3, eval_data=ev, progress=False)   # IASG clients, 2 burn-in rounds
    idata = pa.to_arviz(num_draws=4000, num_chains=4)
    post = group(idata, "posterior")
    assert post["w"].shape == (4, 1000, 2) and idata.attrs["kind"] == "gaussian"
    assert "FedPA" in post.attrs["description"] and "server point" in post.attrs["description"]
    assert "client_posterior" not in group_names(idata)          # the server keeps no client draws
    w = np.asarray(post["w"]).reshape(-1, 2)
    centre = np.asarray(pa.server_state.params)
    sd = np.sqrt(np.asarray(pa.posterior.form.variance()))
    assert np.all(np.abs(w.mean(0) - centre) / sd < 0.1)         # 4000 independent draws: 4 MC sds is 0.06
    assert np.all(np.abs(w.std(0) / sd - 1) < 0.06)
    assert float(az.rhat(post)["w"].max()) < 1.01
    assert group(idata, "sample_stats")["participated"].shape == (3, 2)


def test_sgmcmc_backend_runs_several_chains_per_client(problem):
    """SG-MCMC clients run num_chains independent chains (vmapped): client R-hat is computed over them."""
    az = _az()
    fed, ev = problem
    sampler = I.SGHMC(num_burnin=300, num_samples=200, batch_size=None, num_chains=3)
    r = fp.run(A.Ensemble(client=sampler), MODEL, fed, progress=False)
    idata = r.to_arviz()
    cp = group(idata, "client_posterior")
    assert cp["w"].shape[:1] == (3,) and cp["w"].shape[2:] == (2, 2)     # chain, draw, client, w_dim_0
    w = np.asarray(cp["w"])
    assert not np.allclose(w[0], w[1])                                     # independent chains
    # per draw: the step that made the draw (constant after burn-in: the round's step size) and a
    # gradient-noise ratio of 0 (full batch)
    cs = group(idata, "client_sample_stats")
    assert set(cs.data_vars) == {"step_size", "gradient_noise_ratio"}
    assert cs["step_size"].dims == ("chain", "draw", "client") and cs["step_size"].shape == cp["w"].shape[:3]
    steps = np.asarray(cs["step_size"])
    np.testing.assert_allclose(steps, np.broadcast_to(steps[:, :1], steps.shape), rtol=1e-6)
    np.testing.assert_allclose(steps.mean((0, 1)), np.asarray(group(idata, "sample_stats")["step_size"])[0],
                               rtol=1e-5)
    assert np.all(np.asarray(cs["gradient_noise_ratio"]) == 0)
    assert float(az.rhat(cp)["w"].max()) < 1.05
    for k in range(2):
        m, c = linreg_exact_posterior([fed.client(k)[0]], [fed.client(k)[1]], SIGMA, 1.0)
        assert np.all(np.abs(w[:, :, k].reshape(-1, 2).mean(0) - m) / np.sqrt(np.diag(c)) < 0.3)


def test_consensus_keeps_the_clients_chains_for_rhat(problem):
    """ConsensusMC over 4-chain NUTS clients: the combined draws keep the chains (chain c combines every
    client's chain c), so the global R-hat is real, and the draws match the exact pooled posterior."""
    az = _az()
    fed, _ = problem
    algo = A.ConsensusMC(client=I.NUTS(num_warmup=300, num_samples=500, num_chains=4))
    r = fp.run(algo, MODEL, fed, progress=False)
    assert r.posterior.info["num_chains"] == 4
    post = group(r.to_arviz(), "posterior")
    assert post["w"].shape == (4, 500, 2)
    rhat = np.asarray(az.rhat(post)["w"])
    assert np.all(np.isfinite(rhat)) and rhat.max() < 1.01
    m, c = linreg_exact_posterior([fed.client(k)[0] for k in range(2)], [fed.client(k)[1] for k in range(2)],
                                  SIGMA, 1.0)
    w = np.asarray(post["w"]).reshape(-1, 2)
    assert np.all(np.abs(w.mean(0) - m) / np.sqrt(np.diag(c)) < 0.1)
    row = r.diagnostics(warn=False).rows[0]
    assert row["scope"] == "global" and np.isfinite(row["rhat"]) and row["rhat"] < 1.01


def test_local_sites_have_a_client_dim():
    """Client-local sites (tests/test_local_sites.py's normal-normal hierarchy, PVI exact in one round):
    posterior holds a local site with dims (chain, draw, client), jointly with the global draws;
    az.summary gives one row per client, as result.summary() labels them; the evaluation rows are a new
    client's (its local site from the prior given each global draw); a point estimate's local values are
    one draw."""
    from scipy.stats import norm
    from test_local_sites import TAU, exact_joint, federation, normal_normal

    az = _az()
    fed, clients = federation()
    mean, cov = exact_joint(clients)
    sd = np.sqrt(np.diag(cov))
    r = fp.run(A.PVI(client=I.Laplace(hessian="full"), damping=1.0), normal_normal, fed, rounds=1, progress=False)
    X, y = np.zeros((5, 1)), np.linspace(0.0, 3.0, 5)
    idata = r.to_arviz(num_draws=4000, eval_data=(X, y))
    post = group(idata, "posterior")
    assert post["a"].dims == ("chain", "draw", "client") and post["a"].shape == (4, 1000, 8)
    assert post["mu"].dims == ("chain", "draw")
    np.testing.assert_array_equal(np.asarray(post["client"]), np.arange(8))
    a, mu = np.asarray(post["a"]).reshape(-1, 8), np.asarray(post["mu"]).reshape(-1)
    assert np.all(np.abs(a.mean(0) - mean[1:]) < 4 * sd[1:] / np.sqrt(4000))
    assert np.all(np.abs(a.std(0) / sd[1:] - 1) < 0.06)
    for k in (0, 7):                                  # drawn jointly: the exact mu - a_k correlation
        assert abs(np.corrcoef(mu, a[:, k])[0, 1] - cov[0, k + 1] / (sd[0] * sd[k + 1])) < 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = az.summary(idata)
    labels = [f"a[{k}]" for k in range(8)]
    assert set(s.index) == set(labels) | {"mu"} == {row["parameter"] for row in r.summary().rows}
    np.testing.assert_allclose(np.asarray(s.loc[labels, "mean"], float), mean[1:], atol=4 * sd.max() / np.sqrt(4000))
    ll = np.asarray(group(idata, "log_likelihood")["y"])
    assert ll.shape == (4, 1000, 5)
    dens = np.exp(ll).reshape(-1, 5).mean(0)          # a new client: y ~ N(mu, 1 + var(mu) + tau^2)
    np.testing.assert_allclose(dens, norm.pdf(y, mean[0], np.sqrt(1 + cov[0, 0] + TAU ** 2)), rtol=0.05)
    fa = fp.run(A.FedAvg(local_steps=5, batch_size=None), normal_normal, fed, rounds=2, progress=False)
    pa = group(fa.to_arviz(), "posterior")
    assert pa["a"].shape == (1, 1, 8)
    np.testing.assert_allclose(np.asarray(pa["a"])[0, 0], fa.posterior.local_mean["a"], rtol=1e-6)
