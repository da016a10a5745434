"""Predictive metrics of a posterior on held-out data.

Classification: accuracy, NLL (mean negative log predictive probability),
Brier score and expected calibration error (15 equal-width confidence bins).
Regression: RMSE, NLL of the Gaussian predictive (noise included) and the
coverage of the central 95% predictive interval.
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


def regression_metrics(mean, var, y) -> dict:
    mean = np.asarray(mean, np.float64)
    var = np.maximum(np.asarray(var, np.float64), 1e-12)
    y = np.asarray(y, np.float64)
    err = y - mean
    return {"rmse": float(np.sqrt(np.mean(err ** 2))), "mse": float(np.mean(err ** 2)),
            "nll": float(np.mean(0.5 * (np.log(2 * np.pi * var) + err ** 2 / var))),
            "coverage_95": float(np.mean(np.abs(err) <= 1.959964 * np.sqrt(var)))}


def prediction_metrics(task: str, prediction, y) -> dict:
    if task == "classification":
        return classification_metrics(prediction, y)
    mean, var = prediction
    return regression_metrics(mean, var, y)


def evaluate(posterior, X, y) -> dict:
    """Metrics of ``posterior.predict(X)`` against ``y``."""
    return prediction_metrics(posterior.potential.task, posterior.predict(X), y)
