"""The SG-MCMC driver: a sampler is a kernel plugged into one client run, BlackJAX style.

A sampler (:mod:`fedprob.inference.sgld`, ``sghmc``, ``cyclical_sghmc``, ``iasg``,
``sgnht``) is a frozen dataclass of its hyperparameters and defaults deriving from
:class:`SGMCMC`, and gives two things:

* ``kernel(problem) -> Kernel``: the pure functions of its state, ``init(position)``
  and ``step(key, state, step_size, noisy) -> (state, info)`` (one step on the
  problem's (minibatch) gradient, and its per-step scalars: at least those of
  :func:`step_info`), plus what the driver needs to adapt the step: ``rate`` (the
  dimensionless ``step * lambda_max`` of the adapted default step), ``metric`` (the
  diagonal preconditioner the curvature is measured in), ``noise_scale`` (what turns
  the minibatch gradient variance into each coordinate's gradient-noise ratio per unit
  step) and ``reset`` (the state a rolled-back window restarts from);
* ``schedule() -> Schedule``: the sampling phase (:mod:`.schedules`).

:func:`sample` (every sampler's ``run``) does the rest, the same way for all: the start
point, burn-in with the step-size adaptation and NaN rollback, sampling with thinning or
iterate averaging and the ESS stretch (:func:`.chain.run_chain`), and the diagnostics
(:mod:`.diagnostics`; the kernel's ``info`` scalars are averaged over the draws' steps and
reported under their own names). A new sampler is its kernel file, its export and its test.

Keys: ``key`` splits into the start's, the chain's and (for kernels that inject noise) the
gradient-noise diagnostic's; a kernel whose ``init`` is random (``init_key``, pSGLD's first
gradient) splits its key off the chain's.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedprob.posteriors import Samples
from fedprob.potential import INIT_STRATEGIES
from fedprob.protocols import ClientBackend, ClientResult
from fedprob.validation import check_int, check_positive

from .chain import run_chain
from .curvature import adapted_step_size, gradient_noise_variance, noise_ratios
from .diagnostics import chain_diagnostics, gradient_noise_diagnostic
from .precondition import (PreconditionedPotential, check_precondition, laplace_preconditioner,
                           resolve_control_variate, resolve_precondition)
from .schedules import Schedule, constant_schedule, resolve_target_ess

Array = jax.Array


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


class Problem(NamedTuple):
    """One client's problem as a kernel sees it (built by :func:`sample`)."""

    potential: object      # fedprob.potential.Potential
    target: object         # fedprob.potential.LocalTarget
    batch_size: Optional[int]
    grad: Callable         # (z, key) -> (log_density, gradient) of the (minibatch) log target
    n: Array               # () the client's size (at least 1), in the position's dtype
    position: Array        # (d,) the start point


def _identity(state):
    return state


class Kernel(NamedTuple):
    """A sampler's pure functions and defaults (see the module docstring).

    init: ``position -> state`` (``(position, key) -> state`` with ``init_key``).
    step: ``(key, state, step_size, noisy) -> (state, info)``; ``noisy`` False (a Python
        bool, or traced in a cyclical schedule) means no injected noise; ``info`` a dict of
        scalars with at least ``finite``.
    rate: ``step_size * lambda_max`` of the adapted default step.
    sample_step: the sampling phase's step (``None``: ``step``), e.g. a frozen metric.
    metric: ``state -> (d,)`` diagonal preconditioner G the curvature is measured in
        (``None``: the identity).
    noise_scale: ``state -> scale``: the gradient-noise ratio per unit step of coordinate i
        is ``scale_i * V_i`` (``V`` the minibatch gradient variance; SGLD ``G / (4 T)``,
        SGHMC ``1 / (2 alpha T)``); ``None`` for a kernel that injects no noise (no cap, no
        ``gradient_noise_ratio``). Called only with a minibatch and ``T > 0``.
    reset: ``state -> state`` a rolled-back window restarts from (e.g. zero momentum).
    adapt: ``(key, state, start, num_iters) -> (step, eigenvector)``, the adapted step when
        it is not ``rate / lambda_max`` in the metric (:func:`.curvature.adapted_step_size`).
    reduce: a draw is its block's last position (``"last"``) or average (``"mean"``).
    init_key: ``init`` takes a key (split off the chain's).
    """

    init: Callable
    step: Callable
    rate: float
    sample_step: Optional[Callable] = None
    metric: Optional[Callable] = None
    noise_scale: Optional[Callable] = None
    reset: Callable = _identity
    adapt: Optional[Callable] = None
    reduce: str = "last"
    init_key: bool = False


