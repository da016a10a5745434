"""fp.run's own overhead: a whole run against the sampler steps it drives.

One client holds the digits training rows (softmax regression, 650
parameters); ``ConsensusMC(client=SGHMC(num_burnin=B, num_samples=S,
thinning=T, batch_size=32, target_ess=0))`` runs B + S T gradient steps (no
ESS stretch, so the step count is fixed). Measured side by side in one
process, after compiling, best and median of ``--repeats``:

* ``floor``: ``lax.scan`` of the same number of minibatch gradient steps plus
  one N(0, I) draw each (benchmarks/floor.py), the least any noise-injecting
  sampler can cost;
* ``client phase``: the SGHMC chain as ``fp.run`` runs it (``result.info``);
* ``messages``: the round after its client phase (each client's Stein fit,
  the draws mapped onto it, ESS, the message, the server's sums);
* ``run``: ``fp.run`` end to end with ``eval_data`` (client phase, message,
  server update, posterior with its Monte Carlo check, evaluation on the test
  rows, result).

Ratios: run / floor, run / client phase (the goal: aggregation, diagnostics
and evaluation under 15% of a run). Writes ``benchmarks/results/overhead.{json,md}``
unless ``--quick``.

    python benchmarks/overhead.py            # 20,000 steps, 5 repeats
    python benchmarks/overhead.py --quick    # 2,000 steps, 2 repeats, writes nothing
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import destination, write_results  # noqa: E402
import fedprob as fp                              # noqa: E402
from fedprob.data.loaders import load_digits      # noqa: E402
from fedprob.potential import get_potential, make_target  # noqa: E402
from floor import FLOOR, floor_scans              # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="gradient steps in all (default 20000; quick 2000)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    steps = args.steps or (2000 if args.quick else 20000)
    repeats = args.repeats or (2 if args.quick else 5)
    thinning, samples = 5, steps // 10
    burnin = steps - samples * thinning

    ds = load_digits()
    fed = fp.data.partition(ds.X_train, ds.y_train, num_clients=1, scheme="iid", seed=0)
    model = fp.models.softmax_regression(10)
    backend = fp.inference.SGHMC(num_burnin=burnin, num_samples=samples, thinning=thinning, batch_size=32,
                                 target_ess=0)
    algo = fp.algorithms.ConsensusMC(client=backend)
    evald = (ds.X_test, ds.y_test)

    pot = get_potential(model, fed)
    data = jax.tree_util.tree_map(lambda a: a[0], fed.client_data())
    target = make_target(data, pot.dim)
    floor = floor_scans(pot, 32, steps)[FLOOR]
    w0 = pot.init(jax.random.PRNGKey(0))

    def run_once(seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            res = fp.run(algo, model, fed, seed=seed, eval_data=evald, progress=False)
            return time.perf_counter() - t, res.info.get("client_phase_s", float("nan")), res

    def messages_s(res):        # the round after its client phase: Stein fits, messages, server sums
        return res.history[0]["time"] - res.info.get("client_phase_s", float("nan"))

    def floor_once(seed):
        t = time.perf_counter()
        jax.block_until_ready(floor(w0, target, jax.random.PRNGKey(seed)))
        return time.perf_counter() - t

    floor_once(0)
    run_once(0)                                   # compiles
    runs, phases, floors, msgs = [], [], [], []
    for i in range(repeats):                      # interleaved, so load swings hit both alike
        floors.append(floor_once(i + 1))
        t, ph, res = run_once(i + 1)
        runs.append(t)
        phases.append(ph)
        msgs.append(messages_s(res))
    stat = lambda a: {"best": float(np.min(a)), "median": float(np.median(a))}
    row = {"steps": steps, "repeats": repeats, "floor_s": stat(floors), "client_phase_s": stat(phases),
           "messages_s": stat(msgs),
           "run_s": stat(runs), "accuracy": float(res.history[-1].get("accuracy", float("nan")))}
    row["run_over_floor"] = row["run_s"]["best"] / row["floor_s"]["best"]
    row["run_over_client_phase"] = row["run_s"]["best"] / row["client_phase_s"]["best"]
    row["overhead_fraction"] = 1.0 - row["client_phase_s"]["best"] / row["run_s"]["best"]
    meta = {"backend": jax.default_backend(), "devices": str(jax.devices()), "python": platform.python_version(),
            "jax": jax.__version__, "quick": args.quick}
    md = ["# fp.run overhead: ConsensusMC(SGHMC), one client, softmax regression on digits", "",
          "| steps | floor s (grad + noise) | client phase s | fp.run s | run / floor | run / client phase "
          "| overhead fraction | of it: messages s | accuracy |", "|---|---|---|---|---|---|---|---|---|",
          f"| {steps} | {row['floor_s']['best']:.3f} | {row['client_phase_s']['best']:.3f} | "
          f"{row['run_s']['best']:.3f} | {row['run_over_floor']:.2f} | {row['run_over_client_phase']:.2f} | "
          f"{row['overhead_fraction']:.2f} | {row['messages_s']['best']:.3f} | {row['accuracy']:.3f} |", "",
          f"Best of {repeats} interleaved repeats after compiling (medians in overhead.json).", "",
          "What bounds the messages: each client's full-covariance Stein fit (two (S, d) x (d, d) products "
          "and two d x d eigendecompositions, which the moment-matched draws reuse), the fallback "
          "moment match, the draws' effective sample sizes; after the round, the combination's solve, "
          "its Monte Carlo check and the predictive over every draw on the test rows.", "",
          "```", json.dumps(meta), "```"]
    print("\n".join(md))
    out = {"row": row, "meta": meta}
    write_results(destination(args.out, args.quick), "overhead", out, md)
    return out


if __name__ == "__main__":
    main()
