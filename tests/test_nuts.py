"""Full-batch NUTS/HMC clients against exact conjugate posteriors.

Bayesian linear regression with known noise: w ~ N(0, s^2 I), y ~ N(X w, sigma^2)
has the exact posterior of ``conftest.linreg_exact_posterior``. Tolerances:
means within 0.15 posterior sd and marginal sds within 10% (2000 draws: the
Monte Carlo error of a mean is about 0.035 sd, of an sd about 3%).
"""
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import linreg_exact_posterior, linreg_model

from fedprob.data.federated import FederatedData
from fedprob.inference import HMC, NUTS, Laplace
from fedprob.posteriors import Samples
from fedprob.potential import ClientData, Potential, make_target

PRIOR, SIGMA, D = 1.0, 0.5, 3
SIZES = (10, 25, 40)
W_TRUE = np.array([1.0, -0.5, 0.3])


linreg = linreg_model(PRIOR, SIGMA)


def logreg(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.fixture(scope="module")
def fed():
    rng = np.random.default_rng(0)
    clients = []
    for n in SIZES:
        X = rng.normal(size=(n, D))
        clients.append((X, X @ W_TRUE + SIGMA * rng.normal(size=n)))
    return clients, FederatedData.from_clients(clients)


@pytest.fixture(scope="module")
def setup(fed):
    clients, fd = fed
    pot = Potential(linreg, fd.X[0], fd.y[0])
    return clients, fd.client_data(), pot


NUTS_CI = NUTS(num_warmup=300, num_samples=2000)


@pytest.fixture(scope="module")
def run_nuts(setup):
    """One compiled vmapped NUTS run over the 3 clients; targets are arguments."""
    _, _, pot = setup
    return jax.jit(lambda key, targets, inits: NUTS_CI.run_clients(key, pot, targets, inits))


def check_against(draws, mean, cov, mean_tol=0.15, sd_tol=0.10):
    draws = np.asarray(draws, np.float64)
    sd = np.sqrt(np.diag(cov))
    z = (draws.mean(0) - mean) / sd
    ratio = draws.std(0, ddof=1) / sd
    assert np.all(np.abs(z) < mean_tol), f"mean error / sd = {z}"
    assert np.all(np.abs(ratio - 1) < sd_tol), f"sd ratio = {ratio}"


def targets_for(cd, pot, **kw):
    return jax.vmap(lambda d: make_target(d, pot.dim, **kw))(cd)


def test_nuts_vmap_clients_match_their_exact_posteriors(setup, run_nuts):
    clients, cd, pot = setup
    res = run_nuts(jax.random.PRNGKey(0), targets_for(cd, pot), jnp.zeros((len(SIZES), D)))
    assert isinstance(res.posterior, Samples)
    assert res.posterior.draws.shape == (len(SIZES), 2000, D)
    assert res.params.shape == (len(SIZES), D)
    for k, (X, y) in enumerate(clients):
        mean, cov = linreg_exact_posterior([X], [y], SIGMA, PRIOR)
        check_against(res.posterior.draws[k], mean, cov)
    diag = res.diagnostics
    for name in ("accept_prob", "num_divergences", "num_warmup_divergences", "num_steps",
                 "tree_depth", "step_size", "finite"):
        assert diag[name].shape == (len(SIZES),), name
    assert np.all(diag["finite"])
    assert np.all(diag["num_divergences"] == 0)
    # dual averaging targets 0.8; the realised mean acceptance sits near it
    assert np.all((diag["accept_prob"] > 0.6) & (diag["accept_prob"] < 1.0))
    assert np.all(diag["step_size"] > 0.05)
    # a whitened 3-d Gaussian needs only shallow trees
    assert np.all((diag["tree_depth"] >= 1) & (diag["tree_depth"] <= 5))
    assert np.all(diag["num_steps"] >= 1)


def test_nuts_subposterior_prior_weight(setup, run_nuts):
    """prior_weight = 1/K: p0(w)^(1/K) p(D_k|w) is the posterior under prior N(0, K s^2 I)."""
    clients, cd, pot = setup
    K = len(SIZES)
    res = run_nuts(jax.random.PRNGKey(1), targets_for(cd, pot, prior_weight=1.0 / K),
                   jnp.zeros((K, D)))
    for k, (X, y) in enumerate(clients):
        mean, cov = linreg_exact_posterior([X], [y], SIGMA, PRIOR * np.sqrt(K))
        check_against(res.posterior.draws[k], mean, cov)


def test_nuts_gaussian_term_gives_exact_product(setup, run_nuts):
    """linear . z - z' diag(lam) z / 2 multiplies the posterior by a Gaussian factor."""
    clients, cd, pot = setup
    K = len(SIZES)
    lam = jnp.array([4.0, 1.0, 9.0])
    lin = jnp.array([2.0, -1.0, 0.5])
    targets = targets_for(cd, pot, linear=lin, precision=lam)
    res = run_nuts(jax.random.PRNGKey(2), targets, jnp.zeros((K, D)))
    for k, (X, y) in enumerate(clients):
        P = np.eye(D) / PRIOR ** 2 + X.T @ X / SIGMA ** 2 + np.diag(np.asarray(lam))
        b = X.T @ y / SIGMA ** 2 + np.asarray(lin)
        cov = np.linalg.inv(P)
        check_against(res.posterior.draws[k], cov @ b, cov)


def test_hmc_vmap_clients(setup):
    clients, cd, pot = setup
    hmc = HMC(num_warmup=300, num_samples=2000)
    res = jax.jit(lambda k, t, z: hmc.run_clients(k, pot, t, z))(
        jax.random.PRNGKey(3), targets_for(cd, pot), jnp.zeros((len(SIZES), D)))
    for k, (X, y) in enumerate(clients):
        mean, cov = linreg_exact_posterior([X], [y], SIGMA, PRIOR)
        check_against(res.posterior.draws[k], mean, cov)
    assert np.all(res.diagnostics["num_divergences"] == 0)
    assert "tree_depth" not in res.diagnostics


def test_nuts_single_client_dense_mass_thinning(fed):
    """Unbatched run on the pooled data, dense mass matrix, thinning 2, float32 padded client."""
    clients, _ = fed
    X = np.concatenate([c[0] for c in clients])
    y = np.concatenate([c[1] for c in clients])
    pot = Potential(linreg, X, y)
    data = ClientData(jnp.asarray(np.vstack([X, X[:5]]), jnp.float32),
                      jnp.asarray(np.concatenate([y, y[:5]]), jnp.float32), jnp.asarray(len(y)))
    b = NUTS(num_warmup=300, num_samples=1000, dense_mass=True, thinning=2)
    res = jax.jit(lambda k, t, z: b.run(k, pot, t, z))(
        jax.random.PRNGKey(4), make_target(data, D), jnp.zeros(D))
    assert res.posterior.draws.shape == (1000, D)
    mean, cov = linreg_exact_posterior([X], [y], SIGMA, PRIOR)
    check_against(res.posterior.draws, mean, cov)
    # the draws' correlation follows the exact one (dense posterior)
    corr = np.corrcoef(np.asarray(res.posterior.draws, np.float64).T)
    exact = cov / np.sqrt(np.outer(np.diag(cov), np.diag(cov)))
    np.testing.assert_allclose(corr, exact, atol=0.1)


def test_nuts_and_laplace_agree_on_logistic_regression():
    rng = np.random.default_rng(5)
    n, d = 300, 3
    X = rng.normal(size=(n, d))
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))).astype(np.int32)
    pot = Potential(logreg, X, y)
    target = make_target(ClientData(jnp.asarray(X, jnp.float32), jnp.asarray(y), jnp.asarray(n)), d)
    nuts = NUTS(num_warmup=300, num_samples=2000)
    res = jax.jit(lambda k, t, z: nuts.run(k, pot, t, z))(jax.random.PRNGKey(6), target, jnp.zeros(d))
    lap = jax.jit(lambda k, t, z: Laplace(hessian="ggn").run(k, pot, t, z))(
        jax.random.PRNGKey(7), target, jnp.zeros(d))
    draws = np.asarray(res.posterior.draws, np.float64)
    sd = draws.std(0, ddof=1)
    lap_mean = np.asarray(lap.posterior.mean())
    lap_sd = np.sqrt(np.asarray(lap.posterior.variance()))
    # n = 300, d = 3: the posterior is close to Gaussian; the Laplace mean is the mode
    assert np.all(np.abs(lap_mean - draws.mean(0)) < 0.2 * sd), (lap_mean, draws.mean(0), sd)
    assert np.all(np.abs(lap_sd / sd - 1) < 0.15), (lap_sd, sd)
    assert int(res.diagnostics["num_divergences"]) == 0


