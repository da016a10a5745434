"""Embarrassingly parallel MCMC (Neiswanger, Wang & Xing 2014): products of client densities.

``method="parametric"`` (the default) fits a Gaussian to every client
posterior (moment-matched to its draws, or taken as is from a Gaussian client
output: SVI, Laplace, IVON) and multiplies them in natural parameters. By
default clients use the **full** prior, so the product carries K copies of it
and K-1 are divided out::

    precision = sum_k S_k - (K'-1) S_0,    linear = sum_k S_k mu_k - (K'-1) S_0 mu_0,

over the K' clients received (masked clients are left out; the result is the
posterior given the others' data). ``(S_0, S_0 mu_0)`` is the prior's Gaussian
in fedprob's flat unconstrained layout: exact for Normal priors, otherwise
moment-matched to ``num_prior_samples`` prior draws
(:func:`fedprob.gaussian.prior_gaussian`); ``info["prior_exact"]``
says which. With ``subposteriors=True`` the clients use the prior share 1/K
instead and the correction is ``(1 - K'/K)`` copies (none when all arrive).
Exact when the client posteriors are Gaussian (conjugate models).

The server **sums** (:class:`~fedprob.algorithms.one_round.SummingOneRoundAlgorithm`):
each client sends its natural parameters ``(P_k mu_k, P_k)`` and the server
keeps their masked sums and the count K' of clients received (for the prior
power), so its memory does not grow with K. A sampling client's Gaussian is
by default its Stein fit (``moments="stein"``, :mod:`fedprob.algorithms.stein`:
the gradients of its target at its draws regressed on the draws; the
moment-matched Gaussian with a control variate, exact for a Gaussian client
from any d + 1 draws, so the product's Monte Carlo error no longer grows with
how far apart the clients' posteriors lie). With ``moments="sample"`` client
Gaussians are moment-matched to draws (:func:`fedprob.gaussian.moment_match`): with fewer
than 10 d draws a full covariance has its correlations shrunk toward zero
(OAS) and a RuntimeWarning says how many draws are needed. Clients also send ``P_k Sigma_mc,k P_k``, the Monte Carlo
covariance of their mean from their per-coordinate effective sample sizes,
whose sum gives ``info["mc_error_sd_ratio"]``: the Monte Carlo sd of the
product's mean over its posterior sd (a RuntimeWarning above 0.2 names the
clients with the lowest ESS).

Guard: if the product's precision is not positive definite (noisy moment
estimates, a prior correction larger than the clients' information) a
RuntimeWarning is issued at ``posterior()`` time, ``info["fallback"]`` is set,
and every direction in which the product is less concentrated than the prior
is clipped to the prior's precision (prior-whitened eigenbasis; diagonal:
per coordinate); see :func:`fedprob.gaussian.guarded_product`.

``method="nonparametric"`` multiplies kernel density estimates of the client
sub-posteriors and samples the product by independent Metropolis-within-Gibbs
over the mixture indices (Neiswanger et al. Alg. 1), with the bandwidth
annealed as ``h_i = bandwidth * i^(-1/(4+d))`` over the ``num_samples``
iterations, every iterate kept (``sweeps`` passes over the clients' indices
per iterate; the paper makes one). ``method="semiparametric"`` uses the
Hjort-Glad estimate (Gaussian fit times a kernel correction; same sampler,
the product Gaussian steering every component). Both are asymptotically
exact, run at the server in ``posterior()`` as a ``lax.scan``, and suit small
d only: at finite sizes the kernel smoothing and the slowly mixing index
chain leave errors of a few tenths of a posterior sd (d = 2, 1000 draws per
client). Each client's kernel is shaped by its own sample covariance (kernel
covariance ``h^2 Sigma_k``; ``family="diag"``: its variances), so
``bandwidth`` is in units of that client's spread. The paper uses isotropic
kernels ``h^2 I``; both are exact as h -> 0, and shaped kernels keep the
product's mean right at finite h when the sub-posteriors differ in scale.
These variants keep every client's draws (one slot per client) and default
to sub-posteriors (prior share 1/K, as in the paper). With full-prior
clients, or clients masked out, the missing prior power ``(1 - K' s)`` enters
once: nonparametric, in each component's weight, evaluated at the component
mean (exact as h -> 0); semiparametric, in the Gaussian product that steers
the components (the prior's Gaussian, exact for Normal priors), and not
again in the weights.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from .. import gaussian as gauss
from ..posteriors import Gaussian, GlobalPosterior, Samples
from .base import Context
from .one_round import check_choice, check_int, client_gaussian_message, monte_carlo_check, result_draws
from .one_round_base import GaussianProductAlgorithm

METHODS = ("parametric", "nonparametric", "semiparametric")


@dataclasses.dataclass(frozen=True)
class EPMCMC(GaussianProductAlgorithm):
    """Embarrassingly parallel MCMC (see the module docstring).

    client: the backend (default NUTS); family: ``"full"`` or ``"diag"``
    Gaussians (diag for large d; alias ``covariance``; None, the default: the
    backend's own, ``"full"`` for samplers); method: ``"parametric"``,
    ``"nonparametric"`` or ``"semiparametric"``; num_samples: draws of the
    (non/semi)parametric server sampler, and draws taken from a Gaussian
    client output where draws are needed; subposteriors: clients use the prior
    share 1/K (default: False for parametric, True otherwise); bandwidth:
    initial kernel bandwidth, in units of each client's spread; sweeps:
    Metropolis passes over the clients' mixture indices per server draw (1 in
    the paper; more mix better); jitter: added to sample covariances, relative
    to their mean variance; num_prior_samples: prior draws for moment matching
    a non-Gaussian prior
    (:class:`~fedprob.algorithms.one_round_base.GaussianProductAlgorithm`).
    """

    method: str = "parametric"
    subposteriors: Optional[bool] = None
    bandwidth: float = 1.0
    sweeps: int = 5

    def __post_init__(self):
        super().__post_init__()
        check_choice("method", self.method, METHODS)
        check_int("sweeps", self.sweeps)
        if self.subposteriors not in (None, True, False):
            raise ValueError(f"subposteriors must be None, True or False, got {self.subposteriors!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, got {self.bandwidth}")

    @property
    def uses_subposteriors(self) -> bool:
        return self.method != "parametric" if self.subposteriors is None else bool(self.subposteriors)

    def prior_weight(self, ctx: Context) -> float:
        return 1.0 / ctx.num_clients if self.uses_subposteriors else 1.0

    def sums_messages(self) -> bool:
        """The parametric product sums natural parameters; the kernel variants keep draws."""
        return self.method == "parametric"

    def make_message(self, ctx, result, key, fit=None):
        if self.method == "parametric":
            return client_gaussian_message(result, self.family == "diag", self.jitter, "EPMCMC", fit)
        return {"draws": result_draws(result, key, self.num_samples)}

    def check_message(self, ctx, shapes):
        if self.method != "parametric" and shapes["draws"].shape[0] < 2:
            raise ValueError(f"EPMCMC(method={self.method!r}) needs at least 2 draws per client, the "
                             f"client backend returns {shapes['draws'].shape[0]}")

    def local_sites_refusal(self, potential):
        if self.method != "parametric":
            return (f"EPMCMC(method={self.method!r}) does not take client-local sites yet "
                    "(method='parametric' does)")
        return super().local_sites_refusal(potential)

    def prior_power(self, ctx: Context, num_received: int) -> float:
        """Exponent of the prior that completes the product: ``1 - K' s``."""
        power = 1.0 - num_received * self.prior_weight(ctx)
        return 0.0 if abs(power) < 1e-9 else power

    def posterior(self, ctx: Context, server_state, client_states) -> GlobalPosterior:
        if self.method == "parametric":
            sums, ids, ess = self.counted(server_state)
        else:
            msgs, _, ids = self.received(server_state)
        Kp = int(ids.size)
        diag = self.family == "diag"
        power = self.prior_power(ctx, Kp)
        k_prior, k_chain = jax.random.split(server_state.key)
        g0, exact = self.prior_of(ctx, k_prior, diag)
        info = {"kind": f"ep-mcmc ({self.method})", "family": self.family,
                "num_clients_combined": Kp, "client_ids": ids.tolist(), "prior_power": power,
                "prior_exact": bool(exact), "subposteriors": self.uses_subposteriors}
        if self.method == "parametric":
            g, ginfo = gauss.guarded_product(Gaussian(sums["linear"], sums["precision"]), g0, power,
                                             name="EPMCMC", stacked=False)
            info.update(ginfo)
            info.update(monte_carlo_check("EPMCMC", g.precision, sums["mc"], ids, ess))
            info["moments"] = self.moments
            info["stein_fallbacks"] = int(round(float(sums["stein_fallbacks"])))
            info.update(self.diag_bias_info("EPMCMC", sums, sums["precision"], g0.power(power), Kp))
            return GlobalPosterior(ctx.potential, g, info=self.local_info(info, client_states),
                                   local=self.local_of(client_states))
        draws, cinfo = kde_product_sample(
            k_chain, msgs["draws"], num_samples=self.num_samples, bandwidth=self.bandwidth,
            semiparametric=self.method == "semiparametric", diag=diag, jitter=self.jitter,
            log_prior=ctx.potential.log_prior if power != 0 else None, prior_power=power,
            prior=g0, sweeps=self.sweeps)
        info.update(cinfo)
        return GlobalPosterior(ctx.potential, Samples(draws), info=info)


