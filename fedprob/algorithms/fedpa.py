"""FedPA: federated posterior averaging (Al-Shedivat et al. 2021, Alg. 1 with Alg. 3-4).

Round: every participating client runs its sampling backend on its local
posterior ``p0(w)^(1/K) p(D_k | w)`` started at the server point ``theta``,
and sends ``delta_k = Sigma_hat_k^-1 (theta - mu_k)``: ``mu_k`` the mean of
its ``l`` draws, ``Sigma_hat_k = rho_l I + (1 - rho_l) c_k S_k`` the shrinkage
estimate of its covariance (``rho_l = 1 / (1 + (l - 1) rho)``, ``S_k`` the
sample covariance), computed by the O(l^2 d) dynamic program of
:mod:`fedprob.algorithms.fedpa_delta` without a d x d matrix. The server
averages the deltas with weights ``q_k ∝ N_k`` over the clients that took
part (a client whose delta is not finite is left out by the engine and
reported in the history) and feeds the average to an optax optimiser as a
gradient. Rounds before ``burn_in_rounds`` use ``rho = 0`` (``Sigma_hat = I``):
``delta_k = theta - mu_k``, FedAvg's delta with the local iterates averaged
(exactly FedAvg for a single draw).

Scale. FedPA's objectives are MEAN losses: the posterior it averages is the
local posterior tempered by ``N_k``, ``exp(-f_k)`` with
``f_k = -log(p0^(1/K) p(D_k|w)) / N_k``, whose covariance near its mode is
``A_k^-1`` (``A_k`` the mean-loss Hessian). At that scale
``Sigma_k^-1 (theta - mu_k) = A_k (theta - mu_k)`` is the gradient of
``f_k`` for a quadratic, the weighted mean of the deltas is the gradient of
the global mean loss (whose minimiser is the global posterior mode), and the
target ``I`` of the shrinkage is FedAvg's delta. ``covariance_scale`` states
the scale of the draws: the default ``"n"`` multiplies the sample
covariance by ``N_k`` (``c_k = N_k``), the right factor for draws of the
untempered posterior (NUTS, SGLD/SGHMC at temperature 1, and IASG, whose
averaged iterates approximate it when ``steps_per_sample * batch_size`` is
about ``N_k``); a number ``c`` uses ``c_k = c`` (``1.0``: the authors' raw
convention, draws already at the mean-loss scale).

Shrinkage and the server step. A number is the paper's ``rho``; ``"oas"`` /
``"rblw"`` estimate the weight ``rho_l`` on the target from each client's
draws (Chen et al. 2010, App. C). With exact moments and ``rho_l -> 0`` the
fixed point is the global posterior mode; ``rho_l > 0`` moves it toward
FedAvg's, and caps the delta's curvature ``Sigma_hat^-1`` at ``1 / rho_l``.
``normalize=True`` (default) sends ``rho_l delta_k = (I + (l - 1) rho c_k
S_k)^-1 (theta - mu_k)``: FedAvg's delta in every direction the draws do not
resolve, a smaller one where they do, so server SGD at learning rate 1 is
stable whatever the curvature and burn-in rounds are exactly FedAvg rounds.
``normalize=False`` sends the paper's ``delta_k`` (then the server learning
rate must stay below ``2 rho_l``, or below ``2 / lambda_max`` of the mean-loss
Hessian when ``rho_l`` is small). Defaults: ``shrinkage=None`` is
``rho = 1 / (l - 1)`` (``rho_l = 1/2``) with server SGD at 1. Smaller
``rho_l`` removes more of FedAvg's bias but resolves the flat directions more
slowly (e.g. ``shrinkage=1.0, normalize=False, server_learning_rate=0.2`` on
standardised linear regression reaches the global mode). ``burn_in_rounds=2`` by default: SGD-based samplers started far
from the local mode put their drift into the sample covariance, which damps
the very direction of progress.

Drifting chains. A client's draws carry its covariance only once its chain has settled; a chain
still travelling toward its local mode (a network's, from the server point, within a few hundred
local steps) puts its own progress into the sample covariance, and the delta then damps exactly
that direction: on the Fashion-MNIST MLP of benchmarks/dual.py FedPA scored 44.5% after 10 rounds,
against 70.8% with every round a burn-in round. So under ``family="diag"`` a client whose draws
travel, by two checks on its own draws, sends a burn-in round's message that round
(``theta - mu_k``, precision diagonal 1), reported as the client diagnostic ``drifting``:

1. drift: :func:`fedprob.algorithms.fedpa_delta.drift_ratio` (how far the means of the first and
   last halves of its draws lie apart against their spread: about 1 for independent draws) exceeds
   ``max_drift`` times the ratio of draws moving on a straight line (25 for 10 draws);
2. spread: :func:`fedprob.algorithms.fedpa_delta.drift_spread_ratio`, the draws' variance along
   their drift direction times ``N_k`` times the secant curvature of the client's mean loss between
   the two half-means (two gradients on at most :data:`SPREAD_ROWS` rows), exceeds
   ``max_drift_spread``: the chain spreads wider along its path than the local posterior does.

Both are needed. IASG's chains drift on digits softmax regression as on the network (0.8-0.9 of a
straight line's ratio), but there they creep along directions the client's rows hardly constrain
(spread 0.04-1.1, almost always below 1), where a wide covariance is the truth and the damped delta
is FedPA's correction (0.919-0.928 accuracy, NLL 0.27-0.28 after 20 rounds; 0.892 / 0.370 when the
drift alone decides); on the Fashion-MNIST MLP the clients' chains travel downhill (spread 2 to 5 on
clients of 233 to 431 rows, 8 to 34 on those of 1,189 and 2,555), and sending their burn-in message
instead lifts FedPA() from 44.5% to 70.3% after 10 rounds. The paper's networks ran hundreds of
FedAvg burn-in rounds for the same reason; here each client decides from its own draws. A run
whose last round had drifting clients says so (a warning and ``result.info["run_message"]``): the
posterior's precision there is the burn-in stand-in, not client moments. ``max_drift=None`` turns
the checks off; ``max_drift_spread=None`` lets the drift alone decide.

After the last round ``posterior`` is a diagonal Gaussian approximation:
mean the server point, precision ``N sum_k q_k diag(Sigma_hat_k^-1)`` from the
last round's participants (each client's mean-scale precision times ``N_k``:
a product of the client Gaussians, the prior counted once through the 1/K
shares); before any sampling round it is ``N`` in every coordinate.

Family. The above is ``family="diag"``, the paper's algorithm, for large
models. ``family="full"`` (the default up to :data:`FULL_MAX_DIM` global
parameters) keeps each client's full covariance: ``Sigma_hat_k`` is the
sample covariance of the draws times ``c_k`` (its correlations shrunk toward
its own diagonal by OAS when there are fewer than 10 d draws,
:func:`fedprob.gaussian.sample_covariance`: the marginal variances are kept,
where the target ``I`` would replace them), the client sends
``P_k (theta - mu_k)`` and ``P_k = Sigma_hat_k^-1`` (d x d), and the server
step is preconditioned by their weighted mean,
``theta <- theta - lr (sum_k q_k P_k)^-1 sum_k q_k P_k (theta - mu_k)``: at the
default learning rate 1 one Newton step to the product of the client
Gaussians, ``(sum_k P_k)^-1 sum_k P_k mu_k``, whatever the scale and the
correlations of the problem. Its fixed point with exact client moments is
the global posterior mean for Gaussian sub-posteriors, and the posterior is
the full Gaussian ``N(theta, (N sum_k q_k P_k)^-1)``. The defaults of this
family follow from it: no burn-in rounds (a sampler with its own burn-in
reaches the sub-posterior from any start) and a sampler whose draws have the
posterior's spread, :func:`full_client` (SGHMC at temperature 1, at least
10 d draws); ``shrinkage`` and ``normalize`` are not used. A diagonal
product of correlated clients is biased (the conditional precisions stand for
the marginals): on 8 logistic-regression clients of 20 to 3,000 rows with
correlated, shifted inputs, ``family="diag"`` over SGHMC left the mean 1.2
posterior sd off and sds at 0.7x, ``"full"`` within 0.2 sd.

Client-local sites (``infer={"local": True}``, :mod:`fedprob.local_sites`).
The server point ``theta`` and every quantity above live on the global block.
A client samples the joint of the global block and its own local sites,
``p0(g)^(1/K) p(l_k | g) p(D_k | g, l_k)`` (the prior share on the global
sites only), started at ``(theta, its local sites' conditional mean given
theta)``; the global block of its draws is a sample of its sub-posterior's
global marginal, from which the delta and the precision diagonal are
computed as above, so the fixed point is the same product of global
marginals. The client keeps the Gaussian conditional ``l_k | g`` regressed on
its joint draws (:func:`fedprob.local_sites.conditional_from_draws`;
``p(l_k | g, D_k)`` does not depend on the prior share) in its client state;
the posterior's local posteriors are those conditionals averaged over the
final Gaussian. After the last round ``fp.run`` makes one more client pass
(:meth:`FedPA.refresh_local`): every client samples once more from the final
server point and keeps the conditional of those draws (clients that never
took part get one too).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from ..inference.iasg import IASG
from ..inference.sghmc import SGHMC
from .. import local_sites as loc
from ..posteriors import GlobalPosterior
from ..potential import make_target
from ..protocols import DRAW_STATS, ClientBackend, finite_flag
from .. import gaussian, inputs
from .base import Algorithm, Context, stack_init, weighted_mean
from . import fedpa_delta as dp
from .server_opt import ServerOptimizer


class FedPAState(NamedTuple):
    """Server state: point, optax state, rounds done, last aggregated precision diagonal."""

    params: Any
    opt_state: Any
    round: Any
    precision: Any


class FedPAClient(NamedTuple):
    """Client state of FedPA on a model with client-local sites: the conditional ``l_k | g`` of the
    client's local sites, regressed on its last joint draws."""

    local: loc.LocalConditional


