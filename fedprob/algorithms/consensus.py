"""Consensus Monte Carlo (Scott et al. 2016): a weighted average of aligned sub-posterior draws.

Client k samples its sub-posterior ``p0(w)^(1/K) p(D_k | w)`` (prior share
1/K, arranged here) and sends its S draws with the weight
``W_k = Sigma_k^-1``, the inverse of its sample covariance (``covariance=
"diag"``: elementwise inverse variances). The server combines the s-th draw
of every client::

    w_s = (sum_k W_k)^-1 sum_k W_k w_{k,s},     s = 1..S.

Exact for Gaussian sub-posteriors (the combined draws are then exact draws of
the product). A Gaussian client output (SVI, Laplace, IVON) contributes
``num_samples`` of its own draws and its exact precision as ``W_k``.

Masked clients (diverged, or absent) are left out; the prior share they
carried, ``(K - K')/K`` with ``K'`` clients combined, is put back as one more
"sub-posterior": the prior's Gaussian (exact for Normal priors, see
:func:`fedprob.algorithms.one_round.prior_gaussian`) raised to that power,
with its own draws.

Clients with fewer points than parameters still have a proper sub-posterior
(the 1/K prior share keeps it proper), so the method runs; with many tiny
clients each ``W_k`` is estimated from draws of a wide sub-posterior and the
sampling error of the weights grows with d/S, so use more draws (S >> d).
Draws must be aligned: every client returns the same number S.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..posteriors import GlobalPosterior, Samples
from .base import Context
from .one_round import (OneRoundAlgorithm, check_choice, check_int, prior_gaussian, result_draws,
                        result_gaussian)


@dataclasses.dataclass(frozen=True)
class ConsensusMC(OneRoundAlgorithm):
    """Consensus Monte Carlo over client sub-posteriors (see the module docstring).

    client: the backend (default NUTS); covariance: ``"full"`` or ``"diag"``
    weights; num_samples: draws taken from a Gaussian client output;
    jitter: added to each sample covariance, relative to its mean variance;
    num_prior_samples: prior draws for moment matching a non-Gaussian prior
    when a masked client's prior share is put back.
    """

    covariance: str = "full"
    num_samples: int = 1000
    jitter: float = 1e-6
    num_prior_samples: int = 2000

    def __post_init__(self):
        super().__post_init__()
        check_choice("covariance", self.covariance, ("full", "diag"))
        check_int("num_samples", self.num_samples, 2)
        check_int("num_prior_samples", self.num_prior_samples, 2)
        if not self.jitter >= 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")

    def prior_weight(self, ctx: Context) -> float:
        return 1.0 / ctx.num_clients

    def make_message(self, ctx, result, key):
        diag = self.covariance == "diag"
        draws = result_draws(result, key, self.num_samples)
        g = result_gaussian(result, diag, self.jitter)
        return {"draws": draws, "weight": g.precision}

    def check_message(self, ctx, shapes):
        S = shapes["draws"].shape[0]
        if S < 2:
            raise ValueError(f"ConsensusMC needs at least 2 draws per client to estimate the weights, "
                             f"the client backend returns {S}")

    def posterior(self, ctx: Context, server_state, client_states) -> GlobalPosterior:
        msgs, sizes, ids = self.received(server_state)
        draws, W = msgs["draws"], msgs["weight"]          # (K', S, d), (K', d[, d])
        Kp = draws.shape[0]
        diag = self.covariance == "diag"
        missing = (ctx.num_clients - Kp) / ctx.num_clients
        if diag:
            Wsum = jnp.sum(W, 0)
            WX = jnp.sum(W[:, None, :] * draws, 0)
        else:
            Wsum = jnp.sum(W, 0)
            WX = jnp.einsum("ksi,kij->sj", draws, W)
        if missing > 0:
            k_prior, k_draw = jax.random.split(server_state.key)
            g0, _ = prior_gaussian(ctx.potential, k_prior, diag, self.num_prior_samples)
            g0 = g0.power(missing)
            d0 = g0.sample(k_draw, draws.shape[1])
            Wsum = Wsum + g0.precision
            WX = WX + (g0.precision * d0 if diag else d0 @ g0.precision)
        combined = WX / Wsum if diag else jnp.linalg.solve(Wsum, WX.T).T
        info = {"kind": "consensus monte carlo", "covariance": self.covariance,
                "num_clients_combined": int(Kp), "client_ids": ids.tolist(),
                "missing_prior_share": float(missing)}
        return GlobalPosterior(ctx.potential, Samples(combined), info=info)


__all__ = ["ConsensusMC"]
