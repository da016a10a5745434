"""Every algorithm at its DEFAULT arguments on the embedded digits, and the starts they use.

Setting: ``fp.data.load_digits(seed=0)`` (its own held-out test split), 10
clients, Dirichlet(0.5) label split, seed 0, ``softmax_regression(10)``,
``fp.run`` with the algorithm's default number of rounds. The bounds are the
measured values with a margin (measured values in each comment).

EPMCMC and ConsensusMC default to full-batch NUTS (500 warmup + 500 draws) on
d = 650 parameters per client, about 80-90 s each on two CPU cores: those
default runs are marked slow. The fast versions use a Laplace client
(``Laplace(hessian="diag_ggn")``, a Gaussian per client): a shorter NUTS
(200 warmup + 200 draws, or tree depth 6) does not give usable client
posteriors on d = 650 (EPMCMC's full-covariance product of 200-draw fits
returned NaN predictions; ConsensusMC with depth 6: accuracy 0.36).
"""
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedprob as fp
from fedprob.potential import Potential

A = fp.algorithms


@pytest.fixture(scope="module")
def digits():
    ds = fp.data.load_digits(seed=0)
    fed = fp.data.partition(*ds.train, num_clients=10, scheme="dirichlet", alpha=0.5, seed=0)
    return fed, ds.test


def run_default(algo, digits):
    fed, test = digits
    res = fp.run(algo, fp.models.softmax_regression(10), fed, seed=0, eval_data=test, progress=False)
    return res.history[-1]


# (algorithm, min accuracy, max NLL): measured accuracy / NLL in the comments
CASES = {
    # 10 rounds, start at the prior centre (a prior draw: accuracy 0.21 after 20 rounds)
    "FedAvg": (lambda: A.FedAvg(), 0.78, 1.70),                   # 0.814 / 1.605
    "FedProx": (lambda: A.FedProx(), 0.78, 1.70),                 # 0.814 / 1.606
    "PredictiveBayes": (lambda: A.PredictiveBayes(), 0.76, 0.70),  # 0.792 / 0.603 (plain product: NLL 2.24)
    "Ensemble": (lambda: A.Ensemble(), 0.84, 1.00),               # 0.869 / 0.903
    "OneShotAverage": (lambda: A.OneShotAverage(), 0.72, 1.00),   # 0.750 / 0.936
}


#: PredictiveBayes at its defaults on this federation is checked in the default run by
#: test_predictive_bayes.test_default_is_calibrated_on_the_demo_setting (same run, NLL < 0.75);
#: Ensemble runs the same cSGHMC clients (32 s cold), its mixture is checked in the default run by
#: test_one_round and test_predictive_grid
SLOW_CASES = {"PredictiveBayes", "Ensemble"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n
                                  for n in CASES])
def test_default_algorithm_on_digits(name, digits):
    make, min_acc, max_nll = CASES[name]
    h = run_default(make(), digits)
    assert h["accuracy"] >= min_acc, (name, h["accuracy"])
    assert h["nll"] <= max_nll, (name, h["nll"])


@pytest.mark.parametrize("name,make,min_acc,max_nll", [
    ("EPMCMC", lambda: A.EPMCMC(client=fp.inference.Laplace(hessian="diag_ggn")), 0.86, 0.45),  # 0.897 / 0.392
    ("ConsensusMC", lambda: A.ConsensusMC(client=fp.inference.Laplace(hessian="diag_ggn")), 0.87, 0.75),
    # ConsensusMC measured 0.911 / 0.662
])
def test_nuts_algorithms_with_a_laplace_client(name, make, min_acc, max_nll, digits):
    h = run_default(make(), digits)
    assert h["accuracy"] >= min_acc, (name, h["accuracy"])
    assert h["nll"] <= max_nll, (name, h["nll"])


@pytest.mark.slow
@pytest.mark.parametrize("name,make,min_acc,max_nll", [
    ("EPMCMC", lambda: A.EPMCMC(), 0.79, 0.90),              # 0.828 / 0.771
    ("ConsensusMC", lambda: A.ConsensusMC(), 0.78, 0.70),    # 0.817 / 0.587
])
def test_nuts_algorithms_at_their_defaults(name, make, min_acc, max_nll, digits):
    h = run_default(make(), digits)
    assert h["accuracy"] >= min_acc, (name, h["accuracy"])
    assert h["nll"] <= max_nll, (name, h["nll"])


def test_fedavg_starts_at_the_prior_centre():
    assert A.FedAvg().init_strategy == "center" and A.FedProx().init_strategy == "center"


