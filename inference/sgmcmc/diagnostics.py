"""Diagnostics of one client's chain: effective sample size and the scalar summaries."""
from __future__ import annotations

from typing import Callable

import math

import jax
import jax.numpy as jnp

from fedprob.protocols import DRAW_STATS

Array = jax.Array


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


def chain_diagnostics(out) -> dict:
    """Scalar diagnostics of one client's chain (``out`` a :class:`~.chain.ChainOutput`).

    The kernel's own per-step scalars (its ``info`` but ``finite``; e.g. grad_norm /
    log_density): means over the noisy sampling blocks' last steps (one per draw: per-step
    diagnostics cost as much as a small model's gradient); nonfinite: any NaN/inf left in
    the sampling phase or the draws
    (``finite`` is its negation; failures of an adapted chain are rolled back and counted in
    ``burnin_restarts`` / ``sampling_restarts``); ess: the smallest per-coordinate effective
    sample size of the draws; step_size: the (peak) step of the sampling phase; stretch: the
    factor by which the sampling phase was lengthened to reach ``target_ess``; stretch_needed: the
    factor the pilot asked for, uncapped (where that is out of reach the run keeps its length,
    ``stretch`` 1: :mod:`.schedules`). Per draw
    (:data:`~fedprob.protocols.DRAW_STATS`): ``step_size``, the step that produced the draw
    (the schedule's, after the cap and rollback halvings): S scalars per chain, a 1/d share
    of the draws' own memory.
    """
    ess = effective_sample_size(out.draws)
    return dict(out.means) | {
        "nonfinite": ~out.finite,
        "finite": out.finite,
        "ess": jnp.where(jnp.all(jnp.isfinite(ess)), jnp.min(ess), 0.0),
        "step_size": jnp.asarray(out.step_size, jnp.result_type(float)),
        "burnin_restarts": out.restarts,
        "sampling_restarts": out.sampling_restarts,
        "stretch": out.stretch,
        "stretch_needed": out.stretch if out.stretch_needed is None else out.stretch_needed,
        DRAW_STATS: {"step_size": jnp.asarray(out.draw_steps, jnp.result_type(float))},
    }


def gradient_noise_diagnostic(out, batch_size, coef_at_end: Callable, diag: dict) -> None:
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


__all__ = ["effective_sample_size", "chain_diagnostics", "gradient_noise_diagnostic"]
