"""FedPA against FedAvg: delta quality, client-update cost, synthetic and real-data rounds.

Run ``python benchmarks/fedpa.py`` (about 10 minutes on 2 CPU cores) or
``python benchmarks/fedpa.py --quick`` (CI size, under a minute; writes no
files). The full run writes ``benchmarks/results/fedpa.json`` and ``fedpa.md``.

(a) App. A of the paper: bias and variance of client deltas against the exact
    mean-scale delta ``A (theta - mu)`` on one least-squares client
    (``A`` the mean-loss Hessian, ``mu`` the client optimum), d = 10, 100,
    1000, as local steps and shrinkage vary. FedAvg: ``theta - w_T`` after T
    SGD steps. FedPA-IASG: the same T steps, the second half split into 10
    averaged windows, the DP delta with covariance scale ``n``. FedPA-exact:
    10 exact posterior draws (the shrinkage's own bias and variance).
    bias = ||E delta - exact|| / ||exact||, var = E||delta - E delta||^2 / ||exact||^2.
(b) Table 1: client-update time of FedAvg, FedPA-DP and FedPA with the dense
    solve at d = 100, 1K, 10K, 100K (a linear least-squares client, 64 rows,
    200 full-batch SGD steps, 10 draws); the dense solve only up to 1K in the
    full run (O(d^3): 10K would need a 400 MB matrix and minutes).
(c) Distance to the global optimum per round on 10 heterogeneous
    least-squares clients (d = 50, start at distance ~140 as in the authors'
    demo): FedAvg, the paper's FedPA (``family="diag"``) over IASG and over NUTS (exact local
    moments), and ``FedPA()`` at the library's defaults (d <= 100: full client covariances, the
    Newton server step, SGHMC clients).
(d) Real data with equal local computation per round (every client takes the
    same number of minibatch gradient steps): logistic regression on UCI
    Credit Approval (10 clients, Dirichlet 0.5 over labels) and a 784-100-10
    MLP on a 10,000-row subset of Fashion-MNIST (z-scored pixels, 10 clients,
    Dirichlet 0.5): accuracy and NLL per round, FedAvg vs FedAdam vs FedPA.
    Skipped cleanly when the data folder is absent.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import fedprob as fp
from fedprob.algorithms import fedpa_delta as dp
from fedprob.algorithms.fedpa import FedPA
from fedprob.engine import local

RESULTS = Path(__file__).resolve().parent / "results"
NUM_DRAWS = 10


# -- (a) bias and variance of the deltas -----------------------------------------------------------

def least_squares_client(d: int, n: int, seed: int, ridge: float = 0.01):
    """(X, y, A, mu): rows with covariance eigenvalues spread over [0.1, 1], mean loss with a ridge."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    ev = np.geomspace(0.1, 1.0, d)
    X = rng.normal(size=(n, d)) @ (Q * np.sqrt(ev)).T
    w = rng.normal(size=d)
    y = X @ w + rng.normal(size=n)
    A = X.T @ X / n + ridge * np.eye(d)
    mu = np.linalg.solve(A, X.T @ y / n)
    return X.astype(np.float32), y.astype(np.float32), A, mu


