"""The server optimiser of the FedAvg-style methods (FedAvg, FedProx, FedPA).

The server treats the weighted mean of the client deltas ``delta = sum_k q_k
(w - w_k)`` (``q_k ∝ N_k`` over the clients that took part) as a gradient and
takes one optax step from ``w`` (Reddi et al. 2021): server SGD with learning
rate 1 is plain averaging of the client models; "adam", "adagrad" and "yogi"
are FedAdam, FedAdagrad and FedYogi. The server starts at
``potential.init(key, init_strategy)``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import optax

from ..inference.optim import make_optimizer
from ..potential import INIT_STRATEGIES
from ..validation import check_choice, check_fraction, check_positive


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptimizer:
    """Options of the server step, mixed into an algorithm's dataclass (keyword-only fields).

    server_optimizer: a name ("sgd", "adam", "adagrad", "yogi") or an optax
    transformation (:func:`fedprob.inference.optim.make_optimizer`);
    server_learning_rate / server_momentum configure a named optimiser;
    init_strategy: the server's starting point (a
    :meth:`~fedprob.potential.Potential.init` strategy; the default
    ``"center"`` is the centre of the prior).
    """

    server_optimizer: Any = "sgd"
    server_learning_rate: float = 1.0
    server_momentum: Optional[float] = None
    init_strategy: str = "center"

    def check_server_options(self) -> None:
        """Fail early on a bad server learning rate, momentum or starting point."""
        check_positive("server_learning_rate", self.server_learning_rate)
        if self.server_momentum is not None:
            check_fraction("server_momentum", self.server_momentum, high_open=True)
        check_choice("init_strategy", self.init_strategy, INIT_STRATEGIES)

    def _server_opt(self):
        return make_optimizer(self.server_optimizer or "sgd", self.server_learning_rate,
                              momentum=self.server_momentum, eps=1e-3)

    def server_start(self, potential, key):
        """``(w, optimiser state)``: the server's first parameters and its optimiser's state."""
        w = potential.init(key, self.init_strategy)
        return w, self._server_opt().init(w)

    def server_step(self, w, opt_state, delta):
        """One optax step from ``w`` along the mean client delta: ``(new w, new optimiser state)``."""
        upd, opt_state = self._server_opt().update(delta, opt_state, w)
        return optax.apply_updates(w, upd), opt_state


__all__ = ["ServerOptimizer"]
