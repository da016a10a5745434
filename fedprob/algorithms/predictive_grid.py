"""Predictive densities of a scalar continuous y on a grid, for likelihoods without finite moments.

A heavy-tailed likelihood (a Student-t whose degrees of freedom are inferred
and reach nu <= 2, a Cauchy) has draws whose predictive variance is infinite
(or whose mean is undefined), so the moment-based pooling of
:mod:`~fedprob.algorithms.ensemble` and :mod:`~fedprob.algorithms.predictive_bayes`
is undefined there. Any likelihood NumPyro can score still has a density:
per input row x_i the predictive is evaluated at ``G`` values of y,

    y_ig = lo_i + (hi_i - lo_i) g / (G - 1),   [lo_i, hi_i] = [q_0.5%, q_99.5%] widened by half
                                                its length on each side,

the quantiles taken over ``DRAWS_PER_PARAMETER`` predictive draws of y per
parameter draw. Client
k's predictive there is the exact mixture ``log (1/S) sum_s p(y | x, w_ks)``
(masks removed, :meth:`Potential.predictive_distribution`); the pooled log
density ``s(y)`` is normalised by a Riemann sum over the grid,
``log Z = logsumexp_g s(y_g) + log dy``; ``predict`` returns the mean and
variance of the normalised density on the grid (the predictive restricted to
that range), and the log density of a target is ``s(y) - log Z``, evaluated
at y itself (not interpolated).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from .. import inputs

#: grid points per input row
GRID_SIZE = 512
#: tail mass left out on each side before widening
TAIL = 0.005
#: the widening on each side, as a fraction of the quantile range
PAD = 0.5
#: predictive draws of y per parameter draw that set the range
DRAWS_PER_PARAMETER = 4


def check_grid_applies(potential, method: str) -> None:
    """ValueError unless y is a scalar continuous target (the grid's domain)."""
    if potential.task != "regression" or potential.y_shape:
        raise ValueError(
            f"{method}: the predictive of site '{potential.observed[0]}' has no finite mean or variance under "
            f"some draws, and the grid that replaces them needs one continuous value per row (the target is "
            f"{potential.task} with row shape {potential.y_shape}); use a parameter-space method "
            "(e.g. FedPA, EPMCMC, PVI) or a likelihood with finite moments")


def moments_finite(client_pred) -> bool:
    """Whether every client's predictive mean and variance (:func:`client_predictive`) is finite."""
    mean, latent, noise = client_pred
    return bool(jnp.all(jnp.isfinite(mean)) & jnp.all(jnp.isfinite(latent + noise)))


@partial(jax.jit, static_argnums=(0, 2))
def grid(potential, draws, size, X, key):
    """(size, n) grid of y values per row from draws (M, d) of the parameters (module docstring)."""
    keys = jax.random.split(key, draws.shape[0])
    ys = jax.vmap(lambda z, k: potential.predictive_distribution(z, X).sample(k, (DRAWS_PER_PARAMETER,)))(
        draws, keys).reshape((-1,) + (inputs.num_rows(X),))                                    # (M R, n)
    ys = jnp.where(jnp.isfinite(ys), ys, jnp.nan)
    lo = jnp.nanquantile(ys, TAIL, axis=0)
    hi = jnp.nanquantile(ys, 1.0 - TAIL, axis=0)
    pad = PAD * (hi - lo) + 1e-6 * (1.0 + jnp.abs(lo) + jnp.abs(hi))
    return (lo - pad)[None] + (hi - lo + 2 * pad)[None] * jnp.linspace(0.0, 1.0, size)[:, None]


@partial(jax.jit, static_argnums=0)
def client_log_pdf(potential, draws, X, points):
    """(K, P, n) ``log (1/S) sum_s p(points_pi | x_i, w_ks)`` for draws (K, S, d) and points (P, n),
    streamed over the draws."""
    K, S, _ = draws.shape

    def per_draw(z):
        fn = potential.predictive_distribution(z, X)
        return jax.vmap(fn.log_prob)(points)                          # (P, n)

    per = jax.vmap(per_draw)
    acc, _ = jax.lax.scan(lambda a, z: (jnp.logaddexp(a, per(z)), None), per(draws[:, 0]),
                          jnp.swapaxes(draws[:, 1:], 0, 1))
    return acc - jnp.log(S)


def pooled(lp_clients, weights, lp_prior, beta):
    """Log-linear pooling ``beta log p_prod + (1 - beta) log p_mix`` (unnormalised), with
    ``log p_prod = sum_k log p_k - (K-1) log p_0`` (no prior term where ``lp_prior`` is None) and
    ``p_mix = sum_k w_k p_k``; lp_clients (K, P, n)."""
    K = lp_clients.shape[0]
    prod = jnp.sum(lp_clients, 0)
    if lp_prior is not None:
        prod = prod - (K - 1) * lp_prior
    lw = jnp.log(jnp.maximum(weights, 1e-38))[:, None, None]
    mix = logsumexp(lp_clients + lw, axis=0)
    if isinstance(beta, (int, float)) and beta == 1.0:
        return prod
    if isinstance(beta, (int, float)) and beta == 0.0:
        return mix
    return beta * prod + (1.0 - beta) * mix


def normalise(log_density_on_grid, points):
    """``(log Z (n,), mean (n,), variance (n,))`` of a density given on the grid (P, n)."""
    dy = points[1] - points[0]
    log_z = logsumexp(log_density_on_grid, axis=0) + jnp.log(dy)
    p = jnp.exp(log_density_on_grid - log_z[None]) * dy[None]
    mean = jnp.sum(p * points, 0)
    return log_z, mean, jnp.sum(p * (points - mean[None]) ** 2, 0)


__all__ = ["GRID_SIZE", "TAIL", "PAD", "DRAWS_PER_PARAMETER", "check_grid_applies", "moments_finite", "grid", "client_log_pdf",
           "pooled", "normalise"]
