"""The Flower engine: the pytree codec, and the simulation reproducing the local engine."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedprob as fp

from conftest import linreg_federation, linreg_model, skip_khat_check

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flwr") is None,
                                reason="flwr not installed (pip install 'fedprob[flower]')")


def test_codec_round_trip_keeps_every_leaf():
    from fedprob.engine import codec

    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": (jnp.array([1, 2], jnp.int32), jnp.array(True)),
            "key": jax.random.PRNGKey(3), "c": [jnp.zeros((0, 4)), jnp.float32(2.5)]}
    rec = codec.pack(tree)
    back = codec.unpack(rec, tree)
    for x, y in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(back)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="arrays"):
        codec.unpack(rec, {"a": tree["a"]})


@pytest.mark.slow   # a Ray-backed simulation: about a minute to start on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="the Flower simulation needs ray (pip install 'flwr[simulation]')")
def test_flower_simulation_reproduces_the_local_engine():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=120)).astype(np.float32)
    fed = fp.data.partition(X, y, num_clients=3, scheme="iid", seed=0)
    algo = fp.algorithms.EPMCMC(client=fp.inference.Laplace())
    local = fp.run(algo, linreg_model(), fed, progress=False)
    flower = fp.run(algo, linreg_model(), fed, engine=fp.engine.Flower(num_nodes=2))
    assert flower.info["engine"] == "flower" and flower.info["num_nodes"] == 2
    np.testing.assert_allclose(np.asarray(flower.posterior.mean["w"]), np.asarray(local.posterior.mean["w"]),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(flower.posterior.mean["w"]), [1.0, -2.0, 0.5], atol=0.15)


BOUND = 0.45   # some updates over it (norms 0.47 to 0.58), some under


def _linreg_fed():
    return linreg_federation(120, 3)


def _in_process(handle):
    """``exchange`` answering every request with ``handle`` in this process."""
    def exchange(r, requests):
        return {k: handle(c) for k, node, c in requests}, {}

    return exchange


def test_server_rounds_reproduce_the_local_engine(monkeypatch):
    """The ServerApp's rounds (selection, client keys, commit) over an in-process transport give the
    local engine's participants and states; the reply shapes are computed once per run."""
    from fedprob.engine import flower

    fed = _linreg_fed()
    algo = fp.algorithms.FedAvg(local_steps=5, batch_size=8, learning_rate=0.01)
    local = fp.run(algo, linreg_model(), fed, rounds=3, clients_per_round=2, seed=1, progress=False)
    ctx, data, templates = flower.prepare(algo, linreg_model(), fed, seed=1)
    handle = flower.client_handler(algo, ctx, data, templates)
    calls = []
    real = jax.eval_shape
    monkeypatch.setattr(jax, "eval_shape", lambda *a, **k: calls.append(1) or real(*a, **k))
    server, clients, hist = flower.serve(algo, ctx, data, 3, 1, 2, [11, 12], _in_process(handle))
    assert len(calls) == 1
    assert [h["participants"] for h in hist] == [h["participants"] for h in local.history]
    assert [len(set(h["participants"])) for h in hist] == [2, 2, 2]
    assert all(h["server_update_ok"] and h["excluded"] == [] for h in hist)
    for a, b in zip(jax.tree_util.tree_leaves((server, clients)),
                    jax.tree_util.tree_leaves((local.server_state, local.client_states))):
        np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-5, atol=1e-6)


class _Grid:
    """A Flower Grid in this process: push sets the message ids, each request is answered by
    ``handle`` unless its client is in ``silent`` (no reply) or ``failing`` (an error reply)."""

    def __init__(self, handle, silent=(), failing=()):
        self.handle, self.silent, self.failing = handle, set(silent), set(failing)

    def get_node_ids(self):
        return [20, 21]

    def send_and_receive(self, messages):
        from flwr.app import Error, Message

        out = []
        for i, m in enumerate(messages):
            m.metadata.__dict__["_message_id"] = f"m{i}"
            k = int(m.content["meta"]["client"])
            if k in self.failing:
                out.append(Message(Error(code=7, reason="boom"), reply_to=m))
            elif k not in self.silent:
                out.append(Message(self.handle(m.content), reply_to=m))
        return out[::-1]      # replies come in any order


