"""Point methods at their defaults: a client SGD rate that follows the curvature, and the distance to
the global posterior mode reported (and warned about) after the last round.

Oracles: conjugate least squares, whose posterior is N(mean, cov) in closed form, so the distance of
any point to the mode in posterior sds is ``max_i |w_i - mean_i| / sd_i`` exactly, and the client's
mean-loss curvature is ``lambda_max(X'X / sigma^2 + I / (K s^2)) / n``.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedprob as fp
from conftest import linreg_exact_posterior, linreg_model, skip_khat_check
from fedprob import convergence
from fedprob.potential import get_potential

SIGMA, PRIOR = 0.5, 10.0


def no_khat():
    """Skip the run's Pareto k-hat check (a test-side speed-up, up to a third of a run): only where a test
    reads neither ``khat``, ``diagnostics()`` nor the run's warnings."""
    return skip_khat_check()


def shifted_clients(seed=7, sizes=(30, 60, 120, 250, 500), shift=1.5, corr=0.7):
    """Least squares over clients of unequal sizes with correlated inputs shifted per client."""
    rng = np.random.default_rng(seed)
    d = 3
    L = np.linalg.cholesky(np.full((d, d), corr) + (1 - corr) * np.eye(d))
    w = np.array([1.5, -1.0, 0.5])
    out = []
    for n in sizes:
        X = (rng.normal(size=(n, d)) @ L.T + rng.normal(scale=shift, size=d)).astype(np.float32)
        out.append((X, (X @ w + SIGMA * rng.normal(size=n)).astype(np.float32)))
    return out


@pytest.fixture(scope="module")
def problem():
    clients = shifted_clients()
    fed = fp.data.FederatedData.from_clients(clients)
    mean, cov = linreg_exact_posterior([c[0] for c in clients], [c[1] for c in clients], SIGMA, PRIOR)
    return clients, fed, mean, cov, linreg_model(PRIOR, SIGMA)


def test_mode_distance_is_the_exact_distance_in_posterior_sds(problem):
    clients, fed, mean, cov, model = problem
    pot = get_potential(model, fed)
    sd = np.sqrt(np.diag(cov))
    data = fed.client_data()
    for shift in ([0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, -2.0, 1.0]):
        w = mean + np.asarray(shift) * sd
        got = convergence.mode_distance(pot, jnp.asarray(w, jnp.float32), data)
        assert got == pytest.approx(max(np.abs(shift)), abs=0.02)


def test_default_fedavg_does_not_diverge_on_badly_scaled_inputs_and_says_it_has_not_converged(problem):
    """A fixed rate 0.1 took the server to 1e25 in 10 rounds here (lambda_max of the mean loss about
    40); the capped rate stays finite and the result says how far it is from the mode."""
    clients, fed, mean, cov, model = problem
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = fp.run(fp.algorithms.FedAvg(), model, fed, progress=False)
    w = np.asarray(r.posterior.mean["w"])
    assert np.all(np.isfinite(w))
    dist = np.max(np.abs(w - mean) / np.sqrt(np.diag(cov)))
    assert r.info["mode_distance_sd"] == pytest.approx(dist, rel=0.05)
    msgs = [str(x.message) for x in rec if "has not converged" in str(x.message)]
    assert len(msgs) == 1 and "FedAvg" in msgs[0] and "posterior sd" in msgs[0]
    rates = r.metric("client_learning_rate")
    assert np.all(rates < 0.1) and np.all(rates > 0)


def test_adapted_rate_is_one_over_the_full_batch_curvature(problem):
    """Full batch: the power iteration's curvature is the exact lambda_max of the mean loss."""
    clients, fed, mean, cov, model = problem
    algo = fp.algorithms.FedAvg(batch_size=None, local_steps=1)
    with no_khat():
        r = fp.run(algo, model, fed, rounds=1, progress=False)
    K = len(clients)
    want = []
    for X, _ in clients:
        X = X.astype(np.float64)
        H = (X.T @ X / SIGMA ** 2 + np.eye(3) / (K * PRIOR ** 2)) / len(X)
        want.append(min(0.1, 1.0 / np.linalg.eigvalsh(H).max()))
    got = np.asarray(r.client_diagnostics[0]["learning_rate"])
    np.testing.assert_allclose(got, want, rtol=0.03)


