"""The diagonal product's bias estimate against the exact posterior (conjugate linear regression).

Clients run diagonal Laplace (``Laplace(hessian="diag")``: the exact client mean and the
diagonal of its exact precision, the mean-field client of a Gaussian target), so the diagonal
product EPMCMC / ConsensusMC form is deterministic and its error against the exact global
posterior (``conftest.linreg_exact_posterior``) is the bias by construction that
:mod:`fedprob.algorithms.diag_bias` estimates.

* 3 clients of 4,000 rows, d = 4, inputs X ~ N(2, 1) (correlations about 0.8) and client
  weights of their own: the diagonal product is 2.5 posterior sd off (measured); the probe is
  exact here (d <= bias_probes), so the estimate equals the measured error (to 1%) and warns.
* 3 iid clients sharing one weight vector, independent inputs: 0.01 sd off, no warning.
* d = 11 with fewer probes than parameters (a lower bound on the Mahalanobis distance of
  the diagonal product's mean from the exact one): 12 shifted clients (7.95 sd off in the
  worst coordinate; bounds 4.4, 7.1, 10.4, 15.6, 17.2 with 2, 4, 6, 8, 10 probes; warns) and
  12 iid clients sharing one weight vector (0.24 sd off; bounds 0.11 to 0.29, no warning).
"""
import warnings

import numpy as np
import pytest
from conftest import linreg_exact_posterior, linreg_model

import fedprob as fp
from fedprob.algorithms.diag_bias import DIAG_BIAS_WARN
from fedprob.algorithms.one_round import aggregate, run_clients
from fedprob.data.federated import FederatedData

SIGMA = 0.5


def clients(kind, seed=0, K=3, n=4000, d=4):
    rng = np.random.default_rng(seed)
    w = 0.5 * rng.normal(size=d)
    out = []
    for _ in range(K):
        if kind == "shifted":          # correlated inputs, each client its own weights
            X, wk = rng.normal(2.0, 1.0, size=(n, d)), 0.5 * rng.normal(size=d)
        else:                          # independent inputs, one weight vector
            X, wk = rng.normal(size=(n, d)), w
        y = X @ wk + SIGMA * rng.normal(size=n)
        out.append((X.astype(np.float32), y.astype(np.float32)))
    return out


def exact(cl):
    m, c = linreg_exact_posterior([X for X, _ in cl], [y for _, y in cl], SIGMA, 1.0)
    return m, np.sqrt(np.diag(c))


def products(cl, prior_weight=1.0, **kw):
    """EPMCMC (or ConsensusMC with prior share 1/K) over diagonal Laplace clients; warnings recorded."""
    fed = FederatedData.from_clients(cl)
    runs = run_clients(fp.inference.Laplace(hessian="diag"), linreg_model(1.0, SIGMA), fed,
                       prior_weight=prior_weight)
    kw = {"family": "diag", **kw}
    algo = fp.algorithms.EPMCMC(**kw) if prior_weight == 1.0 else fp.algorithms.ConsensusMC(**kw)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        post, = aggregate([algo], runs)
    form = post.form
    mean = np.asarray(form.mean()) if prior_weight == 1.0 else np.asarray(form.draws, np.float64).mean(0)
    return post, mean, [str(w.message) for w in ws if "diagonal (mean-field) product" in str(w.message)]


@pytest.mark.parametrize("consensus", [False, True])
def test_shifted_clients_warn_with_the_exact_size(consensus):
    cl = clients("shifted")
    m, sd = exact(cl)
    post, mean, warned = products(cl, 1 / 3 if consensus else 1.0)
    err = np.max(np.abs(mean - m) / sd)
    info = post.info
    assert info["family"] == "diag" and info["diag_bias_exact"] and info["diag_bias_clients_probed"] == 3
    if consensus:      # 1,000 draws of each client Gaussian: Monte Carlo error about 0.03 sd
        assert err > 1.0 and abs(info["diag_bias_sd"] - err) < 0.1, (info["diag_bias_sd"], err)
    else:
        assert err > 1.0 and abs(info["diag_bias_sd"] - err) < 0.01 * err, (info["diag_bias_sd"], err)
        sd_d = np.sqrt(np.diag(np.asarray(post.form.covariance())))
        np.testing.assert_allclose(info["diag_sd_ratio"], np.min(sd_d / sd), rtol=0.01)
    assert len(warned) == 1 and f"{info['diag_bias_sd']:.2g} posterior sd off" in warned[0]
    assert "family='full'" in warned[0]