class SGMCMC(ClientBackend):
    """Base of the samplers on the driver: a subclass is a frozen dataclass with the fields
    ``step_size``, ``num_burnin``, ``batch_size`` and ``init_strategy`` (and, where it has
    them, ``temperature``, ``max_gradient_noise``, ``target_ess``, ``max_stretch``; the
    class defaults below stand in otherwise) and gives ``kernel(problem)`` and
    ``schedule()``. ``injects_noise = False`` marks an optimiser (IASG): no gradient-noise
    ratio, and its key is split in two instead of three.
    """

    output = "samples"
    temperature = 1.0
    max_gradient_noise = None
    target_ess = 0.0
    max_stretch = 1
    injects_noise = True
    precondition = None
    control_variate = False

    def __post_init__(self):
        check_common(self)
        check_int("num_burnin", self.num_burnin, 0)
        check_positive("max_gradient_noise", self.max_gradient_noise, allow_none=True)
        check_precondition(self.precondition, self.control_variate)

    def kernel(self, problem: Problem) -> Kernel:
        raise NotImplementedError

    def schedule(self) -> Schedule:
        raise NotImplementedError

    def run(self, key, potential, target, init=None) -> ClientResult:
        return sample(self, key, potential, target, init)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampler(SGMCMC):
    """The settings every noise-injecting sampler shares (keyword-only).

    batch_size: rows per minibatch (with replacement, weighted n/b); ``None``
        is the full batch.
    temperature: multiplies the injected noise variance (1 = posterior).
    max_gradient_noise: with minibatches, the adapted step is also capped so
        that the worst coordinate's gradient-noise ratio stays below this
        (``None``: no cap; ignored for a given ``step_size``; see
        :mod:`.curvature`).
    init_strategy: start used when ``run`` gets ``init=None``: ``"prior"``
        (one prior draw) or ``"zeros"``.
    target_ess, max_stretch: effective-sample-size target of the draws (worst
        coordinate; ``None``: half of the draws; 0: off); the sampling phase is
        lengthened by an integer factor up to ``max_stretch``, chosen from a
        pilot autocorrelation estimate of the second half of burn-in, and kept
        at 1 where the target is out of reach (see :mod:`.schedules`). To raise a client's ESS raise the number of draws
        and ``target_ess`` (and ``max_stretch``).
    num_chains: independent chains per client (vmapped over chain keys by the
        one-round methods; draws are stacked chain-major, so client R-hat is real).
    precondition: ``"auto"`` (the default: ``"full"`` up to 256 parameters, else
        None; None when ``step_size`` is given, which is in the model's own
        coordinates), ``"full"``, ``"diag"`` or None: the chain runs in the coordinates
        whitened by the Laplace approximation at the client's mode (a pre-pass:
        the mode, the Hessian or its diagonal; see :mod:`.precondition`), so its
        mixing no longer depends on the posterior's conditioning; the chain
        starts at a draw of that approximation.
    control_variate: with a minibatch, the gradient is the full-batch gradient
        at the mode plus the minibatch difference (SGLD-CV; two minibatch
        gradients per step); None (the default): on whenever the chain runs on
        minibatches with a preconditioner; True finds the mode even with
        ``precondition=None``.
    """

    batch_size: Optional[int] = None
    temperature: float = 1.0
    max_gradient_noise: Optional[float] = 0.1
    init_strategy: str = "prior"
    target_ess: Optional[float] = None
    max_stretch: int = 10
    num_chains: int = 1
    precondition: Optional[str] = "auto"
    control_variate: Optional[bool] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThinnedSampler(Sampler):
    """A sampler with a constant-step sampling phase: ``num_burnin`` steps discarded, then a
    draw every ``thinning`` steps, ``num_samples`` draws (keyword-only, with :class:`Sampler`'s)."""

    num_burnin: int = 1000
    num_samples: int = 200
    thinning: int = 5

    def __post_init__(self):
        super().__post_init__()
        check_int("num_samples", self.num_samples, 1)
        check_int("thinning", self.thinning, 1)

    def schedule(self) -> Schedule:
        return constant_schedule(self.num_samples, self.thinning)


