"""The plain ensemble: a mixture of the client posteriors (one round).

Every client samples its own posterior ``p0(w) p(D_k | w)`` (full prior) and
sends its S draws. The global object is the mixture
``sum_k pi_k p(w | D_k)`` with ``pi_k ∝ N_k`` (``weighting="size"``, the
default: each client counts by its data) or ``pi_k = 1/K'``
(``weighting="uniform"``), over the K' clients received (masked clients are
left out). Its predictive is the same mixture of client predictives:
classification probabilities ``sum_k pi_k p(y | x, D_k)``; regression the
mixture's mean and variance (law of total variance, noise included).

This is a baseline, not the Bayesian posterior: a mixture of client
posteriors is as wide as the widest client, where the global posterior is
narrower than any of them.

:class:`EnsemblePosterior` also holds the per-client predictive machinery that
:mod:`fedprob.algorithms.predictive_bayes` builds on.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

from .. import inputs
from ..posteriors import GlobalPosterior, Samples, mixture_log_density
from ..inference import CyclicalSGHMC
from .base import Context
from .one_round import OneRoundAlgorithm, check_choice, check_int, client_weights, result_draws


@partial(jax.jit, static_argnums=0)
def client_predictive(potential, draws, X):
    """Per-client predictive from stacked draws (K, S, d), streamed over the draws.

    Classification: (K, n, C) log predictive probabilities
    ``log (1/S) sum_j p(y | x, w_kj)``. Regression: a tuple ``(mean,
    latent_var, noise_var)`` each (K, n, ...): the mean of the per-draw means,
    their variance over draws (uncertainty about the mean function, divisor
    S) and the mean per-draw observation variance.
    """
    K, S, _ = draws.shape
    per = jax.vmap(lambda z: potential.predict(z, X))
    steps = jnp.swapaxes(draws[:, 1:], 0, 1)         # (S-1, K, d)
    if potential.task == "classification":
        first = per(draws[:, 0])

        def step(acc, z):
            return jnp.logaddexp(acc, per(z)), None

        acc, _ = jax.lax.scan(step, first, steps)
        return acc - jnp.log(S)
    m0, v0 = per(draws[:, 0])

    def step(acc, z):
        m, v = per(z)
        dm = m - m0
        return (acc[0] + dm, acc[1] + dm * dm, acc[2] + v), None

    zero = jnp.zeros_like(m0)
    (s1, s2, s3), _ = jax.lax.scan(step, (zero, zero, v0), steps)
    shift = s1 / S
    latent = jnp.maximum(s2 / S - shift * shift, 0.0)
    return m0 + shift, latent, s3 / S


def mixture_prediction(task: str, client_pred, weights):
    """Mixture of client predictives with weights (K,) (see :func:`client_predictive`)."""
    if task == "classification":
        lw = jnp.log(jnp.maximum(weights, 1e-38))[:, None, None]
        return jnp.exp(logsumexp(client_pred + lw, axis=0))
    mean, latent, noise = client_pred
    w = jnp.reshape(weights, (-1,) + (1,) * (mean.ndim - 1))
    mix_mean = jnp.sum(w * mean, 0)
    second = jnp.sum(w * (latent + noise + mean * mean), 0)
    return mix_mean, jnp.maximum(second - mix_mean ** 2, 0.0)


@partial(jax.jit, static_argnums=0)
def _mixture_predict(potential, client_draws, weights, X):
    return mixture_prediction(potential.task, client_predictive(potential, client_draws, X), weights)


@partial(jax.jit, static_argnums=0)
def _mixture_log_density(potential, client_draws, weights, X, y):
    per_client = jax.vmap(lambda d: mixture_log_density(potential, d, X, y))(client_draws)   # (K, n)
    return logsumexp(per_client + jnp.log(jnp.maximum(weights, 1e-38))[:, None], axis=0)


@partial(jax.jit, static_argnums=3)
def _resample(key, client_draws, weights, n: int):
    k1, k2 = jax.random.split(key)
    K, S, _ = client_draws.shape
    ks = jax.random.choice(k1, K, (n,), p=weights)
    return client_draws[ks, jax.random.randint(k2, (n,), 0, S)]


class EnsemblePosterior(GlobalPosterior):
    """A mixture of client posteriors given by draws.

    client_draws: (K, S, d) flat unconstrained draws of the clients received;
    mixture_weights: (K,) weights of the predictive mixture; sample_weights:
    (K,) weights of the clients in ``sample``/``mean`` (default: the mixture
    weights). ``form`` is the union of all draws, ``Samples((K*S, d))``.
    """

    def __init__(self, potential, client_draws, mixture_weights, sample_weights=None, *, info=None,
                 seed: int = 0):
        client_draws = jnp.asarray(client_draws)
        K, S, d = client_draws.shape
        super().__init__(potential, Samples(client_draws.reshape(K * S, d)), info=info, seed=seed)
        self.client_draws = client_draws
        self.mixture_weights = jnp.asarray(mixture_weights)
        self.sample_weights = self.mixture_weights if sample_weights is None else jnp.asarray(sample_weights)

    @property
    def num_clients(self) -> int:
        return int(self.client_draws.shape[0])

    # -- parameters --------------------------------------------------------------------------------
    @property
    def flat_mean(self):
        return jnp.tensordot(self.sample_weights, jnp.mean(self.client_draws, 1), 1)

    @property
    def mean(self) -> dict:
        K, S, d = self.client_draws.shape
        vals = jax.vmap(self.potential.constrain)(self.client_draws.reshape(K * S, d))
        return {k: jnp.tensordot(self.sample_weights, jnp.mean(v.reshape((K, S) + v.shape[1:]), 1), 1)
                for k, v in vals.items()}

    def flat_sample(self, key, n: int):
        """n draws: a client by the sample weights, then one of its draws uniformly."""
        return _resample(key, self.client_draws, self.sample_weights, int(n))

    # -- prediction -----------------------------------------------------------------------------------
    def client_predictive(self, X):
        """Per-client predictives at X (see :func:`client_predictive`)."""
        return client_predictive(self.potential, self.client_draws, inputs.as_jax(X))

    def predict(self, X):
        """The mixture of client predictives (probabilities, or (mean, variance))."""
        return _mixture_predict(self.potential, self.client_draws, self.mixture_weights, inputs.as_jax(X))

    def log_predictive_density(self, X, y):
        """(n,) ``log sum_k pi_k (1/S) sum_j p(y | x, w_kj)``: the mixture's exact log density."""
        y = jnp.asarray(y)
        if self.potential.task != "regression":
            y = y.astype(jnp.int32)
        return _mixture_log_density(self.potential, self.client_draws, self.mixture_weights,
                                    inputs.as_jax(X), y)


