"""The dual-family benchmark's CI-sized runs on the real data: ``benchmarks/dual.py --quick`` (Credit)
and the Fashion-MNIST MLP part at a reduced number of rounds."""
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_benchmarks import load_script

import fedprob as fp
from fedprob.algorithms import BayesADMM
from fedprob.inference import IVON
from fedprob.metrics import classification_metrics
from fedprob.potential import ClientData, Potential, make_target


def test_dual_benchmark_quick(data_root, capsys):
    res = load_script("dual").main(["--quick", "--data", str(data_root)])
    curve = res["problems"]["credit"]["FedLapCov"]
    assert len(curve["accuracy"]) == 2 and all(math.isfinite(a) for a in curve["nll"])
    # two rounds of FedLap-Cov already beat the majority class (55%) by a wide margin, at the mean and averaged
    assert curve["final_mean"]["accuracy"] > 0.75 and curve["final_average"]["accuracy"] > 0.75
    # the pooled-data reference (the global posterior every converging method aims at): the MAP
    # predicts as well as two rounds of FedLap-Cov, with a lower NLL than its diagonal posterior
    pooled = res["problems"]["credit"]["_pooled"]
    assert pooled["mean"]["accuracy"] > 0.8
    assert pooled["mean"]["nll"] < curve["final_mean"]["nll"]
    assert "credit" in capsys.readouterr().out


@pytest.mark.slow
def test_bayes_admm_with_ivon_clients_on_credit(data_root):
    """Alg. 1 as printed (IVON clients, rho = 1) on the heterogeneous Credit split.

    gamma = 0.1 (the default) reaches FedAvg's accuracy (84.7% after 20 rounds in
    results/dual.md) with a lower NLL. At gamma = rho = 1, after one round the server counts
    only 2 / (K + 1) of the sites' precision, so the next client problem's quadratic term
    ``s_g - u_k`` is negative in some coordinate for the clients with the most curvature; a
    logistic loss (linear tails) is then unbounded below, and the paper's loop diverges (the
    second round's mean went past 1e3). The diagonal loop floors that term at the prior
    precision (``floors_the_gaussian_term``), so the second round stays bounded with every client in.
    """
    bench = load_script("dual")
    fed, test = bench.credit_split(data_root)
    model = fp.models.logistic_regression(prior_scale=1.0)
    res = fp.run(BayesADMM(client=IVON()), model, fed, rounds=20, eval_data=test, progress=False)
    assert res.metric("accuracy")[-1] >= 0.847 and res.metric("nll")[-1] < 0.37
    assert all(h["server_update_ok"] and not h["excluded"] for h in res.history)
    one = fp.run(BayesADMM(client=IVON(), damping=1.0), model, fed, rounds=1, progress=False)
    s_g, u = np.asarray(one.server_state.lam.precision), np.asarray(one.client_states.precision)
    K = fed.num_clients
    np.testing.assert_allclose(s_g, 1.0 + 2 * u.sum(0) / (K + 1), rtol=1e-4)
    assert (s_g[None] - u).min() < 0
    two = fp.run(BayesADMM(client=IVON(), damping=1.0), model, fed, rounds=2, progress=False)
    assert BayesADMM(client=IVON(), damping=1.0).loop().floors_the_gaussian_term(SimpleNamespace(num_clients=K))
    assert all(h["server_update_ok"] and not h["excluded"] for h in two.history)
    assert np.abs(np.asarray(two.posterior.form.mean())).max() < 10.0


@pytest.fixture(scope="module")
def fmnist(data_root):
    """The benchmark's split (10% of Fashion-MNIST, 10 clients), its test rows and its MLP."""
    fed, test = load_script("dual").fmnist_split(data_root)
    model = fp.models.bnn_mlp((200, 100), num_classes=10, activation="sigmoid", prior_scale=1.0)
    return fed, test, model


