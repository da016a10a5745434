"""Shared machinery of the stochastic-gradient MCMC backends: one chain runner.

Every sampler (:mod:`.sgld`, :mod:`.sghmc`, :mod:`.cyclical_sghmc`,
:mod:`.iasg`) is a BlackJAX-style kernel, a pair of pure functions ``init`` /
``step``. :func:`run_chain` turns a kernel into a client run: burn-in with the
step-size adaptation and NaN rollback, then a sampling phase described by a
:class:`Schedule` (constant step with thinning or iterate averaging, or
cosine cycles with noise-free exploration), the effective-sample-size target,
and the per-client diagnostics. Everything is ``lax.scan`` / ``lax.fori_loop``.

Conventions (shared by every sampler here):

* The gradient ``g`` is that of the client's **log posterior**
  ``potential.log_density(z, target, key, batch_size)``: a SUM over the
  client's points; a minibatch of ``b`` rows is weighted ``n / b``
  (:func:`fedprob.potential.minibatch`), the prior enters with the target's
  ``prior_weight`` (1, or 1/K for a sub-posterior), the likelihood with its
  ``likelihood_weight``, plus the target's Gaussian term.
* Temperature ``T`` multiplies the variance of the injected noise: the chain
  targets ``pi(z)^(1/T)`` (prior and likelihood both tempered); ``T = 1`` is
  the Bayesian posterior, ``T < 1`` a "cold" one.
* Noise is drawn once per step over the flat parameter vector.

Scale-aware step sizes. With a sum loss the curvature of the target grows
like the client's size ``n_k``, so a stable step shrinks accordingly. A step
size of ``None`` means *adapted to the target's curvature*:
``step = rate / lambda_max``, ``lambda_max`` the largest |eigenvalue| of the
Hessian of the log target (in the sampler's metric), estimated by
:func:`max_curvature` (power iteration on Hessian-vector products over one
minibatch) at the start point and after every 50 burn-in steps
(warm-started). ``rate`` is the dimensionless ``step * lambda_max`` each
sampler fixes; it bounds the discretisation bias in the stiffest direction.
**The step (and the gradient-noise cap below) is frozen at the end of
burn-in**: a step that depends on the current state during sampling tilts
the stationary density towards high curvature. A burn-in window that
produces NaN/inf is rolled back and every later step halved (diagnostic
``burnin_restarts``); in the sampling phase a block (the steps of one draw,
or a cycle's exploration) that produces NaN/inf is rolled back the same
way, its draw is the restored point, and it is counted in
``sampling_restarts``, so a client never comes back NaN because one step
went too far. A number given as ``step_size`` is used as it is, with no
adaptation, no cap and no rollback.

Minibatch noise, per coordinate. A minibatch gradient adds noise of
per-coordinate variance ``V_i`` (zero for the full batch). For SGLD with
metric ``G`` the update of coordinate ``i`` carries injected variance
``eps T G_i`` and gradient-noise variance ``(eps/2)^2 G_i^2 V_i`` per step;
the restoring drift is the same for both, so in a coordinate that is
decoupled from the others the stationary variance is the exact one times
``1 + r_i`` with ``r_i = eps G_i V_i / (4 T)`` (SGHMC: ``r_i = eta V_i / (2
alpha T)``), *whatever the posterior variance of that coordinate*: the
posterior variance cancels from the ratio. For correlated Gaussian targets
whose gradient-noise covariance is proportional to the curvature (``V = c
H``, the usual case near the mode: per-point Fisher = per-point Hessian) the
excess covariance is ``(eps c / 4) I`` and its ratio to the marginal
posterior variance ``T (H^-1)_ii`` is ``r_i / (H_ii (H^-1)_ii) <= r_i``. So
the worst coordinate's ratio ``max_i r_i`` bounds the relative excess
variance of every coordinate. The adapted step is capped so that ``max_i
r_i <= max_gradient_noise`` (0.1: at most about 10% excess variance in any
coordinate; 10 times looser in the first half of burn-in, where the chain
travels); ``V`` is estimated from pairs of minibatch gradients
(:func:`gradient_noise_variance`). The diagnostic ``gradient_noise_ratio``
reports ``max_i r_i`` at the sampling step (for a given step size: at the
final point). With small batches of a large client the capped step is
small (it scales like ``b / n_k^2``): the ESS target below lengthens the run.

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
short pilot is biased low and the stretch tends to ``max_stretch`` (cyclical
SGHMC on a 650-parameter softmax regression with 12 draws: 10 times the
sampling steps for about the same ESS); pass ``target_ess=0`` where a fixed
number of steps matters more than the ESS.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedprob import progress
from fedprob.potential import INIT_STRATEGIES
from fedprob.protocols import DRAW_STATS
from fedprob.validation import check_fraction, check_int, check_positive

Array = jax.Array



# -- validation ------------------------------------------------------------------------------

def check_common(backend) -> None:
    """Checks shared by the SG-MCMC backends (batch size, temperature, init strategy, ESS target)."""
    bs = backend.batch_size
    if bs is not None:
        check_int("batch_size", bs, 1)
    if hasattr(backend, "temperature"):
        check_positive("temperature", backend.temperature, allow_zero=True)
    if backend.init_strategy not in INIT_STRATEGIES:
        raise ValueError(f"unknown init_strategy {backend.init_strategy!r} "
                         f"(use one of {INIT_STRATEGIES})")
    check_positive("step_size", backend.step_size, allow_none=True)
    if hasattr(backend, "target_ess"):
        check_positive("target_ess", backend.target_ess, allow_none=True, allow_zero=True)
        check_int("max_stretch", backend.max_stretch, 1)


def resolve_target_ess(target_ess, num_samples: int) -> float:
    """``None`` -> half the draws; otherwise the number, at most ``num_samples``."""
    if target_ess is None:
        return 0.5 * num_samples
    return float(min(target_ess, num_samples))


# -- targets and gradients -------------------------------------------------------------------

def target_scale(target) -> Array:
    """``likelihood_weight * n + c(precision)``, at least 1.

    A crude bound on the target's curvature in units of one data point's
    (the fallback of :func:`adapted_step_size`).
    """
    n = jnp.asarray(target.data.n).astype(jnp.result_type(float))
    s = jnp.asarray(target.likelihood_weight) * n
    P = jnp.asarray(target.precision)
    if P.ndim == 1:
        c = jnp.max(jnp.abs(P)) if P.shape[0] else 0.0
    else:
        c = jnp.max(jnp.sum(jnp.abs(P), axis=-1))
    return jnp.maximum(s + c, 1.0)


def log_density_and_grad(potential, target, batch_size: Optional[int]) -> Callable:
    """``f(z, key) -> (log_density, gradient)`` of the client's (minibatch) log target."""

    def f(z, key):
        return jax.value_and_grad(potential.log_density)(z, target, key, batch_size)

    return f


