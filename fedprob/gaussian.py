"""Gaussian algebra in natural parameters: the one home for every algorithm that multiplies Gaussians.

A :class:`~fedprob.posteriors.Gaussian` ``N(m, P^-1)`` is stored as
``linear = P m`` and ``precision = P`` (diagonal: shape ``(..., d)``; full:
``(..., d, d)``). Products add natural parameters, quotients subtract them,
a power ``t`` scales them; the class implements ``*``, ``/`` and ``power``.
This module holds the rest:

* construction: ``Gaussian.from_moments`` and :func:`from_mean_precision`;
* :func:`moment_match`: a Gaussian fitted to draws, full covariances with
  **shrinkage** of the correlations toward zero when draws are few
  (:func:`sample_covariance`, :func:`shrinkage_covariance`: OAS on the
  correlation matrix), with a trace-time warning when there are fewer than
  10 draws per dimension;
* sums over a client axis: :func:`natural_sum` (masked), :func:`guarded_product`
  (a product with a prior power, clipped to the prior when not positive
  definite), :func:`is_valid`;
* :func:`kl_divergence` (sampling and densities are ``Gaussian`` methods);
* the Monte Carlo error of a product's mean: :func:`mean_error_term` (one
  client's share, summable) and :func:`relative_mean_error`;
* the prior as a Gaussian in the flat unconstrained layout:
  :func:`prior_gaussian`, :func:`prior_draws`.

Every function is pure and jittable unless it says it returns Python numbers
(:func:`guarded_product`, :func:`prior_gaussian` inspect their results).
"""
from __future__ import annotations

import math
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .posteriors import Gaussian

Array = jax.Array

#: Below this many draws per dimension a full covariance fit warns (see :func:`moment_match`).
DRAWS_PER_DIM = 10


# -- construction ----------------------------------------------------------------------------------

def from_mean_precision(mean, precision) -> Gaussian:
    """``N(mean, precision^-1)``: linear term ``precision @ mean`` (diagonal: elementwise)."""
    mean = jnp.asarray(mean)
    precision = jnp.asarray(precision)
    if precision.ndim == mean.ndim:
        return Gaussian(precision * mean, precision)
    return Gaussian(jnp.einsum("...ij,...j->...i", precision, mean), precision)


# -- validity ------------------------------------------------------------------------------------------

def is_valid(g: Gaussian) -> Array:
    """True where the precision is positive definite and every entry is finite (batched over leading axes)."""
    finite = jnp.all(jnp.isfinite(g.linear), -1)
    if g.is_diag:
        return finite & jnp.all(g.precision > 0, -1) & jnp.all(jnp.isfinite(g.precision), -1)
    ok = jnp.all(jnp.isfinite(g.precision), (-1, -2))
    P = jnp.where(ok[..., None, None], g.precision, jnp.eye(g.dim, dtype=g.precision.dtype))
    eig = jnp.linalg.eigvalsh(0.5 * (P + jnp.swapaxes(P, -1, -2)))
    return finite & ok & jnp.all(eig > 0, -1)


# -- KL divergence -----------------------------------------------------------------------------------

def kl_divergence(q: Gaussian, p: Gaussian) -> Array:
    """KL(q || p) = (tr(P_p S_q) + (m_p - m_q)' P_p (m_p - m_q) - d + log|P_q| - log|P_p|) / 2.

    ``q`` and ``p`` may be diagonal or full (mixed forms are compared as full).
    """
    if q.is_diag != p.is_diag:
        q, p = q.to_full(), p.to_full()
    dm = p.mean() - q.mean()
    d = q.dim
    if q.is_diag:
        return 0.5 * jnp.sum(p.precision / q.precision + p.precision * dm * dm - 1.0
                             + jnp.log(q.precision) - jnp.log(p.precision), -1)
    trace = jnp.trace(jnp.linalg.solve(q.precision, p.precision), axis1=-2, axis2=-1)
    quad = jnp.einsum("...i,...ij,...j->...", dm, p.precision, dm)
    logdet = jnp.linalg.slogdet(q.precision)[1] - jnp.linalg.slogdet(p.precision)[1]
    return 0.5 * (trace + quad - d + logdet)


