"""Expectation propagation with sampling clients (Vehtari, Gelman et al. 2020): the natural loop whose
clients moment-match draws of their tilted distributions.

Notation as in :mod:`fedprob.algorithms.natural` (Gaussians in natural
parameters ``lambda = (P m, P)`` on the **global** block ``g`` of the flat
parameter). Sites ``t_k(g) = exp(<lambda_hat_k, T(g)>)``, the global
approximation and client k's cavity::

    q_g ∝ p0(g) prod_k t_k(g),      lambda_g = lambda_0 + sum_k lambda_hat_k,
    q_-k = q_g / t_k,               lambda_-k = lambda_g - lambda_hat_k.

Client k samples its **tilted distribution** with its backend (NUTS, HMC,
SG-MCMC)::

    pi_k(g, l_k) ∝ q_-k(g) p(l_k | g) p(D_k | g, l_k),

its client-local sites ``l_k`` (``infer={"local": True}``) sampled jointly
with ``g``, their conditional prior whole (the cavity acts on ``g`` only).
It moment-matches the global block of the draws in the loop's ``family``
("full" or "diag"): ``lambda_k = (P_k m_k, P_k)``, ``m_k`` the sample mean,
``P_k`` the inverse sample covariance (:func:`fedprob.gaussian.moment_match`)
times ``(n - d - 2) / (n - 1)`` (``(n - 3) / (n - 1)`` per coordinate for
"diag"), which makes it unbiased for ``n`` independent Gaussian draws
(Vehtari et al. Sec. 5; ``n`` the number of draws). Without it every site
would carry the inverse-covariance bias ``(d + 2) / n`` of the *whole*
tilted precision, and K sites would add K times that to ``lambda_g`` (5% too
precise at K = 8, n = 500). The new site is the tilted Gaussian over the
cavity, moved with damping ``d_k``::

    lambda_hat_k <- (1 - d_k) lambda_hat_k + d_k (lambda_k - lambda_-k)
                  = lambda_hat_k + d_k (lambda_k - lambda_g),

which is the natural loop's site update with ``lambda_k`` the tilted
Gaussian (PVI's rule, ``rho = alpha = 1``): the server is
:meth:`NaturalLoop.server_update` (``lambda_g = lambda_0 + sum_k
lambda_hat_k``). With a Gaussian client backend (Laplace, SVI, IVON, VON)
``EP`` *is* PVI (:class:`~fedprob.algorithms.pvi.PVI`, the same loop and
the same numbers). Each client keeps the conditional ``l_k | g`` of its local
sites regressed on its joint draws (:func:`fedprob.local_sites.conditional_from_draws`),
and after the last round one more pass re-takes it against the final ``q_g``
(:meth:`EP.refresh_local`); the posterior's local posteriors are those
conditionals averaged over ``q_g``.

Positive definiteness (Vehtari et al. Sec. 5). EP sites may have negative
precision (a tilted distribution wider than its cavity: non-log-concave
likelihoods, or Monte Carlo noise on a client that says little about a
direction); what must stay positive definite is ``q_g`` and the cavities.

* **The global.** The clients of a round move together:
  ``lambda_g' = lambda_g + sum_k d_k s_k Delta_k`` with ``Delta_k`` the
  client's site change ``lambda_k - lambda_g`` and ``s_k`` a step scale. With
  ``G = sum_j d_j`` over all K clients (1 for ``damping="clients"`` or
  ``"size"``, ``K d`` for a number ``d``) this is the convex combination
  ``(1 - sum_k d_k / G) lambda_g + sum_k (d_k / G) (lambda_g + G s_k Delta_k)``,
  so ``lambda_g'`` is positive definite whenever every participant's
  ``lambda_g + G s_k Delta_k`` is. Each client checks that for
  ``s_k = 1, 1/2, 1/4, ...`` and takes the first that holds (the step is
  halved); ``lambda_g + Delta_k`` is the tilted Gaussian itself, so
  ``s_k <= 1/G`` always holds and the halving stops after
  ``ceil(log2 G)`` steps; at the default damping (1/K) it never halves. A
  client that finds no such step (non-finite arithmetic) skips the round.
  Reported per round as ``client_step_scale`` (the mean ``s_k``).
* **The cavity.** A cavity that is not positive definite (possible when other
  sites are negative) is no distribution to sample: the client skips the
  round (its site and local conditional unchanged, a zero update), reported
  per round as ``client_cavity_not_pd`` (the fraction of clients that
  skipped); the sampler then runs on ``q_g`` and its draws are discarded.
* **Clipping** (``positive_sites=True``): the new site's precision
  ``P_k - P_-k`` has its negative eigenvalues (diagonal: entries) raised to
  0, and its linear term set so that the cavity times the clipped site keeps
  the tilted mean ``m_k``. Every cavity is then at least the prior and every
  global at least the prior; the price is a ``q_g`` too narrow where a
  likelihood is truly not log-concave. Reported as ``client_sites_clipped``.
* A client whose draws give non-finite moments (a diverging chain) sends a
  non-finite update: the engine leaves it out of the aggregate and reports it
  (``excluded``), and its state is not changed.

``result.posterior.info["negative_sites"]`` lists the clients whose final
site has a negative precision eigenvalue, ``info["min_site_eigenvalue"]`` the
smallest (relative to the prior's precision).

Rounds: as for PVI (:meth:`NaturalLoop.rounds_for`): on a conjugate model a
damped site holds ``1 - (1 - d)^R`` of its client's likelihood after R
rounds, and the default runs until 99% (35 rounds for 8 clients at damping
1/8, at most 100). Damping also averages the Monte Carlo noise of the
moments over about ``(2 - d) / d`` rounds: a site's precision is a difference
of two precisions each the size of ``lambda_g``, so one round's noise is
large (about ``sqrt(2 K / n)`` of ``lambda_g`` at ``d = 1``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from .. import gaussian as gauss
from .. import local_sites as loc
from ..inference import NUTS
from ..posteriors import Gaussian
from ..potential import make_target
from ..protocols import DRAW_STATS, ClientBackend, finite_flag, run_chains
from .aliases import resolve_family, take_alias
from .base import Context
from .messages import draws_ess
from .natural import Configured, NaturalClient, NaturalLoop, NaturalServer, _check_positive
from .pvi import PVI

Array = jax.Array

#: diagnostics of a sampling backend that EP passes on (scalars; per-draw statistics are dropped)
_SAMPLER_DIAGNOSTICS = ("accept_prob", "num_divergences", "step_size", "num_steps", "tree_depth", "ess",
                        "grad_norm")


def unbiased_precision(g: Gaussian, num_draws) -> Gaussian:
    """A moment-matched Gaussian with its precision scaled to be unbiased for ``num_draws``
    independent Gaussian draws: ``(n - d - 2) / (n - 1)`` (full; Wishart), ``(n - 3) / (n - 1)``
    (diagonal: each coordinate alone); the mean is kept. ``num_draws`` may be traced (an
    effective sample size, :func:`variance_ess`)."""
    d = 1 if g.is_diag else g.dim
    n = jnp.maximum(jnp.asarray(num_draws, g.linear.dtype), d + 3.0)
    c = (n - d - 2.0) / (n - 1.0)
    return Gaussian(c * g.linear, c * g.precision)


def variance_ess(draws: Array) -> Array:
    """The effective number of draws behind a sample covariance of (S, d) draws: the mean over
    coordinates of the effective sample size of the squared centred draws (at most S)."""
    c = draws - jnp.mean(draws, 0)
    ess = draws_ess(c * c)
    return jnp.minimum(jnp.mean(ess), draws.shape[0])


def _is_pd(precision: Array) -> Array:
    """True when a (diagonal or full) precision is finite and positive definite."""
    if precision.ndim == 1:
        return jnp.all(precision > 0) & jnp.all(jnp.isfinite(precision))
    ok = jnp.all(jnp.isfinite(precision))
    P = jnp.where(ok, 0.5 * (precision + precision.T), jnp.eye(precision.shape[0], dtype=precision.dtype))
    return ok & jnp.all(jnp.isfinite(jnp.linalg.cholesky(P)))


def clip_site(site: Gaussian, tilted: Gaussian, cavity: Gaussian):
    """``(site with its negative precision eigenvalues raised to 0, number raised)``; the linear term
    makes ``cavity * site`` keep the tilted mean: ``linear = (P_-k + T) m_k - cavity.linear``."""
    m = tilted.mean()
    if site.is_diag:
        T = jnp.maximum(site.precision, 0.0)
        num = jnp.sum(site.precision < 0)
        return Gaussian((cavity.precision + T) * m - cavity.linear, T), num
    a, V = jnp.linalg.eigh(0.5 * (site.precision + site.precision.T))
    T = (V * jnp.maximum(a, 0.0)) @ V.T
    T = 0.5 * (T + T.T)
    return Gaussian((cavity.precision + T) @ m - cavity.linear, T), jnp.sum(a < 0)


def step_scale(lam: Gaussian, delta: Gaussian, total_damping: float, num_halvings: int) -> Array:
    """The largest ``s`` in ``1, 1/2, ..., 2^-num_halvings`` with ``lam + total_damping * s * delta``
    positive definite (precision; module docstring), 0 when none is."""
    scales = 0.5 ** jnp.arange(num_halvings + 1, dtype=lam.precision.dtype)
    ok = jax.vmap(lambda s: _is_pd(lam.precision + total_damping * s * delta.precision)
                  & finite_flag(delta))(scales)
    first = jnp.argmax(ok)
    return jnp.where(jnp.any(ok), scales[first], 0.0)


@dataclasses.dataclass(frozen=True)
class TiltedLoop(NaturalLoop):
    """The natural loop with sampling clients that moment-match their tilted distributions (module
    docstring); what :class:`EP` runs with a sampling backend. ``rho``, ``alpha`` and ``tau`` are 1.

    client: a sampling backend (NUTS, HMC, SG-MCMC); family: "full" or "diag"; damping: as in
    :class:`NaturalLoop`; positive_sites: clip the sites' negative precision eigenvalues at 0;
    jitter: added to each sample covariance, relative to its mean variance.
    """

    positive_sites: bool = False
    jitter: float = 1e-6

    def _validate(self):
        take_alias(self, "damping", "gamma", 1.0)
        if self.family not in ("full", "diag"):
            raise ValueError(f"EP: family must be 'full' or 'diag', got {self.family!r}")
        if not isinstance(self.client, ClientBackend) or getattr(self.client, "output", None) != "samples":
            raise ValueError("TiltedLoop needs a sampling client backend (NUTS, HMC, SG-MCMC)")
        if self.damping not in ("size", "clients"):
            if isinstance(self.damping, str) or not 0.0 < float(self.damping) <= 1.0:
                raise ValueError(f"damping must lie in (0, 1], or be 'size' or 'clients', got {self.damping!r}")
        if (self.rho, self.alpha, self.tau) != (1.0, 1.0, 1.0):
            raise ValueError("EP's loop has rho = alpha = tau = 1")
        _check_positive("delta", self.delta, allow_none=True)
        if not self.jitter >= 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if self.prediction not in ("average", "mean"):
            raise ValueError(f"prediction must be 'average' or 'mean', got {self.prediction!r}")
        if int(self.num_predictive_draws) < 1:
            raise ValueError(f"num_predictive_draws must be >= 1, got {self.num_predictive_draws}")

    # -- configuration ---------------------------------------------------------------------
    @property
    def backend(self):
        return self.client

    def joint_backend(self, potential):
        return self.client

    def local_sites_refusal(self, potential):
        """None: the clients sample their global and local sites jointly."""
        return None

    def local_step_count(self, ctx: Context, data):
        """None: a sampler's truncated run has no tilted moments to send (a straggler is discarded)."""
        return None

    def total_damping(self, ctx: Context) -> float:
        """``G = sum_k d_k`` over all K clients (module docstring)."""
        sizes = np.asarray(ctx.client_sizes, np.float64)
        g = np.broadcast_to(np.asarray(self._gamma(ctx.num_clients, float(sizes.sum()), sizes), np.float64),
                            sizes.shape)
        return float(np.sum(g))

    def num_halvings(self, ctx: Context) -> int:
        """Halvings tried: enough to reach ``s <= 1 / G`` (always positive definite), plus 2."""
        return max(int(math.ceil(math.log2(max(self.total_damping(ctx), 1.0)))), 0) + 2

    # -- the client ------------------------------------------------------------------------
    def sample_tilted(self, ctx: Context, server: NaturalServer, cavity: Gaussian, data, key,
                      local: Optional[loc.LocalConditional] = None):
        """``(tilted Gaussian of the global block, local conditional or None, diagnostics)``: the
        backend's draws of ``q_-k(g) p(l_k | g) p(D_k | g, l_k)`` (the chain starts at the server's
        start point, the local block at the client's conditional mean)."""
        pot = ctx.potential
        dt = server.lam.linear.dtype
        term = loc.embed_global(cavity, ctx.dim)
        target = make_target(data, ctx.dim, prior_weight=0.0, likelihood_weight=1.0, linear=term.linear,
                             precision=term.precision, dtype=dt)
        start = server.start if local is None else jnp.concatenate([server.start, local.mean.astype(dt)])
        res = run_chains(self.client, key, pot, target, start.astype(dt))
        draws = res.posterior.draws
        draws = draws.reshape((-1, draws.shape[-1])).astype(dt)
        dg = pot.dim_global
        fit = gauss.moment_match(draws[:, :dg], self.family == "diag", float(self.jitter), name="EP")
        fit = unbiased_precision(fit, variance_ess(draws[:, :dg]))
        cond = None if local is None else loc.conditional_from_draws(draws, dg)
        diag = {k: v for k, v in res.diagnostics.items() if k in _SAMPLER_DIAGNOSTICS and k != DRAW_STATS}
        return _as_family(fit, self.family), cond, diag

    def client_update(self, ctx: Context, server_state: NaturalServer, client_state, data, key, max_steps=None):
        local = client_state.local if isinstance(client_state, NaturalClient) else None
        site = client_state.site if local is not None else client_state
        lam = server_state.lam
        cavity = Gaussian(lam.linear - site.linear, lam.precision - site.precision)
        cav_ok = _is_pd(cavity.precision) & finite_flag(cavity)
        safe = jax.tree_util.tree_map(lambda a, b: jnp.where(cav_ok, a, b), cavity, lam)
        tilted, cond, diag = self.sample_tilted(ctx, server_state, safe, data, key, local)
        new_site = Gaussian(tilted.linear - safe.linear, tilted.precision - safe.precision)
        clipped = jnp.zeros((), lam.linear.dtype)
        if self.positive_sites:
            new_site, num = clip_site(new_site, tilted, safe)
            clipped = num.astype(lam.linear.dtype)
        delta = Gaussian(new_site.linear - site.linear, new_site.precision - site.precision)
        s = step_scale(lam, delta, self.total_damping(ctx), self.num_halvings(ctx))
        # a non-finite delta stays non-finite (the engine leaves the client out); a skipped one is zero
        s = jnp.where(finite_flag(delta), s, 1.0)
        s = jnp.where(cav_ok, s, 0.0)
        delta = jax.tree_util.tree_map(lambda a: jnp.where(cav_ok, s * a, 0.0), delta)
        g = self.gamma_value(ctx, data.n)
        updated = Gaussian(site.linear + g * delta.linear, site.precision + g * delta.precision)
        diag = {**diag, "step_scale": s, "cavity_not_pd": (~cav_ok).astype(lam.linear.dtype),
                "sites_clipped": clipped}
        mode = tilted.mean()
        if local is not None:
            cond = jax.tree_util.tree_map(lambda a, b: jnp.where(cav_ok, a, b), cond, local)
            return NaturalClient(updated, cond), (delta, mode), diag
        return updated, (delta, mode), diag

    def refresh_local(self, ctx: Context, server_state: NaturalServer, client_state, data, key):
        """One more draw of the client's tilted distribution against the final ``q_g`` (its site
        unchanged); the local conditional is regressed on those draws. A client whose cavity is not
        positive definite or whose draws are not finite keeps its previous conditional."""
        site, local = client_state.site, client_state.local
        lam = server_state.lam
        cavity = Gaussian(lam.linear - site.linear, lam.precision - site.precision)
        cav_ok = _is_pd(cavity.precision) & finite_flag(cavity)
        safe = jax.tree_util.tree_map(lambda a, b: jnp.where(cav_ok, a, b), cavity, lam)
        _, cond, _ = self.sample_tilted(ctx, server_state, safe, data, key, local)
        ok = cav_ok & finite_flag(cond)
        cond = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), cond, local)
        return NaturalClient(site, cond), ok

    # -- the answer --------------------------------------------------------------------------
    def posterior(self, ctx: Context, server_state: NaturalServer, client_states):
        post = super().posterior(ctx, server_state, client_states)
        sites = client_states.site if isinstance(client_states, NaturalClient) else client_states
        P0 = server_state.prior.precision
        P = np.asarray(sites.precision, np.float64)
        if P.ndim == 2:                          # diagonal sites (K, d): relative to the prior's
            rel = P / np.asarray(P0, np.float64)
            low = rel.min(1)
        else:                                    # full (K, d, d): prior-whitened eigenvalues
            L = np.linalg.cholesky(np.asarray(P0, np.float64))
            Li = np.linalg.inv(L)
            low = np.array([np.linalg.eigvalsh(Li @ (0.5 * (p + p.T)) @ Li.T).min() for p in P])
        neg = np.flatnonzero(low < 0)
        post.info.update({"kind": f"{self.family} Gaussian (EP, tilted moments of sampling clients)",
                          "negative_sites": neg.tolist(),
                          "min_site_eigenvalue": float(low.min()) if low.size else float("nan")})
        if isinstance(client_states, NaturalClient):
            post.info["local_posterior"] = (
                "each client's local sites given the global ones, regressed on its joint draws of its "
                "tilted distribution (against the final global posterior), averaged over that posterior")
        return post


