"""The plain ensemble: a mixture of the client posteriors (one round).

Every client samples its own posterior ``p0(w) p(D_k | w)`` (full prior) and
sends its S draws. The global object is the mixture
``sum_k pi_k p(w | D_k)`` with ``pi_k ∝ N_k`` (``weighting="size"``, the
default: each client counts by its data) or ``pi_k = 1/K'``
(``weighting="uniform"``), over the K' clients received (masked clients are
left out). Its predictive is the same mixture of client predictives:
classification probabilities ``sum_k pi_k p(y | x, D_k)``; regression the
mixture's mean and variance (law of total variance, noise included); where
some draws' predictive has no finite mean or variance (heavy tails), those of
the mixture restricted to a grid of y (:mod:`fedprob.algorithms.predictive_grid`,
with a warning). ``log_predictive_density`` is the mixture's exact density.

This is a baseline, not the Bayesian posterior: a mixture of client
posteriors is as wide as the widest client, where the global posterior is
narrower than any of them.

Client-local sites (``infer={"local": True}``): every client samples the joint
of the global sites and its own local sites, ``p0(g) p(l_k | g) p(D_k | g,
l_k)``, and sends those joint draws. ``mean``, ``sd`` and ``sample`` cover the
global sites (the mixture of the global blocks); client k's local posterior is
its own draws' local block (``local_mean``, ``local_sd``, ``sample_local``);
``predict(X, client=k)`` is client k's own posterior predictive (its joint
draws: its data alone, no pooling), and ``predict(X, client=None)`` (the
default) a new client's: every draw's local block replaced by a draw from the
local sites' conditional prior given that draw's global block, mixed over
clients as above (pooled as products by PredictiveBayes).

:class:`EnsemblePosterior` also holds the per-client predictive machinery that
:mod:`fedprob.algorithms.predictive_bayes` builds on.
"""
from __future__ import annotations

import dataclasses
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

