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


def client_gaussian_message(result, diag: bool, jitter: float, name: str) -> dict:
    """A summing message of a client's Gaussian: natural parameters and Monte Carlo terms.

    ``{"linear": P mu, "precision": P, "mc": P Sigma_mc P, "ess": min ESS}``.
    Samples: moment-matched with shrinkage, per-coordinate ESS from the
    draws. A Gaussian output has no Monte Carlo error: ``mc = 0`` and ``ess``
    the largest float (finite, so the engine's finiteness check passes).
    """
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        g = gauss.moment_match(post.draws, diag, jitter, name=name)
        cov = g.variance() if diag else g.covariance()
        return {"linear": g.linear, "precision": g.precision, **mc_message(g.precision, cov, draws_ess(post.draws))}
    g = result_gaussian(post, diag, jitter)
    return {"linear": g.linear, "precision": g.precision, "mc": jnp.zeros_like(g.precision),
            "ess": _huge(g.linear.dtype)}


def client_weights(sizes, weighting: str) -> Array:
    """Mixture weights over clients: ∝ N_k (``"size"``) or ``"uniform"``."""
    sizes = jnp.asarray(sizes, jnp.result_type(float))
    if weighting == "size":
        return sizes / jnp.sum(sizes)
    if weighting == "uniform":
        return jnp.full(sizes.shape, 1.0 / sizes.shape[0])
    raise ValueError(f"weighting must be 'size' or 'uniform', got {weighting!r}")


__all__ = ["result_draws", "result_gaussian", "draws_ess", "mc_message", "client_gaussian_message",
           "client_weights"]