# -- moment matching with shrinkage -----------------------------------------------------------------------

def shrinkage_covariance(draws) -> tuple:
    """OAS shrinkage of the correlations of (S, d) draws toward zero: ``(cov, rho)``.

    ``cov = (1 - rho) C + rho diag(C)``, C the sample covariance (divisor
    S - 1). Shrinking the correlation matrix ``R = D^-1/2 C D^-1/2`` toward
    the identity keeps every marginal variance and is equivariant to the
    scale of each coordinate: the usual target ``mu I`` (mean variance)
    would pull a coordinate with sd 1e-3 and one with sd 10 toward a common
    variance, a large bias whenever the scales differ (unconstrained network
    weights against a log noise scale). ``rho`` is the oracle approximating
    shrinkage (Chen et al. 2010, in the form scikit-learn's ``oas`` uses)
    applied to R, whose mean eigenvalue is 1::

        a = sum_ij R_ij^2 / d^2,     rho = min(1, (a + 1) / ((S + 1) (a - 1/d))),

    so rho ~ 1 when the draws carry no information on the correlations
    (independent coordinates, or S << d) and rho = O(1/S) for strong
    correlations and S >> d. The result is positive definite whenever rho > 0
    and every variance is positive, for any S >= 2.
    """
    draws = jnp.asarray(draws)
    S, d = draws.shape[-2:]
    c = draws - jnp.mean(draws, -2, keepdims=True)
    C = jnp.einsum("...si,...sj->...ij", c, c) / max(S - 1, 1)
    var = jnp.diagonal(C, axis1=-2, axis2=-1)
    sd = jnp.sqrt(jnp.maximum(var, 1e-300))
    R = C / (sd[..., :, None] * sd[..., None, :])
    a = jnp.sum(R * R, (-2, -1)) / d ** 2
    den = (S + 1) * (a - 1.0 / d)
    rho = jnp.where(den > 0, jnp.minimum((a + 1.0) / jnp.where(den > 0, den, 1.0), 1.0), 1.0)
    if d == 1:
        rho = jnp.zeros_like(rho)
    diag = var[..., :, None] * jnp.eye(d, dtype=C.dtype)
    r = rho[..., None, None]
    return (1.0 - r) * C + r * diag, rho


def warn_few_draws(num_draws: int, dim: int, name: str = "moment_match", stacklevel: int = 3) -> bool:
    """Warn (once per traced shape) when a full covariance is fitted to fewer than 10 d draws.

    The sample covariance of S draws in d dimensions spreads its eigenvalues
    over about ``(1 +- sqrt(d/S))^2`` times the true ones (and is singular
    for S <= d); shrinkage bounds the damage but the product of such fits is
    still off. Returns True when it warned.
    """
    if dim > 1 and num_draws < DRAWS_PER_DIM * dim:
        lo = max(1.0 - math.sqrt(dim / num_draws), 0.0) ** 2
        hi = (1.0 + math.sqrt(dim / num_draws)) ** 2
        warnings.warn(
            f"{name}: a full-covariance Gaussian fitted to {num_draws} draws in {dim} dimensions "
            f"({'singular sample covariance, ' if num_draws <= dim else ''}eigenvalues off by factors "
            f"{lo:.2g} to {hi:.2g}); its correlations are shrunk toward zero (OAS), but a reliable full "
            f"covariance needs about {DRAWS_PER_DIM * dim} draws per client ({DRAWS_PER_DIM} per "
            "dimension), or use family='diag'", RuntimeWarning, stacklevel=stacklevel)
        return True
    return False


