"""``fp.Faults``: simulated faults of a run, and the screening of client messages before aggregation.

:class:`Faults` configures what the local engine does to each round's M
participants (shapes never change, so nothing recompiles)::

    fp.Faults(dropout_rate=0.1, stragglers=fp.Stragglers(0.2, policy="truncate"), max_update_norm=10.0)

* ``dropout_rate``: each participant independently fails to report with this
  probability (its mask bit is dropped; it still computes, since shapes are
  fixed, but nothing it produced is used and its client state is unchanged).
* ``stragglers``: a :class:`~fedprob.stragglers.Stragglers` (a number is short
  for ``Stragglers(rate=number)``; None: none). Each reporting participant
  independently misses the round's deadline on its local work with
  probability ``rate``. A straggler
  completes the fraction ``f ~ Uniform[min_fraction, 1)`` of its
  local steps by the deadline (one draw per straggler and round), i.e.
  ``s_k = floor(f * S_k)`` of its ``S_k`` steps. ``policy``:

  - ``"truncate"`` (default): the straggler's update after its ``s_k``
    completed steps is what the server receives and aggregates, with the same
    weight as any other client (heterogeneous local work, as in FedNova's
    setting); the local step loops keep their fixed length and steps at or
    after ``s_k`` leave the client's state unchanged. A straggler with
    ``s_k = 0`` has nothing to send: its message is discarded. Algorithms whose
    client computation has no partial result (``Algorithm.local_step_count`` is
    None: exact Laplace/Newton solves, the isotropic natural loop, sampler
    clients whose estimators need all their draws such as FedPA, the
    one-round methods, EP-MCMC) fall back to ``"discard"``; the history then
    records ``s_k = 0``.
  - ``"discard"``: the straggler's message arrives too late and is discarded
    whole; its state is unchanged.

  Which algorithms truncate: FedAvg/FedProx (optimiser steps of
  :func:`~fedprob.algorithms.local_training.train_locally`), FedDyn (steps of
  its local solve) and the natural loop (PVI, BayesADMM, ...) with an
  iterative Gaussian backend (:class:`~fedprob.inference.IVON`,
  :class:`~fedprob.inference.VON`: their ``map_steps + num_steps`` steps;
  SVI clients fall back to discard).
* ``max_update_norm``: a reporting client whose update has L2 norm above
  the bound is quarantined (weight 0 that round, state unchanged). The update
  is what :meth:`~fedprob.algorithms.base.Algorithm.update_part` names
  (FedAvg/FedProx: the delta; FedPA: its delta), else every floating leaf of
  the message. ``None`` (default) sets no bound.

Independently of these options a client whose message or new state is not
finite is always quarantined. Every quarantined client is recorded in the
round's history with its reason (see :func:`fault_records`).

Randomness: dropout and the straggler draw come from ``fold_in(key,
FAULT_TAG)``, the completed fractions from ``fold_in(key, WORK_TAG)`` and
only under truncation, so the work model touches no other random stream (the
discard policy draws exactly the keys of a run without completed fractions).
Without truncation no step budget is traced: the client update is the same
program as in a run without stragglers.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .stragglers import STRAGGLER_POLICIES, Stragglers
from .validation import check_fraction, check_positive
from .names import CheckedKeywords

#: fold_in tag of the faults' randomness (independent of client selection and client keys).
FAULT_TAG = 0x0FA17
#: fold_in tag of the stragglers' completed fractions of local work (drawn only under truncation).
WORK_TAG = 0x5106


@dataclasses.dataclass(frozen=True)
class Faults(CheckedKeywords):
    """Fault simulation and the norm bound of one run (module docstring): ``dropout_rate`` in
    [0, 1), ``stragglers`` a :class:`~fedprob.stragglers.Stragglers` (a number ``r`` is short for
    ``Stragglers(rate=r)``; None or 0: none), ``max_update_norm`` positive or None."""

    dropout_rate: float = 0.0
    stragglers: Optional[Stragglers] = None
    max_update_norm: Optional[float] = None

    def __post_init__(self):
        s = self.stragglers
        if isinstance(s, (int, float, np.integer, np.floating)) and not isinstance(s, bool):
            s = Stragglers(float(s)) if s else None
            object.__setattr__(self, "stragglers", s)
        if s is not None and not isinstance(s, Stragglers):
            raise TypeError(f"Faults.stragglers must be a fp.Stragglers (or a rate), got {type(s).__name__}")
        check_fraction("dropout_rate", self.dropout_rate, high_open=True)
        check_positive("max_update_norm", self.max_update_norm, allow_none=True)

    @property
    def straggler_rate(self) -> float:
        return 0.0 if self.stragglers is None else self.stragglers.rate

    @property
    def straggler_policy(self) -> str:
        return "truncate" if self.stragglers is None else self.stragglers.policy

    @property
    def straggler_min_fraction(self) -> float:
        return 0.0 if self.stragglers is None else self.stragglers.min_fraction

    @property
    def active(self) -> bool:
        return self.dropout_rate > 0 or self.straggler_rate > 0 or self.max_update_norm is not None

    @property
    def truncates(self) -> bool:
        """Stragglers are simulated and their partial updates kept (where the algorithm has them)."""
        return self.stragglers is not None and self.stragglers.truncates

    def fingerprint(self) -> str:
        """One canonical description of what these settings simulate (checkpoints compare it)."""
        return (f"Faults(dropout_rate={self.dropout_rate!r}, straggler_rate={self.straggler_rate!r}, "
                f"max_update_norm={self.max_update_norm!r}, straggler_policy={self.straggler_policy!r}, "
                f"straggler_min_fraction={self.straggler_min_fraction!r})")


class Draw(NamedTuple):
    """The round's simulated faults, drawn before the clients compute, each (M,)."""

    present: jax.Array     # reports (not dropped out)
    straggler: jax.Array   # reports, but misses the deadline on its local work
    fraction: Optional[jax.Array]   # completed fraction of local work (None unless truncating)


