"""FedAvg / FedProx on the conjugate Gaussian problem, with exact fixed-point oracles."""

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from conftest import skip_khat_check

import fedprob as fp

SIGMA, PRIOR = 0.5, 1.0
W_TRUE = np.array([1.0, -1.0, 0.5])


@pytest.fixture(autouse=True)
def _no_khat():
    """Skip every run's Pareto k-hat check in this file (a test-side speed-up, up to a third of a run):
    no test here reads ``khat``, ``diagnostics()`` or the run's warnings."""
    with skip_khat_check():
        yield


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, PRIOR).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, SIGMA), obs=y)


def make_clients(hetero: bool, seed=0):
    rng = np.random.default_rng(seed)
    clients = []
    for k in range(4):
        n = 15 + 10 * k
        shift = (k - 1.5) * 0.8 if hetero else 0.0
        scale = np.array([1.0, 0.4 + 0.4 * k, 1.0]) if hetero else np.ones(3)
        X = rng.normal(size=(n, 3)) * scale + shift
        w = W_TRUE + (np.array([k, -k, 0.0]) * 0.5 if hetero else 0)
        y = X @ w + SIGMA * rng.normal(size=n)
        clients.append((X.astype(np.float32), y.astype(np.float32)))
    return clients


def client_quadratic(X, y, K):
    """Mean-loss quadratic of a client: f(w) = w'Aw/2 - b'w with the 1/K prior share."""
    n = X.shape[0]
    X = X.astype(np.float64)
    A = (np.eye(3) / PRIOR ** 2 / K + X.T @ X / SIGMA ** 2) / n
    b = X.T @ y.astype(np.float64) / SIGMA ** 2 / n
    return A, b


def fedavg_fixed_point(clients, lr, steps, mu=0.0):
    """Exact fixed point of full-batch FedAvg/FedProx with server SGD(1)."""
    K = len(clients)
    sizes = np.array([len(c[1]) for c in clients], float)
    q = sizes / sizes.sum()

    def round_map(w):
        out = np.zeros(3)
        for (X, y), qk in zip(clients, q):
            A, b = client_quadratic(X, y, K)
            v = w.copy()
            for _ in range(steps):
                v = v - lr * (A @ v - b + mu * (v - w))
            out += qk * v
        return out

    c = round_map(np.zeros(3))
    T = np.stack([round_map(e) - c for e in np.eye(3)], 1)
    return np.linalg.solve(np.eye(3) - T, c)


def global_map(clients):
    from conftest import linreg_exact_posterior

    return linreg_exact_posterior([c[0] for c in clients], [c[1] for c in clients], SIGMA, PRIOR)[0]


def test_one_local_step_is_gradient_descent_on_the_global_posterior():
    clients = make_clients(hetero=True)
    fed = fp.data.FederatedData.from_clients(clients)
    algo = fp.algorithms.FedAvg(local_steps=1, batch_size=None, learning_rate=0.05)
    r = fp.run(algo, model, fed, rounds=400, seed=0, progress=False)
    np.testing.assert_allclose(r.posterior.mean["w"], global_map(clients), atol=2e-4)


def test_iid_many_local_steps_reaches_global_map():
    clients = make_clients(hetero=False)
    fed = fp.data.FederatedData.from_clients(clients)
    algo = fp.algorithms.FedAvg(local_steps=20, batch_size=None, learning_rate=0.05)
    r = fp.run(algo, model, fed, rounds=60, seed=0, progress=False)
    w_map = global_map(clients)
    np.testing.assert_allclose(r.posterior.mean["w"], fedavg_fixed_point(clients, 0.05, 20), atol=2e-4)
    # IID: the FedAvg fixed point sits within a few hundredths of the MAP
    assert np.max(np.abs(r.posterior.mean["w"] - w_map)) < 0.03


def test_noniid_fedavg_bias_matches_exact_fixed_point():
    clients = make_clients(hetero=True)
    fed = fp.data.FederatedData.from_clients(clients)
    lr, steps = 0.03, 50
    algo = fp.algorithms.FedAvg(local_steps=steps, batch_size=None, learning_rate=lr)
    r = fp.run(algo, model, fed, rounds=80, seed=0, progress=False)
    w = np.asarray(r.posterior.mean["w"])
    fixed = fedavg_fixed_point(clients, lr, steps)
    np.testing.assert_allclose(w, fixed, atol=5e-4)
    # the known FedAvg bias: the fixed point is NOT the global MAP
    assert np.max(np.abs(fixed - global_map(clients))) > 0.05


