"""Shared fixtures: the data folder beside the checkout, and conjugate oracles."""
import os
from pathlib import Path

import numpy as np
import pytest


def find_data_root():
    """../shared/data beside the checkout, or $FEDPROB_DATA; None when absent."""
    env = os.environ.get("FEDPROB_DATA")
    if env and Path(env).is_dir():
        return Path(env)
    here = Path(__file__).resolve().parents[1]
    cand = here.parent / "shared" / "data"
    return cand if cand.is_dir() else None


@pytest.fixture(scope="session")
def data_root():
    root = find_data_root()
    if root is None:
        pytest.skip("shared data folder not found (set FEDPROB_DATA or place ../shared/data beside the checkout)")
    return root


def linreg_exact_posterior(Xs, ys, sigma, prior_scale):
    """Exact N(mean, cov) of w for y = X w + N(0, sigma^2), w ~ N(0, prior_scale^2 I), pooled over clients."""
    d = Xs[0].shape[1]
    P = np.eye(d) / prior_scale ** 2
    b = np.zeros(d)
    for X, y in zip(Xs, ys):
        X = np.asarray(X, np.float64)
        P = P + X.T @ X / sigma ** 2
        b = b + X.T @ np.asarray(y, np.float64) / sigma ** 2
    cov = np.linalg.inv(P)
    return cov @ b, cov
