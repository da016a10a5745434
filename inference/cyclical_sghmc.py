"""Cyclical SGHMC (Zhang et al. 2020): cosine step-size cycles, explore then sample.

Step ``t = 1, 2, ...`` uses the learning rate

    eta_t = eta0 / 2 * (cos(pi * mod(t - 1, C) / C) + 1)

(``C`` the cycle length: ``eta0`` at the start of every cycle, decaying to
almost 0 at its end). Within a cycle, the steps with
``mod(t - 1, C) < beta * C`` (``beta = exploration``) are noise-free momentum
SGD on ``-log_density`` (:func:`~fedprob.inference.sghmc.momentum_step`,
exploration: no noise is drawn into the update whatever the temperature); the
rest are SGHMC steps with noise ``N(0, 2 alpha eta_t T)``
(:func:`~fedprob.inference.sghmc.sghmc_step`). The momentum carries over
between cycles.

Draws: ``samples_per_cycle`` per cycle, at the end of the cycle: the last
``samples_per_cycle`` of the equal blocks of ``gap = (C - E) //
samples_per_cycle`` steps that end the cycle (``E = ceil(beta C)`` the number
of exploration steps; ``gap = 1`` when the sampling phase is shorter than
``samples_per_cycle``). Draws within a cycle are strongly correlated (the
step is small there); the cycles give the diversity. With
``exploration = 1`` no noise is ever injected: the draws are the snapshots of
cyclical momentum SGD (a snapshot ensemble).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from .base import ClientBackend, ClientResult, Samples
from .sghmc import check_friction, momentum_step, sghmc_init, sghmc_noise_coef, sghmc_step
from .sgmcmc import (ADAPT_EVERY, POWER_ITERS, WARM_ITERS, adapted_step_size, check_common,
                     check_fraction, check_int, check_positive, effective_sample_size,
                     initial_position, log_density_and_grad, step_info)

Array = jax.Array

#: ``eta0 * lambda_max`` of the adapted default initial learning rate (see ``sgmcmc``);
#: momentum SGD with friction 0.1 is stable up to 3.8.
CSGHMC_RATE = 1.0
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
class CyclicalSGHMC(ClientBackend):
    """Cyclical SGHMC on one client's target (see the module docstring).

    step_size: eta0, the learning rate at the start of each cycle (acts on the
        gradient of the log posterior, a sum over the client's points);
        ``None`` sets it at the start of every cycle to ``1 / lambda_max``,
        ``lambda_max`` the largest curvature of the target at that point,
        and re-estimates it every 50 steps until the draw blocks (see
        :mod:`fedprob.inference.sgmcmc`; it scales like ``1 / n_k``).
    num_cycles: number of cycles.
    cycle_length / num_steps: the cycle length C, or the total number of
        steps (then ``C = ceil(num_steps / num_cycles)``); at most one of the
        two; neither means ``C = 500``.
    exploration: beta, the noise-free fraction of every cycle.
    samples_per_cycle: draws kept at the end of every cycle.
    friction: alpha (momentum decay ``1 - alpha``, 0.9 by default).
    batch_size, temperature, max_gradient_noise, init_strategy: as in
        :class:`~fedprob.inference.SGLD` (see "Minibatches" below).

    Minibatches: the learning rate of the noisy steps (not of the
    exploration) is capped at the start of every cycle so that the
    gradient-noise ratio stays below ``max_gradient_noise`` (as in SGHMC;
    ``None``: no cap).

    Draws: ``num_cycles * samples_per_cycle``. Diagnostics: ``grad_norm``
    and ``log_density`` averaged over the noisy (sampling) steps,
    ``nonfinite`` / ``finite``, ``ess``, ``step_size`` (eta0 of the last
    cycle), ``gradient_noise_ratio`` (as in SGHMC, at the mean learning
    rate of the sampling steps) and ``burnin_restarts`` (50-step segments
    before the draw blocks rolled back after a NaN/inf, with zero momentum
    and a halved step from then on; adapted step only).
    """

    step_size: Optional[float] = None
    num_cycles: int = 4
    cycle_length: Optional[int] = None
    num_steps: Optional[int] = None
    exploration: float = 0.8
    samples_per_cycle: int = 5
    friction: float = 0.1
    batch_size: Optional[int] = None
    temperature: float = 1.0
    max_gradient_noise: Optional[float] = 0.1
    init_strategy: str = "prior"

    output = "samples"

    def __post_init__(self):
        check_common(self)
        check_friction(self.friction)
        check_positive("max_gradient_noise", self.max_gradient_noise, allow_none=True)
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
        C, s = self.length, self.samples_per_cycle
        E = math.ceil(self.exploration * C)
        gap = max((C - E) // s, 1)
        return tuple(C - 1 - gap * (s - 1 - i) for i in range(s))

    def run(self, key, potential, target, init=None) -> ClientResult:
        k_init, k_run, k_noise = jax.random.split(key, 3)
        z0 = initial_position(potential, k_init, init, self.init_strategy)
        vg = log_density_and_grad(potential, target, self.batch_size)
        alpha, T, C, s_per = self.friction, self.temperature, self.length, self.samples_per_cycle
        E = math.ceil(self.exploration * C)
        steps = self.sample_steps()
        gap = steps[1] - steps[0] if s_per > 1 else max(C - E, 1)
        head = C - s_per * gap
        fixed = None if self.step_size is None else jnp.asarray(self.step_size, z0.dtype)
        capped = self.batch_size is not None and T > 0 and self.max_gradient_noise is not None
        inf = jnp.array(jnp.inf, z0.dtype)

        def kernel(carry, xs):
            s, eta0, cap = carry
            k, j = xs                      # j = mod(t - 1, C)
            kg, kn = jax.random.split(k)
            lp, g = vg(s.position, kg)
            eta = cyclical_step_size(j + 1, eta0, C).astype(z0.dtype)
            noisy = j >= E
            s_noise = sghmc_step(kn, s, g, jnp.minimum(eta, cap), alpha, T)
            s_plain = momentum_step(s, g, eta, alpha)
            s = jax.tree_util.tree_map(lambda a, b: jnp.where(noisy, a, b), s_noise, s_plain)
            info = step_info(lp, g, s.position)
            info["noisy"] = noisy
            return (s, eta0, cap), info

        def run_steps(carry, k, start, length):
            return jax.lax.scan(kernel, carry, (jax.random.split(k, length), start + jnp.arange(length)))

        def estimate(k, s, v, iters):
            return adapted_step_size(CSGHMC_RATE, potential, target, self.batch_size, s.position, k,
                                     None, v, iters)

        # The head of a cycle (before the draw blocks) runs in segments; with an
        # adapted step eta0 is re-estimated (warm start) at each segment start.
        n_seg, seg_rest = divmod(head, ADAPT_EVERY) if fixed is None else (0, head)

        def zero_momentum(st):
            return st._replace(momentum=jnp.zeros_like(st.momentum))

        def cycle(carry, k):
            s, v, m, r = carry
            k_est, k_cap, k_rest, k_seg, k_blocks = jax.random.split(k, 5)
            if fixed is None:
                eta0, v = estimate(k_est, s, v, POWER_ITERS)
                eta0 = eta0 * m
            else:
                eta0 = fixed
            cap = inf
            if capped:
                # Learning rate of the noisy steps at most max_gradient_noise / coef.
                cap = self.max_gradient_noise / jnp.maximum(
                    sghmc_noise_coef(vg, s.position, k_cap, alpha, T), jnp.finfo(z0.dtype).tiny)
            c = (s, eta0, cap)
            infos = []
            if seg_rest:
                c, info = run_steps(c, k_rest, 0, seg_rest)
                infos.append(info)
            if n_seg:
                def segment(cc, xs):
                    (s_, e_, cap_), v_, m_, r_ = cc
                    ks, start = xs
                    k1, k2 = jax.random.split(ks)
                    e_, v_ = estimate(k1, s_, v_, WARM_ITERS)
                    c_, info = run_steps((s_, e_ * m_, cap_), k2, start, ADAPT_EVERY)
                    # Roll a segment that produced NaN/inf back (zero momentum), halve the step.
                    ok = jnp.all(info["finite"])
                    s_ = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), c_[0], zero_momentum(s_))
                    m_ = jnp.where(ok, m_, 0.5 * m_)
                    return ((s_, c_[1], cap_), v_, m_, r_ + (~ok).astype(jnp.int32)), info

                starts = seg_rest + ADAPT_EVERY * jnp.arange(n_seg)
                (c, v, m, r), info = jax.lax.scan(segment, (c, v, m, r),
                                                  (jax.random.split(k_seg, n_seg), starts))
                infos.append(jax.tree_util.tree_map(lambda a: a.reshape(-1), info))

            def block(cc, xs):
                kb, start = xs
                cc, info = run_steps(cc, kb, start, gap)
                return cc, (cc[0].position, info)

            starts = head + gap * jnp.arange(s_per)
            c, (draws, info_blocks) = jax.lax.scan(block, c, (jax.random.split(k_blocks, s_per), starts))
            infos.append(jax.tree_util.tree_map(lambda a: a.reshape(-1), info_blocks))
            info = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *infos)
            return (c[0], v, m, r), (draws, info, c[1], c[2], jnp.all(info_blocks["finite"]))

        v0 = jax.random.normal(jax.random.fold_in(k_run, 1), z0.shape, z0.dtype)
        carry0 = (sghmc_init(z0), v0, jnp.ones((), z0.dtype), jnp.zeros((), jnp.int32))
        (state, _, _, restarts), (draws, info, eta0s, caps, block_finite) = jax.lax.scan(
            cycle, carry0, jax.random.split(k_run, self.num_cycles))
        draws = draws.reshape(-1, z0.shape[0])
        info = jax.tree_util.tree_map(lambda a: a.reshape(-1), info)
        noisy = info["noisy"].astype(z0.dtype)
        weight = noisy / jnp.maximum(jnp.sum(noisy), 1.0)

        def noisy_mean(a):
            # Every step counts when no step is noisy (exploration = 1).
            return jnp.where(jnp.sum(noisy) > 0, jnp.sum(weight * a), jnp.mean(a))

        # Segments that failed were rolled back (burnin_restarts); the draw blocks
        # and the draws themselves must be finite.
        finite = (jnp.all(block_finite) & jnp.all(jnp.isfinite(draws))
                  & jnp.all(jnp.isfinite(state.position)))
        ess = effective_sample_size(draws)
        eta0 = eta0s[-1]
        # Mean learning rate over the noisy steps of the last cycle.
        sched = jnp.asarray([0.5 * (math.cos(math.pi * j / C) + 1.0) for j in range(E, C)] or [0.0],
                            z0.dtype)
        eta_bar = jnp.mean(jnp.minimum(eta0 * sched, caps[-1]))
        diag = {
            "grad_norm": noisy_mean(info["grad_norm"]),
            "log_density": noisy_mean(info["log_density"]),
            "nonfinite": ~finite,
            "finite": finite,
            "ess": jnp.where(jnp.all(jnp.isfinite(ess)), jnp.min(ess), 0.0),
            "step_size": eta0,
            "burnin_restarts": restarts,
            "gradient_noise_ratio": (jnp.zeros((), z0.dtype) if self.batch_size is None else
                                     eta_bar * sghmc_noise_coef(vg, state.position, k_noise, alpha, T)),
        }
        return ClientResult(Samples(draws), state.position, diag)


__all__ = ["CyclicalSGHMC", "cyclical_step_size", "is_exploration", "CSGHMC_RATE"]
