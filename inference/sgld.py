"""Stochastic gradient Langevin dynamics (Welling & Teh 2011) and pSGLD (Li et al. 2016).

SGLD step, ``g`` the (minibatch) gradient of the client's log posterior::

    w <- w + (eps / 2) g + N(0, eps T)

Preconditioned SGLD (pSGLD) with the RMSprop preconditioner, ``gbar = g / n``
the per-point (mean) gradient as in Li et al.::

    V <- decay V + (1 - decay) gbar * gbar
    G <- 1 / (lambda + sqrt(V))                    (elementwise, lambda = rmsprop_eps)
    w <- w + (eps_t / 2) G g + N(0, eps_t T G)

``V`` is the second-moment statistic of ``optax.scale_by_rms`` (its ``nu``).
Three documented choices: (1) ``V`` adapts during burn-in and is frozen for
sampling, so the sampling phase is SGLD with a fixed diagonal metric and
Li et al.'s Gamma correction term (the derivative of G) is exactly zero.
Li et al. keep adapting and omit Gamma in their practical version, which
leaves a bias where the gradient scale varies with the position (a few per
cent in the sds of our logistic and linear regression checks); (2) the step is
``eps_t = eps * (lambda + mean_i sqrt(V_i))``, i.e. G is rescaled so that a
coordinate whose RMS gradient is the average one moves exactly like plain
SGLD with step ``eps``; coordinates with larger gradients take smaller
steps, those with smaller gradients larger ones. This keeps ``step_size``
(and its scale-aware default) meaning the same with and without the
preconditioner; it equals Li et al.'s update with a scalar, time-varying
step; (3) ``V`` starts at the first gradient's square (no zero start).

RMSprop shrinks the steps of coordinates whose gradients are large, so a
chain that starts far out in such a coordinate (e.g. a regression noise
scale drawn from its prior) approaches slowly: give pSGLD a longer burn-in
than plain SGLD (on a 2000-row regression with a learned noise scale 1000
burn-in steps were too few for the noise scale, 4000 enough).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

import optax

from .sgmcmc import Kernel, ThinnedSampler, check_fraction, check_positive, step_info

Array = jax.Array

PRECONDITIONERS = (None, "rmsprop")

#: ``eps * lambda_max`` of the adapted default step size (see ``sgmcmc``): the
#: stationary variance of the stiffest direction is ``1 / (1 - rate / 4)`` = +14% too large.
SGLD_RATE = 0.5


class SGLDState(NamedTuple):
    position: Array


class PSGLDState(NamedTuple):
    position: Array
    square_avg: Array     # V: running mean of the squared per-point gradient


def sgld_init(position) -> SGLDState:
    return SGLDState(jnp.asarray(position))


def sgld_step(key, state: SGLDState, grad, step_size, temperature=1.0) -> SGLDState:
    """``w + (eps/2) g + sqrt(eps T) xi``, ``xi ~ N(0, I)`` drawn once over the flat vector.

    The noise is ``jax.random.normal(key, w.shape, w.dtype)`` and the update is
    written as BlackJAX's overdamped Langevin step with ``h = eps / 2``
    (``w + h g + sqrt(2 T h) xi``), so ``blackjax.sgld`` with step size
    ``eps / 2`` and the same key gives the same numbers.
    """
    w = state.position
    noise = jax.random.normal(key, w.shape, w.dtype)
    h = 0.5 * step_size
    return SGLDState(w + h * grad + jnp.sqrt(2 * temperature * h) * noise)


def psgld_init(position, grad, scale=1.0) -> PSGLDState:
    """Preconditioned SGLD state; ``V`` starts at ``(grad / scale)^2`` (``scale`` = n)."""
    gbar = jnp.asarray(grad) / scale
    return PSGLDState(jnp.asarray(position), gbar * gbar)


def rmsprop_preconditioner(square_avg, eps=1e-5) -> Array:
    """The rescaled RMSprop preconditioner ``G_i = (lambda + mean sqrt V) / (lambda + sqrt V_i)``."""
    root = jnp.sqrt(square_avg)
    return (eps + jnp.mean(root)) / (eps + root)


def rms_update(square_avg, gbar, decay) -> Array:
    """``V <- decay V + (1 - decay) gbar^2``: ``optax.scale_by_rms``'s second-moment statistic."""
    tx = optax.scale_by_rms(decay=decay, eps=1.0, eps_in_sqrt=False)   # (updates unused)
    _, st = tx.update(gbar, optax.ScaleByRmsState(nu=square_avg))
    return st.nu


def psgld_step(key, state: PSGLDState, grad, step_size, temperature=1.0, decay=0.99, eps=1e-5,
               scale=1.0) -> PSGLDState:
    """One pSGLD step (see the module docstring); ``scale`` turns ``grad`` into ``gbar``."""
    v = rms_update(state.square_avg, grad / scale, decay)
    G = rmsprop_preconditioner(v, eps)
    w = state.position
    noise = jax.random.normal(key, w.shape, w.dtype)
    w = w + 0.5 * step_size * G * grad + jnp.sqrt(step_size * temperature * G) * noise
    return PSGLDState(w, v)