@pytest.mark.slow
def test_ivon_defaults_learn_the_fmnist_mlp(fmnist):
    """IVON at its defaults, all 6,000 rows as one client, 2 epochs on minibatches of 32 from the
    random initialisation. With ``h0`` the curvature there (``min_hess=0``: half the weights below
    2e-4 per point) the first sds were the prior's, the means moved ~90 in norm and the accuracy
    was 26%; with the floor 0.1 it reaches 72% at the mean (chance 10%; Adam 1e-3 in the same steps:
    78%; the gap is the width of the untempered mean-field posterior under the N(0, 1) prior)."""
    fed, (Xt, yt), model = fmnist
    X = np.concatenate([fed.X[k][: fed.sizes[k]] for k in range(fed.num_clients)])
    y = np.concatenate([fed.y[k][: fed.sizes[k]] for k in range(fed.num_clients)])
    pot = Potential(model, X[:4], y[:4])
    target = make_target(ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(len(y))), pot.dim)
    init = pot.init(jax.random.PRNGKey(0), "center")
    res = IVON(num_steps=len(y) * 2 // 32, batch_size=32, map_steps=0).run(jax.random.PRNGKey(2), pot, target, init)
    acc = classification_metrics(np.exp(np.asarray(pot.predict(res.params, Xt))), yt)["accuracy"]
    assert acc > 0.65 and not bool(res.diagnostics["nonfinite"])


def bayes_admm_ivon_fmnist(fmnist, rounds):
    """BayesADMM with IVON clients at their defaults (38 steps of 32 rows, from the server mean) at
    the paper's temperature 0.1: accuracy at the default prediction after ``rounds`` rounds."""
    fed, test, model = fmnist
    algo = BayesADMM(client=IVON(num_steps=38, batch_size=32, map_steps=0), tau=0.1)
    res = fp.run(algo, model, fed, rounds=rounds, eval_data=test, eval_every=rounds, progress=False)
    assert all(h["server_update_ok"] and not h["excluded"] for h in res.history)
    return res.metric("accuracy")[-1]


@pytest.mark.slow     # 55 s cold; BayesADMM-IVON's oracle: test_dual.py
def test_bayes_admm_with_ivon_learns_the_fmnist_mlp(fmnist):
    """2 rounds: 25% (chance 10%); before the IVON floor and beta2 rule: 10% after 2 rounds."""
    assert bayes_admm_ivon_fmnist(fmnist, 2) > 0.17


@pytest.mark.slow
def test_bayes_admm_with_ivon_reaches_fedavg_on_the_fmnist_mlp(fmnist):
    """4 rounds: 63%, FedAvg's 62.5% after 4 rounds with Adam in the same local steps."""
    assert bayes_admm_ivon_fmnist(fmnist, 4) > 0.5


@pytest.mark.slow
def test_tempered_bayes_admm_leads_fedavg_on_the_fmnist_mlp_after_10_rounds(fmnist):
    """The benchmark's settings (5 local epochs: 94 steps of 32 rows): BayesADMM-IVON at
    tau = 0.03 reached 79.7% (NLL 0.57) after 10 rounds, FedAvg with Adam in the same steps 75.8%
    (0.76); the paper's 10-round numbers are 77.0% and 70.4%."""
    fed, test, model = fmnist
    admm = BayesADMM(client=IVON(num_steps=94, batch_size=32, map_steps=0), tau=0.03)
    fedavg = fp.algorithms.FedAvg(client_optimizer="adam", learning_rate=1e-3, batch_size=32, local_epochs=5.0)
    got = {}
    for name, algo in (("admm", admm), ("fedavg", fedavg)):
        res = fp.run(algo, model, fed, rounds=10, eval_data=test, eval_every=10, progress=False)
        got[name] = res.history[-1]
    assert got["admm"]["accuracy"] > 0.77 and got["admm"]["accuracy"] > got["fedavg"]["accuracy"] + 0.02
    assert got["admm"]["nll"] < got["fedavg"]["nll"] - 0.1