def _as_family(g: Gaussian, family: str) -> Gaussian:
    return g.to_full() if family == "full" else g.to_diag()


#: fields that only a sampling client uses, with their defaults
_SAMPLING_ONLY = {"positive_sites": False, "jitter": 1e-6}


@dataclasses.dataclass(frozen=True)
class EP(Configured):
    """Expectation propagation (module docstring): each client samples its tilted distribution and
    moment-matches it; Gaussian clients make it PVI.

    client: the backend; a sampler (NUTS, HMC, SGLD, SGHMC, ...; None: ``NUTS()``) gives EP with
    tilted moments, a Gaussian backend (Laplace, SVI, IVON, VON) gives :class:`PVI` with the same
    damping and family. damping: the site step in (0, 1], ``"clients"`` (1/K, the default: the
    global stays positive definite without halving, and the Monte Carlo noise of the moments is
    averaged over rounds) or ``"size"`` (N_k / N). family: ``"full"`` or ``"diag"`` (None: ``"full"``
    for samplers, the backend's own for Gaussian clients). delta: prior precision override
    (``N(0, I/delta)``; None: the model's prior). positive_sites: clip negative site precisions at 0
    (sampling clients). jitter: added to the tilted sample covariances, relative to their mean
    variance (sampling clients). prediction / num_predictive_draws: as for PVI.
    """

    client: Any = None
    damping: Union[float, str] = "clients"
    family: Optional[str] = None
    delta: Optional[float] = None
    positive_sites: bool = False
    jitter: float = 1e-6
    prediction: str = "average"
    num_predictive_draws: int = 32

    def __post_init__(self):
        if self.client is not None and not isinstance(self.client, ClientBackend):
            raise TypeError(f"client must be a fedprob.inference backend, got {type(self.client).__name__}")
        if isinstance(self.damping, str):
            if self.damping not in ("clients", "size"):
                raise ValueError(f"damping must lie in (0, 1], or be 'clients' or 'size', got {self.damping!r}")
        elif not 0.0 < float(self.damping) <= 1.0:
            raise ValueError(f"damping must lie in (0, 1], got {self.damping!r}")
        if self.sampling:
            resolve_family(self, "full")
        else:
            resolve_family(self, "diag")
            for name, default in _SAMPLING_ONLY.items():
                if getattr(self, name) != default:
                    raise ValueError(f"EP: {name} applies to sampling clients; with "
                                     f"{type(self.client).__name__} clients EP is PVI")
        self.loop()

    @property
    def sampling(self) -> bool:
        """True for a sampling client (EP with tilted moments), False for a Gaussian one (PVI)."""
        return self.client is None or getattr(self.client, "output", "samples") == "samples"

    def loop(self) -> NaturalLoop:
        if not self.sampling:
            return PVI(client=self.client, damping=self.damping, family=self.family, delta=self.delta,
                       prediction=self.prediction, num_predictive_draws=self.num_predictive_draws).loop()
        return TiltedLoop(client=NUTS() if self.client is None else self.client, family=self.family,
                          damping=self.damping, delta=self.delta, prediction=self.prediction,
                          num_predictive_draws=self.num_predictive_draws, positive_sites=bool(self.positive_sites),
                          jitter=float(self.jitter))


__all__ = ["EP", "TiltedLoop", "unbiased_precision", "variance_ess", "clip_site", "step_scale"]