def initial_position(potential, key, init, strategy: str) -> Array:
    """``init`` as a float vector, or a start drawn with ``potential.init(key, strategy)``."""
    if init is None:
        init = potential.init(key, strategy)
    init = jnp.asarray(init)
    if not jnp.issubdtype(init.dtype, jnp.floating):
        init = init.astype(jnp.result_type(float))
    if init.shape != (potential.dim,):
        raise ValueError(f"init must be a flat vector of shape ({potential.dim},), got {init.shape}")
    return init


def step_info(log_density: Array, grad: Array, position: Array) -> dict:
    """Per-step scalars the runner accumulates: log density, gradient norm, finiteness."""
    finite = jnp.isfinite(log_density) & jnp.all(jnp.isfinite(grad)) & jnp.all(jnp.isfinite(position))
    return {"log_density": log_density, "grad_norm": jnp.sqrt(jnp.sum(grad * grad)), "finite": finite}


# -- curvature and gradient noise ------------------------------------------------------------

#: Burn-in steps between re-estimates of the curvature when the step size is adapted.
ADAPT_EVERY = 50
#: Power iterations from a random start / from the previous eigenvector.
POWER_ITERS = 10
WARM_ITERS = 3
#: The gradient-noise cap is this many times looser in the first half of burn-in.
EARLY_LOOSENESS = 10.0


def max_curvature(potential, target, batch_size: Optional[int], z: Array, key: Array,
                  num_iters: int = POWER_ITERS, preconditioner: Optional[Array] = None,
                  start: Optional[Array] = None):
    """Largest |eigenvalue| of the Hessian of ``log_density`` at ``z`` and its eigenvector.

    Power iteration with Hessian-vector products (forward over reverse) on one
    minibatch drawn with ``key`` (the full batch for ``batch_size=None``),
    from ``start`` (a previous eigenvector: a warm start needs few
    iterations) or a random vector. With a diagonal ``preconditioner`` G the
    eigenvalue is that of ``G H``, the curvature in the sampler's metric. The
    estimate ``|H v|`` is at most the true value and close to it unless the
    top of the spectrum is flat (where it matters little). Returns
    ``(lambda, v)``.
    """
    k_batch, k_start = jax.random.split(key)

    def grad(x):
        return jax.grad(potential.log_density)(x, target, k_batch, batch_size)

    def hvp(v):
        u = jax.jvp(grad, (z,), (v,))[1]
        return u if preconditioner is None else preconditioner * u

    v = jax.random.normal(k_start, z.shape, z.dtype) if start is None else start
    v = v / jnp.maximum(jnp.linalg.norm(v), jnp.finfo(z.dtype).tiny)

    def body(_, carry):
        v, _ = carry
        u = hvp(v)
        lam = jnp.linalg.norm(u)
        ok = jnp.isfinite(lam) & (lam > 0)
        return jnp.where(ok, u / jnp.where(ok, lam, 1.0), v), lam

    v, lam = jax.lax.fori_loop(0, num_iters, body, (v, jnp.zeros((), z.dtype)))
    return lam, v