def sample_covariance(draws, shrink=None) -> Array:
    """Covariance of (..., S, d) draws: the sample covariance, or its shrunk form when draws are few.

    ``shrink=None`` (the default) shrinks (:func:`shrinkage_covariance`)
    when S < 10 d and returns the plain sample covariance (divisor S - 1)
    otherwise; True / False force either. Why not always shrink: OAS picks
    the intensity that is best for the covariance in Frobenius norm, an
    *absolute* error of order 1/S on every correlation eigenvalue. A product
    of posteriors needs the *precision*, and a thin direction of a strongly
    correlated posterior (correlation eigenvalue 1e-3, common for
    sub-posteriors of clients with fewer rows than parameters) would have its
    variance doubled by a shrinkage of 1e-3, whereas the sample covariance
    already estimates every direction's variance to a relative error of
    about sqrt(2/S) once S >> d. Below 10 d draws the sample covariance is
    singular or its eigenvalues are off by large factors, and shrinkage is
    the lesser error.
    """
    draws = jnp.asarray(draws)
    S, d = draws.shape[-2:]
    if shrink is None:
        shrink = S < DRAWS_PER_DIM * d
    if shrink:
        return shrinkage_covariance(draws)[0]
    c = draws - jnp.mean(draws, -2, keepdims=True)
    return jnp.einsum("...si,...sj->...ij", c, c) / max(S - 1, 1)


def moment_match(draws, diag: bool = False, jitter: float = 1e-6, shrink=None, warn: bool = True,
                 name: str = "moment_match") -> Gaussian:
    """Gaussian fit of (..., S, d) draws.

    Mean: the sample mean. Covariance: diagonal, the sample variances; full,
    :func:`sample_covariance` (shrunk toward its diagonal when S < 10 d;
    ``shrink`` forces it on or off). A jitter ``jitter * mean variance`` is
    added to the diagonal. A full fit with S < 10 d warns at trace time
    (:func:`warn_few_draws`; S and d are static).
    """
    draws = jnp.asarray(draws)
    S, d = draws.shape[-2:]
    if S < 2:
        raise ValueError(f"a Gaussian fit needs at least 2 draws, got {S}")
    mean = jnp.mean(draws, -2)
    c = draws - mean[..., None, :]
    var = jnp.sum(c * c, -2) / (S - 1)
    eps = (jitter * jnp.mean(var, -1) + 1e-30)[..., None]
    if diag:
        return Gaussian.from_moments(mean, var + eps)
    if warn:
        warn_few_draws(S, d, name, stacklevel=4)
    cov = sample_covariance(draws, shrink)
    return Gaussian.from_moments(mean, cov + eps[..., None] * jnp.eye(d, dtype=draws.dtype))


# -- sums over a client axis --------------------------------------------------------------------------

def natural_sum(stacked: Gaussian, mask=None) -> Gaussian:
    """``prod_k N_k`` over the leading axis: natural parameters summed over the clients in ``mask``.

    Masked-out entries contribute nothing, even when they are NaN.
    """
    def add(a):
        if mask is None:
            return jnp.sum(a, 0)
        m = jnp.reshape(jnp.asarray(mask, bool), (-1,) + (1,) * (a.ndim - 1))
        return jnp.sum(jnp.where(m, a, 0), 0)

    return Gaussian(add(stacked.linear), add(stacked.precision))


def guarded_product(clients: Gaussian, prior: Gaussian, prior_power: float, name: str = "product",
                    warn: bool = True, stacked: bool = True):
    """``prod_k N_k * p0^prior_power`` in natural parameters, guarded: ``(Gaussian, info)``.

    ``clients`` is stacked over a leading client axis (``stacked=False``: it
    is already the sum ``sum_k eta_k``), diagonal or full like ``prior``.
    Natural parameters add: ``sum_k eta_k + prior_power * eta_0``
    (``prior_power = -(K-1)`` divides out the K-1 surplus copies of the prior
    when every client used the full prior).

    Guard: when the precision is not positive definite (or not finite) the
    product falls back to clipping. In the prior-whitened eigenbasis of the
    precision every eigenvalue below 1 (less concentrated than the prior) is
    raised to 1; diagonal: every precision below the prior's is raised to the
    prior's. The linear term is kept, so in a clipped direction with no
    information the mean stays near the prior mean. A Python warning is
    issued and ``info["fallback"]`` records it. Returns Python numbers in
    ``info`` (not jittable as a whole; :func:`product_core` is).
    """
    total = natural_sum(clients) if stacked else clients
    lin, prec, ok, stats = product_core(total, prior, jnp.asarray(prior_power, prior.linear.dtype))
    stats = {k: np.asarray(v).item() for k, v in stats.items()}
    info = {"fallback": None, "min_relative_precision": stats["min_relative_precision"]}
    if not bool(ok):
        info.update(fallback="clip_to_prior", num_clipped=int(stats["num_clipped"]),
                    num_nonpositive=int(stats["num_nonpositive"]))
    if info["fallback"] is not None and warn:
        warnings.warn(
            f"{name}: the product of the client Gaussians (with the prior correction) is not positive "
            f"definite ({info['num_nonpositive']} non-positive direction(s)); falling back to clipping its "
            f"precision at the prior's in {info['num_clipped']} direction(s). The client posteriors are "
            "probably too noisy (more draws, or family='diag', or a Gaussian client backend help).",
            RuntimeWarning, stacklevel=3)
    return Gaussian(lin, prec), info


