"""FedLap and FedLap-Cov (Swaroop et al., "Connecting federated ADMM to Bayes"): Laplace forms of PVI.

Both are the natural loop (:mod:`fedprob.algorithms.natural`) with ``rho =
alpha = 1`` (PVI) and the delta approximation at the client:

* **FedLap** (Eq. 9): isotropic family ``q = N(m, I/delta)`` with the prior
  ``N(0, I/delta)``; only the linear site ``delta v_k`` moves, so the
  covariance stays the prior's and the result is the point ``m = w_g``
  (``prediction="average"`` keeps the Gaussian, with a warning). Client
  ``w_k = argmin l_k(w) + delta v_k' w + (delta/2) ||w - w_g||^2``, dual
  ``v_k += rho_k (w_k - w_g)``, server ``w_g = sum_k v_k``. Default
  damping ``rho_k = N_k / N``. With ``delta=None`` the model's prior
  precision plays the role of ``delta`` (per coordinate).
* **FedLap-Cov** (Eqs. 12, 14, 21): diagonal family, sites
  ``exp(v_k' w - w' V_k w / 2)``. Client ``w_k = argmin l_k(w) + v_k' w -
  w' V_k w / 2 + ||w - w_g||^2_{S_g} / 2``, ``S_k = H_k(w_k) - V_k + S_g``
  (H_k the diagonal GGN, or the exact Hessian diagonal, of ``l_k`` at
  ``w_k``); duals ``v_k += rho (S_k w_k - S_g w_g)``, ``V_k += rho (S_k -
  S_g) = (1 - rho) V_k + rho H_k``; server ``S_g = delta I + sum_k V_k``,
  ``w_g = S_g^-1 sum_k v_k``. Default damping ``rho = 1/K``. This is damped PVI
  with diagonal Laplace client solves, step for step.

``l_k`` is the summed negative log likelihood of the client's rows; the
client mode is found by full-batch L-BFGS by default (``optimizer``,
``learning_rate``, ``batch_size``, ``num_steps`` configure it, as for
:class:`~fedprob.inference.Laplace`).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional, Union

from ..inference.laplace import Laplace
from .aliases import alias_field, take_alias
from .natural import Configured, NaturalLoop

_HESSIANS = {"ggn": "diag_ggn", "diag": "diag"}


def _check_damping(damping):
    if isinstance(damping, str):
        if damping not in ("size", "clients"):
            raise ValueError(f"damping must be a number in (0, 1], 'size' (N_k/N) or 'clients' (1/K), "
                             f"got {damping!r}")
    elif not 0.0 < float(damping) <= 1.0:
        raise ValueError(f"damping must lie in (0, 1], got {damping!r}")


@dataclasses.dataclass(frozen=True)
class FedLap(Configured):
    """FedLap (module docstring): isotropic PVI with the delta approximation.

    delta: prior (and family) precision, None = the model prior's; damping:
    the site step ("size": N_k/N, "clients": 1/K, or a number; alias ``rho``,
    the paper's name); prediction: "mean" (the default: the result is the
    point ``w_g``, since the family's covariance is the prior's and no
    posterior spread) or "average" (the isotropic Gaussian ``N(w_g, prior
    covariance)`` itself, predictions averaged over it, with a warning that
    its sds are the prior's).
    """

    delta: Optional[float] = None
    damping: Union[float, str] = "size"
    num_steps: int = 200
    optimizer: Any = None
    learning_rate: Optional[float] = None
    batch_size: Optional[int] = None
    prediction: str = "mean"
    rho: Any = alias_field()

    def __post_init__(self):
        take_alias(self, "damping", "rho", "size")
        _check_damping(self.damping)
        self.loop()

    def loop(self) -> NaturalLoop:
        client = Laplace(num_steps=self.num_steps, optimizer=self.optimizer, learning_rate=self.learning_rate,
                         batch_size=self.batch_size)
        return NaturalLoop(client=client, family="isotropic", rho=1.0, damping=self.damping, alpha=1.0,
                           delta=self.delta, prediction=self.prediction)

    #: the result is a point meant to be the global posterior mode (checked: fedprob.convergence)
    reports_mode = True

    def reports_point(self) -> bool:
        """The point ``w_g`` unless ``prediction="average"`` asks for the isotropic Gaussian."""
        return self.prediction == "mean"

    def posterior(self, ctx, server_state, client_states):
        post = super().posterior(ctx, server_state, client_states)
        if not self.reports_point():
            post.info["covariance"] = "the prior's (isotropic family): not a posterior spread"
            warnings.warn("FedLap(prediction='average'): the isotropic family's covariance is the prior's, so "
                          "the posterior's sds and the predictions averaged over it carry the prior's spread, "
                          "not the posterior's; FedLap() (prediction='mean') reports the point w_g",
                          RuntimeWarning, stacklevel=2)
        return post


@dataclasses.dataclass(frozen=True)
class FedLapCov(Configured):
    """FedLap-Cov (module docstring): diagonal PVI with Laplace client solves.

    delta: prior precision, None = the model prior's; damping: the site step
    (default "clients" = 1/K; alias ``rho``, the paper's name); hessian: "ggn" (diagonal generalized Gauss-Newton, PSD)
    or "diag" (exact Hessian diagonal, clipped at a small positive floor);
    prediction: "auto" (the default: "mean" or "average", whichever predicts the clients' rows
    better under their cavities, :mod:`~fedprob.algorithms.prediction_choice`), "average" over
    draws of q_g, or "mean". fisher_samples (``hessian="ggn"``): labels drawn per row for a Monte
    Carlo Fisher (:func:`fedprob.inference.laplace.ggn_likelihood`); None (the default) is exact
    for small Jacobians and one label per row for networks with many outputs (a row then costs one
    reverse pass, not one per class), 0 always exact.
    """

    delta: Optional[float] = None
    damping: Union[float, str] = "clients"
    hessian: str = "ggn"
    num_steps: int = 200
    optimizer: Any = None
    learning_rate: Optional[float] = None
    batch_size: Optional[int] = None
    prediction: str = "auto"
    num_predictive_draws: int = 32
    fisher_samples: Optional[int] = None
    rho: Any = alias_field()

    def __post_init__(self):
        take_alias(self, "damping", "rho", "clients")
        _check_damping(self.damping)
        if self.hessian not in _HESSIANS:
            raise ValueError(f"hessian must be 'ggn' or 'diag', got {self.hessian!r}")
        self.loop()

    def loop(self) -> NaturalLoop:
        client = Laplace(hessian=_HESSIANS[self.hessian], num_steps=self.num_steps, optimizer=self.optimizer,
                         learning_rate=self.learning_rate, batch_size=self.batch_size,
                         fisher_samples=self.fisher_samples if self.hessian == "ggn" else None)
        return NaturalLoop(client=client, family="diag", rho=1.0, damping=self.damping, alpha=1.0, delta=self.delta,
                           prediction=self.prediction, num_predictive_draws=self.num_predictive_draws)


__all__ = ["FedLap", "FedLapCov"]
