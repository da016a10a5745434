"""FedDyn (Acar et al. 2021): federated learning with dynamic regularisation, a federated ADMM baseline.

On the client's **mean** loss ``L_k(w) = l_k(w)/N_k - log p0(w)/N`` (the
model prior split by data share, so that with equal client sizes the fixed
point is the global MAP)::

    client  w_k = argmin L_k(w) - <g_k, w> + (a/2) ||w - w_g||^2 + (wd/2) ||w||^2
            g_k <- g_k - a (w_k - w_g)
    server  h   <- h - a (1/K) sum_{k in round} (w_k - w_g)      (absent clients count 0)
            w_g <- mean_{k in round} w_k - h / a

``g_k`` starts at 0 (it tracks ``grad L_k`` at the client's last solution),
``h`` at 0 and ``w_g`` at the prior centre. The client problem is solved by
:func:`fedprob.inference.optim.minimize` (full-batch L-BFGS by default); a
straggler truncated at a deadline (:mod:`fedprob.faults`) uses the point its
solve reached, for ``w_k`` and its ``g_k`` alike.
The result is a point estimate at ``w_g``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from ..inference.optim import minimize
from ..posteriors import GlobalPosterior, Samples
from ..potential import make_target
from .base import Algorithm, Context, masked_sum, stack_init

Array = jax.Array


class FedDynServer(NamedTuple):
    w: Array     # (d,) server model w_g
    h: Array     # (d,) server state h


@dataclasses.dataclass(frozen=True)
class FedDyn(Algorithm):
    """FedDyn (module docstring).

    alpha: the dynamic-regulariser strength ``a`` (mean-loss scale);
    weight_decay: extra local weight decay ``wd`` (the model prior already
    enters ``L_k``); num_steps / optimizer / learning_rate / batch_size: the
    local solve (:func:`~fedprob.inference.optim.minimize`).
    """

    alpha: float = 0.1
    weight_decay: float = 0.0
    num_steps: int = 200
    optimizer: Any = None
    learning_rate: Optional[float] = None
    batch_size: Optional[int] = None
    init_strategy: str = "center"

    default_rounds = 10
    #: the result is a point meant to be the global posterior mode (checked: fedprob.convergence)
    reports_mode = True

    def __post_init__(self):
        if not float(self.alpha) > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if not float(self.weight_decay) >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if int(self.num_steps) < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")

    def init(self, ctx: Context, key, data):
        w = ctx.potential.init(key, self.init_strategy)
        return FedDynServer(w, jnp.zeros_like(w)), stack_init(ctx.num_clients, jnp.zeros_like(w))

    def local_step_count(self, ctx: Context, data):
        """The steps of the local solve (``num_steps``)."""
        return int(self.num_steps)

    def client_update(self, ctx: Context, server_state: FedDynServer, client_state, data, key, max_steps=None):
        w_g, g = server_state.w, client_state
        a, wd = float(self.alpha), float(self.weight_decay)
        n = jnp.maximum(data.n, 1).astype(w_g.dtype)
        # -log_density / n = l_k/n - log p0/N - g'w - a w_g'w + (a + wd)/2 ||w||^2
        target = make_target(data, ctx.dim, prior_weight=n / ctx.num_rows, linear=n * (g + a * w_g),
                             precision=jnp.full((ctx.dim,), 1.0, w_g.dtype) * n * (a + wd), dtype=w_g.dtype)
        res = minimize(ctx.potential, target, w_g, key=key, num_steps=int(self.num_steps),
                       optimizer=self.optimizer, learning_rate=self.learning_rate, batch_size=self.batch_size,
                       max_steps=max_steps)
        w_k = jnp.where(jnp.isfinite(res.loss), res.params, jnp.nan)   # failed solve: left out
        return g - a * (w_k - w_g), w_k, {"grad_norm": res.grad_norm}

    def server_update(self, ctx: Context, server_state: FedDynServer, messages, weights, mask):
        a = float(self.alpha)
        w_g, h = server_state
        count = jnp.maximum(jnp.sum(mask), 1).astype(w_g.dtype)
        total = masked_sum(messages, mask)
        h = h - a * (total - jnp.sum(mask) * w_g) / ctx.num_clients
        return FedDynServer(total / count - h / a, h)

    def posterior(self, ctx: Context, server_state: FedDynServer, client_states):
        return GlobalPosterior(ctx.potential, Samples(server_state.w[None]), info={"kind": "point estimate"})


__all__ = ["FedDyn", "FedDynServer"]
