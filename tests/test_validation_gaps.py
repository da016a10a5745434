"""Inputs that used to fail deep inside NumPyro or JAX now fail early with a clear message."""
import warnings

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedprob as fp
from conftest import linreg_model

MODEL = linreg_model()
FEDAVG = fp.algorithms.FedAvg(local_steps=2, batch_size=None, learning_rate=0.1)
RNG = np.random.default_rng(0)


def reg_fed(d=3, y_cols=None):
    shape = (10,) if y_cols is None else (10, y_cols)
    return fp.data.FederatedData.from_clients([(RNG.normal(size=(10, d)), RNG.normal(size=shape))] * 2)


def test_discrete_likelihood_with_to_event_and_no_plate_asks_for_the_data_plate():
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.sample("obs", dist.Bernoulli(logits=X @ w).to_event(1), obs=y)

    X = RNG.normal(size=(10, 3))
    with pytest.raises(ValueError, match="needs a 'data' plate.*drop `.to_event"):
        fp.Potential(model, X, (X[:, 0] > 0).astype(np.float32))


def test_whole_vector_event_inside_the_plate_is_refused():
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)

    with pytest.raises(ValueError, match="y does not match the model's likelihood"):
        fp.Potential(model, RNG.normal(size=(10, 3)), RNG.normal(size=10))


def test_integer_labels_stay_integer_without_num_classes():
    def clf(X, y=None):
        W = numpyro.sample("W", dist.Normal(0, 1).expand([X.shape[1], 3]).to_event(2))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Categorical(logits=X @ W), obs=y)

    fed = fp.data.FederatedData.from_clients([(RNG.normal(size=(10, 3)), RNG.integers(0, 3, 10))
                                              for _ in range(2)])
    assert fed.y.dtype == np.int32
    r = fp.run(FEDAVG, clf, fed, rounds=1, progress=False)
    probs = np.asarray(r.posterior.predict(fed.client(0)[0]))
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    assert reg_fed().y.dtype == np.float32           # real targets still become float32