#: The default ``max_drift``: it separates drifting from settled chains. IASG's 10 draws on the
#: Fashion-MNIST MLP score 0.9 to 1.0 of a straight line's ratio (22 to 25 of 25) on every client but a
#: 9-row one (0.12); NUTS's 100 draws on a settled 2-d client at most 0.08 (24 of 294). IASG's chains on
#: digits softmax regression score 0.8-0.9 too, which the spread check (:data:`SPREAD_MAX`) tells apart.
DRIFT_MAX = 0.5
#: The default ``max_drift_spread``: the draws' variance along their drift direction at most the local
#: posterior's there (a Gaussian's along one of its axes: one over the curvature; module docstring).
#: Digits softmax regression: 0.04-1.1 in its sampling rounds; the Fashion-MNIST MLP's clients: 2-5 (233
#: to 431 rows) and 8-34 (1,189 and 2,555 rows). On that network 1.0 scored 70.3 / 75.0% after 10 / 25
#: rounds against 68.6 / 73.9% at 2.0, and the digits MLP 92.3% against 91.7% (three splits).
SPREAD_MAX = 1.0
#: The spread check's two gradients use every row of a client of up to this many (padded) rows, else a
#: uniform draw of this many rows (the same rows for both).
SPREAD_ROWS = 256
#: Largest number of global parameters for which ``family=None`` means ``"full"``.
FULL_MAX_DIM = 100
FAMILIES = ("full", "diag")