def test_a_converged_point_does_not_warn_and_a_given_rate_is_used_as_it_is():
    """iid clients, one full-batch step per round at a given rate: FedAvg is then gradient descent on the
    global objective and reaches the mode (distance below 0.3, no warning); with 20 local steps it stops
    at its own fixed point (the clients' optima averaged: client drift), about 1 sd away, and says so.
    A rate given is not capped (no learning_rate diagnostic)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + SIGMA * rng.normal(size=200)).astype(np.float32)
    fed = fp.data.partition(X, y, num_clients=4, scheme="iid", seed=0)
    model = linreg_model(PRIOR, SIGMA)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = fp.run(fp.algorithms.FedAvg(batch_size=None, local_steps=1, learning_rate=0.2), model, fed,
                   rounds=60, progress=False)
    assert r.info["mode_distance_sd"] < 0.05
    assert not [x for x in rec if "has not converged" in str(x.message)]
    assert "learning_rate" not in r.client_diagnostics[0]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        drift = fp.run(fp.algorithms.FedAvg(batch_size=None, local_steps=20, learning_rate=0.05), model, fed,
                       rounds=10, progress=False)
    assert drift.info["mode_distance_sd"] > 0.5
    assert [x for x in rec if "has not converged" in str(x.message)]


def test_diagonal_family_says_how_far_its_sds_are_from_the_full_posterior():
    """FedLap-Cov (the paper's diagonal family) on least squares whose inputs are correlated at 0.9: its
    sds are the conditional ones, well under the exact marginals; the check reports the ratio against the
    full Laplace approximation, which is the exact posterior here, and warns. PVI at its default (full
    family on 3 parameters) has nothing to report."""
    clients = shifted_clients(seed=3, sizes=(100, 200, 300), shift=0.0, corr=0.9)
    fed = fp.data.FederatedData.from_clients(clients)
    mean, cov = linreg_exact_posterior([c[0] for c in clients], [c[1] for c in clients], SIGMA, PRIOR)
    model = linreg_model(PRIOR, SIGMA)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = fp.run(fp.algorithms.FedLapCov(), model, fed, progress=False)
    report = r.info["diagonal_check"]
    ratio = np.asarray(r.posterior.form.variance()) ** 0.5 / np.sqrt(np.diag(cov))
    assert report["sd_ratio_min"] == pytest.approx(ratio.min(), rel=0.02)
    assert report["sd_ratio_max"] == pytest.approx(ratio.max(), rel=0.02)
    assert report["sd_ratio_min"] < 0.6
    assert [x for x in rec if "diagonal Gaussian" in str(x.message) and "FedLapCov" in str(x.message)]
    with no_khat():     # this run's warnings are not read
        full = fp.run(fp.algorithms.PVI(), model, fed, progress=False)
    assert "diagonal_check" not in full.info
    sd = np.sqrt(np.diag(cov))
    assert np.max(np.abs(np.asarray(full.posterior.mean["w"]) - mean) / sd) < 0.05
    np.testing.assert_allclose(np.asarray(full.posterior.sd["w"]) / sd, 1.0, atol=0.05)


def test_diagonal_check_warns_with_a_margin_inside_the_posterior_bound():
    """The check's reference (the full Laplace at the diagonal mean) approximates the marginals: FedLap-Cov on a
    linear regression with an unknown noise scale had sds at 0.80 of pooled NUTS's that read 0.802 against it, and
    went unwarned while the range was [0.8, 1.25]. It warns outside [0.85, 1.18]."""
    from fedprob.convergence import diagonal_message
    report = lambda lo, hi: {"sd_ratio_min": lo, "sd_ratio_max": hi, "mode_distance_sd": 0.02}
    assert diagonal_message("FedLapCov", report(0.802, 1.0)) is not None
    assert diagonal_message("FedLapCov", report(0.95, 1.2)) is not None
    assert diagonal_message("FedLapCov", report(0.86, 1.17)) is None

