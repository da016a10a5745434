"""The prior lambda_0 of the natural-parameter methods, as a Gaussian in the loop's family.

``N(0, I/delta)`` when ``delta`` is given, else the model's own prior read
off the potential once (exact natural parameters for independent Normal
coordinates, moment-matched otherwise, :func:`fedprob.gaussian.prior_gaussian`).
With client-local sites it is the prior of the global block alone
(``Potential.log_prior_global``): the local sites' conditional prior stays on
the clients.
Used by the natural loop (:mod:`fedprob.algorithms.natural`) and FedLap-Func.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import gaussian as gauss
from ..posteriors import Gaussian

#: model priors already computed, keyed on (potential, x64)
_PRIORS: dict = {}


@functools.partial(jax.jit, static_argnums=0)
def _log_prior_grads(potential, z):
    # with client-local sites, the prior of the global block alone (the server's lambda_0)
    fn = potential.log_prior_global if potential.local_sites else potential.log_prior
    return jax.vmap(jax.grad(fn))(z)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _global_prior_draws(potential, key, n):
    return jax.vmap(potential.sample_prior)(jax.random.split(key, n))[:, :potential.dim_global]


def _global_moment_matched(potential, b, p, ok):
    """The global block's prior: exact ``(b, p)`` on the coordinates ``ok``, the others moment-matched
    to 2000 prior draws of the global block (diagonal)."""
    draws = np.asarray(_global_prior_draws(potential, jax.random.PRNGKey(0), 2000), np.float64)
    mean, var = draws.mean(0), draws.var(0, ddof=1)
    p_safe = np.where(ok, p, 1.0)
    prec = np.where(ok, p_safe, 1.0 / var)
    return prec * np.where(ok, b / p_safe, mean), prec


def _diag_model_prior(potential):
    """``(Gaussian, exact)``: the model prior as a diagonal Gaussian, computed once per potential.

    A coordinate whose log-prior gradient is exactly ``b - p z`` (``p > 0``)
    at ``z = 0``, at ``z = 1`` and at 8 fixed points (entries ``N(0, 2^2)``,
    drawn once by numpy) is an independent Normal prior with natural
    parameters ``(b, p)``: the same check as
    :func:`fedprob.gaussian.prior_gaussian`, as one compiled gradient
    evaluation with no random-number program to compile. When some
    coordinate fails, the whole prior comes from
    :func:`~fedprob.gaussian.prior_gaussian` (moment-matched there).
    """
    cache_key = (potential, bool(jax.config.jax_enable_x64))
    hit = _PRIORS.get(cache_key)
    if hit is None:
        local = bool(potential.local_sites)
        d = potential.dim_global if local else potential.dim
        pts = 2.0 * np.random.default_rng(0).normal(size=(8, d))
        z = np.concatenate([np.zeros((1, d)), np.ones((1, d)), pts])
        g = np.asarray(_log_prior_grads(potential, jnp.asarray(z, jnp.result_type(float))), np.float64)
        b, p, g = g[0], g[0] - g[1], g[2:]
        resid = np.abs(g - (b - p * pts))
        tol = 1e-4 * (1.0 + np.abs(b) + np.abs(p * pts) + np.abs(g))
        ok = (resid <= tol).all(0) & (p > 0) & np.isfinite(g).all(0)
        exact = bool(np.all(ok))
        if exact:
            hit = (b, p), True
        elif local:
            hit = _global_moment_matched(potential, b, p, ok), False
        else:
            gg, _ = gauss.prior_gaussian(potential, jax.random.PRNGKey(0), diag=True)
            hit = (np.asarray(gg.linear), np.asarray(gg.precision)), False
        _PRIORS[cache_key] = hit
    (b, p), exact = hit
    dt = jnp.result_type(float)
    return Gaussian(jnp.asarray(b, dt), jnp.asarray(p, dt)), exact


def model_prior(potential, family: str, delta: Optional[float], name: str = "natural loop") -> Gaussian:
    """lambda_0 in the family's form: ``N(0, I/delta)`` when ``delta`` is given, else the model prior.

    Safe inside a traced function (evaluated at trace time, once per
    potential). Non-Normal prior sites are moment-matched (a warning says so).
    """
    d = potential.dim_global          # the whole vector without client-local sites
    if delta is not None:
        g = Gaussian(jnp.zeros((d,)), jnp.full((d,), float(delta)))
    else:
        with jax.ensure_compile_time_eval():
            g, exact = _diag_model_prior(potential)
        if not exact:
            warnings.warn(
                f"{name}: the model prior is not Gaussian in every unconstrained coordinate; those "
                "coordinates use a Gaussian moment-matched to prior draws (pass delta=... for a "
                "N(0, I/delta) prior instead)", RuntimeWarning, stacklevel=4)
    return g.to_full() if family == "full" else g


__all__ = ["model_prior"]