def test_bad_hyperparameters_fail_early():
    with pytest.raises(ValueError, match="num_samples"):
        NUTS(num_samples=0)
    with pytest.raises(ValueError, match="target_accept_prob"):
        NUTS(target_accept_prob=1.0)
    with pytest.raises(ValueError, match="thinning"):
        NUTS(thinning=0)
    with pytest.raises(ValueError, match="max_tree_depth"):
        NUTS(max_tree_depth=0)
    with pytest.raises(ValueError, match="num_steps or trajectory_length"):
        HMC(num_steps=None, trajectory_length=None)
    with pytest.raises(ValueError, match="jitter"):
        HMC(jitter=1.5)


def test_per_draw_statistics_are_numpyros_own(setup):
    """A fixed step too long for the stiffest direction (0.3 against a posterior sd of 0.16) diverges
    now and then: the per-draw statistics equal NumPyro's own record of the same chain
    (``fori_collect`` over its HMC kernel from the same key), divergences counted transition by
    transition; ``run_chains`` gives them as (chains, draws)."""
    from numpyro.infer.hmc import hmc
    from numpyro.util import fori_collect

    from fedprob.protocols import DRAW_STATS, run_chains

    _, cd, pot = setup
    target = make_target(jax.tree_util.tree_map(lambda a: a[0], cd), pot.dim)
    S, step = 300, 0.3
    nuts = NUTS(num_warmup=0, num_samples=S, step_size=step, adapt_step_size=False, adapt_mass_matrix=False)
    key = jax.random.PRNGKey(0)
    res = jax.jit(lambda k: run_chains(nuts, k, pot, target, jnp.zeros(D)))(key)     # one chain: nuts.run
    assert set(res.diagnostics[DRAW_STATS]) == {"diverging", "acceptance_rate", "step_size", "n_steps",
                                                "tree_depth", "energy", "lp"}
    assert all(v.shape == (1, S) for v in res.diagnostics[DRAW_STATS].values())
    ours = {k: np.asarray(v)[0] for k, v in res.diagnostics[DRAW_STATS].items()}
    init_kernel, sample_kernel = hmc(potential_fn=lambda z: -pot.log_density(z, target), algo="NUTS")
    state = init_kernel(jnp.zeros(D), num_warmup=0, step_size=step, adapt_step_size=False,
                        adapt_mass_matrix=False, rng_key=jax.random.split(key, 3)[0])
    div, acc, n, energy, pe = fori_collect(
        0, S, sample_kernel, state, progbar=False,
        transform=lambda s: (s.diverging, s.accept_prob, s.num_steps, s.energy, s.potential_energy))
    assert 0 < div.sum() < S // 4                                  # a few divergences, not all
    np.testing.assert_array_equal(ours["diverging"], np.asarray(div))
    assert ours["diverging"].sum() == int(res.diagnostics["num_divergences"])
    np.testing.assert_array_equal(ours["n_steps"], np.asarray(n))
    np.testing.assert_allclose(ours["acceptance_rate"], np.asarray(acc), rtol=1e-5)
    np.testing.assert_allclose(ours["energy"], np.asarray(energy), rtol=1e-5)
    np.testing.assert_allclose(ours["lp"], -np.asarray(pe), rtol=1e-5)
    np.testing.assert_array_equal(ours["tree_depth"], np.floor(np.log2(np.asarray(n))).astype(int) + 1)
    np.testing.assert_array_equal(ours["step_size"], np.full(S, step, np.float32))
    # the log density of every kept draw (draws and statistics stay aligned)
    lp = jax.vmap(lambda z: pot.log_density(z, target))(res.posterior.draws)
    np.testing.assert_allclose(ours["lp"], np.asarray(lp), rtol=1e-5)
