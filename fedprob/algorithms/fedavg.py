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

import jax.numpy as jnp

from ..inference.optim import make_optimizer
from ..posteriors import GlobalPosterior, LocalPoint, Samples
from ..validation import check_int, check_positive
from .base import Algorithm, Context, stack_init, weighted_mean
from .local_training import client_steps, local_mode, num_local_steps, train_locally
from .server_opt import ServerOptimizer


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
    optimisers. init_strategy: the server's starting point (a
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
    learning_rate: float = 0.1
    refresh_steps: int = 100

    default_rounds = 10

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

    def _client_opt(self):
        return make_optimizer(self.client_optimizer or "sgd", self.learning_rate, self.batch_size)

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
        w, loss = train_locally(ctx.potential, w0, data, key, optimizer=self._client_opt(),
                                total_steps=total, steps=steps, batch_size=self.batch_size,
                                prior_weight=1.0 / ctx.num_clients, prox_center=w_g, mu=self._mu())
        dg = w_g.shape[-1]
        new_state = PersonalClient(w[dg:]) if personal else client_state
        return new_state, w_g - w[:dg], {"loss": loss, "steps": steps}

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


