"""Bayesian logistic (binary) and softmax (multi-class) regression."""
from __future__ import annotations

import numpyro
import numpyro.distributions as dist

from .linear import DATA_PLATE, check_num_classes, check_scale, check_targets, flatten_features


def logistic_regression(prior_scale: float = 1.0, bias: bool = True):
    """Bayesian logistic regression ``model(X, y=None)`` for labels in {0, 1}.

    Prior (sites in this order)::

        w ~ N(0, prior_scale^2 I_d)   shape (d,)
        b ~ N(0, prior_scale^2)       shape (), only if ``bias``

    Likelihood, inside ``numpyro.plate("data", n)``::

        y_i ~ Bernoulli(logits = x_i . w + b)

    Inputs of shape (n, ...) are flattened to (n, d).
    """
    check_scale("prior_scale", prior_scale)

    def model(X, y=None):
        X = flatten_features(X, "logistic_regression")
        n, d = X.shape
        check_targets(y, n, "logistic_regression")
        w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([d]).to_event(1))
        logits = X @ w
        if bias:
            logits = logits + numpyro.sample("b", dist.Normal(0.0, prior_scale))
        with numpyro.plate(DATA_PLATE, n):
            numpyro.sample("y", dist.Bernoulli(logits=logits), obs=y)

    model.__name__ = "logistic_regression"
    model.__doc__ = logistic_regression.__doc__
    return model


def softmax_regression(num_classes: int, prior_scale: float = 1.0, bias: bool = True):
    """Bayesian multinomial logistic (softmax) regression ``model(X, y=None)``.

    Prior (sites in this order), C = ``num_classes``::

        W ~ N(0, prior_scale^2)   shape (d, C), independent entries
        b ~ N(0, prior_scale^2)   shape (C,), only if ``bias``

    Likelihood, inside ``numpyro.plate("data", n)``::

        y_i ~ Categorical(logits = x_i W + b),   y_i in {0, ..., C-1}

    The parametrisation is the over-complete one (a logit offset common to all
    classes is identified by the prior only). Inputs of shape (n, ...) are
    flattened to (n, d).
    """
    C = check_num_classes(num_classes)
    check_scale("prior_scale", prior_scale)

    def model(X, y=None):
        X = flatten_features(X, "softmax_regression")
        n, d = X.shape
        check_targets(y, n, "softmax_regression")
        W = numpyro.sample("W", dist.Normal(0.0, prior_scale).expand([d, C]).to_event(2))
        logits = X @ W
        if bias:
            logits = logits + numpyro.sample("b", dist.Normal(0.0, prior_scale).expand([C]).to_event(1))
        with numpyro.plate(DATA_PLATE, n):
            numpyro.sample("y", dist.Categorical(logits=logits), obs=y)

    model.__name__ = "softmax_regression"
    model.__doc__ = softmax_regression.__doc__
    return model
