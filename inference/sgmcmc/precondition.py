"""Laplace preconditioning and control variates for an SG-MCMC chain (one pre-pass per client).

**Pre-pass.** Before burn-in, from the chain's start ``z0``: the mode ``m`` of the client's full-batch
target (:func:`fedprob.inference.optim.minimize`: 50 full-batch L-BFGS steps) and the
curvature ``H`` of ``-log pi`` there (:func:`fedprob.inference.laplace.curvature`: the exact Hessian
for ``"full"``, its exact diagonal for ``"diag"``, a Hutchinson estimate above 512 parameters). ``H``'s
eigenvalues (diagonal entries) are raised to ``FLOOR`` times the largest; a pre-pass that is not
finite leaves the chain unpreconditioned (``m = z0``, ``A = I``; ``precondition_failed`` says so).

**Whitening** (``precondition``). The chain runs on ``u`` with ``z = m + A u``, ``A A' = H^-1``
(full: ``A = V diag(a)^-1/2`` from ``H = V diag(a) V'``; diag: ``A = diag(h)^-1/2``), on the target
``log pi(m + A u)`` (the Jacobian is constant), whose gradient is ``A' grad log pi``. For a Gaussian
target ``u ~ N(0, I)``: every direction has unit curvature, so the adapted step (a fixed fraction of
``1 / lambda_max``) is the same fraction of every direction's scale and the autocorrelation time no
longer grows with the condition number. This is SGHMC with mass matrix ``H`` and SGLD with
preconditioner ``H^-1`` (Girolami and Calderhead 2011; Ma et al. 2015), the metric held fixed (no
correction term needed). The chain starts at a draw of ``N(0, I)`` (a draw of the Laplace
approximation); draws and the last position are mapped back to ``z``. Cost: the pre-pass (50
L-BFGS steps and ``d`` Hessian-vector products on the full batch for "full", one eigendecomposition)
and a ``d x d`` matrix-vector product per step.

**Control variate** (``control_variate``, with a minibatch; on by default with a preconditioner): the
minibatch log target
``f_B(z)`` is replaced by ``f_B(z) - f_B(m) - g_B(m)'(z - m) + f(m) + g(m)'(z - m)`` with ``f, g`` the
full-batch value and gradient at the mode (computed once) and ``f_B(m), g_B(m)`` on the same
minibatch: an unbiased estimate whose gradient ``g(m) + g_B(z) - g_B(m)`` has variance that vanishes
as ``z -> m`` (SGLD-CV, Baker et al. 2019; Nagapetyan et al. 2017). Two minibatch gradients per step.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

#: ``precondition`` values (:func:`resolve_precondition` says what ``"auto"`` becomes).
PRECONDITIONS = (None, "auto", "full", "diag")
AUTO_FULL_MAX_DIM = 256
#: Curvature eigenvalues (diagonal entries) below this fraction of the largest are raised to it.
FLOOR = 1e-8
#: L-BFGS steps of the mode search (it only has to land near the mode: the chain does the rest).
MODE_STEPS = 50


def check_precondition(precondition, control_variate) -> None:
    if precondition not in PRECONDITIONS:
        raise ValueError(f"unknown precondition {precondition!r} (use one of {PRECONDITIONS})")
    if control_variate not in (None, True, False):
        raise ValueError(f"control_variate must be None (auto), True or False, got {control_variate!r}")


def resolve_control_variate(control_variate: Optional[bool], kind: Optional[str], batch_size) -> bool:
    """Whether a chain uses the control variate: as given, or (None) whenever it runs on minibatches with a
    preconditioner (the mode is found anyway; on a conjugate regression of 2,000 rows in batches of 32 it
    raised the ESS per gradient 40- to 150-fold, benchmarks/results/inference.md)."""
    if control_variate is None:
        return kind is not None and batch_size is not None
    return bool(control_variate)


def resolve_precondition(precondition: Optional[str], dim: int, fixed_step: bool = False) -> Optional[str]:
    """The preconditioner a chain on ``dim`` parameters uses: ``"auto"`` is ``"full"`` up to
    :data:`AUTO_FULL_MAX_DIM` parameters and None above, or when the user fixed the step size (a given
    ``step_size`` is in the model's own coordinates)."""
    if precondition == "auto":
        return "full" if dim <= AUTO_FULL_MAX_DIM and not fixed_step else None
    return precondition


class Preconditioner(NamedTuple):
    """``z = shift + A u``: ``factor`` is ``A`` (d, d), or its diagonal (d,); ``cv``: the full-batch
    log target and gradient at ``shift`` (the mode) for the control variate, or None."""

    shift: Array
    factor: Array
    failed: Array
    cv: Optional[tuple] = None

    def to_z(self, u: Array) -> Array:
        return self.shift + (self.factor @ u if self.factor.ndim == 2 else self.factor * u)

    def to_z_many(self, u: Array) -> Array:
        """(S, d) -> (S, d)."""
        return self.shift + (u @ self.factor.T if self.factor.ndim == 2 else u * self.factor)


def laplace_preconditioner(potential, target, z0: Array, kind: Optional[str], control_variate: bool,
                           key: Array) -> Preconditioner:
    """The pre-pass (module docstring): mode, curvature, factor ``A`` (identity when ``kind`` is None,
    with the mode kept for the control variate)."""
    from ..dense_check import check_fits
    from ..laplace import curvature
    from ..optim import minimize

    d = z0.shape[0]
    if kind == "full":
        check_fits("precondition='full'", d, z0.dtype,
                   "Use precondition='diag' (or 'auto', which is full only up to "
                   f"{AUTO_FULL_MAX_DIM} parameters).")
    mode = minimize(potential, target, z0, num_steps=MODE_STEPS).params
    ok = jnp.all(jnp.isfinite(mode))
    m = jnp.where(ok, mode, z0)
    if kind == "full":
        H = curvature(potential, target, m, "full")
        H = 0.5 * (H + H.T)
        good = ok & jnp.all(jnp.isfinite(H))
        a, V = jnp.linalg.eigh(jnp.where(good, H, jnp.eye(d, dtype=z0.dtype)))
        a = jnp.maximum(a, FLOOR * jnp.max(a))
        good = good & (jnp.max(a) > 0)
        factor = jnp.where(good, V * (1.0 / jnp.sqrt(a)), jnp.eye(d, dtype=z0.dtype))
    elif kind == "diag":
        h = curvature(potential, target, m, "diag", key=key)
        good = ok & jnp.all(jnp.isfinite(h)) & (jnp.max(h) > 0)
        h = jnp.maximum(h, FLOOR * jnp.max(h))
        factor = jnp.where(good, 1.0 / jnp.sqrt(h), jnp.ones((d,), z0.dtype))
    else:
        good = ok
        factor = jnp.ones((d,), z0.dtype)
    shift = jnp.where(good, m, z0)
    cv = None
    if control_variate:
        value, grad = jax.value_and_grad(potential.log_density)(shift, target)
        cv = (value, grad)
    return Preconditioner(shift, factor, ~good, cv)


class PreconditionedPotential:
    """The client potential in whitened coordinates ``u`` (and with the control variate): what the
    SG-MCMC kernels see; only ``log_density`` and ``dim`` are used by the driver."""

    def __init__(self, base, pre: Preconditioner):
        self.base = base
        self.pre = pre
        self.dim = base.dim

    def log_density(self, u: Array, target, key=None, batch_size=None) -> Array:
        z = self.pre.to_z(u)
        out = self.base.log_density(z, target, key, batch_size)
        if self.pre.cv is None or batch_size is None:
            return out
        m = self.pre.shift
        f_m, g_m = self.pre.cv
        fb_m, gb_m = jax.value_and_grad(self.base.log_density)(m, target, key, batch_size)
        step = z - m
        return out - fb_m + f_m + jnp.dot(jax.lax.stop_gradient(g_m - gb_m), step)


__all__ = ["PRECONDITIONS", "AUTO_FULL_MAX_DIM", "FLOOR", "MODE_STEPS", "check_precondition",
           "resolve_precondition", "resolve_control_variate", "Preconditioner", "laplace_preconditioner", "PreconditionedPotential"]
