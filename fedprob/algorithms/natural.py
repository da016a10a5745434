"""The natural-parameter (dual) loop: one exponential-family round for PVI, FedLap, BayesADMM and ADMM.

Gaussian families ``q = N(m, S^-1)`` in natural parameters
``lambda = (S m, S)`` (see :mod:`fedprob.gaussian`); ``<lambda_hat, T(theta)>
= v' theta - theta' U theta / 2`` for a dual (site) ``lambda_hat = (v, U)``.
Families: ``"isotropic"`` (precision fixed at the prior's, ``delta I`` for
``p0 = N(0, I/delta)``; only the mean moves), ``"diag"`` and ``"full"``.

One round (all signs as in the BayesADMM paper, Fig. 2b and Eqs. 7-9; the
FedLap paper's PVI form, Eqs. 5-6, is the case ``rho = alpha = 1``):

* client k solves (``l_k`` the **summed** negative log likelihood of its
  rows, tempered by ``tau``)::

      q_k = argmin_q  E_q[l_k / tau] + <lambda_hat_k, T(theta)> + rho KL(q || q_g)

  Divided by rho this is ``-ELBO`` of the LocalTarget with
  ``prior_weight = 0`` (the prior enters at the server),
  ``likelihood_weight = 1 / (rho tau)`` and Gaussian term
  ``(lambda_g - lambda_hat_k / rho)`` (a cavity when ``rho = 1``), so any
  Gaussian client backend solves it without knowing the aggregator:
  :class:`~fedprob.inference.Laplace` (delta approximation at the mode with
  its curvature: FedLap-Cov), :class:`~fedprob.inference.IVON`
  (variational, diagonal: BayesADMM Alg. 1) or a full-covariance backend.
  With a server mix ``alpha < 1``, ``rho >= 1`` and the diagonal family the
  Gaussian term's precision is floored at the prior's, centred at the server
  mean, where the duals' early overshoot takes it below
  (:meth:`NaturalLoop.client_target`; it is at least the prior's at the fixed
  point, so the fixed point is the paper's).
  The isotropic family only needs the mode (delta approximation, FedLap and
  ADMM): ``lambda_k = (s m_k, s)``.
* dual (site) update ``lambda_hat_k += gamma_k (lambda_k - lambda_g)``; the
  client sends its natural-parameter delta ``Delta_k = lambda_k - lambda_g``
  (and its mode, used by nothing but diagnostics). Everything the server
  needs is a function of the deltas: the site increments ``gamma_k Delta_k``
  and the round's mean ``mean_k lambda_k = lambda_g + mean_k Delta_k``. The
  delta is the update that differential privacy clips and noises and the
  norm bound screens, for every alpha.
* server::

      lambda_g = (1 - alpha) mean_k lambda_k + alpha (lambda_0 + sum_k lambda_hat_k)

  The mean runs over the clients of the round; the sum over all K sites,
  kept at the server as a running sum of the increments (absent clients'
  sites are unchanged, and the aggregate stays a masked sum). ``alpha = 1``
  is PVI, ``alpha = 1 / (1 + rho K)`` BayesADMM. A server precision that is
  not positive definite is reported as a non-finite update, which the engine
  rejects (the round then changes no state).
* reported posterior: ``lambda_g`` of the last round, or with
  ``iterate_average`` the polynomial-decay average of the rounds' ``lambda_g``
  (:func:`average_step`), kept beside the loop's state and read by nothing
  the loop does (BayesADMM's default where the clients' searches take
  minibatches: :class:`~fedprob.algorithms.BayesADMM`).

A straggler truncated at a deadline (:mod:`fedprob.faults`) solves its
client problem with the steps it completed when the backend has a partial
result (IVON, VON: ``local_step_count``), and its ``lambda_k`` and site increment
are those of the state reached; with Laplace clients and the isotropic family
(exact solves) its message is discarded.

The prior ``lambda_0`` is the model's: exact natural parameters for Normal
priors (:func:`fedprob.gaussian.prior_gaussian`); any other prior site is
replaced by a Gaussian moment-matched to prior draws (unconstrained space),
with a warning. ``delta`` overrides the model prior with ``N(0, I/delta)``
(:mod:`fedprob.algorithms.model_prior`).
The server starts at the prior (``lambda_g = lambda_0``), every site at 0.

Client-local sites (``infer={"local": True}``, :mod:`fedprob.local_sites`).
Every Gaussian above lives on the global block ``g`` only: lambda_0 is the
prior of the global sites, the cavity acts on ``g``, and the local sites keep
their conditional prior ``p(l_k | g)`` whole in the client's target. The
client approximates the joint of ``(g, l_k)`` by a Gaussian (a Laplace
backend at the joint mode with the **full** joint curvature: a diagonal
``hessian`` is raised to its full counterpart, since the coupling between
the blocks is what the marginal needs; or a Gaussian VI guide), and
``lambda_k`` is its global marginal (mean ``m_g``, precision the Schur
complement ``P_gg - P_gl P_ll^-1 P_lg``) in the loop's family. The client
keeps its local conditional ``l_k | g`` (mean, slope, covariance) in its
state; the posterior's local posteriors are those conditionals averaged
over the final ``q_g`` (exact on linear-Gaussian models). The isotropic
family (mode only) and mean-field clients (IVON, a diagonal SVI guide: their
global marginal ignores the coupling) refuse local sites. With ``rho != 1`` or
``tau != 1`` the solve weighs ``log p(l_k | g) + log p(D_k | g, l_k)`` by
``1 / (rho tau)``: the Laplace marginal of the global block is then that of
the tempered joint, the Schur complement scaled by ``1 / (rho tau)`` as the
loop expects, and the conditional's covariance is divided by ``rho`` (the
local sites tempered by ``1 / tau`` alone, as the model's posterior at that
temperature). ``alpha < 1`` (BayesADMM) changes only the server's mix. After the last round ``fp.run`` makes one
more client pass (:meth:`NaturalLoop.refresh_local`): each client solves its
tilted distribution against the final ``q_g`` and keeps the conditional at
that joint mode.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from .. import gaussian as gauss
from ..inference.laplace import Laplace
from ..inference import laplace_marginal as lm
from .. import local_sites as loc
from ..inference.optim import minimize
from ..posteriors import Gaussian, GlobalPosterior, Samples
from ..potential import make_target
from ..protocols import ClientBackend, finite_flag
from .aliases import alias_field, backend_family, resolve_family, take_alias
from .base import Algorithm, Context, masked_sum, sequential_pays, stack_init
from .model_prior import model_prior

Array = jax.Array

FAMILIES = ("isotropic", "diag", "full")
PREDICTIONS = ("average", "mean", "auto")


class NaturalServer(NamedTuple):
    """Server state: ``lam`` = lambda_g, ``site_sum`` = sum_k lambda_hat_k over all K clients,
    ``prior`` = lambda_0, ``start`` = (d,) starting point of the next client solves; with iterate
    averaging (:attr:`NaturalLoop.iterate_average`) ``average`` = the polynomial-decay average of
    lambda_g over the rounds so far and ``rounds`` = their count (both None when not kept)."""

    lam: Gaussian
    site_sum: Gaussian
    prior: Gaussian
    start: Array
    average: Optional[Gaussian] = None
    rounds: Optional[Array] = None

    @property
    def reported(self) -> Gaussian:
        """The Gaussian the posterior reports: the iterate average where one is kept, else lambda_g."""
        return self.lam if self.average is None else self.average


class NaturalClient(NamedTuple):
    """Client state with client-local sites: the site ``lambda_hat_k`` on the global block and the
    local conditional ``l_k | g`` of the client's last solve."""

    site: Gaussian
    local: loc.LocalConditional


