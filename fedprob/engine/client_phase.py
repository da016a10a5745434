"""The client phase of a one-round method as its own compiled function, shared between methods.

One-round methods that run the same backend with the same prior share and
start (e.g. ``Ensemble`` and ``PredictiveBayes`` with one sampler) run
identical clients; only the message and the server side differ. For a
single round over all clients ``fp.run`` therefore compiles the client
phase once per (backend, prior share, shared start, potential, client sizes,
data shapes, client chunk), runs it as its own call (with progress reports
from inside the chains, :mod:`fedprob.progress`), and hands the results to
the local engine's round of :class:`~fedprob.algorithms.client_runs.FromClientPhase`
(message, masks, server update: cheap to compile). Keys are those of
``client_update``, so the answer is the one of the fused round.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import jax
import numpy as np

from .. import progress as prog
from ..algorithms.client_runs import FromClientPhase, PhaseData, client_phase_key, run_client_phase
from . import local

#: compilations of client phases (cache misses).
COMPILE_COUNT = {"phase": 0}
_CACHE: dict = {}
_CACHE_MAX = 16


def applies(algorithm, rounds: int, num_participants: int, num_clients: int) -> bool:
    """A single round of a one-round method over all clients."""
    return client_phase_key(algorithm) is not None and rounds == 1 and num_participants == num_clients


def compiled_phase(algorithm, ctx, data, keys, start_key, client_chunk: Optional[int],
                   reports: bool = True):
    """(compiled ``(data, keys, start_key) -> results``, compile seconds: 0.0 when shared).

    reports: the chains report their progress (host calls, :mod:`fedprob.progress`) or not."""
    backend, shared = client_phase_key(algorithm)
    cache_key = (backend, shared, float(algorithm.prior_weight(ctx)), ctx.potential, ctx.num_clients,
                 np.asarray(ctx.client_sizes).tobytes(), local._signature(data), client_chunk, bool(reports))
    hit = _CACHE.get(cache_key)
    if hit is not None:
        return hit, 0.0
    t0 = time.perf_counter()

    def phase(d, ks, sk):
        if client_chunk is None or client_chunk >= ctx.num_clients:
            return run_client_phase(algorithm, ctx, d, ks, sk)
        one = lambda a: jax.tree_util.tree_map(lambda x: x[0], run_client_phase(
            algorithm, ctx, jax.tree_util.tree_map(lambda x: x[None], a[0]), a[1][None], sk))
        return jax.lax.map(one, (d, ks), batch_size=client_chunk)

    with prog.tracing(reports):
        compiled = jax.jit(phase).lower(data, keys, start_key).compile()
    COMPILE_COUNT["phase"] += 1
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[cache_key] = compiled
    return compiled, time.perf_counter() - t0


def run(algorithm, ctx, data, server_state, round_key, client_chunk: Optional[int] = None,
        show: bool = True):
    """Run the client phase of round ``round_key``; returns ``(round algorithm, round data, info)``.

    info: ``client_phase_compile_s`` (0 when a compiled phase was shared), ``client_phase_s``.
    ``show``: a progress bar fed by the chains' reports; without it the phase is compiled
    without reports (no host calls; the program can go to the persistent compilation cache).
    """
    K = ctx.num_clients
    _, keys = local.select(K, K, round_key)                     # the round's keys, M == K
    start_key = jax.random.fold_in(server_state.key, 1)         # as OneRoundAlgorithm.client_update
    groups = 1 if client_chunk is None or client_chunk >= K else math.ceil(K / client_chunk)
    with prog.phase(f"{type(algorithm).__name__} clients", groups, show) as ph:
        ph.compiling()
        fn, compile_s = compiled_phase(algorithm, ctx, data, keys, start_key, client_chunk, reports=show)
        ph.running(compile_s)
        t0 = time.perf_counter()
        results = jax.block_until_ready(fn(data, keys, start_key))
    info = {"client_phase_compile_s": compile_s, "client_phase_s": time.perf_counter() - t0}
    return FromClientPhase(algorithm), PhaseData(data.X, data.y, data.n, results), info


def clear_cache():
    _CACHE.clear()
    COMPILE_COUNT["phase"] = 0


__all__ = ["applies", "compiled_phase", "run", "clear_cache", "COMPILE_COUNT"]
