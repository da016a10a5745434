"""Hierarchical (multilevel) linear regression: varying intercepts and slopes across clients.

Each client k is a group with parameters of its own, drawn from shared ones
(non-centred: the local sites are standard normal and scaled by the global
ones, which keeps every client's posterior free of the funnel a centred
``a_k ~ N(mu_a, sigma_a)`` has at small ``sigma_a``)::

    mu_a    ~ N(0, prior_scale^2)                 global intercept mean
    sigma_a ~ LogNormal(log scale_prior, 1)       spread of the intercepts
    w       ~ N(0, prior_scale^2 I_d)             shared slopes
    sigma   ~ LogNormal(log noise_prior_scale, 1) observation noise
    z_a     ~ N(0, 1)              local          a_k = mu_a + sigma_a z_a
  if varying_slopes (on the input column ``slope_feature``):
    sigma_b ~ LogNormal(log scale_prior, 1)       spread of the slopes
    z_b     ~ N(0, 1)              local          b_k = sigma_b z_b
  if varying_noise:
    tau_s   ~ LogNormal(log 0.5, 1)               spread of the clients' log noise scales
    z_s     ~ N(0, 1)              local          sigma_k = sigma exp(tau_s z_s)
    y_i ~ N(a_k + x_i . w + b_k x_i[slope_feature], sigma_k^2)  inside plate "data"

The scales are log-normal: Gaussian in the unconstrained (log) coordinates the
Gaussian methods work in, so PVI and the other natural-loop methods use the
prior exactly rather than a Gaussian moment-matched to it (a half-normal scale
prior works too, with that approximation and a warning saying so).

``z_a``/``z_b`` are marked ``infer={"local": True}``: one copy per client,
inferred by the client alone; the rest is shared. ``a_k`` and ``b_k`` are
recorded as deterministic sites ``a`` and ``b``.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from .linear import DATA_PLATE, check_scale, check_targets, flatten_features


def hierarchical_linear(varying_slopes: bool = False, slope_feature: int = 0, varying_noise: bool = False,
                        prior_scale: float = 1.0, scale_prior: float = 1.0, noise_prior_scale: float = 1.0):
    """A varying-intercept (and, with ``varying_slopes``, varying-slope) regression ``model(X, y=None)``
    whose per-client sites are client-local (module docstring)."""
    check_scale("prior_scale", prior_scale)
    check_scale("scale_prior", scale_prior)
    check_scale("noise_prior_scale", noise_prior_scale)
    j = int(slope_feature)

    def model(X, y=None):
        X = flatten_features(X, "hierarchical_linear")
        n, d = X.shape
        check_targets(y, n, "hierarchical_linear")
        if varying_slopes and not 0 <= j < d:
            raise ValueError(f"hierarchical_linear: slope_feature={j} but X has {d} columns")
        mu_a = numpyro.sample("mu_a", dist.Normal(0.0, prior_scale))
        sigma_a = numpyro.sample("sigma_a", dist.LogNormal(math.log(scale_prior), 1.0))
        w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([d]).to_event(1))
        sigma = numpyro.sample("sigma", dist.LogNormal(math.log(noise_prior_scale), 1.0))
        z_a = numpyro.sample("z_a", dist.Normal(0.0, 1.0), infer={"local": True})
        a = numpyro.deterministic("a", mu_a + sigma_a * z_a)
        mean = a + X @ w
        if varying_slopes:
            sigma_b = numpyro.sample("sigma_b", dist.LogNormal(math.log(scale_prior), 1.0))
            z_b = numpyro.sample("z_b", dist.Normal(0.0, 1.0), infer={"local": True})
            b = numpyro.deterministic("b", sigma_b * z_b)
            mean = mean + b * X[:, j]
        if varying_noise:
            tau_s = numpyro.sample("tau_s", dist.LogNormal(math.log(0.5), 1.0))
            z_s = numpyro.sample("z_s", dist.Normal(0.0, 1.0), infer={"local": True})
            sigma = numpyro.deterministic("sigma_k", sigma * jnp.exp(tau_s * z_s))
        with numpyro.plate(DATA_PLATE, n):
            numpyro.sample("y", dist.Normal(mean, sigma), obs=y)

    return model