def default_client() -> IASG:
    """FedPA's default sampler under ``family="diag"``: IASG with minibatches of 32 (Alg. 4)."""
    return IASG(step_size=None, num_burnin=100, steps_per_sample=20, num_samples=10, batch_size=32,
                init_strategy="prior")


def full_client(dim: int) -> SGHMC:
    """FedPA's default sampler under ``family="full"``: SGHMC at temperature 1 (draws with the
    sub-posterior's spread, as the full covariance needs) with at least ``10 dim`` draws."""
    return SGHMC(num_samples=max(200, gaussian.DRAWS_PER_DIM * int(dim)))


def check_client(client) -> None:
    if not isinstance(client, ClientBackend):
        raise TypeError(f"FedPA's client must be a fedprob.inference backend, got {type(client).__name__}")


@dataclasses.dataclass(frozen=True)
class FedPA(Algorithm, ServerOptimizer):
    """Federated posterior averaging (module docstring for the math and scale).

    client: any sampling backend returning draws (IASG, SGLD, SGHMC,
        CyclicalSGHMC, NUTS); ``None`` is :func:`full_client` under ``"full"``,
        :func:`default_client` (IASG) under ``"diag"``.
    shrinkage: the paper's ``rho >= 0``, ``None`` for ``1 / (l - 1)`` (half the
        weight on the target), or ``"oas"`` / ``"rblw"`` (data-driven).
    burn_in_rounds: rounds that send FedAvg's delta ``theta - mu_k`` (None: 0 under ``"full"``, 2
        under ``"diag"``).
    max_drift: under ``"diag"``, a client's round is a burn-in round when the drift ratio of its draws
        exceeds ``max_drift`` times that of draws on a straight line (default :data:`DRIFT_MAX`) and
        their spread ratio exceeds ``max_drift_spread`` (module docstring); None: never.
    max_drift_spread: the spread check's limit (default :data:`SPREAD_MAX`); None: the drift alone
        decides.
    average_rounds: under ``"full"``, the m-th sampling round's server step is 1/m of the Newton
        step (and the precision a running mean): the server point is the mean of the rounds'
        products, whose Monte Carlo error falls like 1/sqrt(rounds). None: on with plain server SGD at
        learning rate 1.
    covariance_scale: ``"n"`` (draws of the untempered local posterior,
        covariance multiplied by ``N_k``) or a number.
    normalize: send ``rho_l delta_k`` (default; FedAvg's scale) or the paper's ``delta_k``.
    server_optimizer / server_learning_rate / server_momentum: the optax
        server optimiser ("sgd", "adam", "adagrad", "yogi" or a
        transformation), as in :class:`~fedprob.algorithms.FedAvg`.
    init_strategy: the server's starting point (default the prior centre).
    family: ``"full"`` (client covariances kept whole, Newton server step),
        ``"diag"`` (the paper's dynamic program and a diagonal posterior), or
        None: ``"full"`` up to :data:`FULL_MAX_DIM` global parameters, else
        ``"diag"`` (module docstring).
    """

    client: Any = None
    shrinkage: Union[None, float, str] = None
    burn_in_rounds: Optional[int] = None
    covariance_scale: Union[str, float] = "n"
    normalize: bool = True
    family: Optional[str] = None
    average_rounds: Optional[bool] = None
    max_drift: Optional[float] = DRIFT_MAX
    max_drift_spread: Optional[float] = SPREAD_MAX

    default_rounds = 10

    def __post_init__(self):
        if self.shrinkage is None:
            pass
        elif isinstance(self.shrinkage, str):
            if self.shrinkage not in ("oas", "rblw"):
                raise ValueError(f"shrinkage must be a number >= 0, 'oas' or 'rblw', got '{self.shrinkage}'")
        elif not self.shrinkage >= 0:
            raise ValueError(f"shrinkage must be >= 0, got {self.shrinkage}")
        if not (self.covariance_scale == "n" or (not isinstance(self.covariance_scale, str)
                                                 and self.covariance_scale > 0)):
            raise ValueError(f"covariance_scale must be 'n' or a positive number, got {self.covariance_scale!r}")
        if self.family not in (None,) + FAMILIES:
            raise ValueError(f"FedPA: family must be one of {FAMILIES} or None, got {self.family!r}")
        if self.max_drift is not None and not self.max_drift > 0:
            raise ValueError(f"max_drift must be a positive number or None, got {self.max_drift!r}")
        if self.max_drift_spread is not None and not self.max_drift_spread > 0:
            raise ValueError(f"max_drift_spread must be a positive number or None, got {self.max_drift_spread!r}")
        if self.burn_in_rounds is not None and int(self.burn_in_rounds) < 0:
            raise ValueError(f"burn_in_rounds must be >= 0, got {self.burn_in_rounds}")
        self.check_server_options()
        if self.client is not None:
            check_client(self.client)
        if self.client is not None and getattr(self.client, "output", "samples") != "samples":
            raise ValueError("FedPA needs a client backend that returns draws (output 'samples'), got "
                             f"{type(self.client).__name__}")

    @property
    def backend(self):
        """The client backend when none depends on the model (``client`` given, or ``family="diag"``)."""
        if self.client is not None:
            return self.client
        return default_client()

    def family_for(self, dim: int) -> str:
        """The family a run on ``dim`` global parameters uses."""
        if self.family is not None:
            return self.family
        return "full" if dim <= FULL_MAX_DIM else "diag"

    def backend_for(self, dim: int):
        """The client backend a run on ``dim`` global parameters uses."""
        if self.client is not None:
            return self.client
        return full_client(dim) if self.family_for(dim) == "full" else default_client()

    def burn_in_for(self, dim: int) -> int:
        """Rounds sending FedAvg's delta on ``dim`` global parameters."""
        if self.burn_in_rounds is not None:
            return int(self.burn_in_rounds)
        return 0 if self.family_for(dim) == "full" else 2

    def for_model(self, potential):
        """The configuration with its defaulted family, client and burn-in settled for the model."""
        dim = potential.dim_global
        return dataclasses.replace(self, family=self.family_for(dim), burn_in_rounds=self.burn_in_for(dim),
                                   client=self.backend_for(dim))

    def local_sites_refusal(self, potential):
        """None: the server works on the global block of the clients' joint draws (module docstring)."""
        return None

    def init(self, ctx: Context, key, data):
        pot = ctx.potential
        if not pot.local_sites:
            w, opt_state = self.server_start(pot, key)
            return FedPAState(w, opt_state, jnp.zeros((), jnp.int32), self._initial_precision(ctx, w)), ()
        z0 = pot.init(key, self.init_strategy)
        w = z0[:pot.dim_global]
        state = FedPAState(w, self._server_opt().init(w), jnp.zeros((), jnp.int32), self._initial_precision(ctx, w))
        return state, stack_init(ctx.num_clients, FedPAClient(loc.initial_conditional(z0, pot.dim_global)))

    def _initial_precision(self, ctx: Context, w):
        """``N`` in every coordinate (``N I`` under the full family): the state before any sampling round."""
        if self.family_for(w.shape[-1]) == "full":
            return float(ctx.num_rows) * jnp.eye(w.shape[-1], dtype=w.dtype)
        return jnp.full_like(w, float(ctx.num_rows))

    def _sample(self, ctx: Context, theta, client_state, data, key):
        """``(draws of the global block (l, d_g), new client state, backend result)``: the client's
        sampler on its sub-posterior, started at ``theta`` (and, with client-local sites, its local
        sites' conditional mean given ``theta``)."""
        target = make_target(data, ctx.dim, prior_weight=1.0 / ctx.num_clients, dtype=theta.dtype)
        backend = self.backend_for(theta.shape[-1])
        if not isinstance(client_state, FedPAClient):
            res = backend.run(key, ctx.potential, target, theta)
            return res.posterior.draws.astype(theta.dtype), client_state, res
        cond = client_state.local
        start_l = cond.mean + cond.slope @ (theta - cond.anchor)
        res = backend.run(key, ctx.potential, target, jnp.concatenate([theta, start_l.astype(theta.dtype)]))
        draws = res.posterior.draws.astype(theta.dtype)
        draws = draws.reshape(-1, draws.shape[-1])
        dg = theta.shape[-1]
        return draws[:, :dg], FedPAClient(loc.conditional_from_draws(draws, dg)), res

    def _drift_spread(self, ctx: Context, data, res, n, key):
        """:func:`fedprob.algorithms.fedpa_delta.drift_spread_ratio` of the client's chain (its joint draws
        with client-local sites), the mean loss's gradient on at most :data:`SPREAD_ROWS` rows."""
        draws = res.posterior.draws
        draws = draws.reshape(-1, draws.shape[-1]).astype(n.dtype)
        target = make_target(data, ctx.dim, prior_weight=1.0 / ctx.num_clients, dtype=n.dtype)
        batch = None if inputs.num_rows(data.X) <= SPREAD_ROWS else SPREAD_ROWS
        loss = lambda z: -ctx.potential.log_density(z, target, key, batch) / n
        return dp.drift_spread_ratio(draws, jax.grad(loss), n)

    def _rho(self, draws, scale):
        if isinstance(self.shrinkage, str):
            fn = dp.oas_rho if self.shrinkage == "oas" else dp.rblw_rho
            return dp.rho_from_weight(fn(draws, scale), draws.shape[0]).astype(draws.dtype)
        if self.shrinkage is None:
            return jnp.asarray(1.0 / max(draws.shape[0] - 1, 1), draws.dtype)
        return jnp.asarray(self.shrinkage, draws.dtype)

    def client_update(self, ctx: Context, server_state, client_state, data, key):
        theta = server_state.params
        draws, client_state, res = self._sample(ctx, theta, client_state, data, key)
        n = jnp.maximum(data.n, 1).astype(theta.dtype)
        scale = n if self.covariance_scale == "n" else jnp.asarray(self.covariance_scale, theta.dtype)
        sampling = server_state.round >= self.burn_in_for(theta.shape[-1])
        diag = {k: v for k, v in res.diagnostics.items() if k != DRAW_STATS and jnp.ndim(v) == 0}
        if self.family_for(theta.shape[-1]) == "full":
            d, prec, weight = full_message(draws, theta, scale, sampling)
            diag["rho_l"] = weight
            diag["delta_norm"] = jnp.linalg.norm(d)
            return client_state, (d, prec), diag
        drift, trend = dp.drift_ratio(draws)
        drifting = jnp.zeros((), bool)
        if self.max_drift is not None:
            drifting = drift > self.max_drift * trend
            if self.max_drift_spread is not None:
                spread = self._drift_spread(ctx, data, res, n, jax.random.fold_in(key, SPREAD_ROWS))
                drifting = drifting & (spread > self.max_drift_spread)
                diag["drift_spread"] = spread
        rho = jnp.where(sampling & ~drifting, self._rho(draws, scale), 0.0)
        rho_l = 1.0 / (1.0 + (draws.shape[0] - 1) * rho)
        d = dp.delta(draws, theta, rho, scale)
        if self.normalize:
            d = rho_l * d
        prec = dp.precision_diagonal(draws, rho, scale)
        diag["drift"] = drift
        diag["drifting"] = (sampling & drifting).astype(theta.dtype)
        diag["rho_l"] = rho_l
        diag["delta_norm"] = jnp.linalg.norm(d)
        return client_state, (d, prec), diag

    def server_update(self, ctx: Context, server_state, messages, weights, mask):
        deltas, precs = messages
        step = weighted_mean(deltas, weights, mask)
        mean_prec = weighted_mean(precs, weights, mask)
        prec = float(ctx.num_rows) * mean_prec
        if mean_prec.ndim == 2:                     # full family: the Newton step (module docstring)
            step = newton_step(mean_prec, step)
            if self.averages_rounds():
                # the m-th sampling round moves 1/m of the way: the running mean of the rounds' products
                m = jnp.maximum(server_state.round - self.burn_in_for(step.shape[-1]) + 1, 1).astype(step.dtype)
                step = step / m
                prec = server_state.precision + (prec - server_state.precision) / m
        params, opt_state = self.server_step(server_state.params, server_state.opt_state, step)
        return FedPAState(params, opt_state, server_state.round + 1, prec)

    def run_message(self, history):
        """The warning when clients' draws still drifted in the last round (module docstring)."""
        share = history[-1].get("client_drifting", 0.0)
        if not share > 0:
            return None
        return (f"FedPA: in the last round {100 * share:.0f}% of the participating clients' draws were still "
                f"drifting (drift ratio {history[-1].get('client_drift', float('nan')):.3g} on average, "
                f"flagged above {self.max_drift:g} times that of draws on a straight line"
                + (", spreading wider along their path than the local posterior"
                   if self.max_drift_spread is not None else "")
                + "): they sent FedAvg's delta "
                "and no covariance, so the posterior's sds are partly the burn-in stand-in (1 / sqrt(N)), not "
                "the clients' posterior moments. Longer client chains (e.g. client=IASG(num_burnin=...)) or "
                "more rounds let them settle")

    def averages_rounds(self) -> bool:
        """Whether the full family averages its sampling rounds (``average_rounds``; None: with plain
        server SGD at learning rate 1)."""
        if self.average_rounds is not None:
            return bool(self.average_rounds)
        return self.server_optimizer == "sgd" and not self.server_momentum and self.server_learning_rate == 1.0

    def refresh_local(self, ctx: Context, server_state, client_state, data, key):
        """``(state, finite)``: the client's local conditional regressed on a fresh run of its sampler
        from the final server point (a run that is not finite keeps the previous conditional)."""
        _, new, _ = self._sample(ctx, server_state.params, client_state, data, key)
        ok = finite_flag(new)
        return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, client_state), ok

    def update_part(self, ctx: Context, message):
        """The delta (the precision diagonal is not an update)."""
        return message[0]

    def with_update(self, ctx: Context, message, update):
        """``(update, 1)``: the precision (diagonal) is replaced by the data-independent 1 (``I`` under the
        full family; see fedprob.privacy)."""
        prec = message[1]
        if prec.ndim >= 2 and prec.shape[-1] == prec.shape[-2] and prec.shape[-1] == update.shape[-1]:
            return update, jnp.broadcast_to(jnp.eye(prec.shape[-1], dtype=prec.dtype), prec.shape)
        return update, jnp.ones_like(prec)

    def gaussian_fits(self, ctx: Context, server_state, client_states, data):
        """The global Gaussian against each client's tilted target: the global with the client's
        ``1/K`` share replaced by its exact sub-posterior, ``q(z)^(1 - 1/K) p0(z)^(1/K) p(D_k | z)``
        (None with client-local sites: the Gaussian stands for the global block of a joint target)."""
        if ctx.potential.local_sites:
            return None
        q = self.posterior(ctx, server_state, client_states).form
        K = ctx.num_clients
        rest = 1.0 - 1.0 / K
        targets = jax.vmap(lambda d: make_target(d, ctx.dim, prior_weight=1.0 / K, linear=rest * q.linear,
                                                 precision=rest * q.precision, dtype=q.linear.dtype))(data)
        return q, targets

    def posterior(self, ctx: Context, server_state, client_states):
        g = gaussian.from_mean_precision(server_state.params, server_state.precision)
        shape = "full" if server_state.precision.ndim == server_state.params.ndim + 1 else "diagonal"
        info = {"kind": f"FedPA: server point with a {shape} Gaussian from the last round's client moments "
                        "(an approximation)"}
        local = None
        if isinstance(client_states, FedPAClient):
            local = client_states.local
            info["local_posterior"] = ("each client's local sites given the global ones, regressed on its joint "
                                       "draws, averaged over the final Gaussian of the global block")
        return GlobalPosterior(ctx.potential, g, info=info, local=local)


