"""Stochastic-gradient MCMC: one driver that every sampler plugs a kernel into.

Every sampler (:mod:`fedprob.inference.sgld`, ``sghmc``, ``cyclical_sghmc``, ``iasg``,
``sgnht``) is a BlackJAX-style kernel, pure functions ``init`` / ``step`` plus its
defaults; its file holds nothing else. This package runs them:

* :mod:`.driver`: the kernel protocol (:class:`Kernel`, :class:`SGMCMC`) and
  :func:`sample`, a client run from a kernel;
* :mod:`.chain`: :func:`run_chain`, burn-in with the step-size adaptation and NaN
  rollback, then the sampling phase;
* :mod:`.curvature`: the adapted step size (``rate / lambda_max``) and the
  minibatch gradient-noise cap;
* :mod:`.schedules`: the sampling phase (constant step with thinning or iterate
  averaging, or cosine cycles with noise-free exploration) and the ESS stretch;
* :mod:`.diagnostics`: effective sample size and the per-client diagnostics.

Everything is ``lax.scan`` / ``lax.fori_loop``.

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
"""
from fedprob.potential import INIT_STRATEGIES
from fedprob.validation import check_fraction, check_int, check_positive

from .chain import MIN_REPORTS, REPORT_STEPS, ChainOutput, num_reports, run_chain
from .curvature import (ADAPT_EVERY, EARLY_LOOSENESS, POWER_ITERS, WARM_ITERS, adapted_step_size,
                        gradient_noise_variance, max_curvature, noise_ratios, target_scale)
from .diagnostics import chain_diagnostics, effective_sample_size, gradient_noise_diagnostic
from .driver import (SGMCMC, Kernel, Problem, Sampler, ThinnedSampler, check_common, initial_position,
                     log_density_and_grad, sample, step_info)
from .schedules import (CYCLE_RELAXATIONS, EQUILIBRATE, ESS_SAFETY, EXPLORATION_LOOSENESS, PILOT_EVERY,
                        Schedule, constant_schedule, cyclical_schedule, resolve_target_ess, stretch_factor)

__all__ = [
    "ChainOutput", "run_chain", "Schedule", "constant_schedule", "cyclical_schedule", "stretch_factor",
    "ADAPT_EVERY", "effective_sample_size", "chain_diagnostics", "gradient_noise_diagnostic",
    "target_scale", "max_curvature", "adapted_step_size", "gradient_noise_variance", "noise_ratios",
    "log_density_and_grad", "initial_position", "step_info", "INIT_STRATEGIES", "resolve_target_ess",
    "SGMCMC", "Sampler", "ThinnedSampler", "Kernel", "Problem", "sample",
    "check_common", "check_fraction", "check_int", "check_positive",
    "POWER_ITERS", "WARM_ITERS", "EARLY_LOOSENESS", "PILOT_EVERY", "EXPLORATION_LOOSENESS",
    "CYCLE_RELAXATIONS", "ESS_SAFETY", "EQUILIBRATE", "REPORT_STEPS", "MIN_REPORTS", "num_reports",
]
