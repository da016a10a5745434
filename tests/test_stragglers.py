"""Stragglers as a deadline on local steps: truncated partial updates, the discard policy and fallback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedprob as fp
from fedprob.inference.ivon import ivon_init, ivon_run, ivon_step, local_target_inputs
from fedprob.inference.optim import minimize
from fedprob.potential import make_target
from fedprob.run import get_potential
from conftest import linreg_exact_posterior, linreg_model, skip_khat_check

MODEL = linreg_model(prior_scale=1.0, sigma=0.5)
W_TRUE = np.array([1.0, -1.0])
S = 6                                                            # FedAvg's local steps
LR = 0.05


def clients(K=4, seed=0, n=12):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(K):
        X = rng.normal(size=(n + rng.integers(0, 5), 2))
        out.append((X, X @ W_TRUE + 0.5 * rng.normal(size=X.shape[0])))
    return out


CLIENTS = clients()
FED = fp.data.FederatedData.from_clients(CLIENTS)
# full-batch local gradient descent, so that the oracle below is plain numpy
FEDAVG = fp.algorithms.FedAvg(local_steps=S, batch_size=None, learning_rate=LR)
OPTS = dict(rounds=3, seed=3, progress=False,
            faults=fp.Faults(dropout_rate=0.1, stragglers=fp.Stragglers(0.5)))
DISCARD = fp.Faults(dropout_rate=0.1, stragglers=fp.Stragglers(0.5, policy="discard"))


@pytest.fixture(scope="module", autouse=True)
def _no_khat():
    """Skip every run's Pareto k-hat check in this file (a test-side speed-up, up to a third of a run):
    no test here reads ``khat``, ``diagnostics()`` or the run's warnings."""
    with skip_khat_check():
        yield


def fedavg_by_hand(history, truncate):
    """FedAvg (server SGD, rate 1, start 0) in float64 numpy: client k takes s_k steps of gradient
    descent on its mean loss ``(||X w - y||^2 / (2 sigma^2) + ||w||^2 / (2 K)) / n_k``, with
    ``s_k = S`` on time, the recorded steps for a truncated straggler; absent clients and stragglers
    with nothing to send (or all stragglers under "discard") are left out."""
    K, w = len(CLIENTS), np.zeros(2)
    for h in history:
        done = dict(zip(h["stragglers"], h["straggler_steps"]))
        deltas, sizes = [], []
        for k, (X, y) in enumerate(CLIENTS):
            steps = 0 if k in h["dropped"] else done.get(k, S) if truncate else (0 if k in done else S)
            if steps == 0:
                continue
            v = w.copy()
            for _ in range(steps):
                v = v - LR * (X.T @ (X @ v - y) / 0.25 + v / K) / len(y)
            deltas.append(w - v)
            sizes.append(len(y))
        w = w - np.tensordot(np.asarray(sizes) / np.sum(sizes), np.stack(deltas), 1)
    return w


@pytest.fixture(scope="module")
def truncated():
    return fp.run(FEDAVG, MODEL, FED, **OPTS)


@pytest.fixture(scope="module")
def discarded():
    return fp.run(FEDAVG, MODEL, FED, **{**OPTS, "faults": DISCARD})


def test_truncated_fedavg_straggler_is_a_client_with_fewer_steps(truncated):
    """A straggler that completed s of S steps contributes exactly the update of s local steps."""
    steps = [s for h in truncated.history for s in h["straggler_steps"]]
    assert sum(0 < s < S for s in steps) >= 2 and all(0 <= s < S for s in steps)
    assert truncated.info["straggler_policy"] == "truncate"
    # float32 run against float64 numpy: equal to float32 rounding
    np.testing.assert_allclose(np.asarray(truncated.server_state[0]), fedavg_by_hand(truncated.history, True),
                               rtol=2e-6, atol=1e-6)
    # the per-client diagnostic is the steps taken
    for h, cd in zip(truncated.history, truncated.client_diagnostics):
        done = dict(zip(h["stragglers"], h["straggler_steps"]))
        for k, inc, st in zip(cd["participants"], cd["included"], cd["steps"]):
            assert st == done.get(int(k), S)


