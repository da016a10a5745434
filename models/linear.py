"""Bayesian linear regression.

Shared small helpers of the zoo (input checks, feature flattening) live here
too; the other model files import them.
"""
from __future__ import annotations

import operator
from typing import Optional

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from fedprob.validation import check_positive

DATA_PLATE = "data"


check_scale = check_positive   # the zoo's name for a positive-scale check


def check_num_classes(num_classes, minimum: int = 2) -> int:
    """The class count as an int; a ValueError unless it is an integer >= minimum."""
    try:
        k = operator.index(num_classes)
    except TypeError:
        raise ValueError(f"num_classes must be an integer >= {minimum}, got {num_classes!r}") from None
    if isinstance(num_classes, bool) or k < minimum:
        raise ValueError(f"num_classes must be an integer >= {minimum}, got {num_classes!r}")
    return k


def flatten_features(X, model_name: str):
    """(n, ...) inputs -> (n, d) with the trailing axes flattened."""
    X = jnp.asarray(X)
    if X.ndim < 2:
        raise ValueError(f"{model_name}: X must have shape (n, d) (or (n, ...) to be flattened), "
                         f"got shape {X.shape}")
    return X.reshape(X.shape[0], -1)


def check_targets(y, n: int, model_name: str) -> None:
    """Targets must be one per row, shape (n,) (a (n, 1) column would silently broadcast)."""
    if y is not None and tuple(jnp.shape(y)) != (n,):
        raise ValueError(f"{model_name}: y must have shape ({n},), one target per row of X, "
                         f"got shape {tuple(jnp.shape(y))}")


def linear_regression(noise_scale: Optional[float] = None, prior_scale: float = 1.0,
                      bias: bool = True, noise_prior_scale: float = 1.0):
    """Bayesian linear regression ``model(X, y=None)``.

    Prior (sites in this order)::

        w     ~ N(0, prior_scale^2 I_d)          shape (d,)
        b     ~ N(0, prior_scale^2)              shape (), only if ``bias``
        sigma ~ HalfNormal(noise_prior_scale)    only if ``noise_scale is None``

    Likelihood, inside ``numpyro.plate("data", n)``::

        y_i ~ N(x_i . w + b, sigma^2)

    with ``sigma = noise_scale`` when the noise is known. With known noise the
    posterior is the conjugate Gaussian (append a ones column to X for the
    bias). Inputs of shape (n, ...) are flattened to (n, d).
    """
    check_scale("noise_scale", noise_scale, allow_none=True)
    check_scale("prior_scale", prior_scale)
    check_scale("noise_prior_scale", noise_prior_scale)

    def model(X, y=None):
        X = flatten_features(X, "linear_regression")
        n, d = X.shape
        check_targets(y, n, "linear_regression")
        w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([d]).to_event(1))
        mean = X @ w
        if bias:
            mean = mean + numpyro.sample("b", dist.Normal(0.0, prior_scale))
        if noise_scale is None:
            sigma = numpyro.sample("sigma", dist.HalfNormal(noise_prior_scale))
        else:
            sigma = noise_scale
        with numpyro.plate(DATA_PLATE, n):
            numpyro.sample("y", dist.Normal(mean, sigma), obs=y)

    model.__name__ = "linear_regression"
    model.__doc__ = linear_regression.__doc__
    return model