# -- the product of kernel density estimates ----------------------------------------------------------

@partial(jax.jit, static_argnums=(1, 2))
def _prepare(draws, diag: bool, jitter: float):
    """Coordinates and per-draw terms of the kernel product.

    Client k's kernel has precision ``Lambda_k / h^2``, ``Lambda_k`` the
    inverse of its sample covariance (diagonal for ``diag``; full: shrunk
    when draws are few, :func:`fedprob.gaussian.sample_covariance`). The draws are
    mapped to ``u = L^-1 (w - center)`` with ``L L' = K (sum_k Lambda_k)^-1``,
    where the kernel precisions sum to ``K I``. Returns center, L, u, the
    per-draw ``a = Lambda_k u`` and ``b = u' Lambda_k u``, the clients'
    Gaussian fits in u and each draw's log density under its fit.
    """
    K, S, d = draws.shape
    center = jnp.mean(draws, (0, 1))
    eye = jnp.eye(d, dtype=draws.dtype)
    if diag:
        cov = jnp.var(draws, 1, ddof=1)[:, :, None] * eye
    else:
        gauss.warn_few_draws(S, d, "EPMCMC (kernel shapes)", stacklevel=4)
        cov = gauss.sample_covariance(draws)
    eps = jitter * jnp.mean(jnp.diagonal(cov, axis1=1, axis2=2), 1) + 1e-30
    cov = cov + eps[:, None, None] * eye
    lam_k = jnp.linalg.inv(cov)
    lam_k = 0.5 * (lam_k + jnp.swapaxes(lam_k, 1, 2))
    C = jnp.linalg.cholesky(jnp.linalg.inv(jnp.sum(lam_k, 0)))
    L = jnp.sqrt(K) * C
    Linv = jax.scipy.linalg.solve_triangular(L, eye, lower=True)
    u = (draws - center) @ Linv.T
    lam_u = jnp.einsum("ji,kjl,lm->kim", L, lam_k, L)                  # L' Lambda_k L
    a = jnp.einsum("kij,ksj->ksi", lam_u, u)
    b = jnp.sum(u * a, -1)
    fits = jax.vmap(lambda x: _fit(x, diag, jitter))(u)
    logf = jax.vmap(lambda g, x: jax.vmap(g.log_prob)(x))(fits, u)       # (K, S)
    return center, L, u, a, b, fits, logf


