"""The sharded engine over two JAX processes (``jax.distributed`` on 127.0.0.1, 2 host devices
each, 4 in the clients mesh) gives, on both processes, the single-process answer."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import fedprob as fp

from conftest import linreg_federation, linreg_model

WORKER = r"""
import os, sys, json, tempfile
pid, port, tests, names = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split(",")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
import jax
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
sys.path.insert(0, tests)
import fedprob as fp
from test_multihost import CASES, federation, summary
from conftest import linreg_model
fed = federation()
out = {"process": jax.process_index(), "devices": jax.device_count(), "local": jax.local_device_count()}
for name in names:
    algo, kw = CASES[name]()
    out[name] = summary(fp.run(algo, linreg_model(), fed, progress=False, **kw))
try:
    fp.run(algo, linreg_model(), fed, progress=False, checkpoint=fp.Checkpoint(tempfile.mkdtemp()), **kw)
except ValueError as e:
    out["checkpoint_refused"] = str(e)
print(json.dumps(out))
"""

CASES = {
    "epmcmc_laplace": lambda: (fp.algorithms.EPMCMC(client=fp.inference.Laplace()), {}),
    "consensus_sgld": lambda: (fp.algorithms.ConsensusMC(client=fp.inference.SGLD(batch_size=8)), {}),
    # 6 participants padded to 8 over the 4 devices; evaluated every round (client states gathered)
    "pvi_laplace": lambda: (fp.algorithms.PVI(client=fp.inference.Laplace()),
                            {"rounds": 3, "clients_per_round": 6, "eval_data": eval_data()}),
}


def eval_data():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 3)).astype(np.float32)
    return X, (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=40)).astype(np.float32)


def federation():
    """8 clients of a 3-weight linear regression: sharded 2 per device over the 4 devices."""
    return linreg_federation(320, 8)


def summary(r):
    return {"mean": np.asarray(r.posterior.mean["w"]).tolist(), "engine": r.info["engine"],
            "devices": len(r.info["devices"]), "participants": [h["participants"] for h in r.history],
            "server_update_ok": [h["server_update_ok"] for h in r.history],
            "rmse": [h.get("rmse") for h in r.history],
            "clients": [np.asarray(a).tolist() for a in jax.tree_util.tree_leaves(r.client_states)
                        if np.asarray(a).dtype.kind == "f"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(names, timeout=280):
    """Both processes' JSON outputs; both are killed when one fails or the time runs out."""
    tests, port = str(Path(__file__).parent), str(_free_port())
    # the suite's XLA options (tests/conftest.py: compile at level 0) kept, two host devices added
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), port, tests, ",".join(names)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0, se[-3000:]
    return [json.loads(so.strip().splitlines()[-1]) for so, _ in outs]


def check(names):
    outs = run_two_processes(names)
    assert [o["process"] for o in outs] == [0, 1]
    assert all(o["devices"] == 4 and o["local"] == 2 for o in outs)
    fed = federation()
    for name in names:
        a, b = outs[0][name], outs[1][name]
        assert a == b, f"{name}: the two processes disagree"           # identical, bit for bit
        assert a["engine"] == "sharded" and a["devices"] == 4
        algo, kw = CASES[name]()
        one = summary(fp.run(algo, linreg_model(), fed, progress=False, **kw))
        assert a["participants"] == one["participants"] and a["server_update_ok"] == one["server_update_ok"]
        # float reassociation over devices only: posterior means to 1e-5, client states to 1e-4
        np.testing.assert_allclose(a["mean"], one["mean"], rtol=1e-5, atol=1e-5, err_msg=name)
        assert (a["rmse"][-1] is None) == (one["rmse"][-1] is None)
        if one["rmse"][-1] is not None:
            np.testing.assert_allclose(a["rmse"], one["rmse"], rtol=1e-5, err_msg=name)
        for x, y in zip(a["clients"], one["clients"]):    # PVI sites: differences of natural parameters
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(a["mean"], [1.0, -2.0, 0.5], atol=0.1, err_msg=name)
    assert all("several JAX processes" in o["checkpoint_refused"] for o in outs)


@pytest.mark.processes    # two JAX processes at once
def test_two_processes_give_the_single_process_epmcmc_product():
    check(["epmcmc_laplace"])


@pytest.mark.slow
@pytest.mark.processes
def test_two_processes_give_the_single_process_answers():
    check(["epmcmc_laplace", "consensus_sgld", "pvi_laplace"])