@pytest.fixture
def task_identity(monkeypatch):
    """The run / task / node ids Flower sets in its own processes (needed to build messages)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 0)


def test_grid_replies_commit_and_a_silent_or_failing_node_is_named(task_identity):
    from fedprob.engine import flower

    fed = _linreg_fed()
    algo = fp.algorithms.EPMCMC(client=fp.inference.Laplace())
    # the local engine's posterior is the reference here, not its Pareto k-hat check (a second compiled
    # program, about 1 s, that this test never reads): skipped
    with skip_khat_check():
        local = fp.run(algo, linreg_model(), fed, progress=False)
    ctx, data, templates = flower.prepare(algo, linreg_model(), fed)
    handle = flower.client_handler(algo, ctx, data, templates)
    server, clients, hist = flower.serve(algo, ctx, data, 1, 0, 3, [20, 21], flower._grid_exchange(_Grid(handle)))
    assert hist[0]["participants"] == [0, 1, 2] and hist[0]["server_update_ok"]
    np.testing.assert_allclose(np.asarray(algo.posterior(ctx, server, clients).mean["w"]),
                               np.asarray(local.posterior.mean["w"]), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"round 1: Flower node 21 sent no reply for client \(partition\) 1"):
        flower.serve(algo, ctx, data, 1, 0, 3, [20, 21], flower._grid_exchange(_Grid(handle, silent={1})))
    with pytest.raises(RuntimeError, match=r"round 1: Flower node 20 replied with an error: boom \(code 7\) "
                                           r"for client \(partition\) 0; 2 participants are missing: clients "
                                           r"\[0, 2\]"):
        flower.serve(algo, ctx, data, 1, 0, 3, [20, 21], flower._grid_exchange(_Grid(handle, failing={0, 2})))


def test_server_rounds_apply_faults_and_privacy_as_the_local_engine():
    """Dropout, the norm bound and the DP transform act on the Flower replies exactly as in the local
    engine: same dropped / excluded clients and epsilon, same states."""
    from fedprob.engine import flower
    from fedprob.faults import Faults

    fed = _linreg_fed()
    algo = fp.algorithms.FedAvg(local_steps=5, batch_size=8, learning_rate=0.01)
    dp = fp.privacy.GaussianDP(clip_norm=1.0, noise_multiplier=0.5)
    with pytest.warns(RuntimeWarning, match="left clients out"):
        local = fp.run(algo, linreg_model(), fed, rounds=4, clients_per_round=2, seed=3, progress=False,
                       faults=Faults(dropout_rate=0.3, max_update_norm=BOUND), privacy=dp)
    ctx, data, templates = flower.prepare(algo, linreg_model(), fed, seed=3)
    handle = flower.client_handler(algo, ctx, data, templates)
    server, clients, hist = flower.serve(algo, ctx, data, 4, 3, 2, [7], _in_process(handle),
                                         faults=Faults(0.3, None, BOUND), privacy=dp)
    cols = ("participants", "dropped", "stragglers", "excluded", "faults", "server_update_ok", "dp_epsilon")
    assert [{c: h[c] for c in cols} for h in hist] == [{c: h[c] for c in cols} for h in local.history]
    assert any(h["dropped"] for h in hist) and any(h["excluded"] for h in hist)
    assert not all(h["server_update_ok"] for h in hist)       # a rejected round commits no client state
    for a, b in zip(jax.tree_util.tree_leaves((server, clients)),
                    jax.tree_util.tree_leaves((local.server_state, local.client_states))):
        np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-5, atol=1e-6)
