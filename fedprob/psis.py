"""Pareto k-hat: is a client's Gaussian close enough to its own target?

A Gaussian client (Laplace, SVI, IVON, a Gaussian moment-matched to a
sampler's draws: EPMCMC, ConsensusMC, FedPA) replaces its target density
``pi`` (the client posterior, sub-posterior or tilted distribution it
approximates) by ``q = N(m, S)``. Draw ``z_s ~ q`` and take the importance
ratios ``log w_s = log pi(z_s) - log q(z_s)`` (``pi`` unnormalised). Pareto
smoothed importance sampling (Vehtari, Simpson, Gelman, Yao & Gabry 2024,
"Pareto smoothed importance sampling", JMLR 25) fits a generalized Pareto
distribution to the largest ``M = min(S / 5, 3 sqrt(S))`` ratios; its shape
``k`` is the diagnostic:

* ``k < 0.5``: the ratios have finite variance: ``q`` covers ``pi`` well;
* ``0.5 <= k < 0.7``: usable, estimates of moments converge slowly;
* ``k >= 0.7`` (:data:`KHAT_MAX`): ``pi`` has mass where ``q`` has almost
  none (heavy tails, a funnel, skew): a Gaussian summary of this target, and
  every product built from it, cannot be trusted.

The shape is fitted by the empirical Bayes method of Zhang & Stephens (2009,
Technometrics 51) as PSIS does: a grid of ``30 + sqrt(M)`` candidate values
of ``b = -k / sigma`` weighted by their profile likelihood, the posterior mean
of ``b``, then ``k`` shrunk toward 0.5 by a weak prior (10 pseudo-observations).
Everything is a JAX function of fixed shapes, so it runs under ``jit`` and
``vmap`` over clients.

Ratios that are practically equal (none above 3 times the median,
:func:`gaussian_ratio_khat`) give ``-inf``: the Gaussian is its target for any
estimate, whatever shape a tail fitted to such ratios takes. The warning
(:func:`message`) follows the global check where a method has one: clients
above the threshold are named when the global Gaussian also fails it.
"""
from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .potential import pooled_log_posterior

#: k-hat above which a client's Gaussian is flagged
KHAT_MAX = 0.7
#: draws of a client's Gaussian used for its k-hat (tail of min(S/5, 3 sqrt(S)) = 135 ratios): at
#: S = 2000 the sample-size threshold of Vehtari et al. (2024), ``1 - 1 / log10(S)``, is
#: :data:`KHAT_MAX` (at 1000 draws it would be 0.67, and k-hat is noisier: a Laplace Gaussian 0.8x
#: as wide as its zero-inflated Poisson target gave 0.74 at 1000 draws, 0.63-0.69 at 2000)
NUM_DRAWS = 2000
#: above this many parameters no k-hat is computed: importance ratios of any Gaussian in hundreds
#: of dimensions degenerate even where its marginals are right, so the diagnostic says nothing
MAX_DIM = 100


