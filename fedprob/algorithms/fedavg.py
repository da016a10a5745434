"""FedAvg with server optimisers (generalised federated optimisation).

Round (FedPA paper Alg. 1; Reddi et al. 2021): each participating client runs
local optimisation from the server parameters ``w`` (see
:mod:`fedprob.algorithms.local_training`: mean loss, prior share 1/K) and
returns ``delta_k = w - w_k``; the server averages the deltas with weights
``q_k ∝ N_k`` over the clients that took part and feeds the average to an
optax server optimiser as a gradient. Server SGD with learning rate 1 is
plain FedAvg (the weighted average of client models); "adam", "adagrad" and
"yogi" are FedAdam/FedAdagrad/FedYogi.

A straggler truncated at a deadline (:mod:`fedprob.faults`) sends the delta
after the steps it completed (diagnostic ``steps``: the steps taken).

The result is a point estimate: ``posterior`` holds one draw.

Client-local sites (``infer={"local": True}``; partial personalization). The
flat parameter is ``w = (w_g, w_l)`` (:mod:`fedprob.potential`): the server
holds and averages the global block ``w_g`` only; each client keeps its own
local block ``w_l`` in its client state across rounds, trains the joint from
``(w_g, w_l)`` (the prior share 1/K on the global sites, the local sites'
conditional prior whole; FedProx's proximal term on the global block only)
and sends ``w_g - w_k[:d_g]``. After the last round ``fp.run`` makes one more
client pass (:meth:`FedAvg.refresh_local`): each client sets its local block
to its conditional mode given the final ``w_g`` (``refresh_steps`` full-batch
L-BFGS steps on the local block alone). The posterior is the point ``w_g``
with each client's local values as a :class:`~fedprob.posteriors.LocalPoint`
(``local_mean`` per client, ``local_sd`` 0; ``predict(X, client=k)`` uses
client k's values, ``client=None`` draws a new client's local sites from
their conditional prior given ``w_g``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..inference.optim import make_optimizer
from ..inference.sgmcmc.curvature import max_curvature
from ..potential import make_target
from ..posteriors import GlobalPosterior, LocalPoint, Samples
from ..validation import check_int, check_positive
from .base import Algorithm, Context, stack_init, weighted_mean
from .local_training import client_steps, local_mode, num_local_steps, train_locally
from .server_opt import ServerOptimizer


#: FedAvg's client SGD rate when none is given, before the curvature cap (``learning_rate=None``)
DEFAULT_LEARNING_RATE = 0.1


class PersonalClient(NamedTuple):
    """Client state of FedAvg/FedProx on a model with client-local sites: the client's local block
    ``w_l`` (d_l,), kept across rounds (module docstring)."""

    local: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class FedAvg(Algorithm, ServerOptimizer):
    """Federated averaging.

    local_steps / local_epochs: local work per round (steps win if both given);
    batch_size: minibatch rows (None = full batch); client_optimizer /
    server_optimizer: a name ("sgd", "adam", "adagrad", "yogi") or an optax
    transformation (resolved by :func:`fedprob.inference.optim.make_optimizer`);
    learning_rate / server_learning_rate / server_momentum configure named
    optimisers. ``learning_rate=None`` (the default) with the client optimiser
    "sgd" is :data:`DEFAULT_LEARNING_RATE` capped at ``1 / lambda_max``, the
    largest curvature of the client's mean loss (plus FedProx's ``mu``) at the
    round's start, estimated by power iteration on Hessian-vector products over
    one minibatch (:func:`fedprob.inference.sgmcmc.curvature.max_curvature`,
    about 20 minibatch gradients): plain SGD diverges above ``2 / lambda_max``,
    which badly scaled inputs reach at any fixed rate (least squares with inputs
    shifted by 1.5 sd: lambda_max 40, and 0.1 took the server to 1e25 in 10
    rounds). The rate used is the client diagnostic ``learning_rate``. With
    other optimisers None is the optimiser's own default (L-BFGS: line search;
    adam, adagrad, yogi: 1e-2). A number is used as it is.
    init_strategy: the server's starting point (a
    :meth:`~fedprob.potential.Potential.init` strategy). The default
    ``"center"`` starts at the centre of the prior (a Normal prior's loc;
    neural network weights get their model's initialisation noise): a prior
    draw would leave its noise in every weight the data never move.
    refresh_steps: with client-local sites, the full-batch L-BFGS steps of the
    pass after the last round that sets each client's local block to its
    conditional mode given the final global block (0: keep the last round's).
    """

    local_steps: Optional[int] = None
    local_epochs: Optional[float] = 1.0
    batch_size: Optional[int] = 32
    client_optimizer: Any = "sgd"
    learning_rate: Optional[float] = None
    refresh_steps: int = 100

    default_rounds = 10
    #: the result is a point meant to be the global posterior mode (checked: fedprob.convergence)
    reports_mode = True

    def __post_init__(self):
        check_int("local_steps", self.local_steps) if self.local_steps is not None else None
        check_positive("local_epochs", self.local_epochs, allow_none=True)
        if self.local_steps is None and self.local_epochs is None:
            raise ValueError("give local_steps or local_epochs")
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size)
        check_positive("learning_rate", self.learning_rate, allow_none=True)   # None: the optimizer's own (L-BFGS line search)
        check_int("refresh_steps", self.refresh_steps, 0)
        self.check_server_options()

    # FedProx overrides this
    def _mu(self) -> float:
        return 0.0

    def _client_opt(self, learning_rate=None):
        lr = self.learning_rate if learning_rate is None else learning_rate
        return make_optimizer(self.client_optimizer or "sgd", lr, self.batch_size)

    def adapts_learning_rate(self) -> bool:
        """Whether the client's SGD rate follows its curvature (``learning_rate=None`` with "sgd")."""
        return self.learning_rate is None and (self.client_optimizer or "sgd") == "sgd"

    def _adapted_rate(self, ctx: Context, w0, data, key):
        """``min(DEFAULT_LEARNING_RATE, 1 / (lambda_max / n_k + mu))``: the mean loss's largest curvature."""
        target = make_target(data, ctx.potential.dim, prior_weight=1.0 / ctx.num_clients, dtype=w0.dtype)
        lam, _ = max_curvature(ctx.potential, target, self.batch_size, w0, key)
        lam = lam / jnp.maximum(data.n, 1).astype(w0.dtype) + self._mu()
        ok = jnp.isfinite(lam) & (lam > 0)
        return jnp.where(ok, jnp.minimum(DEFAULT_LEARNING_RATE, 1.0 / jnp.where(ok, lam, 1.0)),
                         DEFAULT_LEARNING_RATE).astype(w0.dtype)

    def local_sites_refusal(self, potential):
        """None: local sites stay on their clients (module docstring)."""
        return None

    def init(self, ctx: Context, key, data):
        pot = ctx.potential
        if not pot.local_sites:
            return self.server_start(pot, key), ()
        w = pot.init(key, self.init_strategy)
        dg = pot.dim_global
        return (w[:dg], self._server_opt().init(w[:dg])), stack_init(ctx.num_clients, PersonalClient(w[dg:]))

    def local_step_count(self, ctx: Context, data):
        """The client's optimiser steps: ``local_steps``, or ``ceil(local_epochs * n_k / batch_size)``."""
        return client_steps(self.local_steps, self.local_epochs, self.batch_size, data.n)

    def client_update(self, ctx: Context, server_state, client_state, data, key, max_steps=None):
        """Local training from ``w_g`` (frozen after ``max_steps`` steps when given); message ``w_g - w_k``."""
        w_g = server_state[0]
        total = num_local_steps(self.local_steps, self.local_epochs, self.batch_size, data.y.shape[0])
        steps = client_steps(self.local_steps, self.local_epochs, self.batch_size, data.n)
        if max_steps is not None:
            steps = jnp.minimum(steps, max_steps)
        personal = isinstance(client_state, PersonalClient)
        w0 = jnp.concatenate([w_g, client_state.local.astype(w_g.dtype)]) if personal else w_g
        diag = {}
        if self.adapts_learning_rate():
            key, k_curv = jax.random.split(key)
            lr = self._adapted_rate(ctx, w0, data, k_curv)
            optimizer = self._client_opt(lr)
            diag["learning_rate"] = lr
        else:
            optimizer = self._client_opt()
        w, loss = train_locally(ctx.potential, w0, data, key, optimizer=optimizer,
                                total_steps=total, steps=steps, batch_size=self.batch_size,
                                prior_weight=1.0 / ctx.num_clients, prox_center=w_g, mu=self._mu())
        dg = w_g.shape[-1]
        new_state = PersonalClient(w[dg:]) if personal else client_state
        return new_state, w_g - w[:dg], {"loss": loss, "steps": steps, **diag}

    def refresh_local(self, ctx: Context, server_state, client_state: PersonalClient, data, key):
        """``(state, finite)``: the client's local block at its conditional mode given the final global
        block (``refresh_steps`` L-BFGS steps; a solve that is not finite keeps the last round's)."""
        if self.refresh_steps == 0:
            return client_state, jnp.asarray(True)
        w_g = server_state[0]
        w_l, ok = local_mode(ctx.potential, w_g, client_state.local.astype(w_g.dtype), data, self.refresh_steps)
        return PersonalClient(jnp.where(ok, w_l, client_state.local)), ok

    def server_update(self, ctx: Context, server_state, messages, weights, mask):
        w, opt_state = server_state
        return self.server_step(w, opt_state, weighted_mean(messages, weights, mask))

    def update_part(self, ctx: Context, message):
        """The whole message: the delta ``w_g - w_k``."""
        return message

    def with_update(self, ctx: Context, message, update):
        return update

    def posterior(self, ctx: Context, server_state, client_states):
        info = {"kind": "point estimate"}
        local = None
        if isinstance(client_states, PersonalClient):
            local = LocalPoint(jnp.asarray(client_states.local))
            info["local_posterior"] = ("each client's own values of its local sites (a point estimate; local_sd is 0), "
                                       "at their conditional mode given the final global block"
                                       if self.refresh_steps else
                                       "each client's own values of its local sites from its last round (a point "
                                       "estimate; local_sd is 0)")
        return GlobalPosterior(ctx.potential, Samples(server_state[0][None]), info=info, local=local)


