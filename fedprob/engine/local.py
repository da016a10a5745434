"""The local engine: one federated round as one compiled function.

Each round samples ``M`` of the ``K`` clients without replacement (``M`` is
fixed, so shapes never change and nothing recompiles between rounds),
gathers their data and states, runs ``algorithm.client_update`` vmapped over
them (or in chunks with ``lax.map`` when memory is short), marks clients
whose message or state is not finite as excluded, and applies
``algorithm.server_update`` with the participation mask. A server update
that would not be finite is discarded (the previous server state is kept and
the round is flagged), so the server state never silently becomes NaN.
The round is three pure pieces that every engine shares: :func:`select`
(participants and their keys), :func:`client_step` (one client's update,
mapped over the participants by each engine its own way) and
:func:`aggregate_and_commit` (screen, server update, commit);
:mod:`.sharded` maps the clients over a device mesh and :mod:`.flower`
sends them to Flower nodes, both with the same selection and commit.

Optional faults and transforms (:mod:`fedprob.faults`,
:mod:`fedprob.privacy`): simulated dropout and stragglers (drawn before the
clients compute; a truncated straggler gets a traced step budget,
``client_update(..., max_steps=b)``, for algorithms whose
``local_step_count`` is not None), a norm bound on
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
from fedprob.protocols import DRAW_STATS, finite_flag

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
    screen: Optional[faults_mod.Screen] = None   # per-client dropout / straggler / steps / finite / norm


def refresh_local(algorithm, ctx: Context, server, clients, data, key, step=None):
    """``(clients, info)``: every client's local posterior re-taken against the final server state
    (``algorithm.refresh_local``, one more client pass vmapped over all K clients; sites unchanged),
    for a model with client-local sites; ``(clients, None)`` when there is nothing to refresh.

    ``step``: the run's compiled round ``(server, clients, key) -> (server, clients, info)``, given
    when every client takes part in a round, for an algorithm whose ``refresh_is_a_round`` is True
    (the natural loop: its refresh is its round's client solve). The client pass is then that round's (the same client
    solve against the final ``q_g``, compiled once for the run) with its server state and sites
    discarded: only the clients' local conditionals are kept, so no second program is compiled."""
    if not ctx.potential.local_sites or not hasattr(algorithm, "refresh_local"):
        return clients, None
    t0 = time.perf_counter()
    if step is not None and getattr(algorithm, "refresh_is_a_round", False):
        _, stepped, _ = step(server, clients, key)
        new = stepped.local
        ok = jax.vmap(finite_flag)(new)
        new = _where_tree(ok, new, clients.local)
        clients = clients._replace(local=new)
        ok = np.asarray(jax.block_until_ready(ok))
        return clients, {"time_s": time.perf_counter() - t0, "clients": int(ctx.num_clients),
                         "not_finite": np.flatnonzero(~ok).tolist(), "compiled_round": True}

    @jax.jit
    def one_pass(server, clients, data, key):
        keys = jax.random.split(key, ctx.num_clients)
        return vmap_clients(lambda c, d, k: algorithm.refresh_local(ctx, server, c, d, k))(clients, data, keys)

    clients, ok = jax.block_until_ready(one_pass(server, clients, data, key))
    ok = np.asarray(ok)
    return clients, {"time_s": time.perf_counter() - t0, "clients": int(ctx.num_clients),
                     "not_finite": np.flatnonzero(~ok).tolist()}


def _where_tree(flag, new, old):
    def pick(a, b):
        f = jnp.reshape(flag, jnp.shape(flag) + (1,) * (jnp.ndim(a) - jnp.ndim(flag)))
        return jnp.where(f, a, b)

    return jax.tree_util.tree_map(pick, new, old)


def select(num_clients: int, num_participants: int, key):
    """The round's participants and their keys: ``(idx, keys)``.

    ``k_sel, k_cl = split(key)``; ``idx`` (M,) are M of the K clients drawn without
    replacement from ``k_sel`` and sorted (all K, in order, when M == K); client
    ``k`` updates with ``fold_in(k_cl, k)``, so its key does not depend on who else
    was drawn.
    """
    K, M = num_clients, num_participants
    k_sel, k_cl = jax.random.split(key)
    idx = jnp.arange(K) if M == K else jnp.sort(jax.random.permutation(k_sel, K)[:M])
    keys = jax.vmap(jax.random.fold_in, (None, 0))(k_cl, idx)
    return idx, keys


def work(algorithm: Algorithm, ctx: Context, data, key, num_participants: int, faults=None):
    """The round's simulated faults and step budgets, drawn before the clients compute: ``(drawn, budget)``.

    ``data`` are the M participants' data. ``budget`` (M,) is the local steps each
    participant may take (:func:`fedprob.faults.step_budget`) when stragglers are
    truncated and the algorithm has local steps (``local_step_count``), else None.
    """
    drawn = faults_mod.draw(key, num_participants, faults)
    if drawn.fraction is None:
        return drawn, None
    full = jax.vmap(lambda dd: algorithm.local_step_count(ctx, dd))(data)   # None: no partial result
    return drawn, None if full is None else faults_mod.step_budget(drawn.fraction, full, drawn.straggler)


def client_step(algorithm: Algorithm, ctx: Context, server_state):
    """``one((state, data, key[, max_steps])) -> (state, message, diagnostics, finite)``: one client's
    update (with a step budget when the arguments carry one)."""

    def one(args):
        c, dd, k = args[:3]
        extra = {} if len(args) == 3 else {"max_steps": args[3]}
        new_c, msg, diag = algorithm.client_update(ctx, server_state, c, dd, k, **extra)
        return new_c, msg, diag, finite_flag(new_c, msg)

    return one


def aggregate_and_commit(algorithm: Algorithm, ctx: Context, server_state, client_states, idx, new_cs, msgs,
                         diags, ok, sizes, key, faults=None, privacy=None, drawn=None, budget=None):
    """The server half of a round: ``(server, client_states, RoundInfo)``.

    ``idx`` (M,) participants; ``new_cs, msgs, diags, ok`` their stacked outputs
    of :func:`client_step`; ``sizes`` (K,) rows per client (the aggregation
    weights); ``key`` the round key (fault and privacy draws fold it with fixed
    tags; ``drawn, budget`` from :func:`work`, drawn here when None: stragglers
    then are discarded). Screens the messages (finite, faults), privatizes them (equal weights
    then), applies ``server_update``, keeps the old server state when the new one
    is not finite or nobody was included, and writes a participant's new state
    into ``client_states`` only when it was included AND the server update was
    accepted.
    """
    cs = jax.tree_util.tree_map(lambda a: a[idx], client_states)
    weights = jnp.asarray(sizes)[idx]
    if drawn is None:
        drawn = faults_mod.draw(key, idx.shape[0], faults)
    scr = faults_mod.screen(algorithm, ctx, msgs, ok, faults, drawn, budget)
    ok = scr.ok
    if privacy is not None:
        msgs = privacy_mod.privatize(algorithm, ctx, msgs, ok, key, privacy)
        weights = jnp.ones_like(weights)
    new_server = algorithm.server_update(ctx, server_state, msgs, weights, ok)
    server_ok = finite_flag(new_server) & jnp.any(ok)
    new_server = _where_tree(server_ok, new_server, server_state)
    # commit client states only together with the server update that used them
    merged = _where_tree(ok & server_ok, new_cs, cs)
    client_states = jax.tree_util.tree_map(lambda a, b: a.at[idx].set(b), client_states, merged)
    return new_server, client_states, RoundInfo(idx, ok, server_ok, diags, scr)


def make_round_fn(algorithm: Algorithm, ctx: Context, num_participants: int,
                  client_chunk: Optional[int] = None, faults=None, privacy=None, map_clients=None):
    """The pure round function ``(server, clients, data, key) -> (server, clients, RoundInfo)``:
    :func:`select`, the participants' :func:`client_step`, :func:`aggregate_and_commit`.

    faults: a :class:`fedprob.faults.Faults` (dropout, stragglers, norm bound);
    privacy: a :class:`fedprob.privacy.GaussianDP` message transform.
    ``map_clients(one, (states, data, keys))`` maps the single-client update over the
    participants (default: vmap, with one participant a direct call, see
    :mod:`fedprob.client_map`; or lax.map in chunks; :mod:`.sharded` shards it).
    """
    K, M = ctx.num_clients, num_participants

    def round_fn(server_state, client_states, data, key):
        idx, keys = select(K, M, key)
        take = partial(jax.tree_util.tree_map, lambda a: a[idx])
        cs, d = take(client_states), take(data)
        drawn, budget = work(algorithm, ctx, d, key, M, faults)
        one = client_step(algorithm, ctx, server_state)

        args = (cs, d, keys) if budget is None else (cs, d, keys, budget)
        if map_clients is not None:
            new_cs, msgs, diags, ok = map_clients(one, args)
        elif client_chunk is None or client_chunk >= M:
            new_cs, msgs, diags, ok = vmap_clients(one)(args)
        else:
            new_cs, msgs, diags, ok = jax.lax.map(one, args, batch_size=client_chunk)
        return aggregate_and_commit(algorithm, ctx, server_state, client_states, idx, new_cs, msgs, diags,
                                    ok, data.n, key, faults, privacy, drawn, budget)

    return round_fn


def round_record(rinfo: RoundInfo, round_number: int, num_clients: int, faults=None, privacy=None) -> dict:
    """A round's history columns from its :class:`RoundInfo` (host values): ``participants``,
    ``dropped`` / ``stragglers`` / ``excluded`` / ``faults`` (:func:`fedprob.faults.fault_records`),
    ``server_update_ok``, ``dp_epsilon`` / ``dp_delta`` after ``round_number`` rounds (with
    ``privacy``; sampling rate M / K) and ``client_<name>``: each diagnostic's mean over the
    included clients (NaN when none was included)."""
    participants, included = np.asarray(rinfo.participants), np.asarray(rinfo.included)
    scr = rinfo.screen
    bound = None if faults is None else faults.max_update_norm
    entry = {"participants": participants.tolist(),
             **faults_mod.fault_records(participants, np.asarray(scr.present), np.asarray(scr.straggler),
                                        np.asarray(scr.finite), np.asarray(scr.norm), bound,
                                        None if scr.steps is None else np.asarray(scr.steps)),
             "server_update_ok": bool(rinfo.server_finite)}
    if privacy is not None:
        entry["dp_epsilon"] = privacy_mod.epsilon(privacy.noise_multiplier, len(participants) / num_clients,
                                                  round_number, privacy.delta)
        entry["dp_delta"] = float(privacy.delta)
    for name, v in rinfo.diagnostics.items():
        if name == DRAW_STATS:      # per-draw sampler statistics: not a per-client scalar
            continue
        v = np.asarray(v, dtype=float)
        if name == "unbounded":     # a client flagged so is left out: count it over every participant
            entry["client_unbounded"] = float(np.sum(np.nan_to_num(v)))
            continue
        entry["client_" + name] = float(np.mean(v[included])) if included.any() else float("nan")
    return entry


def _signature(tree) -> tuple:
    return tuple((tuple(np.shape(a)), str(jnp.result_type(a))) for a in jax.tree_util.tree_leaves(tree))


def _context_key(algorithm, ctx, data) -> tuple:
    return (algorithm.round_key(), ctx.potential, ctx.num_clients, np.asarray(ctx.client_sizes).tobytes(),
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
