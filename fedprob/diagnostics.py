"""ArviZ shim: one place that talks to ArviZ (0.23 on Python 3.11, 1.x on >= 3.12).

Only bulk ESS and R-hat are compared across versions.
"""
from __future__ import annotations

import numpy as np


def _az():
    import arviz as az

    return az


def to_inference_data(draws: dict):
    """dict site -> (chains, draws, ...) array -> ArviZ posterior object."""
    az = _az()
    posterior = {k: np.asarray(v) for k, v in draws.items()}
    if hasattr(az, "from_dict"):
        try:
            return az.from_dict(posterior=posterior)
        except TypeError:  # arviz 1.x takes groups as a mapping
            return az.from_dict({"posterior": posterior})
    return az.from_dict({"posterior": posterior})  # pragma: no cover


def _values(idata, name):
    post = idata.posterior if hasattr(idata, "posterior") else idata["posterior"]
    return np.asarray(post[name])


def ess(draws: np.ndarray) -> np.ndarray:
    """Bulk effective sample size of (chains, draws, ...) samples, elementwise."""
    az = _az()
    x = np.asarray(draws, np.float64)
    out = az.ess(x, method="bulk") if hasattr(az, "ess") else None
    return np.asarray(getattr(out, "values", out))


def rhat(draws: np.ndarray) -> np.ndarray:
    """Rank-normalised split R-hat of (chains, draws, ...) samples, elementwise."""
    az = _az()
    x = np.asarray(draws, np.float64)
    out = az.rhat(x)
    return np.asarray(getattr(out, "values", out))
