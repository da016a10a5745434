"""Curvature and minibatch gradient noise: what the adapted step size is made of.

Scale-aware step sizes. With a sum loss the curvature of the target grows
like the client's size ``n_k``, so a stable step shrinks accordingly. A step
size of ``None`` means *adapted to the target's curvature*:
``step = rate / lambda_max``, ``lambda_max`` the largest |eigenvalue| of the
Hessian of the log target (in the sampler's metric), estimated by
:func:`max_curvature` (power iteration on Hessian-vector products over one
minibatch) at the start point and after every 50 burn-in steps
(warm-started). ``rate`` is the dimensionless ``step * lambda_max`` each
sampler fixes; it bounds the discretisation bias in the stiffest direction.
**The step (and the gradient-noise cap below) is frozen at the end of
burn-in**: a step that depends on the current state during sampling tilts
the stationary density towards high curvature. A burn-in window that
produces NaN/inf is rolled back and every later step halved (diagnostic
``burnin_restarts``); in the sampling phase a block (the steps of one draw,
or a cycle's exploration) that produces NaN/inf is rolled back the same
way, its draw is the restored point, and it is counted in
``sampling_restarts``, so a client never comes back NaN because one step
went too far. A number given as ``step_size`` is used as it is, with no
adaptation, no cap and no rollback.

Minibatch noise, per coordinate. A minibatch gradient adds noise of
per-coordinate variance ``V_i`` (zero for the full batch). For SGLD with
metric ``G`` the update of coordinate ``i`` carries injected variance
``eps T G_i`` and gradient-noise variance ``(eps/2)^2 G_i^2 V_i`` per step;
the restoring drift is the same for both, so in a coordinate that is
decoupled from the others the stationary variance is the exact one times
``1 + r_i`` with ``r_i = eps G_i V_i / (4 T)`` (SGHMC: ``r_i = eta V_i / (2
alpha T)``), *whatever the posterior variance of that coordinate*: the
posterior variance cancels from the ratio. For correlated Gaussian targets
whose gradient-noise covariance is proportional to the curvature (``V = c
H``, the usual case near the mode: per-point Fisher = per-point Hessian) the
excess covariance is ``(eps c / 4) I`` and its ratio to the marginal
posterior variance ``T (H^-1)_ii`` is ``r_i / (H_ii (H^-1)_ii) <= r_i``. So
the worst coordinate's ratio ``max_i r_i`` bounds the relative excess
variance of every coordinate. The adapted step is capped so that ``max_i
r_i <= max_gradient_noise`` (0.1: at most about 10% excess variance in any
coordinate; 10 times looser in the first half of burn-in, where the chain
travels); ``V`` is estimated from pairs of minibatch gradients
(:func:`gradient_noise_variance`). The diagnostic ``gradient_noise_ratio``
reports ``max_i r_i`` at the sampling step (for a given step size: at the
final point). With small batches of a large client the capped step is
small (it scales like ``b / n_k^2``): the ESS target below lengthens the run.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

def target_scale(target) -> Array:
    """``likelihood_weight * n + c(precision)``, at least 1.

    A crude bound on the target's curvature in units of one data point's
    (the fallback of :func:`adapted_step_size`).
    """
    n = jnp.asarray(target.data.n).astype(jnp.result_type(float))
    s = jnp.asarray(target.likelihood_weight) * n
    P = jnp.asarray(target.precision)
    if P.ndim == 1:
        c = jnp.max(jnp.abs(P)) if P.shape[0] else 0.0
    else:
        c = jnp.max(jnp.sum(jnp.abs(P), axis=-1))
    return jnp.maximum(s + c, 1.0)


# -- curvature and gradient noise ------------------------------------------------------------

#: Burn-in steps between re-estimates of the curvature when the step size is adapted.
ADAPT_EVERY = 50
#: Power iterations from a random start / from the previous eigenvector.
POWER_ITERS = 10
WARM_ITERS = 3
#: The gradient-noise cap is this many times looser in the first half of burn-in.
EARLY_LOOSENESS = 10.0


def max_curvature(potential, target, batch_size: Optional[int], z: Array, key: Array,
                  num_iters: int = POWER_ITERS, preconditioner: Optional[Array] = None,
                  start: Optional[Array] = None):
    """Largest |eigenvalue| of the Hessian of ``log_density`` at ``z`` and its eigenvector.

    Power iteration with Hessian-vector products (forward over reverse) on one
    minibatch drawn with ``key`` (the full batch for ``batch_size=None``),
    from ``start`` (a previous eigenvector: a warm start needs few
    iterations) or a random vector. With a diagonal ``preconditioner`` G the
    eigenvalue is that of ``G H``, the curvature in the sampler's metric. The
    estimate ``|H v|`` is at most the true value and close to it unless the
    top of the spectrum is flat (where it matters little). Returns
    ``(lambda, v)``.
    """
    k_batch, k_start = jax.random.split(key)

    def grad(x):
        return jax.grad(potential.log_density)(x, target, k_batch, batch_size)

    def hvp(v):
        u = jax.jvp(grad, (z,), (v,))[1]
        return u if preconditioner is None else preconditioner * u

    v = jax.random.normal(k_start, z.shape, z.dtype) if start is None else start
    v = v / jnp.maximum(jnp.linalg.norm(v), jnp.finfo(z.dtype).tiny)

    def body(_, carry):
        v, _ = carry
        u = hvp(v)
        lam = jnp.linalg.norm(u)
        ok = jnp.isfinite(lam) & (lam > 0)
        return jnp.where(ok, u / jnp.where(ok, lam, 1.0), v), lam

    v, lam = jax.lax.fori_loop(0, num_iters, body, (v, jnp.zeros((), z.dtype)))
    return lam, v


def adapted_step_size(rate: float, potential, target, batch_size, z, key,
                      preconditioner: Optional[Array] = None, start: Optional[Array] = None,
                      num_iters: int = POWER_ITERS):
    """``(rate / lambda_max, eigenvector)`` with ``lambda_max`` from :func:`max_curvature`.

    The curvature is floored at 1 and falls back to :func:`target_scale` when
    the estimate is not finite, so the step is always finite and at most ``rate``.
    """
    lam, v = max_curvature(potential, target, batch_size, z, key, num_iters, preconditioner, start)
    lam = jnp.where(jnp.isfinite(lam), lam, target_scale(target).astype(lam.dtype))
    return (rate / jnp.maximum(lam, 1.0)).astype(z.dtype), v


def gradient_noise_variance(grad_fn: Callable, z: Array, key: Array, num_pairs: int = 8) -> Array:
    """Per-coordinate variance (d,) of the minibatch gradient at ``z``.

    Estimated from ``num_pairs`` pairs of independent minibatch gradients
    ``(g1 - g2)^2 / 2``; ``grad_fn(z, key) -> gradient``.
    """
    keys = jax.random.split(key, 2 * num_pairs).reshape(num_pairs, 2, -1)
    g = jax.vmap(jax.vmap(lambda k: grad_fn(z, k)))(keys)      # (pairs, 2, d)
    return jnp.mean(0.5 * (g[:, 0] - g[:, 1]) ** 2, axis=0)


def noise_ratios(var: Array, scale) -> Array:
    """``scale_i * var_i``: each coordinate's gradient-noise ratio per unit step (the runner
    caps their maximum).

    ``var`` the per-coordinate minibatch gradient variance, ``scale`` what turns it into the
    ratio of gradient-noise to injected-noise variance per unit step in the sampler's metric
    (SGLD: ``G / (4 T)``; SGHMC: ``1 / (2 alpha T)``; see the module docstring).
    """
    return scale * var



__all__ = ["ADAPT_EVERY", "POWER_ITERS", "WARM_ITERS", "EARLY_LOOSENESS", "target_scale", "max_curvature",
           "adapted_step_size", "gradient_noise_variance", "noise_ratios"]
