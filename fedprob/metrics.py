"""Predictive metrics of a posterior on held-out data.

Classification: accuracy, NLL (mean negative log predictive probability),
Brier score (sum over classes of squared errors, mean over points) and
expected calibration error over ``ece_bins`` (15) equal-width confidence bins
of [0, 1]; ``reliability`` holds the per-bin count, mean confidence and
accuracy (the reliability curve; empty bins have count 0 and NaN values).
Regression and counts: RMSE, MSE, NLL and, for regression, the coverage of
the central intervals ``mean +- z sd`` of the predictive at 50% and 95%
(``coverage_50``, ``coverage_95``) and ``reliability``: nominal against
empirical coverage at 10%, 20%, ..., 90%, 95%. The NLL is that of the
posterior's own predictive (:meth:`GlobalPosterior.log_predictive_density`:
the mixture over draws for sample-based posteriors), not of a Gaussian fitted
to its mean and variance, unless only a (mean, variance) prediction is given.
"""
from __future__ import annotations

import numpy as np


def reliability_bins(conf, correct, num_bins: int = 15) -> dict:
    """Equal-width confidence bins of [0, 1]: edges, count, mean confidence, accuracy (NaN if empty)."""
    conf = np.asarray(conf, np.float64)
    correct = np.asarray(correct, np.float64)
    bins = np.minimum((conf * num_bins).astype(int), num_bins - 1)
    count = np.bincount(bins, minlength=num_bins).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        mconf = np.bincount(bins, conf, num_bins) / count
        acc = np.bincount(bins, correct, num_bins) / count
    return {"edges": np.linspace(0, 1, num_bins + 1).tolist(), "count": count.astype(int).tolist(),
            "confidence": mconf.tolist(), "accuracy": acc.tolist()}


def classification_metrics(probs, y, num_bins: int = 15) -> dict:
    probs = np.asarray(probs, np.float64)
    y = np.asarray(y).astype(int)
    p_true = np.clip(probs[np.arange(len(y)), y], 1e-12, None)
    conf = probs.max(1)
    pred = probs.argmax(1)
    correct = (pred == y).astype(float)
    onehot = np.eye(probs.shape[1])[y]
    rel = reliability_bins(conf, correct, num_bins)
    cnt = np.asarray(rel["count"], float)
    gap = np.abs(np.nan_to_num(np.asarray(rel["accuracy"]) - np.asarray(rel["confidence"])))
    ece = float(np.sum(cnt / len(y) * gap))
    return {"accuracy": float(correct.mean()), "nll": float(-np.log(p_true).mean()),
            "brier": float(((probs - onehot) ** 2).sum(1).mean()), "ece": ece, "ece_bins": num_bins,
            "reliability": rel}


def regression_metrics(mean, var, y, log_density=None, coverage: bool = True) -> dict:
    """RMSE, MSE, NLL (of ``log_density`` when given, else of N(mean, var)) and 95% coverage."""
    mean = np.asarray(mean, np.float64)
    var = np.maximum(np.asarray(var, np.float64), 1e-12)
    y = np.asarray(y, np.float64)
    err = y - mean
    if log_density is None:
        nll = float(np.mean(0.5 * (np.log(2 * np.pi * var) + err ** 2 / var)))
    else:
        nll = float(-np.mean(np.asarray(log_density, np.float64)))
    out = {"rmse": float(np.sqrt(np.mean(err ** 2))), "mse": float(np.mean(err ** 2)), "nll": nll}
    if coverage:
        sd = np.sqrt(var)
        levels = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
        cov = [float(np.mean(np.abs(err) <= _z(p) * sd)) for p in levels]
        out["coverage_95"] = cov[-1]
        out["coverage_50"] = cov[4]
        out["reliability"] = {"nominal": levels, "coverage": cov}
    return out


def _z(p: float) -> float:
    """The standard normal quantile of (1 + p) / 2 (half-width of the central p interval)."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + p / 2)


def prediction_metrics(task: str, prediction, y, log_density=None) -> dict:
    """Metrics of a prediction (probabilities, or (mean, variance)) against ``y``."""
    if task == "classification":
        return classification_metrics(prediction, y)
    mean, var = prediction
    return regression_metrics(mean, var, y, log_density, coverage=task == "regression")


def evaluate(posterior, X, y) -> dict:
    """Metrics of ``posterior.predict(X)`` and ``posterior.log_predictive_density(X, y)``."""
    task = posterior.potential.task
    log_density = None if task == "classification" else posterior.log_predictive_density(X, y)
    return prediction_metrics(task, posterior.predict(X), y, log_density)
