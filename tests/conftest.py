"""Shared fixtures: the data folder beside the checkout, and conjugate oracles."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

# The tests compile far more than they run: a federated run of a 3-parameter model compiles about 7 s of
# XLA programs (its client phase, its round, its Pareto k-hat check) and runs for a tenth of a second;
# compiling (tracing, lowering, XLA) was 76% of the suite's time. Two XLA options cut it:
# * backend optimisation level 0 (no LLVM optimisation): the cold run took 23.7 min instead of about 28;
# * the CPU backend's older elemental emitters instead of its MLIR fusion emitters
#   (--xla_cpu_use_fusion_emitters=false): half the XLA compile time of a round; test_ep.py and
#   test_psis.py took 151 s instead of 194 s on one core.
# (LLVM code generation in one piece, --xla_cpu_parallel_codegen_split_count=1, compiled four fp.runs' XLA
# programs 15% faster but changes the compiled numbers: a NUTS-client FedPA oracle at the edge of its
# tolerance fell outside it, 0.27 posterior sd against 0.25; benchmarks/results/test_suite.md.)
# Every test passes either way (runtime-heavy tests run slower, compile-heavy ones much faster). Set before
# JAX is imported, so xdist workers and the processes tests start (notebook kernels, Flower nodes) inherit
# them; FEDPROB_TEST_XLA_O0=0 compiles with XLA's defaults instead (an XLA_FLAGS that sets one of them keeps its own value).
# XLA aborts the process on a flag it does not know (the emitter option is absent from some jaxlib
# releases): the options are tried once in a child process (together, then one by one if that fails),
# and the outcome passed on to workers.
_PROBED = "FEDPROB_TEST_XLA_FLAGS_PROBED"


def _xla_accepts(flags: str) -> bool:
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return probe.returncode == 0


if os.environ.get("FEDPROB_TEST_XLA_O0", "1") != "0" and _PROBED not in os.environ:
    _flags = os.environ.get("XLA_FLAGS", "")
    _wanted = [f for f in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
               if f.split("=")[0] not in _flags]
    _all = " ".join([_flags] + _wanted).strip()
    if _wanted and _xla_accepts(_all):          # one child process where every option is known
        _flags = _all
    else:
        for _flag in _wanted:
            if _xla_accepts((_flags + " " + _flag).strip()):
                _flags = (_flags + " " + _flag).strip()
    os.environ["XLA_FLAGS"] = _flags
    os.environ[_PROBED] = "1"


# Each xdist worker runs on its own share of the CPUs (worker i of w: CPUs i, i + w, ...), so the workers'
# XLA thread pools (compiling and running) do not compete for every core: the default run took 28.9 minutes
# unpinned against 26.3 pinned on the same 2-core machine the same evening (a 4-file subset: 266 s against
# 243 s). A test marked `processes` starts processes that work at once (Flower's nodes, multi-host workers)
# or that time themselves (the first-result benchmark): it gets every CPU back while it runs, so its
# processes are not squeezed onto its worker's share (pinned, the Deployment Engine test took 222 s against
# 139 s, and the first result's cold fp.run / cold NUTS ratio rose to 2.19 against its bound of 2 on a
# clean-clone run). FEDPROB_TEST_PIN=0 leaves workers unpinned.
def _threads_affinity(cpus):
    """Set the CPU affinity of every thread of this process (Linux sets it per thread)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


_ALL_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
_WORKER_CPUS = None
if os.environ.get("FEDPROB_TEST_PIN", "1") != "0" and _ALL_CPUS \
        and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _index = int(os.environ["PYTEST_XDIST_WORKER"][2:])
    _count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if 1 < _count <= len(_ALL_CPUS):
        _WORKER_CPUS = set(_ALL_CPUS[_index % _count::_count])
        _threads_affinity(_WORKER_CPUS)


