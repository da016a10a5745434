"""Shared machinery of the stochastic-gradient MCMC backends.

The samplers (:mod:`.sgld`, :mod:`.sghmc`, :mod:`.cyclical_sghmc`,
:mod:`.iasg`) are BlackJAX-style pairs of pure functions ``init`` / ``step``;
this module turns a step into a client run: the stochastic gradient of the
client's target, the scale-aware default step size, the ``lax.scan`` driver
(burn-in, then draws every ``thinning`` steps, or the average of a block of
iterates), and the per-client diagnostics.

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
like the client's size ``n_k`` (and like ``1 / sigma^2`` in a regression
with noise scale ``sigma``), and a stable step size shrinks accordingly. A
step size of ``None`` therefore means *adapted to the target's curvature*::

    step_size = rate / lambda_max

with ``lambda_max`` the largest |eigenvalue| of the Hessian of the client's
log target at the current point (in the sampler's metric), estimated by
:func:`max_curvature` (power iteration on Hessian-vector products over one
minibatch). It is estimated at the start point, re-estimated (warm-started)
after every 50 burn-in steps, and the last estimate is frozen for sampling
(:func:`run_chain`; cyclical SGHMC re-estimates its initial rate about every
50 steps throughout). ``rate`` is the dimensionless product
``step_size * lambda_max`` each sampler fixes; it bounds the
discretisation bias in the stiffest direction. For a client of ``n_k``
points on standardised data this is ``rate / (n_k h)``, ``h`` the largest
per-point curvature, so the default carries over to any client size, prior
share (``prior_weight``), likelihood weight and Gaussian term, and follows
the curvature as the chain moves. A step adapted to the local curvature can
still be too large where the chain goes next (momentum carries it into
stiffer regions, e.g. towards a small regression noise scale): a burn-in
window that produces NaN/inf is rolled back and every later step halved
(diagnostic ``burnin_restarts``). A number given as ``step_size`` is used as
it is, with no adaptation and no rollback.

Minibatch noise. A minibatch gradient adds noise of covariance ``Sigma_g``
(zero for the full batch); it inflates the sampled variance by about the
ratio of the two noises per step (SGLD: ``(eps/2)^2 tr Sigma_g / (eps T d)``),
which is linear in the step size. The adapted step is therefore also capped
so that this ratio stays below ``max_gradient_noise`` (0.1 by default, about
10% excess variance; 10 times that in the first half of burn-in, where the
chain travels), with ``Sigma_g`` estimated from pairs of minibatch gradients
(:func:`gradient_noise_variance`). With small batches of a large client the
capped step is small (it scales like ``b / n_k^2``) and the chain slow:
check the ``ess`` diagnostic, run longer or raise the batch size (or set
``max_gradient_noise=None`` and accept over-dispersed draws). The diagnostic
``gradient_noise_ratio`` reports the ratio at the end of burn-in (adapted
step) or at the final point (given step); values near or above 1 mean
over-dispersed draws.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedprob.validation import check_fraction, check_int, check_positive

Array = jax.Array

INIT_STRATEGIES = ("prior", "prior_full", "zeros")


# -- validation ------------------------------------------------------------------------------

def check_common(backend) -> None:
    """Checks shared by the SG-MCMC backends (batch size, temperature, init strategy)."""
    bs = backend.batch_size
    if bs is not None:
        check_int("batch_size", bs, 1)
    if hasattr(backend, "temperature"):
        check_positive("temperature", backend.temperature, allow_zero=True)
    if backend.init_strategy not in INIT_STRATEGIES:
        raise ValueError(f"unknown init_strategy {backend.init_strategy!r} "
                         f"(use one of {INIT_STRATEGIES})")
    check_positive("step_size", backend.step_size, allow_none=True)


# -- targets and gradients -------------------------------------------------------------------

def target_scale(target) -> Array:
    """``likelihood_weight * n + c(precision)``, at least 1 (see the module docstring).

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
    """Per-step scalars the driver records: log density, gradient norm, finiteness."""
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


