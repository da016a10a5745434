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

Conventions: step sizes act on the gradient of the **log posterior**
(a sum over the client's points); temperature T multiplies the variance of
injected noise (T = 1 is the Bayesian posterior); ``batch_size=None`` is the
full batch.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .posteriors import Gaussian, Samples
from .potential import ClientData, LocalTarget

Array = jax.Array


class ClientResult(NamedTuple):
    posterior: Any          # Samples or Gaussian
    params: Array           # (d,) final point
    diagnostics: dict       # name -> scalar array


class ClientBackend:
    """Base class of client backends: subclasses are frozen dataclasses."""

    output: str = "samples"   # or "gaussian"
    #: the ``Potential.init`` strategy of the chain's or optimiser's start when the caller gives
    #: none: samplers draw from the prior, optimiser-started backends start at the prior centre
    init_strategy: str = "prior"

    def run(self, key, potential, target, init) -> ClientResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def run_clients(self, key, potential, targets, inits) -> ClientResult:
        """``run`` vmapped over a leading client axis of ``targets`` and ``inits``."""
        keys = jax.random.split(key, inits.shape[0])
        return jax.vmap(lambda k, t, z: self.run(k, potential, t, z))(keys, targets, inits)


def finite_flag(*trees) -> Array:
    """True when every floating leaf of every tree is finite."""
    ok = jnp.array(True)
    for tree in trees:
        for leaf in jax.tree_util.tree_leaves(tree):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                ok = ok & jnp.all(jnp.isfinite(leaf))
    return ok


__all__ = ["ClientBackend", "ClientResult", "ClientData", "LocalTarget", "finite_flag"]
