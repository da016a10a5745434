"""The posterior summary: mean, sd, a 94% interval, ESS and R-hat per site and coordinate.

``result.posterior.summary()`` (and ``result.summary()``) is a table like
``az.summary``: one row per coordinate of every NumPyro site (``w[0, 3]``),
constrained, with

* ``mean`` and ``sd`` of the site's posterior;
* ``eti_3%`` / ``eti_97%``: the equal-tailed 94% interval (``prob``): the 3%
  and 97% quantiles;
* ``ess_bulk``, ``ess_tail`` and ``r_hat`` (ArviZ's own, :mod:`fedprob.diagnostics`)
  where the posterior is given by sampler draws in chains: R-hat needs two
  chains or more; NaN otherwise;
* ``basis``: what the numbers are computed from.

By kind of global posterior (``basis``):

* a Gaussian (PVI, FedLap, BayesADMM, EPMCMC with a Gaussian family, FedPA):
  ``exact`` for sites with real support (mean, sd and interval from the
  Gaussian's own moments: ``mean +- 1.881 sd``), ``gaussian draws`` for
  constrained sites (the moments of ``num_draws`` transformed draws); no ESS
  or R-hat (the draws are independent, not a chain). FedPA's Gaussian is an
  approximation: the server point with a diagonal covariance estimated from
  the last round's client draws (its sds are those of the clients' local
  posteriors combined, not of a global sampler, and can be well below the
  exact posterior's);
* draws (ConsensusMC, EPMCMC by sampling): ``draws``, with ESS and R-hat
  over the stored chains;
* an ensemble (Ensemble): ``mixture of client draws``, each client weighted
  by the mixture weight; chain ``c`` holds every client's chain ``c``;
* PredictiveBayes pools predictive distributions and has no parameter
  posterior: the rows summarise the union of the client draws
  (``client draws (no parameter posterior)``), which is not the posterior of
  its pooled predictive;
* a point estimate (FedAvg, FedProx, FedDyn, ADMM, FedLap, FedLapFunc, OneShotAverage):
  ``point estimate``: the value as ``mean``; sd, interval, ESS and R-hat are
  NaN, since there is no spread to report.

:func:`site_sd` is ``posterior.sd``: the same sds as the table, one array per
site (exact for a Gaussian's real-support sites; NaN for a point estimate).

Client-local sites (``infer={"local": True}``): after the global sites, one
row per client and coordinate of every local site, labelled as ``az.summary``
labels ``result.to_arviz()`` (the client index first: ``a[3]``, ``b[3, 0]``),
from each client's local posterior: ``exact`` for a Gaussian global posterior's
real-support local sites (the conditional averaged over the Gaussian is
Gaussian: ``local_mean`` +- 1.881 ``local_sd``), else draws given each global
draw (``gaussian draws``, or ``draws`` with ESS and R-hat over the global
chains); an ensemble's from the client's own draws (``client draws``); a point
estimate's values with NaN spread.
"""
from __future__ import annotations

import statistics

import numpy as np

import jax
import jax.numpy as jnp

PROB = 0.94
#: draws of a Gaussian posterior for its constrained sites
NUM_DRAWS = 4000


def kind(post) -> str:
    """``"predictive"``, ``"ensemble"``, ``"gaussian"``, ``"point estimate"`` or ``"samples"``
    (as :mod:`fedprob.arviz_io` names them; recognised by what the posterior holds)."""
    if getattr(post, "client_draws", None) is not None:
        return "predictive" if hasattr(post, "pooling") else "ensemble"
    if hasattr(post.form, "precision"):
        return "gaussian"
    if post.form.draws.reshape(-1, post.form.draws.shape[-1]).shape[0] == 1:
        return "point estimate"
    return "samples"


