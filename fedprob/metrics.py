"""Predictive metrics of a posterior on held-out data.

Classification: accuracy, NLL (mean negative log predictive probability),
Brier score and expected calibration error (15 equal-width confidence bins).
Regression and counts: RMSE, MSE, NLL and, for regression, the coverage of
the interval ``mean +- 1.96 sd`` of the predictive. The NLL is that of the
posterior's own predictive (:meth:`GlobalPosterior.log_predictive_density`:
the mixture over draws for sample-based posteriors), not of a Gaussian fitted
to its mean and variance, unless only a (mean, variance) prediction is given.
"""
from __future__ import annotations

import numpy as np


def classification_metrics(probs, y, num_bins: int = 15) -> dict:
    probs = np.asarray(probs, np.float64)
    y = np.asarray(y).astype(int)
    p_true = np.clip(probs[np.arange(len(y)), y], 1e-12, None)
    conf = probs.max(1)
    pred = probs.argmax(1)
    correct = (pred == y).astype(float)
    onehot = np.eye(probs.shape[1])[y]
    bins = np.minimum((conf * num_bins).astype(int), num_bins - 1)
    ece = 0.0
    for b in range(num_bins):
        m = bins == b
        if m.any():
            ece += m.mean() * abs(correct[m].mean() - conf[m].mean())
    return {"accuracy": float(correct.mean()), "nll": float(-np.log(p_true).mean()),
            "brier": float(((probs - onehot) ** 2).sum(1).mean()), "ece": float(ece)}


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
        out["coverage_95"] = float(np.mean(np.abs(err) <= 1.959964 * np.sqrt(var)))
    return out


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