def full_message(draws, theta, scale, sampling):
    """``(P (theta - mu), P, w)`` of one client under the full family: ``P`` the inverse of ``scale``
    times the draws' covariance (shrunk toward its diagonal below 10 d draws, with OAS weight ``w``),
    ``mu`` their mean; ``(theta - mu, I, 1)`` in a burn-in round (``sampling`` False)."""
    l, dim = draws.shape
    mu = jnp.mean(draws, 0)
    if l < 2:
        raise ValueError("FedPA(family='full') needs at least 2 draws per client")
    if l < gaussian.DRAWS_PER_DIM * dim:
        cov, weight = gaussian.shrinkage_covariance(draws)
    else:
        cov, weight = gaussian.sample_covariance(draws, shrink=False), jnp.zeros((), draws.dtype)
    cov = scale * (cov + jnp.diag(1e-6 * jnp.diagonal(cov) + 1e-30))   # jitter relative to each variance
    chol = jnp.linalg.cholesky(cov)
    eye = jnp.eye(dim, dtype=draws.dtype)
    P = jax.scipy.linalg.cho_solve((chol, True), eye)
    P = 0.5 * (P + P.T)
    delta = P @ (theta - mu)
    return (jnp.where(sampling, delta, theta - mu), jnp.where(sampling, P, eye),
            jnp.where(sampling, weight, 1.0).astype(draws.dtype))


def newton_step(mean_precision, mean_delta):
    """``(sum q_k P_k)^-1 sum q_k P_k (theta - mu_k)`` by a Cholesky solve (a least-squares solve if the
    averaged precision is not positive definite, e.g. a single client's singular burn-in)."""
    P = 0.5 * (mean_precision + mean_precision.T)
    chol = jnp.linalg.cholesky(P)
    ok = jnp.all(jnp.isfinite(chol))
    return jax.lax.cond(ok, lambda: jax.scipy.linalg.cho_solve((chol, True), mean_delta),
                        lambda: jnp.linalg.lstsq(P, mean_delta)[0])


__all__ = ["FedPA", "FedPAState", "FedPAClient", "default_client", "full_client", "FULL_MAX_DIM", "DRIFT_MAX",
           "SPREAD_MAX", "SPREAD_ROWS"]