#: a diagonal Laplace curvature and its full counterpart (the joint of global and local sites)
_FULL_HESSIAN = {"diag": "full", "diag_ggn": "ggn"}


def _check_positive(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, str) or not (float(value) > 0 and float(value) < float("inf")):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _as_family(g: Gaussian, family: str) -> Gaussian:
    if family == "full":
        return g.to_full()
    return g.to_diag()


#: the most rounds a run of the natural loop takes by default (:meth:`NaturalLoop.rounds_for`)
MAX_DEFAULT_ROUNDS = 100
#: the smallest damping ``"auto"`` takes: the step that brings a site to 99% of its client's
#: curvature within :data:`MAX_DEFAULT_ROUNDS` rounds, ``1 - 0.01^(1/100)`` = 0.045
AUTO_DAMPING_FLOOR = 1.0 - 0.01 ** (1.0 / MAX_DEFAULT_ROUNDS)


def _server_mix_errors(step: float, alpha: float, rounds: int):
    """``(t, u_t, e_t)`` for ``t = 1..rounds``: :func:`_server_mix_rounds`'s recursion."""
    u, e = 1.0, -1.0
    for t in range(1, rounds + 1):
        u, e = (1.0 - step) * u, (1.0 - alpha) * e + alpha * step * u
        yield t, u, e


def _server_mix_rounds(step: float, alpha: float, visits: float) -> int:
    """Rounds until a conjugate model's server precision is within 1% of its fixed point, for the
    loop with server mix ``alpha`` and site step ``step = gamma / rho`` (exact client solves).

    Client k's solve gives ``S_k = S_g + (H_k - U_k) / rho``, so its site moves as
    ``U_k += (gamma / rho)(H_k - U_k)`` whatever the server holds, and with ``u_t = sum_k (H_k - U_k)``
    (a fraction of the total curvature, 1 at the prior) and ``e_t = S_g - S_*`` (-1 at the prior)::

        u_{t+1} = (1 - gamma / rho) u_t,    e_{t+1} = (1 - alpha) e_t + alpha (gamma / rho) u_t

    (``alpha = 1 / (1 + rho K)`` cancels the mean's ``1 / (rho K)``). The linear natural parameter
    follows the same recursion, so the count is the first round from which ``|e_t| < 0.01`` for good
    (``e_t`` is a sum of two geometric terms and may cross zero). A client in ``1 / visits`` of the
    rounds moves its site that much less often: the count is scaled by ``visits``.
    """
    last = 0
    for t, u, e in _server_mix_errors(step, alpha, 100 * MAX_DEFAULT_ROUNDS):
        if abs(e) >= 0.01:
            last = t
        elif abs(u) < 1e-4:
            break
    return math.ceil(visits * (last + 1) - 1e-9)


