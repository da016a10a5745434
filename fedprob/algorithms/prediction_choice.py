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
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from .. import gaussian as gauss
from ..posteriors import Gaussian, mixture_log_density

#: draws of each cavity the average is scored over
NUM_DRAWS = 64


def _client_scores(potential, lam_g: Gaussian, site: Gaussian, data, key, num_draws: int):
    """``(elpd_mean, elpd_average, valid)`` of one client's rows under its cavity."""
    cav = Gaussian(lam_g.linear - site.linear, lam_g.precision - site.precision)
    valid = gauss.is_valid(cav)
    safe = Gaussian(jnp.where(valid, cav.linear, 0.0),
                    jnp.where(valid, cav.precision,
                              jnp.ones_like(cav.precision) if cav.is_diag
                              else jnp.eye(cav.dim, dtype=cav.precision.dtype)))
    rows = jnp.arange(data.y.shape[0]) < data.n
    m = safe.mean()
    at_mean = jnp.sum(jnp.where(rows, mixture_log_density(potential, m[None], data.X, data.y), 0.0))
    draws = safe.sample(key, num_draws)
    averaged = jnp.sum(jnp.where(rows, mixture_log_density(potential, draws, data.X, data.y), 0.0))
    return at_mean, averaged, valid


@partial(jax.jit, static_argnums=(0, 5))
def cavity_scores(potential, lam_g: Gaussian, sites: Gaussian, data, key, num_draws: int = NUM_DRAWS):
    """(K,) ``elpd_mean``, (K,) ``elpd_average`` and (K,) ``valid``: every client's rows scored under
    its cavity ``lambda_g - lambda_hat_k`` (``sites`` and ``data`` stacked over clients). Clients run
    one after another (``lax.map``): each draws from its own full precision."""
    keys = jax.random.split(key, data.n.shape[0])
    return jax.lax.map(lambda a: _client_scores(potential, lam_g, a[0], a[1], a[2], num_draws),
                       (sites, data, keys))


def choose(potential, lam_g: Gaussian, sites: Gaussian, data, key) -> dict:
    """``{"prediction": "mean" | "average", "elpd_mean", "elpd_average" (per row, averaged over
    clients), "clients"}``: the leave-one-client-out choice (module docstring); "average" when no
    cavity is a distribution."""
    at_mean, averaged, valid = cavity_scores(potential, lam_g, sites, data, key)
    valid = valid & (data.n > 0)
    used = int(jnp.sum(valid))
    if used == 0:
        return {"prediction": "average", "clients": 0}
    n = jnp.maximum(data.n, 1).astype(at_mean.dtype)
    em = float(jnp.sum(jnp.where(valid, at_mean / n, 0.0)) / used)
    ea = float(jnp.sum(jnp.where(valid, averaged / n, 0.0)) / used)
    pick = "mean" if em > ea else "average"
    return {"prediction": pick, "elpd_mean": em, "elpd_average": ea, "clients": used}


__all__ = ["cavity_scores", "choose", "NUM_DRAWS"]