def noise_capped(step_size: Array, coef: Array, max_ratio: Optional[float]) -> Array:
    """``min(step_size, max_ratio / coef)``: the step at which ``step * coef`` (the
    gradient-noise ratio, linear in the step) stays at most ``max_ratio``."""
    if max_ratio is None:
        return step_size
    cap = max_ratio / jnp.where(coef > 0, coef, 1.0)
    return jnp.where(coef > 0, jnp.minimum(step_size, cap.astype(step_size.dtype)), step_size)


# -- the scan driver -------------------------------------------------------------------------

class ChainOutput(NamedTuple):
    state: object        # final sampler state
    draws: Array         # (num_samples, d)
    burnin_info: dict    # name -> (num_burnin,) per-step values
    sample_info: dict    # name -> (num_samples, steps_per_draw) per-step values
    step_size: Array     # () step size of the sampling phase
    restarts: Array      # () burn-in windows rolled back for NaN/inf (adapted step only)
    noise_coef: Optional[Array] = None   # () gradient-noise ratio per unit step at the end of
                                         # burn-in (from ``final``; None without it)


def run_chain(kernel: Callable, state, key: Array, *, num_burnin: int, num_samples: int,
              steps_per_draw: int, step_size=None, adapt: Optional[Callable] = None,
              final: Optional[Callable] = None, sample_kernel: Optional[Callable] = None,
              adapt_every: int = ADAPT_EVERY, reset: Callable = lambda s: s,
              position: Callable = lambda s: s.position, reduce: str = "last") -> ChainOutput:
    """Burn-in, then ``num_samples`` blocks of ``steps_per_draw`` steps, one draw per block.

    ``kernel(key, state, step_size) -> (state, info)`` is one sampler step
    (``info`` a dict of scalars); ``sample_kernel`` (default ``kernel``) the
    step of the sampling phase. Either a fixed ``step_size``, or
    ``adapt(key, state, start, num_iters) -> (step_size, eigenvector)``: then
    the step size is estimated at the start point and re-estimated
    (warm-started power iteration) at the end of every ``adapt_every``
    burn-in steps; the last estimate is frozen for sampling. ``final(key,
    state, step_size, looseness) -> (step_size, noise_coef)`` (the
    gradient-noise cap), when given, acts on every estimate (the last
    ``noise_coef`` is returned): ``looseness`` is 10 (a 10 times looser cap)
    for the first half of the burn-in windows, where the chain travels, and 1
    for the second half and for sampling, where it settles. A window that
    produces NaN/inf is rolled back to ``reset(state at its start)`` and the
    step multiplied by 1/2 from then on. (Leftover ``num_burnin mod
    adapt_every`` steps run first, with the start estimate.)
    A block's draw is its last position (``reduce="last"``: thinning) or the
    average of its positions (``reduce="mean"``: iterate averaging, IASG).
    Everything is ``lax.scan``.
    """
    if reduce not in ("last", "mean"):
        raise ValueError(f"reduce must be 'last' or 'mean', got {reduce!r}")
    if (step_size is None) == (adapt is None):
        raise ValueError("give exactly one of step_size and adapt")
    sample_kernel = kernel if sample_kernel is None else sample_kernel
    k_burn, k_draw, k_adapt = jax.random.split(key, 3)

    def steps(s, keys, eps, kern=kernel):
        return jax.lax.scan(lambda c, k: kern(k, c, eps), s, keys)

    burn_info = None
    restarts = jnp.zeros((), jnp.int32)
    coef = None
    if adapt is None:
        eps = jnp.asarray(step_size)
        if num_burnin:
            state, burn_info = steps(state, jax.random.split(k_burn, num_burnin), eps)
    else:
        nw, rest = divmod(num_burnin, adapt_every)

        def estimate(k, s, v, looseness):
            k_curv, k_cap = jax.random.split(k)
            e, v = adapt(k_curv, s, v, POWER_ITERS if v is None else WARM_ITERS)
            coef = jnp.zeros((), e.dtype)
            if final is not None:
                e, coef = final(k_cap, s, e, looseness)
            return e, v, coef

        def looseness(j):
            # window j (j = nw: the sampling phase) caps the gradient noise loosely in the
            # first half of burn-in
            return jnp.where(j >= nw // 2, 1.0, EARLY_LOOSENESS)

        k_first, k_rest, k_win = jax.random.split(k_adapt, 3)
        eps, v, coef = estimate(k_first, state, None, looseness(0))
        if rest:
            state, burn_info = steps(state, jax.random.split(k_rest, rest), eps)
        mult = jnp.ones((), eps.dtype)
        if nw:
            def window(carry, xs):
                s, e, v, m, r, _ = carry
                ks, j = xs
                s_new, info = steps(s, jax.random.split(ks[0], adapt_every), e * m)
                # A window that produced NaN/inf is rolled back (reset, e.g. zero
                # momentum) and the step multiplier halved.
                ok = jnp.all(info["finite"])
                s = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), s_new, reset(s))
                m = jnp.where(ok, m, 0.5 * m)
                e, v, c = estimate(ks[1], s, v, looseness(j + 1))   # for the next window
                return (s, e, v, m, r + (~ok).astype(jnp.int32), c), info

            keys = jnp.stack([jax.random.split(k_burn, nw), jax.random.split(k_win, nw)], axis=1)
            carry = (state, eps, v, mult, restarts, coef)
            (state, eps, v, mult, restarts, coef), info = jax.lax.scan(
                window, carry, (keys, jnp.arange(nw)))
            info = jax.tree_util.tree_map(lambda a: a.reshape(-1), info)
            burn_info = info if burn_info is None else jax.tree_util.tree_map(
                lambda a, b: jnp.concatenate([a, b]), burn_info, info)
        eps = eps * mult

    def block(s, k):
        keys = jax.random.split(k, steps_per_draw)
        if reduce == "last":
            s, info = steps(s, keys, eps, sample_kernel)
            return s, (position(s), info)

        def one(carry, kk):
            c, acc = carry
            c, info = sample_kernel(kk, c, eps)
            return (c, acc + position(c)), info

        (s, acc), info = jax.lax.scan(one, (s, jnp.zeros_like(position(s))), keys)
        return s, (acc / steps_per_draw, info)

    state, (draws, sample_info) = jax.lax.scan(block, state, jax.random.split(k_draw, num_samples))
    if burn_info is None:
        burn_info = jax.tree_util.tree_map(lambda a: a.reshape(-1)[:0], sample_info)
    return ChainOutput(state, draws, burn_info, sample_info, eps, restarts, coef)


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