def test_fedprox_fixed_point_and_mu_zero_equals_fedavg():
    clients = make_clients(hetero=True)
    fed = fp.data.FederatedData.from_clients(clients)
    lr, steps, mu = 0.03, 50, 1.0
    r = fp.run(fp.algorithms.FedProx(mu=mu, local_steps=steps, batch_size=None, learning_rate=lr),
               model, fed, rounds=80, seed=0, progress=False)
    fixed = fedavg_fixed_point(clients, lr, steps, mu=mu)
    np.testing.assert_allclose(np.asarray(r.posterior.mean["w"]), fixed, atol=5e-4)
    # the proximal term pulls the fixed point towards the global MAP
    w_map = global_map(clients)
    assert np.linalg.norm(fixed - w_map) < np.linalg.norm(fedavg_fixed_point(clients, lr, steps) - w_map)
    a = fp.run(fp.algorithms.FedProx(mu=0.0, local_steps=3, batch_size=8), model, fed, rounds=3,
               seed=4, progress=False)
    b = fp.run(fp.algorithms.FedAvg(local_steps=3, batch_size=8), model, fed, rounds=3, seed=4,
               progress=False)
    np.testing.assert_array_equal(np.asarray(a.server_state[0]), np.asarray(b.server_state[0]))


@pytest.mark.parametrize("server,lr", [("adam", 0.03), ("yogi", 0.03), ("adagrad", 0.3), ("sgd_momentum", 0.5)])
def test_server_optimizers_reach_global_map(server, lr):
    clients = make_clients(hetero=True)
    fed = fp.data.FederatedData.from_clients(clients)
    if server == "sgd_momentum":
        algo = fp.algorithms.FedAvg(local_steps=1, batch_size=None, learning_rate=0.05,
                                    server_optimizer="sgd", server_learning_rate=lr, server_momentum=0.9)
    else:
        algo = fp.algorithms.FedAvg(local_steps=1, batch_size=None, learning_rate=0.05,
                                    server_optimizer=server, server_learning_rate=lr)
    r = fp.run(algo, model, fed, rounds=600, seed=0, progress=False)
    np.testing.assert_allclose(r.posterior.mean["w"], global_map(clients), atol=5e-3)


def test_local_epochs_give_per_client_step_counts():
    clients = make_clients(hetero=False)
    fed = fp.data.FederatedData.from_clients(clients)
    r = fp.run(fp.algorithms.FedAvg(local_epochs=2, batch_size=10), model, fed, rounds=1, seed=0,
               progress=False)
    expected = np.mean([np.ceil(2 * n / 10) for n in fed.sizes])
    assert r.history[0]["client_steps"] == pytest.approx(expected)


def test_client_lbfgs_through_the_shared_resolver_reaches_local_optima():
    """client_optimizer names go through inference.optim.make_optimizer, so full-batch L-BFGS (which
    needs the loss value passed to the update) works: one round averages the exact client optima."""
    clients = make_clients(hetero=True)
    fed = fp.data.FederatedData.from_clients(clients)
    algo = fp.algorithms.FedAvg(local_steps=40, batch_size=None, client_optimizer="lbfgs", learning_rate=None)
    r = fp.run(algo, model, fed, rounds=1, seed=0, progress=False)
    q = fed.sizes / fed.sizes.sum()
    want = sum(qk * np.linalg.solve(*client_quadratic(X, y, len(clients))) for (X, y), qk in zip(clients, q))
    np.testing.assert_allclose(r.posterior.mean["w"], want, atol=2e-4)


def test_make_optimizer_is_the_one_resolver():
    import jax.numpy as jnp
    import optax

    from fedprob.inference.optim import make_optimizer

    g = jnp.array([0.3, -1.0, 2.0])
    for tx, ref in [(make_optimizer("sgd", 0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9)),
                    (make_optimizer("adagrad", 0.3, eps=1e-3), optax.adagrad(0.3, eps=1e-3)),
                    (make_optimizer("yogi", 0.03, eps=1e-3), optax.yogi(0.03, eps=1e-3)),
                    (make_optimizer("adam", 0.01), optax.adam(0.01))]:
        w, s, w2, s2 = jnp.ones(3), None, jnp.ones(3), None
        s, s2 = tx.init(w), ref.init(w2)
        for t in range(3):
            u, s = tx.update(g * (t + 1), s, w)
            u2, s2 = ref.update(g * (t + 1), s2, w2)
            w, w2 = optax.apply_updates(w, u), optax.apply_updates(w2, u2)
        np.testing.assert_allclose(np.asarray(w), np.asarray(w2), rtol=1e-6)
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer("rmsprop", 0.1)
