"""MAP optimisation of one client's target: an optax loop under ``lax.scan``.

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


def minimize(potential, target, init: Array, *, key: Optional[Array] = None, num_steps: int = 200,
             optimizer=None, learning_rate: Optional[float] = None,
             batch_size: Optional[int] = None, max_steps=None) -> MapResult:
    """Minimise ``-log_density(z, target) / n`` from ``init`` with ``num_steps`` optax steps.

    ``max_steps`` (optional, traced int): steps ``t >= max_steps`` of the
    fixed-length scan leave everything unchanged (a run stopped early).
    Returns a :class:`MapResult` (final point, full-batch mean loss and
    gradient norm there, number of rejected steps).
    """
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    if batch_size is not None and batch_size <= 0:
        raise ValueError(f"batch_size must be positive or None, got {batch_size}")
    tx = make_optimizer(optimizer, learning_rate, batch_size)
    key = jax.random.PRNGKey(0) if key is None else key

    def full_loss(z):
        return mean_loss(potential, z, target)

    state0 = tx.init(init)
    reuse = batch_size is None and _stores_value(state0)
    full_vg = optax.value_and_grad_from_state(full_loss) if reuse else None

    def step(carry, xs):
        z, state, best_z, best_loss, rejected = carry
        k, t = xs
        active = within_budget(t, max_steps)
        if batch_size is None:
            fn = full_loss
            value, grad = full_vg(z, state=state) if reuse else jax.value_and_grad(fn)(z)
        else:
            def fn(x):
                return mean_loss(potential, x, target, k, batch_size)
            value, grad = jax.value_and_grad(fn)(z)
        updates, new_state = tx.update(grad, state, z, value=value, grad=grad, value_fn=fn)
        new_z = optax.apply_updates(z, updates)
        ok = jnp.isfinite(value) & jnp.all(jnp.isfinite(grad)) & jnp.all(jnp.isfinite(new_z)) & active
        z_next, state_next = tree_select(ok, (new_z, new_state), (z, state))
        # value is the loss at z (before the step): track the best point visited.
        better = jnp.isfinite(value) & (value < best_loss) & active
        best_z = jnp.where(better, z, best_z)
        best_loss = jnp.where(better, value, best_loss)
        failed = active & ~ok
        return (z_next, state_next, best_z, best_loss, rejected + failed.astype(jnp.int32)), None

    inf = jnp.array(jnp.inf, dtype=init.dtype)
    carry0 = (init, state0, init, inf, jnp.array(0, jnp.int32))
    keys = jax.random.split(key, max(num_steps, 1))[:num_steps]
    (z, _, best_z, best_loss, rejected), _ = jax.lax.scan(step, carry0, (keys, jnp.arange(num_steps)))
    loss, grad = jax.value_and_grad(full_loss)(z)
    if batch_size is None:
        # The last point was never scored inside the loop; keep it if it is the best.
        use_last = jnp.isfinite(loss) & (loss <= best_loss)
        z = jnp.where(use_last, z, best_z)
        loss, grad = jax.value_and_grad(full_loss)(z)
    return MapResult(z, loss, jnp.linalg.norm(grad), rejected)


__all__ = ["MapResult", "minimize", "make_optimizer", "OPTIMIZERS"]