def _sgd_path(X, y, ridge, theta, key, lr, steps, batch, num_draws):
    """SGD on the mean loss from theta; returns (last iterate, mean of each of num_draws windows of the second half)."""
    n = X.shape[0]
    half = steps // 2
    K = max(half // num_draws, 1)

    def step(w, k):
        idx = jax.random.randint(k, (batch,), 0, n)
        g = X[idx].T @ (X[idx] @ w - y[idx]) / batch + ridge * w
        w = w - lr * g
        return w, w

    w, path = jax.lax.scan(step, theta, jax.random.split(key, steps))
    tail = path[steps - K * num_draws:].reshape(num_draws, K, -1).mean(1)
    return w, tail


def delta_bias_variance(dims=(10, 100, 1000), local_steps=(10, 100, 1000), rhos=("paper", None), reps=20,
                        quick=False, batch=10, ridge=0.01, window=5):
    """dims -> steps -> metrics (module docstring, (a)).

    T local steps give ``l = T / (2 window)`` draws (more local work, more draws, as in the paper);
    ``"paper"`` in rhos is the paper's fixed rho (0.01, 0.005, 0.001 for d = 10, 100, 1000), ``None``
    FedPA's default 1/(l-1).
    """
    out = {}
    for d in dims:
        n = 2 * d if d >= 100 else 200
        X, y, A, mu = least_squares_client(d, n, seed=d)
        # stable for minibatches too: the per-row curvature |x|^2 / batch bounds the step in high d
        lr = 0.5 / max(np.linalg.eigvalsh(A).max(), float(np.mean(np.sum(X.astype(np.float64) ** 2, 1))) / batch)
        theta = np.zeros(d, np.float32)
        exact = A @ (theta - mu)
        norm = np.linalg.norm(exact)
        keys = jax.random.split(jax.random.PRNGKey(d), reps)
        cov_post = np.linalg.inv(A * n)                    # the posterior at sum scale (temperature 1)
        Lc = np.linalg.cholesky(cov_post)
        out[d] = {}
        for T in local_steps:
            nd = max(1, T // (2 * window))
            exact_draws = mu + np.einsum("ij,rsj->rsi", Lc, np.random.default_rng(T).normal(size=(reps, nd, d)))
            run = jax.jit(jax.vmap(lambda k: _sgd_path(jnp.asarray(X), jnp.asarray(y), ridge, jnp.asarray(theta), k,
                                                       lr, T, batch, nd)))
            last, tails = run(keys)
            row = {"draws": nd}

            def stats(deltas):
                deltas = np.asarray(deltas, np.float64)
                m = deltas.mean(0)
                return (float(np.linalg.norm(m - exact) / norm),
                        float(np.mean(np.sum((deltas - m) ** 2, 1)) / norm ** 2))

            row["fedavg_bias"], row["fedavg_var"] = stats(theta - np.asarray(last))
            for rho in rhos:
                r = {None: 1.0 / max(nd - 1, 1), "paper": {10: 0.01, 100: 0.005, 1000: 0.001}.get(d, 0.01)}.get(rho, rho)
                tag = {None: "default", "paper": "paper"}.get(rho, rho)
                dl = jax.vmap(lambda t: dp.delta(t, jnp.asarray(theta), r, float(n)))(tails)
                b, v = stats(dl)
                de = jax.vmap(lambda t: dp.delta(t, jnp.asarray(theta), r, float(n)))(
                    jnp.asarray(exact_draws, jnp.float32))
                be, ve = stats(de)
                row[f"fedpa_rho{tag}_bias"], row[f"fedpa_rho{tag}_var"] = b, v
                row[f"fedpa_exact_rho{tag}_bias"], row[f"fedpa_exact_rho{tag}_var"] = be, ve
                if rho is None:
                    row["fedpa_bias"], row["fedpa_var"] = b, v
            out[d][T] = row
    return out


# -- (b) client-update time ------------------------------------------------------------------------

def _client_fns(d: int, steps: int = 200):
    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.normal(size=(64, d)) / np.sqrt(d), jnp.float32)
    y = jnp.asarray(rng.normal(size=64), jnp.float32)
    lr = 0.5

    def sgd(w):
        return w - lr * (X.T @ (X @ w - y) / 64 + 0.01 * w)

    def path(theta):
        """The same SGD steps; the second half averaged into NUM_DRAWS windows (nested scans, O(d) extra a step)."""
        K = steps // 2 // NUM_DRAWS
        w, _ = jax.lax.scan(lambda w, _: (sgd(w), None), theta, None, length=steps - K * NUM_DRAWS)

        def window(w, _):
            def inner(c, _):
                w, acc = c
                w = sgd(w)
                return (w, acc + w), None

            (w, acc), _ = jax.lax.scan(inner, (w, jnp.zeros_like(w)), None, length=K)
            return w, acc / K

        return jax.lax.scan(window, w, None, length=NUM_DRAWS)

    def fedavg(theta):
        w, _ = jax.lax.scan(lambda w, _: (sgd(w), None), theta, None, length=steps)
        return theta - w

    def fedpa_dp(theta):
        _, draws = path(theta)
        return dp.delta(draws, theta, 1.0 / (NUM_DRAWS - 1), 64.0)

    def fedpa_dense(theta):
        _, draws = path(theta)
        return dp.dense_delta(draws, theta, 1.0 / (NUM_DRAWS - 1), 64.0)

    return {"fedavg": jax.jit(fedavg), "fedpa_dp": jax.jit(fedpa_dp), "fedpa_dense": jax.jit(fedpa_dense)}


def _time_all(fns: dict, x, repeats=9) -> dict:
    """Median seconds of each function, calls interleaved (a shared machine's load hits all alike)."""
    for fn in fns.values():
        jax.block_until_ready(fn(x))
    ts = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(x))
            ts[name].append(time.perf_counter() - t)
    return {name: float(np.median(v)) for name, v in ts.items()}


