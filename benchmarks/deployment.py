"""fedprob on Flower's Deployment Engine beside the local engine: per-round cost, start-up apart.

The digits data set over 6 clients (iid), softmax regression, PVI for
``--rounds`` rounds, seed 0, the same configuration three ways:

* ``local``: ``fp.run`` with the local engine (vmap over the 6 clients);
* ``deployment``: a SuperLink (TLS, SuperNode authentication) and 6
  SuperNodes as separate processes on this machine
  (:class:`fedprob.flower.local.LocalFederation`), each SuperNode with
  fedprob's long-lived worker (``fedprob flower supernode``: the client
  update compiled once per node and kept across rounds), the app submitted
  with ``flwr run``;
* ``deployment, Flower's SuperNodes``: the same with plain
  ``flower-supernode`` processes (Flower starts a ClientApp process per
  message, which imports JAX and compiles the client update every round).

Both deployments poll promptly on the server (:class:`fedprob.flower.polling.PromptGrid`);
fedprob's nodes also shorten the SuperNode's 3 s idle wait to 0.2 s, Flower's
plain SuperNodes keep it.

Reported: start-up (processes up and nodes online; the server's set-up:
the nodes' query and the initial states), the first round, the median of
the later rounds, the ratio of that median to the local engine's, and the
largest difference of the posterior means from the local engine's.

SecAgg+ quantization: EP-MCMC(client=Laplace()) on the conjugate linear
regression oracle (3 clients): each client's natural parameters are scaled
by a public power of two into SecAgg+'s clipping range, quantized with
Flower's own ``quantize`` (``flwr.common.secure_aggregation.quantization``;
SecAgg+'s defaults: clipping range 8, quantization range 2^22), summed as
integers and dequantized; the relative error against the exact sum, over
``--repeats`` draws of Flower's stochastic rounding.

Writes ``benchmarks/results/deployment.{json,md}`` unless ``--quick``.

    python benchmarks/deployment.py            # 5 rounds, both deployments
    python benchmarks/deployment.py --quick    # 3 rounds, fedprob's nodes only, writes nothing
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import fedprob as fp
from fedprob import config as C


SUMMED = ("linear", "precision")     # the natural parameters of EP-MCMC's summing message
CONFIG = {"data": {"name": "digits"}, "partition": {"num_clients": 6, "scheme": "iid", "seed": 0},
          "model": {"name": "softmax_regression"}, "algorithm": {"name": "PVI"}}


def local_run(cfg):
    algo, model, fed, test, kw = C.build(cfg)
    kw.pop("engine", None)
    t = time.perf_counter()
    res = fp.run(algo, model, fed, progress=False, **kw)
    wall = time.perf_counter() - t
    times = [h["time"] for h in res.history]
    return res, {"wall_s": wall, "compile_s": float(res.compile_time), "first_round_s": times[0],
                 "later_round_s": float(np.median(times[1:])), "round_s": times}


def deployment_run(cfg, work: Path, worker: bool):
    from fedprob.flower.appdir import write_app
    from fedprob.flower.local import LocalFederation
    from fedprob.flower_cli import split

    paths = split(cfg, work / "data")
    app = write_app(dict(cfg, flower={"num_nodes": len(paths), "evaluate": False}), work / "app", work / "run",
                    force=True)
    t0 = time.perf_counter()
    with LocalFederation(work / "federation", paths, timeout=180, worker=worker) as f:
        f.wait_online(len(paths), timeout=180)
        startup = time.perf_counter() - t0
        t = time.perf_counter()
        f.run(app, timeout=1200)
        wall = time.perf_counter() - t
    dep = json.loads((work / "run" / "deployment.json").read_text())
    post = np.load(work / "run" / "posterior.npz")
    times = dep["round_s"]
    return post, {"processes_up_s": startup, "setup_s": dep["setup_s"], "flwr_run_wall_s": wall,
                  "first_round_s": times[0], "later_round_s": float(np.median(times[1:])), "round_s": times,
                  "node_compute_s": dep["node_compute_s"],
                  "later_node_compute_s": float(np.median(dep["node_compute_s"][1:])),
                  "kb_sent_per_round": float(np.mean(dep["bytes_sent"])) / 1e3,
                  "kb_received_per_round": float(np.mean(dep["bytes_received"])) / 1e3}


def secagg_quantization(repeats: int):
    import jax
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    from fedprob.engine import flower as fl_engine
    from fedprob.engine import local

    rng = np.random.default_rng(0)
    sizes = (40, 55, 55)
    X = rng.normal(size=(sum(sizes), 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=sum(sizes))).astype(np.float32)
    cuts = np.cumsum((0,) + sizes)
    fed = fp.data.FederatedData.from_clients([(X[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])])
    algo = fp.algorithms.EPMCMC(client=fp.inference.Laplace())
    model = fp.models.linear_regression(noise_scale=0.5, bias=False)
    ctx, data, (server, client0, key) = fl_engine.prepare(algo, model, fed)
    msgs = []
    for k in range(fed.num_clients):
        d = jax.tree_util.tree_map(lambda a: a[k], data)
        _, msg, _, _ = local.client_step(algo, ctx, server)((client0, d, jax.random.fold_in(key, k)))
        msgs.append([np.asarray(msg[1][name], np.float64) for name in SUMMED])   # (id, statistics)
    exact = [np.sum([m[i] for m in msgs], axis=0) for i in range(len(msgs[0]))]
    clip, qrange = 8.0, 2 ** 22
    biggest = max(float(np.max(np.abs(a))) for m in msgs for a in m)
    scale = 2.0 ** np.ceil(np.log2(biggest / clip))       # public: the clients' values fit [-clip, clip]
    errs = []
    for rep in range(repeats):
        np.random.seed(rep)                                 # Flower's stochastic rounding draws from np.random
        q = [quantize([a / scale for a in m], clip, qrange) for m in msgs]
        summed = [np.sum([qk[i].astype(np.int64) for qk in q], axis=0) for i in range(len(exact))]
        # the sum of K dequantized values: dequantize shifts by -clip once per client
        deq = [(dequantize([s], clip, qrange)[0] - (len(msgs) - 1) * clip) * scale for s in summed]
        errs.append(max(float(np.max(np.abs(d - e)) / np.max(np.abs(e))) for d, e in zip(deq, exact)))
    return {"summed": {n: list(a.shape) for n, a in zip(SUMMED, msgs[0])}, "largest_value": biggest, "scale": float(scale),
            "clipping_range": clip, "quantization_range": qrange, "repeats": repeats,
            "max_relative_error": float(max(errs)), "median_relative_error": float(np.median(errs))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    cfg = dict(CONFIG, run={"rounds": rounds, "seed": 0})
    res, loc = local_run(cfg)
    out = {"config": cfg, "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                                      "flwr": __import__("flwr").__version__}, "local": loc}
    kinds = [("deployment", cfg, True, res, loc)]
    if not args.quick:
        kinds.append(("deployment_flower_supernodes", cfg, False, res, loc))
        two = dict(cfg, partition=dict(cfg["partition"], num_clients=2))
        res2, loc2 = local_run(two)
        out["local_2_clients"] = loc2
        kinds.append(("deployment_2_clients", two, True, res2, loc2))
    for name, c, worker, r, lo in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            post, dep = deployment_run(c, Path(tmp), worker)
        dep["later_round_over_local"] = dep["later_round_s"] / lo["later_round_s"]
        dep["max_abs_diff_mean"] = max(float(np.max(np.abs(post[f"mean/{k}"] - np.asarray(v))))
                                       for k, v in r.posterior.mean.items())
        out[name] = dep
        print(name, json.dumps(dep), flush=True)
    out["secagg_quantization"] = secagg_quantization(args.repeats)
    print(json.dumps(out["secagg_quantization"]))
    md = ["| engine | clients | start-up (s) | set-up (s) | first round (s) | later round, median (s) | "
          "of which node compute (s) | x local | max abs diff of the mean | kB sent / received per round |",
          "|---|---|---|---|---|---|---|---|---|---|",
          f"| local | 6 | - | - | {loc['first_round_s']:.2f} (compile {loc['compile_s']:.1f}) | "
          f"{loc['later_round_s']:.3f} | - | 1 | 0 | - |"]
    if "local_2_clients" in out:
        l2 = out["local_2_clients"]
        md.append(f"| local | 2 | - | - | {l2['first_round_s']:.2f} (compile {l2['compile_s']:.1f}) | "
                  f"{l2['later_round_s']:.3f} | - | 1 | 0 | - |")
    for name, c, *_ in kinds:
        d = out[name]
        label = {"deployment": "deployment, fedprob's nodes", "deployment_flower_supernodes":
                 "deployment, Flower's plain SuperNodes", "deployment_2_clients": "deployment, fedprob's nodes"}[name]
        md.append(f"| {label} | {c['partition']['num_clients']} | {d['processes_up_s']:.1f} | {d['setup_s']:.1f} | "
                  f"{d['first_round_s']:.2f} | {d['later_round_s']:.2f} | {d['later_node_compute_s']:.2f} | "
                  f"{d['later_round_over_local']:.1f} | {d['max_abs_diff_mean']:.1e} | "
                  f"{d['kb_sent_per_round']:.1f} / {d['kb_received_per_round']:.1f} |")
    q = out["secagg_quantization"]
    md += ["", "A round on the Deployment Engine is the nodes' compute plus Flower's own per-message work: "
               "Flower 1.41's SuperNode starts one `flwr-clientapp` process per message (it imports Flower and "
               "installs the app each time), and here all nodes share this machine's cores.",
           "", f"SecAgg+ quantization (Flower's quantize/dequantize, clipping range {q['clipping_range']}, "
               f"quantization range 2^22, public scale {q['scale']:g}): EP-MCMC(Laplace) natural parameters "
               f"summed over 3 clients, max relative error {q['max_relative_error']:.1e} over {q['repeats']} "
               f"draws of the stochastic rounding."]
    text = "\n".join(md) + "\n"
    print(text)
    if not args.quick:
        res_dir = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
        (res_dir / "deployment.json").write_text(json.dumps(out, indent=1))
        (res_dir / "deployment.md").write_text(
            "# Deployment Engine beside the local engine (digits, softmax regression, PVI)\n\n"
            f"{platform.machine()}, {out['machine']['cpus']} CPU cores, Flower {out['machine']['flwr']}; "
            f"{rounds} rounds.\n\n" + text)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
