"""Running a one-round method's clients once: the shared client phase and reusable client runs.

:func:`run_client_phase` / :class:`FromClientPhase` let the engine run the client phase as its own
compiled call, shared between methods with the same backend (:mod:`fedprob.engine.client_phase`);
:func:`run_clients` runs a backend once on every client and :func:`aggregate` builds several
one-round posteriors from those results without re-running them.
"""
from __future__ import annotations

import dataclasses
import warnings
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from ..client_map import vmap_clients
from ..protocols import finite_flag, run_chains
from ..potential import ClientData, make_target
from .base import Algorithm, Context, check_local_sites
from .one_round_base import LocalClient, OneRoundAlgorithm, check_client

Array = jax.Array


class PhaseData(NamedTuple):
    """A client's rows (``X, y, n`` as in :class:`~fedprob.potential.ClientData`) and the
    :class:`ClientResult` its backend already produced (``result``)."""

    X: Array
    y: Array
    n: Array
    result: Any


def client_phase_key(algorithm) -> Optional[tuple]:
    """What the client phase of ``algorithm`` depends on beyond the data: ``(backend, prior
    share, shared start)`` for a one-round method (methods with equal keys run identical
    clients), else None. The prior share needs a context, so it is resolved by the caller."""
    if not isinstance(algorithm, OneRoundAlgorithm):
        return None
    return (algorithm.backend, algorithm.shared_start)


def run_client_phase(algorithm, ctx: Context, data, keys, start_key):
    """Every client's :class:`ClientResult` (vmapped; one client runs unbatched,
    :func:`fedprob.client_map.vmap_clients`), with the keys ``client_update`` uses:
    ``keys`` (M,) are the engine's per-client keys, ``start_key`` the shared start key."""

    def one(d, k):
        k_run, _ = jax.random.split(k)
        return algorithm.run_client(ctx, d, k_run, start_key)

    return vmap_clients(one)(data, keys)


@dataclasses.dataclass(frozen=True)
class FromClientPhase(Algorithm):
    """``inner``'s server side on results computed beforehand (:class:`PhaseData`): the
    message, diagnostics, server update and posterior are ``inner``'s, bit for bit the same as
    when ``inner.client_update`` runs the backend itself."""

    inner: Any

    default_rounds = 1

    def client_update(self, ctx, server_state, client_state, data, key):
        _, k_msg = jax.random.split(key)
        rows = ClientData(data.X, data.y, data.n)
        result, cond = self.inner.split_local(ctx, data.result)
        message = self.inner.client_message(ctx, rows, result, k_msg)
        diagnostics = {**result.diagnostics, **self.inner.client_khat(ctx, result, rows, k_msg)}
        if cond is None:
            return client_state, (client_state, message), diagnostics
        return LocalClient(client_state.id, cond), (client_state.id, message), diagnostics

    def server_update(self, ctx, server_state, messages, weights, mask):
        return self.inner.server_update(ctx, server_state, messages, weights, mask)

    def posterior(self, ctx, server_state, client_states):
        return self.inner.posterior(ctx, server_state, client_states)


# -- running the clients once -----------------------------------------------------------------------

class ClientRuns(NamedTuple):
    """One client phase: ``results`` (a ClientResult stacked over the K clients), the (K,) ``mask``
    of clients whose results are finite, the ``prior_weight`` they used, the ``context`` and the
    server ``key``, and the clients' stacked ``data`` (:class:`~fedprob.potential.ClientData`) for
    the parts of a message computed from a client's target."""

    context: Context
    results: Any
    mask: Array
    prior_weight: float
    key: Array
    data: Any = None


def run_clients(backend, model, fed, seed: int = 0, prior_weight: float = 1.0, shared_start: bool = True,
                model_kwargs: Optional[dict] = None) -> ClientRuns:
    """Run ``backend`` once on every client's target ``prior_weight * log p0 + log p(D_k | z)``.

    Clients start from ``potential.init(key, backend.init_strategy)``, one
    shared key for all (``shared_start``, as the one-round methods do) or
    one per client. Returns :class:`ClientRuns`; feed it to :func:`aggregate`
    (or ``algo.posterior_from_results``) for every one-round method that asks
    for this prior share: ``prior_weight=1`` for EPMCMC (parametric, default),
    Ensemble, PredictiveBayes, OneShotAverage; ``1/K`` for ConsensusMC and
    ``EPMCMC(subposteriors=True)``. Clients whose results are not finite are
    masked out (with a warning).
    """
    from ..potential import get_potential

    check_client(backend)
    potential = get_potential(model, fed, model_kwargs)
    ctx = Context(potential, fed.num_clients, np.asarray(fed.sizes), fed.num_rows)
    key = jax.random.PRNGKey(seed)
    k_server, k_start, k_run = jax.random.split(key, 3)
    data = fed.client_data()
    results, mask = _run_all(backend, ctx, float(prior_weight), bool(shared_start), data, k_start, k_run)
    bad = np.flatnonzero(~np.asarray(mask))
    if bad.size:
        warnings.warn(f"run_clients: the results of client(s) {bad.tolist()} are not finite; they are masked "
                      "out of every aggregate", RuntimeWarning, stacklevel=2)
    return ClientRuns(ctx, results, mask, float(prior_weight), k_server, data)


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _run_all(backend, ctx, prior_weight, shared_start, data, k_start, k_run):
    K = ctx.num_clients
    strategy = backend.init_strategy

    def one(d, k):
        k_init, k = jax.random.split(k)
        z0 = ctx.potential.init(k_start if shared_start else k_init, strategy)
        res = run_chains(backend, k, ctx.potential, make_target(d, ctx.dim, prior_weight=prior_weight), z0)
        return res, finite_flag(res.posterior)

    return vmap_clients(one)(data, jax.random.split(k_run, K))


def aggregate(algorithms, runs: ClientRuns, key=None) -> list:
    """The posteriors of several one-round ``algorithms`` from one :class:`ClientRuns` (no re-run).

    Each algorithm must ask for the prior share the clients used
    (``runs.prior_weight``); a mismatch raises ValueError. key: the server key
    (default ``runs.key``).
    """
    ctx = runs.context
    if ctx.potential.local_sites:
        raise ValueError(f"aggregate() does not take client-local sites yet ({list(ctx.potential.local_sites)}): "
                         "run the method with fp.run, whose clients keep their local posteriors")
    out = []
    for algo in algorithms:
        if not isinstance(algo, OneRoundAlgorithm):
            raise TypeError(f"aggregate takes one-round algorithms, got {type(algo).__name__}")
        check_local_sites(algo, ctx.potential)
        s = algo.prior_weight(ctx)
        if abs(s - runs.prior_weight) > 1e-9 * max(1.0, abs(s)):
            raise ValueError(f"{type(algo).__name__} needs clients run with prior share {s:g}, these used "
                             f"{runs.prior_weight:g} (run_clients(..., prior_weight={s:g}))")
        out.append(algo.posterior_from_results(ctx, runs.results, runs.key if key is None else key, runs.mask,
                                               data=runs.data))
    return out


__all__ = ["PhaseData", "client_phase_key", "run_client_phase", "FromClientPhase", "ClientRuns", "run_clients",
           "aggregate"]
