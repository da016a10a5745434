"""Step budgets inside fixed-length scans: the "frozen after ``max_steps``" rule.

A client run is a ``lax.scan`` of a static number of steps (shapes stay fixed
under ``vmap``). A run stopped early (a straggler truncated at a deadline,
:mod:`fedprob.faults`; a client whose own step count is below the scanned
one, local SGD with ``local_epochs``) keeps the same scan and masks the
update: step ``t`` (0-based) is taken when ``t < max_steps``; every later step
leaves the carried state unchanged, so the scan's result is the state of a
run of ``max_steps`` steps. ``max_steps`` is a traced integer (per client under
``vmap``) or ``None``, no budget: every step is taken, and the masked update
returns the new state itself (the same numbers as an unmasked scan).

:func:`tree_select` is the masked update itself (a pytree ``where``), also
used where a step is rejected for another reason (a non-finite update, a
rolled-back SG-MCMC window).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def within_budget(t, max_steps):
    """``t < max_steps``: step ``t`` is taken (``True`` when ``max_steps`` is ``None``)."""
    return True if max_steps is None else jnp.asarray(t) < max_steps


def tree_select(pred, on_true, on_false):
    """Leafwise ``where(pred, on_true, on_false)`` over two pytrees of the same structure."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def frozen_after(max_steps, t, new, old):
    """The carry after step ``t``: ``new`` within the budget, else ``old`` (the state is frozen).

    ``max_steps=None`` returns ``new`` (no mask is built).
    """
    if max_steps is None:
        return new
    return tree_select(within_budget(t, max_steps), new, old)


__all__ = ["within_budget", "tree_select", "frozen_after"]
