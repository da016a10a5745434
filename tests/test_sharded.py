"""The sharded local engine gives the single-device answer (4 host devices, in a subprocess)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import os, sys, json
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
import jax, numpy as np, fedprob as fp
sys.path.insert(0, sys.argv[1])
from conftest import linreg_model
rng = np.random.default_rng(0)
X = rng.normal(size=(300, 3)).astype(np.float32)
y = (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=300)).astype(np.float32)
fed = fp.data.partition(X, y, num_clients=6, scheme="iid", seed=0)
out = {}
cases = {"epmcmc": (fp.algorithms.EPMCMC(client=fp.inference.Laplace()), {}),
         "fedavg": (fp.algorithms.FedAvg(local_steps=5, batch_size=8, learning_rate=0.01),
                    {"rounds": 3, "clients_per_round": 5, "faults": fp.Faults(stragglers=0.4)})}
for name, (algo, kw) in cases.items():
    chunk = 2 if name == "fedavg" else None
    one = fp.run(algo, linreg_model(), fed, progress=False,
                 engine=fp.engine.Local(devices=jax.devices()[:1], client_chunk=chunk), **kw)
    four = fp.run(algo, linreg_model(), fed, progress=False, engine=fp.engine.Local(client_chunk=chunk), **kw)
    out[name] = {"one": np.asarray(one.posterior.mean["w"]).tolist(),
                 "four": np.asarray(four.posterior.mean["w"]).tolist(),
                 "engine": four.info["engine"], "devices": len(four.info["devices"]),
                 "participants": [h["participants"] for h in four.history] == [h["participants"] for h in one.history],
                 "stragglers": [(h["stragglers"], h["straggler_steps"]) for h in four.history]
                 == [(h["stragglers"], h["straggler_steps"]) for h in one.history],
                 "truncated": sum(s > 0 for h in four.history for s in h["straggler_steps"])}
print(json.dumps(out))
"""


@pytest.mark.processes    # one process whose 4 host devices compute at once
def test_sharded_engine_matches_one_device():
    tests = str(Path(__file__).parent)
    # the suite's XLA options (tests/conftest.py: compile at level 0) kept, four host devices added
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env = dict(os.environ, XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tests], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["engine"] == "sharded" and r["devices"] == 4, name
        assert r["participants"] and r["stragglers"], name
        np.testing.assert_allclose(r["four"], r["one"], rtol=1e-5, atol=1e-6, err_msg=name)
    assert out["fedavg"]["truncated"] > 0          # partial updates of truncated stragglers, sharded
    # EP-MCMC with Laplace clients is the conjugate product: close to the data's regression weights
    np.testing.assert_allclose(out["epmcmc"]["one"], [1.0, -2.0, 0.5], atol=0.1)


import numpy as np  # noqa: E402
