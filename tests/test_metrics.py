"""Calibration metrics against hand-computed values."""
import numpy as np
import pytest

from fedprob.metrics import classification_metrics, regression_metrics


def test_classification_metrics_by_hand():
    probs = np.array([[0.9, 0.1], [0.4, 0.6], [0.3, 0.7]])
    y = np.array([0, 0, 1])
    m = classification_metrics(probs, y, num_bins=5)
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert m["nll"] == pytest.approx(-(np.log(0.9) + np.log(0.4) + np.log(0.7)) / 3)
    assert m["brier"] == pytest.approx((2 * 0.1 ** 2 + 2 * 0.6 ** 2 + 2 * 0.3 ** 2) / 3)
    # bins of width 0.2: {0.6, 0.7} in [0.6, 0.8) with accuracy 1/2, {0.9} in [0.8, 1] with accuracy 1
    assert m["ece"] == pytest.approx(2 / 3 * abs(0.5 - 0.65) + 1 / 3 * abs(1 - 0.9))
    rel = m["reliability"]
    assert m["ece_bins"] == 5 and rel["count"] == [0, 0, 0, 2, 1]
    assert rel["confidence"][3:] == pytest.approx([0.65, 0.9]) and rel["accuracy"][3:] == pytest.approx([0.5, 1])
    assert np.isnan(rel["accuracy"][0]) and rel["edges"] == pytest.approx(np.linspace(0, 1, 6))


def test_regression_metrics_by_hand():
    y = np.array([0.1, 1.0, 2.0, -3.0])
    m = regression_metrics(np.zeros(4), np.ones(4), y)
    assert m["rmse"] == pytest.approx(np.sqrt(np.mean(y ** 2)))
    assert m["nll"] == pytest.approx(np.mean(0.5 * np.log(2 * np.pi) + 0.5 * y ** 2))
    # |err| <= 1.96: 0.1, 1.0 -> 1/2; |err| <= 0.674: 0.1 -> 1/4
    assert m["coverage_95"] == 0.5 and m["coverage_50"] == 0.25
    assert m["reliability"]["nominal"][-1] == 0.95 and m["reliability"]["coverage"][-1] == 0.5
    # a calibrated Gaussian predictive covers at its nominal rates
    rng = np.random.default_rng(0)
    cov = regression_metrics(np.zeros(20000), np.ones(20000), rng.normal(size=20000))["reliability"]
    assert np.allclose(cov["coverage"], cov["nominal"], atol=0.015)
