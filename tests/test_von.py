"""VON (full-covariance variational online Newton) against exact Gaussian posteriors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import linreg_exact_posterior, linreg_model

import fedprob as fp
from fedprob.algorithms import BayesADMM
from fedprob.inference import VON
from fedprob.potential import make_target
from fedprob.run import get_potential

from test_dual import PRIOR, SIGMA
from test_dual import linreg_fed as linreg_clients


@pytest.mark.slow
@pytest.mark.parametrize("hessian", ["ggn", "hessian"])
def test_von_fixed_point_is_the_exact_posterior(x64, hessian):
    """Started away from the mode (no mode search), VON's mean and full precision reach the exact
    posterior of a correlated linear regression: the precision exactly (the curvature of a Gaussian
    target is constant), the mean within the Monte Carlo noise of the averaged gradients."""
    Xs, ys, fed = linreg_clients([40])
    pot = get_potential(linreg_model(PRIOR, SIGMA), fed)
    target = make_target(jax.tree_util.tree_map(lambda a: a[0], fed.client_data()), 3)
    mean, cov = linreg_exact_posterior(Xs, ys, SIGMA, PRIOR)
    von = VON(map_steps=0, hessian=hessian)
    res = jax.jit(lambda k: von.run(k, pot, target, jnp.full(3, 5.0)))(jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(res.posterior.precision), np.linalg.inv(cov), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(res.posterior.mean()), mean, atol=0.1 * np.sqrt(np.diag(cov)).min())
    assert bool(res.diagnostics["converged"])


@pytest.mark.slow
def test_full_bayes_admm_with_von_clients_is_near_exact_after_one_round(x64):
    """Prop. 3.2 with VON client solves: rho = gamma = 1/K, one round, full covariance."""
    Xs, ys, fed = linreg_clients([5, 20, 40, 60])
    mean, cov = linreg_exact_posterior(Xs, ys, SIGMA, PRIOR)
    algo = BayesADMM(client=VON(map_steps=0), family="full", rho=1 / 4, damping=1 / 4)
    g = fp.run(algo, linreg_model(PRIOR, SIGMA), fed, rounds=1, progress=False).posterior.form
    np.testing.assert_allclose(np.asarray(g.precision), np.linalg.inv(cov), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g.mean()), mean, atol=0.15 * np.sqrt(np.diag(cov)).min())


def test_von_rejects_bad_settings():
    for kw, msg in [({"learning_rate": 0.0}, "learning_rate"), ({"learning_rate": 1.5}, "learning_rate"),
                    ({"num_steps": 0}, "num_steps"), ({"mc_samples": 0}, "mc_samples"),
                    ({"hessian": "diag"}, "hessian"), ({"map_steps": -1}, "map_steps"),
                    ({"average_fraction": 1.0}, "average_fraction"), ({"min_precision": 0.0}, "min_precision")]:
        with pytest.raises(ValueError, match=msg):
            VON(**kw)
