"""Stochastic variational inference with NumPyro autoguides -> a Gaussian client posterior.

The guide lives on the flat unconstrained vector ``z`` of the potential's
layout. ``run`` builds a two-line NumPyro model over ``z``::

    z = numpyro.sample("z", ImproperUniform(real_vector, (), (d,)))
    numpyro.factor("target", potential.log_density(z, target, key, batch_size))

so the variational objective is the ELBO of the client's whole
:class:`~fedprob.potential.LocalTarget` (``prior_weight * log p0 +
likelihood_weight * log p(D|z) + linear . z - z' P z / 2``), and the guide's
flattening is the potential's layout (one site, no reordering). With
``batch_size`` set, every ELBO particle draws its own minibatch (weight
``n / b`` per row, an unbiased estimate of the full-data sum).

Guides (NumPyro autoguides): ``"normal"`` AutoNormal and ``"diag"``
AutoDiagonalNormal (mean field, diagonal precision), ``"full"``
AutoMultivariateNormal (full precision), ``"lowrank"``
AutoLowRankMultivariateNormal (covariance ``W W' + D``; its precision is
returned full, computed by the Woodbury identity).

The optimisation is ``SVI.init`` then ``lax.scan`` over ``SVI.update``, all
pure, so ``run`` jits and vmaps over ``(key, target, init)``. The default
optimizer is Adam whose step size decays from ``learning_rate`` to
``learning_rate * final_lr_fraction`` on a cosine schedule, which lets the
noisy ELBO iterates settle.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

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

Array = jax.Array

GUIDES = ("normal", "diag", "full", "lowrank")


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


@dataclasses.dataclass(frozen=True)
class SVI(ClientBackend):
    """Gaussian variational posterior of a client by SVI with a NumPyro autoguide.

    Maximises ``ELBO(q) = E_q[log pi(z)] + H(q)`` with ``log pi`` the client's
    LocalTarget (temperature 1: ``likelihood_weight`` and ``prior_weight``
    as given by the algorithm). Returns ``Gaussian(linear = P m,
    precision = P)`` with ``m`` the guide's mean and ``P`` its precision
    (diagonal for ``"normal"``/``"diag"``, full for ``"full"``/``"lowrank"``),
    ``params = m``, and diagnostics ``elbo`` (mean of the ELBO estimates
    over the last 10% of steps) and ``nonfinite``.

    Parameters
    ----------
    guide: ``"normal"``, ``"diag"``, ``"full"`` or ``"lowrank"``.
    num_steps: optimisation steps.
    optimizer: an optax ``GradientTransformation``; ``None`` is Adam with a
        cosine decay from ``learning_rate`` to ``learning_rate *
        final_lr_fraction`` over ``num_steps``.
    learning_rate: Adam's initial step size (ignored if ``optimizer`` is given).
    num_particles: Monte Carlo draws per ELBO estimate.
    rank: rank of the ``"lowrank"`` guide (default ``round(sqrt(d))``).
    batch_size: minibatch rows per particle, ``None`` for the full batch.
    init_scale: initial standard deviation of the guide.
    final_lr_fraction: end point of the default schedule.
    """

    guide: str = "normal"
    num_steps: int = 2000
    optimizer: Optional[Any] = None
    learning_rate: float = 0.02
    num_particles: int = 1
    rank: Optional[int] = None
    batch_size: Optional[int] = None
    init_scale: float = 0.1
    final_lr_fraction: float = 0.01

    output = "gaussian"

    def __post_init__(self):
        if self.guide not in GUIDES:
            raise ValueError(f"unknown guide '{self.guide}'; use one of {GUIDES}")
        if int(self.num_steps) < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if int(self.num_particles) < 1:
            raise ValueError(f"num_particles must be >= 1, got {self.num_particles}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"final_lr_fraction must lie in [0, 1], got {self.final_lr_fraction}")
        if self.batch_size is not None and int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be None or >= 1, got {self.batch_size}")
        if self.rank is not None:
            if self.guide != "lowrank":
                raise ValueError(f"rank is only used by guide='lowrank' (guide is '{self.guide}')")
            if int(self.rank) < 1:
                raise ValueError(f"rank must be >= 1, got {self.rank}")

    # -- pieces ---------------------------------------------------------------------------
    def _optimizer(self):
        if self.optimizer is not None:
            return self.optimizer
        sched = optax.cosine_decay_schedule(self.learning_rate, int(self.num_steps),
                                            alpha=self.final_lr_fraction)
        return optax.adam(sched)

    def _model(self, potential, dim: int):
        batch_size = self.batch_size

        def model(target):
            z = numpyro.sample("z", dist.ImproperUniform(constraints.real_vector, (), (dim,)))
            key = numpyro.prng_key() if batch_size is not None else None
            numpyro.factor("target", potential.log_density(z, target, key, batch_size))

        return model

    def _guide(self, model, init):
        kw = dict(init_loc_fn=init_to_value(values={"z": init}), init_scale=self.init_scale)
        if self.guide == "normal":
            return autoguide.AutoNormal(model, **kw)
        if self.guide == "diag":
            return autoguide.AutoDiagonalNormal(model, **kw)
        if self.guide == "full":
            return autoguide.AutoMultivariateNormal(model, **kw)
        return autoguide.AutoLowRankMultivariateNormal(model, rank=self.rank, **kw)

    def gaussian(self, guide, params):
        """(Gaussian in natural parameters, mean) of the guide from its constrained params."""
        if self.guide in ("normal", "diag"):
            prefix = "z_auto" if self.guide == "normal" else "auto"
            m, s = params[prefix + "_loc"], params[prefix + "_scale"]
            prec = 1.0 / (s * s)
            return Gaussian(prec * m, prec), m
        post = guide.get_posterior(params)
        if self.guide == "full":
            prec = scale_tril_precision(post.scale_tril)
        else:
            prec = lowrank_precision(post.cov_factor, post.cov_diag)
        return Gaussian(prec @ post.loc, prec), post.loc

    # -- the backend ----------------------------------------------------------------------
    def run(self, key, potential, target, init) -> ClientResult:
        """Fit the guide to ``target`` from mean ``init``; see the class docstring."""
        dim = potential.dim
        init = jnp.asarray(init)
        if init.shape != (dim,):
            raise ValueError(f"init must have shape ({dim},), got {init.shape}")
        if self.rank is not None and int(self.rank) >= dim:
            raise ValueError(f"rank must be < the parameter dimension {dim}, got {self.rank}")
        model = self._model(potential, dim)
        guide = self._guide(model, init)
        svi = _NumPyroSVI(model, guide, optax_to_numpyro(self._optimizer()),
                          Trace_ELBO(num_particles=int(self.num_particles)))
        state = svi.init(key, target)

        def body(state, _):
            state, loss = svi.update(state, target)
            return state, loss

        state, losses = jax.lax.scan(body, state, None, length=int(self.num_steps))
        params = svi.get_params(state)
        post, mean = self.gaussian(guide, params)
        tail = max(1, int(self.num_steps) // 10)
        elbo = -jnp.mean(losses[-tail:])
        ok = finite_flag(post, losses[-tail:])
        diagnostics = {"elbo": elbo, "nonfinite": ~ok}
        return ClientResult(post, mean, diagnostics)


__all__ = ["SVI", "GUIDES", "lowrank_precision", "scale_tril_precision"]
