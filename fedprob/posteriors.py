"""The two posterior forms shared by every backend and algorithm, and the global posterior.

* :class:`Samples`: draws of the flat unconstrained parameter, shape
  ``(..., S, d)`` (a leading client axis when stacked over clients).
* :class:`Gaussian`: natural parameters ``linear = P m`` and ``precision = P``,
  with ``P`` either diagonal (shape ``(..., d)``) or full (``(..., d, d)``).
  A product of Gaussians adds natural parameters.

Both are pytrees (they pass through ``jit``/``vmap``/``scan``). A Gaussian can
be sampled and samples can be moment-matched (:func:`fedprob.gaussian.moment_match`,
with shrinkage), so algorithms accept either; all other Gaussian algebra
(products over clients, the prior's Gaussian, KL) is in :mod:`fedprob.gaussian`.
:class:`GlobalPosterior` is the user-facing object an algorithm returns;
:class:`LocalConditional` is a client's posterior of its client-local sites
given the global ones (the algebra around it: :mod:`fedprob.local_sites`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Samples:
    """Posterior draws of the flat unconstrained parameter, shape (..., S, d)."""

    draws: Array

    @property
    def num_draws(self) -> int:
        return self.draws.shape[-2]

    def mean(self) -> Array:
        return jnp.mean(self.draws, axis=-2)

    def covariance(self) -> Array:
        """Sample covariance (divisor S - 1), shape (..., d, d)."""
        c = self.draws - self.mean()[..., None, :]
        s = max(self.num_draws - 1, 1)
        return jnp.einsum("...si,...sj->...ij", c, c) / s

    def variance(self) -> Array:
        """Marginal sample variances (divisor S - 1), shape (..., d)."""
        return jnp.var(self.draws, axis=-2, ddof=1 if self.num_draws > 1 else 0)

    def sample(self, key, n: int) -> Array:
        """n draws resampled uniformly (with replacement) from the stored ones, (n, d)."""
        flat = self.draws.reshape(-1, self.draws.shape[-1])
        idx = jax.random.randint(key, (n,), 0, flat.shape[0])
        return flat[idx]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gaussian:
    """N(m, P^-1) in natural parameters: ``linear = P m``, ``precision = P``.

    ``precision`` has the shape of ``linear`` (diagonal) or one more trailing
    axis (full).
    """

    linear: Array
    precision: Array

    @property
    def is_diag(self) -> bool:
        return self.precision.ndim == self.linear.ndim

    @property
    def dim(self) -> int:
        return self.linear.shape[-1]

    @classmethod
    def from_moments(cls, mean, cov) -> "Gaussian":
        """From a mean and a covariance (vector of variances for a diagonal one)."""
        mean = jnp.asarray(mean)
        cov = jnp.asarray(cov)
        if cov.ndim == mean.ndim:
            prec = 1.0 / cov
            return cls(prec * mean, prec)
        prec = jnp.linalg.inv(cov)
        prec = 0.5 * (prec + jnp.swapaxes(prec, -1, -2))
        return cls(jnp.einsum("...ij,...j->...i", prec, mean), prec)

    def mean(self) -> Array:
        if self.is_diag:
            return self.linear / self.precision
        return jnp.linalg.solve(self.precision, self.linear[..., None])[..., 0]

    def covariance(self) -> Array:
        if self.is_diag:
            return (1.0 / self.precision)[..., None] * jnp.eye(self.dim, dtype=self.precision.dtype)
        return jnp.linalg.inv(self.precision)

    def variance(self) -> Array:
        if self.is_diag:
            return 1.0 / self.precision
        return jnp.diagonal(jnp.linalg.inv(self.precision), axis1=-2, axis2=-1)

    def to_full(self) -> "Gaussian":
        if not self.is_diag:
            return self
        eye = jnp.eye(self.dim, dtype=self.precision.dtype)
        return Gaussian(self.linear, self.precision[..., :, None] * eye)

    def to_diag(self) -> "Gaussian":
        """Diagonal Gaussian with the same marginal variances and mean."""
        if self.is_diag:
            return self
        return Gaussian.from_moments(self.mean(), self.variance())

    def __mul__(self, other: "Gaussian") -> "Gaussian":
        """Product of densities: natural parameters add."""
        a, b = (self, other) if self.is_diag == other.is_diag else (self.to_full(), other.to_full())
        return Gaussian(a.linear + b.linear, a.precision + b.precision)

    def __truediv__(self, other: "Gaussian") -> "Gaussian":
        a, b = (self, other) if self.is_diag == other.is_diag else (self.to_full(), other.to_full())
        return Gaussian(a.linear - b.linear, a.precision - b.precision)

    def power(self, t) -> "Gaussian":
        return Gaussian(self.linear * t, self.precision * t)

    def sample(self, key, n: int) -> Array:
        """(n, d) draws (unbatched Gaussian)."""
        eps = jax.random.normal(key, (n, self.dim), dtype=self.linear.dtype)
        m = self.mean()
        if self.is_diag:
            return m + eps / jnp.sqrt(self.precision)
        L = jnp.linalg.cholesky(self.precision)
        # x = m + L^-T eps has covariance (L L^T)^-1 = P^-1.
        return m + jax.scipy.linalg.solve_triangular(L, eps.T, lower=True, trans=1).T

    def log_prob(self, x) -> Array:
        m = self.mean()
        r = x - m
        d = self.dim
        if self.is_diag:
            quad = jnp.sum(self.precision * r * r, -1)
            logdet = jnp.sum(jnp.log(self.precision), -1)
        else:
            quad = jnp.einsum("...i,ij,...j->...", r, self.precision, r)
            logdet = jnp.linalg.slogdet(self.precision)[1]
        return 0.5 * (logdet - quad - d * jnp.log(2 * jnp.pi))


class LocalConditional(NamedTuple):
    """``l | g ~ N(mean + slope (g - anchor), cov)``: one client's local block given the global one
    (a leading client axis when stacked). anchor (d_g,), mean (d_l,), slope (d_l, d_g), cov (d_l, d_l)."""

    anchor: Array
    mean: Array
    slope: Array
    cov: Array


class LocalPoint(NamedTuple):
    """Each client's local block as a point, ``values`` (K, d_l): the local sites of a point estimate
    (FedAvg, FedProx keep them on their clients); no spread, no dependence on the global draw."""

    values: Array


def local_marginal(cond: LocalConditional, g_mean: Array, g_cov: Array):
    """``(mean, cov)`` of ``l`` when ``g ~ N(g_mean, g_cov)`` (batched over a leading client axis of
    ``cond``); ``g_cov`` is (d_g, d_g)."""
    shift = jnp.einsum("...ij,...j->...i", cond.slope, g_mean - cond.anchor)
    spread = jnp.einsum("...ij,jk,...lk->...il", cond.slope, g_cov, cond.slope)
    return cond.mean + shift, _symmetric(cond.cov + spread)


def sample_local(cond: LocalConditional, g: Array, key) -> Array:
    """Draws of ``l | g`` for draws ``g`` (S, d_g) under ONE client's conditional: (S, d_l)."""
    L = jnp.linalg.cholesky(cond.cov + 1e-12 * jnp.eye(cond.cov.shape[0], dtype=cond.cov.dtype))
    eps = jax.random.normal(key, (g.shape[0], cond.mean.shape[0]), cond.mean.dtype)
    return cond.mean + (g - cond.anchor) @ cond.slope.T + eps @ L.T


