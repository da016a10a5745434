"""Simulated faults and the screening of client messages before aggregation.

:class:`Faults` configures what the local engine does to each round's M
participants (shapes never change, so nothing recompiles):

* ``dropout_rate``: each participant independently fails to report with this
  probability (its mask bit is dropped; it still computes, since shapes are
  fixed, but nothing it produced is used and its client state is unchanged).
* ``straggler_rate``: each reporting participant independently misses the
  round's deadline with this probability. The deadline model is the simplest
  honest one: a straggler's message arrives too late and is discarded whole,
  for every kind of client update (optimiser steps of FedAvg/FedProx, sampler
  draws of FedPA, the one-shot runs of the one-round methods); no partially
  finished update is ever aggregated, and the straggler's state is unchanged.
* ``max_update_norm``: a reporting client whose update has L2 norm above
  the bound is quarantined (weight 0 that round, state unchanged). The update
  is what :meth:`~fedprob.algorithms.base.Algorithm.update_part` names
  (FedAvg/FedProx: the delta; FedPA: its delta), else every floating leaf of
  the message. ``None`` (default) sets no bound.

Independently of these options a client whose message or new state is not
finite is always quarantined. Every quarantined client is recorded in the
round's history with its reason (see :func:`fault_records`).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .validation import check_fraction, check_positive

#: fold_in tag of the faults' randomness (independent of client selection and client keys).
FAULT_TAG = 0x0FA17


@dataclasses.dataclass(frozen=True)
class Faults:
    """Fault simulation and the norm bound of one run (module docstring)."""

    dropout_rate: float = 0.0
    straggler_rate: float = 0.0
    max_update_norm: Optional[float] = None

    def __post_init__(self):
        check_fraction("dropout_rate", self.dropout_rate, high_open=True)
        check_fraction("straggler_rate", self.straggler_rate, high_open=True)
        check_positive("max_update_norm", self.max_update_norm, allow_none=True)

    @property
    def active(self) -> bool:
        return self.dropout_rate > 0 or self.straggler_rate > 0 or self.max_update_norm is not None


class Screen(NamedTuple):
    """Per-participant outcome of screening, each (M,)."""

    ok: jax.Array          # aggregated: present, on time, finite and within the bound
    present: jax.Array     # reported (not dropped out)
    straggler: jax.Array   # reported after the deadline (discarded)
    finite: jax.Array      # message and new state finite
    norm: jax.Array        # L2 norm of the update part


def update_of(algorithm, ctx, message):
    """The update part of ONE client's message (every floating leaf when the algorithm names none)."""
    part = algorithm.update_part(ctx, message)
    if part is None:
        return [a for a in jax.tree_util.tree_leaves(message) if jnp.issubdtype(a.dtype, jnp.inexact)]
    return part


def tree_norm(tree):
    """L2 norm over every leaf of ``tree`` (computed in float32 or wider)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.zeros(())
    return jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(jnp.promote_types(a.dtype, jnp.float32))))
                        for a in leaves))


def screen(algorithm, ctx, messages, finite, key, faults: Optional[Faults]) -> Screen:
    """Which of the M participants' messages are aggregated this round."""
    M = finite.shape[0]
    norm = jax.vmap(lambda m: tree_norm(update_of(algorithm, ctx, m)))(messages)
    faults = faults or Faults()
    k_drop, k_late = jax.random.split(jax.random.fold_in(key, FAULT_TAG))
    present = jnp.ones((M,), bool)
    if faults.dropout_rate > 0:
        present = jax.random.bernoulli(k_drop, 1.0 - faults.dropout_rate, (M,))
    straggler = jnp.zeros((M,), bool)
    if faults.straggler_rate > 0:
        straggler = present & jax.random.bernoulli(k_late, faults.straggler_rate, (M,))
    within = jnp.ones((M,), bool)
    if faults.max_update_norm is not None:
        within = norm <= faults.max_update_norm
    ok = present & ~straggler & finite & within
    return Screen(ok, present, straggler, finite, norm)


def fault_records(participants, present, straggler, finite, norm, bound) -> dict:
    """History columns of one round (numpy inputs): dropped, stragglers, excluded, faults.

    ``faults`` is a list of ``{"client", "reason"}`` for every reporting client
    that was quarantined: reason ``"non-finite update"`` or
    ``"update norm N > bound B"``.
    """
    reporting = present & ~straggler
    faults = []
    for c, f, n, rep in zip(participants.tolist(), finite.tolist(), norm.tolist(), reporting.tolist()):
        if not rep:
            continue
        if not f:
            faults.append({"client": c, "reason": "non-finite update"})
        elif bound is not None and not n <= bound:
            faults.append({"client": c, "reason": f"update norm {n:.4g} > bound {bound:.4g}"})
    return {"dropped": participants[~present].tolist(),
            "stragglers": participants[straggler].tolist(),
            "excluded": [f["client"] for f in faults], "faults": faults}


__all__ = ["Faults", "Screen", "screen", "fault_records", "tree_norm", "update_of"]
