"""Schedules of the sampling phase (constant step, cosine cycles) and the ESS stretch.

Effective sample size. ``target_ess`` (a number; ``None``: half of
``num_samples``; ``0``: off) asks for at least that many effective draws in
the worst coordinate: a pilot estimate of the integrated autocorrelation
time ``tau`` (in steps, from the positions of the second half of burn-in)
sets how much the sampling phase is stretched (the thinning, or the cycle
length, multiplied by an integer up to ``max_stretch``; shapes stay fixed,
the loops run the chosen number of steps). The diagnostic ``ess`` is the
smallest per-coordinate ESS of the draws (what an aggregator needs), and
``stretch`` the factor used. To raise a client's ESS: raise
``num_samples`` and ``target_ess`` (and ``max_stretch`` if ``stretch``
sits at it). Cost: the stretch multiplies the sampling steps (not the cost of a
step). With many parameters and few draws the smallest per-coordinate ESS of a
short pilot is biased low and its request large (cyclical SGHMC on a
650-parameter softmax regression: 27 times the sampling steps, which the cap
of 10 turned into ten times the steps for about the same ESS): such a request
is out of reach (below). Pass ``target_ess=0`` where a fixed number of steps
matters more than the ESS.

A target out of reach is not chased. Where the pilot asks for more than
``REACH * max_stretch`` (twice the cap), even the longest run would reach
less than half of the target by the pilot's own estimate; and where the
pilot's worst coordinate has fewer than ``MIN_PILOT_ESS`` (5) effective
records, the pilot is shorter than a few of its autocorrelation times and
only bounds them from below, so a request above the cap is a lower bound.
In both cases the sampling phase keeps its length (``stretch`` 1) and
``stretch_needed`` reports what the pilot asked for (a request within the
cap is always granted). Measured: on the digits demo
(``PredictiveBayes(client=CyclicalSGHMC())``, 10 clients of a 650-parameter
softmax regression) the pilot asked for 27 on every client (pilot ESS
2.7 of 50 records); stretched to 10 the smallest ESS of 100 draws went from
2.8-3.2 to 3.7-6.9 for ten times the sampling steps (test accuracy 0.778 ->
0.769, NLL 0.647 -> 0.641). SGLD on a regression with an all-zero input
column (tests/test_sgmcmc_defaults.py): the pilot asked for 19 (pilot ESS
4.0 of 100); stretched to 10, an ESS of 5.9 against the target's 100.
SGLD on ill-conditioned shifted clients (pilot ESS 7.5 of 100, asking for
11) is stretched to 10 and its ESS more than doubles.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .curvature import EARLY_LOOSENESS

Array = jax.Array


def resolve_target_ess(target_ess, num_samples: int) -> float:
    """``None`` -> half the draws; otherwise the number, at most ``num_samples``."""
    if target_ess is None:
        return 0.5 * num_samples
    return float(min(target_ess, num_samples))


#: Burn-in steps between two recorded positions of the pilot (ESS target).
PILOT_EVERY = 5
#: Exploration (noise-free) steps of a cyclical schedule are capped this many times looser.
EXPLORATION_LOOSENESS = EARLY_LOOSENESS
#: Integrated autocorrelation times (pilot tau, in burn-in steps) the equilibration part of
#: a cycle's noisy phase must cover: after the noise-free exploration the chain sits near a
#: mode; for an AR(1)-like chain the variance deficit decays like exp(-4 t / tau) and the
#: offset of the mean like exp(-2 t / tau) (0.25% and 5% left at t = 1.5 tau).
CYCLE_RELAXATIONS = 1.5
#: A target is out of reach (not chased) where the pilot asks for more than ``REACH * max_stretch``,
#: or for more than ``max_stretch`` with fewer than ``MIN_PILOT_ESS`` effective records in its worst
#: coordinate (a pilot that short only bounds the autocorrelation time from below).
REACH = 2
MIN_PILOT_ESS = 5.0
#: The pilot's tau is multiplied by this before the stretch is chosen: the ESS estimate of
#: a short pilot is noisy, and the target is a floor.
ESS_SAFETY = 1.5


class Schedule(NamedTuple):
    """The sampling phase (static): ``num_periods`` periods, each ``pre`` steps without a draw,
    then one block per entry of ``gaps`` (that many steps) that gives one draw (the block's
    last position, or its average). With ``exploration=None`` every step is noisy at the
    frozen step; else a period is a cosine cycle: step ``j`` of a cycle of ``C`` steps runs
    at ``peak / 2 * (cos(pi j / C) + 1)`` times the frozen (burn-in) step, noise-free for
    ``j < ceil(exploration C)``. A stretch factor ``k`` (ESS target) multiplies ``pre``,
    ``gaps`` and ``C`` alike; ``equilibrate`` is the fraction of a cycle's noisy phase (in
    integrated step) before its first draw."""

    num_periods: int
    pre: int
    gaps: tuple
    peak: float = 1.0
    exploration: Optional[float] = None
    equilibrate: float = 0.0

    @property
    def period(self) -> int:
        return self.pre + sum(self.gaps)

    @property
    def draws(self) -> int:
        return len(self.gaps)

    @property
    def num_samples(self) -> int:
        return self.num_periods * self.draws

    @property
    def num_explore(self) -> int:
        return 0 if self.exploration is None else math.ceil(self.exploration * self.period)

    def draw_steps(self) -> tuple:
        """Within-period indices (unstretched) of the steps whose position ends a block."""
        ends = self.pre + np.cumsum(self.gaps) - 1
        return tuple(int(e) for e in ends)

    def factor(self, j, k):
        """``(multiplier, noisy)`` of within-period step ``j`` of a period stretched ``k`` times."""
        if self.exploration is None:
            return 1.0, True
        length = self.period * k
        mult = 0.5 * self.peak * (jnp.cos(jnp.pi * j / length) + 1.0)
        return mult, j >= self.num_explore * k

    def noisy_multipliers(self) -> np.ndarray:
        """The multipliers of the noisy steps of one unstretched period."""
        if self.exploration is None:
            return np.ones(self.period)
        j = np.arange(self.num_explore, self.period)
        return 0.5 * self.peak * (np.cos(np.pi * j / self.period) + 1.0)


def constant_schedule(num_samples: int, thinning: int) -> Schedule:
    """A draw every ``thinning`` steps at the frozen step (SGLD, SGHMC, IASG)."""
    return Schedule(1, 0, (thinning,) * num_samples)


#: Fraction of a cycle's noisy phase (in integrated step) left to re-equilibrate after
#: the noise-free exploration, before the first draw.
EQUILIBRATE = 0.3


def cyclical_schedule(num_cycles: int, cycle_length: int, exploration: float, samples_per_cycle: int,
                      peak: float, equilibrate: float = EQUILIBRATE) -> Schedule:
    """Cosine cycles (Zhang et al. 2020) with ``samples_per_cycle`` draws per cycle.

    The draws are spread evenly in *integrated step* (``sum_j eta_j``, the time the
    dynamics sees) over the noisy phase after its first ``equilibrate`` fraction, the last
    at the cycle's last step: even spacing in steps would put several draws in the cycle's
    tail, where the step is near 0 and they are nearly identical. When the noisy phase is
    too short for distinct steps, the draws are its last ``samples_per_cycle`` steps.
    """
    C, s = cycle_length, samples_per_cycle
    E = math.ceil(exploration * C)
    if E >= C:       # no noisy step: snapshots at the end of the cycle, gap (C - E) // s = 1
        ends = list(range(C - s, C))
    else:
        j = np.arange(E, C)
        t = np.cumsum(0.5 * (np.cos(np.pi * j / C) + 1.0))
        goals = t[-1] * (equilibrate + (1.0 - equilibrate) * np.arange(1, s + 1) / s)
        ends = [int(E + np.searchsorted(t, g - 1e-9 * t[-1])) for g in goals]
        ends[-1] = C - 1
        if any(b <= a for a, b in zip(ends, ends[1:])) or ends[0] < 0:
            ends = list(range(C - s, C))
    gaps = tuple([1] + [b - a for a, b in zip(ends, ends[1:])])
    return Schedule(num_cycles, ends[0], gaps, peak, exploration, equilibrate if E < C else 0.0)


def stretch_factor(schedule: Schedule, tau: Array, target_ess: float, max_stretch: int,
                   step_ratio: Array) -> Array:
    """The integer stretch ``k`` in ``[1, max_stretch]`` that reaches ``target_ess``.

    ``tau``: integrated autocorrelation time in steps of the burn-in step (times
    ``ESS_SAFETY``). Constant schedule: ``S`` draws ``k * thinning`` steps apart give about
    ``S k thinning / tau`` effective draws, so ``k = tau target / (S thinning)``. Cyclical:
    a cycle's noisy phase covers ``k * sum_j step_ratio_j`` burn-in steps' worth of motion;
    its first ``equilibrate`` fraction must cover ``CYCLE_RELAXATIONS`` relaxation times
    (to forget the exploration's end point), and the rest of all cycles ``tau * target``.
    """
    tau = ESS_SAFETY * tau
    if schedule.exploration is None:
        need = tau * target_ess / schedule.period
    else:
        per_cycle = jnp.maximum(jnp.sum(step_ratio), 1e-12)
        f = schedule.equilibrate
        need = tau * target_ess / (schedule.num_periods * max(1.0 - f, 1e-3) * per_cycle)
        if f > 0:
            need = jnp.maximum(need, CYCLE_RELAXATIONS * tau / (f * per_cycle))
    need = jnp.where(jnp.isfinite(need), need, float(max_stretch))
    return jnp.clip(jnp.ceil(need), 1, max_stretch).astype(jnp.int32)


def stretch_needed(schedule: Schedule, tau: Array, target_ess: float, step_ratio: Array) -> Array:
    """The stretch the pilot asks for with no cap (:func:`stretch_factor` without ``max_stretch``),
    an int32 at most ``2**30`` (a pilot with a frozen coordinate asks for that)."""
    big = 2 ** 30
    return stretch_factor(schedule, jnp.minimum(tau, float(big)), target_ess, big, step_ratio)


def chosen_stretch(needed: Array, max_stretch: int, pilot_ess=None) -> Array:
    """The stretch used: ``needed`` capped at ``max_stretch``, and 1 (no stretch) where the target is out
    of reach: ``needed > REACH * max_stretch``, or ``needed > max_stretch`` from a pilot whose worst
    coordinate has fewer than ``MIN_PILOT_ESS`` effective records (``pilot_ess``; its ``needed`` is then a
    lower bound). Module docstring."""
    k = jnp.minimum(needed, max_stretch)
    out = needed > REACH * max_stretch
    if pilot_ess is not None:
        out = out | ((needed > max_stretch) & (pilot_ess < MIN_PILOT_ESS))
    return jnp.where(out, 1, k).astype(jnp.int32)



__all__ = ["Schedule", "constant_schedule", "cyclical_schedule", "stretch_factor", "stretch_needed",
           "chosen_stretch", "resolve_target_ess", "REACH", "MIN_PILOT_ESS",
           "PILOT_EVERY", "EXPLORATION_LOOSENESS", "CYCLE_RELAXATIONS", "ESS_SAFETY", "EQUILIBRATE"]