def client_update_times(dims=(100, 1000, 10000, 100000), dense_max=1000):
    out = {}
    for d in dims:
        fns = _client_fns(d)
        if d > dense_max:
            fns.pop("fedpa_dense")
        row = _time_all(fns, jnp.zeros((d,), jnp.float32))
        row["dp_over_fedavg"] = row["fedpa_dp"] / row["fedavg"]
        if "fedpa_dense" in row:
            row["dense_over_fedavg"] = row["fedpa_dense"] / row["fedavg"]
        out[d] = row
    return out


# -- (c) synthetic rounds --------------------------------------------------------------------------

SIG, PRIOR = 1.0, 100.0


def synthetic_federation(d=50, K=10, seed=0):
    """10 least-squares clients with their own feature covariances, sizes and optima (w ~ N(0, 20^2))."""
    rng = np.random.default_rng(seed)
    w0 = 20.0 * rng.normal(size=d)
    clients = []
    for k in range(K):
        n = int(rng.integers(100, 400))
        scales = np.exp(rng.uniform(-1.0, 0.5, size=d))
        X = rng.normal(size=(n, d)) * scales + rng.normal(size=d) * 0.5
        w = w0 + 2.0 * rng.normal(size=d)
        clients.append((X.astype(np.float32), (X @ w + SIG * rng.normal(size=n)).astype(np.float32)))
    fed = fp.data.FederatedData.from_clients(clients)
    P = np.eye(d) / PRIOR ** 2
    b = np.zeros(d)
    for X, y in clients:
        P += X.T.astype(np.float64) @ X / SIG ** 2
        b += X.T.astype(np.float64) @ y / SIG ** 2
    return fed, np.linalg.solve(P, b)


def linreg(X, y=None):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, PRIOR).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, SIG), obs=y)


def distance_curve(algo, model, fed, optimum, rounds, seed=0):
    """Distance of the server point to ``optimum`` before round 1 and after each round."""
    ctx_r = fp.run(algo, model, fed, rounds=1, seed=seed, progress=False)
    ctx, data = ctx_r.context, fed.client_data()
    key = jax.random.PRNGKey(seed)
    k_init, k_rounds = jax.random.split(key)
    server, clients = local.compiled_init(algo, ctx, data, k_init)(k_init, data)
    fn, _ = local.compiled_round(algo, ctx, fed.num_clients, None, server, clients, data, k_rounds)
    point = lambda s: np.asarray(s[0] if isinstance(s, tuple) else s.params)
    curve = [float(np.linalg.norm(point(server) - optimum))]
    t = time.perf_counter()
    for r in range(rounds):
        server, clients, _ = fn(server, clients, data, jax.random.fold_in(k_rounds, r))
        curve.append(float(np.linalg.norm(point(server) - optimum)))
    return curve, (time.perf_counter() - t) / rounds


