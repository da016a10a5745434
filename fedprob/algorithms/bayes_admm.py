"""BayesADMM (Tran et al., "Bayesian duality"): the natural loop with ``alpha = 1/(1 + rho K)``.

Client (Eq. 7; Alg. 1 line 4 for diagonal Gaussians, tempered as App. D)::

    q_k = argmin_q E_q[l_k / tau + v_k' theta - theta' U_k theta / 2] + rho KL(q || q_g)

duals ``v_k += gamma (S_k m_k - S_g m_g)``, ``U_k += gamma (S_k - S_g)``
(lines 5-6; the authors' code keeps the opposite sign and subtracts the
duals at the server, which is the same algorithm); server (lines 9-11)::

    S_g = (1 - alpha) mean_k S_k + alpha (S_0 + sum_k U_k)
    S_g m_g = (1 - alpha) mean_k S_k m_k + alpha (S_0 m_0 + sum_k v_k)

with ``alpha = 1 / (1 + rho K)``, started at the prior. The client problem
is solved by the backend given: :class:`~fedprob.inference.IVON` (Alg. 2)
or a Laplace/Newton solve (the delta approximation at the mode, with the
diagonal GGN for ``family="diag"`` and the full GGN for ``"full"``,
exact for quadratic losses, App. C.4), or, for ``family="full"``,
:class:`~fedprob.inference.VON` (variational online Newton with a full
precision, the paper's full-covariance solver). The default is the Laplace solve
(deterministic, no Monte Carlo noise); ``client=IVON()`` is Alg. 1 as
printed and works at the same defaults.

Step sizes. With ``rho = 1`` the dual step defaults to ``gamma = 0.3``
(the paper: "typically 0.1 works well"; its 0.1 is kept by passing it).
``gamma = rho = 1`` is unstable
on heterogeneous clients, whatever the client solver: after the first
round ``u_k = gamma (s_k - s_0)`` is ``gamma`` times client k's curvature ``H_k`` and the server
precision is ``s_g = s_0 + (1 + gamma) sum_k H_k / (K + 1)`` (the mean over
``lambda_k`` counts each site once, the dual sum with weight
``alpha = 1 / (K + 1)``), so the next client problem's quadratic term
``rho s_g - u_k`` is negative in the coordinates where one client holds
more than ``(1 + gamma) / (gamma (K + 1))`` of the total curvature beyond the
prior's (``11 / (K + 1)`` at 0.1, ``6 / (K + 1)`` at 0.2, ``4.3 / (K + 1)`` at
0.3: 39% of a coordinate's curvature at ``K = 10``). A loss with linear tails
(logistic regression) is then unbounded below along them: on the
heterogeneous Credit split (K = 10) at ``gamma = 1`` two IVON clients (three Laplace ones)
had a negative quadratic term after round 1 and the server mean reached
1e17 in round 2. At the fixed point the term is at least the prior's
(``S_0 + sum_{j != k} U_j`` at ``rho = 1``): the overshoot is a transient of
the first rounds. So with the diagonal family the term's precision is floored
at the prior's, centred at the server mean, wherever it falls below
(:meth:`~fedprob.algorithms.natural.NaturalLoop.client_target`): the solve stays
bounded and the client in the round, and the fixed point is unchanged. Networks
with skewed classes have such coordinates: on the digits MLP of
``benchmarks/network_defaults.py`` (10 Dirichlet(0.5) clients, 20 rounds)
without the floor clients were left out in 0, 0 and 1 of the 20 rounds of
three partitions at 0.2, in 4-17 at 0.25 and in 14-19 at 0.3 (the runs 2-6
times longer, their searches running off); with it none at 0.2 or 0.3
(95.8% and 95.7%, NLL 0.151 and 0.150). On 10 logistic-regression clients, one
of them holding 3,000 of 4,800 rows and nearly all the curvature of one input,
the diagonal loop at a step of 0.5 left clients out in 6 rounds and ended 0.57
posterior sd from the pooled MAP without the floor, none and within 0.05 sd
with it (tests/test_dual.py); the full family (the unset family there) converges
at 0.3 within 0.003 sd, as at 0.1 and 0.2, and on the Credit split 0.2, 0.3 and
0.5 reach the accuracy and NLL 0.1 reaches (84.7-85.5%, NLL 0.355-0.360). A
Laplace client that does run off (the full family, ``rho < 1``) is left out of
the round with a warning (below). The larger step moves the duals, which
correct the clients' drift, sooner: on the Fashion-MNIST MLP of
``benchmarks/network_defaults.py --fmnist`` (10 clients with skewed classes,
three splits, each number the mean of rounds R-2 to R as the paper reads its
own) ``BayesADMM()`` scored 79.5 / 82.4 / 82.6% after 10 / 25 / 50 rounds,
against 78.25 / 81.49 / 82.71% at 0.2 before the floor (single readings at 0.1:
78.9 / 81.1 / 82.0; the paper: 77.0 / 81.5 / 82.3 with its tuned settings):
ahead on every split after 10 and 25 rounds (by 0.2-2.4 points), within
the splits' spread after 50 (-0.25, +0.27, -0.33 points; NLL 0.544 against
0.530), all short of
the pooled MAP's 85.5%. On the convex federations of ``benchmarks/defaults.py``
(8 clients of 20 to 3,000 rows, full family) 0.3 stays within 0.09 posterior sd
of pooled NUTS with sds 0.97-1.05x. The price is a slower server precision on
few clients (default rounds, ``NaturalLoop.rounds_for``: 18 for 4 clients at
0.3 against 15 at 0.2, where the two rates of the server-mix recursion happen
to cancel; 38 against 37 for 8, 47 for 10 at both). The IVON inputs are the paper's (:func:`bayes_admm_client_inputs`,
checked against the Gaussian optimum in the IVON tests). On a linear
regression the fixed point is the pooled mean-field optimum (exact mean,
diagonal of the exact precision), which IVON clients reach in 40 rounds
within their Monte Carlo noise (precision within 5%, mean within 0.03
posterior sd over 10 seeds).

Iterate averaging. BayesADMM's server Gaussian is ``1 - alpha = rho K / (1 + rho K)`` the
mean of the round's fresh client solves, so where those solves carry noise of their own it
jitters about the fixed point from round to round instead of settling (PVI's, the prior times
sites that each move by ``damping = 1/K`` a round, damps that noise itself). With minibatch MAP
searches (Laplace clients on networks, :func:`~fedprob.inference.laplace.map_search_settings`)
``iterate_average="auto"``, the default, reports the polynomial-decay average of the server's
natural parameters over the rounds (weights about ``round^7``, a mean age of about ``R / 9``
rounds: :func:`~fedprob.algorithms.natural.average_step`); the loop, and so its fixed point, is
unchanged, and where the search is full-batch (every conjugate and convex oracle) the posterior is
the last round's, bit for bit. On the Fashion-MNIST MLP of ``benchmarks/network_defaults.py
--fmnist`` at the dual step 0.2, read after each of rounds 40 to 50 of one run, the last round scored 82.0-84.15%
(mean 82.9%, NLL 0.513) on one split and 80.9-82.0% (81.6%, 0.554) on another, the average
82.95-83.7% (83.3%, 0.497) and 82.4-82.75% (82.6%, 0.527): a steadier reading (its sd 0.23 and
0.11 points against 0.68 and 0.30) and a better one; over three splits 82.5% (NLL 0.530) against
82.1% (0.548) (``benchmarks/results/network_defaults_fmnist.md``). It lags a run that still
climbs: after 10 rounds 79.1% against the last round's 79.8%. With IVON clients on
the digits softmax (47 rounds) the average trailed the last round (NLL 0.1815 against 0.1794,
the same accuracy): IVON's noise there is smaller than the average's lag, so a Monte Carlo
backend reports the last round unless a number is passed.

Prop. 3.2: for quadratic losses, ``rho = gamma = 1/K`` and the server
started at the prior, one round gives the exact posterior. The default is
``rho = 1`` nonetheless: with ``rho = 1/K`` the client's quadratic term
``rho S_g - U_k`` is negative wherever client k's curvature exceeds the
average, and a loss that grows only linearly (logistic regression) is then
unbounded below: the client solves (IVON or Laplace) diverged on a
heterogeneous logistic regression, while ``rho = 1`` converged. A diagonal
family makes even a quadratic loss unbounded there once parameters are
correlated (the site holds only the diagonal of the client's curvature):
Prop. 3.2 needs ``family="full"``. A Laplace client whose search runs off
along such a direction (:func:`fedprob.inference.laplace.runs_off`) sends NaN
and is left out of the round, with a warning that says why; before, its
finite mean of 1e10 took the server to 1e15.

:func:`bayes_admm_client_inputs` is the paper's own mapping of the client
problem to IVON's objective (App. D, Eq. 41); the loop reaches the same
objective through the LocalTarget (``likelihood_weight = 1/(rho tau)``, the
duals and ``q_g`` in its Gaussian term), which IVON maps with
:func:`fedprob.inference.ivon.local_target_inputs`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import jax.numpy as jnp

from ..inference.ivon import IVONInputs
from ..inference.laplace import Laplace
from .aliases import alias_field, resolve_family, take_alias
from .natural import Configured, NaturalLoop, unset_family_for


def bayes_admm_client_inputs(num_data, rho, tau, v, u, global_mean, global_precision) -> IVONInputs:
    """IVON inputs of a BayesADMM client (BayesADMM paper, App. D, Eq. 41).

    The client problem ``E_q[l_k/tau + v_k' theta - theta'(u_k theta)/2] +
    rho KL(q || N(m_g, diag(s_g)^-1))`` (``l_k`` the summed loss of the
    client's ``N_k`` points) is IVON's objective with the **mean** loss
    ``l_k / N_k``, ``lambda = N_k / (rho tau)``, ``v = tau v_k / N_k``,
    ``u = tau u_k / N_k`` and prior ``q_g = N(m_g, diag(s_g)^-1)``.
    """
    num_data = jnp.asarray(num_data, jnp.result_type(float))
    ess = num_data / (rho * tau)
    return IVONInputs(ess, tau * jnp.asarray(v) / num_data, tau * jnp.asarray(u) / num_data,
                      jnp.asarray(global_mean), jnp.asarray(global_precision))


@dataclasses.dataclass(frozen=True)
class BayesADMM(Configured):
    """BayesADMM (module docstring).

    client: Gaussian backend (None: ``Laplace(hessian="diag_ggn")`` for diag,
    ``Laplace(hessian="ggn")`` for full; ``IVON()`` is Alg. 1 as printed; ``VON()`` the
    full-covariance variational solve); family: "diag" or "full" (None, the default: the
    client's own family; without a client "full" on a model of at most 100 parameters or with
    client-local sites, "diag" beyond (:meth:`for_model`); alias ``covariance``); rho: KL weight (1; 1/K
    gives Prop. 3.2); damping: the site (dual) step (0.3, three times the paper's usual 0.1: module docstring; None = rho,
    as in Prop. 3.2; alias ``gamma``, the paper's name); delta: prior precision (None = the model
    prior's); tau: temperature of the client losses (1: the posterior of the model; the
    paper's 0.1 gives each client ``lambda = N_k / tau`` and a 10 times sharper likelihood,
    which a network under a weak prior needs: with IVON clients on the Fashion-MNIST MLP of
    benchmarks/dual.py, 72.2% after 10 rounds at tau = 0.1 against 47.2% at tau = 1, whose
    wide mean-field posterior predicts poorly); prediction: "auto" (the default: "mean" or
    "average", whichever predicts the clients' rows better under their cavities,
    :mod:`~fedprob.algorithms.prediction_choice`), "average" over ``num_predictive_draws`` draws
    of q_g, or "mean"; iterate_average: "auto" (the default: the polynomial-decay average of the
    rounds' Gaussians where the clients search their modes on minibatches, the last round's
    elsewhere; module docstring), None (always the last round's: Alg. 1 as printed) or the weights'
    exponent (about ``round^eta``).
    """

    client: Any = None
    family: Optional[str] = None
    rho: float = 1.0
    damping: Optional[float] = 0.3
    delta: Optional[float] = None
    tau: float = 1.0
    prediction: str = "auto"
    num_predictive_draws: int = 32
    iterate_average: Union[None, float, str] = "auto"
    covariance: Any = alias_field()
    gamma: Any = alias_field()

    def __post_init__(self):
        take_alias(self, "damping", "gamma", 0.3)
        object.__setattr__(self, "_family_unset", self.family is None and self.client is None)
        resolve_family(self, "diag")
        self.loop()

    def for_model(self, potential):
        """An unset family (no client given) becomes "full" (full-GGN Laplace clients) as PVI's does
        (:func:`~fedprob.algorithms.natural.unset_family_for`): on 8 logistic-regression clients
        with correlated, shifted inputs the diagonal family's fixed point has sds 0.83-0.96x NUTS's
        (the conditional precisions), "full" 0.97-1.01x with the mean within 0.09 sd."""
        family = unset_family_for(potential) if self._family_unset else None
        return dataclasses.replace(self, family=family) if family else self

    def loop(self) -> NaturalLoop:
        client = self.client
        if client is None:
            client = Laplace(hessian="diag_ggn" if self.family == "diag" else "ggn")
        rho: Union[float, str] = self.rho
        damping: Union[float, str] = "rho" if self.damping is None else self.damping
        return NaturalLoop(client=client, family=self.family, rho=rho, damping=damping, alpha="admm",
                           delta=self.delta, tau=self.tau, prediction=self.prediction,
                           num_predictive_draws=self.num_predictive_draws,
                           iterate_average=self.iterate_average)


__all__ = ["BayesADMM", "bayes_admm_client_inputs"]