# Python's cyclic garbage collector at its default thresholds (700, 10, 10) took 42.5 of each worker's 477 CPU
# seconds in the default run (2026-12-02, 2 cores): about 19,000 young and 60 full collections, a full one 0.6 s
# over the 2 million objects a worker holds once JAX, NumPyro and the compiled programs are loaded, while
# tracing allocates millions of short-lived objects that reference counting frees. Collecting the young
# generation every 100,000 net allocations instead of 700, and the older ones as rarely: 6 to 9 s a worker,
# the run 9 min 31 s -> 8 min 31 s back to back (tests' times summed 1,101 s -> 989 s), the same peak
# memory. FEDPROB_TEST_GC=default keeps Python's thresholds.
if os.environ.get("FEDPROB_TEST_GC", "") != "default":
    import gc

    gc.set_threshold(100_000, 50, 100)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A `processes` test (its fixtures' processes included) runs on every CPU."""
    wide = _WORKER_CPUS is not None and item.get_closest_marker("processes") is not None
    if wide:
        _threads_affinity(set(_ALL_CPUS))
    try:
        yield
    finally:
        if wide:
            _threads_affinity(_WORKER_CPUS)


# A test that runs far longer than it compiles (samplers' defaults, EP with NUTS over many rounds) is marked
# `xla_optimized`: its programs are compiled at XLA's usual backend optimisation level (2), passed per compile
# beside the options above, so they run several times faster and the test takes less in all (one process, the
# same test marked and not: PredictiveBayes at its defaults on the digits 74.6 s -> 43.2 s, EP with NUTS on the
# normal-normal hierarchy 34.1 s -> 21.5 s; benchmarks/results/test_suite.md). Mark a test only where that
# was measured: compile-bound tests take longer. Programs already compiled in the worker are reused as they
# are. Without the private hook (another JAX release) the test runs unoptimised.
XLA_OPTIMIZED = {"xla_backend_optimization_level": 2}


@pytest.fixture(autouse=True)
def _xla_optimized(request):
    if request.node.get_closest_marker("xla_optimized") is None \
            or "--xla_backend_optimization_level=0" not in os.environ.get("XLA_FLAGS", ""):
        yield
        return
    try:
        from jax._src import compiler
        original = compiler.get_compile_options
    except (ImportError, AttributeError):
        yield
        return

    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        return original(*args, env_options_overrides={**XLA_OPTIMIZED, **dict(env_options_overrides or {})},
                        **kwargs)

    compiler.get_compile_options = get_compile_options
    try:
        yield
    finally:
        compiler.get_compile_options = original


def find_data_root():
    """../shared/data beside the checkout, or $FEDPROB_DATA; None when absent."""
    env = os.environ.get("FEDPROB_DATA")
    if env and Path(env).is_dir():
        return Path(env)
    here = Path(__file__).resolve().parents[1]
    cand = here.parent / "shared" / "data"
    return cand if cand.is_dir() else None


@pytest.fixture(scope="session")
def data_root():
    root = find_data_root()
    if root is None:
        pytest.skip("shared data folder not found (set FEDPROB_DATA or place ../shared/data beside the checkout)")
    return root


def linreg_exact_posterior(Xs, ys, sigma, prior_scale):
    """Exact N(mean, cov) of w for y = X w + N(0, sigma^2), w ~ N(0, prior_scale^2 I), pooled over clients."""
    d = Xs[0].shape[1]
    P = np.eye(d) / prior_scale ** 2
    b = np.zeros(d)
    for X, y in zip(Xs, ys):
        X = np.asarray(X, np.float64)
        P = P + X.T @ X / sigma ** 2
        b = b + X.T @ np.asarray(y, np.float64) / sigma ** 2
    cov = np.linalg.inv(P)
    return cov @ b, cov


def linreg_model(prior_scale=1.0, sigma=0.5):
    """The conjugate oracle: w ~ N(0, prior_scale^2 I), y ~ N(X w, sigma^2) in the "data" plate."""
    import numpyro
    import numpyro.distributions as dist

    def linreg(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)

    return linreg


def linreg_federation(num_rows, num_clients, seed=0):
    """``num_rows`` rows of y = X [1, -2, 0.5] + N(0, 0.5^2) (float32), split iid over the clients."""
    import fedprob as fp

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(num_rows, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=num_rows)).astype(np.float32)
    return fp.data.partition(X, y, num_clients=num_clients, scheme="iid", seed=0)


