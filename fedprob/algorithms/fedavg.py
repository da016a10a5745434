"""FedAvg with server optimisers (generalised federated optimisation).

Round (FedPA paper Alg. 1; Reddi et al. 2021): each participating client runs
local optimisation from the server parameters ``w`` (see
:mod:`fedprob.algorithms.local_training`: mean loss, prior share 1/K) and
returns ``delta_k = w - w_k``; the server averages the deltas with weights
``q_k ∝ N_k`` over the clients that took part and feeds the average to an
optax server optimiser as a gradient. Server SGD with learning rate 1 is
plain FedAvg (the weighted average of client models); "adam", "adagrad" and
"yogi" are FedAdam/FedAdagrad/FedYogi.

The result is a point estimate: ``posterior`` holds one draw.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import optax

from ..posteriors import GlobalPosterior, Samples
from .base import Algorithm, Context, weighted_mean
from .local_training import client_steps, num_local_steps, resolve_optimizer, train_locally


@dataclasses.dataclass(frozen=True)
class FedAvg(Algorithm):
    """Federated averaging.

    local_steps / local_epochs: local work per round (steps win if both given);
    batch_size: minibatch rows (None = full batch); client_optimizer /
    server_optimizer: a name ("sgd", "adam", "adagrad", "yogi") or an optax
    transformation; learning_rate / server_learning_rate / server_momentum
    configure named optimisers. init: "prior" (a prior draw) or "zeros".
    """

    local_steps: Optional[int] = None
    local_epochs: Optional[float] = 1.0
    batch_size: Optional[int] = 32
    client_optimizer: Any = "sgd"
    learning_rate: float = 0.1
    server_optimizer: Any = "sgd"
    server_learning_rate: float = 1.0
    server_momentum: Optional[float] = None
    init_strategy: str = "prior"

    default_rounds = 10

    # FedProx overrides this
    def _mu(self) -> float:
        return 0.0

    def _client_opt(self):
        return resolve_optimizer(self.client_optimizer, self.learning_rate)

    def _server_opt(self):
        return resolve_optimizer(self.server_optimizer, self.server_learning_rate, self.server_momentum,
                                 eps=1e-3)

    def init(self, ctx: Context, key, data):
        w = ctx.potential.init(key, self.init_strategy)
        return (w, self._server_opt().init(w)), ()

    def client_update(self, ctx: Context, server_state, client_state, data, key):
        w_g = server_state[0]
        total = num_local_steps(self.local_steps, self.local_epochs, self.batch_size, data.X.shape[0])
        steps = client_steps(self.local_steps, self.local_epochs, self.batch_size, data.n)
        w, loss = train_locally(ctx.potential, w_g, data, key, optimizer=self._client_opt(),
                                total_steps=total, steps=steps, batch_size=self.batch_size,
                                prior_weight=1.0 / ctx.num_clients, prox_center=w_g, mu=self._mu())
        return client_state, w_g - w, {"loss": loss, "steps": steps}

    def server_update(self, ctx: Context, server_state, messages, weights, mask):
        w, opt_state = server_state
        delta = weighted_mean(messages, weights, mask)
        upd, opt_state = self._server_opt().update(delta, opt_state, w)
        return optax.apply_updates(w, upd), opt_state

    def posterior(self, ctx: Context, server_state, client_states):
        return GlobalPosterior(ctx.potential, Samples(server_state[0][None]),
                               info={"kind": "point estimate"})


