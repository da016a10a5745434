"""The Monte Carlo check of a product of client posteriors: its mean's sampling error over its sd."""
from __future__ import annotations

import warnings

import jax
import numpy as np

from .. import gaussian as gauss

#: A product whose mean's Monte Carlo sd exceeds this fraction of its posterior sd warns.
MC_ERROR_WARN = 0.2


def monte_carlo_check(name: str, precision, mc_sum, ids, ess, threshold: float = MC_ERROR_WARN) -> dict:
    """Monte Carlo error of a product's mean as a fraction of its posterior sd; warns above ``threshold``.

    Returns info entries: ``mc_error_sd_ratio`` (the largest over
    coordinates of ``sd_mc(mean_i) / sd(posterior_i)``,
    :func:`fedprob.gaussian.relative_mean_error`), ``mc_error_coordinate``
    (where), ``mc_error_sd_ratios`` (every coordinate's), ``client_ess`` (client id -> smallest ESS). The product is about
    sqrt(K) narrower than each client, while every client's mean carries its
    own sampling error ``sd_k / sqrt(ESS_k)``: few effective draws per client
    leave the product's mean off by a visible fraction of its sd. The
    estimate covers the sampling error of the client means only (not a
    sampler's bias, nor the error of the fitted precisions, nor an ESS
    overestimated from a short chain), so it is a lower bound on the error.
    """
    ratio = np.asarray(_relative_error(precision, mc_sum), np.float64)
    ratio = np.where(np.isfinite(ratio), ratio, np.inf)
    i = int(np.argmax(ratio))
    r = float(ratio[i])
    ess = np.where(np.asarray(ess) >= 0.99 * np.finfo(np.float32).max, np.inf, ess)    # exact Gaussian output
    info = {"mc_error_sd_ratio": r, "mc_error_coordinate": i, "mc_error_sd_ratios": ratio.tolist(),
            "client_ess": {int(k): float(e) for k, e in zip(ids, ess)}}
    if r > threshold:
        order = np.argsort(ess)[:3]
        worst = ", ".join(f"client {int(ids[j])} (ESS {float(ess[j]):.3g})" for j in order)
        factor = (r / threshold) ** 2
        warnings.warn(
            f"{name}: the Monte Carlo error of the combined mean is {r:.2f} of the posterior sd (coordinate "
            f"{i}); the product is about sqrt(K) narrower than each client while each client's mean carries "
            f"its own sampling error. Lowest effective sample sizes: {worst}. Draw about {factor:.1f}x as many "
            "effective samples on every client (more draws, longer chains, a better-mixing sampler) to bring "
            f"it below {threshold}; see posterior.info['mc_error_sd_ratio'].", RuntimeWarning, stacklevel=3)
    return info


_relative_error = jax.jit(gauss.relative_mean_error)


__all__ = ["MC_ERROR_WARN", "monte_carlo_check"]