def _tail_size(S: int) -> int:
    return int(min(S // 5, math.ceil(3.0 * math.sqrt(S))))


def gpd_fit(x):
    """(k, sigma) of a generalized Pareto fitted to exceedances ``x`` (M,) sorted ascending, >= 0.

    Zhang & Stephens (2009) with the weakly informative prior of PSIS.
    """
    x = jnp.asarray(x)
    n = x.shape[0]
    m = 30 + int(math.sqrt(n))
    xmax = jnp.maximum(x[-1], jnp.finfo(x.dtype).tiny)
    quart = jnp.maximum(x[int(n / 4 + 0.5) - 1], jnp.finfo(x.dtype).tiny)
    j = jnp.arange(1, m + 1, dtype=x.dtype)
    b = 1.0 - jnp.sqrt(m / (j - 0.5))
    b = b / (3.0 * quart) + 1.0 / xmax
    k = jnp.mean(jnp.log1p(-b[:, None] * x[None, :]), axis=1)          # (m,) = -shape at each b
    ll = n * (jnp.log(-(b / k)) - k - 1.0)                              # profile log likelihood
    w = jax.nn.softmax(jnp.where(jnp.isfinite(ll), ll, -jnp.inf))
    b_post = jnp.sum(w * b)
    k_post = jnp.mean(jnp.log1p(-b_post * x))
    sigma = -k_post / b_post
    k_post = (n * k_post + 10.0 * 0.5) / (n + 10.0)
    return k_post, sigma


def pareto_khat(log_w, tol=0.0):
    """PSIS k-hat of log importance ratios ``log_w`` (S,); non-finite ratios count as 0 weight.

    Equal ratios (the proposal is the target: tail log ratios within ``tol`` of each other, the
    rounding error of the log densities) give k-hat ``-inf``; no finite ratio at all (every draw
    where the target is 0 or not finite) gives ``inf``.
    """
    log_w = jnp.asarray(log_w)
    S = log_w.shape[0]
    M = _tail_size(S)
    log_w = jnp.where(jnp.isnan(log_w), -jnp.inf, log_w)
    lw = jnp.sort(log_w - jnp.max(log_w))
    cutoff = lw[S - M - 1]
    x = jnp.exp(lw[S - M:]) - jnp.exp(cutoff)                          # exceedances over the cutoff
    x = jnp.maximum(x, 0.0)
    k, _ = gpd_fit(x)
    equal = lw[-1] - cutoff <= tol
    return jnp.where(jnp.isfinite(lw[-1]), jnp.where(equal | (x[-1] <= 0), -jnp.inf, k), jnp.inf)


#: log-ratio spread (largest minus median) at or below which a Gaussian counts as its target: no
#: importance ratio of the draws is above 3 times the typical one (measured on benchmarks/any_model.py's
#: models: 2.1-2.4 for EP on the zero-inflated Poisson, whose moments match NUTS's within 2% with an
#: importance-sampling ESS of 99%; 9 to 10^20 where a Gaussian misses mass)
NEGLIGIBLE_SPREAD = math.log(3.0)


def gaussian_ratio_khat(log_pi, log_q):
    """k-hat of the ratios ``log_pi - log_q`` of a Gaussian ``q`` (its draws) against its target ``pi``;
    ``-inf`` when the ratios are practically equal: the largest within :data:`NEGLIGIBLE_SPREAD` of
    the median (and within the log densities' rounding error of each other).

    A near-Gaussian target that is slightly skewed (a Poisson or binomial likelihood at a few hundred
    rows) makes ``log pi - log q`` grow slowly in the far tail of the draws: the fitted tail
    shape can then come out near 1 though every weight of 1,000 draws is within a few percent of the
    others (measured: EP on a Poisson GLM written as a factor, k-hat 0.98 with ratios within a
    factor of 1.25 of the median; EP on a zero-inflated Poisson, k-hat 0.82-1.03 with the largest
    ratio 2.1-2.4 times the median and the log ratios' sd 0.1). Such a tail holds none of the target's mass that matters; the
    diagnostic reports it as the exact case. Where a Gaussian misses mass (the eight-schools funnel, a horseshoe
    prior), the largest ratio is 9 to 10^20 times the median (benchmarks/any_model.py's models).
    """
    log_w = log_pi - log_q
    k = pareto_khat(log_w, rounding(log_pi, log_q))
    finite = jnp.where(jnp.isnan(log_w), -jnp.inf, log_w)
    negligible = (jnp.max(finite) - jnp.nanmedian(log_w)) <= NEGLIGIBLE_SPREAD
    return jnp.where(jnp.isfinite(k) & negligible, -jnp.inf, k)


def rounding(*log_densities):
    """The rounding error of log densities of their typical (median) size: a tolerance for equal ratios."""
    big = sum(jnp.nanmedian(jnp.where(jnp.isfinite(a), jnp.abs(a), jnp.nan)) for a in log_densities)
    big = jnp.where(jnp.isfinite(big), big, 0.0)
    return 100.0 * jnp.finfo(log_densities[0].dtype).eps * big


def gaussian_khat(key, potential, q, target, num_draws: int = NUM_DRAWS):
    """k-hat of ``q`` (a :class:`~fedprob.posteriors.Gaussian`) as an importance proposal for
    ``target`` (a :class:`~fedprob.potential.LocalTarget`, its full-batch log density)."""
    return gaussian_ratio_khat(*_draw_log_densities(key, potential, q, target, num_draws))


def _draw_log_densities(key, potential, q, target, num_draws):
    """``(log pi, log q)`` at ``num_draws`` draws of ``q`` (the importance ratios' two halves)."""
    z = q.sample(key, num_draws)
    log_pi = jax.lax.map(lambda zz: potential.log_density(zz, target), z, batch_size=min(num_draws, 64))
    return log_pi, jax.vmap(q.log_prob)(z)


def _clients_log_densities_impl(potential, num_draws, q, targets, key):
    K = jax.tree_util.tree_leaves(targets)[0].shape[0]
    keys = jax.random.split(key, K)
    return jax.vmap(lambda k, t: _draw_log_densities(k, potential, q, t, num_draws))(keys, targets)


def _global_log_densities_impl(potential, num_draws, q, data, key):
    z = q.sample(key, num_draws)
    log_pi = jax.lax.map(lambda zz: pooled_log_posterior(potential, zz, data), z, batch_size=min(num_draws, 32))
    return log_pi, jax.vmap(q.log_prob)(z)


def _both_log_densities_impl(potential, num_draws, q_clients, targets, q_global, data, key_clients, key_global):
    return (_clients_log_densities_impl(potential, num_draws, q_clients, targets, key_clients),
            _global_log_densities_impl(potential, num_draws, q_global, data, key_global))


# The model-dependent part of a check (the log densities at the draws) is compiled per model; the clients'
# and the global one in one program. The tail fit is the same program for every model and run
# (``num_draws`` ratios): compiled once per process, it is applied to each row of ratios.
_clients_log_densities = jax.jit(_clients_log_densities_impl, static_argnums=(0, 1))
_global_log_densities = jax.jit(_global_log_densities_impl, static_argnums=(0, 1))
_both_log_densities = jax.jit(_both_log_densities_impl, static_argnums=(0, 1))
_ratio_khat = jax.jit(gaussian_ratio_khat)


def _ratio_khats(log_pi, log_q) -> np.ndarray:
    """k-hat of each row of ``log_pi - log_q`` (..., S), by the shared compiled fit."""
    log_pi, log_q = np.asarray(log_pi), np.asarray(log_q)
    flat_pi, flat_q = log_pi.reshape(-1, log_pi.shape[-1]), log_q.reshape(-1, log_q.shape[-1])
    out = [float(_ratio_khat(a, b)) for a, b in zip(flat_pi, flat_q)]
    return np.asarray(out, float).reshape(log_pi.shape[:-1])


def _global_key(seed):
    return jax.random.fold_in(jax.random.PRNGKey(seed), 29)


def _clients_key(seed):
    return jax.random.fold_in(jax.random.PRNGKey(seed), 23)


def global_khat(potential, q, data, seed: int = 0) -> float:
    """k-hat of a Gaussian global posterior ``q`` against the exact posterior ``p0(z) prod_k p(D_k | z)``.

    Federated, this is one more exchange: the server sends ``NUM_DRAWS`` draws of ``q``, each client
    returns its log likelihood at them, and the server sums (a masked sum, like every aggregate).
    """
    return float(_ratio_khats(*_global_log_densities(potential, NUM_DRAWS, q, data, _global_key(seed))))


def client_khats(algorithm, ctx, server_state, client_states, data, client_diagnostics, seed: int = 0):
    """(K,) per-client k-hat of a finished run (NaN for clients without one), or None when the method
    has no Gaussian client.

    Iterative Gaussian methods (``algorithm.gaussian_fits``: PVI, FedLap-Cov, BayesADMM, FedPA)
    are checked once, after the last round, every client vmapped; one-round methods report
    ``khat`` from their client update (:meth:`OneRoundAlgorithm.client_khat`), read here from
    each client's latest included round.
    """
    return run_khats(algorithm, ctx, server_state, client_states, data, client_diagnostics, None, seed)[0]


def _reported_khats(K, client_diagnostics):
    """(K,) the ``khat`` the clients reported in their latest included round (NaN: none), or None."""
    out, found = np.full(K, np.nan), False
    for entry in client_diagnostics or ():
        if "khat" not in entry:
            continue
        found = True
        ids = np.asarray(entry["participants"])
        inc = np.asarray(entry["included"], bool)
        out[ids[inc]] = np.asarray(entry["khat"], float)[inc]
    return out if found else None


def run_khats(algorithm, ctx, server_state, client_states, data, client_diagnostics, global_q=None,
              seed: int = 0):
    """``(client k-hats or None, global k-hat or None)`` of a finished run: :func:`client_khats` and,
    when ``global_q`` (the global posterior's Gaussian) is given, :func:`global_khat`; both in one
    compiled program where the method's clients are checked after the last round (the same numbers)."""
    if not applies(ctx.potential):
        return None, None
    use_global = global_q is not None and data is not None
    fits = None if data is None else algorithm.gaussian_fits(ctx, server_state, client_states, data)
    if fits is None:
        khat = _reported_khats(ctx.num_clients, client_diagnostics)
        return khat, (global_khat(ctx.potential, global_q, data, seed) if use_global else None)
    q, targets = fits
    if not use_global:
        return _ratio_khats(*_clients_log_densities(ctx.potential, NUM_DRAWS, q, targets, _clients_key(seed))), None
    clients, glob = _both_log_densities(ctx.potential, NUM_DRAWS, q, targets, global_q, data,
                                        _clients_key(seed), _global_key(seed))
    return _ratio_khats(*clients), float(_ratio_khats(*glob))


def applies(potential) -> bool:
    """Whether k-hat is computed for this model: at most :data:`MAX_DIM` parameters and no
    client-local sites (a client's Gaussian then stands for the global block of a joint target)."""
    return potential.dim <= MAX_DIM and not getattr(potential, "local_sites", ())


def message(khat, global_k=None) -> str | None:
    """The warning for per-client k-hats (K,) (NaN: none) and the global one (None or NaN: none), or
    None when none is above :data:`KHAT_MAX`.

    The global k-hat checks the answer itself (the global Gaussian against the exact posterior); where
    it exists and is at most :data:`KHAT_MAX`, clients whose own Gaussians are above it (a skewed
    sub-posterior of a few rows whose product is still right) are left to ``diagnostics()`` and no
    warning is given. Where the global check fails, or the method has none, the clients above it are
    named.
    """
    parts = []
    has_global = global_k is not None and not np.isnan(global_k)
    if has_global and global_k > KHAT_MAX:
        parts.append(f"the global Gaussian against the exact posterior: {global_k:.2f}")
    if khat is not None and (not has_global or global_k > KHAT_MAX):
        khat = np.asarray(khat, float)
        bad = np.flatnonzero(np.nan_to_num(khat, nan=-np.inf) > KHAT_MAX)
        if bad.size:
            order = bad[np.argsort(-khat[bad])]
            shown = ", ".join(f"client {int(k)}: {khat[k]:.2f}" for k in order[:8])
            more = f" and {order.size - 8} more" if order.size > 8 else ""
            parts.append(f"{bad.size} of {int(np.sum(~np.isnan(khat)))} clients' Gaussians against their own "
                         f"targets ({shown}{more})")
    if not parts:
        return None
    return (f"Pareto k-hat above {KHAT_MAX} on " + "; on ".join(parts) + ": the Gaussian misses where the "
            "target has mass (heavy tails, a funnel, skew, or correlations a diagonal Gaussian drops), so the "
            "posterior built from it is unreliable. Use a full-covariance family (family='full') where the "
            "target is near Gaussian but correlated, or a sampling client (NUTS, SGHMC) with a sample-based "
            "product (EPMCMC(method='semiparametric'), PredictiveBayes, Ensemble); where a funnel comes from "
            "per-client parameters under a shared scale, mark them client-local (infer={'local': True}) so each "
            "client keeps its own")


def warn(khat, global_k=None, stacklevel: int = 3) -> None:
    m = message(khat, global_k)
    if m is not None:
        warnings.warn(m, RuntimeWarning, stacklevel=stacklevel + 1)


__all__ = ["KHAT_MAX", "NUM_DRAWS", "MAX_DIM", "gpd_fit", "pareto_khat", "gaussian_khat", "client_khats", "global_khat", "run_khats", "gaussian_ratio_khat", "NEGLIGIBLE_SPREAD", "applies", "message",
           "warn"]