def draw(key, num_participants: int, faults: Optional[Faults]) -> Draw:
    """Dropout, stragglers and (under truncation) their completed fractions of round ``key``."""
    M = num_participants
    faults = faults or Faults()
    k_drop, k_late = jax.random.split(jax.random.fold_in(key, FAULT_TAG))
    present = jnp.ones((M,), bool)
    if faults.dropout_rate > 0:
        present = jax.random.bernoulli(k_drop, 1.0 - faults.dropout_rate, (M,))
    straggler = jnp.zeros((M,), bool)
    if faults.straggler_rate > 0:
        straggler = present & jax.random.bernoulli(k_late, faults.straggler_rate, (M,))
    fraction = None
    if faults.truncates:
        fraction = jax.random.uniform(jax.random.fold_in(key, WORK_TAG), (M,),
                                      minval=faults.straggler_min_fraction, maxval=1.0)
    return Draw(present, straggler, fraction)


def step_budget(fraction, full_steps, straggler):
    """Local steps each participant completes: ``floor(f * S_k)`` for stragglers, ``S_k`` otherwise."""
    full = jnp.asarray(full_steps, jnp.int32)
    done = jnp.floor(fraction * full.astype(fraction.dtype)).astype(jnp.int32)
    return jnp.where(straggler, jnp.minimum(done, full), full)


class Screen(NamedTuple):
    """Per-participant outcome of screening, each (M,)."""

    ok: jax.Array          # aggregated: present, sent in time, finite and within the bound
    present: jax.Array     # reported (not dropped out)
    straggler: jax.Array   # missed the deadline on its local work
    finite: jax.Array      # message and new state finite
    norm: jax.Array        # L2 norm of the update part
    steps: Optional[jax.Array] = None   # local steps completed under truncation (None: not truncating)


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


def screen(algorithm, ctx, messages, finite, faults: Optional[Faults], drawn: Draw,
           budget=None) -> Screen:
    """Which of the M participants' messages are aggregated this round.

    budget: (M,) local steps each participant completed when stragglers were truncated
    (None: stragglers are discarded).
    """
    M = finite.shape[0]
    norm = jax.vmap(lambda m: tree_norm(update_of(algorithm, ctx, m)))(messages)
    faults = faults or Faults()
    present, straggler = drawn.present, drawn.straggler
    steps, on_time = None, ~straggler
    if budget is not None:
        steps = budget
        on_time = on_time | (budget > 0)
    within = jnp.ones((M,), bool)
    if faults.max_update_norm is not None:
        within = norm <= faults.max_update_norm
    ok = present & on_time & finite & within
    return Screen(ok, present, straggler, finite, norm, steps)


def fault_records(participants, present, straggler, finite, norm, bound, steps=None) -> dict:
    """History columns of one round (numpy inputs): dropped, stragglers, straggler_steps, excluded, faults.

    ``straggler_steps`` lists, for each straggler in ``stragglers``, the local
    steps it completed and sent (0: its message was discarded). ``faults`` is
    a list of ``{"client", "reason"}`` for every reporting client that was
    quarantined: reason ``"non-finite update"`` or ``"update norm N > bound B"``.
    """
    steps = np.zeros(len(participants), np.int64) if steps is None else np.asarray(steps)
    steps = np.where(straggler, steps, 0)
    reporting = present & (~straggler | (steps > 0))
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
            "straggler_steps": [int(s) for s in steps[straggler]],
            "excluded": [f["client"] for f in faults], "faults": faults}


__all__ = ["Faults", "Stragglers", "Draw", "Screen", "draw", "step_budget", "screen", "fault_records", "tree_norm",
           "update_of", "STRAGGLER_POLICIES"]
