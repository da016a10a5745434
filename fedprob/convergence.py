"""Has a point-estimate method reached the global posterior mode? Its distance in posterior sds.

FedAvg, FedProx, FedDyn, ADMM and FedLap report one point ``w`` that is meant
to be (or to approach) the mode of the global posterior
``log p(w | D) = sum_k [log p0(w) / K + log p(D_k | w)]``. After the last
round the check takes one Newton step on that objective, the clients' full
batches summed (one more exchange in a federation: each client sends its
gradient and Hessian at ``w``)::

    g = grad log p(w | D),    H = -hess log p(w | D),    delta = H^-1 g,

and reports ``max_i |delta_i| / sqrt((H^-1)_ii)``: how far the mode lies from
``w`` in Laplace posterior sds, coordinate by coordinate (exact for a
Gaussian posterior; to first order otherwise). Above :data:`TOLERANCE_SD`
the run warns that it has not converged (``Result.info["mode_distance_sd"]``
holds the number in every case). Where ``H`` is not positive definite ``w``
is not near a mode and the distance is reported as infinite.

Diagonal families (FedLap-Cov; PVI and BayesADMM with ``family="diag"``)
cannot reach the global posterior where parameters are correlated: their
product keeps each client's conditional precisions. :func:`diagonal_check`
compares such a result with the full Laplace approximation at its mean (the
same Newton step, and ``sqrt(diag(H^-1))`` against the Gaussian's sds) and
warns when its mean is more than :data:`TOLERANCE_SD` from the mode or an sd
ratio falls outside :data:`SD_RATIO_RANGE` (``Result.info["diagonal_check"]``).
On 8 logistic-regression clients with correlated, shifted inputs FedLap-Cov's
sds were 0.77-0.91x pooled NUTS's.

Only models with at most :data:`MAX_DIM` parameters and no client-local sites
are checked (the d x d Hessian); networks have no single mode to reach.
"""
from __future__ import annotations

import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .potential import pooled_log_posterior

#: distance (posterior sds, largest over coordinates) above which a point method is said not to have converged
TOLERANCE_SD = 0.3
#: sds of a diagonal-family Gaussian over the full Laplace ones outside this range are warned about: the
#: posterior methods' [0.8, 1.25] narrowed by the reference's own error (the full Laplace at the diagonal mean
#: approximates the marginals: on a linear regression with an unknown noise scale FedLap-Cov's sd at 0.80 of
#: pooled NUTS's read 0.802 of the Laplace one, and went unwarned at the old range)
SD_RATIO_RANGE = (0.85, 1.18)
#: largest number of parameters checked (a d x d Hessian)
MAX_DIM = 100


def applies(potential) -> bool:
    return potential.dim <= MAX_DIM and not getattr(potential, "local_sites", ())


def _laplace_impl(potential, w, data):
    """``(max_i |delta_i| / sd_i, sd)`` at ``w``: the Newton step ``delta = H^-1 g`` on the summed
    objective in Laplace sds ``sd = sqrt(diag(H^-1))`` (inf and NaN sds where ``H`` is not positive
    definite)."""
    def log_post(z):
        return pooled_log_posterior(potential, z, data)

    g = jax.grad(log_post)(w)
    H = -jax.hessian(log_post)(w)
    H = 0.5 * (H + H.T)
    L = jnp.linalg.cholesky(H)
    ok = jnp.all(jnp.isfinite(L)) & jnp.all(jnp.isfinite(g))
    L = jnp.where(ok, L, jnp.eye(w.shape[-1], dtype=w.dtype))
    delta = jax.scipy.linalg.cho_solve((L, True), g)
    Linv = jax.scipy.linalg.solve_triangular(L, jnp.eye(w.shape[-1], dtype=w.dtype), lower=True)
    sd = jnp.sqrt(jnp.sum(Linv * Linv, axis=0))            # sqrt(diag(H^-1)), H^-1 = L^-T L^-1
    return jnp.where(ok, jnp.max(jnp.abs(delta) / sd), jnp.inf), jnp.where(ok, sd, jnp.nan)


_laplace = jax.jit(_laplace_impl, static_argnums=(0,))


def mode_distance(potential, w, data) -> float:
    """``max_i |(H^-1 g)_i| / sqrt((H^-1)_ii)`` at the flat point ``w`` (module docstring); inf where
    ``H`` is not positive definite."""
    return float(_laplace(potential, jnp.asarray(w), data)[0])