def _symmetric(a):
    return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def average_predictions(potential, draws: Array, X, chunk: int = 64):
    """Bayesian model average of the per-draw predictive over draws (S, d).

    Classification: (n, C) probabilities, the mean of per-draw probabilities.
    Regression: (mean, variance), the mixture's moments (law of total variance).
    """
    draws = jnp.atleast_2d(draws)
    if potential.task == "classification":
        logp = jax.lax.map(lambda z: potential.predict(z, X), draws, batch_size=chunk)  # (S, n, C)
        return jnp.exp(logsumexp(logp, axis=0) - jnp.log(draws.shape[0]))
    means, variances = jax.lax.map(lambda z: potential.predict(z, X), draws, batch_size=chunk)
    mean = jnp.mean(means, 0)
    var = jnp.mean(variances + means ** 2, 0) - mean ** 2
    return mean, var


_average_predictions_jit = jax.jit(average_predictions, static_argnums=(0, 3))
_constrain_all_jit = jax.jit(lambda potential, z: jax.vmap(potential.constrain_all)(z), static_argnums=0)


def mixture_log_density(potential, draws: Array, X, y, chunk: int = 64) -> Array:
    """(n,) ``log (1/S) sum_s p(y_i | x_i, w_s)``: the log density of the draws' predictive mixture.

    Exact for any likelihood (classification, regression, counts; a masked one is scored
    unmasked, :meth:`Potential.predictive_log_likelihood`); unlike a
    Gaussian fitted to the mixture's mean and variance it keeps multimodal
    and heavy-tailed predictives. Computed per draw in log space (logsumexp),
    streamed over the draws in chunks of ``chunk``.
    """
    draws = jnp.atleast_2d(draws)
    ll = jax.lax.map(lambda z: potential.predictive_log_likelihood(z, X, y), draws, batch_size=chunk)
    return logsumexp(ll, axis=0) - jnp.log(draws.shape[0])


