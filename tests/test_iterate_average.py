"""Iterate averaging of the natural loop's server Gaussian (``iterate_average``, BayesADMM's "auto"):
the recursion against its closed-form weights, the rule that switches it on, and the average against
the exact posterior of a conjugate model whose clients' solves are stochastic."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import linreg_exact_posterior, linreg_model, skip_khat_check

import fedprob as fp
from fedprob.algorithms import BayesADMM, NaturalLoop
from fedprob.algorithms.base import Context
from fedprob.algorithms.natural import AUTO_AVERAGE_ETA, average_step
from fedprob.inference import IVON, Laplace
from fedprob.posteriors import Gaussian
from fedprob.potential import get_potential


def no_khat():
    """Skip the run's Pareto k-hat check (a test-side speed-up, up to a third of a run): the tests below
    silence its warning and read neither ``khat`` nor ``diagnostics()``."""
    return skip_khat_check()


def closed_form_weights(t, eta):
    """Round s's weight in avg_t for an integer eta: (eta + 1) prod_j (s + j - 1) / prod_j (t + j)."""
    s = np.arange(1, t + 1, dtype=np.float64)
    num = np.prod([s + j - 1 for j in range(1, eta + 1)], axis=0) if eta else np.ones_like(s)
    den = np.prod([t + j for j in range(0, eta + 1)])
    return (eta + 1) * num / den


@pytest.mark.parametrize("eta", [0, 1, 3, 7])
def test_average_step_is_the_polynomial_decay_average(eta):
    rng = np.random.default_rng(eta)
    xs = rng.normal(size=(40, 5))
    avg = np.zeros(5)
    for t, x in enumerate(xs, start=1):
        avg = avg + average_step(t, float(eta)) * (x - avg)
        w = closed_form_weights(t, eta)
        np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-12)
        np.testing.assert_allclose(avg, w @ xs[:t], rtol=1e-10, atol=1e-12)
    if eta == 0:
        np.testing.assert_allclose(avg, xs.mean(0), rtol=1e-12)
    # weights grow like s^eta: the last round weighs (eta + 1) / t, the mean age is about t / (eta + 2)
    w = closed_form_weights(40, eta)
    np.testing.assert_allclose(w[-1], (eta + 1) / (40 + eta), rtol=1e-12)
    assert abs(float(w @ (40 - np.arange(1, 41))) - 40 / (eta + 2)) < 1.0


def linreg(sizes, seed=0, d=3, sigma=0.5):
    rng = np.random.default_rng(seed)
    Xs = [(rng.normal(size=(n, d)) + rng.normal(size=d)).astype(np.float32) for n in sizes]
    w = np.array([1.0, -2.0, 0.5])[:d]
    ys = [(X @ w + sigma * rng.normal(size=n)).astype(np.float32) for X, n in zip(Xs, sizes)]
    return Xs, ys, fp.data.FederatedData.from_clients(list(zip(Xs, ys)))


def test_the_server_keeps_the_average_of_its_own_iterates():
    """server_update on arbitrary deltas: the average it keeps is the closed-form weighting of the
    lambda_g it produced, round by round; the loop's own state is untouched by it."""
    Xs, ys, fed = linreg([30, 50, 80])
    pot = get_potential(linreg_model(), fed)
    ctx = Context(pot, fed.num_clients, np.asarray(fed.sizes), fed.num_rows)
    plain, averaged = (NaturalLoop(family="diag", alpha="admm", damping=0.2, iterate_average=a) for a in (None, 2))
    s_plain, _ = plain.init(ctx, jax.random.PRNGKey(0), fed.client_data())
    s_avg, _ = averaged.init(ctx, jax.random.PRNGKey(0), fed.client_data())
    assert s_plain.average is None and float(s_avg.rounds) == 0.0
    rng = np.random.default_rng(1)
    lams, mask = [], jnp.ones(3, bool)
    for t in range(1, 9):
        delta = Gaussian(jnp.asarray(rng.normal(size=(3, 3)), jnp.float32),
                         jnp.asarray(rng.uniform(0.5, 2.0, size=(3, 3)), jnp.float32))
        msg = (delta, jnp.zeros((3, 3), jnp.float32))
        s_plain = plain.server_update(ctx, s_plain, msg, jnp.asarray(fed.sizes), mask)
        s_avg = averaged.server_update(ctx, s_avg, msg, jnp.asarray(fed.sizes), mask)
        np.testing.assert_array_equal(np.asarray(s_avg.lam.linear), np.asarray(s_plain.lam.linear))
        lams.append(s_avg.lam)
        w = closed_form_weights(t, 2)
        for part in ("linear", "precision"):
            want = w @ np.stack([np.asarray(getattr(l, part), np.float64) for l in lams])
            np.testing.assert_allclose(np.asarray(getattr(s_avg.average, part)), want, rtol=2e-5, atol=1e-5)
    assert float(s_avg.rounds) == 8.0
    np.testing.assert_array_equal(np.asarray(s_avg.reported.linear), np.asarray(s_avg.average.linear))
    np.testing.assert_array_equal(np.asarray(s_plain.reported.linear), np.asarray(s_plain.lam.linear))


