"""The protocols every layer shares: client backends, their results, the finite flag.

They live in the core (with :mod:`fedprob.potential`, which defines
:class:`~fedprob.potential.ClientData` and :class:`~fedprob.potential.LocalTarget`,
and :mod:`fedprob.posteriors`), so the engine and the algorithms depend on no
backend package.

The client backend protocol.

A backend is a frozen dataclass of hyperparameters (hashable, so compiled
functions can be cached on it) with one pure method::

    run(key, potential, target, init) -> ClientResult

``potential`` is a :class:`fedprob.potential.Potential` (static), ``target`` a
:class:`fedprob.potential.LocalTarget` (one client's padded data, prior weight,
likelihood weight and Gaussian term), ``init`` the flat unconstrained
starting point (d,). ``run`` is jittable and vmappable over
``(key, target, init)``, loops over steps with ``lax.scan``, and draws its
noise once over the flat vector. It returns a :class:`ClientResult`: the
posterior form (``Samples`` (S, d) or ``Gaussian``), the final point (last
iterate, MAP or mean: used to warm-start the next round), and a dict of
scalar diagnostics.

Several chains: a sampling backend with a ``num_chains`` field (> 1) runs
that many independent chains per client through :func:`run_chains` (``run``
vmapped over chain keys; chain 0 starts at ``init``, the others at
``potential.init`` draws of their own). The draws are stacked chain-major,
``Samples`` (num_chains * S, d), so ``draws.reshape(num_chains, S, d)``
recovers the chains; scalar diagnostics are summed (the counts ``num_*``,
but not ``num_steps``, a mean per transition), and-ed
(``finite``) or averaged over chains, per-draw statistics (``DRAW_STATS``)
stacked (num_chains, S); ``params`` is chain 0's.

Stopping early (stragglers truncated at a deadline, :mod:`fedprob.faults`):
a backend whose run has a meaningful partial result sets
``local_step_count`` to the number of steps of one run and accepts
``run(key, potential, target, init, max_steps=b)`` with a traced
``b <= local_step_count``: the fixed-length scans leave the state unchanged
at steps ``t >= b``. ``None`` (default) means no partial result (e.g. a
Laplace approximation needs the mode).

Conventions: step sizes act on the gradient of the **log posterior**
(a sum over the client's points); temperature T multiplies the variance of
injected noise (T = 1 is the Bayesian posterior); ``batch_size=None`` is the
full batch.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .names import CheckedKeywords
from .posteriors import Gaussian, Samples
from .potential import ClientData, LocalTarget

Array = jax.Array


#: The diagnostics entry holding per-draw sampler statistics: a dict name -> (S,) array (one value
#: per kept draw) from ``run``, (num_chains, S) after :func:`run_chains`. Optional; every other
#: diagnostics entry is a scalar.
DRAW_STATS = "draw_stats"


class ClientResult(NamedTuple):
    posterior: Any          # Samples or Gaussian
    params: Array           # (d,) final point
    diagnostics: dict       # name -> scalar array (and DRAW_STATS -> dict of per-draw arrays)


class ClientBackend(CheckedKeywords):
    """Base class of client backends: subclasses are frozen dataclasses (an unknown keyword argument
    is a TypeError naming the closest field, :class:`fedprob.names.CheckedKeywords`)."""

    output: str = "samples"   # or "gaussian"
    #: the ``Potential.init`` strategy of the chain's or optimiser's start when the caller gives
    #: none: samplers draw from the prior, optimiser-started backends start at the prior centre
    init_strategy: str = "prior"
    #: steps of one run that ``run(..., max_steps=b)`` can stop after; None: no partial result
    local_step_count = None

    def run(self, key, potential, target, init) -> ClientResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def run_clients(self, key, potential, targets, inits) -> ClientResult:
        """:func:`run_chains` vmapped over a leading client axis of ``targets`` and ``inits``."""
        keys = jax.random.split(key, inits.shape[0])
        return jax.vmap(lambda k, t, z: run_chains(self, k, potential, t, z))(keys, targets, inits)


def num_chains(backend) -> int:
    """The backend's ``num_chains`` (1 when it has no such field); a ValueError when not a positive int."""
    c = getattr(backend, "num_chains", 1)
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"num_chains must be a positive integer, got {c!r}")
    if c > 1 and getattr(backend, "output", "samples") != "samples":
        raise ValueError(f"num_chains={c}: several chains need a sampling backend, "
                         f"{type(backend).__name__} returns a Gaussian")
    return c


def run_chains(backend, key, potential, target, init) -> ClientResult:
    """``backend.run`` on ``backend.num_chains`` chains (vmapped over chain keys), stacked chain-major."""
    C = num_chains(backend)
    if C == 1:
        res = backend.run(key, potential, target, init)
        if DRAW_STATS not in res.diagnostics:
            return res
        per_draw = {n: v[None] for n, v in res.diagnostics[DRAW_STATS].items()}
        return res._replace(diagnostics={**res.diagnostics, DRAW_STATS: per_draw})
    keys = jax.random.split(key, 2 * C)
    starts = jax.vmap(lambda k: potential.init(k, backend.init_strategy))(keys[C + 1:])
    inits = jnp.concatenate([init[None], starts.astype(init.dtype)], 0)
    res = jax.vmap(lambda k, z: backend.run(k, potential, target, z))(keys[:C], inits)
    draws = res.posterior.draws
    stacked = Samples(draws.reshape((C * draws.shape[1],) + draws.shape[2:]))
    diag = {}
    for name, v in res.diagnostics.items():
        if name == DRAW_STATS:
            diag[name] = v                                   # name -> (C, S), chain-major like the draws
        elif name == "finite" or v.dtype == jnp.bool_:
            diag[name] = jnp.all(v)
        elif name.startswith("num_") and name != "num_steps":   # counts; num_steps is a mean per transition
            diag[name] = jnp.sum(v)
        else:
            diag[name] = jnp.mean(v)
    return ClientResult(stacked, res.params[0], diag)


def finite_flag(*trees) -> Array:
    """True when every floating leaf of every tree is finite."""
    ok = jnp.array(True)
    for tree in trees:
        for leaf in jax.tree_util.tree_leaves(tree):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                ok = ok & jnp.all(jnp.isfinite(leaf))
    return ok


__all__ = ["DRAW_STATS", "ClientBackend", "ClientResult", "run_chains", "num_chains", "ClientData", "LocalTarget", "finite_flag"]