def test_discard_policy_leaves_stragglers_out_with_the_same_draws(truncated, discarded):
    assert [h["stragglers"] for h in discarded.history] == [h["stragglers"] for h in truncated.history]
    assert [h["dropped"] for h in discarded.history] == [h["dropped"] for h in truncated.history]
    assert all(s == 0 for h in discarded.history for s in h["straggler_steps"])
    assert discarded.info["straggler_policy"] == "discard"
    np.testing.assert_allclose(np.asarray(discarded.server_state[0]), fedavg_by_hand(discarded.history, False),
                               rtol=2e-6, atol=1e-6)
    assert not np.allclose(np.asarray(discarded.server_state[0]), np.asarray(truncated.server_state[0]))


def test_history_records_stragglers_and_resumes_bit_for_bit(tmp_path, truncated):
    fp.run(FEDAVG, MODEL, FED, checkpoint=fp.Checkpoint(str(tmp_path)), **{**OPTS, "rounds": 2})
    resumed = fp.run(FEDAVG, MODEL, FED, checkpoint=fp.Checkpoint(str(tmp_path)), **OPTS)
    strip = lambda r: [{k: v for k, v in h.items() if k != "time"} for h in r.history]  # noqa: E731
    assert strip(resumed) == strip(truncated)
    np.testing.assert_array_equal(np.asarray(resumed.server_state[0]), np.asarray(truncated.server_state[0]))
    for h in truncated.history:
        assert set(h["stragglers"]) <= set(h["participants"]) and set(h["stragglers"]).isdisjoint(h["dropped"])
        assert len(h["straggler_steps"]) == len(h["stragglers"])
    # a different policy is a different run setting: its checkpoint is not resumed
    with pytest.raises(ValueError, match="settings"):
        fp.run(FEDAVG, MODEL, FED, checkpoint=fp.Checkpoint(str(tmp_path)), **{**OPTS, "faults": DISCARD})


