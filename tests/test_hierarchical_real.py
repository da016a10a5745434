"""A hierarchical model on real grouped data (bike sharing by week) at PVI's defaults against NUTS on the
pooled hierarchical program: benchmarks/hierarchical.py, whose numbers these tests assert.

The default run takes the first 24 weeks (intercepts only); the full 105 weeks with intercepts and with
slopes are slow-marked. Skipped without the shared data folder.
"""
from __future__ import annotations

import pytest

from test_benchmarks import load_script


@pytest.fixture(scope="module")
def bench(data_root):
    return load_script("hierarchical")


def check(r, global_z, local_z, sd_lo=0.75, sd_hi=1.33):
    for kind, bound in (("global", global_z), ("local", local_z)):
        for site, v in r[kind].items():
            assert v["max_abs_z"] < bound, (kind, site, v)
            assert sd_lo < v["sd_ratio_min"] and v["sd_ratio_max"] < sd_hi, (kind, site, v)
    v = r["new_client"]
    assert v["max_abs_shift_sd"] < 0.1 and 0.9 < v["sd_ratio_min"] and v["sd_ratio_max"] < 1.1, v
    h = r["heldout_nll"]
    # the federated hierarchical predictive is the pooled program's, and beats complete pooling
    assert abs(h["hierarchical"] - h["hierarchical_nuts"]) < 0.03, h
    assert h["hierarchical"] < h["complete_pooling"] - 0.02, h


@pytest.mark.slow     # 66 s cold; PVI on hierarchical oracles: test_local_sites.py
def test_24_weeks_at_pvi_defaults_match_pooled_nuts(bench, data_root):
    """Measured: global sites within 0.45 sd (sigma_a 0.35, sigma 0.44: 24 groups leave the scale's
    posterior skewed, which a Gaussian in log sigma_a only approaches), local z within 0.34 sd, sds
    0.80-0.99."""
    r = bench.run(weeks=24, slopes=False, chains=1, root=data_root)
    check(r, global_z=0.5, local_z=0.4)


@pytest.mark.slow
@pytest.mark.parametrize("slopes", [False, True])
def test_105_weeks_at_pvi_defaults_match_pooled_nuts(bench, data_root, slopes):
    """Measured: intercepts, global within 0.17 sd and local within 0.07; with slopes the slopes'
    spread sigma_b is 0.34 sd off (a Gaussian in log sigma_b of a skewed posterior), the rest within
    0.14. No pooling scores a better held-out NLL than both models (0.57 against 0.75, under pooled
    NUTS too): the weeks differ in their noise (benchmarks/results/hierarchical.md)."""
    r = bench.run(weeks=105, slopes=slopes, chains=2, root=data_root)
    check(r, global_z=0.4 if slopes else 0.25, local_z=0.3)
