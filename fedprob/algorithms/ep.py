"""Expectation propagation with sampling clients (Vehtari, Gelman et al. 2020): the natural loop whose
clients moment-match their tilted distributions from a sampler's draws.

Notation as in :mod:`fedprob.algorithms.natural` (Gaussians in natural
parameters ``lambda = (P m, P)`` on the **global** block ``g`` of the flat
parameter). Sites ``t_k(g) = exp(<lambda_hat_k, T(g)>)``, the global
approximation and client k's cavity::

    q_g ∝ p0(g) prod_k t_k(g),      lambda_g = lambda_0 + sum_k lambda_hat_k,
    q_-k = q_g / t_k,               lambda_-k = lambda_g - lambda_hat_k.

Client k samples its **tilted distribution** with its backend (NUTS, HMC,
SG-MCMC)::

    pi_k(g, l_k) ∝ q_-k(g) h_k(g, l_k),     h_k = p(l_k | g) p(D_k | g, l_k),

its client-local sites ``l_k`` (``infer={"local": True}``) sampled jointly
with ``g``, their conditional prior whole (the cavity acts on ``g`` only),
and forms ``lambda_k``, the Gaussian with the tilted distribution's moments
of ``g`` in the loop's ``family`` ("full" or "diag"). The new site is that
Gaussian over the cavity, moved with the step ``d_k``::

    lambda_hat_k <- (1 - d_k) lambda_hat_k + d_k (lambda_k - lambda_-k)
                  = lambda_hat_k + d_k (lambda_k - lambda_g),

the natural loop's site update with ``lambda_k`` the tilted Gaussian (PVI's
rule, ``rho = alpha = 1``); the client sends its increment and the server is
:meth:`NaturalLoop.server_update` (``lambda_g = lambda_0 + sum_k
lambda_hat_k``). With a Gaussian client backend (Laplace, SVI, IVON, VON)
``EP`` *is* PVI (:class:`~fedprob.algorithms.pvi.PVI`: the same loop, the
same numbers).

Tilted moments (``moments``). A site is a *difference* of two precisions,
each the size of ``lambda_g`` when K is large: estimated from the draws'
sample covariance (``moments="sample"``) its Monte Carlo error is that of
the whole tilted precision, about ``sqrt(2 / n)`` of ``lambda_g`` per site for
n effective draws, and K sites add it up (and its bias K times: 5% too
precise at K = 8, n = 500, before the correction below). The default,
``moments="stein"``, uses the client's gradients of ``log h_k`` at its draws
``x = (g, l)``. For any density ``p``, ``E_p[grad log p(x) (x - m)'] = -I``
(integration by parts), and ``grad log pi_k = (-P_-k (g - m_-k), 0) +
grad log h_k``; so the least-squares regression ``grad log h_k ~ nu - Lam x``
over the draws gives ``Lam = Cov(x)^-1 - diag(P_-k, 0)``: the tilted
distribution's moment-matched joint Gaussian is ``N(g; cavity) exp(nu' x -
x' Lam x / 2)`` exactly, at the population level, for any ``h_k``. The site is
its global marginal over the cavity (the Schur complement of ``Lam`` on the
local block, :func:`stein_site`), and the client's local conditional
``l_k | g`` is its conditional. The estimate has no Monte Carlo error at all
when ``h_k`` is Gaussian (conjugate models: EP with NUTS clients is exact to
float precision on the normal-normal hierarchy and on linear regression),
and otherwise its error scales with the site, not with ``lambda_g``: on a
Poisson client with a local site, 4000 NUTS draws gave the site precision
within 1.5% of quadrature where the sample covariance was 9-14% off. It
costs one gradient of the client's log density per draw (minibatched with
the backend's ``batch_size``). The "diag" family regresses per global
coordinate (``T_i = -Cov(d_i log h, g_i) / Var(g_i)``: the same identity for
the global block alone, O(S d)) and regresses the local conditional on the
draws (:func:`fedprob.local_sites.conditional_from_draws`). ``"sample"``
multiplies the inverse sample covariance by ``(n - d - 2) / (n - 1)``
(``(n - 3) / (n - 1)`` per coordinate for "diag"), unbiased for n
independent Gaussian draws (Vehtari et al. Sec. 5), n the effective sample
size of the squared centred draws (:func:`variance_ess`).

Steps (``damping``, ``average``). With ``average=True`` (the default) client
k's n-th accepted update steps by ``max(d_k, 1/n)``: its first site is its
tilted Gaussian over its cavity (in the first round, against the prior: the
parametric EPMCMC product), and its next ones average its estimates until
the step reaches the damping ``d_k`` (PVI's ``"auto"`` by default: 1/K up
to 22 clients, 0.045 above), which then averages the Monte Carlo noise of
the last ~``2 / d_k`` rounds and forgets older cavities. With ``average=False`` every step is ``d_k``, as in PVI.

Positive definiteness (Vehtari et al. Sec. 5). EP sites may have negative
precision (a tilted distribution wider than its cavity: non-log-concave
likelihoods, or Monte Carlo noise on a client that says little about a
direction); what must stay positive definite is ``q_g`` and the cavities.

* **The global.** The clients of a round move together:
  ``lambda_g' = lambda_g + sum_k g_k s_k Delta_k`` with ``Delta_k`` the
  client's site change ``lambda_k - lambda_g``, ``g_k`` its step and ``s_k``
  a step scale. Writing it as a convex combination,
  ``(1 - sum_k w_k) lambda_g + sum_k w_k (lambda_g + F_k s_k Delta_k)`` with
  ``w_k = 1/K, F_k = K g_k`` (averaging steps) or ``w_k = d_k / G,
  F_k = G = sum_j d_j`` over all K clients (fixed steps: ``G = 1`` for
  ``damping="clients"`` or ``"size"``), ``lambda_g'`` is positive definite
  whenever every participant's ``lambda_g + F_k s_k Delta_k`` is. Each client
  tests that for ``s_k = 1, 1/2, 1/4, ...`` and takes the first that holds
  (the step is halved); ``lambda_g + Delta_k`` is the tilted Gaussian itself,
  so it holds once ``F_k s_k <= 1``, after at most ``ceil(log2 K)`` halvings.
  A client that finds no such step skips the round. Reported per round as
  ``client_step_scale`` (the mean ``s_k``) and ``client_step`` (the mean
  ``g_k s_k``).
* **The cavity.** A cavity that is not positive definite (possible when other
  sites are negative) is no distribution to sample: the client skips the
  round (site and local conditional unchanged, a zero update), reported per
  round as ``client_cavity_not_pd`` (the fraction of clients that skipped);
  its sampler runs on ``q_g`` instead and the draws are discarded.
* **Clipping** (``positive_sites=True``): the new site's precision has its
  negative eigenvalues (diagonal: entries) raised to 0, and its linear term
  set so that the cavity times the clipped site keeps the tilted mean. Every
  cavity and the global are then at least the prior; the price is a ``q_g``
  too narrow where a likelihood is truly not log-concave. Reported as
  ``client_sites_clipped``.
* A client whose draws give non-finite moments (a diverging chain) sends a
  non-finite update: the engine leaves it out of the aggregate and reports it
  (``excluded``), and its state is not changed.

``result.posterior.info["negative_sites"]`` lists the clients whose final
site has a negative precision eigenvalue, ``info["min_site_eigenvalue"]`` the
smallest (in the prior-whitened basis).

Local posteriors: each client keeps the conditional ``l_k | g`` of its last
tilted distribution (:class:`EPClient`); after the last round one more pass
re-takes it against the final ``q_g`` (:meth:`TiltedLoop.refresh_local`), and
the posterior's local posteriors are those conditionals averaged over ``q_g``
(``local_mean``, ``local_sd``, ``sample_local``, ``predict(X, client=k)``).

Rounds: as for PVI (:meth:`NaturalLoop.rounds_for` on the damping ``d_k``):
``ceil((K / M) log 0.01 / log(1 - min_k d_k))``, 10 to 100 (35 for 8 clients
at 1/8). Each round costs one sampler run per client (vmapped), plus S
gradients for the Stein moments.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from .. import gaussian as gauss
from .. import local_sites as loc
from ..inference import NUTS
from ..posteriors import Gaussian
from ..potential import make_target
from ..protocols import ClientBackend, finite_flag, run_chains
from .aliases import resolve_family, take_alias
from .base import Context
from .messages import draws_ess
from .natural import Configured, NaturalClient, NaturalLoop, NaturalServer, _check_positive
from .pvi import PVI
from .stein import is_positive_definite, stein_regression

Array = jax.Array

#: how a client estimates its tilted moments (module docstring)
MOMENTS = ("stein", "sample")

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


def stein_site(x: Array, grads: Array, dim_global: int, diag: bool, jitter: float = 1e-6):
    """``(site on the global block, LocalConditional or None)`` of a tilted distribution
    ``N(g; cavity) h(g, l)`` from its draws ``x = (g, l)`` (S, d) and the gradients ``grads`` (S, d)
    of ``log h`` at them (module docstring, "Tilted moments").

    Full: the least-squares regression ``grad log h ~ nu - Lam x``, ``Lam = -Cov(grad, x) Cov(x)^-1``
    (symmetrized), ``nu = mean(grad) + Lam mean(x)``. By the identity ``E_p[grad log p (x - m)'] = -I``
    the moment-matched joint Gaussian of the tilted is ``N(x; cavity) exp(nu' x - x' Lam x / 2)``;
    the site is its global marginal over the cavity (Schur complement of ``Lam`` on the local block)
    and the local conditional is its ``l | g``. Exact (no Monte Carlo error) when ``h`` is Gaussian.
    Diag: per global coordinate, ``T_i = -Cov(grad_i, g_i) / Var(g_i)``, ``nu_i = mean(grad_i) +
    T_i mean(g_i)`` (Stein's identity for the global block,
    ``Cov(g) = C + C Cov(grad_g log h, g)`` with C the cavity covariance), the local conditional
    regressed on the draws. ``jitter`` (relative to each coordinate's variance) keeps ``Cov(x)``
    invertible."""
    S, d = x.shape
    dg = dim_global
    if diag:
        nu, T = stein_regression(x[:, :dg], grads[:, :dg], True, jitter)
        cond = None if d == dg else loc.conditional_from_draws(x, dg)
        return Gaussian(nu, T), cond
    nu, Lam = stein_regression(x, grads, False, jitter)
    mx = jnp.mean(x, 0)
    if d == dg:
        return Gaussian(nu, Lam), None
    L_gg, L_gl, L_ll = Lam[:dg, :dg], Lam[:dg, dg:], Lam[dg:, dg:]
    chol = jnp.linalg.cholesky(L_ll)
    solve = lambda b: jax.scipy.linalg.cho_solve((chol, True), b)      # noqa: E731
    cov = solve(jnp.eye(d - dg, dtype=x.dtype))
    slope = -solve(L_gl.T)                                               # -Lam_ll^-1 Lam_lg
    w = solve(nu[dg:])
    site = Gaussian(nu[:dg] - L_gl @ w, 0.5 * (L_gg + L_gl @ slope + (L_gg + L_gl @ slope).T))
    anchor = mx[:dg]
    cond = loc.LocalConditional(anchor, w + slope @ anchor, slope, 0.5 * (cov + cov.T))
    return site, cond


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


def step_scale(lam: Gaussian, delta: Gaussian, factor, num_halvings: int) -> Array:
    """The largest ``s`` in ``1, 1/2, ..., 2^-num_halvings`` with ``lam + factor * s * delta``
    positive definite (precision; module docstring), 0 when none is."""
    scales = 0.5 ** jnp.arange(num_halvings + 1, dtype=lam.precision.dtype)
    ok = jax.vmap(lambda s: is_positive_definite(lam.precision + factor * s * delta.precision)
                  & finite_flag(delta))(scales)
    first = jnp.argmax(ok)
    return jnp.where(jnp.any(ok), scales[first], 0.0)


class EPClient(NamedTuple):
    """A client's EP state: its site on the global block, the conditional of its local sites (None
    without client-local sites) and the number of its accepted updates (for the averaging steps)."""

    site: Gaussian
    local: Optional[loc.LocalConditional]
    updates: Array


@dataclasses.dataclass(frozen=True)
class TiltedLoop(NaturalLoop):
    """The natural loop with sampling clients that moment-match their tilted distributions (module
    docstring); what :class:`EP` runs with a sampling backend. ``rho``, ``alpha`` and ``tau`` are 1.

    client: a sampling backend (NUTS, HMC, SG-MCMC); family: "full" or "diag"; damping: the step
    floor, as in :class:`NaturalLoop`; average: a client's n-th update steps by
    ``max(damping, 1/n)``; positive_sites: clip the sites' negative precision eigenvalues at 0;
    jitter: added to each sample covariance, relative to its mean variance.
    """

    average: bool = True
    moments: str = "stein"
    positive_sites: bool = False
    jitter: float = 1e-6

    def _validate(self):
        take_alias(self, "damping", "gamma", 1.0)
        if self.family not in ("full", "diag"):
            raise ValueError(f"EP: family must be 'full' or 'diag', got {self.family!r}")
        if not isinstance(self.client, ClientBackend) or getattr(self.client, "output", None) != "samples":
            raise ValueError("TiltedLoop needs a sampling client backend (NUTS, HMC, SG-MCMC)")
        if self.damping not in ("size", "clients", "auto"):
            if isinstance(self.damping, str) or not 0.0 < float(self.damping) <= 1.0:
                raise ValueError(f"damping must lie in (0, 1], or be 'size', 'clients' or 'auto', got "
                                 f"{self.damping!r}")
        if (self.rho, self.alpha, self.tau) != (1.0, 1.0, 1.0):
            raise ValueError("EP's loop has rho = alpha = tau = 1")
        _check_positive("delta", self.delta, allow_none=True)
        if not self.jitter >= 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if self.moments not in MOMENTS:
            raise ValueError(f"moments must be one of {MOMENTS}, got {self.moments!r}")
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

    def step(self, ctx: Context, n, updates):
        """Client k's site step: ``d_k`` (the damping), or ``max(d_k, 1 / (updates + 1))`` when averaging."""
        g = self.gamma_value(ctx, n)
        if self.average:
            g = jnp.maximum(g, 1.0 / (jnp.asarray(updates, g.dtype) + 1.0))
        return g

    def pd_factor(self, ctx: Context, g):
        """``F`` of the halving test ``lambda_g + F s Delta_k`` positive definite (module docstring):
        ``G = sum_k d_k`` for a fixed damping, ``K g_k`` when averaging (steps differ per client)."""
        if self.average:
            return ctx.num_clients * g
        sizes = np.asarray(ctx.client_sizes, np.float64)
        d = np.broadcast_to(np.asarray(self._gamma(ctx.num_clients, float(sizes.sum()), sizes), np.float64),
                            sizes.shape)
        return jnp.asarray(float(np.sum(d)), g.dtype)

    def num_halvings(self, ctx: Context) -> int:
        """Halvings tried: enough to reach ``F s <= 1`` (always positive definite; ``F <= K``), plus 2."""
        return max(int(math.ceil(math.log2(max(ctx.num_clients, 1)))), 0) + 2

    # -- the client ------------------------------------------------------------------------
    def init(self, ctx: Context, key, data):
        server, clients = super().init(ctx, key, data)
        K = ctx.num_clients
        counts = jnp.zeros((K,), server.lam.linear.dtype)
        if isinstance(clients, NaturalClient):
            return server, EPClient(clients.site, clients.local, counts)
        return server, EPClient(clients, None, counts)

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
        diag_family = self.family == "diag"
        if self.moments == "stein":
            h = make_target(data, ctx.dim, prior_weight=0.0, likelihood_weight=1.0, dtype=dt)
            batch = getattr(self.client, "batch_size", None)
            keys = jax.random.split(jax.random.fold_in(key, 7), draws.shape[0])
            grads = jax.vmap(lambda z, k: jax.grad(pot.log_density)(z, h, k, batch))(draws, keys)
            site, cond = stein_site(draws, grads.astype(dt), dg, diag_family, float(self.jitter))
            c = _as_family(cavity, self.family)
            fit = Gaussian(c.linear + site.linear, c.precision + site.precision)
        else:
            fit = gauss.moment_match(draws[:, :dg], diag_family, float(self.jitter), name="EP")
            fit = unbiased_precision(fit, variance_ess(draws[:, :dg]))
            cond = None if local is None else loc.conditional_from_draws(draws, dg)
        diag = {k: v for k, v in res.diagnostics.items() if k in _SAMPLER_DIAGNOSTICS}
        return _as_family(fit, self.family), cond, diag

    def client_update(self, ctx: Context, server_state: NaturalServer, client_state: EPClient, data, key,
                      max_steps=None):
        site, local = client_state.site, client_state.local
        lam = server_state.lam
        dt = lam.linear.dtype
        cavity = Gaussian(lam.linear - site.linear, lam.precision - site.precision)
        cav_ok = is_positive_definite(cavity.precision) & finite_flag(cavity)
        safe = jax.tree_util.tree_map(lambda a, b: jnp.where(cav_ok, a, b), cavity, lam)
        tilted, cond, diag = self.sample_tilted(ctx, server_state, safe, data, key, local)
        new_site = Gaussian(tilted.linear - safe.linear, tilted.precision - safe.precision)
        clipped = jnp.zeros((), dt)
        if self.positive_sites:
            new_site, num = clip_site(new_site, tilted, safe)
            clipped = num.astype(dt)
        delta = Gaussian(new_site.linear - site.linear, new_site.precision - site.precision)
        g = self.step(ctx, data.n, client_state.updates)
        s = step_scale(lam, delta, self.pd_factor(ctx, g), self.num_halvings(ctx))
        # a non-finite delta stays non-finite (the engine leaves the client out); a skipped one is zero
        s = jnp.where(finite_flag(delta), s, 1.0)
        s = jnp.where(cav_ok, s, 0.0)
        sent = jax.tree_util.tree_map(lambda a: jnp.where(cav_ok, g * s * a, 0.0), delta)
        updated = Gaussian(site.linear + sent.linear, site.precision + sent.precision)
        diag = {**diag, "step_scale": s, "step": g * s, "cavity_not_pd": (~cav_ok).astype(dt),
                "sites_clipped": clipped}
        if local is not None:
            cond = jax.tree_util.tree_map(lambda a, b: jnp.where(cav_ok, a, b), cond, local)
        count = client_state.updates + cav_ok.astype(dt)
        return EPClient(updated, cond, count), (sent, tilted.mean()), diag

    def server_update(self, ctx: Context, server_state: NaturalServer, messages, weights, mask):
        """The natural loop's server (PVI: ``lambda_g = lambda_0 + sum_k lambda_hat_k``) on the site
        increments the clients sent, already scaled by their steps."""
        unit = dataclasses.replace(self, damping=1.0)
        return NaturalLoop.server_update(unit, ctx, server_state, messages, weights, mask)

    def update_part(self, ctx: Context, message):
        """The site increment a client sends (its step applied: no client size at the server)."""
        return message[0]

    def refresh_local(self, ctx: Context, server_state: NaturalServer, client_state: EPClient, data, key):
        """One more draw of the client's tilted distribution against the final ``q_g`` (its site
        unchanged); the local conditional is regressed on those draws. A client whose cavity is not
        positive definite or whose draws are not finite keeps its previous conditional."""
        site, local = client_state.site, client_state.local
        lam = server_state.lam
        cavity = Gaussian(lam.linear - site.linear, lam.precision - site.precision)
        cav_ok = is_positive_definite(cavity.precision) & finite_flag(cavity)
        safe = jax.tree_util.tree_map(lambda a, b: jnp.where(cav_ok, a, b), cavity, lam)
        _, cond, _ = self.sample_tilted(ctx, server_state, safe, data, key, local)
        ok = cav_ok & finite_flag(cond)
        cond = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), cond, local)
        return client_state._replace(local=cond), ok

    def gaussian_fits(self, ctx: Context, server_state: NaturalServer, client_states: EPClient, data):
        return super().gaussian_fits(ctx, server_state, client_states.site, data)

    # -- the answer --------------------------------------------------------------------------
    def posterior(self, ctx: Context, server_state: NaturalServer, client_states: EPClient):
        local = client_states.local
        post = super().posterior(ctx, server_state, client_states.site if local is None
                                 else NaturalClient(client_states.site, local))
        P0 = server_state.prior.precision
        P = np.asarray(client_states.site.precision, np.float64)
        if P.ndim == 2:                          # diagonal sites (K, d): relative to the prior's
            low = (P / np.asarray(P0, np.float64)).min(1)
        else:                                    # full (K, d, d): prior-whitened eigenvalues
            Li = np.linalg.inv(np.linalg.cholesky(np.asarray(P0, np.float64)))
            low = np.array([np.linalg.eigvalsh(Li @ (0.5 * (p + p.T)) @ Li.T).min() for p in P])
        post.info.update({"kind": f"{self.family} Gaussian (EP, tilted moments of sampling clients)",
                          "negative_sites": np.flatnonzero(low < 0).tolist(),
                          "min_site_eigenvalue": float(low.min()) if low.size else float("nan")})
        if local is not None:
            post.info["local_posterior"] = (
                "each client's local sites given the global ones, regressed on its joint draws of its "
                "tilted distribution (against the final global posterior), averaged over that posterior")
        return post