def test_predict_validates_inputs():
    fed = reg_fed()
    post = fp.run(FEDAVG, MODEL, fed, rounds=1, progress=False).posterior
    with pytest.raises(ValueError, match="NaN/inf"):
        post.predict(np.full((2, 3), np.nan))
    with pytest.raises(ValueError, match=r"shape \(2, 4\).*rows of shape \(3,\)"):
        post.predict(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        post.predict(np.zeros(3))
    with pytest.raises(ValueError, match="NaN/inf"):
        post.log_predictive_density(np.full((2, 3), np.inf), np.zeros(2))
    mean, var = post.predict(np.zeros((2, 3)))
    assert np.all(np.isfinite(np.asarray(mean))) and np.all(np.asarray(var) > 0)


@pytest.mark.parametrize("make, match", [
    (lambda: fp.algorithms.FedAvg(learning_rate=-1), "learning_rate must be a positive"),
    (lambda: fp.algorithms.FedAvg(local_steps=0), "local_steps must be an integer >= 1"),
    (lambda: fp.algorithms.FedAvg(batch_size=0), "batch_size must be an integer >= 1"),
    (lambda: fp.algorithms.FedAvg(local_steps=None, local_epochs=None), "local_steps or local_epochs"),
    (lambda: fp.algorithms.FedAvg(server_learning_rate=0.0), "server_learning_rate must be a positive"),
    (lambda: fp.algorithms.FedAvg(server_momentum=1.0), r"server_momentum must lie in \[0, 1\)"),
    (lambda: fp.algorithms.FedAvg(init_strategy="random"), "init_strategy must be one of"),
    (lambda: fp.algorithms.FedProx(learning_rate=float("nan")), "learning_rate must be a positive"),
    (lambda: fp.algorithms.FedProx(mu=-0.1), "mu >= 0"),
    (lambda: fp.algorithms.FedPA(server_learning_rate=-1), "server_learning_rate must be a positive"),
    (lambda: fp.algorithms.EPMCMC(num_samples=1), "num_samples must be an integer >= 2"),
])
def test_algorithm_hyperparameters_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_backend_an_algorithm_cannot_use_is_refused_naming_both():
    with pytest.raises(ValueError, match="FedPA needs a client backend that returns draws.*got SVI"):
        fp.algorithms.FedPA(client=fp.inference.SVI())
    with pytest.raises(TypeError, match="FedPA's client must be a fedprob.inference backend, got str"):
        fp.algorithms.FedPA(client="sgld")
    with pytest.raises(TypeError, match="client must be a fedprob.inference backend"):
        fp.algorithms.ConsensusMC(client=object())


def test_data_that_do_not_match_the_model_or_each_other():
    with pytest.raises(ValueError, match="y does not match the model's likelihood"):
        fp.run(FEDAVG, MODEL, reg_fed(y_cols=2), rounds=1, progress=False)
    with pytest.raises(ValueError, match=r"client 1's X rows have shape \(4,\), client 0's have \(3,\)"):
        fp.data.FederatedData.from_clients([(np.zeros((3, 3)), np.zeros(3)), (np.zeros((3, 4)), np.zeros(3))])
    fed = reg_fed()
    with pytest.raises(ValueError, match=r"eval_data X rows have shape \(5,\)"):
        fp.run(FEDAVG, MODEL, fed, rounds=1, progress=False, eval_data=(np.zeros((4, 5)), np.zeros(4)))
    with pytest.raises(ValueError, match=r"eval_data y rows have shape \(2,\)"):
        fp.run(FEDAVG, MODEL, fed, rounds=1, progress=False, eval_data=(np.zeros((4, 3)), np.zeros((4, 2))))


def _dense_check_problem(monkeypatch):
    """The 410-parameter softmax regression on two clients, with the device shrunk to 512 KiB."""
    from fedprob.inference import dense_check
    assert dense_check.device_memory_bytes() > 2 ** 30
    monkeypatch.setattr(dense_check, "device_memory_bytes", lambda: 2 ** 19)
    rng = np.random.default_rng(1)
    X = rng.normal(size=(60, 40)).astype(np.float32)
    fed = fp.data.FederatedData.from_clients([(X[:30], rng.integers(0, 10, 30)), (X[30:], rng.integers(0, 10, 30))],
                                             num_classes=10)
    return fed, fp.models.softmax_regression(10)


DENSE_LAPLACE_REFUSED = (r"Laplace\(hessian='full'\) on 410 parameters builds a 410 x 410 matrix "
                         r"per client \(0.6 MiB\), more than this device.s memory \(0.5 MiB\)"
                         r".*Laplace\(hessian='diag_ggn'\)")


def _dense_curvatures_are_refused(fed, model):
    """A dense Laplace curvature and a dense preconditioner over the (shrunk) device are refused by fp.run."""
    with pytest.raises(ValueError, match=DENSE_LAPLACE_REFUSED):
        fp.run(fp.algorithms.EPMCMC(client=fp.inference.Laplace()), model, fed, progress=False)
    with pytest.raises(ValueError, match=r"precondition='full' on 410 parameters.*precondition='diag'"):
        fp.run(fp.algorithms.ConsensusMC(client=fp.inference.SGLD(precondition="full")), model, fed,
               progress=False)


def test_a_dense_curvature_larger_than_the_device_is_refused_before_compiling_backend(monkeypatch):
    """The default-run version of test_a_dense_curvature_larger_than_the_device_is_refused_before_compiling
    (slow): the same two refusals through fp.run, same model, data and shrunk device; the diagonal
    curvature under the same limit runs as the Laplace backend itself, the two clients vmapped in one
    compiled program (fp.run traces the client twice and compiles its round: 10 s against 4 s here)."""
    import jax
    import jax.numpy as jnp
    from fedprob.potential import Potential, make_target

    fed, model = _dense_check_problem(monkeypatch)
    _dense_curvatures_are_refused(fed, model)
    pot = Potential(model, fed.X[0], fed.y[0])
    assert pot.dim == 410
    targets = jax.vmap(lambda d: make_target(d, pot.dim))(fed.client_data())
    lap = fp.inference.Laplace(hessian="diag_ggn")
    res = jax.jit(lambda k, t, z: lap.run_clients(k, pot, t, z))(jax.random.PRNGKey(0), targets,
                                                                  jnp.zeros((2, pot.dim)))
    assert np.all(np.isfinite(np.asarray(res.posterior.mean())))
    assert np.all(np.asarray(res.posterior.precision) > 0) and np.asarray(res.posterior.precision).shape == (2, 410)


@pytest.mark.slow   # about 10 s: fp.run on 410 parameters; the default run has the _backend version
def test_a_dense_curvature_larger_than_the_device_is_refused_before_compiling(monkeypatch):
    """Laplace(hessian='full') on a 178,110-weight network asked XLA for 1,268,926,884,000 bytes and failed with
    RESOURCE_EXHAUSTED after compiling; a (d, d) matrix over the device's memory is now refused at trace time,
    naming the setting, the size and the diagonal alternative (the device here shrunk to 512 KiB so that 410
    parameters exceed it: 410^2 float32 is 656 KiB). A diagonal curvature under the same limit runs."""
    fed, model = _dense_check_problem(monkeypatch)
    _dense_curvatures_are_refused(fed, model)
    with warnings.catch_warnings():             # the diagonal product's own check may warn on these rows
        warnings.simplefilter("ignore")
        r = fp.run(fp.algorithms.EPMCMC(client=fp.inference.Laplace(hessian="diag_ggn")), model, fed,
                   progress=False)
    assert np.all(np.isfinite(np.asarray(r.posterior.form.mean())))