@dataclasses.dataclass(frozen=True)
class Ensemble(OneRoundAlgorithm):
    """Mixture of client posteriors (see the module docstring).

    client: the backend (default CyclicalSGHMC()); weighting:
    ``"size"`` (pi_k ∝ N_k) or ``"uniform"``; num_samples: draws taken from a
    Gaussian client output.
    """

    weighting: str = "size"
    num_samples: int = 100

    def default_client(self):
        """Cyclical SGHMC with its defaults (the paper's client sampler)."""
        return CyclicalSGHMC()

    def __post_init__(self):
        super().__post_init__()
        check_choice("weighting", self.weighting, ("size", "uniform"))
        check_int("num_samples", self.num_samples)

    def make_message(self, ctx, result, key):
        return {"draws": result_draws(result, key, self.num_samples)}

    def posterior(self, ctx: Context, server_state, client_states) -> EnsemblePosterior:
        msgs, sizes, ids = self.received(server_state)
        w = client_weights(sizes, self.weighting)
        info = {"kind": "ensemble (mixture of client posteriors)", "weighting": self.weighting,
                "num_clients_combined": int(ids.size), "client_ids": ids.tolist(),
                "mixture_weights": np.asarray(w).tolist()}
        return EnsemblePosterior(ctx.potential, msgs["draws"], w, info=info)


__all__ = ["Ensemble", "EnsemblePosterior", "client_predictive", "mixture_prediction"]
