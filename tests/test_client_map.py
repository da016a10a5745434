"""One client runs unbatched (fedprob.client_map): the same answer, bit for bit (CPU), as the
vmapped batch of one."""
import jax
import jax.numpy as jnp
import numpy as np

import fedprob as fp
from fedprob.algorithms.base import Context
from fedprob.client_map import vmap_clients
from fedprob.engine import client_phase, local
from fedprob.inference import SGLD
from fedprob.run import get_potential

from test_engine import make_fed, model


def _chain(x, k):
    """A noisy scan with a matrix product: what a sampler's loop does."""
    A = jnp.outer(x, x) / (1.0 + x @ x)

    def body(z, kk):
        z = z - 0.1 * A @ z + 0.01 * jax.random.normal(kk, z.shape)
        return z, jnp.sum(z * z)

    return jax.lax.scan(body, x, jax.random.split(k, 200))


def test_vmap_clients_equals_vmap_for_one_and_many_clients():
    xs = jax.random.normal(jax.random.PRNGKey(0), (3, 5))
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    for m in (1, 3):
        want = jax.jit(jax.vmap(_chain))(xs[:m], keys[:m])
        got = jax.jit(vmap_clients(_chain))(xs[:m], keys[:m])
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_participant_round_equals_vmapped_round():
    """FedAvg, one of six clients per round: the direct call and jax.vmap over the batch of one
    give the same server and client states after four rounds, bit for bit."""
    fed = make_fed()
    algo = fp.algorithms.FedAvg(local_steps=4, batch_size=5, learning_rate=0.05)
    pot = get_potential(model, fed)
    ctx = Context(pot, fed.num_clients, np.asarray(fed.sizes), fed.num_rows)
    data = fed.client_data()
    key = jax.random.PRNGKey(0)
    direct = jax.jit(local.make_round_fn(algo, ctx, 1))
    vmapped = jax.jit(local.make_round_fn(algo, ctx, 1, map_clients=lambda one, xs: jax.vmap(one)(xs)))
    states = [local.compiled_init(algo, ctx, data, key)(key, data)] * 2
    for r in range(4):
        k = jax.random.fold_in(key, r)
        (s1, c1, i1), (s2, c2, i2) = direct(*states[0], data, k), vmapped(*states[1], data, k)
        np.testing.assert_array_equal(np.asarray(i1.participants), np.asarray(i2.participants))
        for a, b in zip(jax.tree_util.tree_leaves((s1, c1)), jax.tree_util.tree_leaves((s2, c2))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        states = [(s1, c1), (s2, c2)]
    assert not np.allclose(np.asarray(states[0][0][0]), np.asarray(
        local.compiled_init(algo, ctx, data, key)(key, data)[0][0]))


def test_one_client_phase_equals_vmapped_phase():
    """SGLD on one client: the client phase fp.run compiles (unbatched) and jax.vmap over the
    batch of one give the same draws and diagnostics, bit for bit."""
    fed = make_fed(K=1)
    algo = fp.algorithms.OneShotAverage(client=SGLD(step_size=1e-3, num_burnin=100, num_samples=20,
                                                     thinning=5, batch_size=4, target_ess=0))
    pot = get_potential(model, fed)
    ctx = Context(pot, 1, np.asarray(fed.sizes), fed.num_rows)
    data, keys = fed.client_data(), jax.random.split(jax.random.PRNGKey(0), 1)
    start = jax.random.PRNGKey(1)

    def vmapped(d, ks, sk):
        def one(dd, k):
            return algo.run_client(ctx, dd, jax.random.split(k)[0], sk)
        return jax.vmap(one)(d, ks)

    # the compiled client phase as fp.run compiles and caches it (without progress reports, as
    # progress=False runs it): the fp.run below reuses it instead of compiling it again
    phase, _ = client_phase.compiled_phase(algo, ctx, data, keys, start, None, reports=False)
    got = phase(data, keys, start)
    want = jax.jit(vmapped)(data, keys, start)
    assert got.posterior.draws.shape == want.posterior.draws.shape == (1, 20, 3)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    r = fp.run(algo, model, fed, seed=0, progress=False)
    assert r.history[0]["client_finite"] > 0