from .. import inputs
from ..posteriors import GlobalPosterior, Samples, _average_predictions_jit, _mixture_log_density_jit, mixture_log_density
from ..inference import CyclicalSGHMC
from . import predictive_grid
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
    weights). ``form`` is the union of all draws, ``Samples((K*S, d))`` (of
    their global block with client-local sites, module docstring).
    """

    def __init__(self, potential, client_draws, mixture_weights, sample_weights=None, *, info=None,
                 seed: int = 0):
        client_draws = jnp.asarray(client_draws)
        K, S, d = client_draws.shape
        dg = potential.dim_global if getattr(potential, "local_sites", ()) else d
        super().__init__(potential, Samples(client_draws[..., :dg].reshape(K * S, dg)), info=info, seed=seed)
        self.client_draws = client_draws
        self.mixture_weights = jnp.asarray(mixture_weights)
        self.sample_weights = self.mixture_weights if sample_weights is None else jnp.asarray(sample_weights)
        self._new_client = None

    @property
    def num_clients(self) -> int:
        return int(self.client_draws.shape[0])

    # -- parameters --------------------------------------------------------------------------------
    def _dg(self) -> int:
        return self.form.draws.shape[-1]

    @property
    def flat_mean(self):
        return jnp.tensordot(self.sample_weights, jnp.mean(self.client_draws[..., :self._dg()], 1), 1)

    @property
    def mean(self) -> dict:
        K, S, d = self.client_draws.shape
        vals = jax.vmap(self.potential.constrain)(self.client_draws.reshape(K * S, d))
        keep = self.potential.global_sites if self.has_local_sites else tuple(vals)
        return {k: jnp.tensordot(self.sample_weights, jnp.mean(v.reshape((K, S) + v.shape[1:]), 1), 1)
                for k, v in vals.items() if k in keep}

    def flat_sample(self, key, n: int):
        """n draws: a client by the sample weights, then one of its draws uniformly (the global block
        with client-local sites)."""
        return _resample(key, self.client_draws, self.sample_weights, int(n))[..., :self._dg()]

    # -- client-local sites ---------------------------------------------------------------------------
    def _check_local(self):
        if not self.has_local_sites:
            super()._check_local()

    @property
    def num_local_clients(self) -> int:
        self._check_local()
        return self.num_clients

    def local_moments(self):
        """``(mean (K, d_l), cov (K, d_l, d_l))`` of each client's own draws' local block."""
        self._check_local()
        zl = self.client_draws[..., self._dg():]
        m = jnp.mean(zl, 1)
        c = zl - m[:, None]
        return m, jnp.einsum("ksi,ksj->kij", c, c) / max(zl.shape[1] - 1, 1)

    def sample_local(self, key, n: int) -> dict:
        """site -> (n, K, ...): each client's local sites resampled from its own joint draws."""
        self._check_local()
        K, S, d = self.client_draws.shape
        idx = jax.random.randint(key, (K, int(n)), 0, S)
        z = jnp.take_along_axis(self.client_draws, idx[..., None], 1)          # (K, n, d)
        vals = jax.vmap(self.potential.constrain)(jnp.swapaxes(z, 0, 1).reshape(-1, d))
        return {s: vals[s].reshape((int(n), K) + vals[s].shape[1:]) for s in self.potential.local_sites}

    def new_client_draws(self):
        """(K, S, d): the client draws with every local block replaced by a draw from the local sites'
        conditional prior given the draw's global block (a new client's sites; fixed for this posterior)."""
        if self._new_client is None:
            K, S, d = self.client_draws.shape
            zg = self.client_draws[..., :self._dg()].reshape(K * S, -1)
            keys = jax.random.split(jax.random.fold_in(self._key, 3), K * S)
            zl = jax.vmap(self.potential.sample_local_prior)(keys, zg)
            self._new_client = jnp.concatenate([zg, zl], -1).reshape(K, S, d)
        return self._new_client

    def predictive_draws(self, client=None):
        """``(draws (K, S, d) mixed over clients, None)`` for the global or a new client's predictive, or
        ``(None, draws (S, d))`` of client ``client``'s own posterior predictive."""
        if not self.has_local_sites:
            if client is not None:
                raise ValueError("client=... needs a model with client-local sites (infer={'local': True}); "
                                 "this model shares every site across clients")
            return self.client_draws, None
        if client is None:
            return self.new_client_draws(), None
        K = self.num_clients
        if isinstance(client, bool) or not isinstance(client, (int, np.integer)) or not 0 <= int(client) < K:
            raise ValueError(f"client must be None (a new client) or an index in [0, {K}), got {client!r}")
        return None, self.client_draws[int(client)]

    # -- prediction -----------------------------------------------------------------------------------
    def client_predictive(self, X):
        """Per-client predictives at X (see :func:`client_predictive`; a new client's local sites)."""
        return client_predictive(self.potential, self.predictive_draws()[0], inputs.as_jax(X))

    def predict(self, X, client=None):
        """The mixture of client predictives (probabilities, or (mean, variance)); with client-local
        sites ``client=k`` is client k's own posterior predictive, ``None`` a new client's."""
        mixed, own = self.predictive_draws(client)
        if own is not None:
            return _average_predictions_jit(self.potential, own, inputs.as_jax(X), 64)
        X = inputs.as_jax(X)
        if self.potential.task == "classification":
            return _mixture_predict(self.potential, mixed, self.mixture_weights, X)
        cp = client_predictive(self.potential, mixed, X)
        if predictive_grid.moments_finite(cp):
            return mixture_prediction(self.potential.task, cp, self.mixture_weights)
        points, lp, _ = self.grid_parts(X, mixed, prior_draws=None)
        _, mean, var = predictive_grid.normalise(predictive_grid.pooled(lp, self.mixture_weights, None, 0.0),
                                                 points)
        return mean, var

    def grid_parts(self, X, draws, prior_draws):
        """``(points (G, n), client log densities there (K, G, n), prior predictive's (G, n) or None)``
        for a likelihood without finite moments (:mod:`fedprob.algorithms.predictive_grid`); warns once
        per posterior."""
        name = type(self).__name__.replace("Posterior", "")
        predictive_grid.check_grid_applies(self.potential, name)
        if not self.info.get("predictive_grid"):
            self.info["predictive_grid"] = predictive_grid.GRID_SIZE
            fn = type(self.potential.predictive_distribution(draws[0, 0], X)).__name__
            warnings.warn(
                f"{name}: the predictive of site '{self.potential.observed[0]}' ({fn}) has no finite mean or "
                "variance under some client draws (heavy tails), so the predictive is computed on a grid of "
                f"{predictive_grid.GRID_SIZE} values of y per row, between the {100 * predictive_grid.TAIL:g}% "
                f"and {100 - 100 * predictive_grid.TAIL:g}% quantiles of predictive draws widened by "
                f"{predictive_grid.PAD:g} of their range on each side: predict's mean and variance are those of the predictive "
                "restricted to that range (posterior.info['predictive_grid'])", RuntimeWarning, stacklevel=3)
        K, S, d = draws.shape
        points = predictive_grid.grid(self.potential, draws.reshape(K * S, d), predictive_grid.GRID_SIZE, X,
                                      jax.random.fold_in(self._key, 5))
        lp = predictive_grid.client_log_pdf(self.potential, draws, X, points)
        lp0 = None
        if prior_draws is not None:
            lp0 = predictive_grid.client_log_pdf(self.potential, prior_draws[None], X, points)[0]
        return points, lp, lp0

    def log_predictive_density(self, X, y, client=None):
        """(n,) ``log sum_k pi_k (1/S) sum_j p(y | x, w_kj)``: the mixture's exact log density (client
        k's own mixture over its draws for ``client=k``)."""
        y = jnp.asarray(y)
        if self.potential.task != "regression":
            y = y.astype(jnp.int32)
        mixed, own = self.predictive_draws(client)
        if own is not None:
            return _mixture_log_density_jit(self.potential, own, inputs.as_jax(X), y, 64)
        return _mixture_log_density(self.potential, mixed, self.mixture_weights, inputs.as_jax(X), y)


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

    def local_sites_refusal(self, potential):
        """None: clients send joint draws, each keeping its own local posterior (module docstring)."""
        return None

    def split_local(self, ctx: Context, result):
        """The joint result, unsplit: the server keeps each client's joint draws."""
        return result, None

    def posterior(self, ctx: Context, server_state, client_states) -> EnsemblePosterior:
        msgs, sizes, ids = self.received(server_state)
        w = client_weights(sizes, self.weighting)
        info = {"kind": "ensemble (mixture of client posteriors)", "weighting": self.weighting,
                "num_clients_combined": int(ids.size), "client_ids": ids.tolist(),
                "mixture_weights": np.asarray(w).tolist()}
        return EnsemblePosterior(ctx.potential, msgs["draws"], w, info=info)


__all__ = ["Ensemble", "EnsemblePosterior", "client_predictive", "mixture_prediction"]