_mixture_log_density_jit = jax.jit(mixture_log_density, static_argnums=(0, 4))


class GlobalPosterior:
    """The server's answer: a posterior over the model's parameters.

    ``form`` is :class:`Samples` (draws, ``(S, d)``) or :class:`Gaussian`
    (unbatched). ``mean`` is a dict of constrained sites: for samples, the
    mean of the constrained draws; for a Gaussian, the constrained image of
    its mean (exact for unconstrained sites); ``mean`` and ``sample`` also
    carry the model's ``numpyro.deterministic`` sites outside the data plate,
    computed from the same values. ``predict(X)`` is the
    posterior predictive: class probabilities (n, C), or a tuple (mean,
    variance) with observation noise included. A Gaussian is averaged over
    ``num_predictive_draws`` draws. ``log_predictive_density(X, y)`` is the
    exact log density of that same average (a mixture over draws), not of a
    Gaussian fitted to its mean and variance.

    ``prediction`` sets what ``predict`` and ``log_predictive_density`` do by
    default: ``"average"`` (the Bayesian model average above) or ``"mean"``
    (the plug-in predictive at the mean of the flat parameter); both methods
    also take it per call.

    Models with client-local sites (``infer={"local": True}``): ``form`` is the
    posterior of the global block (``potential.dim_global`` coordinates) and
    ``local`` the clients' conditionals ``l_k | g``
    (:class:`LocalConditional`, leading client axis K), or their points
    (:class:`LocalPoint`, a point estimate's: ``local_sd`` is then 0).
    ``mean``, ``sd`` and ``sample`` cover the global sites;
    ``local_mean[site]`` / ``local_sd[site]`` have a leading client axis (each
    client's local posterior: its conditional averaged over the global
    posterior), ``sample_local(key, n)`` gives (n, K, ...) draws, and
    ``predict(X, client=k)`` is client k's predictive (global draws with its
    local sites drawn from its conditional given each); ``client=None`` (the
    default) is a new client's, its local sites drawn from their conditional
    prior given each global draw.
    """

    def __init__(self, potential, form, *, num_predictive_draws: int = 100, seed: int = 0,
                 info: Optional[dict] = None, prediction: str = "average", local=None):
        if prediction not in ("average", "mean"):
            raise ValueError(f"prediction must be 'average' or 'mean', got {prediction!r}")
        self.potential = potential
        self.form = form
        self.local = local
        self.num_predictive_draws = num_predictive_draws
        self.prediction = prediction
        self._key = jax.random.PRNGKey(seed)
        self.info = dict(info or {})

    # -- parameters ------------------------------------------------------------------------
    @property
    def has_local_sites(self) -> bool:
        return bool(getattr(self.potential, "local_sites", ()))

    def _with_zero_local(self, zg: Array) -> Array:
        """Global draws (..., d_g) padded with zeros on the local block (global sites never read it)."""
        pad = jnp.zeros(zg.shape[:-1] + (self.potential.dim_local,), zg.dtype)
        return jnp.concatenate([zg, pad], -1)

    def _global_sites(self, zg: Array) -> dict:
        vals = jax.vmap(self.potential.constrain)(self._with_zero_local(jnp.atleast_2d(zg)))
        return {n: vals[n] for n in self.potential.global_sites}

    @property
    def mean(self) -> dict:
        if self.has_local_sites:
            if isinstance(self.form, Gaussian):
                return {k: v[0] for k, v in self._global_sites(self.form.mean()).items()}
            return {k: jnp.mean(v, 0) for k, v in self._global_sites(self._flat_draws()).items()}
        if isinstance(self.form, Gaussian):
            return self.potential.constrain_all(self.form.mean())
        vals = jax.vmap(self.potential.constrain_all)(self.form.draws)
        return {k: jnp.mean(v, 0) for k, v in vals.items()}

    @property
    def sd(self) -> dict:
        """dict site -> posterior sd of the constrained site, beside :attr:`mean`: exact for a Gaussian's
        real-support sites, from draws otherwise; NaN for a point estimate (:func:`fedprob.summary.site_sd`)."""
        from .summary import site_sd

        if self.has_local_sites:
            if isinstance(self.form, Samples) and self._flat_draws().shape[0] == 1:     # a point estimate
                return {k: jnp.full(jnp.shape(v), jnp.nan) for k, v in self.mean.items()}
            vals = self._global_sites(self.flat_sample(jax.random.PRNGKey(0), 4000))
            return {k: jnp.std(v, 0, ddof=1) for k, v in vals.items()}
        return site_sd(self)

    def summary(self, prob: float = 0.94, chains: Optional[int] = None, num_draws: int = 4000, seed: int = 0):
        """A table like ``az.summary``: mean, sd, the equal-tailed ``prob`` interval, bulk/tail ESS and
        R-hat where there are chains of draws, per site and coordinate (:mod:`fedprob.summary`; with
        client-local sites, one row per client and coordinate after the global sites)."""
        from .summary import summary

        return summary(self, chains=chains, num_draws=num_draws, seed=seed, prob=prob)

    @property
    def flat_mean(self) -> Array:
        """Mean of the flat unconstrained parameter (of the global block, with client-local sites)."""
        return self.form.mean()

    def flat_sample(self, key, n: int) -> Array:
        """(n, d) unconstrained draws."""
        return self.form.sample(key, n)

    def sample(self, key, n: int) -> dict:
        """dict site -> (n, ...) constrained draws (deterministic sites outside the data plate included;
        the global sites alone for a model with client-local sites)."""
        if self.has_local_sites:
            return self._global_sites(self.flat_sample(key, n))
        return jax.vmap(self.potential.constrain_all)(self.flat_sample(key, n))

    def _flat_draws(self) -> Array:
        return self.form.draws.reshape(-1, self.form.draws.shape[-1])

    # -- client-local sites ----------------------------------------------------------------
    def _check_local(self):
        if not self.has_local_sites or self.local is None:
            raise ValueError("this posterior has no client-local sites (a model declares them with "
                             "numpyro.sample(name, d, infer={'local': True}))")

    @property
    def num_local_clients(self) -> int:
        """K: the clients whose local posteriors this posterior holds."""
        self._check_local()
        return int(jax.tree_util.tree_leaves(self.local)[0].shape[0])

    def _global_moments(self):
        if isinstance(self.form, Gaussian):
            return self.form.mean(), self.form.to_full().covariance()
        draws = self._flat_draws()
        m = jnp.mean(draws, 0)
        c = draws - m
        return m, c.T @ c / max(draws.shape[0] - 1, 1)

    def local_moments(self):
        """``(mean (K, d_l), cov (K, d_l, d_l))``: each client's local block in unconstrained space
        (a zero covariance for :class:`LocalPoint` values)."""
        self._check_local()
        if isinstance(self.local, LocalPoint):
            v = self.local.values
            return v, jnp.zeros(v.shape + v.shape[-1:], v.dtype)
        m, c = self._global_moments()
        return local_marginal(self.local, m, c)

    def _local_mean_var(self):
        """``(mean, variance)`` (K, d_l) of each client's local block, unconstrained."""
        self._check_local()
        if isinstance(self.local, LocalPoint):
            return self.local.values, jnp.zeros_like(self.local.values)
        mean, cov = self.local_moments()
        return mean, jnp.diagonal(cov, axis1=-2, axis2=-1)

    def _local_sites(self, zl: Array) -> dict:
        """Local blocks (..., d_l) -> dict of constrained local sites (global sites at the mean)."""
        zg = jnp.broadcast_to(self.flat_mean, zl.shape[:-1] + (self.potential.dim_global,))
        z = jnp.concatenate([zg, zl], -1)
        flat = z.reshape(-1, z.shape[-1])
        vals = jax.vmap(self.potential.constrain)(flat)
        return {n: vals[n].reshape(zl.shape[:-1] + vals[n].shape[1:]) for n in self.potential.local_sites}

    @property
    def local_mean(self) -> dict:
        """site -> (K, ...): each client's local posterior mean, the constrained image of the
        unconstrained mean (exact for real-support sites, like :attr:`mean` of a Gaussian)."""
        return self._local_sites(self._local_mean_var()[0])

    @property
    def local_sd(self) -> dict:
        """site -> (K, ...): each client's local posterior sd (exact for real-support sites; from 4000
        draws of :meth:`sample_local` otherwise; 0 for :class:`LocalPoint` values, a point estimate)."""
        mean, var = self._local_mean_var()
        sd = jnp.sqrt(var)
        real = np.asarray(self.potential._real_mask[self.potential.dim_global:])
        out, draws = {}, None
        K = mean.shape[0]
        for site in self.potential.sites:
            if site.name not in self.potential.local_sites:
                continue
            if isinstance(self.local, LocalPoint):
                out[site.name] = jnp.zeros((K,) + tuple(site.shape), mean.dtype)
                continue
            sl = slice(site.offset - self.potential.dim_global, site.offset - self.potential.dim_global + site.size)
            if bool(np.all(real[sl])) and tuple(site.shape) == tuple(site.unconstrained_shape):
                out[site.name] = sd[:, sl].reshape((-1,) + tuple(site.shape))
            else:
                draws = self.sample_local(jax.random.PRNGKey(0), 4000) if draws is None else draws
                out[site.name] = jnp.std(draws[site.name], 0, ddof=1)
        return out

    def _local_draws(self, key, zg: Array) -> Array:
        """(K, S, d_l) local blocks drawn for each client given global draws zg (S, d_g)."""
        if isinstance(self.local, LocalPoint):
            v = self.local.values
            return jnp.broadcast_to(v[:, None, :], (v.shape[0], zg.shape[0], v.shape[1]))
        K = self.local.mean.shape[0]
        return jax.vmap(lambda c, k: sample_local(c, zg, k))(self.local, jax.random.split(key, K))

    def sample_local(self, key, n: int) -> dict:
        """site -> (n, K, ...) constrained draws of every client's local sites, each drawn jointly with
        a global draw (the same n global draws for every client)."""
        self._check_local()
        k_g, k_l = jax.random.split(key)
        zg = self.flat_sample(k_g, n)
        zl = jnp.swapaxes(self._local_draws(k_l, zg), 0, 1)     # (n, K, d_l)
        return self._local_sites_jointly(zg, zl)

    def _local_sites_jointly(self, zg: Array, zl: Array) -> dict:
        """Constrained local sites for global draws zg (n, d_g) and local blocks zl (n, K, d_l)."""
        K = zl.shape[1]
        z = jnp.concatenate([jnp.broadcast_to(zg[:, None], zl.shape[:2] + zg.shape[-1:]), zl], -1)
        vals = jax.vmap(self.potential.constrain)(z.reshape(-1, z.shape[-1]))
        return {n: vals[n].reshape((zl.shape[0], K) + vals[n].shape[1:]) for n in self.potential.local_sites}

    def joint_site_draws(self, zg, key):
        """``(values, client_sites)``: constrained draws of every site for global draws ``zg`` (..., d_g) of
        a model with client-local sites, as host arrays: a global site (..., *shape); a local site
        (..., K, *shape), each client's drawn from its local posterior given each global draw; a
        deterministic site outside the data plate with the client axis where it depends on the local
        sites, without it where it does not. ``client_sites`` names the sites with the client axis."""
        self._check_local()
        zg = np.asarray(zg)
        lead, dg = zg.shape[:-1], zg.shape[-1]
        flat = jnp.asarray(zg.reshape(-1, dg))
        zl = self._local_draws(key, flat)                                   # (K, N, d_l)
        K, N = zl.shape[:2]
        z = jnp.concatenate([jnp.broadcast_to(flat[None], (K, N, dg)), zl.astype(flat.dtype)], -1)
        vals = _constrain_all_jit(self.potential, z.reshape(K * N, -1))
        out, client_sites = {}, []
        for name, v in vals.items():
            v = np.asarray(v).reshape((K, N) + v.shape[1:])
            per_client = name in self.potential.local_sites or (
                name not in self.potential.global_sites and not np.allclose(v, v[:1], equal_nan=True))
            if per_client:
                out[name] = np.moveaxis(v, 0, 1).reshape(lead + (K,) + v.shape[2:])
                client_sites.append(name)
            else:
                out[name] = v[0].reshape(lead + v.shape[2:])
        return out, tuple(client_sites)

    def _predictive_draws(self, prediction: Optional[str] = None, client=None) -> Array:
        prediction = self.prediction if prediction is None else prediction
        if prediction not in ("average", "mean"):
            raise ValueError(f"prediction must be 'average' or 'mean', got {prediction!r}")
        if self.has_local_sites:
            return self._joint_predictive_draws(prediction, client)
        if client is not None:
            raise ValueError("client=... needs a model with client-local sites (infer={'local': True}); "
                             "this model shares every site across clients")
        if prediction == "mean":
            return self.form.mean()[None]
        if isinstance(self.form, Samples):
            return self.form.draws.reshape(-1, self.form.draws.shape[-1])
        return self.form.sample(self._key, self.num_predictive_draws)

    def _joint_predictive_draws(self, prediction: str, client) -> Array:
        """Joint draws (S, d) for client ``client``'s predictive, or a new client's (``client=None``)."""
        k_g, k_l = jax.random.split(jax.random.fold_in(self._key, 1))
        if prediction == "mean":
            zg = self.form.mean()[None]
        elif isinstance(self.form, Samples):
            zg = self._flat_draws()
        else:
            zg = self.form.sample(k_g, self.num_predictive_draws)
        if client is None:
            if zg.shape[0] == 1 and prediction == "average":     # a point: many draws of the new client's sites
                zg = jnp.broadcast_to(zg, (self.num_predictive_draws, zg.shape[1]))
            keys = jax.random.split(k_l, zg.shape[0])
            zl = jax.vmap(self.potential.sample_local_prior)(keys, zg)
            if prediction == "mean":
                raise ValueError("prediction='mean' needs client=k for a model with client-local sites: a new "
                                 "client's local sites are drawn from their prior")
            return jnp.concatenate([zg, zl], -1)
        self._check_local()
        K = self.num_local_clients
        if isinstance(client, bool) or not isinstance(client, (int, np.integer)) or not 0 <= int(client) < K:
            raise ValueError(f"client must be None (a new client) or an index in [0, {K}), got {client!r}")
        if prediction == "mean" or isinstance(self.local, LocalPoint):
            mean, _ = self._local_mean_var()
            return jnp.concatenate([zg, jnp.broadcast_to(mean[int(client)], zg.shape[:1] + mean.shape[1:])], -1)
        cond = jax.tree_util.tree_map(lambda a: a[int(client)], self.local)
        return jnp.concatenate([zg, sample_local(cond, zg, k_l)], -1)

    # -- prediction ------------------------------------------------------------------------
    def _check_inputs(self, X) -> Array:
        """X as an array of rows shaped like the training rows, all finite (else ValueError)."""
        from . import inputs

        if inputs.is_structured(X) or not isinstance(self.potential.x_shape, tuple) or (
                self.potential.x_shape and isinstance(self.potential.x_shape[0], tuple)):
            return inputs.tree_map(jnp.asarray, inputs.check_like(X, self.potential.x_shape))
        X = np.asarray(X)
        want = tuple(self.potential.x_shape)
        if X.ndim != len(want) + 1 or tuple(X.shape[1:]) != want:
            raise ValueError(f"X has shape {X.shape}; the model was fitted on rows of shape {want}, so X "
                             f"must have shape (n,) + {want}")
        if np.issubdtype(X.dtype, np.floating) and not np.all(np.isfinite(X)):
            raise ValueError(f"X contains {int(np.sum(~np.isfinite(X)))} NaN/inf value(s); predictions "
                             "need finite inputs")
        return jnp.asarray(X)

    def predict(self, X, prediction: Optional[str] = None, client=None):
        """Posterior predictive at X (class probabilities, or (mean, variance)); X is validated.

        ``prediction``: "average" (over draws) or "mean" (at the mean); default ``self.prediction``.
        ``client``: with client-local sites, the index of the client whose local posterior predicts
        (None: a new client's predictive, class docstring).
        """
        X = self._check_inputs(X)
        return _average_predictions_jit(self.potential, self._predictive_draws(prediction, client), X, 64)

    def log_predictive_density(self, X, y, prediction: Optional[str] = None, client=None) -> Array:
        """(n,) log p(y_i | x_i, D): the log of the posterior predictive averaged over draws (or at the mean)."""
        X = self._check_inputs(X)
        y = jnp.asarray(y)
        from . import inputs

        if y.shape[:1] != (inputs.num_rows(X),):
            raise ValueError(f"X has {inputs.num_rows(X)} rows and y {y.shape[0] if y.ndim else 0}")
        if self.potential.task != "regression":
            y = y.astype(jnp.int32)
        return _mixture_log_density_jit(self.potential, self._predictive_draws(prediction, client), X, y, 64)


def log_predictive_density(task: str, prediction, y) -> Array:
    """(n,) log density of targets y under a prediction from ``predict``.

    Classification: the log of the predicted probability of the label. Otherwise the
    GAUSSIAN with the predicted mean and variance: exact only for predictives that
    are Gaussian (products of Gaussian predictives); for a posterior given by draws
    use :meth:`GlobalPosterior.log_predictive_density` (the mixture's density).
    """
    y = jnp.asarray(y)
    if task == "classification":
        probs = prediction
        return jnp.log(jnp.clip(jnp.take_along_axis(probs, y[:, None].astype(jnp.int32), 1)[:, 0],
                                1e-12, None))
    mean, var = prediction
    return -0.5 * (jnp.log(2 * jnp.pi * var) + (y - mean) ** 2 / var)


__all__ = ["Samples", "Gaussian", "GlobalPosterior", "LocalConditional", "LocalPoint", "local_marginal", "sample_local", "average_predictions", "log_predictive_density",
           "mixture_log_density"]
