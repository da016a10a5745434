"""MAP optimisation of one client's target: an optax loop under ``lax.while_loop``
(full batch, stopping when the loss stalls) or ``lax.scan`` (minibatches).

The objective is the client's **mean** loss ``-log_density(z, target) / n``
(:func:`fedprob.potential.mean_loss`), so learning rates carry across client
sizes; its minimiser is the mode of the target (prior weight, likelihood
weight and Gaussian term included). ``batch_size=None`` uses the full batch
at every step; otherwise each step draws its own minibatch (unbiased for the
sum over the client's points, see :func:`fedprob.potential.minibatch`).

A step whose loss or new point is not finite is rejected (the point and the
optimizer state stay as they were), so the result is always a finite point
the loop has visited. With the full batch the best point seen is returned
(L-BFGS is monotone up to line-search tolerance, so this is the last one).

Usable by any backend: ``minimize(potential, target, init, key=...)`` is pure,
jittable and vmappable over ``(target, init, key)``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from fedprob.potential import mean_loss

from .budget import tree_select, within_budget

Array = jax.Array

OPTIMIZERS = ("lbfgs", "adam", "sgd", "adagrad", "yogi")


class MapResult(NamedTuple):
    params: Array        # (d,) final (full batch: best) point
    loss: Array          # () full-batch mean loss -log_density / n at params
    grad_norm: Array     # () norm of the full-batch mean-loss gradient at params
    num_rejected: Array  # () steps rejected for a non-finite loss or point
    num_steps: Array     # () steps taken (full batch: fewer than asked once the loss stalls)


def make_optimizer(optimizer: Union[str, optax.GradientTransformation, None] = None,
                   learning_rate: Optional[float] = None,
                   batch_size: Optional[int] = None, momentum: Optional[float] = None,
                   eps: float = 1e-8) -> optax.GradientTransformationExtraArgs:
    """The optax transformation for a name (or pass an optax transformation through).

    The one place in fedprob that turns a name and learning rate into an
    optax transformation (MAP backends, FedAvg-family clients and servers).
    ``None`` picks ``"lbfgs"`` (zoom line search) for the full batch and
    ``"adam"`` for minibatches. ``learning_rate=None`` means: line search for
    L-BFGS, 1e-2 for the others (on the mean loss). ``momentum`` applies to
    SGD (heavy ball); ``eps`` is the adaptivity floor of adam / adagrad / yogi
    (Reddi et al. use 1e-3 at a FedAdam server). The result accepts optax's
    extra arguments (``value``, ``grad``, ``value_fn``), which L-BFGS needs.
    """
    if optimizer is None:
        optimizer = "lbfgs" if batch_size is None else "adam"
    if isinstance(optimizer, str):
        name = optimizer.lower()
        lr = 1e-2 if learning_rate is None else learning_rate
        if name == "lbfgs":
            if batch_size is not None:
                raise ValueError("optimizer='lbfgs' needs the full batch (batch_size=None); "
                                 "use 'adam' or 'sgd' with minibatches")
            tx = optax.lbfgs(learning_rate=learning_rate)
        elif name == "adam":
            tx = optax.adam(lr, eps=eps)
        elif name == "sgd":
            tx = optax.sgd(lr, momentum=momentum or None)
        elif name == "adagrad":
            tx = optax.adagrad(lr, eps=eps)
        elif name == "yogi":
            tx = optax.yogi(lr, eps=eps)
        else:
            raise ValueError(f"unknown optimizer '{optimizer}' (use one of {OPTIMIZERS} "
                             "or an optax GradientTransformation)")
    elif isinstance(optimizer, optax.GradientTransformation):
        tx = optimizer
    else:
        raise ValueError(f"optimizer must be a name in {OPTIMIZERS} or an optax "
                         f"GradientTransformation, got {type(optimizer).__name__}")
    return optax.with_extra_args_support(tx)


def _stores_value(state) -> bool:
    try:
        get = optax.tree.get
        return get(state, "value") is not None and get(state, "grad") is not None
    except (KeyError, ValueError):
        return False


def _update(tx, z, state, value, grad, fn):
    updates, new_state = tx.update(grad, state, z, value=value, grad=grad, value_fn=fn)
    new_z = optax.apply_updates(z, updates)
    ok = jnp.isfinite(value) & jnp.all(jnp.isfinite(grad)) & jnp.all(jnp.isfinite(new_z))
    return new_z, new_state, ok


def descend_until_stall(tx, fn, init: Array, num_steps: int, max_steps=None):
    """At most ``num_steps`` steps of ``tx`` on a deterministic ``fn`` from ``init`` in a
    ``lax.while_loop`` that stops once the loss has stalled: ``STALL_STEPS`` steps in a row improving
    the best loss by at most ``noise = STALL_TOL * eps * (1 + |loss|)`` (eps of ``init``'s dtype). A
    converged L-BFGS otherwise spends every remaining step in a line search that cannot decrease the
    loss (tens of evaluations each): 200 steps cost 7x the 10 that converge. Steps with a non-finite
    value, gradient or point are rejected (the point and state stay). Under ``vmap`` the loop runs
    until every lane has stopped, the finished lanes unchanged.

    The point returned is the best visited (the last one included): the lowest loss, and among
    losses within ``noise`` of each other (in float32 the rounding of a loss of order 10 is about
    1e-6, more than the loss still to be gained near the mode) the smallest gradient.

    Returns ``(steps taken, best point, its loss, its gradient norm, rejected steps)``.
    """
    state0 = tx.init(init)
    from_state = _stores_value(state0)
    vg = optax.value_and_grad_from_state(fn) if from_state else jax.value_and_grad(fn)
    tol = STALL_TOL * jnp.finfo(init.dtype).eps

    def better(value, gnorm, best_loss, best_gnorm):
        noise = tol * (1.0 + jnp.abs(value))
        ok = jnp.isfinite(value) & jnp.isfinite(gnorm)
        return ok & ((value < best_loss - noise) | ((value <= best_loss + noise) & (gnorm < best_gnorm))), \
            ok & (value < best_loss - noise)

    def cond(carry):
        t, stall = carry[0], carry[7]
        return (t < num_steps) & (stall < STALL_STEPS) & within_budget(t, max_steps)

    def body(carry):
        t, z, state, best_z, best_loss, best_gnorm, rejected, stall = carry
        value, grad = vg(z, state=state) if from_state else vg(z)
        new_z, new_state, ok = _update(tx, z, state, value, grad, fn)
        z_next, state_next = tree_select(ok, (new_z, new_state), (z, state))
        gnorm = jnp.linalg.norm(grad)
        take, gained = better(value, gnorm, best_loss, best_gnorm)
        best_z, best_loss, best_gnorm = tree_select(take, (z, value, gnorm), (best_z, best_loss, best_gnorm))
        stall = jnp.where(gained, 0, stall + 1)
        return (t + 1, z_next, state_next, best_z, best_loss, best_gnorm, rejected + (~ok).astype(jnp.int32),
                stall)

    zero = jnp.array(0, jnp.int32)
    inf = jnp.array(jnp.inf, init.dtype)
    carry0 = (zero, init, state0, init, inf, inf, zero, zero)
    taken, z, _, best_z, best_loss, best_gnorm, rejected, _ = jax.lax.while_loop(cond, body, carry0)
    # the last point was never scored inside the loop
    value, grad = jax.value_and_grad(fn)(z)
    gnorm = jnp.linalg.norm(grad)
    take, _ = better(value, gnorm, best_loss, best_gnorm)
    best_z, best_loss, best_gnorm = tree_select(take, (z, value, gnorm), (best_z, best_loss, best_gnorm))
    return taken, best_z, best_loss, best_gnorm, rejected


# the full-batch loop stops after STALL_STEPS steps in a row that improve the best loss by at most
# STALL_TOL * eps * (1 + |loss|) (eps of the parameters' dtype)
STALL_STEPS = 5
STALL_TOL = 8.0


def minimize(potential, target, init: Array, *, key: Optional[Array] = None, num_steps: int = 200,
             optimizer=None, learning_rate: Optional[float] = None,
             batch_size: Optional[int] = None, max_steps=None) -> MapResult:
    """Minimise ``-log_density(z, target) / n`` from ``init`` with at most ``num_steps`` optax steps.

    Full batch: a ``lax.while_loop`` that also stops once the loss has stalled
    (``STALL_STEPS`` steps in a row improving the best loss by at most
    ``STALL_TOL * eps * (1 + |loss|)``); vmapped over clients it runs until
    every client has stopped, the finished ones unchanged. Minibatches: a
    fixed-length ``lax.scan`` of ``num_steps`` steps.
    ``max_steps`` (optional, traced int): steps ``t >= max_steps`` are not
    taken (a run stopped early).
    Returns a :class:`MapResult` (final point, full-batch mean loss and
    gradient norm there, number of rejected steps, number of steps taken).
    """
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    if batch_size is not None and batch_size <= 0:
        raise ValueError(f"batch_size must be positive or None, got {batch_size}")
    tx = make_optimizer(optimizer, learning_rate, batch_size)
    key = jax.random.PRNGKey(0) if key is None else key

    def full_loss(z):
        return mean_loss(potential, z, target)

    if batch_size is None:
        taken, z, loss, gnorm, rejected = descend_until_stall(tx, full_loss, init, num_steps, max_steps)
        return MapResult(z, loss, gnorm, rejected, taken)
    else:
        inf = jnp.array(jnp.inf, dtype=init.dtype)

        def step(carry, xs):
            z, state, best_z, best_loss, rejected = carry
            k, t = xs
            active = within_budget(t, max_steps)

            def fn(x):
                return mean_loss(potential, x, target, k, batch_size)
            value, grad = jax.value_and_grad(fn)(z)
            new_z, new_state, ok = _update(tx, z, state, value, grad, fn)
            ok = ok & active
            z_next, state_next = tree_select(ok, (new_z, new_state), (z, state))
            # value is the loss at z (before the step): track the best point visited.
            better = jnp.isfinite(value) & (value < best_loss) & active
            best_z = jnp.where(better, z, best_z)
            best_loss = jnp.where(better, value, best_loss)
            failed = active & ~ok
            return (z_next, state_next, best_z, best_loss, rejected + failed.astype(jnp.int32)), None

        carry0 = (init, tx.init(init), init, inf, jnp.array(0, jnp.int32))
        keys = jax.random.split(key, max(num_steps, 1))[:num_steps]
        (z, _, best_z, best_loss, rejected), _ = jax.lax.scan(step, carry0, (keys, jnp.arange(num_steps)))
        taken = jnp.array(num_steps, jnp.int32) if max_steps is None else \
            jnp.minimum(jnp.asarray(max_steps), num_steps).astype(jnp.int32)
    loss, grad = jax.value_and_grad(full_loss)(z)
    return MapResult(z, loss, jnp.linalg.norm(grad), rejected, taken)


__all__ = ["MapResult", "minimize", "descend_until_stall", "make_optimizer", "OPTIMIZERS"]
