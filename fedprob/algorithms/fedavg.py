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
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp

from ..inference.optim import make_optimizer
from ..posteriors import GlobalPosterior, Samples
from ..validation import check_int, check_positive
from .base import Algorithm, Context, weighted_mean
from .local_training import client_steps, num_local_steps, train_locally
from .server_opt import ServerOptimizer


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
    """

    local_steps: Optional[int] = None
    local_epochs: Optional[float] = 1.0
    batch_size: Optional[int] = 32
    client_optimizer: Any = "sgd"
    learning_rate: float = 0.1

    default_rounds = 10

    def __post_init__(self):
        check_int("local_steps", self.local_steps) if self.local_steps is not None else None
        check_positive("local_epochs", self.local_epochs, allow_none=True)
        if self.local_steps is None and self.local_epochs is None:
            raise ValueError("give local_steps or local_epochs")
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size)
        check_positive("learning_rate", self.learning_rate, allow_none=True)   # None: the optimizer's own (L-BFGS line search)
        self.check_server_options()

    # FedProx overrides this
    def _mu(self) -> float:
        return 0.0

    def _client_opt(self):
        return make_optimizer(self.client_optimizer or "sgd", self.learning_rate, self.batch_size)

    def init(self, ctx: Context, key, data):
        return self.server_start(ctx.potential, key), ()

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
        w, loss = train_locally(ctx.potential, w_g, data, key, optimizer=self._client_opt(),
                                total_steps=total, steps=steps, batch_size=self.batch_size,
                                prior_weight=1.0 / ctx.num_clients, prox_center=w_g, mu=self._mu())
        return client_state, w_g - w, {"loss": loss, "steps": steps}

    def server_update(self, ctx: Context, server_state, messages, weights, mask):
        w, opt_state = server_state
        return self.server_step(w, opt_state, weighted_mean(messages, weights, mask))

    def update_part(self, ctx: Context, message):
        """The whole message: the delta ``w_g - w_k``."""
        return message

    def with_update(self, ctx: Context, message, update):
        return update

    def posterior(self, ctx: Context, server_state, client_states):
        return GlobalPosterior(ctx.potential, Samples(server_state[0][None]),
                               info={"kind": "point estimate"})


