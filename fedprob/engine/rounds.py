"""The local engine's compiled round, on one device or a ``("clients",)`` mesh, behind one ``step``.

:func:`compile_rounds` builds what ``fp.run`` loops over for a
:class:`~fedprob.engine.Local` plan: with one device the round of
:mod:`fedprob.engine.local` (vmap, or ``lax.map`` chunks), with several the
``shard_map`` round of :mod:`fedprob.engine.sharded` (client data and states
placed on the mesh, the server state back on this process after each round).
A single round of a one-round method over all clients first runs its client
phase as its own shared compiled call (:mod:`fedprob.engine.client_phase`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax

from .. import progress as prog
from . import client_phase, local, sharded


@dataclasses.dataclass
class Rounds:
    """A compiled round: ``step(server, clients, key) -> (server, clients, RoundInfo)``.

    algorithm / data: what the round runs (a one-round method after its client
    phase runs the cheap :class:`~fedprob.algorithms.client_runs.FromClientPhase`
    on the phase's results). clients: the initial client states, placed where
    the round wants them. compile_time: seconds (round and client phase).
    info: ``engine``, ``devices``, ``client_chunk`` (where the user set none, the
    algorithm's :meth:`~fedprob.algorithms.base.Algorithm.client_chunk_for`, with
    ``client_chunk_chosen`` saying why when it is not None), ``compile_round_s``, the
    client phase's timings and, with stragglers, ``straggler_policy``.
    """

    round_fn: Callable
    algorithm: Any
    data: Any
    clients: Any
    mesh: Optional[Any]
    multiprocess: Optional[str]
    compile_time: float
    info: dict

    def step(self, server, clients, key):
        """One round; the server state comes back to this process, ready."""
        if self.mesh is None:
            server, clients, rinfo = self.round_fn(server, clients, self.data, key)
        else:   # the placement the round was compiled with
            server, clients, rinfo = self.round_fn(sharded.unplace(server), sharded.place(clients, self.mesh),
                                                   self.data, key)
            server = sharded.unplace(server)
        return jax.block_until_ready(server), clients, rinfo

    def host_clients(self, clients):
        """The client states as arrays of this process (gathered across processes)."""
        return clients if self.multiprocess is None else sharded.unplace(clients)


def straggler_policy(algorithm, ctx, data, faults) -> str:
    """The policy applied to stragglers: ``"truncate"``, ``"discard"``, or ``"discard (no partial
    result)"`` when truncation was asked of an algorithm whose clients have no local steps."""
    if faults.straggler_policy == "discard":
        return "discard"
    one = jax.tree_util.tree_map(lambda a: a[0], data)
    steps = jax.eval_shape(lambda d: algorithm.local_step_count(ctx, d), one)
    return "truncate" if steps is not None else "discard (no partial result)"


def compile_rounds(plan, algorithm, ctx, num_participants: int, rounds: int, start: int, server, clients,
                   data, k_rounds, faults, privacy, progress: bool = True) -> Rounds:
    """The compiled round of ``plan`` (a :class:`~fedprob.engine.Local`) for a run of ``rounds``
    rounds resumed at ``start``; ``k_rounds`` is the run's round key (round r uses ``fold_in(k_rounds, r)``)."""
    devs, chunk, M = plan.device_list(), plan.client_chunk, num_participants
    mesh = sharded.make_mesh(devs) if len(devs) > 1 else None
    info = {"engine": "local" if mesh is None else "sharded", "devices": [str(d) for d in devs]}
    if chunk is None and mesh is None:
        chunk = algorithm.client_chunk_for(ctx)     # the algorithm's choice where the user made none
        if chunk is not None:
            info["client_chunk_chosen"] = "one client at a time: the updates skip their padded rows"
    info["client_chunk"] = chunk
    if mesh is None and start == 0 and client_phase.applies(algorithm, rounds, M, ctx.num_clients):
        algorithm, data, phase_info = client_phase.run(
            algorithm, ctx, data, server, jax.random.fold_in(k_rounds, 0), chunk, progress)
        info.update(phase_info)
    with prog.tracing(False):       # no bar shows the chains' reports inside a round
        if mesh is None:
            round_fn, compile_time = local.compiled_round(algorithm, ctx, M, chunk, server, clients, data,
                                                          k_rounds, faults, privacy)
        else:
            data, clients = sharded.place(data, mesh), sharded.place(clients, mesh)
            round_fn, compile_time = sharded.compiled_round(algorithm, ctx, M, chunk, server, clients, data,
                                                            k_rounds, mesh, faults, privacy)
    info["compile_round_s"] = compile_time
    if faults.straggler_rate > 0:
        info["straggler_policy"] = straggler_policy(algorithm, ctx, data, faults)
    compile_time += info.get("client_phase_compile_s", 0.0)
    return Rounds(round_fn, algorithm, data, clients, mesh, sharded.processes(devs), compile_time, info)


__all__ = ["Rounds", "compile_rounds", "straggler_policy"]
