"""One-round FedAvg: the N_k-weighted average of the clients' point estimates.

Every client runs its backend once on its own posterior ``p0(w) p(D_k|w)``
(full prior) and sends one point: its posterior mean (``use="mean"``, the
default: the mean of its draws, or its Gaussian's mean) or the backend's
final point (``use="params"``: the MAP or mean of an optimiser, Laplace or
VI backend; the last iterate of a sampler). The server averages them with
weights ``q_k ∝ N_k`` over the clients received (masked clients are left
out), in the flat unconstrained layout. The result is a point estimate: the
posterior holds one draw.

A baseline: on heterogeneous clients the average of local optima is not the
global optimum (compare FedAvg with many local steps).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ..posteriors import GlobalPosterior, Samples
from ..inference import Laplace
from .base import Context
from .one_round import OneRoundAlgorithm, check_choice, client_weights


@dataclasses.dataclass(frozen=True)
class OneShotAverage(OneRoundAlgorithm):
    """N_k-weighted average of client points (see the module docstring).

    client: the backend (default Laplace(hessian="diag_ggn")); use:
    ``"mean"`` (client posterior mean) or ``"params"`` (``ClientResult.params``).
    """

    use: str = "mean"

    def default_client(self):
        """Laplace(hessian="diag_ggn"): its MAP (full-batch L-BFGS) and mean is what is averaged."""
        return Laplace(hessian="diag_ggn")

    def __post_init__(self):
        super().__post_init__()
        check_choice("use", self.use, ("mean", "params"))

    def make_message(self, ctx, result, key):
        if self.use == "params":
            return {"point": result.params}
        return {"point": result.posterior.mean()}

    def posterior(self, ctx: Context, server_state, client_states) -> GlobalPosterior:
        msgs, sizes, ids = self.received(server_state)
        q = client_weights(sizes, "size")
        avg = jnp.tensordot(q, msgs["point"], 1)
        info = {"kind": "point estimate (one-round average)", "use": self.use,
                "num_clients_combined": int(ids.size), "client_ids": ids.tolist(),
                "weights": np.asarray(q).tolist()}
        return GlobalPosterior(ctx.potential, Samples(avg[None]), info=info)


__all__ = ["OneShotAverage"]
