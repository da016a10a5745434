"""Differential privacy: clipping bound, noise on the aggregate, and the accountant's epsilon."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

dp_accounting = pytest.importorskip("dp_accounting")

import fedprob as fp  # noqa: E402
from fedprob import privacy  # noqa: E402
from conftest import linreg_model  # noqa: E402

MODEL = linreg_model(prior_scale=1.0, sigma=0.5)
FEDAVG = fp.algorithms.FedAvg(local_steps=5, batch_size=None, learning_rate=0.1)


def make_fed(K=5, seed=0):
    rng = np.random.default_rng(seed)
    cl = []
    for _ in range(K):
        X = rng.normal(size=(10, 2))
        cl.append((X, X @ np.array([2.0, -2.0]) + 0.5 * rng.normal(size=10)))
    return fp.data.FederatedData.from_clients(cl)


def test_privatize_clips_each_update_and_puts_sigma_c_noise_on_the_sum():
    d = 4000
    rng = np.random.default_rng(0)
    norms = np.array([3.0, 0.5, 10.0, 1.0])
    u = rng.normal(size=(4, d))
    msgs = jnp.asarray(u / np.linalg.norm(u, axis=1, keepdims=True) * norms[:, None], jnp.float32)
    mask = jnp.array([True, True, True, True])
    clipped = privacy.privatize(FEDAVG, None, msgs, mask, jax.random.PRNGKey(0), privacy.GaussianDP(1.0, 0.0))
    np.testing.assert_allclose(np.linalg.norm(np.asarray(clipped), axis=1), np.minimum(norms, 1.0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(clipped[1]), np.asarray(msgs[1]), rtol=1e-6)   # under the bound: as is
    noisy = privacy.privatize(FEDAVG, None, msgs, mask, jax.random.PRNGKey(0), privacy.GaussianDP(1.0, 2.0))
    noise_sum = np.asarray(noisy - clipped).sum(0)
    assert np.std(noise_sum) == pytest.approx(2.0 * 1.0, rel=0.05)        # sigma * C on the sum
    assert abs(np.mean(noise_sum)) < 0.1


def test_fedavg_server_steps_respect_the_clipping_bound():
    fed, C = make_fed(), 0.05
    free = fp.run(FEDAVG, MODEL, fed, rounds=3, seed=0, progress=False)
    dp = fp.run(FEDAVG, MODEL, fed, rounds=3, seed=0, progress=False,
                privacy=privacy.GaussianDP(clip_norm=C, noise_multiplier=0.0))
    w0 = np.zeros(2)              # FedAvg starts at the prior centre
    path = [w0]
    for t in (1, 2, 3):        # the server point after each round (same seed: the same rounds)
        path.append(np.asarray(fp.run(FEDAVG, MODEL, fed, rounds=t, seed=0, progress=False,
                                      privacy=privacy.GaussianDP(clip_norm=C, noise_multiplier=0.0)
                                      ).server_state[0]))
    steps = np.linalg.norm(np.diff(np.stack(path), axis=0), axis=1)
    assert np.linalg.norm(np.asarray(free.server_state[0]) - w0) > 10 * C   # clipping had work to do
    # server SGD at learning rate 1 moves by the mean of clipped deltas: at most C per round
    assert steps.max() <= C * (1 + 1e-5)
    assert steps.min() > 0.8 * C              # every client was clipped and they point the same way
    assert all(h["dp_epsilon"] == np.inf for h in dp.history)               # no noise: no guarantee


def test_epsilon_in_history_matches_dp_accounting():
    fed = make_fed(K=5)
    sigma, delta, rounds, M = 1.1, 1e-5, 4, 2
    r = fp.run(FEDAVG, MODEL, fed, rounds=rounds, seed=0, progress=False, clients_per_round=M,
               privacy=privacy.GaussianDP(clip_norm=0.5, noise_multiplier=sigma, delta=delta))
    for t, h in enumerate(r.history, 1):
        acc = dp_accounting.rdp.RdpAccountant(list(privacy.ORDERS))
        acc.compose(dp_accounting.PoissonSampledDpEvent(M / 5, dp_accounting.GaussianDpEvent(sigma)), t)
        assert h["dp_epsilon"] == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
        assert h["dp_delta"] == delta
    eps = r.metric("dp_epsilon")
    assert np.all(np.diff(eps) > 0)
    # the tighter PLD accountant agrees within the RDP conversion's slack
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.PoissonSampledDpEvent(M / 5, dp_accounting.GaussianDpEvent(sigma)), rounds)
    assert pld.get_epsilon(delta) <= eps[-1] <= 1.5 * pld.get_epsilon(delta)
    assert np.all(np.isfinite(np.asarray(r.server_state[0])))


def test_privacy_options_are_validated_and_unsupported_algorithms_refused():
    with pytest.raises(ValueError, match="clip_norm must be a positive"):
        privacy.GaussianDP(clip_norm=0.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="delta must lie in"):
        privacy.GaussianDP(clip_norm=1.0, noise_multiplier=1.0, delta=0.0)
    with pytest.raises(ValueError, match="EPMCMC does not name an update to clip"):
        fp.run(fp.algorithms.EPMCMC(), MODEL, make_fed(), rounds=1, progress=False,
               privacy=privacy.GaussianDP(1.0, 1.0))
    with pytest.raises(TypeError, match="GaussianDP"):
        fp.run(FEDAVG, MODEL, make_fed(), rounds=1, progress=False, privacy={"clip_norm": 1.0})
    # FedPA sends only its clipped delta: the precision diagonal becomes the data-independent 1
    u, prec = fp.algorithms.FedPA().with_update(None, (jnp.ones(3), jnp.full(3, 7.0)), jnp.zeros(3))
    np.testing.assert_array_equal(np.asarray(prec), np.ones(3))
    np.testing.assert_array_equal(np.asarray(u), np.zeros(3))


def test_natural_parameter_deltas_are_clipped_and_noised():
    """Natural-parameter servers use only the deltas lambda_k - lambda_g: every aggregated delta is
    clipped to norm C, so PVI's site sum moves by at most gamma M' C per round; BayesADMM (whose
    server also averages the client posteriors) is private too (that with no noise and a bound that
    never binds it is the plain run, and that the bound binds, is
    test_bayes_admm_with_a_bound_that_never_binds_is_the_plain_run, slow); damping="size" needs private
    sizes at the server and is refused."""
    fed = make_fed()
    K = fed.num_clients
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(t)])
    algo = fp.algorithms.PVI(damping=1.0)
    plain = fp.run(algo, MODEL, fed, rounds=1, progress=False)
    C = 0.5
    dp = fp.run(algo, MODEL, fed, rounds=1, progress=False,
                privacy=privacy.GaussianDP(clip_norm=C, noise_multiplier=1e-3))
    assert np.linalg.norm(flat(dp.server_state.site_sum)) <= K * C * 1.01
    assert np.linalg.norm(flat(plain.server_state.site_sum)) > 10 * K * C   # the bound binds
    assert np.isfinite(dp.history[-1]["dp_epsilon"]) and dp.history[-1]["dp_delta"] == 1e-5

    admm = fp.algorithms.BayesADMM()
    tight = fp.run(admm, MODEL, fed, rounds=1, progress=False,
                   privacy=privacy.GaussianDP(clip_norm=C, noise_multiplier=0.0))
    s0 = tight.history[0]
    gamma, alpha = admm.damping, 1.0 / (1.0 + admm.rho * K)
    # site sum: at most gamma K C; the server moves from the prior by at most (1 - alpha) C + alpha gamma K C
    assert np.linalg.norm(flat(tight.server_state.site_sum)) <= gamma * K * C * 1.001
    prior = flat(tight.server_state.prior)
    moved = np.linalg.norm(flat(tight.server_state.lam) - prior)
    assert 0.5 * C * (1 - alpha) < moved <= ((1 - alpha) * C + alpha * gamma * K * C) * 1.001
    assert s0["dp_delta"] == 1e-5
    with pytest.raises(ValueError, match="PVI names no update to clip"):
        fp.run(fp.algorithms.PVI(damping="size"), MODEL, fed, rounds=1, progress=False,
               privacy=privacy.GaussianDP(clip_norm=C, noise_multiplier=1.0))


@pytest.mark.slow
def test_bayes_admm_with_a_bound_that_never_binds_is_the_plain_run():
    """BayesADMM with no noise and a clipping bound that never binds is the plain run, and the plain run
    moves the server more than 10 C from the prior (the bound of test_natural_parameter_deltas_are_clipped_and_noised
    binds)."""
    fed = make_fed()
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(t)])
    admm, C = fp.algorithms.BayesADMM(), 0.5
    ref = fp.run(admm, MODEL, fed, rounds=3, progress=False)
    loose = fp.run(admm, MODEL, fed, rounds=3, progress=False,
                   privacy=privacy.GaussianDP(clip_norm=1e12, noise_multiplier=0.0))
    # float32 sums in another order (full precision matrix, the default family here): 2e-5 relative
    np.testing.assert_allclose(flat(loose.server_state.lam), flat(ref.server_state.lam), rtol=1e-4, atol=1e-6)
    assert np.linalg.norm(flat(ref.server_state.lam) - flat(ref.server_state.prior)) > 10 * C