def adapted_step_size(rate: float, potential, target, batch_size, z, key,
                      preconditioner: Optional[Array] = None, start: Optional[Array] = None,
                      num_iters: int = POWER_ITERS):
    """``(rate / lambda_max, eigenvector)`` with ``lambda_max`` from :func:`max_curvature`.

    The curvature is floored at 1 and falls back to :func:`target_scale` when
    the estimate is not finite, so the step is always finite and at most ``rate``.
    """
    lam, v = max_curvature(potential, target, batch_size, z, key, num_iters, preconditioner, start)
    lam = jnp.where(jnp.isfinite(lam), lam, target_scale(target).astype(lam.dtype))
    return (rate / jnp.maximum(lam, 1.0)).astype(z.dtype), v


def gradient_noise_variance(grad_fn: Callable, z: Array, key: Array, num_pairs: int = 8) -> Array:
    """Per-coordinate variance (d,) of the minibatch gradient at ``z``.

    Estimated from ``num_pairs`` pairs of independent minibatch gradients
    ``(g1 - g2)^2 / 2``; ``grad_fn(z, key) -> gradient``.
    """
    keys = jax.random.split(key, 2 * num_pairs).reshape(num_pairs, 2, -1)
    g = jax.vmap(jax.vmap(lambda k: grad_fn(z, k)))(keys)      # (pairs, 2, d)
    return jnp.mean(0.5 * (g[:, 0] - g[:, 1]) ** 2, axis=0)


def noise_ratios(var: Array, scale) -> Array:
    """``scale_i * var_i``: each coordinate's gradient-noise ratio per unit step (the runner
    caps their maximum).

    ``var`` the per-coordinate minibatch gradient variance, ``scale`` what turns it into the
    ratio of gradient-noise to injected-noise variance per unit step in the sampler's metric
    (SGLD: ``G / (4 T)``; SGHMC: ``1 / (2 alpha T)``; see the module docstring).
    """
    return scale * var


# -- schedules of the sampling phase -----------------------------------------------------------

#: Burn-in steps between two recorded positions of the pilot (ESS target).
PILOT_EVERY = 5
#: Exploration (noise-free) steps of a cyclical schedule are capped this many times looser.
EXPLORATION_LOOSENESS = EARLY_LOOSENESS
#: Integrated autocorrelation times (pilot tau, in burn-in steps) the equilibration part of
#: a cycle's noisy phase must cover: after the noise-free exploration the chain sits near a
#: mode; for an AR(1)-like chain the variance deficit decays like exp(-4 t / tau) and the
#: offset of the mean like exp(-2 t / tau) (0.25% and 5% left at t = 1.5 tau).
CYCLE_RELAXATIONS = 1.5
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


# -- the chain runner ------------------------------------------------------------------------

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


def _where(ok, a, b):
    return jax.tree_util.tree_map(lambda x, y: jnp.where(ok, x, y), a, b)


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
    ``target_ess > 0`` the sampling phase is stretched (:func:`stretch_factor`) from the
    pilot autocorrelation time of the second half of burn-in (recorded every
    ``PILOT_EVERY`` steps).
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
                s = _where(ok, s_new, reset(s))
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
        k = stretch_factor(schedule, tau, target_ess, max_stretch, ratio)
    else:
        k = 1

    # -- sampling phase ---------------------------------------------------------------------
    info_names = None

    def run_steps(s, m, key, j0, n):
        """``n`` steps from within-period index ``j0``; returns state, sums, positions' sum, ok.

        Only the block's last step computes the kernel's info (the others' is dead code XLA
        removes): NaN/inf propagate through the state, so a failure anywhere in the block
        shows in the last step's info and the final position."""

        def one(i, s):
            f, noisy = schedule.factor(j0 + i, k)
            step = (jnp.minimum(eps * f, jnp.where(noisy, cap, EXPLORATION_LOOSENESS * cap)) * m).astype(dtype)
            return sample_kernel(jax.random.fold_in(key, i), s, step, noisy), noisy, step

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

    def block(carry, key, j0, n):
        s, m, r, acc, fin = carry
        s_new, a, psum, ok, last_step = run_steps(s, m, key, j0, n)
        if adaptive:
            s_new = _where(ok, s_new, reset(s))
            r = r + (~ok).astype(jnp.int32)
            a = _where(ok, a, jax.tree_util.tree_map(jnp.zeros_like, a))
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

    b_every = max(1, (every * schedule.draws) // max(schedule.period, 1))

    def period(carry, xs):
        key, p = xs
        k_pre, k_blocks = jax.random.split(key)
        if schedule.pre:
            carry, _ = block(carry, k_pre, 0, schedule.pre * k)

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
                       coef if noise is not None else None, draw_steps)


