"""Client phases shared between one-round methods, and progress reported from inside chains."""
import jax
import numpy as np

import fedprob as fp
from fedprob import progress
from fedprob.engine import client_phase, local
from fedprob.potential import make_target
from fedprob.run import get_potential

from conftest import linreg_model


def _fed(K=3, n=40, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(K * n, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=K * n)).astype(np.float32)
    return fp.data.partition(X, y, num_clients=K, scheme="iid", seed=seed)


# the chains' statistics do not matter here, only their progress reports and compiled programs: without
# the (default, on 3 parameters) Laplace preconditioner and control variate the program is a third the size
SGLD = fp.inference.SGLD(num_burnin=100, num_samples=20, thinning=2, batch_size=8, target_ess=0, precondition=None)
LAPLACE = fp.inference.Laplace()


def test_client_phase_is_compiled_once_and_matches_the_fused_round():
    fed, model = _fed(), linreg_model()
    client_phase.clear_cache()
    r_pb = fp.run(fp.algorithms.PredictiveBayes(client=LAPLACE), model, fed, progress=False)
    r_en = fp.run(fp.algorithms.Ensemble(client=LAPLACE), model, fed, progress=False)
    assert r_pb.info["client_phase_compile_s"] > 0
    assert r_en.info["client_phase_compile_s"] == 0.0          # shared with PredictiveBayes
    assert client_phase.COMPILE_COUNT["phase"] == 1
    # the engine running Ensemble.client_update itself (client phase fused into the round)
    algo, ctx, data = fp.algorithms.Ensemble(client=LAPLACE), r_en.context, fed.client_data()
    k_init, k_rounds = jax.random.split(jax.random.PRNGKey(0))
    server, clients = algo.init(ctx, k_init, data)
    fused = jax.jit(local.make_round_fn(algo, ctx, fed.num_clients))
    server, _, _ = fused(server, clients, data, jax.random.fold_in(k_rounds, 0))
    leaves = jax.tree_util.tree_leaves
    for a, b, c in zip(leaves(server.messages), leaves(r_en.server_state.messages),
                       leaves(r_pb.server_state.messages)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    draws = [np.asarray(m) for m in leaves(r_en.server_state.messages) if np.ndim(m) == 3]
    assert draws and np.std(draws[0]) > 0                    # the clients' draws, not empty slots


def test_progress_reports_from_inside_a_chain():
    fed = _fed(K=1)
    pot = get_potential(linreg_model(), fed)
    target = make_target(jax.tree_util.tree_map(lambda a: a[0], fed.client_data()), pot.dim)
    run = jax.jit(lambda k: SGLD.run(k, pot, target).posterior.draws)
    with progress.phase("test", enabled=False) as ph:
        jax.block_until_ready(run(jax.random.PRNGKey(0)))
    assert ph.shown == ph.total > 100                        # the chain reached its end, counted in steps
    assert 10 <= ph.reports <= 2 * progress.REPORTS          # coarse: not one report per step
    with progress.phase("two groups", groups=2, enabled=False) as ph:
        jax.block_until_ready(run(jax.random.PRNGKey(0)))
        assert 0.4 * ph.total <= ph.shown <= 0.5 * ph.total  # the first of two sequential groups
        jax.block_until_ready(run(jax.random.PRNGKey(1)))
    assert ph.shown == ph.total


def test_phase_without_progress_has_no_host_calls_and_the_same_draws():
    """progress=False compiles the client phase without the chains' reports (no host call, so
    JAX's persistent cache can store it); the draws are those of the phase with reports, bit
    for bit, and the two are cached apart."""
    fed, model = _fed(), linreg_model()
    algo = fp.algorithms.Ensemble(client=SGLD)
    client_phase.clear_cache()
    quiet = fp.run(algo, model, fed, progress=False)
    shown = fp.run(algo, model, fed, progress=True)
    assert client_phase.COMPILE_COUNT["phase"] == 2
    for a, b in zip(jax.tree_util.tree_leaves(quiet.server_state), jax.tree_util.tree_leaves(shown.server_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    texts, fns = {}, {}
    ctx, data = quiet.context, fed.client_data()
    keys = jax.random.split(jax.random.PRNGKey(0), fed.num_clients)
    for reports in (False, True):
        fn, dt = client_phase.compiled_phase(algo, ctx, data, keys, jax.random.PRNGKey(1), None, reports)
        assert dt == 0.0                                         # compiled by the runs above
        texts[reports], fns[reports] = fn.as_text(), fn
    assert "callback" not in texts[False] and "callback" in texts[True]
    # the quiet phase was traced under progress.tracing(False): run, it reports nothing (the phase
    # traced with reports does, as a control); the programs compiled above, so nothing compiles here
    reports = {}
    for shown in (False, True):
        with progress.phase("quiet", enabled=False) as ph:
            jax.block_until_ready(fns[shown](data, keys, jax.random.PRNGKey(1)))
        reports[shown] = ph.reports
    assert reports[False] == 0 and reports[True] > 0