def _server_mix_reached(step: float, alpha: float, rounds: float) -> float:
    """The fraction of the curvature the server precision holds after ``rounds`` rounds
    (:func:`_server_mix_rounds`'s recursion)."""
    e = -1.0
    for _, _, e in _server_mix_errors(step, alpha, int(rounds)):
        pass
    return 1.0 + e


#: the weight exponent of ``iterate_average="auto"`` (:func:`average_step`)
AUTO_AVERAGE_ETA = 7.0


def average_step(rounds, eta: float):
    """The weight of round ``t = rounds`` in the polynomial-decay average (Shamir and Zhang, 2013)::

        avg_t = (1 - w_t) avg_{t-1} + w_t lambda_t,    w_t = (eta + 1) / (t + eta)

    ``w_1 = 1`` (the first average is the first iterate); round ``s``'s weight in ``avg_t`` is
    ``prod_{j=1}^{eta} (s + j - 1) / (t + j)`` up to a constant, about ``s^eta``: ``eta = 0`` is the
    uniform (Polyak-Ruppert) average, a larger ``eta`` forgets the early rounds faster (the average's
    mean age is about ``t / (eta + 2)`` rounds)."""
    return (eta + 1.0) / (rounds + eta)


#: the client diagnostics the loop keeps (per client, per round)
KEPT_DIAGNOSTICS = ("grad_norm", "loss", "mean_drift", "unbounded")


def _kept_diagnostics(res) -> dict:
    """The entries of a client result's diagnostics named in :data:`KEPT_DIAGNOSTICS`."""
    return {k: v for k, v in res.diagnostics.items() if k in KEPT_DIAGNOSTICS}


