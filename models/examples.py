"""Example programs in the style of NumPyro's own examples, each with a "data" plate.

They show the constructs a federated run accepts beyond the zoo's GLMs, and
the benchmark ``benchmarks/any_model.py`` and the tests run every algorithm on
them against pooled NUTS. Each is a plain ``model(X, y=None)``; the columns of
``X`` that are not features (a group index, trial counts, a known sd) are
stated per model.

* :func:`robust_regression`: Student-t regression (nu = 4) on column 0, the
  likelihood masked where column 1 is 0 (``.mask``);
* :func:`zero_inflated_poisson`: counts with a Beta-distributed zero gate;
* :func:`ordinal_regression`: ordered logistic regression with cutpoints from
  Dirichlet class probabilities (a deterministic site ``cutpoints``);
* :func:`binomial_groups`: binomial regression, column 0 an integer group
  index, column 1 the integer number of trials;
* :func:`known_scales`: a normal mean with a known sd per row in column 1
  (the eight-schools likelihood);
* :func:`factor_poisson`: a Poisson GLM written as a ``numpyro.factor``;
* :func:`horseshoe_logistic`: logistic regression under a horseshoe prior,
  deterministic effective coefficients ``w`` (a posterior far from Gaussian);
* :func:`eight_schools`: the centred eight schools (a funnel between ``tau``
  and ``theta``); column 0 the school, column 1 its known sd.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist


def robust_regression(X, y=None):
    """``y ~ StudentT(4, w x0 + b, sigma)`` where ``x1 > 0`` (masked rows do not count); w, b ~ N(0, 3^2),
    sigma ~ HalfNormal(2)."""
    w = numpyro.sample("w", dist.Normal(0.0, 3.0))
    b = numpyro.sample("b", dist.Normal(0.0, 3.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(4.0, w * X[:, 0] + b, sigma).mask(X[:, 1] > 0), obs=y)


def zero_inflated_poisson(X, y=None):
    """``y ~ ZeroInflatedPoisson(gate, exp(w x0 + b))``; w, b ~ N(0, 1), gate ~ Beta(1, 1)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    gate = numpyro.sample("gate", dist.Beta(1.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.ZeroInflatedPoisson(gate, jnp.exp(w * X[:, 0] + b)), obs=y)


#: classes of :func:`ordinal_regression`
NUM_ORDINAL_CLASSES = 4


def ordinal_regression(X, y=None):
    """``y ~ OrderedLogistic(beta x0, cutpoints)`` over 4 classes, ``cutpoints = logit(cumsum(p))[:-1]``
    with ``p ~ Dirichlet(1)`` (a deterministic site); beta ~ N(0, 2^2)."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0))
    probs = numpyro.sample("probs", dist.Dirichlet(jnp.ones(NUM_ORDINAL_CLASSES)))
    cut = numpyro.deterministic("cutpoints", jax.scipy.special.logit(
        jnp.clip(jnp.cumsum(probs)[:-1], 1e-6, 1 - 1e-6)))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.OrderedLogistic(beta * X[:, 0], cut), obs=y)


#: groups of :func:`binomial_groups`
NUM_GROUPS = 3


def binomial_groups(X, y=None):
    """``y ~ Binomial(x1, sigmoid(a[x0]))``: column 0 an integer group index (3 groups), column 1 the
    integer number of trials; a ~ N(0, 2^2) per group."""
    a = numpyro.sample("a", dist.Normal(0.0, 2.0).expand([NUM_GROUPS]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Binomial(total_count=X[:, 1], logits=a[X[:, 0]]), obs=y)


def known_scales(X, y=None):
    """``y ~ N(mu, x1^2)``, a known sd per row in column 1; mu ~ N(0, 10^2)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(mu, X[:, 1]), obs=y)


def factor_poisson(X, y=None):
    """A Poisson GLM ``log p(y | w, b) = log Poisson(y; exp(w x0 + b))`` as a ``numpyro.factor`` in the
    data plate; w, b ~ N(0, 1)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.factor("lik", dist.Poisson(jnp.exp(w * X[:, 0] + b)).log_prob(y))


def horseshoe_logistic(X, y=None):
    """``y ~ Bernoulli(sigmoid(X w))`` with ``w = tau lam z`` (deterministic), tau ~ HalfCauchy(1),
    lam ~ HalfCauchy(1) per feature, z ~ N(0, 1) per feature."""
    D = X.shape[1]
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    lam = numpyro.sample("lam", dist.HalfCauchy(jnp.ones(D)).to_event(1))
    z = numpyro.sample("z", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
    w = numpyro.deterministic("w", tau * lam * z)
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def eight_schools(X, y=None):
    """Centred eight schools: ``theta ~ N(mu, tau^2)`` per school, ``y ~ N(theta[x0], x1^2)``;
    mu ~ N(0, 5^2), tau ~ HalfCauchy(5)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    theta = numpyro.sample("theta", dist.Normal(mu * jnp.ones(8), tau).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(theta[X[:, 0].astype(jnp.int32)], X[:, 1]), obs=y)


__all__ = ["robust_regression", "zero_inflated_poisson", "ordinal_regression", "binomial_groups", "known_scales",
           "factor_poisson", "horseshoe_logistic", "eight_schools", "NUM_ORDINAL_CLASSES", "NUM_GROUPS"]

from fedprob.names import module_getattr as _module_getattr  # noqa: E402

__getattr__ = _module_getattr(__name__, globals(), "example model or attribute")
