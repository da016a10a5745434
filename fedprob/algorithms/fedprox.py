"""FedProx: FedAvg whose clients add a proximal term (mu/2) ||w - w_g||^2.

The proximal term is added to the client's mean loss (so ``mu`` carries
across client sizes); mu = 0 is FedAvg.
"""
from __future__ import annotations

import dataclasses

from .fedavg import FedAvg


@dataclasses.dataclass(frozen=True)
class FedProx(FedAvg):
    """FedAvg with a proximal client term; ``mu`` is its strength (mean-loss scale)."""

    mu: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        if not self.mu >= 0:
            raise ValueError("FedProx needs mu >= 0")

    def _mu(self) -> float:
        return self.mu
