"""fedprob.models.examples: each program's likelihood and prior, as the engine reads them, against the
same densities written out by hand with scipy (at prior draws), and its deterministic sites.

The federated answers on these programs (every algorithm at its defaults against pooled NUTS) are in
test_any_model.py, test_psis.py and benchmarks/any_model.py.
"""
import jax
import numpy as np
import pytest
from scipy import special, stats

from fedprob.models import examples as ex
from fedprob.potential import Potential


def _data(name, n=30, seed=0):
    rng = np.random.default_rng(seed)
    x0 = rng.normal(size=n)
    if name == "robust_regression":
        X = np.stack([x0, rng.uniform(size=n) > 0.3], 1).astype(np.float32)
        return X, (x0 + rng.standard_t(4, n)).astype(np.float32)
    if name in ("zero_inflated_poisson", "factor_poisson"):
        y = rng.poisson(1.5, n) * (rng.uniform(size=n) > 0.3)
        return x0[:, None].astype(np.float32), y.astype(np.float32)
    if name == "ordinal_regression":
        return x0[:, None].astype(np.float32), rng.integers(0, ex.NUM_ORDINAL_CLASSES, n).astype(np.int32)
    if name == "binomial_groups":
        trials = rng.integers(1, 12, n)
        X = np.stack([rng.integers(0, ex.NUM_GROUPS, n), trials], 1).astype(np.int32)
        return X, rng.binomial(trials, 0.4).astype(np.int32)
    if name == "known_scales":
        X = np.stack([x0, rng.uniform(0.5, 2.0, n)], 1).astype(np.float32)
        return X, (1.0 + X[:, 1] * rng.normal(size=n)).astype(np.float32)
    if name == "horseshoe_logistic":
        X = rng.normal(size=(n, 3)).astype(np.float32)
        return X, (rng.uniform(size=n) < 0.5).astype(np.int32)
    if name == "eight_schools":
        X = np.stack([np.arange(8.0), [15, 10, 16, 11, 9, 11, 10, 18.0]], 1).astype(np.float32)
        return X, np.array([28, 8, -3, 7, -1, 1, 18, 12.0], np.float32)
    raise KeyError(name)


def _by_hand(name, v, X, y):
    """(log likelihood, log prior density of the constrained values) written out with scipy."""
    v = {k: np.asarray(a, np.float64) for k, a in v.items()}
    x0 = X[:, 0].astype(np.float64)
    if name == "robust_regression":
        ll = stats.t.logpdf(y, 4.0, v["w"] * x0 + v["b"], v["sigma"])
        return np.sum(np.where(X[:, 1] > 0, ll, 0.0)), (stats.norm.logpdf(v["w"], 0, 3) + stats.norm.logpdf(
            v["b"], 0, 3) + stats.halfnorm.logpdf(v["sigma"], scale=2.0))
    if name == "zero_inflated_poisson":
        rate, g = np.exp(v["w"] * x0 + v["b"]), v["gate"]
        ll = np.where(y == 0, np.log(g + (1 - g) * np.exp(-rate)), np.log1p(-g) + stats.poisson.logpmf(y, rate))
        return np.sum(ll), stats.norm.logpdf(v["w"]) + stats.norm.logpdf(v["b"]) + stats.beta.logpdf(g, 1, 1)
    if name == "ordinal_regression":
        cut = special.logit(np.cumsum(v["probs"])[:-1])
        np.testing.assert_allclose(v["cutpoints"], cut, rtol=1e-4, atol=1e-4)     # the deterministic site
        upper = np.append(special.expit(cut[None, :] - v["beta"] * x0[:, None]), np.ones((len(y), 1)), 1)
        cdf = np.concatenate([np.zeros((len(y), 1)), upper], 1)
        p = cdf[np.arange(len(y)), y + 1] - cdf[np.arange(len(y)), y]
        return np.sum(np.log(p)), (stats.norm.logpdf(v["beta"], 0, 2)
                                   + stats.dirichlet.logpdf(v["probs"] / v["probs"].sum(),
                                                            np.ones(ex.NUM_ORDINAL_CLASSES)))
    if name == "binomial_groups":
        p = special.expit(v["a"][X[:, 0]])
        return np.sum(stats.binom.logpmf(y, X[:, 1], p)), np.sum(stats.norm.logpdf(v["a"], 0, 2))
    if name == "known_scales":
        return np.sum(stats.norm.logpdf(y, v["mu"], X[:, 1])), stats.norm.logpdf(v["mu"], 0, 10)
    if name == "factor_poisson":
        return (np.sum(stats.poisson.logpmf(y, np.exp(v["w"] * x0 + v["b"]))),
                stats.norm.logpdf(v["w"]) + stats.norm.logpdf(v["b"]))
    if name == "horseshoe_logistic":
        w = v["tau"] * v["lam"] * v["z"]
        np.testing.assert_allclose(v["w"], w, rtol=1e-4)                       # the deterministic site
        logits = X.astype(np.float64) @ w
        return (np.sum(y * logits - np.logaddexp(0, logits)),
                stats.halfcauchy.logpdf(v["tau"]) + np.sum(stats.halfcauchy.logpdf(v["lam"]))
                + np.sum(stats.norm.logpdf(v["z"])))
    if name == "eight_schools":
        return (np.sum(stats.norm.logpdf(y, v["theta"][X[:, 0].astype(int)], X[:, 1])),
                stats.norm.logpdf(v["mu"], 0, 5) + stats.halfcauchy.logpdf(v["tau"], scale=5)
                + np.sum(stats.norm.logpdf(v["theta"], v["mu"], v["tau"])))
    raise KeyError(name)


@pytest.mark.parametrize("name", [n for n in ex.__all__ if not n.isupper()])
def test_likelihood_prior_and_deterministic_sites_match_the_densities_by_hand(name):
    X, y = _data(name)
    model = getattr(ex, name)
    pot = Potential(model, X, y)

    @jax.jit        # one compiled program for the three draws, not op by op (eagerly) for each
    def engine_view(key):
        z = pot.sample_prior(key)
        return pot.constrain_all(z), pot.log_likelihood(z, X, y), pot.log_prior(z)

    for seed in range(3):
        values, engine_ll, engine_lp = engine_view(jax.random.PRNGKey(seed))
        ll, lp = _by_hand(name, values, X, y)
        np.testing.assert_allclose(float(engine_ll), ll, rtol=2e-4, atol=2e-3)
        if name in ("known_scales", "binomial_groups", "factor_poisson"):    # real support: no Jacobian
            np.testing.assert_allclose(float(engine_lp), lp, rtol=2e-4, atol=2e-3)


def test_a_misspelt_example_names_the_closest_one():
    with pytest.raises(AttributeError, match="did you mean 'zero_inflated_poisson'") as e:
        ex.zero_inflated_poison
    assert "annotations" not in str(e.value)
