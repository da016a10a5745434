"""Client results as messages: draws, Gaussians, effective sample sizes and Monte Carlo terms.

What one-round clients send: :func:`result_draws` (S draws of a Samples or Gaussian output),
:func:`result_gaussian` (moment-matched with shrinkage, or the exact Gaussian),
:func:`client_gaussian_message` (natural parameters with the Monte Carlo covariance of the mean),
and the mixture weights over clients (:func:`client_weights`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import gaussian as gauss
from ..inference.sgmcmc import effective_sample_size
from ..posteriors import Gaussian, Samples

Array = jax.Array


def result_draws(result, key, num_samples: int) -> Array:
    """(S, d) draws of a client result: its Samples, or ``num_samples`` draws of its Gaussian."""
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        return post.draws
    if isinstance(post, Gaussian):
        return post.sample(key, num_samples)
    raise ValueError(f"client backend returned {type(post).__name__}; expected Samples or Gaussian")


def result_gaussian(result, diag: bool, jitter: float = 1e-6, name: str = "moment_match") -> Gaussian:
    """The client's Gaussian: moment-matched to Samples (with shrinkage), or its Gaussian in the asked form.

    A full Gaussian asked for diagonally keeps its marginal variances; a
    diagonal one asked for fully becomes a diagonal matrix. See
    :func:`fedprob.gaussian.moment_match`.
    """
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        return gauss.moment_match(post.draws, diag, jitter, name=name)
    if isinstance(post, Gaussian):
        return post.to_diag() if diag else post.to_full()
    raise ValueError(f"client backend returned {type(post).__name__}; expected Samples or Gaussian")


def draws_ess(draws) -> Array:
    """(d,) single-chain effective sample size of each coordinate of (S, d) draws (0 where not finite)."""
    ess = effective_sample_size(draws)
    return jnp.where(jnp.isfinite(ess), ess, 0.0)


def mc_message(weight, cov, ess) -> dict:
    """The Monte Carlo entries of a summing message: ``{"mc": W Sigma_mc W, "ess": min ESS}``.

    See :func:`fedprob.gaussian.mean_error_term`; ``ess`` (d,) per coordinate.
    """
    return {"mc": gauss.mean_error_term(weight, cov, ess), "ess": jnp.min(ess)}


def _huge(dtype):
    return jnp.asarray(jnp.finfo(dtype).max, dtype)


def client_gaussian_message(result, diag: bool, jitter: float, name: str, fit=None) -> dict:
    """A summing message of a client's Gaussian: natural parameters and Monte Carlo terms.

    ``{"linear": P mu, "precision": P, "mc": P Sigma_mc P, "ess": min ESS, "stein_fallbacks"}``.
    Samples: the Stein fit ``fit`` or moment-matched with shrinkage
    (:func:`fitted_gaussian`), per-coordinate ESS from the draws. A Gaussian
    output has no Monte Carlo error: ``mc = 0`` and ``ess`` the largest float
    (finite, so the engine's finiteness check passes); with a ``fit`` (a
    variational Gaussian refined from S of its own draws) the fit where it is
    positive definite, with the residuals' Monte Carlo term at ESS = S.
    """
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        g, cov, fallback = fitted_gaussian(post.draws, fit, diag, jitter, name)
        return {"linear": g.linear, "precision": g.precision, "stein_fallbacks": fallback,
                **mc_message(g.precision, cov, draws_ess(post.draws))}
    g = result_gaussian(post, diag, jitter)
    if fit is not None:             # a variational Gaussian refined from its own draws (iid: ESS = S)
        st, resid, ok = fit[:3]
        c = resid - jnp.mean(resid, 0)
        S = resid.shape[0]
        cov = jnp.sum(c * c, 0) / (S - 1) if diag else c.T @ c / (S - 1)
        g = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), st, g)
        mc = jnp.where(ok, gauss.mean_error_term(g.precision, cov, jnp.full(resid.shape[1:], float(S), c.dtype)),
                       jnp.zeros_like(g.precision))
        return {"linear": g.linear, "precision": g.precision, "stein_fallbacks": (~ok).astype(g.linear.dtype),
                "mc": mc, "ess": jnp.where(ok, jnp.asarray(S, g.linear.dtype), _huge(g.linear.dtype))}
    return {"linear": g.linear, "precision": g.precision, "stein_fallbacks": jnp.zeros((), g.linear.dtype),
            "mc": jnp.zeros_like(g.precision), "ess": _huge(g.linear.dtype)}


def fitted_gaussian(draws, fit, diag: bool, jitter: float, name: str):
    """``(Gaussian, covariance of the mean's Monte Carlo terms, fallback)`` of (S, d) draws: the Stein
    fit ``fit = (Gaussian, residuals, ok)`` (:func:`fedprob.algorithms.stein.stein_gaussian`) where it
    is positive definite, with the residuals' covariance; else (or with ``fit=None``) the sample
    moments (:func:`fedprob.gaussian.moment_match`) and the draws' covariance. ``fallback`` is 1.0
    where a Stein fit was replaced, else 0.0."""
    mm = gauss.moment_match(draws, diag, jitter, name=name, warn=fit is None)
    if fit is None:
        return mm, (mm.variance() if diag else mm.covariance()), jnp.zeros((), draws.dtype)
    g, resid, ok = fit[:3]
    g = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), g, mm)
    c = jnp.where(ok, resid, draws)
    c = c - jnp.mean(c, 0)
    cov = jnp.sum(c * c, 0) / (c.shape[0] - 1) if diag else c.T @ c / (c.shape[0] - 1)
    return g, cov, (~ok).astype(draws.dtype)


def match_moments(draws, g: Gaussian, diag: bool, transform=None) -> Array:
    """(S, d) draws mapped linearly so that their sample mean and covariance are ``g``'s (diagonal:
    their mean and variances): ``mean_g + Sigma_g^1/2 C^-1/2 (x - mean(x))`` with ``C`` the draws'
    sample covariance and symmetric square roots. The draws keep their shape (skew, tails) and take
    the fitted moments. ``transform``: ``(mean, T)`` already computed for these draws (a full Stein
    fit's, :func:`fedprob.algorithms.stein.stein_gaussian` with ``transform=True``), which saves the
    two eigendecompositions and the inverse here."""
    S = draws.shape[0]
    c = draws - jnp.mean(draws, 0)
    if transform is not None and not diag:
        mean, T = transform
        return mean + c @ T.T
    tiny = jnp.finfo(draws.dtype).tiny
    if diag:
        sd = jnp.sqrt(jnp.sum(c * c, 0) / (S - 1))
        scale = jnp.where(sd > tiny, jnp.sqrt(g.variance()) / jnp.maximum(sd, tiny), 1.0)
        return g.mean() + c * scale
    C = c.T @ c / (S - 1)
    C = C + jnp.diag(1e-6 * jnp.diagonal(C) + tiny)
    # symmetric square roots by eigendecomposition (no batched Cholesky custom calls in the client phase;
    # see fedprob.algorithms.stein): T = Sigma_g^1/2 C^-1/2, so T C T' = Sigma_g
    a, V = jnp.linalg.eigh(0.5 * (C + C.T))
    cov = g.covariance()
    b, U = jnp.linalg.eigh(0.5 * (cov + cov.T))
    T = ((U * jnp.sqrt(jnp.maximum(b, 0.0))) @ U.T) @ ((V / jnp.sqrt(jnp.maximum(a, tiny))) @ V.T)
    ok = jnp.all(jnp.isfinite(T))
    return g.mean() + c @ jnp.where(ok, T, jnp.eye(C.shape[0], dtype=C.dtype)).T


def client_weights(sizes, weighting: str) -> Array:
    """Mixture weights over clients: ∝ N_k (``"size"``) or ``"uniform"``."""
    sizes = jnp.asarray(sizes, jnp.result_type(float))
    if weighting == "size":
        return sizes / jnp.sum(sizes)
    if weighting == "uniform":
        return jnp.full(sizes.shape, 1.0 / sizes.shape[0])
    raise ValueError(f"weighting must be 'size' or 'uniform', got {weighting!r}")


__all__ = ["result_draws", "result_gaussian", "draws_ess", "mc_message", "client_gaussian_message", "fitted_gaussian",
           "match_moments",
           "client_weights"]