def _as_family(g: Gaussian, family: str) -> Gaussian:
    return g.to_full() if family == "full" else g.to_diag()


#: fields that only a sampling client uses, with their defaults
_SAMPLING_ONLY = {"positive_sites": False, "jitter": 1e-6, "moments": "stein"}


@dataclasses.dataclass(frozen=True)
class EP(Configured):
    """Expectation propagation (module docstring): each client samples its tilted distribution and
    moment-matches it; Gaussian clients make it PVI.

    client: the backend; a sampler (NUTS, HMC, SGLD, SGHMC, ...; None: ``NUTS()``) gives EP with
    tilted moments, a Gaussian backend (Laplace, SVI, IVON, VON) gives :class:`PVI` with the same
    damping and family. damping: the site step (its floor when averaging) in (0, 1], ``"auto"``
    (the default, as PVI's: 1/K up to 22 clients, 0.045 above, so the default rounds converge),
    ``"clients"`` (1/K: after the first steps the global stays positive definite without halving,
    and the Monte Carlo noise of the moments is averaged over rounds) or ``"size"`` (N_k / N).
    family: ``"full"`` or ``"diag"`` (None: ``"full"`` for samplers, the backend's own for Gaussian
    clients). delta: prior precision override (``N(0, I/delta)``; None: the model's prior).
    Sampling clients only: average: a client's n-th update steps by ``max(damping, 1/n)`` (True,
    the default) or by ``damping`` (False, as PVI); moments: ``"stein"`` (the default: regression
    of the log-likelihood gradients on the draws) or ``"sample"`` (sample covariances);
    positive_sites: clip negative site precisions at 0; jitter: added to the draws' covariances,
    relative to each coordinate's (``"stein"``) or their mean (``"sample"``) variance.
    prediction / num_predictive_draws: as for PVI.
    """

    client: Any = None
    damping: Union[float, str] = "auto"
    family: Optional[str] = None
    delta: Optional[float] = None
    average: bool = True
    moments: str = "stein"
    positive_sites: bool = False
    jitter: float = 1e-6
    prediction: str = "average"
    num_predictive_draws: int = 32

    def __post_init__(self):
        if self.client is not None and not isinstance(self.client, ClientBackend):
            raise TypeError(f"client must be a fedprob.inference backend, got {type(self.client).__name__}")
        if isinstance(self.damping, str):
            if self.damping not in ("clients", "size", "auto"):
                raise ValueError(f"damping must lie in (0, 1], or be 'clients', 'size' or 'auto', got "
                                 f"{self.damping!r}")
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
                          num_predictive_draws=self.num_predictive_draws, average=bool(self.average),
                          moments=self.moments,
                          positive_sites=bool(self.positive_sites),
                          jitter=float(self.jitter))


__all__ = ["EP", "EPClient", "TiltedLoop", "MOMENTS", "stein_site", "unbiased_precision", "variance_ess", "clip_site",
           "step_scale"]
