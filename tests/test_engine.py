"""The local engine: determinism, compile caching, participation, divergence quarantine, validation."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedprob as fp
from fedprob.engine import local


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def clf_model(X, y=None):
    W = numpyro.sample("W", dist.Normal(0, 1).expand([X.shape[1], 3]).to_event(2))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=X @ W), obs=y)


def make_fed(K=6, seed=0, scales=None):
    rng = np.random.default_rng(seed)
    clients = []
    for k in range(K):
        n = 10 + 3 * k
        X = rng.normal(size=(n, 3)) * (1.0 if scales is None else scales[k])
        y = X @ np.array([1.0, -1.0, 0.5]) + 0.5 * rng.normal(size=n)
        clients.append((X, y))
    return fp.data.FederatedData.from_clients(clients)


ALGO = fp.algorithms.FedAvg(local_steps=4, batch_size=5, learning_rate=0.05)
# the compile-caching test's algorithm; the participation test runs it too (same round: compiled once)
ALGO_CACHED = fp.algorithms.FedAvg(local_steps=2, batch_size=5, learning_rate=0.01)


def test_same_seed_same_result_and_seeds_differ():
    fed = make_fed()
    a = fp.run(ALGO, model, fed, rounds=4, seed=3, progress=False, clients_per_round=3)
    b = fp.run(ALGO, model, fed, rounds=4, seed=3, progress=False, clients_per_round=3)
    c = fp.run(ALGO, model, fed, rounds=4, seed=4, progress=False, clients_per_round=3)
    np.testing.assert_array_equal(np.asarray(a.server_state[0]), np.asarray(b.server_state[0]))
    assert [h["participants"] for h in a.history] == [h["participants"] for h in b.history]
    assert not np.allclose(np.asarray(a.server_state[0]), np.asarray(c.server_state[0]))


def test_no_recompilation_across_rounds_and_repeated_runs():
    fed = make_fed()
    local.clear_cache()
    algo = ALGO_CACHED
    r1 = fp.run(algo, model, fed, rounds=5, seed=0, progress=False, clients_per_round=2)
    assert local.COMPILE_COUNT["round"] == 1
    assert r1.compile_time > 0
    r2 = fp.run(algo, model, fed, rounds=7, seed=1, progress=False, clients_per_round=2)
    assert local.COMPILE_COUNT["round"] == 1
    assert r2.compile_time == 0.0
    # a different participation count is a different shape: one more compile, then cached again
    fp.run(algo, model, fed, rounds=2, seed=0, progress=False, clients_per_round=3)
    fp.run(algo, model, fed, rounds=2, seed=5, progress=False, clients_per_round=3)
    assert local.COMPILE_COUNT["round"] == 2


def test_partial_participation_samples_distinct_clients_and_covers_all():
    fed = make_fed(K=6)
    r = fp.run(ALGO_CACHED, model, fed, rounds=20, seed=0, progress=False, clients_per_round=2)
    seen = set()
    for h in r.history:
        assert len(set(h["participants"])) == 2
        seen.update(h["participants"])
    assert seen == set(range(6))


def test_chunked_clients_equal_vmapped_clients():
    fed = make_fed()
    a = fp.run(ALGO, model, fed, rounds=3, seed=2, progress=False)
    b = fp.run(ALGO, model, fed, rounds=3, seed=2, progress=False, engine=fp.engine.Local(client_chunk=2))
    np.testing.assert_allclose(np.asarray(a.server_state[0]), np.asarray(b.server_state[0]), rtol=1e-5,
                               atol=1e-6)


def test_diverging_client_is_left_out_and_reported():
    # client 2 has inputs 1e3 times larger: its local SGD explodes to inf/NaN
    scales = [1.0, 1.0, 1e3, 1.0]
    fed = make_fed(K=4, scales=scales)
    algo = fp.algorithms.FedAvg(local_steps=30, batch_size=None, learning_rate=0.05)
    with pytest.warns(RuntimeWarning, match="not finite"):
        r = fp.run(algo, model, fed, rounds=5, seed=0, progress=False)
    assert all(h["excluded"] == [2] for h in r.history)
    assert r.excluded_clients == {i: [2] for i in range(1, 6)}
    w = np.asarray(r.server_state[0])
    assert np.all(np.isfinite(w))
    # the healthy clients still fit the true weights
    np.testing.assert_allclose(np.asarray(r.posterior.mean["w"]), [1.0, -1.0, 0.5], atol=0.25)


def test_all_clients_diverging_keeps_server_state():
    fed = make_fed(K=3, scales=[1e3, 1e3, 1e3])
    algo = fp.algorithms.FedAvg(local_steps=30, batch_size=None, learning_rate=0.05, init_strategy="zeros")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = fp.run(algo, model, fed, rounds=3, seed=0, progress=False)
    assert all(not h["server_update_ok"] for h in r.history)
    np.testing.assert_array_equal(np.asarray(r.server_state[0]), np.zeros(3))


def test_eval_history_and_arviz():
    fed = make_fed()
    X, y = fed.client(0)
    r = fp.run(ALGO, model, fed, rounds=3, seed=0, progress=False, eval_data=(X, y))
    assert {"rmse", "nll", "coverage_95", "time", "client_loss"} <= set(r.history[-1])
    assert np.all(np.isfinite(r.metric("rmse")))
    idata = r.to_arviz(num_draws=10)
    post = idata.posterior if hasattr(idata, "posterior") else idata["posterior"]
    # a point estimate is one labelled draw, not num_draws copies of it
    assert np.asarray(post["w"]).shape == (1, 1, 3)


def test_validation_errors():
    fed = make_fed()
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        fp.run(ALGO, model, fed, rounds=0, progress=False)
    with pytest.raises(ValueError, match="clients_per_round"):
        fp.run(ALGO, model, fed, rounds=1, clients_per_round=99, progress=False)
    with pytest.raises(ValueError, match="eval_data X rows"):
        fp.run(ALGO, model, fed, rounds=1, eval_data=(np.zeros((4, 5)), np.zeros(4)), progress=False)
    with pytest.raises(ValueError, match="NaN/inf"):
        fp.run(ALGO, model, fed, rounds=1, eval_data=(np.full((4, 3), np.nan), np.zeros(4)), progress=False)
    with pytest.raises(TypeError, match="FederatedData"):
        fp.run(ALGO, model, (np.zeros((4, 3)), np.zeros(4)), rounds=1, progress=False)
    rng = np.random.default_rng(0)
    bad = fp.data.FederatedData.from_clients([(rng.normal(size=(5, 3)), np.array([0, 1, 2, 3, 1]))] * 2)
    with pytest.raises(ValueError, match="labels out of range"):
        fp.run(ALGO, clf_model, bad, rounds=1, progress=False)

    def no_plate(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        numpyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)

    with pytest.raises(ValueError, match="plate named 'data'"):
        fp.run(ALGO, no_plate, fed, rounds=1, progress=False)
    with pytest.raises(ValueError, match="no data"):
        fp.data.FederatedData.from_clients([(np.zeros((0, 3)), np.zeros(0))])


def test_classification_eval_metrics():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(90, 3))
    y = np.argmax(X @ rng.normal(size=(3, 3)), 1)
    fed = fp.data.FederatedData.from_clients([(X[i::3], y[i::3]) for i in range(3)], num_classes=3)
    r = fp.run(fp.algorithms.FedAvg(local_steps=20, batch_size=None, learning_rate=0.5), clf_model, fed,
               rounds=10, seed=0, progress=False, eval_data=(X, y))
    h = r.history[-1]
    assert h["accuracy"] > 0.85 and 0 <= h["ece"] <= 1 and h["nll"] < 0.5
    probs = np.asarray(r.posterior.predict(X))
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    assert float(jnp.mean(r.posterior.log_predictive_density(X, y))) == pytest.approx(-h["nll"], rel=1e-4)


def test_ggn_laplace_clients_of_a_large_model_run_one_at_a_time_and_match_vmapped():
    """PVI's Laplace clients skip their padded rows in the curvature loop only when mapped one at a
    time: on the CPU, a model of >= SEQUENTIAL_MIN_DIM parameters with unequal clients runs them so by
    default (the same numbers as vmapping them all), a small model or equal clients vmap them."""
    from fedprob.algorithms.base import SEQUENTIAL_MIN_DIM, Context, sequential_pays
    from fedprob.run import get_potential

    rng = np.random.default_rng(0)
    d = SEQUENTIAL_MIN_DIM
    clients = []
    for n in (8, 8, 40):
        X = rng.normal(size=(n, d)).astype(np.float32) / np.sqrt(d)
        clients.append((X, (X[:, :3] @ np.array([1.0, -1.0, 0.5]) + 0.3 * rng.normal(size=n)).astype(np.float32)))
    fed = fp.data.FederatedData.from_clients(clients)
    pot = get_potential(model, fed)
    ctx = Context(pot, 3, np.asarray(fed.sizes), fed.num_rows)
    cpu = jax.default_backend() == "cpu"                 # accelerators keep vmap
    assert fp.algorithms.PVI().client_chunk_for(ctx) == (1 if cpu else None)
    assert fp.algorithms.FedAvg().client_chunk_for(ctx) is None          # fixed steps: vmap
    assert not sequential_pays(Context(pot, 3, np.array([40, 40, 40]), 120))      # equal sizes
    small = make_fed(K=3)
    assert not sequential_pays(Context(get_potential(model, small), 3, np.array([8, 8, 40]), 56))
    algo = fp.algorithms.PVI(client=fp.inference.Laplace(hessian="diag_ggn", num_steps=20))
    a = fp.run(algo, model, fed, rounds=1, seed=0, progress=False)
    b = fp.run(algo, model, fed, rounds=1, seed=0, progress=False, engine=fp.engine.Local(client_chunk=3))
    assert a.info["client_chunk"] == (1 if cpu else None)
    assert ("padded rows" in a.info["client_chunk_chosen"]) if cpu else ("client_chunk_chosen" not in a.info)
    assert b.info["client_chunk"] == 3 and "client_chunk_chosen" not in b.info
    np.testing.assert_allclose(np.asarray(a.posterior.mean["w"]), np.asarray(b.posterior.mean["w"]),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a.posterior.sd["w"]), np.asarray(b.posterior.sd["w"]), rtol=1e-4)
