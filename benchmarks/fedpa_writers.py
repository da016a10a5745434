"""FedPA against FedAvg and FedAdam over hundreds of simulated writers (the FedPA paper's EMNIST-62 setting,
scaled to these machines).

The paper (Al-Shedivat et al. 2021, Table 3a) trains a CNN over 3,400 EMNIST writers, 100 per round,
server SGD with momentum 0.9 at 0.5, client SGD at 0.01 for 5 epochs, and turns FedPA's sampling on
after 100 burn-in rounds of 1,500: FedAvg-1E 83.9 / 86.5%, FedAvg-ME 85.8 / 85.9%, FedPA-ME 86.5 /
87.3% after 500 / 1,500 rounds (centralised 88%). Here: MNIST's training rows over ``--clients`` writers
(300), each with a label skew (classes ~ Dirichlet(0.5)), a size skew (sizes ~ Dirichlet(1)) and a style of
its own (a shift of up to 2 pixels in each direction and a contrast exponent in [0.6, 1.6], applied to
all its rows); the test rows carry styles drawn the same way. Model ``bnn_mlp((100,))`` (79,510
weights), ``--per-round`` (20) writers a round, ``--rounds`` (120) rounds. Every method takes the same
client work per round (``--steps`` minibatch SGD steps of ``--batch`` rows at ``--lr``) and the same
server optimiser:

- ``FedAvg-1E``: one epoch's steps of the average client; ``FedAvg-ME``: ``--steps`` steps;
  both with server SGD (momentum 0.9, learning rate 0.5: the paper's FedAvgM).
- ``FedAdam-ME``: the same steps, server Adam at 0.01.
- ``FedPA-ME``: IASG clients with the same steps (the first 40% burn-in, then 10 draws), the library's
  FedPA defaults otherwise (shrinkage, normalised deltas, the drift and spread checks), server SGD as
  FedAvg's, ``--burn-in`` (10) FedAvg rounds first (the paper's 100 of 1,500: 7% of the rounds).
- ``FedPA-ME(no checks)``: the same with ``max_drift=None`` (every sampling round's delta damped).
- ``FedPA-ME(paper's delta)``: the paper's EMNIST settings of the delta (shrinkage 0.1, the delta not
  normalised, the draws' covariance taken as is), no checks.

Reported per method (mean over ``--seeds`` seeds, each its own split, styles and run): test accuracy at
one third of the rounds and at the end (the mean over the last 10 rounds, as the paper averages its
last 100), and the first round whose 10-round running mean reaches each ``--targets`` accuracy
(test rows scored every ``--eval-every`` rounds: 5).

Usage::

    python benchmarks/fedpa_writers.py                 # writes benchmarks/results/fedpa_writers.{json,md}
    python benchmarks/fedpa_writers.py --quick         # 40 writers, 4 rounds, 2 methods, 32 hidden units
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np

import fedprob as fp

sys.path.insert(0, str(Path(__file__).parent))
from dual import find_data_root  # noqa: E402
from results_io import destination, write_results  # noqa: E402

#: The paper's Table 3a (EMNIST-62, accuracy % after 500 / 1,500 rounds).
PAPER = {"FedAvg-1E": (83.9, 86.5), "FedAvg-ME": (85.8, 85.9), "FedPA-ME": (86.5, 87.3)}


def styled(X, rng, n_styles):
    """Each row of ``X`` (n, 784) in [0, 1] in one of ``n_styles`` random writer styles: ``(X', style index)``."""
    shifts = rng.integers(-2, 3, size=(n_styles, 2))
    gammas = rng.uniform(0.6, 1.6, size=n_styles)
    which = rng.integers(0, n_styles, size=len(X))
    return apply_styles(X, which, shifts, gammas), which


def apply_styles(X, which, shifts, gammas):
    imgs = X.reshape(-1, 28, 28)
    out = np.empty_like(imgs)
    for s in np.unique(which):
        rows = which == s
        img = np.roll(imgs[rows], tuple(shifts[s]), axis=(1, 2))
        out[rows] = np.power(np.clip(img, 0.0, 1.0), gammas[s])
    return out.reshape(len(X), -1).astype(np.float32)


def writers(root, num_clients: int, seed: int, test_rows: int = 2000):
    """``(FederatedData, (X_test, y_test))``: MNIST's training rows over writers with label, size and style
    skew (module docstring); test rows in random writer styles."""
    ds = fp.data.load_mnist(root)
    rng = np.random.default_rng(seed)
    X, y = np.asarray(ds.X_train, np.float32), np.asarray(ds.y_train)
    sizes = np.maximum(5, np.round(rng.dirichlet(np.ones(num_clients)) * len(y) * 0.5)).astype(int)
    by_class = [rng.permutation(np.flatnonzero(y == c)).tolist() for c in range(10)]
    shifts = rng.integers(-2, 3, size=(num_clients, 2))
    gammas = rng.uniform(0.6, 1.6, size=num_clients)
    clients = []
    for k, n in enumerate(sizes):
        p = rng.dirichlet(0.5 * np.ones(10))
        counts = rng.multinomial(n, p)
        idx = []
        for c, m in enumerate(counts):
            take = min(m, len(by_class[c]))
            idx += [by_class[c].pop() for _ in range(take)]
        idx = np.asarray(idx if idx else [by_class[int(np.argmax([len(b) for b in by_class]))].pop()])
        Xk = apply_styles(X[idx], np.zeros(len(idx), int), shifts[k:k + 1], gammas[k:k + 1])
        clients.append((Xk, y[idx].astype(np.int32)))
    t = rng.permutation(len(ds.y_test))[:test_rows]
    Xt, _ = styled(np.asarray(ds.X_test, np.float32)[t], rng, 50)
    return fp.data.FederatedData.from_clients(clients), (Xt, np.asarray(ds.y_test)[t].astype(np.int32))


def methods(steps: int, epoch_steps: int, batch: int, lr: float, burn_in: int):
    server = dict(server_optimizer="sgd", server_learning_rate=0.5, server_momentum=0.9)
    burn = int(round(0.4 * steps))
    per = max(1, (steps - burn) // 10)
    iasg = fp.inference.IASG(step_size=lr, num_burnin=steps - 10 * per, steps_per_sample=per, num_samples=10,
                             batch_size=batch)
    A = fp.algorithms
    return {
        "FedAvg-1E": A.FedAvg(local_steps=epoch_steps, batch_size=batch, learning_rate=lr, **server),
        "FedAvg-ME": A.FedAvg(local_steps=steps, batch_size=batch, learning_rate=lr, **server),
        "FedAdam-ME": A.FedAvg(local_steps=steps, batch_size=batch, learning_rate=lr, server_optimizer="adam",
                               server_learning_rate=0.01),
        "FedPA-ME": A.FedPA(client=iasg, family="diag", burn_in_rounds=burn_in, **server),
        "FedPA-ME(no checks)": A.FedPA(client=iasg, family="diag", burn_in_rounds=burn_in, max_drift=None, **server),
        "FedPA-ME(paper's delta)": A.FedPA(client=iasg, family="diag", burn_in_rounds=burn_in, shrinkage=0.1,
                                           normalize=False, covariance_scale=1.0, max_drift=None, **server),
    }


def first_round(acc, target, window=10):
    """The first round (1-based) whose running mean of the evaluated accuracies over the last ``window``
    rounds reaches ``target`` (rounds not evaluated are NaN in ``acc`` and left out); None if none does."""
    acc = np.asarray(acc, float)
    for end in range(window, len(acc) + 1):
        part = acc[end - window:end]
        if np.isfinite(part).any() and np.nanmean(part) >= target:
            return end
    return None


def run_all(root, a):
    rows = []
    for seed in range(a.seeds):
        fed, test = writers(root, a.clients, seed, test_rows=a.test_rows)
        epoch_steps = max(1, int(round(np.mean(fed.client_sizes) / a.batch)))
        model = fp.models.bnn_mlp((a.hidden,), num_classes=10)
        for name, algo in methods(a.steps, epoch_steps, a.batch, a.lr, a.burn_in).items():
            if a.methods and name not in a.methods.split(","):
                continue
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = fp.run(algo, model, fed, rounds=a.rounds, seed=seed, clients_per_round=a.per_round,
                           eval_data=test, eval_every=a.eval_every, progress=False)
            acc = np.asarray(r.metric("accuracy"), float)        # NaN in the rounds not evaluated
            row = {"method": name, "seed": seed, "accuracy": acc.tolist(),
                   "nll": np.asarray(r.metric("nll")).tolist(), "seconds": round(time.perf_counter() - t0, 1)}
            if "client_drifting" in r.history[-1]:
                row["drifting"] = np.asarray(r.metric("client_drifting")).tolist()
            rows.append(row)
            print(name, seed, f"acc {acc[a.rounds // 3 - 1]:.4f} / {np.nanmean(acc[-10:]):.4f}",
                  f"{row['seconds']} s", flush=True)
    return rows


def markdown(rows, meta, a):
    third = a.rounds // 3
    targets = [float(x) for x in a.targets.split(",")]
    lines = ["# FedPA over simulated writers (the paper's EMNIST-62 setting, scaled)", "",
             f"{meta['machine']}; jax {meta['jax']}; {meta['date']}; 2 CPU cores", "",
             f"MNIST's training rows over {a.clients} writers (label skew Dirichlet(0.5), size skew Dirichlet(1), a "
             f"shift and contrast style per writer), `bnn_mlp(({a.hidden},))`, {a.per_round} writers a round, {a.rounds} "
             f"rounds, {a.steps} SGD steps of {a.batch} rows at {a.lr} per client and round (FedAvg-1E: one "
             f"epoch's), server SGD with momentum 0.9 at 0.5 (FedAdam: Adam at 0.01), FedPA sampling after "
             f"{a.burn_in} FedAvg rounds; {a.seeds} seeds (split, styles, run). Test accuracy % at round "
             f"{third} and at the end (mean of the last 10 rounds), and the first round whose 10-round running "
             f"mean reaches each target (evaluated every {a.eval_every} rounds); the paper's Table 3a "
             "(EMNIST-62 CNN, 500 / 1,500 rounds) beside it.", "",
             f"| method | acc @ {third} | acc @ {a.rounds} | NLL @ {a.rounds} | "
             + " | ".join(f"rounds to {100 * t:.0f}%" for t in targets) + " | paper @ 500 / 1,500 | s per run |",
             "|---|---|---|---|" + "---|" * len(targets) + "---|---|"]
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == m]
        at_third = 100 * np.mean([r["accuracy"][third - 1] for r in rs])
        end = 100 * np.mean([np.nanmean(r["accuracy"][-10:]) for r in rs])
        nll = np.mean([np.nanmean(r["nll"][-10:]) for r in rs])
        reach = []
        for t in targets:
            hits = [first_round(np.asarray(r["accuracy"]), t) for r in rs]
            reach.append("not reached" if any(h is None for h in hits) else f"{np.mean(hits):.0f}")
        paper = PAPER.get(m)
        lines.append(f"| {m} | {at_third:.1f} | {end:.1f} | {nll:.3f} | " + " | ".join(reach)
                     + f" | {'' if paper is None else f'{paper[0]} / {paper[1]}'} | "
                     f"{np.mean([r['seconds'] for r in rs]):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", type=int, default=300)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--burn-in", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--targets", default="0.9,0.93")
    ap.add_argument("--hidden", type=int, default=100, help="hidden units of the MLP")
    ap.add_argument("--test-rows", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=5, help="evaluate every this many rounds (and the last)")
    ap.add_argument("--methods", default=None, help="comma-separated subset (default all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.clients, a.rounds, a.burn_in, a.seeds, a.per_round, a.steps = 40, 4, 2, 1, 4, 20
        a.methods = a.methods or "FedAvg-ME,FedPA-ME"
        a.eval_every, a.hidden, a.test_rows = 1, 32, 200
    root = find_data_root()
    if root is None:
        print("no data folder (../shared/data or FEDPROB_DATA): skipping")
        return []
    rows = run_all(root, a)
    meta = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d")}
    md = markdown(rows, meta, a)
    print(md)
    write_results(destination(a.out, a.quick), "fedpa_writers", {"meta": meta, "args": vars(a), "rows": rows},
                  [md.rstrip("\n")])
    return rows


if __name__ == "__main__":
    main()