def sample(backend: SGMCMC, key, potential, target, init=None) -> ClientResult:
    """One client's chain of ``backend`` on ``target``: draws (S, d), last position, diagnostics.

    The step is ``backend.step_size / schedule.peak`` when given (no adaptation, no cap, no
    rollback), else adapted during burn-in (``kernel.adapt`` or ``kernel.rate / lambda_max``)
    and, with a minibatch and ``T > 0``, capped so that the worst coordinate's gradient-noise
    ratio is at most ``max_gradient_noise``.
    """
    schedule = backend.schedule()
    keys = jax.random.split(key, 3 if backend.injects_noise else 2)
    z0 = initial_position(potential, keys[0], init, backend.init_strategy)
    bs = backend.batch_size
    kind = resolve_precondition(backend.precondition, z0.shape[0], backend.step_size is not None)
    cv = resolve_control_variate(backend.control_variate, kind, bs) and bs is not None
    pre = None
    if kind is not None or cv:
        k_pre, k_u = jax.random.split(jax.random.fold_in(keys[0], 1))
        pre = laplace_preconditioner(potential, target, z0, kind, cv, k_pre)
        potential = PreconditionedPotential(potential, pre)
        # u = 0 is the mode; whitened, a draw of N(0, I) is a draw of the Laplace approximation (with the
        # control variate alone the coordinates keep their scale: the chain starts at the mode)
        u0 = jax.random.normal(k_u, z0.shape, z0.dtype) if kind is not None else jnp.zeros_like(z0)
        z0 = jnp.where(pre.failed, 0.0, u0)
    vg = log_density_and_grad(potential, target, bs)
    n = jnp.maximum(jnp.asarray(target.data.n), 1).astype(z0.dtype)
    kernel = backend.kernel(Problem(potential, target, bs, vg, n, z0))
    k_run = keys[1]
    if kernel.init_key:
        k_state, k_run = jax.random.split(k_run)
        state = kernel.init(z0, k_state)
    else:
        state = kernel.init(z0)

    def metric(s):
        return None if kernel.metric is None else kernel.metric(s)

    def noise(k, s):
        var = gradient_noise_variance(lambda x, kk: vg(x, kk)[1], s.position, k)
        return noise_ratios(var, kernel.noise_scale(s))

    def adapt(k, s, start, iters):
        return adapted_step_size(kernel.rate, potential, target, bs, s.position, k, metric(s), start, iters)

    T = backend.temperature
    fixed = backend.step_size is not None
    noisy = kernel.noise_scale is not None
    minibatch = bs is not None and T > 0
    out = run_chain(kernel.step, state, k_run, num_burnin=backend.num_burnin, schedule=schedule,
                    step_size=jnp.asarray(backend.step_size / schedule.peak, z0.dtype) if fixed else None,
                    adapt=None if fixed else (kernel.adapt or adapt),
                    noise=noise if (noisy and minibatch and not fixed) else None,
                    max_noise=backend.max_gradient_noise, reset=kernel.reset, reduce=kernel.reduce,
                    target_ess=resolve_target_ess(backend.target_ess, schedule.num_samples),
                    max_stretch=backend.max_stretch, sample_kernel=kernel.sample_step)
    last = out.state.position
    if pre is not None:
        out_z = out._replace(draws=pre.to_z_many(out.draws))
        last = pre.to_z(last)
    else:
        out_z = out
    diag = chain_diagnostics(out_z)
    if pre is not None:
        diag["precondition_failed"] = pre.failed
    if noisy:
        gradient_noise_diagnostic(out, bs if T > 0 else None, lambda s: noise(keys[2], s), diag)
    return ClientResult(Samples(out_z.draws), last, diag)


__all__ = ["SGMCMC", "Sampler", "ThinnedSampler", "Kernel", "Problem", "sample", "check_common",
           "log_density_and_grad", "initial_position", "step_info"]