def padded_correlated_client(seed, n, n_max, w_true, sigma):
    """(X, y) with correlated features, padded to n_max rows; rows n: hold garbage that must not count."""
    rng = np.random.default_rng(seed)
    corr = np.array([[1.0, 0.7, 0.3], [0.7, 1.0, 0.5], [0.3, 0.5, 1.0]])
    X = rng.normal(size=(n_max, 3)) @ np.linalg.cholesky(corr).T
    y = X @ w_true + sigma * rng.normal(size=n_max)
    X[n:] = 7.0
    y[n:] = -30.0
    return X, y


# The default run hands whole files to its two workers (`--dist loadfile`), in collection order. xdist would
# order the files by their number of tests, which leaves the files of one or two long tests (real processes,
# benchmarks' quick runs) for last, so the run ended on one worker: 570 s against 526 s on the other (2 quiet
# cores, 2026-12-02). Instead the files go longest first, by their seconds in the default run as last measured
# (tests/file_seconds.json; a file missing from it counts as the median), the greedy schedule whose makespan
# for those times is 548 s on each worker. `FEDPROB_STORE_FILE_SECONDS=1 pytest -q` measures them again and
# rewrites the file (for the files that ran).
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _stored_seconds() -> dict:
    try:
        return json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):
        return {}


def pytest_collection_modifyitems(config, items):
    """The files longest first (see FILE_SECONDS); the tests of a file keep their order."""
    seconds = _stored_seconds()
    if not seconds:
        return
    default = float(np.median(list(seconds.values())))
    first = {}
    for i, item in enumerate(items):
        first.setdefault(_file_of(item.nodeid), i)
    items.sort(key=lambda item: (-seconds.get(_file_of(item.nodeid), default), first[_file_of(item.nodeid)]))


_measured_seconds = {}


def pytest_runtest_logreport(report):
    if os.environ.get("FEDPROB_STORE_FILE_SECONDS") == "1" and not os.environ.get("PYTEST_XDIST_WORKER"):
        f = _file_of(report.nodeid)
        _measured_seconds[f] = _measured_seconds.get(f, 0.0) + report.duration


def pytest_sessionfinish(session):
    if _measured_seconds and not os.environ.get("PYTEST_XDIST_WORKER"):
        seconds = _stored_seconds()
        seconds.update({f: round(s, 1) for f, s in _measured_seconds.items()})
        FILE_SECONDS.write_text(json.dumps(dict(sorted(seconds.items(), key=lambda kv: -kv[1])), indent=0) + "\n")


def pytest_configure(config):
    """Compiled programs go to JAX's persistent compilation cache under the pytest cache
    (``.pytest_cache/d/jax-compilation-cache``), so a second run loads what the first compiled;
    ``FEDPROB_COMPILATION_CACHE=off`` switches it off (see fedprob.compile_cache). The directory is passed
    on in ``FEDPROB_COMPILATION_CACHE``, so ``fedprob demo`` / ``fedprob run`` called by a test and the
    processes a test starts use it too."""
    if hasattr(config.option, "loadscopereorder"):     # pytest-xdist: keep the order above (FILE_SECONDS)
        config.option.loadscopereorder = False
    from fedprob import compile_cache

    cache = getattr(config, "cache", None)
    if cache is not None and compile_cache.cache_dir() is not None:
        path = compile_cache.enable(cache.mkdir("jax-compilation-cache"))
        # the same directory for `fedprob demo/run` called in a test and for the processes a test starts
        # (notebook kernels, Flower nodes, multi-host workers): nothing is written under the user's home
        os.environ[compile_cache.ENV] = str(path)


@pytest.fixture
def x64():
    """Double precision for the test (exact oracles), restored after it."""
    import jax

    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


def skip_khat_check():
    """A context manager in which ``fp.run`` skips its Pareto k-hat check (``psis.run_khats`` returns no
    k-hats), for tests that read neither ``khat``, ``diagnostics()`` nor the k-hat warning: on models of at
    most 100 parameters the check compiles the model's log densities at 2,000 draws over every row, seconds
    of a run that otherwise takes a few (a third of a 4,800-row logistic run)."""
    from unittest import mock

    return mock.patch("fedprob.psis.run_khats", lambda *a, **k: (None, None))