def synthetic_curves(quick=False, rounds=None):
    d = 20 if quick else 50
    rounds = rounds or (10 if quick else 30)
    fed, opt = synthetic_federation(d=d)
    steps = 100 if quick else 200
    half = steps // 2
    algos = {
        "fedavg": fp.algorithms.FedAvg(local_steps=steps, batch_size=32, learning_rate=0.02),
        # the IASG learning rate adapted during its local burn-in (0.5 / lambda_max), 3 FedAvg rounds first
        "fedpa": FedPA(family="diag", client=fp.inference.IASG(step_size=None, num_burnin=half, steps_per_sample=half // NUM_DRAWS,
                                                num_samples=NUM_DRAWS, batch_size=32), burn_in_rounds=3),
    }
    if not quick:
        algos["fedpa_iasg_lr0.02"] = FedPA(family="diag", client=fp.inference.IASG(
            step_size=0.02, num_burnin=half, steps_per_sample=half // NUM_DRAWS, num_samples=NUM_DRAWS, batch_size=32),
            burn_in_rounds=3)
        algos["fedpa_iasg_no_burn_in_rounds"] = FedPA(family="diag", client=fp.inference.IASG(
            step_size=None, num_burnin=half, steps_per_sample=half // NUM_DRAWS, num_samples=NUM_DRAWS, batch_size=32),
            burn_in_rounds=0)
        algos["fedpa_nuts"] = FedPA(family="diag", client=fp.inference.NUTS(num_warmup=200, num_samples=200))
        algos["fedpa_nuts_rho1"] = FedPA(family="diag", client=fp.inference.NUTS(num_warmup=200, num_samples=200),
                                         shrinkage=1.0, normalize=False, server_learning_rate=0.2)
        # the library's default on d <= 100: full client covariances, Newton server step, SGHMC clients
        algos["fedpa_default_full"] = FedPA()
    out = {}
    for name, algo in algos.items():
        out[name], out[name + "_sec_per_round"] = distance_curve(algo, linreg, fed, opt, rounds)
    return out


# -- (d) real data ----------------------------------------------------------------------------------

def find_data_root(arg: Optional[str]) -> Optional[Path]:
    for cand in (arg, os.environ.get("FEDPROB_DATA")):
        if cand:
            return Path(cand) if Path(cand).is_dir() else None
    cand = Path(__file__).resolve().parents[2] / "shared" / "data"
    return cand if cand.is_dir() else None


def real_data_algos(steps: int, lr: float, batch: int = 32):
    half = steps // 2
    return {
        "fedavg": fp.algorithms.FedAvg(local_steps=steps, batch_size=batch, learning_rate=lr),
        "fedadam": fp.algorithms.FedAvg(local_steps=steps, batch_size=batch, learning_rate=lr,
                                        server_optimizer="adam", server_learning_rate=0.03),
        "fedpa": FedPA(family="diag", client=fp.inference.IASG(step_size=lr, num_burnin=half, steps_per_sample=half // NUM_DRAWS,
                                                num_samples=NUM_DRAWS, batch_size=batch), burn_in_rounds=2),
    }


def real_data(root: Path, quick=False):
    out = {}
    ds = fp.data.load_credit_approval(root / "uci_credit_approval")
    fed = fp.data.partition(ds.X_train, ds.y_train, num_clients=10, scheme="dirichlet", alpha=0.5, seed=0,
                            num_classes=2)
    model = fp.models.logistic_regression()
    rounds = 5 if quick else 20
    out["credit"] = {}
    for name, algo in real_data_algos(steps=40, lr=0.1).items():
        r = fp.run(algo, model, fed, rounds=rounds, seed=0, eval_data=(ds.X_test, ds.y_test), progress=False)
        out["credit"][name] = {"accuracy": r.metric("accuracy").tolist(), "nll": r.metric("nll").tolist(),
                               "sec_per_round": float(np.mean(r.metric("time")))}
    if quick:
        return out
    fm = fp.data.load_fashion_mnist(root / "fashion_mnist")
    rng = np.random.default_rng(0)
    idx = np.sort(rng.permutation(len(fm.y_train))[:10000])
    te = np.sort(rng.permutation(len(fm.y_test))[:2000])
    Xtr, ytr = fm.X_train[idx].reshape(len(idx), -1), fm.y_train[idx]
    Xte, yte = fm.X_test[te].reshape(len(te), -1), fm.y_test[te]
    m, s = float(Xtr.mean()), float(Xtr.std())
    Xtr, Xte = ((Xtr - m) / s).astype(np.float32), ((Xte - m) / s).astype(np.float32)
    fed = fp.data.partition(Xtr, ytr, num_clients=10, scheme="dirichlet", alpha=0.5, seed=0, num_classes=10)
    model = fp.models.bnn_mlp(hidden_sizes=(100,), num_classes=10)
    out["fashion_mnist"] = {}
    for name, algo in real_data_algos(steps=60, lr=0.05).items():
        r = fp.run(algo, model, fed, rounds=10, seed=0, eval_data=(Xte, yte), progress=False)
        out["fashion_mnist"][name] = {"accuracy": r.metric("accuracy").tolist(), "nll": r.metric("nll").tolist(),
                                      "sec_per_round": float(np.mean(r.metric("time")))}
    return out


# -- report -----------------------------------------------------------------------------------------

def report(res: dict) -> str:
    lines = ["# FedPA benchmark", ""]
    if "bias" in res:
        lines += ["## (a) Delta bias / variance (relative to the exact mean-scale delta)", "",
                  "| d | T | l | FedAvg bias | FedAvg var | FedPA-IASG bias | FedPA-IASG var | FedPA-IASG paper-rho bias "
                  "| paper-rho var | FedPA-exact-draws bias | FedPA-exact-draws var |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for d, rows in res["bias"].items():
            for T, r in rows.items():
                lines.append(f"| {d} | {T} | {r['draws']} | {r['fedavg_bias']:.3f} | {r['fedavg_var']:.3g} | "
                             f"{r['fedpa_bias']:.3f} | {r['fedpa_var']:.3g} | {r['fedpa_rhopaper_bias']:.3f} | "
                             f"{r['fedpa_rhopaper_var']:.3g} | "
                             f"{r['fedpa_exact_rhodefault_bias']:.3f} | {r['fedpa_exact_rhodefault_var']:.3g} |")
        lines.append("")
    if "timing" in res:
        lines += ["## (b) Client-update time (s)", "", "| d | FedAvg | FedPA-DP | dense | DP / FedAvg | dense / FedAvg |",
                  "|---|---|---|---|---|---|"]
        for d, r in res["timing"].items():
            lines.append(f"| {d} | {r['fedavg']:.4g} | {r['fedpa_dp']:.4g} | {r.get('fedpa_dense', float('nan')):.4g} | "
                         f"{r['dp_over_fedavg']:.3f} | {r.get('dense_over_fedavg', float('nan')):.3f} |")
        lines.append("")
    if "synthetic" in res:
        lines += ["## (c) Distance to the optimum per round (10 clients, least squares)", "",
                  "Authors' demo (their own problem, start at 142): FedAvg stalls near 4, their FedPA-IASG is at "
                  "4.5 after 30 rounds.", ""]
        syn = res["synthetic"]
        for name, curve in syn.items():
            if isinstance(curve, list):
                pts = ", ".join(f"{c:.3g}" for c in curve[::5] + [curve[-1]])
                lines.append(f"- {name}: {pts} (start, every 5 rounds, end); "
                             f"FedAvg end / this end = {syn['fedavg'][-1] / curve[-1]:.2f}")
        lines.append("")
    if res.get("real"):
        lines += ["## (d) Real data (equal local steps per round)", "", "| data | method | accuracy (end) | NLL (end) |"
                  " best accuracy | s / round |", "|---|---|---|---|---|---|"]
        for data, rows in res["real"].items():
            for name, r in rows.items():
                lines.append(f"| {data} | {name} | {r['accuracy'][-1]:.4f} | {r['nll'][-1]:.4f} | "
                             f"{np.nanmax(r['accuracy']):.4f} | {r['sec_per_round']:.3g} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI size; writes no files")
    p.add_argument("--data", default=None)
    p.add_argument("--parts", default="abcd")
    args = p.parse_args(argv)
    res = {}
    t0 = time.perf_counter()
    if "a" in args.parts:
        res["bias"] = (delta_bias_variance(dims=(10,), local_steps=(10, 100, 400), reps=8, quick=True) if args.quick
                       else delta_bias_variance())
    if "b" in args.parts:
        res["timing"] = client_update_times((100, 1000) if args.quick else (100, 1000, 10000, 100000))
    if "c" in args.parts:
        res["synthetic"] = synthetic_curves(quick=args.quick)
    if "d" in args.parts:
        root = find_data_root(args.data)
        if root is None:
            print("fedpa benchmark: data folder not found; part (d) skipped")
        else:
            res["real"] = real_data(root, quick=args.quick)
    res["seconds"] = time.perf_counter() - t0
    text = report(res)
    print(text)
    print(f"total {res['seconds']:.0f} s")
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fedpa.json").write_text(json.dumps(res, indent=1, default=float))
        (RESULTS / "fedpa.md").write_text(text + "\n")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
