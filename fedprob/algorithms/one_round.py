"""Shared machinery of the one-round (one-shot) algorithms.

Every one-round method has the same client side: client k runs its backend
once on its own target

    log pi_k(z) = s * log p0(z) + log p(D_k | z),

with the prior share ``s`` the method asks for (``s = 1``: the client's own
posterior; ``s = 1/K``: a sub-posterior, Scott et al. 2016), starting from a
prior draw, and sends a *message* built from the :class:`ClientResult`
(draws, a Gaussian, a point). A masked client (absent, or whose update
diverged) never enters any aggregate. The server side comes in two kinds:

* :class:`OneRoundAlgorithm` keeps **one slot per client**
  (:class:`OneRoundState`) and combines in ``posterior()``: for methods that
  need every client's draws (Ensemble, PredictiveBayes, the kernel EP-MCMC
  variants) or points. A client that takes part again overwrites its slot.
* :class:`SummingOneRoundAlgorithm` keeps **masked sums of sufficient
  statistics** (:class:`SumState`: natural parameters for EP-MCMC,
  precision-weighted sums for Consensus Monte Carlo) plus a (K,) flag of the
  clients counted, their sizes and effective sample sizes: server memory
  does not grow with K beyond those O(K) scalars, and the aggregate is a sum,
  as secure aggregation and cross-machine engines need. Rule for repeated
  participation (``clients_per_round < K`` over several rounds): a client is
  counted **once**, with its first accepted message; later messages from a
  counted client are ignored (a sum cannot forget a term).

A client learns its id from its client state (``init`` gives client ``k``
the state ``k``), which keeps shapes fixed whatever subset of clients takes
part and works unchanged when client and server run on different machines.

One set of client runs can feed several aggregates without recomputation:
:func:`run_clients` runs a backend once on every client and
:meth:`OneRoundAlgorithm.posterior_from_results` (or :func:`aggregate`)
builds any one-round method's posterior from those results.

Gaussian algebra (moment matching with shrinkage, the prior's Gaussian,
guarded products) lives in :mod:`fedprob.gaussian`.

The pieces: :mod:`.one_round_base` (the two server bases),
:mod:`.client_runs` (the shared client phase, :func:`run_clients`, :func:`aggregate`),
:mod:`.messages` (client results as messages) and :mod:`.mc_checks` (the Monte Carlo check of a
product); this module gathers their names.
"""
from __future__ import annotations

from ..gaussian import guarded_product as gaussian_product  # noqa: F401  (name kept for importers)
from ..gaussian import prior_draws, prior_gaussian  # noqa: F401  (names kept for importers)
from .client_runs import (ClientRuns, FromClientPhase, PhaseData, aggregate, client_phase_key,  # noqa: F401
                          run_client_phase, run_clients)
from .mc_checks import MC_ERROR_WARN, monte_carlo_check  # noqa: F401
from .messages import (client_gaussian_message, client_weights, draws_ess, mc_message,  # noqa: F401
                       result_draws, result_gaussian)
from .one_round_base import (OneRoundAlgorithm, OneRoundState, SumState, SummingOneRoundAlgorithm,  # noqa: F401
                             check_choice, check_client, check_int)

__all__ = ["OneRoundAlgorithm", "OneRoundState", "PhaseData", "FromClientPhase", "run_client_phase",
           "client_phase_key", "SummingOneRoundAlgorithm", "SumState", "ClientRuns",
           "run_clients", "aggregate", "result_draws", "result_gaussian", "draws_ess", "mc_message",
           "client_gaussian_message", "MC_ERROR_WARN",
           "monte_carlo_check", "client_weights", "check_client", "prior_gaussian", "prior_draws",
           "gaussian_product"]
