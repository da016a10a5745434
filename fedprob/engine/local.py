"""The local engine: one federated round as one compiled function.

Each round samples ``M`` of the ``K`` clients without replacement (``M`` is
fixed, so shapes never change and nothing recompiles between rounds),
gathers their data and states, runs ``algorithm.client_update`` vmapped over
them (or in chunks with ``lax.map`` when memory is short), marks clients
whose message or state is not finite as excluded, and applies
``algorithm.server_update`` with the participation mask. A server update
that would not be finite is discarded (the previous server state is kept and
the round is flagged), so the server state never silently becomes NaN.

Optional faults and transforms (:mod:`fedprob.faults`,
:mod:`fedprob.privacy`): simulated dropout and stragglers, a norm bound on
client updates (a client over it is quarantined like a non-finite one), and
a differential-privacy transform (clip and noise) applied to the messages
before ``server_update``, which then gets equal weights. Their randomness
comes from ``fold_in`` of the round key with fixed tags, so a run without
them draws exactly the same keys as before.

Client and server states are committed together: a client's new state is
kept only when its update was finite AND the server update was accepted, so
a rejected round changes no state at all (sites and duals of stateful
algorithms stay in step with the server).

Compiled functions (the round, the algorithm's ``init``) are cached on
everything that changes the traced program: the algorithm (a frozen,
hashable dataclass), the potential (equal when model, ``model_kwargs``,
row shapes and dtypes are equal, see :class:`fedprob.potential.Potential`),
the number of clients and their sizes, M, the chunk size and the shapes and
dtypes of every state and data leaf. A second ``fp.run`` with the same inputs
does not recompile; changing any of them does. :data:`COMPILE_COUNT` counts
compilations (outside traced code).
"""
from __future__ import annotations

import time
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedprob.client_map import vmap_clients
from fedprob.protocols import finite_flag

from ..algorithms.base import Algorithm, Context
from .. import faults as faults_mod
from .. import privacy as privacy_mod

#: compilations done by :func:`compiled_round` and :func:`compiled_init` (cache misses).
COMPILE_COUNT = {"round": 0, "init": 0}
_CACHE: dict = {}
_CACHE_MAX = 32


def _cache_put(key, value):
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = value


class RoundInfo(NamedTuple):
    participants: jax.Array     # (M,) client ids
    included: jax.Array         # (M,) bool: update finite and aggregated
    server_finite: jax.Array    # () bool: server update accepted
    diagnostics: dict           # name -> (M,) per-client values
    screen: Optional[faults_mod.Screen] = None   # per-client dropout / straggler / finite / norm


def _where_tree(flag, new, old):
    def pick(a, b):
        f = jnp.reshape(flag, jnp.shape(flag) + (1,) * (jnp.ndim(a) - jnp.ndim(flag)))
        return jnp.where(f, a, b)

    return jax.tree_util.tree_map(pick, new, old)


def make_round_fn(algorithm: Algorithm, ctx: Context, num_participants: int,
                  client_chunk: Optional[int] = None, faults=None, privacy=None, map_clients=None):
    """The pure round function ``(server, clients, data, key) -> (server, clients, RoundInfo)``.

    faults: a :class:`fedprob.faults.Faults` (dropout, stragglers, norm bound);
    privacy: a :class:`fedprob.privacy.GaussianDP` message transform.
    ``map_clients(one, (states, data, keys))`` maps the single-client update over the
    participants (default: vmap, with one participant a direct call, see
    :mod:`fedprob.client_map`; or lax.map in chunks; :mod:`.sharded` shards it).
    """
    K, M = ctx.num_clients, num_participants

    def round_fn(server_state, client_states, data, key):
        k_sel, k_cl = jax.random.split(key)
        idx = jnp.arange(K) if M == K else jnp.sort(jax.random.permutation(k_sel, K)[:M])
        take = partial(jax.tree_util.tree_map, lambda a: a[idx])
        cs, d = take(client_states), take(data)
        keys = jax.vmap(jax.random.fold_in, (None, 0))(k_cl, idx)

        def one(args):
            c, dd, k = args
            new_c, msg, diag = algorithm.client_update(ctx, server_state, c, dd, k)
            return new_c, msg, diag, finite_flag(new_c, msg)

        if map_clients is not None:
            new_cs, msgs, diags, ok = map_clients(one, (cs, d, keys))
        elif client_chunk is None or client_chunk >= M:
            new_cs, msgs, diags, ok = vmap_clients(one)((cs, d, keys))
        else:
            new_cs, msgs, diags, ok = jax.lax.map(one, (cs, d, keys), batch_size=client_chunk)
        scr = faults_mod.screen(algorithm, ctx, msgs, ok, key, faults)
        ok, weights = scr.ok, d.n
        if privacy is not None:
            msgs = privacy_mod.privatize(algorithm, ctx, msgs, ok, key, privacy)
            weights = jnp.ones_like(d.n)
        new_server = algorithm.server_update(ctx, server_state, msgs, weights, ok)
        server_ok = finite_flag(new_server) & jnp.any(ok)
        new_server = _where_tree(server_ok, new_server, server_state)
        # commit client states only together with the server update that used them
        merged = _where_tree(ok & server_ok, new_cs, cs)
        client_states = jax.tree_util.tree_map(lambda a, b: a.at[idx].set(b), client_states, merged)
        return new_server, client_states, RoundInfo(idx, ok, server_ok, diags, scr)

    return round_fn


def _signature(tree) -> tuple:
    return tuple((tuple(np.shape(a)), str(jnp.result_type(a))) for a in jax.tree_util.tree_leaves(tree))


def _context_key(algorithm, ctx, data) -> tuple:
    return (algorithm, ctx.potential, ctx.num_clients, np.asarray(ctx.client_sizes).tobytes(),
            _signature(data))


def compiled_round(algorithm, ctx, num_participants, client_chunk, server_state, client_states,
                   data, key, faults=None, privacy=None):
    """(compiled round function, compile seconds: 0.0 when cached)."""
    cache_key = ("round",) + _context_key(algorithm, ctx, data) + (
        num_participants, client_chunk, _signature(server_state), _signature(client_states), faults,
        privacy)
    hit = _CACHE.get(cache_key)
    if hit is not None:
        return hit, 0.0
    t0 = time.perf_counter()
    fn = jax.jit(make_round_fn(algorithm, ctx, num_participants, client_chunk, faults, privacy))
    compiled = fn.lower(server_state, client_states, data, key).compile()
    dt = time.perf_counter() - t0
    COMPILE_COUNT["round"] += 1
    _cache_put(cache_key, compiled)
    return compiled, dt


def compiled_init(algorithm, ctx, data, key):
    """The compiled ``algorithm.init(ctx, key, data)`` (cached like :func:`compiled_round`)."""
    cache_key = ("init",) + _context_key(algorithm, ctx, data)
    hit = _CACHE.get(cache_key)
    if hit is None:
        hit = jax.jit(lambda k, d: algorithm.init(ctx, k, d)).lower(key, data).compile()
        COMPILE_COUNT["init"] += 1
        _cache_put(cache_key, hit)
    return hit


def clear_cache():
    """Forget every compiled function (and reset the compile counters)."""
    _CACHE.clear()
    for k in COMPILE_COUNT:
        COMPILE_COUNT[k] = 0
