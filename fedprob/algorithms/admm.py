"""Federated ADMM (BayesADMM paper, Fig. 2a): the natural loop's isotropic family with alpha = 1/(1 + rho K).

Client ``w_k = argmin l_k(w) + <v_k, w> + (rho/2) ||w - w_g||^2_{S_0}``,
dual ``v_k += rho S_0 (w_k - w_g)``, server ``w_g = (1 - alpha) mean_k w_k +
alpha S_0^-1 sum_k v_k`` with ``alpha = 1/(1 + rho K)``, for the regulariser
``l_0 = w' S_0 w / 2``: the prior's precision (``S_0 = delta I`` with
``delta``, else the model prior's). With ``S_0 = I`` this is Fig. 2a
exactly. ``l_k`` is the summed negative log likelihood; default
``rho = 1/K``. The result is a point estimate at ``w_g``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from ..inference.laplace import Laplace
from .natural import Configured, NaturalLoop


@dataclasses.dataclass(frozen=True)
class ADMM(Configured):
    """Federated ADMM (module docstring). rho: penalty (None = 1/K), in units of the prior precision."""

    rho: Optional[float] = None
    delta: Optional[float] = None
    num_steps: int = 200
    optimizer: Any = None
    learning_rate: Optional[float] = None
    batch_size: Optional[int] = None

    def __post_init__(self):
        self.loop()

    def loop(self) -> NaturalLoop:
        client = Laplace(num_steps=self.num_steps, optimizer=self.optimizer, learning_rate=self.learning_rate,
                         batch_size=self.batch_size)
        rho: Union[float, str] = "clients" if self.rho is None else self.rho
        return NaturalLoop(client=client, family="isotropic", rho=rho, damping="rho", alpha="admm",
                           delta=self.delta, prediction="mean")

    #: the result is a point meant to be the global posterior mode (checked: fedprob.convergence)
    reports_mode = True

    def reports_point(self) -> bool:
        """Always: the result is the point ``w_g`` (the isotropic family's covariance is the prior's)."""
        return True


__all__ = ["ADMM"]