@dataclasses.dataclass(frozen=True)
class SGLD(ThinnedSampler):
    """Stochastic gradient Langevin dynamics on one client's target.

    step_size: eps (acts on the gradient of the log posterior, a sum over the
        client's points); ``None`` adapts it during burn-in to
        ``0.5 / lambda_max``, ``lambda_max`` the largest curvature of the
        target (in the preconditioned metric for pSGLD; see
        :mod:`fedprob.inference.sgmcmc`), which scales like ``1 / n_k``.
    num_burnin, num_samples, thinning: ``num_burnin`` steps discarded, then a
        draw every ``thinning`` steps (static ints).
    batch_size: rows per minibatch (with replacement, weighted n/b); ``None``
        is the full batch.
    temperature: multiplies the injected noise variance (1 = posterior).
    preconditioner: ``None`` or ``"rmsprop"`` (pSGLD, with ``rmsprop_decay``
        and ``rmsprop_eps``; see the module docstring).
    max_gradient_noise: with minibatches, the adapted step is also capped so
        that the worst coordinate's gradient-noise ratio stays below this
        (``None``: no cap; ignored for a given ``step_size``).
    init_strategy: start used when ``run`` gets ``init=None``: ``"prior"``
        (one prior draw) or ``"zeros"``.
    target_ess, max_stretch: effective-sample-size target of the draws (worst
        coordinate; ``None``: half of ``num_samples``; 0: off); the thinning
        is multiplied by an integer up to ``max_stretch``, chosen from a pilot
        autocorrelation estimate of the second half of burn-in; a target out
        of reach (the pilot asks for more than twice ``max_stretch``, or for
        more than ``max_stretch`` while too short to resolve its slowest
        coordinate) is not chased: the run keeps its length (``stretch`` 1,
        ``stretch_needed`` says what was asked for; :mod:`.sgmcmc.schedules`). To raise a client's ESS raise ``num_samples`` and
        ``target_ess`` (and ``max_stretch``).
    num_chains: independent chains per client (vmapped over chain keys by the
        one-round methods; draws are stacked chain-major, so client R-hat is real).

    Minibatch noise inflates the variance: in coordinate ``i`` the gradient
    noise adds ``(eps/2)^2 G_i^2 V_i`` per step (``V_i`` the variance of the
    minibatch gradient's coordinate, ``G`` the metric, 1 without
    preconditioner) to the injected ``eps T G_i``, a relative excess variance
    of about ``r_i = eps G_i V_i / (4 T)`` in that coordinate (the posterior
    variance cancels; see :mod:`fedprob.inference.sgmcmc`). ``max_i r_i`` is
    reported as the diagnostic ``gradient_noise_ratio`` and bounded by
    ``max_gradient_noise`` when the step is adapted (then small batches of a
    large client give small steps and a longer run: check ``ess``).

    Diagnostics: ``grad_norm``, ``log_density`` (means over the last steps
    of the sampling blocks, one per draw), ``nonfinite`` / ``finite``, ``ess`` (smallest per-coordinate ESS
    of the draws), ``step_size`` (of the sampling phase), ``stretch``, ``stretch_needed``,
    ``burnin_restarts`` / ``sampling_restarts`` (burn-in windows / sampling
    blocks rolled back after a NaN/inf, adapted step only),
    ``gradient_noise_ratio``.
    """

    step_size: Optional[float] = None
    preconditioner: Optional[str] = None
    rmsprop_decay: float = 0.99
    rmsprop_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        if self.preconditioner not in PRECONDITIONERS:
            raise ValueError(f"unknown preconditioner {self.preconditioner!r} (use None or 'rmsprop')")
        check_fraction("rmsprop_decay", self.rmsprop_decay, high_open=True)
        check_positive("rmsprop_eps", self.rmsprop_eps)

    def kernel(self, problem) -> Kernel:
        """SGLD, or pSGLD whose ``V`` adapts during burn-in and is frozen (decay 1) for sampling."""
        vg, T, n = problem.grad, self.temperature, problem.n

        if self.preconditioner is None:
            def step(k, s, eps, noisy=True):
                kg, kn = jax.random.split(k)
                lp, g = vg(s.position, kg)
                s = sgld_step(kn, s, g, eps, T * noisy)
                return s, step_info(lp, g, s.position)

            return Kernel(sgld_init, step, SGLD_RATE, noise_scale=lambda s: 1.0 / (4.0 * T))

        def psgld(decay):
            def step(k, s, eps, noisy=True):
                kg, kn = jax.random.split(k)
                lp, g = vg(s.position, kg)
                s = psgld_step(kn, s, g, eps, T * noisy, decay, self.rmsprop_eps, n)
                return s, step_info(lp, g, s.position)
            return step

        def metric(s):
            return rmsprop_preconditioner(s.square_avg, self.rmsprop_eps)

        return Kernel(lambda z, k: psgld_init(z, vg(z, k)[1], n), psgld(self.rmsprop_decay), SGLD_RATE,
                      sample_step=psgld(1.0), metric=metric, noise_scale=lambda s: metric(s) / (4.0 * T),
                      init_key=True)


__all__ = ["SGLD", "SGLDState", "PSGLDState", "sgld_init", "sgld_step", "psgld_init", "psgld_step",
           "rmsprop_preconditioner", "rms_update", "SGLD_RATE"]
