"""Stochastic gradient Hamiltonian Monte Carlo (Chen et al. 2014), momentum form.

With friction ``alpha``, learning rate ``eta`` and ``g`` the (minibatch)
gradient of the client's log posterior::

    v <- (1 - alpha) v + eta g + N(0, 2 alpha eta T)
    w <- w + v

(the "SGD with momentum" parametrisation: momentum decay ``1 - alpha``).
Without the noise term this is heavy-ball momentum SGD on ``-log_density``
(:func:`momentum_step`). For slowly varying directions the chain behaves like
SGLD with step ``2 eta / alpha``. At stationarity ``v`` has variance about
``eta T / (1 - alpha / 2)`` per coordinate; the diagnostic
``kinetic_temperature = mean(v^2) (1 - alpha/2) / eta`` estimates the
temperature the chain actually runs at (above ``T`` when minibatch gradient
noise is not negligible against the injected noise).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .sgmcmc import Kernel, ThinnedSampler, check_fraction, step_info

Array = jax.Array

#: ``eta * lambda_max`` of the adapted default learning rate (see ``sgmcmc``): with
#: friction 0.1 the stiffest direction's stationary variance is about 7% too large.
SGHMC_RATE = 0.25


class SGHMCState(NamedTuple):
    position: Array
    momentum: Array


def sghmc_init(position, momentum=None) -> SGHMCState:
    """State with zero momentum unless one is given."""
    position = jnp.asarray(position)
    momentum = jnp.zeros_like(position) if momentum is None else jnp.asarray(momentum)
    return SGHMCState(position, momentum)


def momentum_step(state: SGHMCState, grad, step_size, friction) -> SGHMCState:
    """Noise-free step: ``v <- (1 - alpha) v + eta g``; ``w <- w + v``."""
    v = (1.0 - friction) * state.momentum + step_size * grad
    return SGHMCState(state.position + v, v)


def sghmc_step(key, state: SGHMCState, grad, step_size, friction, temperature=1.0,
               draw: bool = True) -> SGHMCState:
    """``v <- (1 - alpha) v + eta g + sqrt(2 alpha eta T) xi``; ``w <- w + v``.

    ``draw=False`` (with ``temperature=0``): ``xi`` is zeros instead of a draw, the same numbers
    without the cost of the draw."""
    v0 = state.momentum
    noise = jax.random.normal(key, v0.shape, v0.dtype) if draw else jnp.zeros_like(v0)
    v = (1.0 - friction) * v0 + step_size * grad + jnp.sqrt(2.0 * friction * step_size * temperature) * noise
    return SGHMCState(state.position + v, v)


def sghmc_step_where(key, state: SGHMCState, grad, step_size, friction, temperature, noisy) -> SGHMCState:
    """:func:`sghmc_step` at ``temperature`` where the traced bool ``noisy`` holds, else at 0 (momentum
    SGD: cyclical SGHMC's exploration steps). The same numbers either way it is compiled:

    * on a CPU, a conditional skips the N(0, I) draw of the noise-free steps (a threefry draw costs
      about a small model's minibatch gradient there);
    * elsewhere (GPU, TPU) the step always draws and scales the noise by ``noisy``: a conditional
      inside the step loop costs more there than the draw (on an H200, cyclical SGHMC's step, the
      conditional included, took 2.0 times plain SGHMC's: benchmarks/results/inference_steps_nvidia_h200.md).

    At temperature 0 the noise term is exactly zero (``0 * xi``), so both give the same state."""

    def on(step):
        return lambda k, s, g, eta, n: step(k, s, g, eta, friction, temperature, n)

    return jax.lax.platform_dependent(key, state, grad, step_size, noisy, cpu=on(sghmc_step_skipping_draw),
                                      default=on(sghmc_step_scaling_noise))


def sghmc_step_skipping_draw(key, state, grad, step_size, friction, temperature, noisy) -> SGHMCState:
    """:func:`sghmc_step_where` by a conditional: no N(0, I) draw where ``noisy`` is False."""
    return jax.lax.cond(noisy, lambda: sghmc_step(key, state, grad, step_size, friction, temperature),
                        lambda: sghmc_step(key, state, grad, step_size, friction, 0.0, draw=False))


def sghmc_step_scaling_noise(key, state, grad, step_size, friction, temperature, noisy) -> SGHMCState:
    """:func:`sghmc_step_where` without a conditional: the temperature times ``noisy`` (0 or 1)."""
    return sghmc_step(key, state, grad, step_size, friction, temperature * jnp.asarray(noisy, grad.dtype))


def kinetic_temperature(momentum, step_size, friction) -> Array:
    """``mean(v^2) (1 - alpha/2) / eta``: the temperature implied by the momentum."""
    return jnp.mean(momentum * momentum) * (1.0 - 0.5 * friction) / step_size


def check_friction(friction) -> None:
    check_fraction("friction", friction, low_open=True)


@dataclasses.dataclass(frozen=True)
class SGHMC(ThinnedSampler):
    """SGHMC on one client's target (see the module docstring).

    step_size: eta (acts on the gradient of the log posterior, a sum over the
        client's points); ``None`` adapts it during burn-in to
        ``0.25 / lambda_max``, ``lambda_max`` the largest curvature of the
        target (see :mod:`fedprob.inference.sgmcmc`), which scales like
        ``1 / n_k``.
    friction: alpha in (0, 1] (momentum decay ``1 - alpha``).
    num_burnin, num_samples, thinning, batch_size, temperature,
        max_gradient_noise, init_strategy, target_ess, max_stretch: as in
        :class:`~fedprob.inference.SGLD`.

    Diagnostics: those of SGLD (``grad_norm``, ``log_density``,
    ``nonfinite`` / ``finite``, ``ess``, ``step_size``, ``stretch``, ``stretch_needed``,
    ``burnin_restarts``, ``sampling_restarts``, ``gradient_noise_ratio`` =
    ``eta max_i V_i / (2 alpha T)``, the worst coordinate's ratio of
    minibatch-noise to injected-noise variance per step) and
    ``kinetic_temperature`` (see the module docstring).
    num_chains: independent chains per client (vmapped over chain keys by the
    one-round methods; draws are stacked chain-major, so client R-hat is real).
    """

    step_size: Optional[float] = None
    friction: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        check_friction(self.friction)

    def kernel(self, problem) -> Kernel:
        return sghmc_kernel(problem.grad, self.friction, self.temperature)


def sghmc_kernel(vg, friction, temperature, rate=SGHMC_RATE) -> Kernel:
    """SGHMC on ``vg``'s gradient: ``step(key, state, eta, noisy)`` (``noisy`` False: no injected
    noise, i.e. momentum SGD) with the kinetic temperature among its scalars; a rolled-back
    window restarts with zero momentum."""

    def step(k, s, eta, noisy=True):
        kg, kn = jax.random.split(k)
        lp, g = vg(s.position, kg)
        if isinstance(noisy, bool):
            s = sghmc_step(kn, s, g, eta, friction, temperature * noisy)
        else:
            s = sghmc_step_where(kn, s, g, eta, friction, temperature, noisy)
        info = step_info(lp, g, s.position)
        info["kinetic_temperature"] = kinetic_temperature(s.momentum, eta, friction)
        return s, info

    return Kernel(sghmc_init, step, rate, noise_scale=lambda s: sghmc_noise_scale(friction, temperature),
                  reset=lambda s: s._replace(momentum=jnp.zeros_like(s.momentum)))


def sghmc_noise_scale(friction, temperature):
    """``1 / (2 alpha T)``: minibatch over injected noise variance per unit ``eta`` and unit
    gradient variance (see :mod:`fedprob.inference.sgmcmc.curvature`)."""
    return 1.0 / (2.0 * friction * temperature)


__all__ = ["SGHMC", "SGHMCState", "sghmc_init", "sghmc_step", "sghmc_step_where", "sghmc_step_skipping_draw",
           "sghmc_step_scaling_noise", "momentum_step", "kinetic_temperature", "sghmc_kernel", "sghmc_noise_scale",
           "SGHMC_RATE"]