# -- diagnostics -----------------------------------------------------------------------------

def effective_sample_size(draws: Array) -> Array:
    """Single-chain effective sample size of each coordinate of ``draws`` (S, d) -> (d,).

    Geyer's initial monotone sequence estimator on FFT autocorrelations:
    ``S / (-1 + 2 sum_k P_k)`` with ``P_k = rho_2k + rho_2k+1`` truncated at
    the first non-positive pair and made monotone. A coordinate that does not
    move gets ``S``. For fewer than 4 draws the result is ``S``.
    """
    S = draws.shape[0]
    if S < 4:
        return jnp.full(draws.shape[1:], float(S))
    x = draws - jnp.mean(draws, axis=0)
    f = jnp.fft.rfft(x, n=2 * S, axis=0)
    acov = jnp.fft.irfft(f * jnp.conj(f), n=2 * S, axis=0)[:S] / S
    var0 = acov[0]
    moving = var0 > 0
    rho = acov / jnp.where(moving, var0, 1.0)
    m = S // 2
    pairs = rho[0:2 * m:2] + rho[1:2 * m:2]                # (m, d)
    positive = jnp.cumprod((pairs > 0).astype(rho.dtype), axis=0)
    mono = jax.lax.cummin(jnp.where(positive > 0, pairs, jnp.inf), axis=0)
    mono = jnp.where(positive > 0, mono, 0.0)
    tau = -1.0 + 2.0 * jnp.sum(mono, axis=0)
    tau = jnp.maximum(tau, 1.0 / math.log10(max(S, 10)))
    return jnp.where(moving, S / tau, float(S))


def chain_diagnostics(out: ChainOutput) -> dict:
    """Scalar diagnostics of one client's chain.

    grad_norm / log_density: means over the noisy sampling blocks' last steps (one per draw:
    per-step diagnostics cost as much as a small model's gradient) of the gradient norm and the
    (stochastic) log density; nonfinite: any NaN/inf left in the sampling phase or the draws
    (``finite`` is its negation; failures of an adapted chain are rolled back and counted in
    ``burnin_restarts`` / ``sampling_restarts``); ess: the smallest per-coordinate effective
    sample size of the draws; step_size: the (peak) step of the sampling phase; stretch: the
    factor by which the sampling phase was lengthened to reach ``target_ess``. Per draw
    (:data:`~fedprob.protocols.DRAW_STATS`): ``step_size``, the step that produced the draw
    (the schedule's, after the cap and rollback halvings): S scalars per chain, a 1/d share
    of the draws' own memory.
    """
    ess = effective_sample_size(out.draws)
    diag = {name: out.means[name] for name in ("grad_norm", "log_density")}
    return diag | {
        "nonfinite": ~out.finite,
        "finite": out.finite,
        "ess": jnp.where(jnp.all(jnp.isfinite(ess)), jnp.min(ess), 0.0),
        "step_size": jnp.asarray(out.step_size, jnp.result_type(float)),
        "burnin_restarts": out.restarts,
        "sampling_restarts": out.sampling_restarts,
        "stretch": out.stretch,
        DRAW_STATS: {"step_size": jnp.asarray(out.draw_steps, jnp.result_type(float))},
    }


def gradient_noise_diagnostic(out: ChainOutput, batch_size, coef_at_end: Callable, diag: dict) -> None:
    """Set ``gradient_noise_ratio`` in ``diag``: the worst coordinate's ratio at the largest noisy
    sampling step (0 for the full batch; ``coef_at_end(state)`` when the run did not estimate
    it), and per draw (``diag[DRAW_STATS]``) the same ratio at each draw's step."""
    dtype = out.max_noisy_step.dtype
    if batch_size is None:
        coef = jnp.zeros((), dtype)
    else:
        coef = out.noise_coef if out.noise_coef is not None else jnp.max(coef_at_end(out.state))
    diag["gradient_noise_ratio"] = out.max_noisy_step * coef
    diag[DRAW_STATS] = {**diag.get(DRAW_STATS, {}), "gradient_noise_ratio": (out.draw_steps * coef).astype(dtype)}


__all__ = [
    "ChainOutput", "run_chain", "Schedule", "constant_schedule", "cyclical_schedule", "stretch_factor",
    "ADAPT_EVERY", "effective_sample_size", "chain_diagnostics", "gradient_noise_diagnostic",
    "target_scale", "max_curvature", "adapted_step_size", "gradient_noise_variance", "noise_ratios",
    "log_density_and_grad", "initial_position", "step_info", "INIT_STRATEGIES", "resolve_target_ess",
]
