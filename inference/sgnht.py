"""Stochastic-gradient Nosé-Hoover thermostat, SGNHT (Ding et al. 2014), momentum form.

Ding et al. write the dynamics with step ``h``, momentum ``p``, a thermostat
``xi`` and diffusion ``A``, ``g`` the (minibatch) gradient of the client's log
posterior and ``d`` the dimension::

    p  <- p + h g - h xi p + N(0, 2 A h T)
    w  <- w + h p
    xi <- xi + h (p'p / d - T)

In the "SGD with momentum" parametrisation of :mod:`.sghmc` (``v = h p``,
learning rate ``eta = h^2``, friction ``alpha = h xi``, ``a = h A``) this is::

    v     <- (1 - alpha) v + eta g + N(0, 2 a eta T)
    w     <- w + v
    alpha <- alpha + eta (K - T),       K = mean(v^2) (1 - alpha / 2) / eta

SGHMC with friction ``a`` whose friction is learnt: the thermostat raises
``alpha`` while the kinetic temperature ``K`` is above ``T`` and lowers it
below, so minibatch gradient noise of unknown size (which heats the momentum
like extra injected noise) is absorbed by extra friction instead of widening
the draws (exactly so in the continuous-time limit when the noise is the same
in every coordinate; Ding et al., Sec. 3). With gradient-noise variance
``eta^2 V`` per step the fixed point is ``alpha = a + eta V / (2 T)``, the
friction SGHMC would need to know.

One documented choice: ``K`` is SGHMC's kinetic temperature
(:func:`~fedprob.inference.sghmc.kinetic_temperature`), with the factor
``1 - alpha / 2`` of the discrete momentum's equilibrium variance
``eta T / (1 - alpha / 2)``; Ding et al.'s ``mean(v^2) / eta`` (their
``p'p / d``) is its continuous-time limit. Holding ``mean(v^2) / eta`` itself
at ``T`` cools the discrete chain: the stationary variance of the position
comes out ``1 - a / 2`` of the exact one (5% too small at ``a = 0.1``) at
every step size. The thermostat fluctuates around its mean by about
``sqrt(eta T / d)``, small against ``a`` at the adapted step.

The thermostat absorbs gradient noise only while ``alpha < 2`` (the
momentum's decay ``|1 - alpha| < 1``): a gradient-noise ratio ``r = eta V /
(2 a T)`` puts the fixed point at ``a (1 + r)``, so ``r`` must stay below
``2 / a - 1`` (19 at ``a = 0.1``). The adapted step keeps ``r`` below
``max_gradient_noise`` (0.1) as for SGHMC; a given ``step_size`` with small
batches of a large client can exceed the limit (the chain diverges, and the
client's draws come back NaN and flagged).

The chain starts with zero momentum and ``alpha = a``; a rolled-back burn-in
window or sampling block restarts from there. The step size, the burn-in and
the draws are the driver's (:mod:`fedprob.inference.sgmcmc`), with SGHMC's
rate and gradient-noise ratio ``eta V_i / (2 a T)`` (injected noise ``2 a
eta T`` per step).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .sghmc import SGHMC_RATE, kinetic_temperature, sghmc_noise_scale
from .sgmcmc import Kernel, ThinnedSampler, check_fraction, step_info

Array = jax.Array


class SGNHTState(NamedTuple):
    position: Array
    momentum: Array
    thermostat: Array     # () the friction alpha


def sgnht_init(position, diffusion=0.1) -> SGNHTState:
    """Zero momentum, thermostat at ``a`` (``diffusion``)."""
    position = jnp.asarray(position)
    return SGNHTState(position, jnp.zeros_like(position), jnp.asarray(diffusion, position.dtype))


def sgnht_step(key, state: SGNHTState, grad, step_size, diffusion, temperature=1.0) -> SGNHTState:
    """``v <- (1 - alpha) v + eta g + sqrt(2 a eta T) xi``; ``w <- w + v``;
    ``alpha <- alpha + mean(v^2) (1 - alpha / 2) - eta T`` (``xi ~ N(0, I)`` over the flat vector)."""
    v0 = state.momentum
    noise = jax.random.normal(key, v0.shape, v0.dtype)
    v = ((1.0 - state.thermostat) * v0 + step_size * grad
         + jnp.sqrt(2.0 * diffusion * step_size * temperature) * noise)
    alpha = state.thermostat + step_size * (kinetic_temperature(v, step_size, state.thermostat) - temperature)
    return SGNHTState(state.position + v, v, alpha)


@dataclasses.dataclass(frozen=True)
class SGNHT(ThinnedSampler):
    """SGNHT on one client's target (see the module docstring).

    step_size: eta (acts on the gradient of the log posterior, a sum over the
        client's points); ``None`` adapts it during burn-in to
        ``0.25 / lambda_max`` as for SGHMC (see :mod:`fedprob.inference.sgmcmc`).
    diffusion: a in (0, 1], the injected noise ``2 a eta T`` per step and the
        thermostat's start and centre (SGHMC's friction).
    num_burnin, num_samples, thinning, batch_size, temperature,
        max_gradient_noise, init_strategy, target_ess, max_stretch, num_chains:
        as in :class:`~fedprob.inference.SGHMC`.

    Diagnostics: those of SGHMC (``kinetic_temperature`` near ``T``: the
    thermostat holds it there) and ``thermostat``, the mean friction (above
    ``diffusion`` by what absorbs the minibatch noise).
    """

    step_size: Optional[float] = None
    diffusion: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        check_fraction("diffusion", self.diffusion, low_open=True)

    def kernel(self, problem) -> Kernel:
        vg, a, T = problem.grad, self.diffusion, self.temperature

        def step(k, s, eta, noisy=True):
            kg, kn = jax.random.split(k)
            lp, g = vg(s.position, kg)
            s = sgnht_step(kn, s, g, eta, a, T * noisy)
            info = step_info(lp, g, s.position)
            info["kinetic_temperature"] = kinetic_temperature(s.momentum, eta, s.thermostat)
            info["thermostat"] = s.thermostat
            return s, info

        return Kernel(lambda z: sgnht_init(z, a), step, SGHMC_RATE,
                      noise_scale=lambda s: sghmc_noise_scale(a, T),
                      reset=lambda s: sgnht_init(s.position, a))


__all__ = ["SGNHT", "SGNHTState", "sgnht_init", "sgnht_step"]
