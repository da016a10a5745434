"""Cyclical SGHMC (Zhang et al. 2020): cosine step-size cycles, explore then sample.

A schedule on the SG-MCMC driver (:mod:`fedprob.inference.sgmcmc`) with the SGHMC
kernel. After ``num_burnin`` SGHMC steps (where the step is
adapted to the curvature and capped for the gradient noise, then FROZEN),
step ``t = 1, 2, ...`` of the sampling phase uses the learning rate

    eta_t = eta0 / 2 * (cos(pi * mod(t - 1, C) / C) + 1)

(``C`` the cycle length: ``eta0`` at the start of every cycle, decaying to
almost 0 at its end). Within a cycle, the steps with
``mod(t - 1, C) < ceil(beta * C)`` (``beta = exploration``) are noise-free
momentum SGD on ``-log_density`` (exploration: no noise enters the update
whatever the temperature); the rest are SGHMC steps with noise
``N(0, 2 alpha eta_t T)``. The momentum carries over between cycles. The
step never depends on the current state during sampling (a state-dependent
step tilts the stationary density towards high curvature).

Draws: ``samples_per_cycle`` per cycle, spread evenly in integrated step
(``sum_t eta_t``, the time the dynamics sees) over the noisy phase after its
first 30% (left to re-equilibrate after the noise-free exploration), the last
at the cycle's last step; even spacing in steps would put several draws in
the tail of the cycle, where the step is near 0 and they are nearly
identical (:func:`fedprob.inference.sgmcmc.schedules.cyclical_schedule`). With
``exploration = 1`` no noise is ever injected: the draws are the snapshots of
cyclical momentum SGD at the last ``samples_per_cycle`` steps of each cycle
(a snapshot ensemble).

Calibration. The noise-free exploration ends near a mode and the decaying
sampling phase must spread the chain out again before the draws: its
integrated step must cover a few relaxation times of the slowest
direction. The default ``exploration`` is therefore 0.5 (with 0.8 the
noisy phase of a cycle moves about 14 times less, and draws came out 0.6 to
0.9 of the exact sds on ill-conditioned regressions), and with the
effective-sample-size target (``target_ess``) the cycles are lengthened
(up to ``max_stretch`` times) from a pilot estimate of the autocorrelation
time (burn-in) until the equilibration part of each cycle's noisy phase
covers ``CYCLE_RELAXATIONS`` of them and the draws reach the target. On the
unimodal oracles this costs: a cycle spends half its steps exploring and the
draws need the rest, so cyclical SGHMC reaches a given ESS with several times
more gradients than SGHMC; its strength is moving between modes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from .sghmc import SGHMC_RATE, check_friction, sghmc_kernel
from .sgmcmc import Kernel, Sampler, check_fraction, check_int, cyclical_schedule

Array = jax.Array

#: ``eta0 * lambda_max`` of the adapted default initial learning rate (see ``sgmcmc``);
#: on a quadratic, momentum SGD with friction alpha is stable up to 2 (2 - alpha). The
#: burn-in runs SGHMC at ``SGHMC_RATE``; eta0 is ``CSGHMC_RATE / SGHMC_RATE`` times its
#: frozen step.
CSGHMC_RATE = 0.5
#: Cycle length when neither ``cycle_length`` nor ``num_steps`` is given.
DEFAULT_CYCLE_LENGTH = 500


def cyclical_step_size(t, step_size, cycle_length) -> Array:
    """``eta0 / 2 * (cos(pi * mod(t - 1, C) / C) + 1)`` for steps ``t = 1, 2, ...``."""
    j = jnp.mod(jnp.asarray(t) - 1, cycle_length)
    return 0.5 * step_size * (jnp.cos(jnp.pi * j / cycle_length) + 1.0)


def is_exploration(t, cycle_length, exploration) -> Array:
    """True where ``mod(t - 1, C) < exploration * C`` (no noise at step ``t``)."""
    j = jnp.mod(jnp.asarray(t) - 1, cycle_length)
    return j < math.ceil(exploration * cycle_length)


@dataclasses.dataclass(frozen=True)
class CyclicalSGHMC(Sampler):
    """Cyclical SGHMC on one client's target (see the module docstring).

    step_size: eta0, the learning rate at the start of each cycle (acts on the
        gradient of the log posterior, a sum over the client's points);
        ``None``: ``0.5 / lambda_max``, ``lambda_max`` the largest curvature
        of the target, adapted during burn-in (SGHMC at half that rate) and
        frozen for the cycles (see :mod:`fedprob.inference.sgmcmc`; it scales
        like ``1 / n_k``). A given step size burns in at ``step_size / 2``.
    num_burnin: SGHMC steps before the first cycle (adaptation, pilot ESS).
    num_cycles: number of cycles.
    cycle_length / num_steps: the cycle length C, or the total number of
        steps of the cycles (then ``C = ceil(num_steps / num_cycles)``); at
        most one of the two; neither means ``C = 500``.
    exploration: beta, the noise-free fraction of every cycle (default 0.5:
        see "Calibration" in the module docstring).
    samples_per_cycle: draws kept at the end of every cycle.
    friction: alpha (momentum decay ``1 - alpha``). The default 0.3 is
        higher than the 0.1 of the one-round predictive paper's code: with
        0.1 the long noise-free momentum phase can resonate on targets whose
        curvature varies along the path (a regression's noise scale) and
        diverge; 0.3 damps it.
    batch_size, temperature, max_gradient_noise, init_strategy: as in
        :class:`~fedprob.inference.SGLD`. With minibatches and an adapted
        step, the noisy steps are capped at the frozen gradient-noise cap of
        the end of burn-in (worst coordinate's ratio at most
        ``max_gradient_noise``) and the exploration steps at 10 times it:
        minibatch noise makes momentum SGD with a large constant rate hot,
        and the small steps of the sampling phase could not cool the chain.
    target_ess, max_stretch: the cycle length is multiplied by an integer
        up to ``max_stretch`` so that each cycle's noisy phase covers a few
        pilot autocorrelation times and the draws reach ``target_ess``
        effective draws (``None``: half the draws; 0: off); a target out of
        reach is not chased (as in :class:`~fedprob.inference.SGLD`;
        ``stretch_needed`` reports what the pilot asked for).

    Draws: ``num_cycles * samples_per_cycle``. Diagnostics: ``grad_norm``,
    ``log_density`` and ``kinetic_temperature`` averaged over the noisy
    steps, ``nonfinite`` / ``finite``, ``ess``, ``step_size`` (eta0),
    ``stretch``, ``stretch_needed``, ``gradient_noise_ratio`` (worst coordinate, at the largest
    noisy learning rate), ``burnin_restarts`` and ``sampling_restarts``
    (burn-in windows / sampling blocks rolled back after a NaN/inf, with the
    step halved from then on; adapted step only).
    num_chains: independent chains per client (vmapped over chain keys by the
    one-round methods; draws are stacked chain-major, so client R-hat is real).
    """

    step_size: Optional[float] = None
    num_cycles: int = 4
    cycle_length: Optional[int] = None
    num_steps: Optional[int] = None
    exploration: float = 0.5
    samples_per_cycle: int = 25
    friction: float = 0.3
    num_burnin: int = 500

    def __post_init__(self):
        super().__post_init__()
        check_friction(self.friction)
        check_int("num_cycles", self.num_cycles, 1)
        check_int("samples_per_cycle", self.samples_per_cycle, 1)
        check_fraction("exploration", self.exploration)
        if self.cycle_length is not None and self.num_steps is not None:
            raise ValueError("give cycle_length or num_steps, not both "
                             f"(got cycle_length={self.cycle_length}, num_steps={self.num_steps})")
        if self.cycle_length is not None:
            check_int("cycle_length", self.cycle_length, 1)
        if self.num_steps is not None:
            check_int("num_steps", self.num_steps, 1)
        if self.samples_per_cycle > self.length:
            raise ValueError(f"samples_per_cycle={self.samples_per_cycle} exceeds the cycle "
                             f"length {self.length}")

    @property
    def length(self) -> int:
        """The cycle length C."""
        if self.cycle_length is not None:
            return self.cycle_length
        if self.num_steps is not None:
            return -(-self.num_steps // self.num_cycles)
        return DEFAULT_CYCLE_LENGTH

    @property
    def num_samples(self) -> int:
        return self.num_cycles * self.samples_per_cycle

    def sample_steps(self) -> tuple:
        """Indices ``mod(t - 1, C)`` (within a cycle) of the steps whose position is a draw."""
        return self.schedule().draw_steps()

    def schedule(self):
        """The runner's :class:`~fedprob.inference.sgmcmc.Schedule` of the cycles."""
        return cyclical_schedule(self.num_cycles, self.length, self.exploration, self.samples_per_cycle,
                                 CSGHMC_RATE / SGHMC_RATE)

    def kernel(self, problem) -> Kernel:
        """The SGHMC kernel; burn-in runs at ``SGHMC_RATE``, the cycles peak at ``CSGHMC_RATE``."""
        return sghmc_kernel(problem.grad, self.friction, self.temperature)


__all__ = ["CyclicalSGHMC", "cyclical_step_size", "is_exploration", "CSGHMC_RATE"]