def chain_diagnostics(out: ChainOutput, step_size=None) -> dict:
    """Scalar diagnostics of one client's chain.

    grad_norm / log_density: means over the sampling phase of the gradient
    norm and the (stochastic) log density; nonfinite: any NaN/inf seen in the
    log density, gradient or position of the sampling phase or in the draws
    (``finite`` is its negation; burn-in failures are rolled back and counted
    in ``burnin_restarts``);
    ess: the smallest per-coordinate effective sample size of the draws;
    step_size: the step size of the sampling phase; burnin_restarts: burn-in
    windows rolled back after a NaN/inf (adapted step sizes).
    """
    step_size = out.step_size if step_size is None else step_size
    si = out.sample_info
    # Burn-in windows that failed were rolled back (counted in burnin_restarts);
    # a failure that was not shows up in the sampling phase.
    finite = (jnp.all(si["finite"]) & jnp.all(jnp.isfinite(out.draws))
              & jnp.all(jnp.isfinite(out.state.position)))
    ess = effective_sample_size(out.draws)
    return {
        "grad_norm": jnp.mean(si["grad_norm"]),
        "log_density": jnp.mean(si["log_density"]),
        "nonfinite": ~finite,
        "finite": finite,
        "ess": jnp.where(jnp.all(jnp.isfinite(ess)), jnp.min(ess), 0.0),
        "step_size": jnp.asarray(step_size, jnp.result_type(float)),
        "burnin_restarts": out.restarts,
    }


__all__ = [
    "ChainOutput", "run_chain", "ADAPT_EVERY", "effective_sample_size", "chain_diagnostics",
    "target_scale", "max_curvature", "adapted_step_size", "gradient_noise_variance", "noise_capped",
    "log_density_and_grad", "initial_position", "step_info", "INIT_STRATEGIES",
]
