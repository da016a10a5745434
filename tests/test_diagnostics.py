"""The ArviZ shim: bulk ESS and R-hat on (chains, draws, ...) arrays."""
import numpy as np
import pytest

from fedprob import diagnostics


def test_ess_and_rhat_of_independent_and_stuck_chains():
    rng = np.random.default_rng(0)
    iid = rng.normal(size=(4, 1000, 3))
    e = diagnostics.ess(iid)
    assert e.shape == (3,)
    assert np.all(e > 2500) and np.all(e < 6000)          # about 4000 for independent draws
    assert np.all(np.abs(diagnostics.rhat(iid) - 1) < 0.01)
    # an AR(1) chain with rho = 0.9 has ESS about n (1 - rho) / (1 + rho)
    ar = np.zeros((4, 4000))
    for t in range(1, 4000):
        ar[:, t] = 0.9 * ar[:, t - 1] + rng.normal(size=4)
    assert diagnostics.ess(ar[..., None])[0] == pytest.approx(16000 * 0.1 / 1.9, rel=0.3)
    # chains stuck in different places: R-hat far above 1
    stuck = rng.normal(size=(4, 500, 1)) + np.arange(4)[:, None, None] * 3
    assert diagnostics.rhat(stuck)[0] > 1.5
    with pytest.raises(ValueError, match="chains, draws"):
        diagnostics.ess(np.zeros(10))
