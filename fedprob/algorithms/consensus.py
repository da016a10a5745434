"""Consensus Monte Carlo (Scott et al. 2016): a weighted average of aligned sub-posterior draws.

Client k samples its sub-posterior ``p0(w)^(1/K) p(D_k | w)`` (prior share
1/K, arranged here) and computes the weight ``W_k = Sigma_k^-1``. By default
(``moments="stein"``) ``Sigma_k`` and the draws' centre come from the Stein fit
of its draws (:mod:`fedprob.algorithms.stein`: the gradients of the
sub-posterior at the draws regressed on the draws, the moment-matched Gaussian
with a control variate, exact for a Gaussian sub-posterior), and the draws are
mapped linearly onto those moments (:func:`~fedprob.algorithms.messages.match_moments`);
with ``moments="sample"`` it is the inverse of the sample covariance (its
correlations shrunk toward zero when it has fewer than 10 d draws,
:func:`fedprob.gaussian.moment_match`). ``family="diag"``: elementwise inverse
variances. The server combines the s-th draw of every client::

    w_s = (sum_k W_k)^-1 sum_k W_k w_{k,s},     s = 1..S.

Exact for Gaussian sub-posteriors (the combined draws are then exact draws of
the product). A Gaussian client output (SVI, Laplace, IVON) contributes
``num_samples`` of its own draws and its exact precision as ``W_k``.

The server **sums**: each client sends ``W_k`` and its weighted draws
``W_k w_{k,s}`` (S, d), and the server keeps ``sum_k W_k``,
``sum_k W_k w_{k,s}`` and the clients counted
(:class:`~fedprob.algorithms.one_round.SummingOneRoundAlgorithm`), so its
memory does not grow with K. Clients also send the Monte Carlo covariance
terms of their means; ``info["mc_error_sd_ratio"]`` is the Monte Carlo sd of
the combined mean over the posterior sd (a RuntimeWarning above 0.2 names
the clients with the lowest effective sample size).

Masked clients (diverged, or absent) are left out; the prior share they
carried, ``(K - K')/K`` with ``K'`` clients combined, is put back as one more
"sub-posterior": the prior's Gaussian (exact for Normal priors, see
:func:`fedprob.gaussian.prior_gaussian`) raised to that power, with its own
draws.

Clients with fewer points than parameters still have a proper sub-posterior
(the 1/K prior share keeps it proper), so the method runs; with many tiny
clients each ``W_k`` is estimated from draws of a wide sub-posterior and the
sampling error of the weights grows with d/S, so use more draws (S >> d;
full weights from fewer than 10 d draws warn).
Draws must be aligned: every client returns the same number S.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import gaussian as gauss
from ..posteriors import GlobalPosterior, Samples
from ..protocols import num_chains
from .base import Context
from .messages import fitted_gaussian, match_moments
from .one_round import draws_ess, mc_message, monte_carlo_check, result_draws, result_gaussian
from .one_round_base import GaussianProductAlgorithm


@dataclasses.dataclass(frozen=True)
class ConsensusMC(GaussianProductAlgorithm):
    """Consensus Monte Carlo over client sub-posteriors (see the module docstring).

    client: the backend (default NUTS); family: ``"full"`` or ``"diag"``
    weights (alias ``covariance``; None, the default: the backend's own,
    ``"full"`` for samplers); num_samples: draws taken from a Gaussian client
    output; jitter: added to each sample covariance, relative to its mean
    variance; num_prior_samples: prior draws for moment matching a
    non-Gaussian prior when a masked client's prior share is put back
    (:class:`~fedprob.algorithms.one_round_base.GaussianProductAlgorithm`).
    """

    maps_draws_to_fit = True

    def prior_weight(self, ctx: Context) -> float:
        return 1.0 / ctx.num_clients

    def make_message(self, ctx, result, key, fit=None):
        """``{"weight": W_k, "weighted_draws": W_k w_{k,s} (S, d), "mc", "ess", "stein_fallbacks"}``; with
        a Stein ``fit`` the draws are mapped linearly onto the fit's mean and covariance
        (:func:`~fedprob.algorithms.messages.match_moments`), so that the weights are their inverse
        covariance as in the sample-moment method and the combined draws have the product's moments."""
        diag = self.family == "diag"
        post = result.posterior if hasattr(result, "posterior") else result
        draws = result_draws(post, key, self.num_samples)
        if draws.shape[0] < 2:      # shapes are static: this fails at init, before compiling
            raise ValueError(f"ConsensusMC needs at least 2 draws per client to estimate the weights, "
                             f"the client backend returns {draws.shape[0]}")
        fallback = jnp.zeros((), draws.dtype)
        if isinstance(post, Samples):
            g, cov, fallback = fitted_gaussian(draws, fit, diag, self.jitter, "ConsensusMC")
            ess = draws_ess(draws)
            if fit is not None:
                draws = match_moments(draws, g, diag, fit[3])
        else:                       # exact Gaussian output: its own iid draws
            g = result_gaussian(post, diag, self.jitter)
            cov = g.variance() if diag else g.covariance()
            ess = jnp.full(draws.shape[1:], float(draws.shape[0]), draws.dtype)
            if fit is not None:     # a variational Gaussian refined from these draws (stein_fit)
                st, _, ok = fit[:3]
                fallback = (~ok).astype(draws.dtype)
                g = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), st, g)
                cov = g.variance() if diag else g.covariance()
                draws = match_moments(draws, g, diag, fit[3])
        W = g.precision
        weighted = W * draws if diag else draws @ W
        return {"weight": W, "weighted_draws": weighted, "stein_fallbacks": fallback, **mc_message(W, cov, ess)}

    def posterior(self, ctx: Context, server_state, client_states) -> GlobalPosterior:
        sums, ids, ess = self.counted(server_state)
        Kp = int(ids.size)
        Wsum, WX = sums["weight"], sums["weighted_draws"]           # (d[, d]), (S, d)
        diag = self.family == "diag"
        missing = (ctx.num_clients - Kp) / ctx.num_clients
        g0 = None
        if missing > 0:
            k_prior, k_draw = jax.random.split(server_state.key)
            g0, _ = self.prior_of(ctx, k_prior, diag)
            g0 = g0.power(missing)
            d0 = g0.sample(k_draw, WX.shape[0])
            Wsum = Wsum + g0.precision
            WX = WX + (g0.precision * d0 if diag else d0 @ g0.precision)
        combined = WX / Wsum if diag else jnp.linalg.solve(Wsum, WX.T).T
        info = {"kind": "consensus monte carlo", "family": self.family,
                "num_clients_combined": Kp, "client_ids": ids.tolist(),
                "missing_prior_share": float(missing)}
        C = num_chains(self.backend) if self.backend.output == "samples" else 1
        if C > 1 and WX.shape[0] % C == 0:
            info["num_chains"] = C          # draws chain-major: combined chain c = every client's chain c
        info.update(monte_carlo_check("ConsensusMC", Wsum, sums["mc"], ids, ess))
        info["moments"] = self.moments
        info["stein_fallbacks"] = int(round(float(sums["stein_fallbacks"])))
        info.update(self.diag_bias_info("ConsensusMC", sums, sums["weight"], g0, Kp))
        return GlobalPosterior(ctx.potential, Samples(combined), info=self.local_info(info, client_states),
                               local=self.local_of(client_states))


__all__ = ["ConsensusMC"]