@jax.jit
def product_core(total: Gaussian, prior: Gaussian, power):
    """``total * prior^power`` and its clipped fallback (selected when not PD or not finite).

    Returns ``(linear, precision, ok, stats)``; see :func:`guarded_product`.
    """
    lin = total.linear + power * prior.linear
    prec = total.precision + power * prior.precision
    finite = jnp.all(jnp.isfinite(lin)) & jnp.all(jnp.isfinite(prec))
    lin_safe = jnp.where(jnp.isfinite(lin), lin, prior.linear)
    if prior.is_diag:
        rel = jnp.where(jnp.isfinite(prec), prec, 0.0) / prior.precision
        ok = finite & jnp.all(rel > 0)
        keep = rel >= 1.0
        clipped = jnp.where(keep, prec, prior.precision)
        stats = {"min_relative_precision": jnp.min(rel), "num_clipped": jnp.sum(~keep),
                 "num_nonpositive": jnp.sum(~(rel > 0))}
    else:
        L0 = jnp.linalg.cholesky(prior.precision)
        Linv = jax.scipy.linalg.solve_triangular(L0, jnp.eye(prior.dim, dtype=L0.dtype), lower=True)
        A = Linv @ jnp.where(jnp.isfinite(prec), prec, 0.0) @ Linv.T
        a, V = jnp.linalg.eigh(0.5 * (A + A.T))
        ok = finite & (jnp.min(a) > 0)
        clipped = L0 @ (V * jnp.maximum(a, 1.0)) @ V.T @ L0.T
        clipped = 0.5 * (clipped + clipped.T)
        stats = {"min_relative_precision": jnp.min(a), "num_clipped": jnp.sum(a < 1.0),
                 "num_nonpositive": jnp.sum(~(a > 0))}
    prec = jnp.where(ok, prec, clipped)
    lin = jnp.where(ok, lin, lin_safe)
    return lin, prec, ok, stats


# -- Monte Carlo error of a product's mean ------------------------------------------------------------

def mean_error_term(weight, cov, ess) -> Array:
    """One client's share ``W_k Sigma_mc,k W_k`` of the Monte Carlo covariance of a product's mean.

    A product (or consensus average) has mean ``P^-1 sum_k W_k m_k`` with
    ``P = sum_k W_k (+ prior terms)``. Client k's sample mean ``m_k`` has
    Monte Carlo covariance ``Sigma_mc,k = D^-1/2 Sigma_k D^-1/2``, ``D`` the
    diagonal of its per-coordinate effective sample sizes ``ess`` (d,) and
    ``Sigma_k`` its posterior covariance ``cov`` ((d,) variances for a
    diagonal ``weight`` (d,), else (d, d)). The terms add over clients (a
    sufficient statistic); :func:`relative_mean_error` turns their sum into
    a fraction of the product's sd. ``ess = inf`` (exact Gaussian output)
    gives zero.
    """
    inv = 1.0 / jnp.sqrt(ess)
    if jnp.ndim(weight) == jnp.ndim(ess):
        return weight * weight * cov * inv * inv
    mc = cov * inv[:, None] * inv[None, :]
    return weight @ mc @ weight