# ----------------------------------------------------------------------------- Potential.init
def _hier(X, y=None):
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    mu = numpyro.sample("mu", dist.Normal(3.0, tau))
    w = numpyro.sample("w", dist.Normal(mu, 1.0).expand([2]).to_event(1))
    s = numpyro.sample("s", dist.LogNormal(0.5, 1.0))
    p = numpyro.sample("p", dist.Dirichlet(jnp.ones(3)))
    c = numpyro.sample("c", dist.StudentT(1.0, 2.0, 1.0))
    g = numpyro.sample("g", dist.Gamma(2.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + c * 0 + g * 0 + p[0] * 0, s), obs=y)


def test_center_is_the_prior_median_in_model_order():
    X, y = np.ones((3, 2), np.float32), np.ones(3, np.float32)
    pot = Potential(_hier, X, y)
    center = jax.jit(lambda k: pot.init(k, "center"))
    z = center(jax.random.PRNGKey(5))
    p = pot.constrain(z)
    assert float(p["tau"]) == pytest.approx(2.0 * 0.6744898, rel=1e-5)     # HalfNormal median
    assert float(p["mu"]) == pytest.approx(3.0)                             # Normal loc
    np.testing.assert_allclose(p["w"], [3.0, 3.0])                          # child of mu: mu's centre
    assert float(p["s"]) == pytest.approx(np.exp(0.5), rel=1e-5)            # LogNormal median
    np.testing.assert_allclose(p["p"], np.full(3, 1 / 3), rtol=1e-5)        # Dirichlet mean
    assert float(p["c"]) == pytest.approx(2.0)                              # StudentT(df=1): its loc
    assert float(p["g"]) == pytest.approx(2.0)                              # Gamma: no icdf, its mean
    # deterministic: the key does not matter when no site declares an init scale
    np.testing.assert_allclose(z, center(jax.random.PRNGKey(0)), rtol=1e-6)
    # the centre of a Normal prior is its loc: softmax regression starts at 0
    pot2 = Potential(fp.models.softmax_regression(4), X, np.zeros(3, np.int32))
    np.testing.assert_array_equal(jax.jit(lambda k: pot2.init(k, "center"))(jax.random.PRNGKey(1)),
                                  np.zeros(pot2.dim))
    with pytest.raises(ValueError, match="init strategy"):
        pot.init(jax.random.PRNGKey(0), "median")


def test_prior_start_is_unchanged_for_models_without_an_init_scale():
    """"prior": real sites drawn from the prior, constrained sites at unconstrained 0."""
    X, y = np.ones((3, 2), np.float32), np.ones(3, np.float32)
    pot = Potential(_hier, X, y)
    key = jax.random.PRNGKey(3)
    draw = pot.sample_prior(key)
    want = jnp.where(pot._real_mask, draw, 0.0)
    np.testing.assert_allclose(pot.init(key, "prior"), want, rtol=1e-6)
    np.testing.assert_array_equal(pot.init(key, "prior_full"), draw)


def test_fedavg_default_start_trains_a_network(digits):
    """An MLP's prior centre is all zeros (every hidden unit identical, no gradient to break the tie):
    the default start adds the model's LeCun init noise to the weights. Measured after 10 rounds:
    accuracy 0.681 from the default start, 0.100 (chance) from zeros."""
    fed, test = digits
    model = fp.models.bnn_mlp((32,), num_classes=10)
    h = fp.run(A.FedAvg(), model, fed, seed=0, eval_data=test, progress=False).history[-1]
    z = fp.run(A.FedAvg(init_strategy="zeros"), model, fed, seed=0, eval_data=test, progress=False).history[-1]
    assert h["accuracy"] >= 0.62 and z["accuracy"] <= 0.15


def test_fedpa_default_on_a_network_sends_fedavgs_delta_for_travelling_chains(digits):
    """FedPA() on the same MLP, 10 rounds: the clients whose IASG chains still travel downhill (drift and
    spread checks, fedprob.algorithms.fedpa) send FedAvg's delta that round, the rest their damped delta.
    Measured: 0.886 accuracy, NLL 0.381, up to 30% of the clients flagged in a round; with the checks off
    (max_drift=None) 0.853 / 0.472; FedAvg() above: 0.697 / 1.518."""
    fed, test = digits
    r = fp.run(A.FedPA(), fp.models.bnn_mlp((32,), num_classes=10), fed, seed=0, eval_data=test, progress=False)
    h = r.history[-1]
    assert h["accuracy"] >= 0.86 and h["nll"] <= 0.42, h
    flagged = np.asarray(r.metric("client_drifting"))
    assert 0 < flagged.max() < 1 and flagged[:2].max() == 0     # some clients, never in the burn-in rounds
