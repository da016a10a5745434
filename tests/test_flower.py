"""The Flower engine: the pytree codec, and the simulation reproducing the local engine."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedprob as fp

from conftest import linreg_model

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
    flower = fp.run(algo, linreg_model(), fed, engine="flower", num_nodes=2)
    assert flower.info["engine"] == "flower" and flower.info["num_nodes"] == 2
    np.testing.assert_allclose(np.asarray(flower.posterior.mean["w"]), np.asarray(local.posterior.mean["w"]),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(flower.posterior.mean["w"]), [1.0, -2.0, 0.5], atol=0.15)
