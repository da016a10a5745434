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

Calibration. The noise-free exploration ends near a mode, and the short,
decaying sampling phase must spread the chain out again before the draws;
when it is short against the mixing time the draws are too narrow (on the
tests' linear regression the sds come out 0.88 of the exact ones with the
defaults, 0.77 with cycles of 200 steps, 1.0 with ``exploration=0.5``).
For calibrated moments lower ``exploration`` or lengthen the cycles; the
method's strength is moving between modes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedprob.posteriors import Samples
from fedprob.protocols import ClientBackend, ClientResult
from .sghmc import check_friction, momentum_step, sghmc_init, sghmc_noise_coef, sghmc_step
from .sgmcmc import (ADAPT_EVERY, EARLY_LOOSENESS, POWER_ITERS, WARM_ITERS, adapted_step_size,
                     check_common,
                     check_fraction, check_int, check_positive, effective_sample_size,
                     initial_position, log_density_and_grad, step_info)

Array = jax.Array

#: ``eta0 * lambda_max`` of the adapted default initial learning rate (see ``sgmcmc``);
#: on a quadratic, momentum SGD with friction alpha is stable up to 2 (2 - alpha).
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
class CyclicalSGHMC(ClientBackend):
    """Cyclical SGHMC on one client's target (see the module docstring).

    step_size: eta0, the learning rate at the start of each cycle (acts on the
        gradient of the log posterior, a sum over the client's points);
        ``None`` sets it at the start of every cycle to ``0.5 / lambda_max``,
        ``lambda_max`` the largest curvature of the target at that point,
        and re-estimates it about every 50 steps (see
        :mod:`fedprob.inference.sgmcmc`; it scales like ``1 / n_k``).
    num_cycles: number of cycles.
    cycle_length / num_steps: the cycle length C, or the total number of
        steps (then ``C = ceil(num_steps / num_cycles)``); at most one of the
        two; neither means ``C = 500``.
    exploration: beta, the noise-free fraction of every cycle.
    samples_per_cycle: draws kept at the end of every cycle.
    friction: alpha (momentum decay ``1 - alpha``). The default 0.3 is
        higher than the 0.1 of the one-round predictive paper's code: with
        0.1 the long noise-free momentum phase can resonate on targets whose
        curvature varies along the path (a regression's noise scale) and
        diverge; 0.3 damps it.
    batch_size, temperature, max_gradient_noise, init_strategy: as in
        :class:`~fedprob.inference.SGLD` (see "Minibatches" below).

    Minibatches: with an adapted step, the learning rate of the noisy steps
    is capped (re-estimated about every 50 steps) so that the gradient-noise
    ratio stays below ``max_gradient_noise`` (as in SGHMC; ``None``: no cap;
    a given ``step_size`` is never capped), and that of the
    exploration steps at 10 times that cap: minibatch noise makes momentum
    SGD with a large constant rate hot, and the small steps of the sampling
    phase could not cool the chain down again.

    Draws: ``num_cycles * samples_per_cycle``. Diagnostics: ``grad_norm``
    and ``log_density`` averaged over the noisy (sampling) steps,
    ``nonfinite`` / ``finite`` (NaN/inf in the draws or the final point),
    ``ess``, ``step_size`` (eta0 of the last cycle), ``gradient_noise_ratio``
    (as in SGHMC, at the mean learning rate of the sampling steps) and
    ``burnin_restarts``: with an adapted step a cycle runs in segments of
    about 50 steps; a segment that produces NaN/inf is rolled back (zero
    momentum) and the step halved from then on (draws that fell in it stay
    NaN, so the client is reported non-finite).
    """

    step_size: Optional[float] = None
    num_cycles: int = 4
    cycle_length: Optional[int] = None
    num_steps: Optional[int] = None
    exploration: float = 0.8
    samples_per_cycle: int = 5
    friction: float = 0.3
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
        k_init, k_run, k_noise, k_first = jax.random.split(key, 4)
        z0 = initial_position(potential, k_init, init, self.init_strategy)
        d = z0.shape[0]
        vg = log_density_and_grad(potential, target, self.batch_size)
        alpha, T, C, s_per = self.friction, self.temperature, self.length, self.samples_per_cycle
        E = math.ceil(self.exploration * C)
        adaptive = self.step_size is None
        capped = (adaptive and self.batch_size is not None and T > 0
                  and self.max_gradient_noise is not None)
        # A cycle runs as n_seg segments of L steps (steps past C are masked no-ops); with an
        # adapted step eta0 is re-estimated at every segment start and a segment that
        # produces NaN/inf is rolled back.
        n_seg = -(-C // ADAPT_EVERY) if adaptive else 1
        L = -(-C // n_seg)
        slot = np.full(n_seg * L, -1, np.int32)
        for i, j in enumerate(self.sample_steps()):
            slot[j] = i
        js = jnp.arange(n_seg * L).reshape(n_seg, L)
        slots = jnp.asarray(slot).reshape(n_seg, L)

        def kernel(carry, xs):
            s, eta0, cap, buf = carry
            k, j, sl = xs                      # j = mod(t - 1, C); sl: draw slot or -1
            kg, kn = jax.random.split(k)
            lp, g = vg(s.position, kg)
            eta = cyclical_step_size(j + 1, eta0, C).astype(z0.dtype)
            noisy = j >= E
            s_noise = sghmc_step(kn, s, g, jnp.minimum(eta, cap), alpha, T)
            s_plain = momentum_step(s, g, jnp.minimum(eta, EARLY_LOOSENESS * cap), alpha)
            active = j < C
            s = jax.tree_util.tree_map(lambda a, b, c: jnp.where(active, jnp.where(noisy, a, b), c),
                                       s_noise, s_plain, s)
            i = jnp.maximum(sl, 0)
            buf = buf.at[i].set(jnp.where(sl >= 0, s.position, buf[i]))
            info = step_info(lp, g, s.position)
            info["weight"] = (noisy & active).astype(z0.dtype)
            info["active"] = active
            return (s, eta0, cap, buf), info

        def estimate(k, s, v, iters):
            return adapted_step_size(CSGHMC_RATE, potential, target, self.batch_size, s.position, k,
                                     None, v, iters)

        def segment(carry, xs):
            s, eta0, cap, buf, v, m, r = carry
            k, j, sl = xs
            k_est, k_cap, k_steps = jax.random.split(k, 3)
            if adaptive:
                eta0, v = estimate(k_est, s, v, WARM_ITERS)
                eta0 = eta0 * m
            if capped:
                # learning rate of the noisy steps at most max_gradient_noise / coef (and
                # 10 times that for the exploration steps), re-estimated with the segment
                coef = sghmc_noise_coef(vg, s.position, k_cap, alpha, T, num_pairs=4)
                cap = self.max_gradient_noise / jnp.maximum(coef, jnp.finfo(z0.dtype).tiny)
            (s_new, _, _, buf_new), info = jax.lax.scan(
                kernel, (s, eta0, cap, buf), (jax.random.split(k_steps, L), j, sl))
            if adaptive:
                # roll back (zero momentum) and halve the step on NaN/inf
                ok = jnp.all(info["finite"] | ~info["active"])
                s_new = jax.tree_util.tree_map(
                    lambda a, b: jnp.where(ok, a, b), s_new, s._replace(momentum=jnp.zeros_like(s.momentum)))
                buf_new = jnp.where(ok, buf_new, buf)
                m = jnp.where(ok, m, 0.5 * m)
                r = r + (~ok).astype(jnp.int32)
            return (s_new, eta0, cap, buf_new, v, m, r), info

        def cycle(carry, k):
            s, eta0, v, m, r = carry
            cap = jnp.array(jnp.inf, z0.dtype)
            buf = jnp.full((s_per, d), jnp.nan, z0.dtype)
            (s, eta0, cap, buf, v, m, r), info = jax.lax.scan(
                segment, (s, eta0, cap, buf, v, m, r), (jax.random.split(k, n_seg), js, slots))
            return (s, eta0, v, m, r), (buf, info, eta0, cap)

        state0 = sghmc_init(z0)
        if adaptive:
            eta0, v0 = estimate(k_first, state0, None, POWER_ITERS)
        else:
            eta0, v0 = jnp.asarray(self.step_size, z0.dtype), jnp.zeros_like(z0)
        carry0 = (state0, eta0, v0, jnp.ones((), z0.dtype), jnp.zeros((), jnp.int32))
        (state, _, _, _, restarts), (draws, info, eta0s, caps) = jax.lax.scan(
            cycle, carry0, jax.random.split(k_run, self.num_cycles))
        draws = draws.reshape(-1, d)
        info = jax.tree_util.tree_map(lambda a: a.reshape(-1), info)
        w = info["weight"]
        any_noisy = jnp.sum(w) > 0
        w = jnp.where(any_noisy, w, info["active"].astype(z0.dtype))
        w = w / jnp.maximum(jnp.sum(w), 1.0)

        def mean(a):
            # over the noisy (sampling) steps; over every step when none is noisy (exploration = 1)
            return jnp.sum(jnp.where(w > 0, w * a, 0.0))

        # Segments that failed were rolled back (burnin_restarts): the draws decide.
        finite = jnp.all(jnp.isfinite(draws)) & jnp.all(jnp.isfinite(state.position))
        ess = effective_sample_size(draws)
        eta0 = eta0s[-1]
        # mean learning rate over the noisy steps of the last cycle
        sched = jnp.asarray([0.5 * (math.cos(math.pi * j / C) + 1.0) for j in range(E, C)] or [0.0],
                            z0.dtype)
        eta_bar = jnp.mean(jnp.minimum(eta0 * sched, caps[-1]))
        diag = {
            "grad_norm": mean(info["grad_norm"]),
            "log_density": mean(info["log_density"]),
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
