"""The ArviZ shim: bulk/tail ESS and R-hat equal ArviZ's own; importance-sampling ESS; warnings."""
import re
import warnings

import numpy as np
import pytest

from fedprob import diagnostics
from fedprob.diagnostics import _az


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
    with pytest.raises(ValueError, match="bulk"):
        diagnostics.ess(iid, method="mean")


def test_equal_to_arviz_on_the_same_arrays():
    az = _az()
    rng = np.random.default_rng(1)
    x = np.cumsum(rng.normal(size=(3, 400, 2, 2)), axis=1) * 0.1 + rng.normal(size=(3, 400, 2, 2))
    for method, kw in (("bulk", {}), ("tail", {"prob": diagnostics.TAIL_PROB})):
        ours = diagnostics.ess(x, method)
        theirs = np.array([[float(az.ess(x[:, :, i, j], method=method, **kw)) for j in range(2)] for i in range(2)])
        np.testing.assert_allclose(ours, theirs, rtol=1e-10)
    theirs = np.array([[float(az.rhat(x[:, :, i, j])) for j in range(2)] for i in range(2)])
    np.testing.assert_allclose(diagnostics.rhat(x), theirs, rtol=1e-10)


def test_importance_ess():
    # weights 1, 2, 3: (1 + 2 + 3)^2 / (1 + 4 + 9)
    draws = np.array([[0.0], [1.0], [2.0]])
    assert diagnostics.importance_ess(draws, lambda z: np.log(z[:, 0] + 1.0)) == pytest.approx(36 / 14)
    # draws from the reference itself, its density as the proposal: every weight equal, ESS = n
    rng = np.random.default_rng(0)
    z = rng.normal(size=(500, 2))
    logp = lambda a: -0.5 * np.sum(a ** 2, -1)               # noqa: E731
    assert diagnostics.importance_ess(z, logp, logp) == pytest.approx(500)
    # too wide a sampler (sd 2 for sd 1): ESS/n -> 1 / E_q[(p/q)^2] = (sqrt(2 s^2 - 1) / s^2)^d = (sqrt(7)/4)^2
    q = 2.0 * rng.normal(size=(20000, 2))
    logq = lambda a: -0.5 * np.sum((a / 2.0) ** 2, -1)       # noqa: E731
    assert diagnostics.importance_ess(q, logp, logq) / 20000 == pytest.approx(7 / 16, rel=0.1)
    # a per-draw function works too
    assert diagnostics.importance_ess(draws, lambda v: float(np.log(v[0] + 1.0))) == pytest.approx(36 / 14)
    with pytest.raises(ValueError, match="finite"):
        diagnostics.importance_ess(draws, lambda a: np.log(a[:, 0]))


def test_gaussian_gap_and_warnings_name_the_client():
    rng = np.random.default_rng(0)
    assert diagnostics.gaussian_gap(rng.normal(size=(4000, 3))) < 0.1
    bimodal = np.concatenate([rng.normal(-3, 0.3, 2000), rng.normal(3, 0.3, 2000)])[:, None]
    assert diagnostics.gaussian_gap(bimodal) > 0.5
    rows = [{"scope": "client 3", **diagnostics.summarize(rng.normal(size=(4, 500, 2)) + np.arange(4)[:, None, None])},
            {"scope": "client 4", **diagnostics.summarize(rng.normal(size=(4, 500, 2)))}]
    with pytest.warns(RuntimeWarning) as rec:
        msgs = diagnostics.check(rows)
    assert len(rec) == len(msgs) and all("on 1 of 2 clients" in m and "(client 3)" in m for m in msgs)
    assert any(re.match(r"R-hat above 1.05 on 1 of 2 clients, worst .* \(client 3\): .*run longer chains", m)
               for m in msgs)


def test_same_numbers_on_every_arviz_version():
    """Pinned values: ArviZ 0.23 and 1.x give these same bulk/tail ESS and R-hat (tail at the 5%/95% quantiles)."""
    rng = np.random.default_rng(1)
    x = np.cumsum(rng.normal(size=(3, 400, 2)), axis=1) * 0.1 + rng.normal(size=(3, 400, 2))
    np.testing.assert_allclose(diagnostics.ess(x), [5.278487609245197, 5.447711620721946], rtol=1e-9)
    np.testing.assert_allclose(diagnostics.ess(x, "tail"), [19.118635081239887, 30.887569605468272], rtol=1e-9)
    np.testing.assert_allclose(diagnostics.rhat(x), [1.5631923999597712, 1.5320756605440689], rtol=1e-9)


def test_check_warns_each_cause_once_per_run():
    rng = np.random.default_rng(0)
    bad = diagnostics.summarize(rng.normal(size=(4, 500, 2)) + np.arange(4)[:, None, None])
    rows = [{"scope": f"client {k}", **bad} for k in range(10)] + [{"scope": "global", **bad}]
    seen = set()
    with pytest.warns(RuntimeWarning) as rec:
        msgs = diagnostics.check(rows, seen=seen)
    causes = len(rec)
    assert causes == len(msgs) and any("on 10 of 10 clients" in m for m in msgs)
    assert sum(m.startswith("global:") for m in msgs) == causes // 2        # global and clients per cause
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert diagnostics.check(rows, seen=seen) == msgs                   # the same notes, no second warning
    healthy = diagnostics.summarize(rng.normal(size=(4, 500, 650)))         # 650 healthy coordinates
    assert 1.0 < healthy["rhat"] < diagnostics.RHAT_WARN
    assert diagnostics.check([{"scope": "client 0", **healthy}], warn=False) == []
