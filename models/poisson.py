"""Bayesian Poisson regression: a count likelihood (``Potential.task == "count"``)."""
from __future__ import annotations

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from .linear import DATA_PLATE, check_scale, check_targets, flatten_features


def poisson_regression(prior_scale: float = 1.0, bias: bool = True):
    """Bayesian Poisson regression ``model(X, y=None)`` for counts y in {0, 1, 2, ...}.

    Prior (sites in this order)::

        w ~ N(0, prior_scale^2 I_d)   shape (d,)
        b ~ N(0, prior_scale^2)       shape (), only if ``bias``

    Likelihood, inside ``numpyro.plate("data", n)`` (log link)::

        y_i ~ Poisson(rate = exp(x_i . w + b))

    The posterior predictive of a count is summarised by its mean and
    variance (``posterior.predict``), and scored by the exact log density of
    the mixture over posterior draws (``posterior.log_predictive_density``).
    Inputs of shape (n, ...) are flattened to (n, d).
    """
    check_scale("prior_scale", prior_scale)

    def model(X, y=None):
        X = flatten_features(X, "poisson_regression")
        n, d = X.shape
        check_targets(y, n, "poisson_regression")
        w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([d]).to_event(1))
        eta = X @ w
        if bias:
            eta = eta + numpyro.sample("b", dist.Normal(0.0, prior_scale))
        with numpyro.plate(DATA_PLATE, n):
            numpyro.sample("y", dist.Poisson(jnp.exp(eta)), obs=y)

    model.__name__ = "poisson_regression"
    model.__doc__ = poisson_regression.__doc__
    return model