@jax.jit
def _eig_cov(g: Gaussian):
    cov = jnp.linalg.inv(g.precision)
    lam, V = jnp.linalg.eigh(0.5 * (cov + cov.T))
    return g.mean(), jnp.maximum(lam, 1e-12 * jnp.max(lam)), V


def kde_product_sample(key, draws, num_samples: int, bandwidth: float = 1.0, semiparametric: bool = False,
                       diag: bool = False, jitter: float = 1e-6, log_prior=None, prior_power: float = 0.0,
                       prior: Optional[Gaussian] = None, sweeps: int = 1):
    """Draws from the product of the clients' (semi)parametric density estimates.

    ``draws``: (K, S, d) client draws. Neiswanger et al. (2014) Alg. 1:
    ``num_samples`` iterations; in iteration i the bandwidth is
    ``h = bandwidth * i^(-1/(4+d))``, each client's mixture index is updated
    in turn by an independent Metropolis proposal (uniform over its draws;
    ``sweeps`` passes over the clients per iteration, 1 in the paper), then
    one draw is taken from the selected product component. Works in
    coordinates whitened by the clients' mean sample covariance (diagonal:
    mean variances), with isotropic kernels there. ``log_prior`` (a function
    of the flat parameter) with ``prior_power`` multiplies each component
    weight by ``p0(component mean)^prior_power`` (nonparametric); in the
    semiparametric variant ``prior`` (a Gaussian in the original coordinates)
    enters the Gaussian product with that power instead and ``log_prior`` is
    used only when ``prior`` is None: the prior power is counted once. Returns
    ((num_samples, d) draws, info).
    """
    draws = jnp.asarray(draws)
    K, S, d = draws.shape
    center, L, u, a, b, fits, logf = _prepare(draws, bool(diag), float(jitter))
    info = {"bandwidth_final": float(bandwidth * num_samples ** (-1.0 / (4.0 + d)))}
    if semiparametric:
        if prior is None:
            prior_u = Gaussian(jnp.zeros((d,), u.dtype), 1e-6 * jnp.eye(d, dtype=u.dtype))
        else:
            pf = prior.to_full()
            prior_u = Gaussian(L.T @ (pf.linear - pf.precision @ center), L.T @ pf.precision @ L)
        gM, ginfo = gauss.guarded_product(fits, prior_u, prior_power, name="EPMCMC(semiparametric)")
        info.update({"gaussian_" + k: v for k, v in ginfo.items()})
        semi = (logf,) + _eig_cov(gM)
    else:
        semi = (jnp.zeros((K, S), u.dtype), jnp.zeros((d,), u.dtype), jnp.ones((d,), u.dtype),
                jnp.eye(d, dtype=u.dtype))
    # semiparametric: the prior's Gaussian is already in the product gM that steers every component
    use_prior = log_prior is not None and prior_power != 0 and not (semiparametric and prior is not None)
    x, acc = _mwg_chain(key, a, b, semi, jnp.asarray(bool(semiparametric)), center, L,
                        jnp.asarray(prior_power, u.dtype), log_prior if use_prior else None,
                        int(num_samples), float(bandwidth), int(sweeps))
    info["acceptance_rate"] = float(acc)
    return center + x @ L.T, info


