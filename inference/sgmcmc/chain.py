"""The chain runner: burn-in with step-size adaptation and NaN rollback, then a schedule.

:func:`run_chain` turns a kernel step ``(key, state, step, noisy) -> (state, info)`` into a
client's chain. The step size is either given or adapted during burn-in
(:mod:`.curvature`: ``rate / lambda_max``, capped for the minibatch gradient noise) and
FROZEN at the end of burn-in; the sampling phase follows a :class:`~.schedules.Schedule`
(stretched for the effective-sample-size target). Everything is ``lax.scan`` /
``lax.fori_loop``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedprob import progress

from ..budget import tree_select
from .curvature import ADAPT_EVERY, EARLY_LOOSENESS, POWER_ITERS, WARM_ITERS
from .diagnostics import effective_sample_size
from .schedules import EXPLORATION_LOOSENESS, PILOT_EVERY, Schedule, chosen_stretch, stretch_needed

Array = jax.Array

#: Progress reports of a chain: one per ``REPORT_STEPS`` steps, at least ``MIN_REPORTS`` (a short
#: run's bar still moves smoothly) and at most ``progress.REPORTS``. A report is a host call; on
#: CPU one costs as much as 10 to 20 minibatch gradients of a small model (batch 64, d = 650), so
#: 50 reports made a 2000-step chain of such a model about 30% slower than its steps alone.
REPORT_STEPS = 1000
MIN_REPORTS = 25


def num_reports(total_steps: int) -> int:
    """Progress reports of a chain of ``total_steps`` (unstretched) steps."""
    return int(min(progress.REPORTS, max(MIN_REPORTS, total_steps // REPORT_STEPS)))


class ChainOutput(NamedTuple):
    state: object        # final sampler state
    draws: Array         # (num_samples, d)
    means: dict          # name -> () mean of the kernel's info over the last steps of the noisy
                         # sampling blocks (one per draw)
    finite: Array        # () every sampling step finite (after rollbacks) and the draws finite
    step_size: Array     # () peak step of the sampling phase (schedule.peak times the frozen step)
    max_noisy_step: Array  # () largest step of the noisy sampling steps (after the cap)
    restarts: Array      # () burn-in windows rolled back for NaN/inf
    sampling_restarts: Array  # () sampling blocks rolled back for NaN/inf
    stretch: Array       # () stretch factor of the sampling phase (ESS target)
    noise_coef: Optional[Array] = None   # () worst-coordinate gradient-noise ratio per unit
                                         # step at the end of burn-in (None without ``noise``)
    draw_steps: Optional[Array] = None   # (num_samples,) the step of each draw's last step
    stretch_needed: Optional[Array] = None  # () the stretch the pilot asked for, uncapped (1 without
                                            # a pilot); out of reach, the run is not stretched



def run_chain(kernel: Callable, state, key: Array, *, num_burnin: int, schedule: Schedule,
              step_size=None, adapt: Optional[Callable] = None, noise: Optional[Callable] = None,
              max_noise: Optional[float] = None, adapt_every: int = ADAPT_EVERY,
              reset: Callable = lambda s: s, position: Callable = lambda s: s.position,
              reduce: str = "last", target_ess: float = 0.0, max_stretch: int = 1,
              sample_kernel: Optional[Callable] = None) -> ChainOutput:
    """Burn-in, then the sampling phase of ``schedule``; returns a :class:`ChainOutput`.

    ``kernel(key, state, step, noisy) -> (state, info)`` is one sampler step (``noisy`` False:
    no injected noise; ``info`` a dict of scalars with at least ``finite``);
    ``sample_kernel`` (default ``kernel``) the one of the sampling phase. The step is
    either ``step_size`` (a number, used as it is) or ``adapt(key, state, start, num_iters) ->
    (step, eigenvector)``: estimated at the start point and re-estimated (warm-started power
    iteration) at the end of every ``adapt_every`` burn-in steps. ``noise(key, state) ->
    ratios`` (with an adapted step) gives each coordinate's gradient-noise ratio per unit
    step (averaged over the estimates of the second half of burn-in); with ``coef`` their
    maximum the step is capped at ``max_noise / coef`` (10 times looser in the first half of
    burn-in and for noise-free steps). Step and cap are FROZEN at the end of burn-in. Burn-in
    windows and sampling blocks that produce NaN/inf are rolled back to ``reset(state at
    their start)`` and every later step halved (adapted step only). A block's draw is its
    last position (``reduce="last"``) or the average of its positions (``"mean"``). With
    ``target_ess > 0`` the sampling phase is stretched (:func:`.schedules.chosen_stretch`) from the
    pilot autocorrelation time of the second half of burn-in (recorded every
    ``PILOT_EVERY`` steps), unless the target is out of reach.
    """
    if reduce not in ("last", "mean"):
        raise ValueError(f"reduce must be 'last' or 'mean', got {reduce!r}")
    if (step_size is None) == (adapt is None):
        raise ValueError("give exactly one of step_size and adapt")
    adaptive = adapt is not None
    sample_kernel = kernel if sample_kernel is None else sample_kernel
    capped = adaptive and noise is not None and max_noise is not None
    k_burn, k_draw, k_adapt = jax.random.split(key, 3)
    pos0 = position(state)
    dtype = pos0.dtype
    inf = jnp.array(jnp.inf, dtype)

    # progress: num_reports(steps) reports per chain, each a scalar predicate and, when it
    # holds, one host call (fedprob.progress)
    every = max(1, (num_burnin + schedule.num_periods * schedule.period)
                // num_reports(num_burnin + schedule.num_periods * schedule.period))

    def report_if(pred, done, stretch):
        total = num_burnin + schedule.num_periods * schedule.period * stretch
        jax.lax.cond(pred, lambda: progress.report(done, total), lambda: None)

    def steps(s, keys, eps):
        """One step per key; only the last step's info is computed (see :func:`advance`)."""
        s = jax.lax.scan(lambda c, k: (kernel(k, c, eps, True)[0], None), s, keys[:-1])[0]
        s, info = kernel(keys[-1], s, eps, True)
        return s, info["finite"] & jnp.all(jnp.isfinite(position(s)))

    # -- burn-in: windows of adapt_every steps, re-estimating the step and the cap ----------
    nw, rest = divmod(num_burnin, adapt_every)
    pilot_on = target_ess > 0 and max_stretch > 1 and nw >= 2 and adapt_every % PILOT_EVERY == 0

    def looseness(j):
        return jnp.where(j >= nw // 2, 1.0, EARLY_LOOSENESS)

    def estimate(k, s, v, j, vacc, cnt):
        """Step, eigenvector, noise ratios, cap; the per-coordinate noise ratios are averaged
        over the estimates of the second half of burn-in (``vacc / cnt``): a single estimate
        from a few gradient pairs is noisy, and its maximum over coordinates biased low or high."""
        k_curv, k_cap = jax.random.split(k)
        if adaptive:
            e, v = adapt(k_curv, s, v, POWER_ITERS if v is None else WARM_ITERS)
        else:
            e = jnp.asarray(step_size, dtype)
        if noise is not None:
            ratios = noise(k_cap, s).astype(dtype)
            late = jnp.asarray(j) >= nw // 2
            vacc = jnp.where(late, vacc + ratios, vacc)
            cnt = cnt + late.astype(dtype)
            coef = jnp.max(jnp.where(late, vacc / jnp.maximum(cnt, 1.0), ratios))
        else:
            coef = jnp.zeros((), dtype)
        cap = inf
        if capped:
            cap = jnp.where(coef > 0, max_noise / jnp.where(coef > 0, coef, 1.0), inf).astype(dtype)
        return e.astype(dtype), v, coef.astype(dtype), cap, cap * looseness(j), vacc, cnt

    k_first, k_rest, k_win = jax.random.split(k_adapt, 3)
    vacc, cnt = jnp.zeros_like(pos0), jnp.zeros((), dtype)
    eps, v, coef, cap, cap_now, vacc, cnt = estimate(k_first, state, None, 0, vacc, cnt)
    v = jnp.zeros_like(pos0) if v is None else v
    mult = jnp.ones((), dtype)
    restarts = jnp.zeros((), jnp.int32)
    if rest:
        state, _ = steps(state, jax.random.split(k_rest, rest), jnp.minimum(eps, cap_now))
    records = None
    if nw:
        R = adapt_every // PILOT_EVERY if pilot_on else 1
        chunk = adapt_every // R

        def window(carry, xs):
            s, e, v, m, r, coef, cap, cap_now, vacc, cnt = carry
            ks, j = xs
            b = m * jnp.minimum(e, cap_now)

            def part(c, kk):
                c, ok = steps(c, jax.random.split(kk, chunk), b)
                return c, (position(c), ok)

            s_new, (rec, fin) = jax.lax.scan(part, s, jax.random.split(ks[0], R))
            if adaptive:
                ok = jnp.all(fin)
                s = tree_select(ok, s_new, reset(s))
                m = jnp.where(ok, m, 0.5 * m)
                r = r + (~ok).astype(jnp.int32)
            else:
                s = s_new
            e, v2, coef, cap, cap_now, vacc, cnt = estimate(ks[1], s, v if adaptive else None, j + 1,
                                                            vacc, cnt)
            v = v2 if adaptive else v
            w_every = max(1, -(-every // adapt_every))
            report_if((j + 1) % w_every == 0, rest + (j + 1) * adapt_every, 1)
            return (s, e, v, m, r, coef, cap, cap_now, vacc, cnt), rec

        keys = jnp.stack([jax.random.split(k_burn, nw), jax.random.split(k_win, nw)], axis=1)
        carry = (state, eps, v, mult, restarts, coef, cap, cap_now, vacc, cnt)
        (state, eps, v, mult, restarts, coef, cap, _, _, _), records = jax.lax.scan(
            window, carry, (keys, jnp.arange(nw)))

    # -- frozen step and cap; the stretch from the pilot -----------------------------------
    base = jnp.minimum(eps, cap)                     # the burn-in step at the end of burn-in
    noisy_mult = jnp.asarray(schedule.noisy_multipliers(), dtype)
    noisy_steps = jnp.minimum(eps * noisy_mult, cap)
    max_noisy = jnp.max(noisy_steps) if noisy_mult.size else jnp.zeros((), dtype)
    if pilot_on:
        rec = records[nw // 2:].reshape(-1, pos0.shape[0])
        ess = effective_sample_size(rec)
        tau = PILOT_EVERY * rec.shape[0] / jnp.maximum(jnp.min(ess), 1e-3)
        tau = jnp.where(jnp.all(jnp.isfinite(rec)), tau, 1.0)
        ratio = noisy_steps / jnp.where(base > 0, base, 1.0)
        needed = stretch_needed(schedule, tau, target_ess, ratio)
        k = chosen_stretch(needed, max_stretch, jnp.min(ess))
    else:
        k, needed = 1, 1

    # -- sampling phase ---------------------------------------------------------------------
    info_names = None

    def run_steps(s, m, key, j0, n, i0=0):
        """``n`` steps from within-period index ``j0`` (step ``i`` of the block draws with
        ``fold_in(key, i0 + i)``); returns state, sums, positions' sum, ok.

        Only the block's last step computes the kernel's info (the others' is dead code XLA
        removes): NaN/inf propagate through the state, so a failure anywhere in the block
        shows in the last step's info and the final position."""

        def one(i, s):
            f, noisy = schedule.factor(j0 + i, k)
            step = (jnp.minimum(eps * f, jnp.where(noisy, cap, EXPLORATION_LOOSENESS * cap)) * m).astype(dtype)
            return sample_kernel(jax.random.fold_in(key, i0 + i), s, step, noisy), noisy, step

        def body(i, c):
            s, psum = c
            s = one(i, s)[0][0]
            return s, (psum + position(s) if reduce == "mean" else psum)

        s, psum = jax.lax.fori_loop(0, n - 1, body, (s, jnp.zeros_like(pos0)))
        (s, info), noisy, last_step = one(n - 1, s)
        if reduce == "mean":
            psum = psum + position(s)
        w = jnp.asarray(noisy, dtype) if schedule.exploration not in (None, 1.0) else jnp.ones((), dtype)
        acc = {name: jnp.where(w > 0, w * jnp.asarray(info[name], dtype), 0.0) for name in info_names}
        ok = info["finite"] & jnp.all(jnp.isfinite(position(s)))
        return s, acc | {"weight": w}, psum, ok, last_step

    def block(carry, key, j0, n, i0=0, tally=True):
        """One block of ``n`` steps (rolled back as a whole on NaN/inf); ``tally=False``: its last
        step's info is left out of the means."""
        s, m, r, acc, fin = carry
        s_new, a, psum, ok, last_step = run_steps(s, m, key, j0, n, i0)
        if tally is not True:
            a = jax.tree_util.tree_map(lambda v: jnp.where(tally, v, jnp.zeros_like(v)), a)
        if adaptive:
            s_new = tree_select(ok, s_new, reset(s))
            r = r + (~ok).astype(jnp.int32)
            a = tree_select(ok, a, jax.tree_util.tree_map(jnp.zeros_like, a))
            m_next = jnp.where(ok, m, 0.5 * m)
        else:
            m_next = m
            fin = fin & ok
        acc = jax.tree_util.tree_map(jnp.add, acc, a)
        if reduce == "mean":
            draw = jnp.where(ok, psum / n, position(s_new)) if adaptive else psum / n
        else:
            draw = position(s_new)
        return (s_new, m_next, r, acc, fin), (draw, last_step)

    # reports: the draw blocks at about one per ``every`` steps of their own span; the steps before
    # a period's first draw (a cycle's exploration and equilibration, stretched ``k`` times) in
    # ``pre_parts`` parts with a report after each, so that a stretched cycle is not silent. The
    # parts are one block cut at report points: the same per-step keys (``fold_in(k_pre, i)``
    # over the whole pre-phase) and steps; only a NaN/inf rolls back to the part's start.
    span = schedule.period - schedule.pre
    b_every = max(1, (every * schedule.draws) // max(span, 1))
    pre_parts = max(1, min(schedule.pre, -(-schedule.pre // every)))

    def pre_phase(carry, k_pre, p):
        if pre_parts == 1:
            carry, _ = block(carry, k_pre, 0, schedule.pre * k)
            return carry
        total_pre = schedule.pre * k

        def part(c, r):
            a = (r * total_pre) // pre_parts
            b = ((r + 1) * total_pre) // pre_parts
            c, _ = block(c, k_pre, a, b - a, i0=a, tally=r == pre_parts - 1)
            report_if(True, num_burnin + p * schedule.period * k + b, k)
            return c, None

        return jax.lax.scan(part, carry, jnp.arange(pre_parts, dtype=jnp.int32))[0]

    def period(carry, xs):
        key, p = xs
        k_pre, k_blocks = jax.random.split(key)
        if schedule.pre:
            carry = pre_phase(carry, k_pre, p)

        def one(c, xs):
            kb, j0, n, i = xs
            c, draw = block(c, kb, j0 * k, n * k)
            report_if((p * schedule.draws + i + 1) % b_every == 0,
                      num_burnin + (p * schedule.period + j0 + n) * k, k)
            return c, draw

        starts = schedule.pre + np.concatenate([[0], np.cumsum(schedule.gaps)[:-1]])
        return jax.lax.scan(one, carry, (jax.random.split(k_blocks, schedule.draws),
                                         jnp.asarray(starts, jnp.int32),
                                         jnp.asarray(schedule.gaps, jnp.int32),
                                         jnp.arange(schedule.draws)))

    _, probe = jax.eval_shape(lambda s: sample_kernel(k_draw, s, eps, True), state)
    info_names = [name for name in probe if name != "finite"]
    acc0 = {name: jnp.zeros((), dtype) for name in info_names} | {"weight": jnp.zeros((), dtype)}
    carry = (state, mult, jnp.zeros((), jnp.int32), acc0, jnp.array(True))
    (state, mult_end, s_restarts, acc, fin), (draws, draw_steps) = jax.lax.scan(
        period, carry, (jax.random.split(k_draw, schedule.num_periods), jnp.arange(schedule.num_periods)))
    draws = draws.reshape(-1, pos0.shape[0])
    draw_steps = draw_steps.reshape(-1)
    weight = jnp.maximum(acc["weight"], 1.0)
    means = {name: acc[name] / weight for name in info_names}
    finite = fin & jnp.all(jnp.isfinite(draws)) & jnp.all(jnp.isfinite(position(state)))
    peak_step = schedule.peak * eps if schedule.exploration is not None else base
    return ChainOutput(state, draws, means, finite, mult_end * peak_step, max_noisy * mult_end,
                       restarts, s_restarts, jnp.asarray(k, jnp.int32),
                       coef if noise is not None else None, draw_steps, jnp.asarray(needed, jnp.int32))



__all__ = ["ChainOutput", "run_chain", "num_reports", "REPORT_STEPS", "MIN_REPORTS"]
