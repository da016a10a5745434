"""The local engine's round with the clients sharded over several devices.

The participants of a round are split over a one-axis mesh ``("clients",)``
with ``jax.shard_map``: each device runs the vmapped client update (or
``lax.map`` in chunks of ``client_chunk`` clients) on its share, the
messages are gathered and the server update runs as in
:func:`fedprob.engine.local.make_round_fn` (same masks, same commit rule),
so the answer is the single-device one up to float reassociation. When the
number of participants ``M`` does not divide by the number of devices the
participants are padded with copies of the first one, whose outputs are
dropped. Federation data and client states are placed with a
``NamedSharding`` over the client axis when ``K`` divides by the number of
devices (replicated otherwise). Compiled rounds are cached like the local
engine's, per mesh.

Several JAX processes (``jax.distributed.initialize`` in each, then the same
``fp.run`` everywhere): the mesh holds the devices of every process, client
data and states are global arrays (:func:`place` fills each process's own
shards), the round's server state and round info come out replicated, and
:func:`unplace` gathers what a process reads, so every process holds the
same result. On CPU the collectives between processes run over Gloo.
"""
from __future__ import annotations

import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import local

COMPILE_COUNT = {"round": 0}
_CACHE: dict = {}


def make_mesh(devices=None):
    """A one-axis mesh ``("clients",)`` over ``devices`` (default: all local devices)."""
    devices = list(jax.devices() if devices is None else devices)
    return jax.make_mesh((len(devices),), ("clients",), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))


def processes(devices):
    """None when ``devices`` all belong to this process, else a description of the processes they
    span (``jax.distributed``: the clients mesh then spans every process's devices)."""
    procs = sorted({d.process_index for d in devices})
    if procs == [jax.process_index()]:
        return None
    return f"processes {procs} of jax.process_count() = {jax.process_count()}"


def map_clients_sharded(mesh, client_chunk: Optional[int] = None):
    """``map_clients(one, (states, data, keys[, step budgets]))`` for :func:`local.make_round_fn`, sharded over ``mesh``."""
    n_dev = mesh.devices.size
    spec = NamedSharding(mesh, P("clients"))

    def map_clients(one, args):
        M = jax.tree_util.tree_leaves(args)[0].shape[0]
        pad = -M % n_dev
        if pad:
            args = jax.tree_util.tree_map(
                lambda a: jnp.concatenate([a, jnp.repeat(a[:1], pad, axis=0)], axis=0), args)
        args = jax.lax.with_sharding_constraint(args, spec)

        def shard(a):
            m = jax.tree_util.tree_leaves(a)[0].shape[0]
            if client_chunk is None or client_chunk >= m:
                return jax.vmap(one)(a)
            return jax.lax.map(one, a, batch_size=client_chunk)

        out = jax.shard_map(shard, mesh=mesh, in_specs=P("clients"), out_specs=P("clients"),
                            check_vma=False)(args)
        rep = NamedSharding(mesh, P())
        return jax.tree_util.tree_map(lambda a: jax.lax.with_sharding_constraint(a, rep)[:M], out)

    return map_clients


def _spec(a, n_dev: int):
    return P("clients") if np.ndim(a) and np.shape(a)[0] % n_dev == 0 else P()


def _global(a, sharding):
    """``a`` as a global array with ``sharding``: kept when it already has it, else built from the host
    value, each process filling only the shards of its own devices."""
    if isinstance(a, jax.Array) and a.sharding.is_equivalent_to(sharding, a.ndim):
        return a
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return jax.device_put(a, sharding)
    h = np.asarray(a)
    return jax.make_array_from_callback(h.shape, sharding, lambda index: h[index])


def place(tree, mesh):
    """``tree`` (leading axis K) on ``mesh``: sharded over clients when K divides, else replicated.

    With several JAX processes (``jax.distributed``) the arrays are global: each
    process holds the rows of the clients on its own devices."""
    n_dev = mesh.devices.size
    return jax.tree_util.tree_map(lambda a: _global(a, NamedSharding(mesh, _spec(a, n_dev))), tree)


def replicate(tree, mesh):
    """``tree`` replicated on every device of ``mesh`` (every process passes the same values)."""
    rep = NamedSharding(mesh, P())
    return jax.tree_util.tree_map(lambda a: _global(a, rep), tree)


def unplace(tree):
    """``tree`` as arrays of this process (through the host): arrays spread over several
    processes are gathered (a collective: every process must call it)."""
    from jax.experimental import multihost_utils

    def host(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            a = (a.addressable_data(0) if a.is_fully_replicated
                 else multihost_utils.process_allgather(a, tiled=True))
        return jnp.asarray(np.asarray(a))

    return jax.tree_util.tree_map(host, tree)


def compiled_round(algorithm, ctx, num_participants, client_chunk, server_state, client_states, data, key,
                   mesh, faults=None, privacy=None):
    """(compiled sharded round, compile seconds: 0.0 when cached).

    The server state and the key enter replicated (:func:`replicate`), client
    states and data as :func:`place` puts them; the outputs leave the same way
    (server state and round info replicated, client states placed), so each
    round's outputs feed the next without moving."""
    cache_key = ("sharded", tuple(d.id for d in mesh.devices.flat)) + local._context_key(algorithm, ctx, data) + (
        num_participants, client_chunk, local._signature(server_state), local._signature(client_states),
        faults, privacy)
    hit = _CACHE.get(cache_key)
    if hit is not None:
        return hit, 0.0
    t0 = time.perf_counter()
    n_dev, rep = mesh.devices.size, NamedSharding(mesh, P())
    on_mesh = lambda tree: jax.tree_util.tree_map(lambda a: NamedSharding(mesh, _spec(a, n_dev)), tree)
    fn = jax.jit(local.make_round_fn(algorithm, ctx, num_participants, None, faults, privacy,
                                     map_clients_sharded(mesh, client_chunk)),
                 in_shardings=(None, on_mesh(client_states), on_mesh(data), None),
                 out_shardings=(rep, on_mesh(client_states), rep))
    compiled = fn.lower(server_state, client_states, data, key).compile()
    COMPILE_COUNT["round"] += 1
    if len(_CACHE) >= 16:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[cache_key] = compiled
    return compiled, time.perf_counter() - t0


__all__ = ["make_mesh", "map_clients_sharded", "place", "replicate", "unplace", "compiled_round", "COMPILE_COUNT"]
