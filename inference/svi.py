"""Stochastic variational inference with NumPyro autoguides -> a Gaussian client posterior.

The guide lives on the flat unconstrained vector ``z`` of the potential's
layout, written in whitened coordinates ``z = m0 + A u`` (see
*Preconditioning*). ``run`` builds a two-line NumPyro model over ``u``::

    u = numpyro.sample("z", ImproperUniform(real_vector, (), (d,)))
    numpyro.factor("target", potential.log_density(m0 + A u, target, key, batch_size))

so the variational objective is the ELBO of the client's whole
:class:`~fedprob.potential.LocalTarget` (``prior_weight * log p0 +
likelihood_weight * log p(D|z) + linear . z - z' P z / 2``, temperature 1;
the log-likelihood is the **sum** over the client's rows). With
``batch_size`` set, every ELBO particle draws its own minibatch (weight
``n / b`` per row, an unbiased estimate of the full-data sum).

Guides (NumPyro autoguides): ``"normal"`` AutoNormal and ``"diag"``
AutoDiagonalNormal (mean field, diagonal precision), ``"full"``
AutoMultivariateNormal (full precision), ``"lowrank"``
AutoLowRankMultivariateNormal (covariance ``W W' + D`` in the whitened
coordinates ``u``, so ``A (W W' + D) A'`` in ``z``: the Laplace covariance
corrected by a rank-r term; its precision is returned full, computed by the
Woodbury identity; ``W`` starts at ``0.3 N(0, 1)`` draws relative to the
guide's scale, because ``W = 0`` is a stationary point of the ELBO that Adam
leaves only by chance).

Preconditioning (``precondition=True``, the default). A fixed Adam step is
an absolute distance: on a client whose posterior sd is 0.01 a step of 0.02
jitters the mean by two sds, and on correlated inputs Adam's diagonal scaling
leaves the narrow directions unconverged. So ``run`` first finds the mode
``m0`` of the target (:func:`fedprob.inference.optim.minimize`, ``map_steps``
L-BFGS steps; Adam on minibatches) and its curvature ``H = -hess log pi(m0)``
over the client's data, then optimises the guide over ``u`` with ``z = m0 +
A u``, ``A A' = H^-1``: ``A = V L^-1/2`` from ``H = V L V'`` for the full
and low-rank guides, ``A = diag(H)^-1/2`` for the mean-field ones (so they
stay mean field in ``z``). A diagonal ``A`` would leave the low-rank guide
in ``z``'s own ``W W' + D`` family, whose ELBO is badly conditioned on
correlated posteriors: on 1,000-row clients with correlation 0.8 it was
still 0.2-0.4 nats short of that family's optimum after 1,000-3,000 steps.
Either curvature costs d Hessian-vector products; the dense one d^2 memory
(as does the full precision both guides return). Eigenvalues (or
diagonal entries) of ``H`` are floored at ``1e-6 (1 + max)``. In ``u`` the
posterior has unit scale whatever the client's size, so the learning rate
and ``init_scale`` are in posterior sds and the same defaults serve tens and
thousands of rows. The guide starts at ``u = 0`` with sd ``init_scale``
(the Laplace approximation for the full and low-rank guides, the Laplace
diagonal otherwise). The answer maps back exactly: mean ``m0 + A mu_u``, precision
``A^-T P_u A^-1``; the reported ELBO includes ``log |det A|``.

Optimisation: ``SVI.init`` then ``lax.scan`` over ``SVI.update``, all pure,
so ``run`` jits and vmaps over ``(key, target, init)``. Default optimizer:
Adam with a cosine decay from ``learning_rate`` to ``learning_rate *
final_lr_fraction``; the returned guide is the Polyak average of the
(constrained) guide parameters over the last ``average_fraction`` of the
steps, which removes most of the iterate noise of the stochastic ELBO: on
Gaussian targets the averaged mean is off by about ``1 / sqrt(num_steps *
average_fraction)`` posterior sds per coordinate (0.03 at the defaults, 0.1
at worst over coordinates, clients and seeds in the tests).
Convergence is reported, not used to stop (a fixed budget keeps vmapped
clients in lock step): with ``w = num_steps // 10``, ``mean_drift`` is the
largest change of the guide mean between the last two windows of ``w``
steps in posterior sds, ``elbo_change`` the change of the mean ELBO between
them, and ``converged = mean_drift < 0.1 and |elbo_change| < max(3 se,
1e-3 |elbo|)`` (``se`` the standard error of that difference). It is a
check on the last windows only: a slow drift below the noise passes it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
import optax
from numpyro.distributions import constraints
from numpyro.infer import SVI as _NumPyroSVI
from numpyro.infer import Trace_ELBO, autoguide
from numpyro.infer.initialization import init_to_value
from numpyro.optim import optax_to_numpyro

from fedprob.posteriors import Gaussian

from fedprob.protocols import ClientBackend, ClientResult, finite_flag
from .laplace import curvature
from .optim import minimize

Array = jax.Array

GUIDES = ("normal", "diag", "full", "lowrank")

CURVATURE_FLOOR = 1e-6
LOWRANK_INIT = 0.3


def lowrank_precision(cov_factor: Array, cov_diag: Array) -> Array:
    """Precision of ``W W' + diag(D)`` by the Woodbury identity, (d, d).

    ``P = D^-1 - D^-1 W (I + W' D^-1 W)^-1 W' D^-1``.
    """
    dinv = 1.0 / cov_diag
    wd = cov_factor * dinv[:, None]                                  # D^-1 W, (d, r)
    cap = jnp.eye(cov_factor.shape[-1], dtype=cov_factor.dtype) + cov_factor.T @ wd
    chol = jnp.linalg.cholesky(cap)
    a = jax.scipy.linalg.solve_triangular(chol, wd.T, lower=True)     # L^-1 W' D^-1, (r, d)
    prec = jnp.diag(dinv) - a.T @ a
    return 0.5 * (prec + prec.T)


def scale_tril_precision(scale_tril: Array) -> Array:
    """Precision ``(L L')^-1`` from a lower Cholesky factor of the covariance."""
    eye = jnp.eye(scale_tril.shape[-1], dtype=scale_tril.dtype)
    linv = jax.scipy.linalg.solve_triangular(scale_tril, eye, lower=True)
    prec = linv.T @ linv
    return 0.5 * (prec + prec.T)


class Whitening(NamedTuple):
    """``z = center + A u``. ``factor`` is ``A`` (d, d), or its diagonal (d,);
    ``root`` is ``A^-T`` ((d, d), or the diagonal ``1 / A``), so that the
    precision of ``z`` is ``root P_u root'``; ``log_det`` is ``log |det A|``.
    """

    center: Array
    factor: Array
    root: Array
    log_det: Array

    def to_z(self, u):
        return self.center + (self.factor @ u if self.factor.ndim == 2 else self.factor * u)

    def gaussian(self, mean_u, precision_u) -> Gaussian:
        """The Gaussian of ``z`` from the mean and precision (diag or full) of ``u``."""
        mean = self.to_z(mean_u)
        r = self.root
        if r.ndim == 2:
            pu = jnp.diag(precision_u) if precision_u.ndim == 1 else precision_u
            prec = r @ pu @ r.T
        elif precision_u.ndim == 1:
            prec = r * r * precision_u
        else:
            prec = r[:, None] * precision_u * r[None, :]
        if prec.ndim == 2:
            prec = 0.5 * (prec + prec.T)
            return Gaussian(prec @ mean, prec), mean
        return Gaussian(prec * mean, prec), mean


def identity_whitening(center: Array) -> Whitening:
    """``z = center + u``."""
    one = jnp.ones_like(center)
    return Whitening(center, one, one, jnp.zeros((), center.dtype))


def curvature_whitening(curv: Array, center: Array) -> Whitening:
    """Whitening by a curvature ``H`` (full (d, d) or diagonal (d,)): ``A A' = H^-1``.

    Eigenvalues (full) or entries (diagonal) below ``1e-6 (1 + max)`` are
    raised to it (a non-finite curvature falls back to the identity).
    """
    if curv.ndim == 1:
        ok = jnp.all(jnp.isfinite(curv))
        curv = jnp.where(ok, curv, 1.0)
        h = jnp.maximum(curv, CURVATURE_FLOOR * (1.0 + jnp.max(curv)))
        root = jnp.sqrt(h)
        return Whitening(center, 1.0 / root, root, -jnp.sum(jnp.log(root)))
    ok = jnp.all(jnp.isfinite(curv))
    curv = jnp.where(ok, 0.5 * (curv + curv.T), jnp.eye(curv.shape[0], dtype=curv.dtype))
    evals, evecs = jnp.linalg.eigh(curv)
    evals = jnp.maximum(evals, CURVATURE_FLOOR * (1.0 + jnp.max(evals)))
    sq = jnp.sqrt(evals)
    return Whitening(center, evecs / sq, evecs * sq, -jnp.sum(jnp.log(sq)))


@dataclasses.dataclass(frozen=True)
class SVI(ClientBackend):
    """Gaussian variational posterior of a client by SVI with a NumPyro autoguide.

    Maximises ``ELBO(q) = E_q[log pi(z)] + H(q)`` with ``log pi`` the client's
    LocalTarget (temperature 1: ``likelihood_weight`` and ``prior_weight``
    as given by the algorithm). Returns ``Gaussian(linear = P m,
    precision = P)`` with ``m`` the guide's mean and ``P`` its precision
    (diagonal for ``"normal"``/``"diag"``, full for ``"full"``/``"lowrank"``),
    ``params = m``. Diagnostics: ``elbo`` (mean ELBO estimate over the last
    10% of steps, in ``z``), ``elbo_change``, ``mean_drift``, ``converged``
    (module docstring), ``num_steps_run``, ``map_grad_norm`` (gradient norm of
    the mean loss at the mode used for preconditioning) and ``nonfinite``.

    Parameters
    ----------
    guide: ``"normal"``, ``"diag"``, ``"full"`` or ``"lowrank"``.
    num_steps: optimisation steps.
    optimizer: an optax ``GradientTransformation``; ``None`` is Adam with a
        cosine decay from ``learning_rate`` to ``learning_rate *
        final_lr_fraction`` over ``num_steps``.
    learning_rate: Adam's initial step size (ignored if ``optimizer`` is
        given); in posterior sds when ``precondition`` is on.
    num_particles: Monte Carlo draws per ELBO estimate.
    rank: rank of the ``"lowrank"`` guide (default ``round(sqrt(d))``).
    batch_size: minibatch rows per particle, ``None`` for the full batch.
    init_scale: initial standard deviation of the guide; ``None`` is 1 (the
        Laplace sd) with ``precondition`` and 0.1 without.
    final_lr_fraction: end point of the default schedule.
    average_fraction: the last fraction of steps whose guide parameters are
        averaged (0: the last iterate).
    precondition: whiten by the curvature at the mode (module docstring);
        ``False`` optimises the guide in ``z`` from ``init``.
    map_steps: optimiser steps of the mode search before preconditioning.
    """

    guide: str = "normal"
    num_steps: int = 2000
    optimizer: Optional[Any] = None
    learning_rate: float = 0.02
    num_particles: int = 1
    rank: Optional[int] = None
    batch_size: Optional[int] = None
    init_scale: Optional[float] = None
    final_lr_fraction: float = 0.01
    average_fraction: float = 0.5
    precondition: bool = True
    map_steps: int = 200

    init_strategy: str = "center"

    output = "gaussian"
    #: a variational fixed point: a product may refine the returned Gaussian by one unit natural-gradient
    #: step estimated from its draws (:meth:`fedprob.algorithms.one_round_base.GaussianProductAlgorithm.stein_fit`),
    #: which leaves the ELBO's optimum where it is
    variational_fixed_point = True

    def __post_init__(self):
        if self.guide not in GUIDES:
            raise ValueError(f"unknown guide '{self.guide}'; use one of {GUIDES}")
        if int(self.num_steps) < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if int(self.num_particles) < 1:
            raise ValueError(f"num_particles must be >= 1, got {self.num_particles}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.init_scale is not None and not self.init_scale > 0:
            raise ValueError(f"init_scale must be None or > 0, got {self.init_scale}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"final_lr_fraction must lie in [0, 1], got {self.final_lr_fraction}")
        if not 0 <= self.average_fraction < 1:
            raise ValueError(f"average_fraction must lie in [0, 1), got {self.average_fraction}")
        if int(self.map_steps) < 0:
            raise ValueError(f"map_steps must be >= 0, got {self.map_steps}")
        if self.batch_size is not None and int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be None or >= 1, got {self.batch_size}")
        if self.rank is not None:
            if self.guide != "lowrank":
                raise ValueError(f"rank is only used by guide='lowrank' (guide is '{self.guide}')")
            if int(self.rank) < 1:
                raise ValueError(f"rank must be >= 1, got {self.rank}")

    # -- pieces ---------------------------------------------------------------------------
    @property
    def resolved_init_scale(self) -> float:
        if self.init_scale is not None:
            return float(self.init_scale)
        return 1.0 if self.precondition else 0.1

    def _optimizer(self):
        if self.optimizer is not None:
            return self.optimizer
        sched = optax.cosine_decay_schedule(self.learning_rate, int(self.num_steps),
                                            alpha=self.final_lr_fraction)
        return optax.adam(sched)

    def _model(self, potential, dim: int):
        batch_size = self.batch_size

        def model(target, white):
            u = numpyro.sample("z", dist.ImproperUniform(constraints.real_vector, (), (dim,)))
            key = numpyro.prng_key() if batch_size is not None else None
            numpyro.factor("target", potential.log_density(white.to_z(u), target, key, batch_size))

        return model

    def _guide(self, model, dim: int, dtype):
        kw = dict(init_loc_fn=init_to_value(values={"z": jnp.zeros((dim,), dtype)}),
                  init_scale=self.resolved_init_scale)
        if self.guide == "normal":
            return autoguide.AutoNormal(model, **kw)
        if self.guide == "diag":
            return autoguide.AutoDiagonalNormal(model, **kw)
        if self.guide == "full":
            return autoguide.AutoMultivariateNormal(model, **kw)
        return autoguide.AutoLowRankMultivariateNormal(model, rank=self.rank, **kw)

    def _loc_sd(self, guide, params):
        """(mean, marginal sds) of the guide in its own coordinates."""
        if self.guide in ("normal", "diag"):
            prefix = "z_auto" if self.guide == "normal" else "auto"
            return params[prefix + "_loc"], params[prefix + "_scale"]
        post = guide.get_posterior(params)
        if self.guide == "full":
            return post.loc, jnp.sqrt(jnp.sum(post.scale_tril ** 2, -1))
        return post.loc, jnp.sqrt(post.cov_diag + jnp.sum(post.cov_factor ** 2, -1))

    def gaussian(self, guide, params):
        """(Gaussian in natural parameters, mean) of the guide from its constrained params,
        in the guide's own coordinates."""
        if self.guide in ("normal", "diag"):
            m, s = self._loc_sd(guide, params)
            prec = 1.0 / (s * s)
            return Gaussian(prec * m, prec), m
        post = guide.get_posterior(params)
        if self.guide == "full":
            prec = scale_tril_precision(post.scale_tril)
        else:
            prec = lowrank_precision(post.cov_factor, post.cov_diag)
        return Gaussian(prec @ post.loc, prec), post.loc

    def whitening(self, key, potential, target, init):
        """``(Whitening, map_grad_norm)``: the mode of ``target`` and ``A A' = H^-1`` there."""
        if not self.precondition:
            return identity_whitening(init), jnp.full((), jnp.nan, init.dtype)
        opt = minimize(potential, target, init, key=key, num_steps=int(self.map_steps),
                       batch_size=self.batch_size)
        dense = self.guide in ("full", "lowrank")
        # mean-field guides: the diagonal (estimated above 512 parameters, a preconditioner only)
        curv = curvature(potential, target, opt.params, "full" if dense else "diag",
                         key=jax.random.fold_in(key, 1))
        return curvature_whitening(curv, opt.params), opt.grad_norm

    # -- the backend ----------------------------------------------------------------------
    def run(self, key, potential, target, init) -> ClientResult:
        """Fit the guide to ``target`` from ``init``; see the class docstring."""
        dim = potential.dim
        init = jnp.asarray(init)
        if init.shape != (dim,):
            raise ValueError(f"init must have shape ({dim},), got {init.shape}")
        if self.rank is not None and int(self.rank) >= dim:
            raise ValueError(f"rank must be < the parameter dimension {dim}, got {self.rank}")
        k_map, k_svi = jax.random.split(key)
        white, map_grad_norm = self.whitening(k_map, potential, target, init)
        model = self._model(potential, dim)
        guide = self._guide(model, dim, init.dtype)
        svi = _NumPyroSVI(model, guide, optax_to_numpyro(self._optimizer()),
                          Trace_ELBO(num_particles=int(self.num_particles)))
        k_init, k_svi = jax.random.split(k_svi)
        init_params = None
        if self.guide == "lowrank":
            # W = 0 is a saddle of the ELBO (its gradient in W is (S^-1 - P) W): start off it
            rank = self.rank if self.rank is not None else max(1, int(round(dim ** 0.5)))
            init_params = {"auto_cov_factor": LOWRANK_INIT * jax.random.normal(
                k_init, (dim, int(rank)), init.dtype)}
        state = svi.init(k_svi, target, white, init_params=init_params)

        steps = int(self.num_steps)
        start_avg = min(int(steps * (1.0 - self.average_fraction)), steps - 1)
        w = max(1, steps // 10)
        win_a, win_b = max(0, steps - 2 * w), steps - w
        params0 = svi.get_params(state)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params0)
        loc0 = jnp.zeros((dim,), init.dtype)

        def body(carry, t):
            state, avg, loc_a, loc_b = carry
            state, loss = svi.update(state, target, white)
            params = svi.get_params(state)
            in_avg = (t >= start_avg).astype(init.dtype)
            avg = jax.tree_util.tree_map(lambda s, p: s + in_avg * p, avg, params)
            loc = self._loc_sd(guide, params)[0]
            in_a = ((t >= win_a) & (t < win_b)).astype(init.dtype)
            in_b = (t >= win_b).astype(init.dtype)
            return (state, avg, loc_a + in_a * loc, loc_b + in_b * loc), loss

        carry = (state, zeros, loc0, loc0)
        (state, avg, loc_a, loc_b), losses = jax.lax.scan(body, carry, jnp.arange(steps))
        params = jax.tree_util.tree_map(lambda s: s / (steps - start_avg), avg)
        post_u, mean_u = self.gaussian(guide, params)
        post, mean = white.gaussian(mean_u, post_u.precision)

        # convergence over the last two windows of w steps
        elbos = -losses + white.log_det
        e_a, e_b = elbos[win_a:win_b], elbos[win_b:]
        elbo = jnp.mean(e_b)
        elbo_change = elbo - jnp.mean(e_a)
        se = jnp.sqrt(jnp.var(e_a) / e_a.shape[0] + jnp.var(e_b) / e_b.shape[0])
        _, sd_u = self._loc_sd(guide, params)
        n_a = max(1, win_b - win_a)
        mean_drift = jnp.max(jnp.abs(loc_b / (steps - win_b) - loc_a / n_a) / sd_u)
        converged = (mean_drift < 0.1) & (jnp.abs(elbo_change)
                                          <= jnp.maximum(3.0 * se, 1e-3 * jnp.abs(elbo)))
        ok = finite_flag(post, losses[win_b:])
        diagnostics = {"elbo": elbo, "elbo_change": elbo_change, "mean_drift": mean_drift,
                       "converged": converged & ok, "num_steps_run": jnp.asarray(steps, jnp.int32),
                       "map_grad_norm": map_grad_norm, "nonfinite": ~ok}
        return ClientResult(post, mean, diagnostics)


__all__ = ["SVI", "GUIDES", "Whitening", "curvature_whitening", "identity_whitening",
           "lowrank_precision", "scale_tril_precision"]
