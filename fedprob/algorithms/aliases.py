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

When ``family`` is not given it follows the client backend
(:func:`resolve_family`): a backend's full covariance is never silently
reduced to its diagonal, and a ``"diag"`` family given over a backend that
returns a full precision is refused.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
    """The ``stacklevel`` of :func:`warnings.warn`, called from the caller of this function, that
    points at the first frame outside ``fedprob/algorithms`` and the dataclasses' generated code."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_HERE)
                                 or frame.f_code.co_filename.startswith("<")):
        frame, level = frame.f_back, level + 1
    return level


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
                  "one release", FutureWarning, stacklevel=_user_stacklevel())
    object.__setattr__(obj, canonical, value)
    object.__setattr__(obj, alias, UNSET)


def _gaussian_family(client):
    """``"full"`` or ``"diag"`` for a Gaussian backend whose precision has that form, None otherwise
    (no client, a sampler, or a backend this module does not know)."""
    if client is None:
        return None
    kind = type(client).__name__
    if kind == "Laplace":
        return "full" if client.hessian in ("full", "ggn") else "diag"
    if kind == "SVI":
        return "full" if client.guide in ("full", "lowrank") else "diag"
    if kind == "VON":
        return "full"
    if kind == "IVON":
        return "diag"
    return None


def backend_family(client, default: str = "diag") -> str:
    """The Gaussian family a client backend returns: ``"full"`` or ``"diag"`` (``default`` when unknown).

    Laplace with ``hessian="full"``/``"ggn"``, SVI with a ``"full"``/``"lowrank"``
    guide and VON return a full precision; Laplace's diagonal Hessians, SVI's
    ``"normal"``/``"diag"`` guides and IVON a diagonal one.
    """
    family = _gaussian_family(client)
    return default if family is None else family


def resolve_family(obj, default: str, choices=("full", "diag")) -> None:
    """Settle ``obj.family``: take the ``covariance`` alias, follow the client backend, check it.

    ``family=None`` becomes the backend's own family (:func:`backend_family`,
    ``default`` for samplers and without a client). A ``"diag"`` family over a
    backend that returns a full precision (``Laplace(hessian="full")``,
    ``SVI(guide="full")``, ``VON()``) is refused: it would keep only the
    diagonal of every client's curvature, the off-diagonal information the
    backend paid for lost (PVI on a conjugate problem: 0.67 posterior sd off,
    where the full family is exact).
    """
    if "covariance" in {f.name for f in dataclasses.fields(obj)}:
        take_alias(obj, "family", "covariance", None)
    if obj.family is None:
        object.__setattr__(obj, "family", backend_family(obj.client, default))
    name = type(obj).__name__
    if obj.family not in choices:
        raise ValueError(f"{name}: family must be one of {tuple(choices)}, got {obj.family!r}")
    if obj.family == "diag" and _gaussian_family(obj.client) == "full":
        raise ValueError(
            f"{name}: family='diag' over {type(obj.client).__name__}, which returns a full precision, would "
            "keep only its diagonal and drop the off-diagonal curvature: leave family unset (it follows the "
            "backend: 'full') or give a diagonal backend (Laplace(hessian='diag_ggn'), SVI(guide='diag'), "
            "IVON())")


__all__ = ["UNSET", "alias_field", "take_alias", "backend_family", "resolve_family"]