def test_auto_averages_where_the_clients_search_their_modes_on_minibatches():
    Xs, ys, fed = linreg([30, 50, 80])
    pot = get_potential(linreg_model(), fed)
    ctx = Context(pot, fed.num_clients, np.asarray(fed.sizes), fed.num_rows)
    eta = lambda algo: algo.loop().average_eta(ctx)
    assert eta(BayesADMM()) is None                                  # full-batch L-BFGS: exact solves
    assert eta(BayesADMM(client=Laplace(batch_size=80))) is None     # a "minibatch" of every row
    assert eta(BayesADMM(client=Laplace(batch_size=16))) == AUTO_AVERAGE_ETA
    assert eta(BayesADMM(client=IVON())) is None                      # measured: lag outweighs its noise
    assert eta(BayesADMM(iterate_average=3, client=IVON())) == 3.0
    assert eta(BayesADMM(iterate_average=None, client=Laplace(batch_size=16))) is None
    assert eta(BayesADMM(iterate_average=5)) == 5.0
    assert NaturalLoop().iterate_average is None                     # PVI and the others: unchanged
    # the default on a network: the Fashion-MNIST MLP's 178,110 weights on clients of 1,000 rows search
    # their modes on minibatches of 128 (a full gradient would be 1.8e8 row-parameters)
    rng = np.random.default_rng(0)
    net = fp.data.FederatedData.from_clients(
        [(rng.normal(size=(1000, 784)).astype(np.float32), rng.integers(0, 10, 1000)) for _ in range(2)])
    mlp = get_potential(fp.models.bnn_mlp((200, 100), num_classes=10, activation="sigmoid"), net)
    assert mlp.dim == 178_110
    big = Context(mlp, 2, np.asarray(net.sizes), net.num_rows)
    assert BayesADMM().for_model(mlp).loop().average_eta(big) == AUTO_AVERAGE_ETA
    assert fp.algorithms.PVI().for_model(mlp).loop().average_eta(big) is None
    with pytest.raises(ValueError, match="iterate_average"):
        BayesADMM(iterate_average="yes")
    with pytest.raises(ValueError, match="iterate_average"):
        BayesADMM(iterate_average=-1.0)


def test_bayes_admm_reports_the_average_nearer_the_exact_posterior_than_its_last_rounds(tmp_path):
    """Minibatch client solves (Adam at a constant step on 16 rows) keep BayesADMM's last-round
    Gaussian jittering about its fixed point (the exact posterior here); at the default "auto" the
    posterior is the average, read after rounds 20, 22, ..., 60 of one run (resumed from its
    checkpoints; the last iterate is the server state's ``lam``, the loop being the same)."""
    Xs, ys, fed = linreg([200, 400, 800, 1600], seed=3)
    mean, cov = linreg_exact_posterior(Xs, ys, 0.5, 1.0)
    sd = np.sqrt(np.diag(cov))
    client = Laplace(hessian="ggn", batch_size=16, optimizer=optax.adam(1e-2), num_steps=200)
    algo = BayesADMM(family="full", client=client)
    last_err, avg_err = [], []
    for rounds in range(20, 61, 2):
        with warnings.catch_warnings(), no_khat():
            warnings.simplefilter("ignore")       # the Pareto k-hat of a jittering Gaussian
            res = fp.run(algo, linreg_model(), fed, rounds=rounds, seed=0, progress=False,
                         checkpoint=fp.Checkpoint(str(tmp_path)))
        assert "iterate_average" in res.posterior.info
        assert res.posterior.info["kind"] == f"full Gaussian, the average of {rounds} rounds' (iterate_average)"
        last_err.append(np.max(np.abs(np.asarray(res.server_state.lam.mean()) - mean) / sd))
        avg_err.append(np.max(np.abs(np.asarray(res.posterior.form.mean()) - mean) / sd))
        sds = np.sqrt(np.diag(np.linalg.inv(np.asarray(res.posterior.form.precision, np.float64))))
        np.testing.assert_allclose(sds / sd, 1.0, atol=0.05)
    rms = lambda e: float(np.sqrt(np.mean(np.square(e))))
    print("largest |mean - exact| in posterior sds; last round", np.round(last_err, 2),
          "average", np.round(avg_err, 2), "rms", rms(last_err), rms(avg_err))
    # measured: rms 1.84 for the last rounds (0.34 to 3.41), 1.07 for the averages (0.59 to 1.59): the
    # server's noise is correlated from round to round (its duals move by 0.2 a round), so 11 effective
    # rounds of weights about round^7 remove less than 1/sqrt(11) of it
    assert rms(avg_err) < 0.75 * rms(last_err)
    assert rms(avg_err) < 1.3 and max(avg_err) < 2.0


def test_a_resumed_run_keeps_the_same_average(tmp_path):
    """The average and its round count travel in the checkpoint: 3 rounds, then resumed to 6, give the
    states of 6 rounds at once bit for bit."""
    Xs, ys, fed = linreg([60, 120], seed=1)
    algo = BayesADMM(family="full", client=Laplace(hessian="ggn", batch_size=16, optimizer=optax.adam(1e-2),
                                                   num_steps=50))
    run = lambda r, **kw: fp.run(algo, linreg_model(), fed, rounds=r, seed=0, progress=False, **kw)
    with warnings.catch_warnings(), no_khat():
        warnings.simplefilter("ignore")
        whole = run(6)
        run(3, checkpoint=fp.Checkpoint(str(tmp_path)))
        resumed = run(6, checkpoint=fp.Checkpoint(str(tmp_path)))
    assert float(resumed.server_state.rounds) == 6.0
    for a, b in zip(jax.tree_util.tree_leaves(whole.server_state), jax.tree_util.tree_leaves(resumed.server_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(whole.posterior.form.linear), np.asarray(resumed.posterior.form.linear))
