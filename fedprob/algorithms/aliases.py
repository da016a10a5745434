"""One name per concept across algorithms, with the papers' names kept as aliases.

Canonical names (README, "Names across algorithms"):

* ``family``: the Gaussian family a method fits or multiplies (``"diag"``,
  ``"full"``; the natural loop also ``"isotropic"``). Alias: ``covariance``
  (BayesADMM, EPMCMC, ConsensusMC).
* ``damping``: the site step ``gamma_k`` of the dual update
  ``lambda_hat_k += gamma_k (lambda_k - lambda_g)``. Aliases: ``rho``
  (FedLap, FedLap-Cov, FedLap-Func: the FedLap paper's name), ``gamma``
  (BayesADMM, the natural loop: the BayesADMM paper's name). BayesADMM's own
  ``rho`` (the weight of ``KL(q || q_g)``) and ADMM's ``rho`` (the penalty)
  are other concepts and keep their names.

An alias field defaults to :data:`UNSET`; :func:`take_alias` moves a given
alias onto its canonical field (with a FutureWarning naming the canonical
form) and resets the alias, so ``FedLap(rho=0.5) == FedLap(damping=0.5)``.

When ``family`` is not given to a natural-loop method it follows the client
backend (:func:`backend_family`), so a backend's full covariance is never
silently reduced to its diagonal.
"""
from __future__ import annotations

import dataclasses
import warnings


class _Unset:
    """The default of an alias field: the alias was not passed."""

    def __repr__(self) -> str:
        return "UNSET"

    def __eq__(self, other) -> bool:
        return isinstance(other, _Unset)

    def __hash__(self) -> int:
        return hash("fedprob.UNSET")


UNSET = _Unset()


def alias_field():
    """A dataclass field for an alias: default :data:`UNSET`, left out of the repr."""
    return dataclasses.field(default=UNSET, repr=False)


def take_alias(obj, canonical: str, alias: str, default) -> None:
    """Move ``obj.<alias>`` (when given) onto ``obj.<canonical>`` with a FutureWarning.

    Both given (the canonical one away from its ``default``) is a ValueError.
    """
    value = getattr(obj, alias)
    if isinstance(value, _Unset):
        return
    name = type(obj).__name__
    if getattr(obj, canonical) != default:
        raise ValueError(f"{name}: pass {canonical}=... only ({alias}= is its older name, not a second setting)")
    warnings.warn(f"{name}({alias}=...) is now {name}({canonical}=...); the name {alias!r} keeps working for "
                  "one release", FutureWarning, stacklevel=4)
    object.__setattr__(obj, canonical, value)
    object.__setattr__(obj, alias, UNSET)


def backend_family(client, default: str = "diag") -> str:
    """The Gaussian family a client backend returns: ``"full"`` or ``"diag"`` (``default`` when unknown).

    Laplace with ``hessian="full"``/``"ggn"``, SVI with a ``"full"``/``"lowrank"``
    guide and VON return a full precision; Laplace's diagonal Hessians, SVI's
    ``"normal"``/``"diag"`` guides and IVON a diagonal one.
    """
    if client is None:
        return default
    kind = type(client).__name__
    if kind == "Laplace":
        return "full" if client.hessian in ("full", "ggn") else "diag"
    if kind == "SVI":
        return "full" if client.guide in ("full", "lowrank") else "diag"
    if kind == "VON":
        return "full"
    if kind == "IVON":
        return "diag"
    return default


def follow_backend(obj, default: str = "diag") -> None:
    """``obj.family = backend_family(obj.client)`` when ``obj.family`` is None (not given)."""
    if obj.family is None:
        object.__setattr__(obj, "family", backend_family(obj.client, default))


__all__ = ["UNSET", "alias_field", "take_alias", "backend_family", "follow_backend"]