def test_iid_clients_with_independent_inputs_do_not_warn():
    cl = clients("iid")
    m, sd = exact(cl)
    post, mean, warned = products(cl)
    err = np.max(np.abs(mean - m) / sd)
    assert err < 0.05 and abs(post.info["diag_bias_sd"] - err) < 0.01 and not warned
    assert post.info["diag_bias_sd"] < DIAG_BIAS_WARN


@pytest.mark.slow     # 30 s cold; the warning's exact size is tested in the default run (test_shifted_clients_warn...)
def test_random_probes_bound_the_mahalanobis_bias_from_below():
    """d > bias_probes: the Galerkin value is a lower bound on the exact Mahalanobis distance of the diagonal
    product's mean from the exact one, growing with the number of probes and exact at d probes."""
    for kind, warns in (("shifted", True), ("iid", False)):
        cl = clients(kind, seed=0, K=12, n=2000, d=11)
        m, c = linreg_exact_posterior([X for X, _ in cl], [y for _, y in cl], SIGMA, 1.0)
        bounds = []
        for probes in (4, 8, 11):
            post, mean, warned = products(cl, bias_probes=probes)
            b = mean - m
            mahal = np.sqrt(b @ np.linalg.solve(c, b))
            bounds.append(post.info["diag_bias_mahalanobis"])
            assert post.info["diag_bias_exact"] == (probes == 11)
            assert bounds[-1] <= mahal * 1.01, (kind, probes, bounds[-1], mahal)
            if probes == 8:
                assert bool(warned) == warns and (post.info["diag_bias_sd"] > 5) == warns
        assert bounds[0] < bounds[1] < bounds[2] and bounds[2] == pytest.approx(mahal, rel=0.01)


def test_through_run_in_diagnostics_and_arviz():
    """The engine's client phase sends the probe too; result.diagnostics() and the ArviZ attrs carry it;
    a full family sends none."""
    cl = clients("shifted", n=1000)
    fed = FederatedData.from_clients(cl)
    with pytest.warns(RuntimeWarning, match="diagonal"):
        res = fp.run(fp.algorithms.EPMCMC(client=fp.inference.Laplace(hessian="diag")), linreg_model(1.0, SIGMA),
                     fed, rounds=1, seed=0, progress=False)
    m, sd = exact(cl)
    err = np.max(np.abs(np.ravel(res.posterior.mean["w"]) - m) / sd)
    b = res.posterior.info["diag_bias_sd"]
    assert err > 1 and abs(b - err) < 0.01 * err
    row = res.diagnostics(warn=False).rows[0]
    assert row["scope"] == "global" and row["diag_bias_sd"] == pytest.approx(b)
    attrs = res.to_arviz().attrs
    assert attrs["diag_bias_sd"] == pytest.approx(b)
    # the Monte Carlo check per site beside it: exact Gaussian clients carry no Monte Carlo error
    assert attrs["mc_error_sd_ratio"] == 0.0 and attrs["mc_error_sd_ratio_w"] == 0.0
    assert row["mc_error_sd_ratio"] == 0.0 and row["mc_error_by_site"] == "w: 0"
    full = fp.run(fp.algorithms.EPMCMC(client=fp.inference.Laplace()), linreg_model(1.0, SIGMA), fed, rounds=1,
                  seed=0, progress=False)
    assert "diag_bias_sd" not in full.posterior.info
    np.testing.assert_allclose(np.ravel(full.posterior.mean["w"]), m, atol=0.01 * sd.min())
    off = fp.algorithms.EPMCMC(client=fp.inference.Laplace(hessian="diag"), bias_probes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r0 = fp.run(off, linreg_model(1.0, SIGMA), fed, rounds=1, seed=0, progress=False)
    assert "diag_bias_sd" not in r0.posterior.info
    # no bias check without probes; the diagonal Gaussians of these correlated clients still fail PSIS
    assert not [w for w in caught if "diag_bias_sd" in str(w.message)]
    assert any("k-hat" in str(w.message) and "family='full'" in str(w.message) for w in caught)


def test_bad_probe_count_fails_early():
    with pytest.raises(ValueError, match="bias_probes"):
        fp.algorithms.EPMCMC(family="diag", bias_probes=1)
    with pytest.raises(ValueError, match="bias_probes"):
        fp.algorithms.ConsensusMC(family="diag", bias_probes=-1)
