"""The diagonal GGN of a network, and a FedLap-Cov round beside a FedAvg round.

Part 1, one client (the largest of the Fashion-MNIST federation of benchmarks/dual.py: 2,555 rows,
MLP (200, 100) with sigmoid units, 178,110 weights, 10 classes), at a fixed point ``z``, the
likelihood part of the diagonal GGN ``sum_i diag(J_i' H_i J_i)`` three ways, each compiled first and
timed (best of ``--repeats``):

* ``jacobians``: each row's (10, d) Jacobian by reverse passes, then ``sum J * (H J)`` (written here:
  the route the library took before, and the obvious one);
* ``exact``: ``fedprob.inference.laplace.ggn_likelihood`` with ``fisher_samples=0``: one reverse pass per
  row and output with the columns of a square root of ``H_i`` as cotangents, no Jacobian formed;
* ``fisher``: the Monte Carlo Fisher (``fisher_samples=1``, the default for this network: a row's
  Jacobian has more than ``EXACT_GGN_MAX_JACOBIAN`` entries), one label per row drawn from the model's predictive, one reverse
  pass per row; its relative error against ``exact`` (median and 90th percentile over the weights
  with the largest 90% of the curvature).

Part 2, the federation of 10 clients: ``FedLapCov`` (Adam 1e-3, minibatches of 32, 5 local epochs,
as in dual.py) at its default curvature (and with ``fisher_samples=0``, each client alone) beside
``FedAvg`` with the same local steps: seconds per round after the first (median), each client alone
(``Local(client_chunk=1)``, as dual.py runs FedLap-Cov) and vmapped (the default engine: every client
pays for the largest one's rows: ``client_chunk`` = the clients; with none given, FedLap-Cov's
clients of this network run one at a time), and test accuracy at the posterior mean after the rounds.

    python benchmarks/network_curvature.py           # writes benchmarks/results/network_curvature.{json,md}
    python benchmarks/network_curvature.py --quick   # digits, an MLP (32,), small sizes; writes nothing
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import destination, write_results  # noqa: E402
import fedprob as fp                                            # noqa: E402
from fedprob.inference.laplace import ggn_likelihood, natural_parameters  # noqa: E402
from fedprob.metrics import classification_metrics             # noqa: E402
from fedprob.potential import get_potential, make_target, minibatch  # noqa: E402


def jacobian_route(potential, z, X, y, w, chunk: int = 32):
    """The diagonal GGN from per-row Jacobians (c, M, d) per chunk of rows."""
    n = y.shape[0]
    pad = -n % chunk
    X = jnp.concatenate([X, jnp.repeat(X[:1], pad, 0)])
    y = jnp.concatenate([y, jnp.repeat(y[:1], pad, 0)])
    w = jnp.concatenate([w, jnp.zeros((pad,), w.dtype)])

    def eta_row(zz, x):
        return natural_parameters(potential.predictive_distribution(zz, x[None]))[0][0]

    def one(acc, b):
        Xb, yb, wb = b
        eta, build = natural_parameters(potential.predictive_distribution(z, Xb))
        J = jax.vmap(lambda x: jax.jacrev(eta_row)(z, x))(Xb)
        H = jax.vmap(jax.hessian(lambda e, t: -jnp.sum(build(e[None]).log_prob(t[None]))))(eta, yb)
        return acc + jnp.sum(J * (wb[:, None, None] * jnp.einsum("cab,cbd->cad", H, J)), axis=(0, 1)), None

    shaped = [a.reshape((-1, chunk) + a.shape[1:]) for a in (X, y, w)]
    return jax.lax.scan(one, jnp.zeros_like(z), tuple(shaped))[0]


def best_time(f, repeats):
    jax.block_until_ready(f())
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(f())
        ts.append(time.perf_counter() - t)
    return min(ts), out


def federation(quick: bool, root):
    if quick:
        ds = fp.data.load_digits(seed=0)
        fed = fp.data.partition(*ds.train, num_clients=4, scheme="dirichlet", alpha=0.5, seed=0)
        return fed, ds.test, fp.models.bnn_mlp((32,), num_classes=10, activation="sigmoid", prior_scale=1.0)
    from dual import fmnist_split

    fed, test = fmnist_split(root)
    return fed, test, fp.models.bnn_mlp((200, 100), num_classes=10, activation="sigmoid", prior_scale=1.0)


def part_one(fed, model, repeats):
    pot = get_potential(model, fed)
    k = int(np.argmax(fed.sizes))
    data = jax.tree_util.tree_map(lambda a: a[k], fed.client_data())
    X, y, w = minibatch(None, make_target(data, pot.dim).data, None)
    w = w.astype(jnp.float32)
    z = 0.3 * pot.init(jax.random.PRNGKey(0))
    routes = {
        "jacobians": jax.jit(lambda z: jacobian_route(pot, z, X, y, w)),
        "exact": jax.jit(lambda z: ggn_likelihood(pot, z, X, y, w, True, 32, 0, jax.random.PRNGKey(1))),
        "fisher": jax.jit(lambda z: ggn_likelihood(pot, z, X, y, w, True, 32, 1, jax.random.PRNGKey(1))),
    }
    times, outs = {}, {}
    for name, f in routes.items():
        times[name], outs[name] = best_time(lambda: f(z), repeats)
    ex = np.asarray(outs["exact"])
    big = ex > np.quantile(ex, 0.1)
    rel = np.abs(np.asarray(outs["fisher"]) - ex)[big] / ex[big]
    agree = float(np.max(np.abs(np.asarray(outs["jacobians"]) - ex) / np.maximum(ex, 1e-12 * ex.max())))
    return {"rows": int(fed.sizes[k]), "dim": int(pot.dim), "seconds": times,
            "jacobians_over_exact": times["jacobians"] / times["exact"],
            "jacobians_over_fisher": times["jacobians"] / times["fisher"],
            "exact_vs_jacobians_max_rel": agree,
            "fisher_rel_err_median": float(np.median(rel)), "fisher_rel_err_p90": float(np.quantile(rel, 0.9))}


def part_two(fed, test, model, rounds, epochs, quick=False):
    steps = max(1, int(round(epochs * 600 / 32)))
    adam = dict(optimizer="adam", learning_rate=1e-3, batch_size=32, num_steps=steps)
    methods = {"FedAvg": fp.algorithms.FedAvg(client_optimizer="adam", learning_rate=1e-3, batch_size=32,
                                              local_epochs=epochs),
               "FedLapCov": fp.algorithms.FedLapCov(**adam),
               "FedLapCov(fisher_samples=0)": fp.algorithms.FedLapCov(fisher_samples=0, **adam)}
    if quick:       # the small network's default is exact: the quick run draws labels, each client alone
        methods = {"FedAvg": methods["FedAvg"], "FedLapCov(fisher_samples=1)": fp.algorithms.FedLapCov(
            fisher_samples=1, **adam)}
    rows = []
    for name, algo in methods.items():
        for chunk in ((1,) if "fisher_samples" in name else (1, None)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = fp.run(algo, model, fed, rounds=rounds, progress=False,
                             engine=fp.engine.Local(client_chunk=chunk or fed.num_clients))
            post = res.posterior
            pred = "mean" if isinstance(post.form, fp.Gaussian) else None
            acc = classification_metrics(np.asarray(post.predict(test[0], prediction=pred)), test[1])["accuracy"]
            rows.append({"method": name, "engine": "one client at a time" if chunk == 1 else "vmapped",
                         "round_s": statistics.median(h["time"] for h in res.history[1:]),
                         "compile_s": float(res.compile_time), "accuracy_at_mean": float(acc)})
    base = {r["engine"]: r["round_s"] for r in rows if r["method"] == "FedAvg"}
    for r in rows:
        r["over_fedavg"] = r["round_s"] / base[r["engine"]]
    return {"rounds": rounds, "local_epochs": epochs, "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--data", default=None, help="the data folder (default ../shared/data or FEDPROB_DATA)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (quick 2)")
    p.add_argument("--repeats", type=int, default=None, help="default 2 (quick 1)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    repeats = args.repeats or (1 if args.quick else 2)
    root = None
    if not args.quick:
        from dual import find_data_root

        root = find_data_root(args.data)
    fed, test, model = federation(args.quick, root)
    one = part_one(fed, model, repeats)
    two = part_two(fed, test, model, rounds, 1.0 if args.quick else 5.0, args.quick)
    meta = {"backend": jax.default_backend(), "devices": str(jax.devices()), "python": platform.python_version(),
            "jax": jax.__version__, "quick": args.quick}
    s = one["seconds"]
    md = ["# The diagonal GGN of a network; a FedLap-Cov round beside a FedAvg round", "",
          f"## One client: {one['rows']} rows, {one['dim']} weights, 10 classes (best of {repeats})", "",
          "| route | seconds | per-row Jacobians / route |", "|---|---|---|",
          f"| per-row Jacobians (before) | {s['jacobians']:.2f} | 1.0 |",
          f"| exact, one reverse pass per row and class | {s['exact']:.2f} | {one['jacobians_over_exact']:.1f} |",
          f"| Monte Carlo Fisher, one label per row | {s['fisher']:.2f} | "
          f"{one['jacobians_over_fisher']:.1f} |", "",
          f"Exact route against the Jacobians: largest relative difference {one['exact_vs_jacobians_max_rel']:.1e}. "
          f"Monte Carlo Fisher against the exact diagonal: relative error median {one['fisher_rel_err_median']:.3f}, "
          f"90th percentile {one['fisher_rel_err_p90']:.3f} (weights with the largest 90% of the curvature).", "",
          f"## The federation: seconds per round after the first (median of {rounds - 1}), "
          f"{two['local_epochs']:g} local epochs", "",
          "| method | engine | s / round | / FedAvg round | compile s | accuracy at the mean |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['method']} | {r['engine']} | {r['round_s']:.2f} | {r['over_fedavg']:.2f} | {r['compile_s']:.1f} "
           f"| {r['accuracy_at_mean']:.3f} |" for r in two["rows"]]
    md += ["", "```", json.dumps(meta), "```"]
    print("\n".join(md))
    out = {"one_client": one, "federation": two, "meta": meta}
    write_results(destination(args.out, args.quick), "network_curvature", out, md)
    return out


if __name__ == "__main__":
    main()