@dataclasses.dataclass(frozen=True)
class NaturalLoop(Algorithm):
    """The exponential-family dual loop (module docstring); the named algorithms configure it.

    client: a Gaussian client backend (``None``: ``Laplace(hessian="diag_ggn")``
        for "diag", ``Laplace(hessian="ggn")`` for "full"; for "isotropic" only
        the mode is used, searched with the backend's optimizer settings).
    family: "isotropic", "diag" or "full" (None, the default: the client
        backend's own, :func:`fedprob.algorithms.aliases.backend_family`;
        "diag" without a client).
    rho: weight of ``KL(q || q_g)`` in the client problem; a number, or
        ``"clients"`` for ``1 / K``.
    damping: the site (dual) step gamma_k; a number, ``"size"`` for ``N_k / N``
        per client, ``"clients"`` for ``1 / K``, ``"auto"`` for ``max(1 / K,``
        :data:`AUTO_DAMPING_FLOOR` ``)`` (1/K up to 22 clients; above, the step
        that converges within :data:`MAX_DEFAULT_ROUNDS` rounds: at 1/K, 105
        clients need about 480 rounds), or ``"rho"`` for rho's value (alias:
        ``gamma``, the BayesADMM paper's name).
    alpha: server mix; a number in (0, 1], or ``"admm"`` for ``1 / (1 + rho K)``.
    delta: prior precision override (``p0 = N(0, I/delta)``); None: the model prior.
    tau: temperature of the client losses (``l_k / tau``).
    prediction: what ``posterior().predict`` does by default: ``"average"``
        (Bayesian model average over ``num_predictive_draws`` draws of q_g) or
        ``"mean"`` (plug-in at the server mean).
    init_strategy: the shared starting point of the first client solves.
    iterate_average: what the posterior reports: None (the default) the last round's ``lambda_g``;
        a number ``eta >= 0``, the polynomial-decay average of ``lambda_g`` over the rounds with
        weights about ``round^eta`` (:func:`average_step`; the loop itself, and so its fixed point,
        is unchanged: the clients solve against the last ``lambda_g``); ``"auto"``,
        :data:`AUTO_AVERAGE_ETA` where the clients' Laplace solves search their modes on minibatches
        (:meth:`minibatch_search`) and None elsewhere: exact solves converge, and an average
        would only lag them.
    """

    client: Any = None
    family: Optional[str] = None
    rho: Union[float, str] = 1.0
    damping: Union[float, str] = 1.0
    alpha: Union[float, str] = 1.0
    delta: Optional[float] = None
    tau: float = 1.0
    prediction: str = "average"
    posterior_only = ("prediction",)          # read by posterior() alone (Algorithm.round_key)
    num_predictive_draws: int = 32
    init_strategy: str = "center"
    iterate_average: Union[None, float, str] = None
    gamma: Any = alias_field()

    default_rounds = 10
    #: the local refresh after the last round is a round's client solve (sites and server discarded)
    refresh_is_a_round = True

    def __post_init__(self):
        self._validate()

    def _validate(self):
        take_alias(self, "damping", "gamma", 1.0)
        resolve_family(self, "diag", FAMILIES)
        if self.client is not None:
            if not isinstance(self.client, ClientBackend):
                raise TypeError(f"client must be a fedprob.inference backend, got {type(self.client).__name__}")
            if getattr(self.client, "output", None) != "gaussian":
                raise ValueError(f"client {type(self.client).__name__} returns {self.client.output}; the "
                                 "natural loop needs a Gaussian backend (Laplace, IVON)")
            if self.family == "isotropic" and not isinstance(self.client, Laplace):
                raise ValueError("the isotropic family uses the delta approximation (the mode only): pass "
                                 "client=None or a Laplace backend (its optimizer settings are used)")
        if self.rho != "clients":
            _check_positive("rho", self.rho)
        if self.damping not in ("size", "clients", "auto", "rho"):
            _check_positive("damping", self.damping)
        if self.alpha != "admm":
            if isinstance(self.alpha, str) or not 0.0 < float(self.alpha) <= 1.0:
                raise ValueError(f"alpha must lie in (0, 1] or be 'admm', got {self.alpha!r}")
        _check_positive("delta", self.delta, allow_none=True)
        _check_positive("tau", self.tau)
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {self.prediction!r}")
        if int(self.num_predictive_draws) < 1:
            raise ValueError(f"num_predictive_draws must be >= 1, got {self.num_predictive_draws}")
        a = self.iterate_average
        if a is not None and a != "auto":
            if isinstance(a, (str, bool)) or not (float(a) >= 0 and float(a) < float("inf")):
                raise ValueError(f"iterate_average must be None, 'auto' or a number >= 0 (the weights' "
                                 f"exponent), got {a!r}")

    # -- configuration ---------------------------------------------------------------------
    @property
    def backend(self):
        if self.client is not None:
            return self.client
        return Laplace(hessian="ggn" if self.family == "full" else "diag_ggn")

    def client_chunk_for(self, ctx):
        """One client at a time (:func:`~fedprob.algorithms.base.sequential_pays`) for GGN Laplace
        clients, whose curvature loop stops at the client's last row; else all vmapped."""
        b = self.joint_backend(ctx.potential)
        if isinstance(b, Laplace) and b.hessian in ("ggn", "diag_ggn") and sequential_pays(ctx):
            return 1
        return None

    def joint_backend(self, potential):
        """The backend of the client solves: :attr:`backend`, with a diagonal Laplace curvature raised
        to the full one when the model has client-local sites (module docstring)."""
        b = self.backend
        if potential.local_sites and isinstance(b, Laplace) and b.hessian in _FULL_HESSIAN:
            return dataclasses.replace(b, hessian=_FULL_HESSIAN[b.hessian])
        return b

    def local_sites_refusal(self, potential):
        if self.family == "isotropic":
            return (f"{type(self).__name__}'s isotropic family uses the clients' modes only and has no "
                    "marginal of the global block")
        b = self.joint_backend(potential)
        if not isinstance(b, Laplace) and backend_family(b) == "diag":
            return (f"{type(self).__name__} with {type(b).__name__} clients (a mean-field Gaussian) does not "
                    "take client-local sites: a mean-field guide drops the coupling between the global and "
                    "the local sites, and its global marginal comes out far too narrow (sd 0.32 of the "
                    "exact one on a normal-normal hierarchy); use Laplace clients (the default) or a "
                    "full-covariance guide (SVI(guide='full'))")
        return None

    def _rho(self, num_clients: int) -> float:
        return 1.0 / num_clients if self.rho == "clients" else float(self.rho)

    def rho_value(self, ctx: Context) -> float:
        return self._rho(ctx.num_clients)

    def _alpha(self, num_clients: int) -> float:
        if self.alpha == "admm":
            return 1.0 / (1.0 + self._rho(num_clients) * num_clients)
        return float(self.alpha)

    def alpha_value(self, ctx: Context) -> float:
        return self._alpha(ctx.num_clients)

    def _gamma(self, num_clients: int, num_rows, n):
        """The site step of a client of ``n`` rows (``n``: a number or an array of them)."""
        if self.damping == "size":
            return n / float(num_rows)
        if self.damping == "clients":
            return 1.0 / num_clients
        if self.damping == "auto":
            return max(1.0 / num_clients, AUTO_DAMPING_FLOOR)
        if self.damping == "rho":
            return self._rho(num_clients)
        return float(self.damping)

    def gamma_value(self, ctx: Context, n):
        dt = jnp.result_type(float)
        return jnp.asarray(self._gamma(ctx.num_clients, ctx.num_rows, jnp.asarray(n, dt)), dt)

    def rounds_for(self, num_clients: int, client_sizes, clients_per_round: int, name: Optional[str] = None) -> int:
        """Default rounds: enough for every site to take in 99% of its client's curvature (``name``:
        the algorithm named in the warning when the cap falls short).

        With ``alpha = 1`` (PVI, FedLap, FedLap-Cov) and exact client
        solves on a conjugate model, a site equals the fraction
        ``1 - (1 - gamma_k)^r`` of the client's likelihood after ``r`` updates,
        and a client takes part in ``M / K`` of the rounds; the default is
        ``ceil((K / M) log 0.01 / log(1 - min_k gamma_k))`` (44 rounds for ten
        clients at damping 1/K), at least :attr:`default_rounds` (10) and at
        most :data:`MAX_DEFAULT_ROUNDS`. With a server mix ``alpha < 1``
        (BayesADMM) the precision's error follows a two-rate recursion
        (:func:`_server_mix_rounds`): the default is the number of rounds it
        needs to stay below 1% (at BayesADMM's default ``gamma = 0.3``, ``rho = 1``:
        18 rounds for 4 clients, 38 for 8, 47 for 10, 94 for 20, where
        ``1 - alpha = K / (K + 1)`` has overtaken ``1 - gamma``; at ``gamma = 0.2``
        15, 37, 47 and 94; at ``gamma = 0.1`` 25, 34, 44 and 93, and 10 rounds
        left 6% of the curvature out at 4 clients, 27% at 8).
        """
        sizes = np.asarray(client_sizes, np.float64)
        K, M = int(num_clients), int(clients_per_round)
        g = float(np.min(self._gamma(K, sizes.sum(), sizes)))
        if self.alpha != 1:
            need = _server_mix_rounds(g / self._rho(K), float(self._alpha(K)), K / M)
        elif g >= 1.0:
            return int(self.default_rounds)
        else:
            need = math.ceil((K / M) * math.log(0.01) / math.log1p(-g) - 1e-9) if g > 0 else MAX_DEFAULT_ROUNDS
        if need > MAX_DEFAULT_ROUNDS:
            if self.alpha != 1:
                reached = _server_mix_reached(g / self._rho(K), float(self._alpha(K)), MAX_DEFAULT_ROUNDS * M / K)
                what = "the server precision to"
            else:
                reached = 1.0 - (1.0 - g) ** (MAX_DEFAULT_ROUNDS * M / K)
                what = "each site to"
            warnings.warn(
                f"{name or type(self).__name__}: the default {MAX_DEFAULT_ROUNDS} rounds bring {what} "
                f"{100 * reached:.0f}% of the clients' curvature at damping {g:.3g} ({need} rounds reach 99%): "
                f"the posterior will be too wide. Pass rounds={need}, or a larger damping where the "
                "clients' solves are stable", RuntimeWarning, stacklevel=4)
        return int(min(max(need, self.default_rounds), MAX_DEFAULT_ROUNDS))

    def minibatch_search(self, ctx: Context) -> bool:
        """Whether the clients' solves are Laplace approximations at a minibatch MAP search on these
        client sizes (:meth:`~fedprob.inference.Laplace.search_settings_for`: unset, from
        ``2^27`` row-parameters of a client's gradient, networks; or a ``batch_size`` below the
        largest client's rows). Such a search ends wherever its last minibatches left it, and the
        site's ``P m`` carries that jitter into every round."""
        b = self.joint_backend(ctx.potential)
        if not isinstance(b, Laplace):
            return False
        rows = int(np.max(np.asarray(ctx.client_sizes))) if np.size(ctx.client_sizes) else 0
        _, _, batch_size = b.search_settings_for(rows, int(ctx.potential.dim))
        return batch_size is not None and batch_size < rows

    def average_eta(self, ctx: Context) -> Optional[float]:
        """The weights' exponent of the iterate average on this federation (None: no average kept)."""
        a = self.iterate_average
        if a == "auto":
            return AUTO_AVERAGE_ETA if self.minibatch_search(ctx) else None
        return None if a is None else float(a)

    # -- protocol ---------------------------------------------------------------------------
    def init(self, ctx: Context, key, data):
        prior = model_prior(ctx.potential, self.family, self.delta, type(self).__name__)
        zero = Gaussian(jnp.zeros_like(prior.linear), jnp.zeros_like(prior.precision))
        start = ctx.potential.init(key, self.init_strategy)
        dg = ctx.potential.dim_global
        # the average starts at the prior with no round counted (the first round's weight is 1)
        avg = {} if self.average_eta(ctx) is None else {
            "average": prior, "rounds": jnp.zeros((), prior.linear.dtype)}
        if ctx.potential.local_sites:
            client = NaturalClient(zero, loc.initial_conditional(start, dg))
            return NaturalServer(prior, zero, prior, start[:dg], **avg), stack_init(ctx.num_clients, client)
        return NaturalServer(prior, zero, prior, start, **avg), stack_init(ctx.num_clients, zero)

    def floors_the_gaussian_term(self, ctx: Context) -> bool:
        """Whether the client problem's Gaussian term is floored at the prior (:meth:`client_target`):
        a server mix ``alpha < 1`` (BayesADMM), ``rho >= 1`` and the diagonal family."""
        return self.family == "diag" and self.alpha_value(ctx) < 1.0 and self.rho_value(ctx) >= 1.0

    def client_target(self, ctx: Context, lam_g: Gaussian, site: Gaussian, data,
                      server: Optional[NaturalServer] = None):
        """The LocalTarget whose ``-ELBO`` (times rho) is the client problem (module docstring).

        The Gaussian term is ``lambda_g - lambda_hat_k / rho``. With a server mix ``alpha < 1``
        (BayesADMM), ``rho >= 1`` and the diagonal family its precision ``S_g - U_k / rho`` is, at the
        fixed point, ``S_0 + sum_{j != k} U_j + (1 - 1/rho) U_k`` (with PSD client curvature at least the
        prior's ``S_0``), but the server mix lets the duals overshoot in the first rounds, and where
        one client holds most of a coordinate's curvature (a class only it has) the term turns
        negative there and a loss with linear tails is unbounded below. Given ``server``, each
        coordinate whose term precision is below the prior's is replaced by the prior's precision
        centred at the server mean (``S_0 m_g, S_0``): the client's solve stays bounded and in the
        round, and the fixed point, where the floor does not bind, is unchanged."""
        rho = self.rho_value(ctx)
        linear, precision = lam_g.linear - site.linear / rho, lam_g.precision - site.precision / rho
        if server is not None and self.floors_the_gaussian_term(ctx):
            floor = server.prior.precision
            low = precision < floor
            precision = jnp.where(low, floor, precision)
            linear = jnp.where(low, floor * lam_g.mean(), linear)
        term = loc.embed_global(Gaussian(linear, precision), ctx.dim)
        return make_target(data, ctx.dim, prior_weight=0.0, likelihood_weight=1.0 / (rho * float(self.tau)),
                           linear=term.linear, precision=term.precision)

    def local_step_count(self, ctx: Context, data):
        """The backend's steps (``local_step_count``) for an iterative Gaussian backend (IVON); None
        for the isotropic family and Laplace clients, whose exact solves have no partial result."""
        if self.family == "isotropic":
            return None
        return getattr(self.backend, "local_step_count", None)

    def solve_client(self, ctx: Context, server: NaturalServer, site: Gaussian, data, key, max_steps=None,
                     local: Optional[loc.LocalConditional] = None):
        """``(lambda_k, mode, diagnostics)`` of the client problem (stopped after ``max_steps`` steps);
        with client-local sites (``local``: the client's conditional, whose mean starts the local
        block) ``(lambda_k, mode_global, diagnostics, new conditional)``."""
        target = self.client_target(ctx, server.lam, site, data, server)
        backend = self.backend
        if local is not None:
            extra = {} if max_steps is None else {"max_steps": max_steps}
            start = jnp.concatenate([server.start, local.mean.astype(server.start.dtype)])
            backend = self.joint_backend(ctx.potential)
            dg = ctx.potential.dim_global
            if isinstance(backend, Laplace) and backend.local == "marginal" and lm.applies(ctx.potential):
                marginal, mode, cond, diag = lm.laplace_marginal(ctx.potential, target, start,
                                                                 min_precision=backend.min_precision)
                mean, diag = mode, {"grad_norm": diag["grad_norm"], "loss": diag["loss"]}
            else:
                res = backend.run(key, ctx.potential, target, start, **extra)
                mean = res.params if isinstance(self.backend, Laplace) else res.posterior.mean()
                marginal, cond = loc.split_joint(res.posterior, mean, dg)
                diag = _kept_diagnostics(res)
            # the solve tempers the local sites with the likelihood by 1/(rho tau); their conditional is
            # the model's tempered by 1/tau alone (the KL weight rho belongs to the global block)
            cond = cond._replace(cov=cond.cov / self.rho_value(ctx))
            return _as_family(marginal, self.family), mean[:dg], diag, cond
        if self.family == "isotropic":
            optimizer, learning_rate, batch_size = (
                backend.search_settings(target, server.start.shape[-1]) if isinstance(backend, Laplace)
                else (backend.optimizer, backend.learning_rate, backend.batch_size))
            res = minimize(ctx.potential, target, server.start, key=key, num_steps=backend.num_steps,
                           optimizer=optimizer, learning_rate=learning_rate, batch_size=batch_size)
            s = server.lam.precision
            mode = jnp.where(jnp.isfinite(res.loss), res.params, jnp.nan)   # failed solve: left out
            return Gaussian(s * mode, s), mode, {"grad_norm": res.grad_norm}
        extra = {} if max_steps is None else {"max_steps": max_steps}
        res = backend.run(key, ctx.potential, target, server.start, **extra)
        lam_k = _as_family(res.posterior, self.family)
        diag = _kept_diagnostics(res)
        return lam_k, res.params, diag

    def client_update(self, ctx: Context, server_state: NaturalServer, client_state: Gaussian, data, key,
                      max_steps=None):
        if isinstance(client_state, NaturalClient):
            lam_k, mode, diag, cond = self.solve_client(ctx, server_state, client_state.site, data, key,
                                                        max_steps, local=client_state.local)
            site = client_state.site
        else:
            lam_k, mode, diag = self.solve_client(ctx, server_state, client_state, data, key, max_steps)
            site = client_state
        g = self.gamma_value(ctx, data.n)
        delta = Gaussian(lam_k.linear - server_state.lam.linear, lam_k.precision - server_state.lam.precision)
        new_site = Gaussian(site.linear + g * delta.linear, site.precision + g * delta.precision)
        if isinstance(client_state, NaturalClient):
            return NaturalClient(new_site, cond), (delta, mode), diag
        return new_site, (delta, mode), diag

    def server_update(self, ctx: Context, server_state: NaturalServer, messages, weights, mask):
        """``weights`` are the clients' sizes ``N_k`` (used only by ``damping="size"``)."""
        delta, mode = messages
        g = self.gamma_value(ctx, weights)
        per_client = lambda x: jnp.reshape(g, jnp.shape(g) + (1,) * (x.ndim - jnp.ndim(g))) * x
        inc = jax.tree_util.tree_map(per_client, delta)
        site_sum = server_state.site_sum
        added = masked_sum(inc, mask)
        site_sum = Gaussian(site_sum.linear + added.linear, site_sum.precision + added.precision)
        pvi = Gaussian(server_state.prior.linear + site_sum.linear,
                       server_state.prior.precision + site_sum.precision)
        a = self.alpha_value(ctx)
        count = jnp.maximum(jnp.sum(mask), 1).astype(pvi.linear.dtype)
        if a < 1.0:
            shift = jax.tree_util.tree_map(lambda x: x / count, masked_sum(delta, mask))
            mean = Gaussian(server_state.lam.linear + shift.linear, server_state.lam.precision + shift.precision)
            lam = Gaussian((1 - a) * mean.linear + a * pvi.linear, (1 - a) * mean.precision + a * pvi.precision)
        else:
            lam = pvi
        if self.family == "full":
            lam = Gaussian(lam.linear, 0.5 * (lam.precision + lam.precision.T))
        # a non-positive-definite q_g is no distribution: report it as non-finite (the engine rejects it)
        ok = gauss.is_valid(lam)
        lam = jax.tree_util.tree_map(lambda x: jnp.where(ok, x, jnp.nan), lam)
        start = self.next_start(server_state, lam, mode, mask, count)
        average, rounds = server_state.average, server_state.rounds
        if average is not None:
            rounds = rounds + 1
            w = average_step(rounds, self.average_eta(ctx))
            average = jax.tree_util.tree_map(lambda a, x: a + w * (x - a), average, lam)
        return NaturalServer(lam, site_sum, server_state.prior, start, average, rounds)

    def refresh_local(self, ctx: Context, server_state: NaturalServer, client_state, data, key):
        """One more solve of the client's tilted distribution against the final ``q_g`` (its site
        unchanged): the local conditional is re-taken at the final joint mode. A solve that is not
        finite keeps the previous conditional."""
        final = server_state._replace(lam=server_state.reported)
        _, _, _, cond = self.solve_client(ctx, final, client_state.site, data, key, local=client_state.local)
        ok = finite_flag(cond)
        cond = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), cond, client_state.local)
        return NaturalClient(client_state.site, cond), ok

    # -- differential privacy (fedprob.privacy) ----------------------------------------------
    def update_part(self, ctx: Context, message):
        """The natural-parameter delta ``lambda_k - lambda_g`` (linear and precision parts): every
        server term is a function of it (module docstring). ``None`` for ``damping="size"``, whose
        dual step ``N_k / N`` needs the client's private size at the server (differential privacy
        refuses that configuration; the norm bound then covers every leaf of the message)."""
        if self.damping == "size":
            return None
        return message[0]

    def with_update(self, ctx: Context, message, update):
        """The message with the noised delta; the mode (unused by the server) zeroed, not sent."""
        return update, jnp.zeros_like(message[1])

    def gaussian_fits(self, ctx: Context, server_state: NaturalServer, client_states, data):
        """``q_g`` against each client's tilted target: ``q_g`` with the client's site and the
        Gaussian prior replaced by the exact factors they stand for,
        ``p0(z) p(D_k | z)^(1/tau) exp(<lambda_g - lambda_0 - lambda_hat_k, T(z)>)``
        (with ``delta`` the prior is the Gaussian ``lambda_0`` itself). At a fixed point the
        client's own solve returns ``q_g``, so this is the client's Gaussian against its target,
        the true prior in it. None for the isotropic family (a mode, no covariance)."""
        if self.family == "isotropic" or ctx.potential.local_sites:
            return None
        lam, prior = server_state.reported, server_state.prior
        exact_prior = self.delta is None
        base = Gaussian(lam.linear - prior.linear, lam.precision - prior.precision) if exact_prior else lam
        sites = client_states
        targets = jax.vmap(lambda s, d: make_target(
            d, ctx.dim, prior_weight=1.0 if exact_prior else 0.0, likelihood_weight=1.0 / float(self.tau),
            linear=base.linear - s.linear, precision=base.precision - s.precision,
            dtype=lam.linear.dtype))(sites, data)
        return Gaussian(lam.linear, lam.precision), targets

    def next_start(self, server_state, lam, mode, mask, count):
        """Where the next round's client solves start: the new server mean."""
        return lam.mean()

    def posterior(self, ctx: Context, server_state: NaturalServer, client_states):
        lam = server_state.reported
        local = client_states.local if isinstance(client_states, NaturalClient) else None
        info = {"kind": f"{self.family} Gaussian", "algorithm": type(self).__name__}
        if server_state.average is not None:
            info["kind"] = (f"{self.family} Gaussian, the average of {int(server_state.rounds)} rounds' "
                            "(iterate_average)")
            info["iterate_average"] = (
                f"the polynomial-decay average of the server's natural parameters over "
                f"{int(server_state.rounds)} rounds (weights about round^{self.average_eta(ctx):g}), "
                "the loop's iterates carrying the noise of the clients' stochastic solves")
        if local is not None:
            info["local_posterior"] = ("each client's Laplace conditional of its local sites given the global "
                                       "ones, from its last solve, averaged over the final global posterior")
        if self.prediction == "auto":
            info["prediction"] = "auto: the average until the clients' cavities choose (choose_prediction)"
        return GlobalPosterior(ctx.potential, Gaussian(lam.linear, lam.precision),
                               num_predictive_draws=int(self.num_predictive_draws),
                               prediction="average" if self.prediction == "auto" else self.prediction,
                               info=info, local=local)

    def choose_prediction(self, ctx: Context, server_state: NaturalServer, client_states, data, posterior):
        """``prediction="auto"``: predict at the mean or averaged over q_g, whichever scores the
        clients' rows better under their cavities (:mod:`~fedprob.algorithms.prediction_choice`;
        ``posterior.info["prediction_choice"]`` keeps the scores). The average where there is
        nothing to choose from: one client, client-local sites, the isotropic family, no rows."""
        if (self.prediction != "auto" or "prediction_choice" in posterior.info or data is None
                or self.family == "isotropic" or ctx.num_clients < 2 or isinstance(client_states, NaturalClient)
                or not isinstance(posterior.form, Gaussian)):
            return posterior
        from .prediction_choice import choose

        choice = choose(ctx.potential, server_state.reported, client_states, data, jax.random.PRNGKey(7),
                        prior=server_state.prior)
        posterior.prediction = choice["prediction"]
        posterior.info["prediction_choice"] = choice
        posterior.info["prediction"] = choice["prediction"]
        return posterior


