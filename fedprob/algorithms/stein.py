"""Gaussian fits from draws and their score (Stein moments): the moment-matched Gaussian with a control variate.

For any density ``p`` with score ``g(x) = grad log p(x)``, integration by parts gives
``E_p[g (x - m)'] = -I`` and ``E_p[g] = 0``. So the least-squares regression of the scores on the draws,
``g ~ nu - Lam x`` with ``Lam = -Cov(g, x) Cov(x)^-1`` (symmetrized) and ``nu = mean(g) + Lam mean(x)``,
has the population values ``Lam = Cov(x)^-1`` and ``Lam^-1 nu = E[x]``: the **moment-matched** Gaussian,
for any target. From finitely many draws it is a control-variate estimate: the mean is
``mean(x + Lam^-1 g)`` (the score has mean zero under ``p``; first-order zero-variance control variates,
Mira et al. 2013), and for a Gaussian ``p`` every residual ``x_s + Lam^-1 g_s`` equals the mean and the
regression returns the exact precision from any ``d + 1`` draws in general position, whatever their
autocorrelation or the sampler's bias. Otherwise the error scales with the target's departure from a
Gaussian instead of with its spread: a product of many clients, which is sqrt(K) narrower than each,
keeps the accuracy that sample moments lose (see :mod:`fedprob.algorithms.mc_checks`).

``diag``: per coordinate, ``T_i = -Cov(g_i, x_i) / Var(x_i)`` (the same identity, coordinate by
coordinate: ``T_i = 1 / Var(x_i)`` at the population level, the diagonal moment match), O(S d).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..posteriors import Gaussian

Array = jax.Array


def stein_regression(x: Array, grads: Array, diag: bool, jitter: float = 1e-6):
    """``(nu, Lam)`` of the regression ``grads ~ nu - Lam x`` over (S, d) draws (module docstring);
    ``Lam`` (d, d) symmetrized, or (d,) with ``diag``. ``jitter`` (relative to each coordinate's
    variance) keeps ``Cov(x)`` invertible."""
    nu, Lam, _ = _regression(x, grads, diag, jitter)
    return nu, Lam


def _regression(x, grads, diag, jitter):
    """``(nu, Lam, eig)``: :func:`stein_regression` and the eigendecomposition ``(a, V)`` of the
    draws' jittered sample covariance (None with ``diag``)."""
    S = x.shape[0]
    mx, mg = jnp.mean(x, 0), jnp.mean(grads, 0)
    cx, cg = x - mx, grads - mg
    if diag:
        var = jnp.sum(cx * cx, 0) / (S - 1)
        T = -(jnp.sum(cg * cx, 0) / (S - 1)) / (var * (1.0 + jitter))
        return mg + T * mx, T, None
    C_xx = cx.T @ cx / (S - 1)
    C_xx = C_xx + jnp.diag(jitter * jnp.diagonal(C_xx) + 1e-30)
    C_gx = cg.T @ cx / (S - 1)
    a, V = jnp.linalg.eigh(0.5 * (C_xx + C_xx.T))
    Lam = -(C_gx @ V / a) @ V.T
    Lam = 0.5 * (Lam + Lam.T)
    return mg + Lam @ mx, Lam, (a, V)


def is_positive_definite(precision: Array) -> Array:
    """True when a (diagonal or full) precision is finite and positive definite."""
    if precision.ndim == 1:
        return jnp.all(precision > 0) & jnp.all(jnp.isfinite(precision))
    ok = jnp.all(jnp.isfinite(precision))
    P = jnp.where(ok, 0.5 * (precision + precision.T), jnp.eye(precision.shape[0], dtype=precision.dtype))
    return ok & jnp.all(jnp.isfinite(jnp.linalg.cholesky(P)))


def stein_gaussian(x: Array, grads: Array, diag: bool, jitter: float = 1e-6, transform: bool = False):
    """``(Gaussian, residuals, ok)``: the Stein fit of (S, d) draws ``x`` with scores ``grads`` of the
    density they were drawn from, the per-draw residuals ``x_s + Lam^-1 g_s`` (S, d) whose mean is the
    fit's mean (their covariance over the ESS is the mean's Monte Carlo covariance), and whether the fit
    is positive definite (when not, the caller falls back to sample moments).

    ``transform=True`` appends ``(mean, T)``: the fit's mean and, for a full fit, the (d, d) map
    ``T = Sigma^1/2 C^-1/2`` (symmetric square roots; ``Sigma = Lam^-1``, ``C`` the draws' jittered
    sample covariance) that takes the centred draws onto the fit's covariance (``T C T' = Sigma``), built
    from the eigendecompositions the fit already has; where the fit is not ok, the draws' own mean and
    the identity (the draws keep their sample moments). None for ``diag``.
    :func:`fedprob.algorithms.messages.match_moments` uses it."""
    nu, Lam, eig = _regression(x, grads, diag, jitter)
    if diag:
        ok = is_positive_definite(Lam) & jnp.all(jnp.isfinite(nu))
        resid = x + grads / jnp.where(ok, Lam, 1.0)
        out = (Gaussian(nu, Lam), resid, ok)
        return out + (None,) if transform else out
    # eigendecompositions rather than Cholesky solves: in a vmapped client phase, XLA's CPU runtime
    # occasionally never returned from programs with batched Cholesky / triangular-solve custom calls
    finite = jnp.all(jnp.isfinite(Lam)) & jnp.all(jnp.isfinite(nu))
    a, V = jnp.linalg.eigh(jnp.where(finite, Lam, jnp.eye(Lam.shape[0], dtype=Lam.dtype)))
    ok = finite & (jnp.min(a) > 0)
    inv = (V / jnp.where(ok, a, 1.0)) @ V.T
    resid = x + grads @ inv.T
    out = (Gaussian(nu, Lam), resid, ok)
    if not transform:
        return out
    a_x, V_x = eig
    tiny = jnp.finfo(x.dtype).tiny
    root_fit = (V / jnp.sqrt(jnp.where(ok, a, 1.0))) @ V.T
    inv_root_x = (V_x / jnp.sqrt(jnp.maximum(a_x, tiny))) @ V_x.T
    T = root_fit @ inv_root_x
    use = ok & jnp.all(jnp.isfinite(T))
    T = jnp.where(use, T, jnp.eye(T.shape[0], dtype=T.dtype))
    return out + ((jnp.where(use, inv @ nu, jnp.mean(x, 0)), T),)


__all__ = ["stein_regression", "stein_gaussian", "is_positive_definite"]