def test_completed_steps_are_floor_of_a_uniform_fraction_and_bad_settings_fail():
    from fedprob.faults import WORK_TAG, Faults, Stragglers, draw, step_budget

    key = jax.random.PRNGKey(7)
    f = Faults(stragglers=Stragglers(0.5, min_fraction=0.5))
    d = draw(key, 4000, f)
    frac = np.asarray(jax.random.uniform(jax.random.fold_in(key, WORK_TAG), (4000,), minval=0.5, maxval=1.0))
    np.testing.assert_array_equal(np.asarray(d.fraction), frac)
    assert abs(np.mean(np.asarray(d.straggler)) - 0.5) < 0.03
    full = np.arange(4000) % 9 + 1
    b = np.asarray(step_budget(d.fraction, jnp.asarray(full), d.straggler))
    late = np.asarray(d.straggler)
    np.testing.assert_array_equal(b[~late], full[~late])
    np.testing.assert_array_equal(b[late], np.floor(frac[late] * full[late]).astype(int))
    assert np.all((b[late] >= full[late] // 2) & (b[late] < full[late]))
    assert draw(key, 8, Faults(stragglers=Stragglers(0.5, policy="discard"))).fraction is None
    with pytest.raises(ValueError, match="Stragglers.policy must be one of"):
        Stragglers(0.1, policy="late")
    with pytest.raises(ValueError, match=r"Stragglers.min_fraction must lie in \[0, 1\)"):
        Stragglers(0.1, min_fraction=1.0)
    flower = fp.engine.Flower()
    with pytest.raises(ValueError, match="does not support Stragglers.min_fraction"):
        fp.run(FEDAVG, MODEL, FED, rounds=1, progress=False, engine=flower,
               faults=Faults(stragglers=Stragglers(0.0, min_fraction=0.5)))
    with pytest.raises(ValueError, match="policy='discard'"):
        fp.run(FEDAVG, MODEL, FED, rounds=1, progress=False, engine=flower, faults=Faults(stragglers=0.2))


def test_pvi_with_laplace_clients_falls_back_to_discard_and_reaches_the_conjugate_answer():
    """Exact (Laplace) client solves have no partial result: stragglers are discarded, their sites
    stay, and with damping 1 q_g is the exact posterior once every client has been aggregated."""
    cl = clients(K=5, n=20, seed=4)
    fed = fp.data.FederatedData.from_clients(cl)
    mean, cov = linreg_exact_posterior([c[0] for c in cl], [c[1] for c in cl], 0.5, 1.0)
    algo = fp.algorithms.PVI(family="full", damping=1.0, client=fp.inference.Laplace(hessian="ggn", num_steps=30))
    r = fp.run(algo, MODEL, fed, rounds=8, seed=0, progress=False, faults=fp.Faults(stragglers=0.3))
    late = [s for h in r.history for s in h["straggler_steps"]]
    assert late and all(s == 0 for s in late)
    assert r.info["straggler_policy"] == "discard (no partial result)"
    seen = set().union(*[set(h["participants"]) - set(h["stragglers"]) for h in r.history])
    assert seen == set(range(5))
    q = r.posterior.form
    np.testing.assert_allclose(np.asarray(q.mean()), mean, atol=1e-3 * np.sqrt(np.diag(cov)).min() + 1e-4)
    np.testing.assert_allclose(np.linalg.inv(np.asarray(q.precision)), cov, rtol=1e-3)


FEDPA = fp.algorithms.FedPA(
    client=fp.inference.IASG(step_size=0.05, num_burnin=5, steps_per_sample=2, num_samples=3, batch_size=None),
    burn_in_rounds=1)


def test_fedpa_falls_back_to_discard():
    """Sampler clients have no partial result: FedPA's stragglers are discarded, the run stays finite."""
    t = fp.run(FEDPA, MODEL, FED, rounds=3, seed=1, progress=False, faults=fp.Faults(stragglers=0.4))
    assert any(h["stragglers"] for h in t.history)
    assert all(s == 0 for h in t.history for s in h["straggler_steps"])
    assert t.info["straggler_policy"] == "discard (no partial result)"
    assert all(h["server_update_ok"] for h in t.history)
    assert np.all(np.isfinite(np.asarray(t.server_state.params)))


@pytest.mark.slow
def test_fedpa_fallback_is_the_discard_policy():
    opts = dict(rounds=3, seed=1, progress=False, faults=fp.Faults(stragglers=0.4))
    t = fp.run(FEDPA, MODEL, FED, **opts)
    d = fp.run(FEDPA, MODEL, FED, **{**opts,
                                      "faults": fp.Faults(stragglers=fp.Stragglers(0.4, policy="discard"))})
    np.testing.assert_array_equal(np.asarray(t.server_state.params), np.asarray(d.server_state.params))
    assert [h["stragglers"] for h in t.history] == [h["stragglers"] for h in d.history]


def test_truncated_ivon_clients_send_the_gaussian_they_reached():
    """Small default-run version of the convergence test below: PVI with IVON clients whose
    stragglers stop early (some inside the mode search, some inside the IVON steps)."""
    algo = fp.algorithms.PVI(family="diag", damping=1.0, client=fp.inference.IVON(num_steps=40, map_steps=10))
    r = fp.run(algo, MODEL, FED, rounds=3, seed=0, progress=False, faults=fp.Faults(stragglers=0.6))
    steps = [s for h in r.history for s in h["straggler_steps"]]
    assert any(0 < s <= 10 for s in steps) and any(10 < s < 50 for s in steps)
    assert all(h["server_update_ok"] and not h["excluded"] for h in r.history)
    assert r.info["straggler_policy"] == "truncate"
    prec = np.asarray(r.posterior.form.precision)
    assert np.all(np.isfinite(np.asarray(r.posterior.form.mean()))) and np.all(prec > 0)


@pytest.mark.slow
def test_pvi_with_truncated_ivon_clients_converges():
    """IVON clients that stop early send the Gaussian they reached; the diagonal PVI loop still
    lands near the exact posterior (IVON's own accuracy at these settings: about 0.1 sd)."""
    cl = clients(K=4, n=20, seed=5)
    fed = fp.data.FederatedData.from_clients(cl)
    mean, cov = linreg_exact_posterior([c[0] for c in cl], [c[1] for c in cl], 0.5, 1.0)
    algo = fp.algorithms.PVI(family="diag", damping=1.0, client=fp.inference.IVON(num_steps=200, map_steps=10))
    r = fp.run(algo, MODEL, fed, rounds=6, seed=0, progress=False, faults=fp.Faults(stragglers=0.5))
    steps = [s for h in r.history for s in h["straggler_steps"]]
    assert any(0 < s < 210 for s in steps)
    assert all(h["server_update_ok"] and not h["excluded"] for h in r.history)
    q = r.posterior.form
    sd = np.sqrt(np.diag(cov))
    assert np.all(np.abs(np.asarray(q.mean()) - mean) < 0.3 * sd)
    np.testing.assert_allclose(1 / np.sqrt(np.asarray(q.precision)), sd, rtol=0.2)


def test_stopped_scans_equal_shorter_runs():
    """``max_steps = s`` of a fixed-length scan gives the state of a run of s steps."""
    one = jax.tree_util.tree_map(lambda a: a[0], FED.client_data())
    pot = get_potential(MODEL, FED)
    target = make_target(one, pot.dim, prior_weight=1.0)
    grad_fn, inputs = local_target_inputs(pot, target)
    z0, key = jnp.zeros(pot.dim), jax.random.PRNGKey(0)

    @jax.jit
    def runs(s):
        short = minimize(pot, target, z0, num_steps=3).params
        stopped = minimize(pot, target, z0, num_steps=12, max_steps=s).params
        ivon = ivon_run(key, grad_fn, inputs, z0, num_steps=12, learning_rate=0.05, max_steps=s).state
        state = ivon_init(z0, 1.0)
        for k in jax.random.split(key, 12)[:3]:
            state, _ = ivon_step(k, state, grad_fn, inputs, 0.05)
        return short, stopped, ivon, state

    short, stopped, ivon, state = runs(jnp.asarray(3))
    np.testing.assert_array_equal(np.asarray(stopped), np.asarray(short))
    assert not np.allclose(np.asarray(short), np.asarray(runs(jnp.asarray(12))[1]))
    for a, b in zip(jax.tree_util.tree_leaves(ivon), jax.tree_util.tree_leaves(state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_feddyn_with_truncated_local_solves_reaches_the_global_map():
    """FedDyn's fixed point does not depend on how far each local solve got: with truncated
    stragglers (equal client sizes) the server still converges to the global MAP."""
    rng = np.random.default_rng(8)
    cl = []
    for _ in range(4):
        X = rng.normal(size=(15, 2))
        cl.append((X, X @ W_TRUE + 0.5 * rng.normal(size=15)))
    fed = fp.data.FederatedData.from_clients(cl)
    mean, cov = linreg_exact_posterior([c[0] for c in cl], [c[1] for c in cl], 0.5, 1.0)
    algo = fp.algorithms.FedDyn(alpha=0.5, num_steps=10)
    r = fp.run(algo, MODEL, fed, rounds=40, seed=0, progress=False, faults=fp.Faults(stragglers=0.3))
    assert sum(0 < s < 10 for h in r.history for s in h["straggler_steps"]) >= 5
    np.testing.assert_allclose(np.asarray(r.server_state.w), mean, atol=1e-3)


@pytest.mark.slow
def test_pvi_with_truncated_von_clients_converges():
    """Full-covariance VON clients that stop early: the PVI covariance is still exact (the GGN of a
    linear-Gaussian model is its exact, constant curvature, whatever point a solve stopped at); the
    mean carries the unfinished solves of each client's last update (measured 0.2-0.5 sd over 8 to
    24 rounds; VON's own Monte Carlo error at these settings is about 0.15 sd)."""
    cl = clients(K=4, n=20, seed=5)
    fed = fp.data.FederatedData.from_clients(cl)
    mean, cov = linreg_exact_posterior([c[0] for c in cl], [c[1] for c in cl], 0.5, 1.0)
    algo = fp.algorithms.PVI(family="full", damping=1.0,
                             client=fp.inference.VON(num_steps=30, map_steps=10, mc_samples=2))
    r = fp.run(algo, MODEL, fed, rounds=8, seed=0, progress=False, faults=fp.Faults(stragglers=0.5))
    steps = [s for h in r.history for s in h["straggler_steps"]]
    assert any(0 < s <= 10 for s in steps) and any(10 < s < 40 for s in steps)
    assert r.info["straggler_policy"] == "truncate"
    q = r.posterior.form
    sd = np.sqrt(np.diag(cov))
    assert np.all(np.abs(np.asarray(q.mean()) - mean) < 0.6 * sd), (np.asarray(q.mean()) - mean) / sd
    np.testing.assert_allclose(np.linalg.inv(np.asarray(q.precision)), cov, rtol=1e-4, atol=1e-7)
