"""fedprob.gaussian against dense numpy computations and exact Gaussian facts."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedprob import gaussian as gauss
from fedprob.posteriors import Gaussian


def oas_correlation_numpy(x):
    """OAS shrinkage of the correlations of draws x (S, d) toward 0, written out in float64."""
    x = np.asarray(x, np.float64)
    S, d = x.shape
    C = np.cov(x.T)
    sd = np.sqrt(np.diag(C))
    R = C / np.outer(sd, sd)
    a = np.mean(R ** 2)                         # tr(R^2) / d^2, mean eigenvalue 1
    rho = min(1.0, (a + 1.0) / ((S + 1.0) * (a - 1.0 / d)))
    return (1 - rho) * C + rho * np.diag(np.diag(C)), rho


def random_spd(rng, d, scales=None):
    A = rng.normal(size=(d, d))
    C = A @ A.T / d + 0.1 * np.eye(d)
    if scales is not None:
        C = C * np.outer(scales, scales)
    return C


def test_shrinkage_covariance_matches_numpy_and_keeps_variances():
    rng = np.random.default_rng(0)
    scales = np.array([1e-3, 1.0, 10.0, 0.1, 3.0, 1e-2])        # very different coordinate scales
    C = random_spd(rng, 6, scales)
    for S in (4, 6, 50, 2000):
        x = rng.multivariate_normal(np.zeros(6), C, size=S)
        want, rho = oas_correlation_numpy(x)
        got, got_rho = gauss.shrinkage_covariance(jnp.asarray(x, jnp.float32))
        np.testing.assert_allclose(float(got_rho), rho, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=1e-12)
        np.testing.assert_allclose(np.diag(np.asarray(got)), np.diag(np.cov(x.T)), rtol=1e-4)   # marginals kept
        assert np.linalg.eigvalsh(want / np.outer(scales, scales)).min() > 0                  # PD even for S <= d
    # independent coordinates: the correlations are pure noise and are shrunk away completely
    x = rng.normal(size=(8, 6)) * scales
    assert float(gauss.shrinkage_covariance(x)[1]) == 1.0
    # batched over a leading client axis
    xs = rng.normal(size=(3, 40, 6))
    got, rhos = gauss.shrinkage_covariance(xs)
    for k in range(3):
        np.testing.assert_allclose(np.asarray(got[k]), oas_correlation_numpy(xs[k])[0], rtol=1e-4, atol=1e-7)


def test_moment_match_shrinks_only_with_few_draws_and_warns():
    rng = np.random.default_rng(1)
    d = 20
    C = random_spd(rng, d)
    x = rng.multivariate_normal(np.zeros(d), C, size=10)
    with pytest.warns(RuntimeWarning, match="200 draws"):
        g = gauss.moment_match(jnp.asarray(x), jitter=0.0)
    np.testing.assert_allclose(np.asarray(jnp.linalg.inv(g.precision)), oas_correlation_numpy(x)[0], rtol=2e-3,
                               atol=1e-6)
    # S >= 10 d: the plain sample covariance (plus the relative jitter), no warning
    x = rng.multivariate_normal(np.zeros(d), C, size=400)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = gauss.moment_match(jnp.asarray(x))
    cov = np.cov(x.T)
    cov = cov + 1e-6 * np.mean(np.diag(cov)) * np.eye(d)
    np.testing.assert_allclose(np.asarray(g.mean()), x.mean(0), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jnp.linalg.inv(g.precision)), cov, rtol=2e-3, atol=2e-5)
    # the diagonal form never warns and keeps the sample variances
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gd = gauss.moment_match(jnp.asarray(x[:5]), diag=True, jitter=0.0)
    np.testing.assert_allclose(1 / np.asarray(gd.precision), x[:5].var(0, ddof=1), rtol=1e-4)
    with pytest.raises(ValueError, match="at least 2 draws"):
        gauss.moment_match(jnp.asarray(x[:1]))


def test_natural_sum_masks_nan_clients_and_guarded_product():
    rng = np.random.default_rng(2)
    Ps = np.stack([random_spd(rng, 3) for _ in range(4)])
    ms = rng.normal(size=(4, 3))
    stack = gauss.from_mean_precision(jnp.asarray(ms), jnp.asarray(Ps))
    np.testing.assert_allclose(np.asarray(stack.linear), np.einsum("kij,kj->ki", Ps, ms), rtol=1e-5)
    lin = np.asarray(stack.linear).copy()
    lin[1] = np.nan
    mask = np.array([True, False, True, True])
    s = gauss.natural_sum(Gaussian(jnp.asarray(lin), jnp.asarray(Ps)), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(s.precision), Ps[mask].sum(0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s.linear), np.einsum("kij,kj->i", Ps[mask], ms[mask]), rtol=1e-4)
    # product with a prior power, stacked or pre-summed: the same
    prior = Gaussian(jnp.zeros(3), jnp.eye(3))
    g1, i1 = gauss.guarded_product(stack, prior, -1.0)
    g2, _ = gauss.guarded_product(gauss.natural_sum(stack), prior, -1.0, stacked=False)
    np.testing.assert_allclose(np.asarray(g1.precision), Ps.sum(0) - np.eye(3), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g2.mean()), np.asarray(g1.mean()), rtol=1e-5)
    assert i1["fallback"] is None
    np.testing.assert_array_equal(np.asarray(gauss.is_valid(stack)), True)
    assert not bool(gauss.is_valid(Gaussian(jnp.zeros(3), -jnp.eye(3))))
    assert not bool(gauss.is_valid(Gaussian(jnp.zeros(2), jnp.array([1.0, jnp.nan]))))


def test_kl_divergence_full_and_diag_against_formula():
    rng = np.random.default_rng(3)
    d = 4
    Cq, Cp = random_spd(rng, d), random_spd(rng, d)
    mq, mp = rng.normal(size=d), rng.normal(size=d)
    Pp = np.linalg.inv(Cp)
    want = 0.5 * (np.trace(Pp @ Cq) + (mp - mq) @ Pp @ (mp - mq) - d
                  + np.linalg.slogdet(Cp)[1] - np.linalg.slogdet(Cq)[1])
    q, p = Gaussian.from_moments(mq, Cq), Gaussian.from_moments(mp, Cp)
    np.testing.assert_allclose(float(gauss.kl_divergence(q, p)), want, rtol=1e-4)
    assert abs(float(gauss.kl_divergence(q, q))) < 1e-4
    vq, vp = np.diag(Cq), np.diag(Cp)
    want_d = 0.5 * np.sum(vq / vp + (mp - mq) ** 2 / vp - 1 + np.log(vp / vq))
    qd, pd = Gaussian.from_moments(mq, vq), Gaussian.from_moments(mp, vp)
    np.testing.assert_allclose(float(gauss.kl_divergence(qd, pd)), want_d, rtol=1e-5)
    np.testing.assert_allclose(float(gauss.kl_divergence(qd, pd.to_full())), want_d, rtol=1e-4)


def test_monte_carlo_error_of_a_product_mean_matches_repeated_sampling():
    """Clients with iid draws (ESS = S): the predicted sd of the product's mean equals the empirical one."""
    rng = np.random.default_rng(4)
    K, d, S, reps = 4, 3, 25, 4000
    covs = np.stack([random_spd(rng, d) for _ in range(K)])
    Ps = np.linalg.inv(covs)
    P = Ps.sum(0) - 2.0 * np.eye(d) * 0.1                         # a prior power taken out, as EP-MCMC does
    # product means over repeated sampling (exact client precisions: only the means carry MC error)
    means = np.stack([rng.multivariate_normal(np.zeros(d), covs[k] / S, size=reps) for k in range(K)])
    prod = np.linalg.solve(P, np.einsum("kij,krj->ir", Ps, means)).T           # (reps, d)
    empirical = prod.std(0) / np.sqrt(np.diag(np.linalg.inv(P)))
    ess = jnp.full((d,), float(S))
    M = sum(gauss.mean_error_term(jnp.asarray(Ps[k]), jnp.asarray(covs[k]), ess) for k in range(K))
    predicted = np.asarray(gauss.relative_mean_error(jnp.asarray(P), M))
    np.testing.assert_allclose(predicted, empirical, rtol=0.06)
    # diagonal form: M = sum_k P_k / ESS_k elementwise
    v = np.stack([np.diag(c) for c in covs])
    Md = sum(gauss.mean_error_term(jnp.asarray(1 / v[k]), jnp.asarray(v[k]), ess) for k in range(K))
    np.testing.assert_allclose(np.asarray(Md), (1 / v).sum(0) / S, rtol=1e-5)
    Pd = (1 / v).sum(0)
    np.testing.assert_allclose(np.asarray(gauss.relative_mean_error(jnp.asarray(Pd), Md)), np.full(d, S ** -0.5),
                               rtol=1e-5)
    # an exact Gaussian client (ESS infinite) adds nothing
    assert float(jnp.max(jnp.abs(gauss.mean_error_term(jnp.asarray(Ps[0]), jnp.asarray(covs[0]),
                                                       jnp.full((d,), jnp.inf))))) == 0.0


def test_prior_draws_and_sample_moments():
    g = Gaussian.from_moments(jnp.array([1.0, -2.0]), jnp.array([[2.0, 0.6], [0.6, 0.5]]))
    x = np.asarray(g.sample(jax.random.PRNGKey(0), 20000), np.float64)
    np.testing.assert_allclose(x.mean(0), [1.0, -2.0], atol=0.03)
    np.testing.assert_allclose(np.cov(x.T), [[2.0, 0.6], [0.6, 0.5]], rtol=0.05, atol=0.01)
    lp = float(g.log_prob(jnp.array([1.0, -2.0])))
    np.testing.assert_allclose(lp, -np.log(2 * np.pi) - 0.5 * np.log(2.0 * 0.5 - 0.36), rtol=1e-5)
