"""Time to a first result: a small model, cold and warm, beside NUTS on the pooled rows.

The problem: Bayesian logistic regression with 3 features and a bias (4
parameters), 400 rows, iid over 4 clients, seed 0. Each row is one fresh
Python process (``import fedprob`` included in nothing: the clock starts
after the imports) with JAX's persistent compilation cache off, so "cold"
is what a first run costs: tracing and compiling included. "warm" is the
same call again in that process (compiled programs reused).

* ``NUTS (pooled rows)``: NumPyro's NUTS on all 400 rows, 1 chain, 500
  warm-up and 1000 draws (the reference the issue names: a first result
  from the pooled data);
* ``fp.run(...)`` of FedAvg (10 rounds), PVI (its default rounds), FedPA
  (10 rounds) and EPMCMC over NUTS clients (one round), ``progress=False``.

Writes ``benchmarks/results/first_result.{json,md}`` unless ``--quick``
(which runs only NUTS and FedAvg and writes nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, sys, time
import numpy as np
import jax
import numpyro, numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS
import fedprob as fp

which = sys.argv[1]
rng = np.random.default_rng(0)
X = rng.normal(size=(400, 3)).astype(np.float32)
y = (X @ np.array([1.0, -2.0, 0.5]) + rng.logistic(size=400) > 0).astype(np.int32)
model = fp.models.logistic_regression()


def once():
    if which == "nuts":
        mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=1000, num_chains=1, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(0), X, y)
        jax.block_until_ready(mcmc.get_samples())
        return
    fed = fp.data.partition(X, y, num_clients=4, seed=0)
    algo, rounds = {"fedavg": (fp.algorithms.FedAvg(), 10), "pvi": (fp.algorithms.PVI(), None),
                    "fedpa": (fp.algorithms.FedPA(), 10),
                    "epmcmc": (fp.algorithms.EPMCMC(client=fp.inference.NUTS()), 1)}[which]
    r = fp.run(algo, model, fed, rounds=rounds, seed=0, progress=False)
    jax.block_until_ready(r.posterior.flat_mean)


t = time.perf_counter(); once(); cold = time.perf_counter() - t
t = time.perf_counter(); once(); warm = time.perf_counter() - t
print(json.dumps({"cold_s": cold, "warm_s": warm}))
'''

ROWS = [("nuts", "NUTS (pooled rows), 500 warm-up + 1000 draws"), ("fedavg", "fp.run FedAvg, 10 rounds"),
        ("pvi", "fp.run PVI, default rounds"), ("fedpa", "fp.run FedPA, 10 rounds"),
        ("epmcmc", "fp.run EPMCMC(client=NUTS()), 1 round")]


def measure(which: str) -> dict:
    env = dict(os.environ, FEDPROB_COMPILATION_CACHE="off", JAX_ENABLE_COMPILATION_CACHE="false")
    out = subprocess.run([sys.executable, "-c", CHILD, which], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for which, label in ROWS[:2] if args.quick else ROWS:
        m = measure(which)
        rows.append({"run": label, "cold_s": round(m["cold_s"], 2), "warm_s": round(m["warm_s"], 3)})
        print(rows[-1], flush=True)
    nuts = rows[0]["cold_s"]
    for r in rows:
        r["cold / NUTS pooled"] = round(r["cold_s"] / nuts, 2)
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        res = Path(__file__).parent / "results"
        (res / "first_result.json").write_text(json.dumps(rows, indent=1))
        (res / "first_result.md").write_text(
            "# Time to a first result (4-parameter logistic regression, 400 rows, 4 clients)\n\n"
            "Each row a fresh process, JAX's compilation cache off; cold: the first call (compiling included), "
            "warm: the same call again. `python benchmarks/first_result.py`.\n\n" + table + "\n")
    return rows


if __name__ == "__main__":
    main()
