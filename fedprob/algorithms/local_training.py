"""Client-side local optimisation shared by FedAvg-family algorithms.

A client minimises its **mean** loss ``-log_density / n_k`` (see
:func:`fedprob.potential.mean_loss`) with the model prior split evenly across
clients (``prior_weight = 1/K``), optionally plus a proximal term
``(mu/2) ||w - w_g||^2``, by ``num_steps`` steps of an optax optimiser on
minibatches. With ``local_epochs`` the number of steps is
``ceil(epochs * n_k / batch_size)`` per client: every client scans the largest
count and freezes once its own count is reached, so shapes stay fixed.

Client-local sites (``infer={"local": True}``): the client trains the joint
``w = (w_g, w_l)`` (global block from the server, local block its own); the
prior share 1/K acts on the global sites only and the proximal term on the
global block only (``prox_center`` has the global block's length).
:func:`local_mode` is the client's local block at its conditional mode given a
fixed global block (full-batch L-BFGS on the local block alone).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from ..inference.budget import frozen_after
from ..inference.optim import descend_until_stall
from ..potential import make_target, mean_loss


def num_local_steps(local_steps, local_epochs, batch_size, n_max: int) -> int:
    """Static number of scanned steps (the largest client's count)."""
    if local_steps is not None:
        if local_steps < 1:
            raise ValueError("local_steps must be >= 1")
        return int(local_steps)
    if local_epochs is None or local_epochs <= 0:
        raise ValueError("give local_steps or a positive local_epochs")
    if batch_size is None:
        return int(math.ceil(local_epochs))
    return int(math.ceil(local_epochs * n_max / batch_size))


def client_steps(local_steps, local_epochs, batch_size, n):
    """Per-client step count (traced): all scanned steps, or ceil(epochs * n / b)."""
    if local_steps is not None:
        return jnp.asarray(local_steps)
    if batch_size is None:
        return jnp.asarray(int(math.ceil(local_epochs)))
    return jnp.ceil(local_epochs * n / batch_size).astype(jnp.int32)


def train_locally(potential, w0, data, key, *, optimizer, total_steps: int, steps, batch_size,
                  prior_weight, prox_center=None, mu: float = 0.0):
    """Run ``total_steps`` optimiser steps (frozen after ``steps``) from w0.

    ``optimizer``: an optax transformation with extra-argument support (see
    :func:`fedprob.inference.optim.make_optimizer`). The proximal term
    ``(mu/2) ||w[:p] - prox_center||^2`` acts on the first ``p = len(prox_center)``
    coordinates (the global block of a model with client-local sites).
    Returns (w_final, mean loss of the last step taken).
    """
    target = make_target(data, potential.dim, prior_weight=prior_weight)

    def loss_fn(w, k):
        loss = mean_loss(potential, w, target, k, batch_size)
        if prox_center is not None and mu > 0:
            loss = loss + 0.5 * mu * jnp.sum((w[:prox_center.shape[-1]] - prox_center) ** 2)
        return loss

    grad_fn = jax.value_and_grad(loss_fn)

    def step(carry, t):
        w, opt_state, last = carry
        k = jax.random.fold_in(key, t)
        loss, g = grad_fn(w, k)
        upd, new_state = optimizer.update(g, opt_state, w, value=loss, grad=g,
                                          value_fn=lambda x: loss_fn(x, k))
        new = (optax.apply_updates(w, upd), new_state, loss)
        return frozen_after(steps, t, new, (w, opt_state, last)), None

    init = (w0, optimizer.init(w0), jnp.zeros((), w0.dtype))
    (w, _, last), _ = jax.lax.scan(step, init, jnp.arange(total_steps))
    return w, last


def local_mode(potential, w_g, w_l0, data, num_steps: int = 100):
    """``(w_l, finite)``: the local block at the mode of ``p(w_l | w_g) p(D_k | w_g, w_l)`` for the fixed
    global block ``w_g``, by at most ``num_steps`` full-batch L-BFGS steps from ``w_l0``, stopping once the
    loss stalls (:func:`fedprob.inference.optim.descend_until_stall`; a step whose loss or point is not
    finite is rejected); ``finite`` is False when no finite point was reached."""
    target = make_target(data, potential.dim, prior_weight=0.0)

    def loss(w_l):
        return mean_loss(potential, jnp.concatenate([w_g, w_l]), target)

    _, w, value, _, _ = descend_until_stall(optax.lbfgs(), loss, w_l0, int(num_steps))
    return w, jnp.isfinite(value) & jnp.all(jnp.isfinite(w))