def _fit(x, diag, jitter):
    return gauss.moment_match(x, diag, jitter, warn=False)


@partial(jax.jit, static_argnums=(8, 9, 10, 11))
def _mwg_chain(key, a, b, semi, is_semi, center, L, power, log_prior, num_iter: int, bandwidth: float,
               sweeps: int):
    """Independent Metropolis-within-Gibbs over mixture indices (coordinates u of :func:`_prepare`).

    With the selected draws u_k, ``r = sum_k Lambda_k u_k`` and ``q = sum_k
    u_k' Lambda_k u_k`` (``sum_k Lambda_k = K I``), the product component has
    mean ``ubar = r / K``, covariance ``h^2 I / K`` and log weight
    ``-(q - |r|^2 / K) / (2 h^2)`` (+ the prior and semiparametric terms).
    One compiled chain serves both variants: ``is_semi`` (traced) switches the
    semiparametric terms on (``semi`` holds dummies otherwise).
    """
    K, S, d = a.shape
    dtype = a.dtype
    logf, muM, lam, V = semi
    expo = -1.0 / (4.0 + d)
    rows = jnp.arange(K)

    def log_weight(r, q, lfs, h2):
        ubar = r / K
        lw = -(q - jnp.sum(r * r) / K) / (2.0 * h2)
        if log_prior is not None:
            lw = lw + power * log_prior(center + L @ ubar)
        z = V.T @ (ubar - muM)
        return lw + jnp.where(is_semi, -lfs - 0.5 * jnp.sum(z * z / (lam + h2 / K)), 0.0)

    def totals(t):
        return jnp.sum(a[rows, t], 0), jnp.sum(b[rows, t]), jnp.sum(logf[rows, t])

    k0, kc = jax.random.split(key)
    t0 = jax.random.randint(k0, (K,), 0, S)

    def outer(t, xs):
        i, key_i = xs
        h2 = (bandwidth * i.astype(dtype) ** expo) ** 2
        k_sweep, k_draw = jax.random.split(key_i)
        r, q, lfs = totals(t)          # recomputed every iteration: no drift

        def inner(c, xs):
            t, r, q, lfs, lw = c
            k, kk = xs
            ka, kb = jax.random.split(kk)
            cand = jax.random.randint(ka, (), 0, S)
            old = t[k]
            r2 = r - a[k, old] + a[k, cand]
            q2 = q - b[k, old] + b[k, cand]
            lfs2 = lfs - logf[k, old] + logf[k, cand]
            lw2 = log_weight(r2, q2, lfs2, h2)
            ok = jnp.log(jax.random.uniform(kb, dtype=dtype)) < lw2 - lw
            pick = lambda new, cur: jnp.where(ok, new, cur)  # noqa: E731
            return (t.at[k].set(pick(cand, old)), pick(r2, r), pick(q2, q), pick(lfs2, lfs), pick(lw2, lw)), ok

        def sweep(c, kk):
            c, oks = jax.lax.scan(inner, c, (rows, jax.random.split(kk, K)))
            return c, jnp.mean(oks.astype(dtype))

        (t, r, _, _, _), acc = jax.lax.scan(sweep, (t, r, q, lfs, log_weight(r, q, lfs, h2)),
                                            jax.random.split(k_sweep, sweeps))
        eps = jax.random.normal(k_draw, (d,), dtype)
        ubar = r / K
        prec = K / h2 + 1.0 / lam
        m = (K / h2 * (V.T @ ubar) + (V.T @ muM) / lam) / prec
        x_semi = V @ (m + eps / jnp.sqrt(prec))
        x = jnp.where(is_semi, x_semi, ubar + jnp.sqrt(h2 / K) * eps)
        return t, (x, jnp.mean(acc))

    _, (xs, acc) = jax.lax.scan(outer, t0, (jnp.arange(1, num_iter + 1), jax.random.split(kc, num_iter)))
    return xs, jnp.mean(acc)


__all__ = ["EPMCMC", "kde_product_sample"]