def point_of(algorithm, posterior) -> Optional[jax.Array]:
    """The flat point a point-estimate method reports, or None for a method with a posterior spread."""
    if not getattr(algorithm, "reports_mode", False):
        return None
    form = getattr(posterior, "form", None)
    draws = getattr(form, "draws", None)
    if draws is not None and draws.ndim == 2 and draws.shape[0] == 1:
        return draws[0]
    reports_point = getattr(algorithm, "reports_point", None)
    if reports_point is not None and reports_point() and hasattr(form, "mean"):
        return form.mean()
    return None


def message(name: str, distance: float, rounds: int) -> Optional[str]:
    if not distance > TOLERANCE_SD:
        return None
    where = ("is not near a mode of the global posterior (its Hessian there is not positive definite)"
             if not np.isfinite(distance) else
             f"is {distance:.2g} posterior sd (Laplace, largest over the parameters) from the global posterior "
             "mode")
    return (f"{name} has not converged: after {rounds} round(s) its point {where}. Run more rounds, or use a "
            "method that targets the global posterior (PVI, FedPA, EPMCMC); FedAvg-style methods with "
            "heterogeneous clients also stop at a fixed point of their own (client drift). "
            "See Result.info['mode_distance_sd'].")


def check(algorithm, ctx, posterior, data, rounds: int, stacklevel: int = 4) -> Optional[float]:
    """The distance (module docstring) of a point-estimate method's result, warning above
    :data:`TOLERANCE_SD`; None where it does not apply."""
    if data is None or not applies(ctx.potential):
        return None
    w = point_of(algorithm, posterior)
    if w is None:
        return None
    dist = mode_distance(ctx.potential, w, data)
    msg = message(type(algorithm).__name__, dist, rounds)
    if msg is not None:
        warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)
    return dist


def diagonal_family(algorithm) -> bool:
    """Whether ``algorithm`` is a natural-parameter method run with a diagonal Gaussian family."""
    loop = getattr(algorithm, "loop", None)
    return loop is not None and getattr(loop(), "family", None) == "diag"


def diagonal_message(name: str, report: dict) -> Optional[str]:
    lo, hi, dist = report["sd_ratio_min"], report["sd_ratio_max"], report["mode_distance_sd"]
    if not (lo < SD_RATIO_RANGE[0] or hi > SD_RATIO_RANGE[1] or dist > TOLERANCE_SD):
        return None
    return (f"{name}'s diagonal Gaussian is {dist:.2g} posterior sd from the global mode with sds "
            f"{lo:.2f}-{hi:.2f} times the full Laplace approximation's there: a diagonal family keeps each "
            "client's conditional precisions, so where the parameters are correlated the product is too "
            "narrow, and biased where the clients' means also differ. Use family='full' (PVI, BayesADMM and "
            "EPMCMC take it; PVI's default on models of up to 100 parameters). "
            "See Result.info['diagonal_check'].")


def diagonal_check(algorithm, ctx, posterior, data, stacklevel: int = 4) -> Optional[dict]:
    """For a diagonal-family natural-parameter method (FedLap-Cov, PVI / BayesADMM with
    ``family="diag"``) on at most :data:`MAX_DIM` parameters: its Gaussian against the full Laplace
    approximation of the global posterior at its mean, ``{"mode_distance_sd", "sd_ratio_min",
    "sd_ratio_max"}`` (the sds of the diagonal Gaussian over the Laplace ones), warning where the
    distance is above :data:`TOLERANCE_SD` or a ratio outside :data:`SD_RATIO_RANGE`: the best its
    structure allows is the mean-field fit, and correlated parameters put it off."""
    if data is None or not applies(ctx.potential) or not diagonal_family(algorithm):
        return None
    form = getattr(posterior, "form", None)
    if form is None or not getattr(form, "is_diag", False) or not hasattr(form, "variance"):
        return None
    dist, sd = _laplace(ctx.potential, form.mean(), data)
    ratio = np.sqrt(np.asarray(form.variance())) / np.asarray(sd)
    if not np.all(np.isfinite(ratio)):
        return None
    report = {"mode_distance_sd": float(dist), "sd_ratio_min": float(ratio.min()),
              "sd_ratio_max": float(ratio.max())}
    msg = diagonal_message(type(algorithm).__name__, report)
    if msg is not None:
        warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)
    return report


__all__ = ["TOLERANCE_SD", "SD_RATIO_RANGE", "MAX_DIM", "applies", "mode_distance", "point_of", "message", "check",
           "diagonal_family", "diagonal_message", "diagonal_check"]