def _flat_draws(post, chains, num_draws: int, seed: int):
    """(flat draws (C, S, d), per-draw weights (C, S) or None, basis) of the posterior's parameters."""
    k = kind(post)
    if k in ("ensemble", "predictive"):
        cd = np.asarray(post.client_draws)            # (K, S, d)
        K, S, d = cd.shape
        C = chains if chains and S % chains == 0 else 1
        x = cd.reshape(K, C, S // C, d).transpose(1, 2, 0, 3).reshape(C, (S // C) * K, d)
        w = np.asarray(post.sample_weights, np.float64)
        w = np.broadcast_to((w / w.sum() / S)[None, None, :], (C, S // C, K)).reshape(C, -1)
        basis = "client draws (no parameter posterior)" if k == "predictive" else "mixture of client draws"
        return x, w, basis
    if k == "gaussian":
        z = np.asarray(post.form.sample(jax.random.PRNGKey(seed), int(num_draws)))
        return z[None], None, "gaussian draws"
    z = np.asarray(post.form.draws).reshape(-1, post.form.draws.shape[-1])
    if k == "point estimate":
        return z[None], None, "point estimate"
    C = chains or int(post.info.get("num_chains", 1))
    C = C if z.shape[0] % C == 0 else 1
    return z.reshape(C, z.shape[0] // C, -1), None, "draws"


def _constrain_impl(potential, z):
    return jax.vmap(potential.constrain)(z)


_constrain_jit = jax.jit(_constrain_impl, static_argnums=0)


def _constrained(post, z: np.ndarray) -> dict:
    """flat (..., d) draws -> dict of constrained sites with the same leading axes."""
    lead = z.shape[:-1]
    vals = _constrain_jit(post.potential, jnp.asarray(z.reshape(-1, z.shape[-1])))
    return {k: np.asarray(v).reshape(lead + v.shape[1:]) for k, v in vals.items()}


def _weighted_quantiles(x: np.ndarray, w: np.ndarray, qs) -> np.ndarray:
    """Quantiles (len(qs), ...) of x (N, ...) under weights w (N,) (the inverse of the weighted CDF)."""
    order = np.argsort(x, axis=0)
    xs = np.take_along_axis(x, order, 0)
    cw = np.cumsum(w[order], axis=0)
    cw = cw / cw[-1:]
    out = []
    for q in qs:
        idx = np.argmax(cw >= q - 1e-12, axis=0)
        out.append(np.take_along_axis(xs, idx[None], 0)[0])
    return np.stack(out)


def _site_stats(v: np.ndarray, w, prob: float):
    """mean, sd, lo, hi over the draws of (C, S, *shape) values (weights (C, S) or None)."""
    x = v.reshape((-1,) + v.shape[2:]).astype(np.float64)
    lo_q, hi_q = (1 - prob) / 2, 1 - (1 - prob) / 2
    if w is None:
        mean = x.mean(0)
        sd = x.std(0, ddof=1) if x.shape[0] > 1 else np.full(mean.shape, np.nan)
        lo, hi = np.quantile(x, [lo_q, hi_q], axis=0)
    else:
        ww = np.asarray(w, np.float64).reshape(-1)
        ww = ww / ww.sum()
        wb = ww.reshape((-1,) + (1,) * (x.ndim - 1))
        mean = (wb * x).sum(0)
        sd = np.sqrt((wb * (x - mean) ** 2).sum(0) * x.shape[0] / max(x.shape[0] - 1, 1))
        lo, hi = _weighted_quantiles(x, ww, [lo_q, hi_q])
    return mean, sd, lo, hi


def _exact_sites(post) -> dict:
    """site -> (mean, sd) arrays for a Gaussian posterior's sites with real support (identity transform)."""
    pot = post.potential
    real = getattr(pot, "_real_mask", None)
    if real is None:
        return {}
    m = np.asarray(post.form.mean(), np.float64)
    s = np.sqrt(np.asarray(post.form.variance(), np.float64))
    out = {}
    for site in pot.sites:
        if site.offset + site.size > m.shape[-1]:          # a client-local site: not in the global form
            continue
        sl = slice(site.offset, site.offset + site.size)
        if bool(np.all(real[sl])) and tuple(site.shape) == tuple(site.unconstrained_shape):
            out[site.name] = (m[sl].reshape(site.shape), s[sl].reshape(site.shape))
    return out


def _label(name: str, idx: tuple) -> str:
    return name if not idx else f"{name}[{', '.join(map(str, idx))}]"


def summary(post, chains=None, num_draws: int = NUM_DRAWS, seed: int = 0, prob: float = PROB, title: str = ""):
    """The summary table of a global posterior (see the module docstring): a :class:`fedprob.report.Table`.

    chains: how many chains the stored draws hold (default: the posterior's
    ``info["num_chains"]``, else 1); ``result.summary()`` passes its backend's.
    num_draws: draws of a Gaussian posterior for its constrained sites. prob:
    the interval's probability (0.94: columns ``eti_3%`` and ``eti_97%``).
    """
    from . import diagnostics as D
    from .table import Table

    if not 0 < prob < 1:
        raise ValueError(f"prob must lie in (0, 1), got {prob!r}")
    z, w, basis = _flat_draws(post, chains, num_draws, seed)
    k = kind(post)
    pot = post.potential
    local = bool(getattr(pot, "local_sites", ()))
    if local and z.shape[-1] < pot.dim:                   # the global block: local sites at 0 (never read)
        z = np.concatenate([z, np.zeros(z.shape[:-1] + (pot.dim - z.shape[-1],), z.dtype)], -1)
    vals = _constrained(post, z)
    exact = _exact_sites(post) if k == "gaussian" else {}
    zq = statistics.NormalDist().inv_cdf(1 - (1 - prob) / 2)
    lo_name, hi_name = f"eti_{100 * (1 - prob) / 2:g}%", f"eti_{100 * (1 - (1 - prob) / 2):g}%"
    chained = k in ("samples", "ensemble", "predictive") and z.shape[1] >= 4
    rows = []

    def add(name, v, site_basis, mean=None, sd=None, chained=chained, w=w, prefix=()):
        if mean is not None:
            lo, hi = mean - zq * sd, mean + zq * sd
        else:
            mean, sd, lo, hi = _site_stats(v, w, prob)
        if k == "point estimate":
            sd, lo, hi = (np.full(np.shape(mean), np.nan),) * 3
        nan = np.full(np.shape(mean), np.nan)
        eb = D.ess(v, "bulk") if chained else nan
        et = D.ess(v, "tail") if chained else nan
        rh = D.rhat(v) if chained and v.shape[0] > 1 else nan
        for idx in np.ndindex(*np.shape(mean)):
            rows.append({"parameter": _label(name, prefix + idx), "mean": float(np.asarray(mean)[idx]),
                         "sd": float(np.asarray(sd)[idx]), lo_name: float(np.asarray(lo)[idx]),
                         hi_name: float(np.asarray(hi)[idx]), "ess_bulk": float(np.asarray(eb)[idx]),
                         "ess_tail": float(np.asarray(et)[idx]), "r_hat": float(np.asarray(rh)[idx]),
                         "basis": site_basis})

    for name in (pot.global_sites if local else pot.site_names):
        v = np.asarray(vals[name])
        if name in exact:
            add(name, v, "exact", *exact[name])
        else:
            add(name, v, basis)
    if local:
        _local_rows(post, k, z, chains, seed, add)
    return Table(rows, title=title or "posterior summary", notes=_notes(post, k, z, prob))


def _local_rows(post, k: str, z, chains, seed: int, add) -> None:
    """The rows of the client-local sites (module docstring), one client after another, through ``add``."""
    pot = post.potential
    K = post.num_local_clients
    if k in ("ensemble", "predictive"):
        cd = np.asarray(post.client_draws)            # (K, S, d): each client's own draws
        S = cd.shape[1]
        C = chains if chains and S % chains == 0 else 1
        vals = _constrained(post, cd.reshape(K, C, S // C, -1))
        for c in range(K):
            for name in pot.local_sites:
                add(name, np.asarray(vals[name][c]), "client draws", chained=S // C >= 4, w=None, prefix=(c,))
        return
    exact = {}
    if k == "gaussian":
        real = np.asarray(pot._real_mask)
        lm, ls = post.local_mean, post.local_sd
        for site in pot.sites:
            sl = slice(site.offset, site.offset + site.size)
            if site.name in pot.local_sites and bool(np.all(real[sl])) and \
                    tuple(site.shape) == tuple(site.unconstrained_shape):
                exact[site.name] = (np.asarray(lm[site.name], np.float64), np.asarray(ls[site.name], np.float64))
    if k == "point estimate":
        for name, v in post.local_mean.items():
            for c in range(K):
                add(name, np.asarray(v[c])[None, None], "point estimate", prefix=(c,))
        return
    vals, _ = post.joint_site_draws(z[..., :pot.dim_global], jax.random.PRNGKey(seed + 2))
    basis = "gaussian draws" if k == "gaussian" else "draws"
    for c in range(K):
        for name in pot.local_sites:
            v = np.asarray(vals[name])[:, :, c]
            if name in exact:
                add(name, v, "exact", exact[name][0][c], exact[name][1][c], prefix=(c,))
            else:
                add(name, v, basis, prefix=(c,))


def _notes(post, k: str, z, prob: float) -> list:
    info_kind = post.info.get("kind")
    notes = [f"kind: {info_kind}"] if info_kind else []
    if k == "point estimate":
        notes.append("a point estimate: one value, no posterior spread (sd, interval, ESS and R-hat are NaN)")
    elif k == "gaussian":
        notes.append(f"a Gaussian posterior: real-support sites exact, constrained sites from {z.shape[1]} "
                     "independent draws; ESS and R-hat do not apply")
    elif k == "predictive":
        notes.append("predictive-space pooling has no parameter posterior: the rows summarise the union of the "
                     "client draws, not the posterior behind the pooled predictive")
    else:
        notes.append(f"{z.shape[0]} chain(s) of {z.shape[1]} draws" + ("; R-hat needs 2 chains or more"
                                                                      if z.shape[0] < 2 else ""))
    notes.append(f"eti: the equal-tailed {100 * prob:g}% interval")
    return notes


def site_sd(post, num_draws: int = NUM_DRAWS, seed: int = 0) -> dict:
    """site -> posterior sd of the constrained site (``posterior.sd``; NaN for a point estimate)."""
    k = kind(post)
    if k == "point estimate":
        return {n: jnp.full(np.shape(v), jnp.nan) for n, v in post.mean.items()}
    exact = _exact_sites(post) if k == "gaussian" else {}
    if len(exact) == len(post.potential.site_names):
        return {n: jnp.asarray(exact[n][1]) for n in post.potential.site_names}
    z, w, _ = _flat_draws(post, None, num_draws, seed)
    vals = _constrained(post, z)
    out = {}
    for n in post.potential.site_names:
        out[n] = jnp.asarray(exact[n][1] if n in exact else _site_stats(np.asarray(vals[n]), w, PROB)[1])
    return out


__all__ = ["summary", "site_sd", "kind", "PROB", "NUM_DRAWS"]