#: Largest number of parameters (a model without client-local sites) on which PVI's and BayesADMM's
#: unset family is "full"
FULL_MAX_DIM = 100


def unset_family_for(potential) -> Optional[str]:
    """The family an unset ``family`` (and no client) takes on this model: ``"full"`` (full-GGN
    Laplace clients) on a model with client-local sites whose global block has at most
    :data:`fedprob.inference.laplace_marginal.MAX_GLOBAL_DIM` parameters, and on a model of at most
    :data:`FULL_MAX_DIM` parameters; None (keep "diag") beyond. The diagonal of a client's
    curvature (its conditional precisions) makes the posterior too narrow wherever parameters are
    correlated (sds 0.05-0.4x NUTS's for the global block of a hierarchical regression of 105
    clients; 0.77-0.91x on 8 logistic-regression clients with correlated, shifted inputs, where
    "full" gives 0.96-1.01x), and a d x d precision is cheap at that size."""
    from ..inference import laplace_marginal as lm

    if potential.local_sites:
        return "full" if potential.dim_global <= lm.MAX_GLOBAL_DIM else None
    return "full" if potential.dim <= FULL_MAX_DIM else None


class Configured(Algorithm):
    """Base of the named algorithms: a frozen dataclass of the method's own hyperparameters whose
    :meth:`loop` returns the :class:`NaturalLoop` it is; every protocol method is the loop's."""

    default_rounds = 10
    refresh_is_a_round = True
    #: what ``posterior()`` predicts with by default: no round reads it
    posterior_only = ("prediction",)

    def loop(self) -> NaturalLoop:  # pragma: no cover - abstract
        raise NotImplementedError

    def rounds_for(self, num_clients, client_sizes, clients_per_round):
        return self.loop().rounds_for(num_clients, client_sizes, clients_per_round, name=type(self).__name__)

    def init(self, ctx, key, data):
        return self.loop().init(ctx, key, data)

    def local_step_count(self, ctx, data):
        return self.loop().local_step_count(ctx, data)

    def client_chunk_for(self, ctx):
        return self.loop().client_chunk_for(ctx)

    def gaussian_fits(self, ctx, server_state, client_states, data):
        return self.loop().gaussian_fits(ctx, server_state, client_states, data)

    def refresh_local(self, ctx, server_state, client_state, data, key):
        return self.loop().refresh_local(ctx, server_state, client_state, data, key)

    def local_sites_refusal(self, potential):
        reason = self.loop().local_sites_refusal(potential)
        return None if reason is None else reason.replace("NaturalLoop", type(self).__name__)

    def client_update(self, ctx, server_state, client_state, data, key, max_steps=None):
        return self.loop().client_update(ctx, server_state, client_state, data, key, max_steps)

    def server_update(self, ctx, server_state, messages, weights, mask):
        return self.loop().server_update(ctx, server_state, messages, weights, mask)

    def update_part(self, ctx, message):
        return self.loop().update_part(ctx, message)

    def with_update(self, ctx, message, update):
        return self.loop().with_update(ctx, message, update)

    def reports_point(self) -> bool:
        """Whether the result is the point ``w_g`` (a family that fixes the covariance at the
        prior's reports no spread: :func:`point_of`)."""
        return False

    def posterior(self, ctx, server_state, client_states):
        post = self.loop().posterior(ctx, server_state, client_states)
        post.info["algorithm"] = type(self).__name__
        return point_of(post) if self.reports_point() else post

    def choose_prediction(self, ctx, server_state, client_states, data, posterior):
        if self.reports_point():
            return posterior
        return self.loop().choose_prediction(ctx, server_state, client_states, data, posterior)


#: what a point result of an isotropic-family method says about its spread
FIXED_COVARIANCE = ("the isotropic family's covariance is the prior's (the method moves the mean only), so "
                    "it is no posterior spread: the result is the point w_g")


def point_of(post: GlobalPosterior) -> GlobalPosterior:
    """The point estimate at a Gaussian posterior's mean (unconstrained), keeping its info: for the
    methods whose family fixes the covariance at the prior's (FedLap, ADMM, FedLap-Func), whose
    Gaussian's sds are the prior's and would be read as a posterior's."""
    info = dict(post.info, kind="point estimate", covariance=FIXED_COVARIANCE)
    return GlobalPosterior(post.potential, Samples(post.form.mean()[None]), info=info)


__all__ = ["NaturalLoop", "NaturalServer", "NaturalClient", "Configured", "model_prior", "FAMILIES",
           "average_step", "AUTO_AVERAGE_ETA",
           "point_of", "FIXED_COVARIANCE"]
