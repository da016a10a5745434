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

Only models with at most :data:`MAX_DIM` parameters and no client-local sites
are checked (the d x d Hessian); networks have no single mode to reach.
"""
from __future__ import annotations

import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .potential import make_target

#: distance (posterior sds, largest over coordinates) above which a point method is said not to have converged
TOLERANCE_SD = 0.3
#: largest number of parameters checked (a d x d Hessian)
MAX_DIM = 100


def applies(potential) -> bool:
    return potential.dim <= MAX_DIM and not getattr(potential, "local_sites", ())


def _distance_impl(potential, w, data):
    K = data.n.shape[0]

    def log_post(z):
        per = jax.vmap(lambda d: potential.log_density(z, make_target(d, potential.dim, prior_weight=1.0 / K,
                                                                         dtype=z.dtype)))(data)
        return jnp.sum(per)

    g = jax.grad(log_post)(w)
    H = -jax.hessian(log_post)(w)
    H = 0.5 * (H + H.T)
    L = jnp.linalg.cholesky(H)
    ok = jnp.all(jnp.isfinite(L)) & jnp.all(jnp.isfinite(g))
    L = jnp.where(ok, L, jnp.eye(w.shape[-1], dtype=w.dtype))
    delta = jax.scipy.linalg.cho_solve((L, True), g)
    Linv = jax.scipy.linalg.solve_triangular(L, jnp.eye(w.shape[-1], dtype=w.dtype), lower=True)
    sd = jnp.sqrt(jnp.sum(Linv * Linv, axis=0))            # sqrt(diag(H^-1)), H^-1 = L^-T L^-1
    return jnp.where(ok, jnp.max(jnp.abs(delta) / sd), jnp.inf)


_distance = jax.jit(_distance_impl, static_argnums=(0,))


def mode_distance(potential, w, data) -> float:
    """``max_i |(H^-1 g)_i| / sqrt((H^-1)_ii)`` at the flat point ``w`` (module docstring); inf where
    ``H`` is not positive definite."""
    return float(_distance(potential, jnp.asarray(w), data))


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


__all__ = ["TOLERANCE_SD", "MAX_DIM", "applies", "mode_distance", "point_of", "message", "check"]