def relative_mean_error(precision, error_term) -> Array:
    """Per-coordinate Monte Carlo sd of a product's mean over its posterior sd, (d,).

    ``sqrt(diag(P^-1 M P^-1) / diag(P^-1))`` with ``P`` the product's
    precision and ``M`` the summed :func:`mean_error_term`.
    """
    if precision.ndim == 1:
        return jnp.sqrt(error_term / precision)
    cov = jnp.linalg.inv(precision)
    cov = 0.5 * (cov + cov.T)
    var_mc = jnp.sum((cov @ error_term) * cov, 1)
    return jnp.sqrt(jnp.maximum(var_mc, 0.0) / jnp.diagonal(cov))


# -- the prior as a Gaussian --------------------------------------------------------------------------

@partial(jax.jit, static_argnums=(0, 2))
def _prior_check(potential, key, check_points: int):
    """log-prior gradients at 0, at 1 and at prior draws: (b, p, exact mask)."""
    d = potential.dim
    pts = jax.vmap(potential.sample_prior)(jax.random.split(key, check_points))
    z = jnp.concatenate([jnp.zeros((1, d), pts.dtype), jnp.ones((1, d), pts.dtype), pts])
    g = jax.vmap(jax.grad(potential.log_prior))(z)
    b, p, g = g[0], g[0] - g[1], g[2:]
    resid = jnp.abs(g - (b - p * pts))
    tol = 1e-4 * (1.0 + jnp.abs(b) + jnp.abs(p * pts) + jnp.abs(g))
    exact = jnp.all(resid <= tol, 0) & (p > 0) & jnp.all(jnp.isfinite(g), 0)
    return b, p, exact


@partial(jax.jit, static_argnums=(0, 2))
def prior_draws(potential, key, num_samples: int):
    """(num_samples, d) prior draws in the flat unconstrained layout (compiled once per model)."""
    return jax.vmap(potential.sample_prior)(jax.random.split(key, num_samples))


@partial(jax.jit, static_argnums=(0, 2))
def _prior_moments(potential, key, num_samples: int):
    draws = prior_draws(potential, key, num_samples)
    mean = jnp.mean(draws, 0)
    c = draws - mean
    return mean, c.T @ c / (num_samples - 1)


def prior_gaussian(potential, key, diag: bool, num_samples: int = 2000, check_points: int = 8):
    """The prior p0 as a Gaussian in the flat unconstrained layout: ``(Gaussian, exact)``.

    Coordinates on which the log prior is an independent quadratic (checked:
    the gradient at ``check_points`` prior draws, at 0 and at 1 is exactly
    ``b - p * z`` coordinate-wise, as for any ``Normal`` prior site, or a
    ``LogNormal`` one after its log transform) get their exact natural
    parameters ``(b, p)``. The other coordinates (e.g. a HalfNormal noise
    scale, hierarchical or heavy-tailed priors) are moment-matched to
    ``num_samples`` prior draws (``potential.sample_prior``); they are
    assumed independent of the exact ones, which holds because an exact
    coordinate's gradient involves no other coordinate. ``exact`` is True when
    every coordinate was exact (a Python bool).
    """
    k_check, k_draw = jax.random.split(key)
    b, p, exact = _prior_check(potential, k_check, check_points)
    exact = np.asarray(exact)
    if exact.all():
        g0 = Gaussian(b, p)
        return (g0 if diag else g0.to_full()), True
    mean_mm, cov_mm = _prior_moments(potential, k_draw, num_samples)
    ex = jnp.asarray(exact)
    p_safe = jnp.where(ex, p, 1.0)
    mean = jnp.where(ex, b / p_safe, mean_mm)
    if diag:
        var = jnp.where(ex, 1.0 / p_safe, jnp.diag(cov_mm))
        return Gaussian.from_moments(mean, var), False
    block = (~ex)[:, None] & (~ex)[None, :]
    cov = jnp.where(block, cov_mm, 0.0) + jnp.diag(jnp.where(ex, 1.0 / p_safe, 0.0))
    return Gaussian.from_moments(mean, cov), False


__all__ = ["Gaussian", "from_mean_precision", "is_valid",
           "kl_divergence", "shrinkage_covariance", "sample_covariance", "moment_match", "warn_few_draws", "natural_sum",
           "guarded_product", "product_core", "mean_error_term", "relative_mean_error", "prior_gaussian",
           "prior_draws", "DRAWS_PER_DIM"]
