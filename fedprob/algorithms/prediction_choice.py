"""``prediction="auto"``: plug-in at the mean or average over the Gaussian, chosen by held-out clients.

A Gaussian posterior can predict two ways: averaged over its draws (the
Bayesian model average) or at its mean. The average is right when the
Gaussian is the posterior; it is badly wrong when the Gaussian is far wider
than the posterior in the directions that matter, as a diagonal Laplace
approximation of a network is (digits MLP, 10 Dirichlet(0.5) clients, 20
rounds of FedLap-Cov: 36.4% accuracy, NLL 1.93 averaged against 95.3% and
0.18 at the mean; FedAvg 82.8% and 0.82).

The natural loop holds, for free, each client's *cavity*
``q_{-k} = q_g / t_k`` (natural parameters ``lambda_g - lambda_hat_k``): the
global posterior without client k's data. Scoring client k's own rows under
it is a leave-one-client-out cross-validation of the two predictives::

    elpd_mean    = (1/K) sum_k (1/n_k) sum_i log p(y_ki | x_ki, m_{-k})
    elpd_average = (1/K) sum_k (1/n_k) sum_i log (1/S) sum_s p(y_ki | x_ki, z_s),   z_s ~ q_{-k}

each client computing its two sums on its own rows (two numbers sent, no
rows). ``"auto"`` predicts with the larger (the average on a tie or when no
cavity is a distribution). Each client's fold counts alike (per-row means
averaged over clients, as K-fold cross-validation averages its folds): a
client holding most of the rows has a cavity fitted to the few rows left,
and pooled over rows its fold alone would decide (Fashion-MNIST MLP,
FedLap-Cov, 10 rounds: the largest client, 2,555 of 6,000 rows, scored
-8.2 at the mean against -6.0 averaged while 8 of the 10 clients scored
better at the mean; pooled, the average was chosen, 15% test accuracy
against 72% at the mean). On the MLP above the scores (pooled over rows) were
-1.92 (mean) against -2.29 (average) per row; on softmax regression -1.15
against -1.20 (test NLL 0.25 at the mean, 0.38 averaged); averaged over the
clients the choices are the same (the MLP: benchmarks/results/network_defaults.md;
softmax regression, PVI, 20 rounds: -1.149 against -1.168). A cavity that is not a
distribution (a site larger than the rest of the posterior) is left out.

The folds count only where the cavities are a fair stand-in for the
global posterior: their means must predict the clients' rows better than
the prior's mean does (``elpd_mean > elpd_prior``, the plug-in at ``m_0``,
averaged over the folds alike; uniform classes for a zero-mean network).
Subtracting a large client's diagonal site from a network's global Gaussian
can leave cavities whose means predict worse than knowing nothing; under
them both predictives are poor and the softer one, the average, wins by
default. That vote says nothing about q_g (Fashion-MNIST MLP, FedLap-Cov,
25 rounds: the average was chosen and predicted 17% of the test rows
against 77% at the mean). Then the mean is used and
``info["prediction_choice"]["reason"]`` says why: the plug-in is what every
point method predicts with, and an average over a Gaussian no held-out
client supports is not. (The test is over the folds together: one small
client's rows can sit closer to the prior mean's prediction than to any
fitted model's by chance, as one of five conjugate clients of 8 rows did.)
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from .. import gaussian as gauss
from ..posteriors import Gaussian, mixture_log_density

#: draws of each cavity the average is scored over
NUM_DRAWS = 64


def _client_scores(potential, lam_g: Gaussian, site: Gaussian, data, key, num_draws: int, baseline):
    """``(elpd_mean, elpd_average, elpd_prior, valid)``: sums over one client's rows under its cavity
    (plug-in at its mean, average over its draws) and the plug-in at ``baseline`` (the prior mean)."""
    cav = Gaussian(lam_g.linear - site.linear, lam_g.precision - site.precision)
    valid = gauss.is_valid(cav)
    safe = Gaussian(jnp.where(valid, cav.linear, 0.0),
                    jnp.where(valid, cav.precision,
                              jnp.ones_like(cav.precision) if cav.is_diag
                              else jnp.eye(cav.dim, dtype=cav.precision.dtype)))
    rows = jnp.arange(data.y.shape[0]) < data.n

    def score(points):
        return jnp.sum(jnp.where(rows, mixture_log_density(potential, points, data.X, data.y), 0.0))

    draws = safe.sample(key, num_draws)
    return score(safe.mean()[None]), score(draws), score(baseline[None]), valid


@partial(jax.jit, static_argnums=(0, 6))
def cavity_scores(potential, lam_g: Gaussian, sites: Gaussian, data, key, baseline, num_draws: int = NUM_DRAWS):
    """(K,) ``elpd_mean``, (K,) ``elpd_average``, (K,) ``elpd_prior`` and (K,) ``valid``: every client's
    rows (sums) scored under its cavity ``lambda_g - lambda_hat_k`` and at the point ``baseline``
    (``sites`` and ``data`` stacked over clients). Clients run one after another (``lax.map``): each
    draws from its own full precision."""
    keys = jax.random.split(key, data.n.shape[0])
    return jax.lax.map(lambda a: _client_scores(potential, lam_g, a[0], a[1], a[2], num_draws, baseline),
                       (sites, data, keys))


def choose(potential, lam_g: Gaussian, sites: Gaussian, data, key, prior: Gaussian | None = None) -> dict:
    """``{"prediction": "mean" | "average", "elpd_mean", "elpd_average", "elpd_prior" (per row,
    averaged over the clients), "clients" (folds counted), "per_client": {"mean", "average", "prior"}
    (per-row scores, NaN where the cavity is not a distribution)}``: the leave-one-client-out choice
    (module docstring); "average" when no cavity is a distribution, "mean" (with a "reason") when the
    cavities' means predict no better than the prior mean (``prior``: the model's prior Gaussian;
    None: the origin)."""
    baseline = jnp.zeros_like(lam_g.linear) if prior is None else prior.mean()
    at_mean, averaged, at_prior, valid = cavity_scores(potential, lam_g, sites, data, key, baseline)
    valid = valid & (data.n > 0)
    used = int(jnp.sum(valid))
    n = jnp.maximum(data.n, 1).astype(at_mean.dtype)
    per_row = {k: jnp.where(valid, s / n, jnp.nan) for k, s in (("mean", at_mean), ("average", averaged),
                                                                ("prior", at_prior))}
    out = {"clients": used, "per_client": {k: [float(x) for x in v] for k, v in per_row.items()}}
    if used == 0:
        return {**out, "prediction": "average", "reason": "no client's cavity is a distribution"}
    em, ea, ep = (float(jnp.sum(jnp.where(valid, per_row[k], 0.0)) / used) for k in ("mean", "average", "prior"))
    out.update(elpd_mean=em, elpd_average=ea, elpd_prior=ep)
    if em <= ep:
        return {**out, "prediction": "mean",
                "reason": (f"the clients' cavities predicted their rows no better at their means than the prior "
                           f"mean does ({em:.3g} against {ep:.3g} per row): no held-out client supports the "
                           "average over the Gaussian")}
    return {**out, "prediction": "mean" if em > ea else "average"}


__all__ = ["cavity_scores", "choose", "NUM_DRAWS"]
