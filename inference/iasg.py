"""Iterate-averaged SGD sampling, IASG (Mandt et al. 2017): FedPA's client sampler (FedPA, Alg. 4).

Scale convention. Unlike the other samplers, IASG is an *optimizer*: it runs
SGD (optionally heavy-ball momentum, optax's ``sgd`` convention) on the
client's **mean** loss

    f(w) = -log_density(w, target) / n_k         (fedprob.potential.mean_loss)

so ``step_size`` is a per-point learning rate that carries across client
sizes, as in FedPA (whose objectives are mean losses). Steps::

    m <- momentum * m + grad f_B(w);   w <- w - step_size * m

(``f_B``: the minibatch estimate, ``batch_size=None`` the full batch.) After
``num_burnin`` steps, each of ``num_samples`` draws is the average of the
next ``steps_per_sample`` iterates.

What the draws approximate. Near the mode SGD is a linear-Gaussian process
whose stationary spread is set by the learning rate, the batch size and the
gradient noise, not by ``n_k``: with the mean-loss Hessian ``A`` and
per-point gradient covariance ``C``, single iterates have covariance
``~ (step_size / b) S`` with ``A S + S A = C`` (small step sizes) while the
posterior has ``(n_k A)^-1``. So the draws approximate the posterior *tempered by
n_k* (spread of order ``step_size / b``, not ``1 / n_k``), and their
covariance matches the true posterior only for a tuned step size (Mandt et
al.): :func:`iasg_sample_covariance` gives the exact stationary covariance
of the draws on a quadratic loss for any step size, averaging window and
momentum, and :func:`iasg_calibrated_step_size` the step size at which its
trace matches a target covariance. With the full batch there is no gradient
noise: the draws collapse onto the mode. Averaging ``K`` iterates shrinks
the spread; for windows long against the relaxation time it tends to
``A^-1 C A^-1 / (K b)``, the posterior's when ``K b = n_k`` and ``C = A``.
The quadratic model holds the gradient-noise covariance at its value at the
mode; where it grows with the distance to the mode (a linear regression's
does), the draws come out somewhat wider (about +12% in the trace at the
calibrated step size of the tests).

``step_size=None`` adapts the learning rate during burn-in to
``0.5 / lambda_max(A)`` (the curvature machinery of the SG-MCMC samplers):
a safe, fast default for FedPA-style use, not a calibrated one.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .sgmcmc import SGMCMC, Kernel, check_fraction, check_int, constant_schedule, max_curvature, step_info

Array = jax.Array

#: ``step_size * lambda_max(A)`` of the adapted default learning rate (``A`` the
#: mean-loss Hessian); plain SGD is stable below 2.
IASG_RATE = 0.5
#: A minibatch mean loss this many times above the start's (plus 1) marks a diverging run.
DIVERGED_FACTOR = 1e3


class IASGState(NamedTuple):
    position: Array
    momentum: Array      # heavy-ball buffer (zeros when momentum = 0)


def iasg_init(position) -> IASGState:
    position = jnp.asarray(position)
    return IASGState(position, jnp.zeros_like(position))


def sgd_step(state: IASGState, loss_grad, step_size, momentum=0.0) -> IASGState:
    """``m <- momentum m + grad;  w <- w - step_size m`` (``grad`` of the mean LOSS; optax.sgd)."""
    m = momentum * state.momentum + loss_grad
    return IASGState(state.position - step_size * m, m)


@dataclasses.dataclass(frozen=True)
class IASG(SGMCMC):
    """Iterate-averaged SGD sampler on one client's mean loss (see the module docstring).

    step_size: SGD learning rate on the mean loss ``-log_density / n_k``;
        ``None`` adapts it during burn-in to ``0.5 / lambda_max(A)``, ``A``
        the mean-loss Hessian at the current point (as the SG-MCMC samplers
        do, see :mod:`fedprob.inference.sgmcmc`). The draws' spread depends
        on it (module docstring): give a number to control it.
    num_burnin: SGD steps before the first draw.
    steps_per_sample: iterates averaged into each draw (K in FedPA).
    num_samples: draws (l in FedPA); with one draw this is FedAvg's local
        training followed by averaging of the last K iterates.
    momentum: heavy-ball momentum (0 = plain SGD).
    batch_size: rows per minibatch (with replacement); ``None`` is the full
        batch (then the draws sit at the mode).
    init_strategy: start used when ``run`` gets ``init=None``.

    Diagnostics: ``grad_norm`` (of the mean-loss gradient) and ``loss``
    (minibatch mean loss), both averaged over the sampling steps; ``nonfinite``
    / ``finite``; ``ess``; ``step_size``; ``stretch`` (always 1: IASG has no
    ESS target); ``burnin_restarts`` / ``sampling_restarts`` (adapted step
    only, see :mod:`fedprob.inference.sgmcmc`).
    """

    step_size: Optional[float] = None
    num_burnin: int = 500
    steps_per_sample: int = 20
    num_samples: int = 10
    momentum: float = 0.0
    batch_size: Optional[int] = None
    init_strategy: str = "prior"

    injects_noise = False

    def __post_init__(self):
        super().__post_init__()
        check_int("steps_per_sample", self.steps_per_sample, 1)
        check_int("num_samples", self.num_samples, 1)
        check_fraction("momentum", self.momentum, high_open=True)

    def schedule(self):
        """Each draw the average of ``steps_per_sample`` iterates."""
        return constant_schedule(self.num_samples, self.steps_per_sample)

    def kernel(self, problem) -> Kernel:
        """SGD (heavy ball) on the mean loss; the adapted step is ``IASG_RATE / lambda_max(A)``."""
        vg, n = problem.grad, problem.n
        # Divergence guard: SGD with a step above 2 / lambda_max grows geometrically and can stay
        # finite for hundreds of steps (a step adapted on one minibatch's curvature can be too
        # large for the client's). A minibatch mean loss above DIVERGED_FACTOR times the start's
        # counts as non-finite, so the adapted run rolls the window back and halves the step.
        loss_ref = jnp.abs(-problem.potential.log_density(problem.position, problem.target) / n)
        limit = DIVERGED_FACTOR * (jnp.where(jnp.isfinite(loss_ref), loss_ref, 0.0) + 1.0)

        def step(k, s, lr, noisy=True):    # an optimizer: nothing is injected
            lp, g = vg(s.position, k)
            loss_grad = -g / n
            s = sgd_step(s, loss_grad, lr, self.momentum)
            info = step_info(-lp / n, loss_grad, s.position)
            info["finite"] = info["finite"] & (-lp / n < limit)
            info["loss"] = info.pop("log_density")
            return s, info

        def adapt(k, s, start, iters):
            lam, v = max_curvature(problem.potential, problem.target, problem.batch_size, s.position, k,
                                   iters, None, start)
            lam = lam / n
            lam = jnp.where(jnp.isfinite(lam) & (lam > 0), lam, 1.0)
            return (IASG_RATE / jnp.maximum(lam, 1e-3)).astype(problem.position.dtype), v

        return Kernel(iasg_init, step, IASG_RATE, adapt=adapt, reduce="mean",
                      reset=lambda s: s._replace(momentum=jnp.zeros_like(s.momentum)))


# -- calibration on a quadratic loss (Mandt et al. 2017) -------------------------------------

def _stationary(F, Q, iters: int = 64):
    """Solve S = F S F' + Q (Smith's doubling); requires spectral radius of F < 1."""
    S, Fk = Q.copy(), F.copy()
    for _ in range(iters):
        S_next = S + Fk @ S @ Fk.T
        Fk = Fk @ Fk
        if np.allclose(S_next, S, rtol=1e-14, atol=0.0):
            return S_next
        S = S_next
    return S


def iasg_sample_covariance(hessian, grad_cov, step_size: float, batch_size: int,
                           steps_per_sample: int = 1, momentum: float = 0.0) -> np.ndarray:
    """Stationary covariance of IASG draws on the quadratic mean loss ``(w-m)' A (w-m) / 2``.

    The minibatch gradient is ``A (w - m) + xi`` with ``Cov xi = C / b``
    (``C = grad_cov`` the per-point gradient covariance, rows drawn with
    replacement). The SGD state ``(w - m, buffer)`` is then a linear-Gaussian
    AR(1) process; this returns the covariance of the average of
    ``steps_per_sample`` consecutive iterates at stationarity (exact for that
    model, float64).
    """
    A = np.atleast_2d(np.asarray(hessian, np.float64))
    C = np.atleast_2d(np.asarray(grad_cov, np.float64))
    d = A.shape[0]
    lr, mu, K = float(step_size), float(momentum), int(steps_per_sample)
    lam = np.linalg.eigvalsh(A)
    if lam.min() <= 0:
        raise ValueError("hessian must be positive definite")
    if lr * lam.max() >= 2.0 * (1.0 + mu):
        raise ValueError(f"step_size={lr} is unstable: SGD on this loss needs "
                         f"step_size < {2.0 * (1.0 + mu) / lam.max():.4g}")
    eye = np.eye(d)
    F = np.block([[eye - lr * A, -lr * mu * eye], [A, mu * eye]])
    G = np.vstack([-lr * eye, eye])
    S = _stationary(F, G @ (C / batch_size) @ G.T)
    cov = K * S[:d, :d]
    Fk = np.eye(2 * d)
    for k in range(1, K):
        Fk = F @ Fk
        L = (Fk @ S)[:d, :d]
        cov = cov + (K - k) * (L + L.T)
    return cov / K ** 2


def iasg_calibrated_step_size(hessian, grad_cov, batch_size: int, target_cov,
                              steps_per_sample: int = 1, momentum: float = 0.0) -> float:
    """The step size at which ``trace(iasg_sample_covariance) = trace(target_cov)``.

    ``target_cov`` is typically the posterior covariance ``(n_k A)^-1``. Found
    by bisection in log step size below the stability limit; a ValueError
    when no stable step size reaches the target (averaging windows long
    against the relaxation time give ``A^-1 C A^-1 / (K b)`` whatever the
    step size: use fewer ``steps_per_sample`` or another batch size).
    """
    A = np.atleast_2d(np.asarray(hessian, np.float64))
    goal = float(np.trace(np.atleast_2d(np.asarray(target_cov, np.float64))))
    hi = 2.0 * (1.0 + momentum) / np.linalg.eigvalsh(A).max() * (1.0 - 1e-6)

    def excess(lr):
        cov = iasg_sample_covariance(A, grad_cov, lr, batch_size, steps_per_sample, momentum)
        return np.log(np.trace(cov)) - np.log(goal)

    lo = hi * 1e-8
    f_lo, f_hi = excess(lo), excess(hi)
    if f_lo > 0 or f_hi < 0:
        raise ValueError("no stable step size gives draws with the target covariance "
                         f"(trace ratio ranges over [{np.exp(f_lo):.3g}, {np.exp(f_hi):.3g}])")
    for _ in range(100):
        mid = np.sqrt(lo * hi)
        if excess(mid) > 0:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-10:
            break
    return float(np.sqrt(lo * hi))


__all__ = ["IASG", "IASG_RATE", "IASGState", "iasg_init", "sgd_step", "iasg_sample_covariance",
           "iasg_calibrated_step_size"]
