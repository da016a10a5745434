"""ArviZ shim: one place that talks to ArviZ (0.23 on Python 3.11, 1.x on >= 3.12).

Only bulk ESS and R-hat are compared across versions.
"""
from __future__ import annotations

import warnings

import numpy as np


def _az():
    """The arviz module, imported on first use without its import-time FutureWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
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


def _elementwise(fn, draws) -> np.ndarray:
    """Apply a (chains, draws) -> scalar ArviZ statistic to every trailing element."""
    x = np.asarray(draws, np.float64)
    if x.ndim < 2:
        raise ValueError(f"draws must have shape (chains, draws, ...), got {x.shape}")
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    vals = []
    for j in range(flat.shape[-1]):
        r = fn(flat[:, :, j])
        vals.append(float(np.asarray(getattr(r, "values", r))))
    return np.array(vals).reshape(x.shape[2:])


def ess(draws) -> np.ndarray:
    """Bulk effective sample size of (chains, draws, ...) samples, elementwise."""
    az = _az()
    return _elementwise(lambda a: az.ess(a, method="bulk"), draws)


def rhat(draws) -> np.ndarray:
    """Rank-normalised split R-hat of (chains, draws, ...) samples, elementwise."""
    return _elementwise(_az().rhat, draws)
