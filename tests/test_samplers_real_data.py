"""Every client sampler against a NUTS reference on real data.

Problem: Bayesian logistic regression (``fp.models.logistic_regression()``,
prior N(0, 1) on the weights and the bias) on the embedded digits, training
rows of classes 1 (y = 0) and 8 (y = 1): n = 284 rows, the 64 pixels reduced
to their first 5 principal components (numpy SVD of the centred rows) and
standardised, so d = 6 parameters. The pair is not separable (the MAP
classifies 94.7% of the rows), so the posterior is proper and
likelihood-driven; it is mildly skewed: the MAP of the second weight sits
0.39 posterior sd from its posterior mean. One client holds all rows
(a one-client ``FederatedData``, ``make_target`` with prior weight 1).

Oracles, in order of trust:

* an importance-sampling estimate of the posterior mean and sd in numpy
  float64 (multivariate t_5 proposal at the Laplace approximation, 10^5
  draws, effective sample size about 7 10^4): Monte Carlo error below
  0.01 sd. It checks the reference;
* the reference: NUTS (``fp.inference.NUTS``), 4 chains vmapped
  (CI: 1000 draws each; slow: 5000 each);
* the exact MAP and Hessian (Newton's method in float64) for Laplace and for
  IASG's quadratic-model covariance.

Each sampler runs 4 chains (vmapped runs with different keys) and is
compared per coordinate: ``z = (mean - ref_mean) / ref_sd`` and
``ratio = sd / ref_sd``. Tolerances are stated next to each sampler; they
are about 4 Monte Carlo standard errors of the run lengths used plus the
method's known bias (the step-size bias of SG-MCMC at
``step_size * lambda_max = 0.1`` is a few per cent in the sd).

Step sizes are given explicitly as fractions of ``1 / lambda_max`` (the
largest eigenvalue of the negative Hessian of the log posterior at the MAP,
29.4 here): these tests check each update rule, not the default step-size
heuristics (the ESS target is off: ``target_ess=0``). The default run keeps NUTS's
reference and the SGLD chain (about 20 s, mostly compiles); SGHMC, cyclical SGHMC
and the long runs are marked slow.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import fedprob as fp
from fedprob.data.federated import FederatedData
from fedprob.inference import IASG, NUTS, SGHMC, SGLD, SVI, CyclicalSGHMC, Laplace
from fedprob.inference.iasg import iasg_calibrated_step_size, iasg_sample_covariance
from fedprob.posteriors import Gaussian, Samples
from fedprob.potential import Potential, make_target

CLASSES = (1, 8)
NUM_COMPONENTS = 5
NUM_CHAINS = 4
BATCH = 64


# -- the problem and its oracles ---------------------------------------------------------------

def digits_pair(classes=CLASSES, k=NUM_COMPONENTS):
    """(Z, y): training digits of two classes, first k principal components, standardised."""
    ds = fp.data.load_digits()
    X, y = ds.X_train, ds.y_train
    keep = (y == classes[0]) | (y == classes[1])
    Xk = X[keep].astype(np.float64)
    yk = (y[keep] == classes[1]).astype(np.int32)
    Xc = Xk - Xk.mean(0)
    _, _, Vt = np.linalg.svd(Xc, full_matrices=False)
    Z = Xc @ Vt[:k].T
    return (Z / Z.std(0)).astype(np.float32), yk


def newton_map(Z, y, prior_scale=1.0, iters=50):
    """(MAP, negative Hessian of the log posterior at the MAP) in float64; columns [Z, 1]."""
    Zb = np.hstack([Z.astype(np.float64), np.ones((len(Z), 1))])
    w = np.zeros(Zb.shape[1])
    eye = np.eye(len(w)) / prior_scale ** 2
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-Zb @ w))
        H = (Zb * (p * (1 - p))[:, None]).T @ Zb + eye
        w = w + np.linalg.solve(H, Zb.T @ (y - p) - eye @ w)
    p = 1.0 / (1.0 + np.exp(-Zb @ w))
    return w, (Zb * (p * (1 - p))[:, None]).T @ Zb + eye, Zb


def importance_oracle(Zb, y, w_map, H, num_draws=100_000, nu=5.0, seed=0, chunk=10_000):
    """Posterior mean, sd and ESS by self-normalised importance sampling (t_nu proposal at the Laplace fit)."""
    rng = np.random.default_rng(seed)
    d = len(w_map)
    L = np.linalg.cholesky(np.linalg.inv(H))
    draws, logw = [], []
    for _ in range(num_draws // chunk):
        e = rng.normal(size=(chunk, d)) / np.sqrt(rng.chisquare(nu, size=chunk) / nu)[:, None]
        th = w_map + e @ L.T
        logits = th @ Zb.T
        log_post = np.sum(y * logits - np.logaddexp(0.0, logits), 1) - 0.5 * np.sum(th ** 2, 1)
        log_q = -0.5 * (nu + d) * np.log1p(np.sum(e ** 2, 1) / nu)
        draws.append(th)
        logw.append(log_post - log_q)
    th, lw = np.concatenate(draws), np.concatenate(logw)
    wt = np.exp(lw - lw.max())
    wt /= wt.sum()
    mean = wt @ th
    return mean, np.sqrt(wt @ (th - mean) ** 2), 1.0 / np.sum(wt ** 2)


@pytest.fixture(scope="module")
def problem():
    Z, y = digits_pair()
    fed = FederatedData.from_clients([(Z, y)], num_classes=2)
    model = fp.models.logistic_regression()
    pot = Potential(model, fed.X[0], fed.y[0])
    data = jax.tree_util.tree_map(lambda a: a[0], fed.client_data())
    target = make_target(data, pot.dim)
    w_map, H, Zb = newton_map(Z, y)
    mean, sd, ess = importance_oracle(Zb, y, w_map, H)
    lam_max = float(np.linalg.eigvalsh(H).max())
    return dict(Z=Z, y=y, Zb=Zb, pot=pot, target=target, n=len(y), map=w_map, H=H,
                is_mean=mean, is_sd=sd, is_ess=ess, lam_max=lam_max)


def run_chains(backend, problem, seed, init=None, num_chains=NUM_CHAINS):
    """``backend.run`` vmapped over ``num_chains`` keys on the one client (one compile per backend)."""
    pot, target = problem["pot"], problem["target"]
    z0 = jnp.zeros((pot.dim,)) if init is None else jnp.asarray(init, jnp.float32)
    fn = jax.jit(jax.vmap(lambda k: backend.run(k, pot, target, z0)))
    return fn(jax.random.split(jax.random.PRNGKey(seed), num_chains))


def pooled_draws(result) -> np.ndarray:
    assert isinstance(result.posterior, Samples)
    assert np.all(np.asarray(result.diagnostics["finite"]))
    d = np.asarray(result.posterior.draws, np.float64)
    return d.reshape(-1, d.shape[-1])


def gaussian_moments(g: Gaussian):
    P = np.asarray(g.precision, np.float64)
    cov = np.linalg.inv(P) if P.ndim == 2 else np.diag(1.0 / P)
    return cov @ np.asarray(g.linear, np.float64), cov


def check_moments(name, mean, sd, ref_mean, ref_sd, mean_tol, ratio_range):
    z = (np.asarray(mean) - ref_mean) / ref_sd
    ratio = np.asarray(sd) / ref_sd
    lo, hi = ratio_range
    assert np.all(np.abs(z) < mean_tol), f"{name}: (mean - ref) / ref_sd = {np.round(z, 3)} (tol {mean_tol})"
    assert np.all((ratio > lo) & (ratio < hi)), f"{name}: sd / ref_sd = {np.round(ratio, 3)} (range {ratio_range})"


# -- the reference -----------------------------------------------------------------------------

NUTS_CI = NUTS(num_warmup=500, num_samples=1000)
NUTS_LONG = NUTS(num_warmup=1000, num_samples=5000)


@pytest.fixture(scope="module")
def reference(problem):
    """CI reference: 4 NUTS chains x 1000 draws (about 3500 effective draws)."""
    d = pooled_draws(run_chains(NUTS_CI, problem, seed=100))
    return d.mean(0), d.std(0, ddof=1)


def test_problem_is_not_separable_and_oracle_is_accurate(problem):
    Zb, y, w = problem["Zb"], problem["y"], problem["map"]
    acc = np.mean((Zb @ w > 0) == (y == 1))
    assert 0.9 < acc < 0.99          # not separable: the likelihood alone has a finite maximiser
    assert problem["is_ess"] > 30_000
    # the posterior is skewed: MAP and mean differ by a visible fraction of an sd
    assert np.max(np.abs(w - problem["is_mean"]) / problem["is_sd"]) > 0.2


def test_nuts_reference_matches_importance_oracle(problem, reference):
    """NUTS (4 x 1000 draws) vs the float64 importance-sampling oracle: mean 0.1 sd, sd 7%."""
    mean, sd = reference
    check_moments("NUTS", mean, sd, problem["is_mean"], problem["is_sd"], 0.1, (0.93, 1.07))


# -- SG-MCMC samplers vs the reference ---------------------------------------------------------
# name -> (backend factory of (n, lam_max), mean tolerance in ref sds, sd ratio range)
# SGLD: eps = 0.1 / lam_max; SGHMC: eta = 0.005 / lam_max with friction 0.1 (moves like SGLD
# with 2 eta / alpha = 0.1 / lam_max); minibatches of 64 rows (gradient noise adds a few per
# cent to the variance). Runs: 4 chains x (2000 burn-in + 20000 steps).

SG_SAMPLERS = {
    "SGLD": (lambda lam: SGLD(step_size=0.1 / lam, num_burnin=2000, num_samples=2000, thinning=10,
                              batch_size=BATCH, init_strategy="zeros", target_ess=0), 0.35, (0.8, 1.25)),
    "SGHMC": (lambda lam: SGHMC(step_size=0.005 / lam, friction=0.1, num_burnin=2000, num_samples=2000,
                                thinning=10, batch_size=BATCH, init_strategy="zeros", target_ess=0), 0.35, (0.8, 1.25)),
    # Cyclical SGHMC draws from the end of each cycle, where the step has decayed: the
    # sampling phase must be long against the mixing time, hence exploration = 0.5 and
    # C = 2000 (with the default exploration 0.8 the draws come out too narrow on this
    # problem, sd ratio about 0.7: see the slow test). eta0 = 0.02 / lam_max.
    "CyclicalSGHMC": (lambda lam: CyclicalSGHMC(step_size=0.02 / lam, num_cycles=10, cycle_length=2000,
                                                exploration=0.5, samples_per_cycle=50, batch_size=BATCH,
                                                init_strategy="zeros", target_ess=0), 0.4, (0.75, 1.3)),
}


#: SGLD stays in the default run; SGHMC and cyclical SGHMC run here in the slow run only (about 4 s each of
#: compiling and running; their update rules are checked against exact posteriors in the default run by
#: test_sgmcmc.py::test_sampler_matches_exact_posterior, and on this problem against the long NUTS reference
#: by test_long_sgmcmc_matches_long_nuts).
@pytest.mark.parametrize("name", [n if n == "SGLD" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in SG_SAMPLERS])
def test_sgmcmc_matches_nuts_reference(problem, reference, name):
    make, mean_tol, ratio_range = SG_SAMPLERS[name]
    d = pooled_draws(run_chains(make(problem["lam_max"]), problem, seed=1))
    check_moments(name, d.mean(0), d.std(0, ddof=1), *reference, mean_tol, ratio_range)


# -- IASG ----------------------------------------------------------------------------------------
# IASG is SGD on the mean loss; its draws are NOT posterior draws at a generic step size: their
# spread is set by the learning rate and batch size (a posterior tempered by n), and their
# covariance has the shape of the SGD stationary law, not of the posterior. What it promises,
# tested here: started at the mode, the draws stay centred on the mode and their covariance is
# the exact stationary covariance of the quadratic model (``iasg_sample_covariance`` with the
# mean-loss Hessian A = H / n and the per-point gradient covariance C at the MAP).

def per_point_grad_cov(problem):
    Zb, y, w = problem["Zb"], problem["y"], problem["map"]
    p = 1.0 / (1.0 + np.exp(-Zb @ w))
    return np.cov((Zb * (y - p)[:, None]).T, bias=True)


def check_iasg(problem, lr, b, K, num_samples, seed, sd_range):
    """IASG draws (4 chains from the MAP) whose sds match the quadratic-model prediction."""
    A = problem["H"] / problem["n"]
    pred_sd = np.sqrt(np.diag(iasg_sample_covariance(A, per_point_grad_cov(problem), lr, b, K)))
    backend = IASG(step_size=lr, num_burnin=500, steps_per_sample=K, num_samples=num_samples, batch_size=b)
    d = pooled_draws(run_chains(backend, problem, seed=seed, init=problem["map"]))
    ratio = d.std(0, ddof=1) / pred_sd
    assert np.all((ratio > sd_range[0]) & (ratio < sd_range[1])), f"IASG sd / quadratic-model sd = {ratio}"
    return d


def test_iasg_draws_follow_the_sgd_stationary_law(problem, reference):
    """lr = 0.1 / lam_max(A) (quadratic regime), b = 32, K = 5: sds within 15% of the exact
    quadratic-model prediction; mean within 0.15 posterior sd of the MAP (SGD on a non-quadratic
    loss drifts by O(lr): 0.06 sd here); and (the tempered-scale caveat) the draws are far
    narrower than the posterior at this step size (sd ratio 0.15 to 0.45)."""
    lam_A = problem["lam_max"] / problem["n"]
    d = check_iasg(problem, lr=0.1 / lam_A, b=32, K=5, num_samples=2000, seed=2, sd_range=(0.85, 1.15))
    off = (d.mean(0) - problem["map"]) / reference[1]
    assert np.all(np.abs(off) < 0.15), f"IASG (mean - MAP) / posterior sd = {off}"
    assert np.all(d.std(0) / reference[1] < 0.6)


# -- Gaussian approximations -----------------------------------------------------------------

def test_laplace_matches_newton_and_reference(problem, reference):
    """Laplace = N(MAP, H^-1) exactly (float32 tolerances); against NUTS its mean is off by the
    MAP-vs-mean skew (0.39 sd on one coordinate: tolerance 0.5 sd) and its sds within 10%."""
    res = jax.jit(lambda k: Laplace().run(k, problem["pot"], problem["target"], jnp.zeros(6)))(
        jax.random.PRNGKey(0))
    mean, cov = gaussian_moments(res.posterior)
    np.testing.assert_allclose(mean, problem["map"], atol=2e-3)
    np.testing.assert_allclose(cov, np.linalg.inv(problem["H"]), rtol=1e-2, atol=1e-4)
    check_moments("Laplace", mean, np.sqrt(np.diag(cov)), *reference, 0.5, (0.9, 1.1))


def test_svi_full_matches_reference(problem, reference):
    """SVI with a full-covariance Gaussian guide (2000 Adam steps, 1 particle): mean within 0.3
    sd (the ELBO's single-particle noise leaves about 0.15 sd), sds within 15% (VI under-disperses
    slightly)."""
    svi = SVI(guide="full")
    res = jax.jit(lambda k: svi.run(k, problem["pot"], problem["target"], jnp.zeros(6)))(
        jax.random.PRNGKey(0))
    mean, cov = gaussian_moments(res.posterior)
    check_moments("SVI(full)", mean, np.sqrt(np.diag(cov)), *reference, 0.3, (0.85, 1.1))


# -- slow: long runs --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_reference(problem):
    """Slow reference: 4 NUTS chains x 5000 draws (about 18000 effective draws)."""
    d = pooled_draws(run_chains(NUTS_LONG, problem, seed=200))
    mean, sd = d.mean(0), d.std(0, ddof=1)
    check_moments("long NUTS vs IS", mean, sd, problem["is_mean"], problem["is_sd"], 0.05, (0.97, 1.03))
    return mean, sd


LONG_SAMPLERS = {
    # 4 chains x (5000 burn-in + 100000 steps): Monte Carlo error about 0.03 sd; what is left is
    # the step-size and minibatch bias.
    "SGLD": (SGLD, dict(step_size=0.1, num_burnin=5000, num_samples=10000, thinning=10,
                        batch_size=BATCH), 0.15, (0.9, 1.12)),
    "SGHMC": (SGHMC, dict(step_size=0.005, num_burnin=5000, num_samples=10000, thinning=10,
                          batch_size=BATCH), 0.15, (0.9, 1.12)),
    # pSGLD (RMSprop metric, Gamma term dropped): a few per cent wider.
    "pSGLD": (SGLD, dict(step_size=0.1, num_burnin=5000, num_samples=10000, thinning=10, batch_size=BATCH,
                         preconditioner="rmsprop"), 0.2, (0.9, 1.15)),
    "CyclicalSGHMC": (CyclicalSGHMC, dict(step_size=0.02, num_cycles=50, cycle_length=2000, exploration=0.5,
                                          samples_per_cycle=50, batch_size=BATCH), 0.2, (0.85, 1.15)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LONG_SAMPLERS))
def test_long_sgmcmc_matches_long_nuts(problem, long_reference, name):
    cls, kw, mean_tol, ratio_range = LONG_SAMPLERS[name]
    kw = dict(kw, step_size=kw["step_size"] / problem["lam_max"], init_strategy="zeros", target_ess=0)
    d = pooled_draws(run_chains(cls(**kw), problem, seed=3))
    check_moments(name, d.mean(0), d.std(0, ddof=1), *long_reference, mean_tol, ratio_range)


@pytest.mark.slow
def test_short_nuts_matches_long_nuts(problem, long_reference):
    """2 chains x 500 draws after 300 warmup: mean within 0.2 sd, sd within 15%."""
    d = pooled_draws(run_chains(NUTS(num_warmup=300, num_samples=500), problem, seed=4, num_chains=2))
    check_moments("short NUTS", d.mean(0), d.std(0, ddof=1), *long_reference, 0.2, (0.85, 1.15))


@pytest.mark.slow
def test_cyclical_sghmc_default_exploration_underdisperses(problem, long_reference):
    """Documented limitation: exploration = 0.8 leaves too short a noisy phase at this step size."""
    be = CyclicalSGHMC(step_size=0.02 / problem["lam_max"], num_cycles=20, cycle_length=2000,
                       samples_per_cycle=50, batch_size=BATCH, init_strategy="zeros", target_ess=0,
                       exploration=0.8)
    d = pooled_draws(run_chains(be, problem, seed=5))
    assert np.min(d.std(0, ddof=1) / long_reference[1]) < 0.85


@pytest.mark.slow
def test_iasg_calibrated_step_matches_posterior_trace(problem, long_reference):
    """With ``iasg_calibrated_step_size`` (K = 1, b = 32, target H^-1) the total variance of the
    draws matches the posterior's within 25%; the per-coordinate sds only within a factor 3
    (the SGD stationary covariance is near isotropic when C ~ A, the posterior's is H^-1); the
    quadratic-model prediction holds within 25% (the step is large: nonlinearity) and the mean
    lies within 0.4 posterior sd of the reference mean."""
    n, H = problem["n"], problem["H"]
    lr = iasg_calibrated_step_size(H / n, per_point_grad_cov(problem), 32, np.linalg.inv(H), 1)
    d = check_iasg(problem, lr=lr, b=32, K=1, num_samples=20000, seed=6, sd_range=(0.8, 1.25))
    # at this large step the iterates' mean leaves the MAP (towards the posterior mean)
    z = (d.mean(0) - long_reference[0]) / long_reference[1]
    assert np.all(np.abs(z) < 0.4), f"IASG calibrated: (mean - ref) / ref_sd = {z}"
    var_ratio = np.sum(d.var(0)) / np.sum(long_reference[1] ** 2)
    assert 0.75 < var_ratio < 1.33, var_ratio
    ratio = d.std(0) / long_reference[1]
    assert np.all((ratio > 0.3) & (ratio < 3.0)), ratio


@pytest.mark.slow
def test_svi_full_many_particles_matches_long_nuts(problem, long_reference):
    svi = SVI(guide="full", num_steps=5000, num_particles=4)
    res = jax.jit(lambda k: svi.run(k, problem["pot"], problem["target"], jnp.zeros(6)))(
        jax.random.PRNGKey(0))
    mean, cov = gaussian_moments(res.posterior)
    check_moments("SVI(full, 4 particles)", mean, np.sqrt(np.diag(cov)), *long_reference, 0.1, (0.9, 1.05))


DEFAULT_SAMPLERS = {
    "SGLD": SGLD(batch_size=BATCH, num_samples=1000),
    "SGHMC": SGHMC(batch_size=BATCH, num_samples=1000),
    "pSGLD": SGLD(batch_size=BATCH, num_samples=1000, preconditioner="rmsprop"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DEFAULT_SAMPLERS))
def test_default_step_sizes_match_long_nuts(problem, long_reference, name):
    """Out of the box (adapted step size; only the batch size and draw count
    set): mean within 0.3 sd, sds within [0.85, 1.2] (the default rate trades a few per cent of
    over-dispersion for mixing)."""
    d = pooled_draws(run_chains(DEFAULT_SAMPLERS[name], problem, seed=7))
    check_moments(f"{name} defaults", d.mean(0), d.std(0, ddof=1), *long_reference, 0.3, (0.85, 1.2))
