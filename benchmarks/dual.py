"""The natural-parameter (dual) family on real data, side by side with the FedLap and BayesADMM papers.

Logistic regression (FedLap paper, Table 1), accuracy after 10/20/25/50 rounds:

* UCI Credit Approval, 10 heterogeneous clients as in PVI's split: 5 small
  clients of 36 rows with about 6% positive labels and 5 large ones of 67
  rows with about 66% (the fixed protocol's stratified 80/20 split, seed 0);
* Fed-Heart-Disease, the 4 hospitals as clients (per-centre standardization).

Methods: FedAvg, FedProx (Adam 1e-3, batch 4, 10 local epochs, as the
paper's grid), FedDyn, FedLap, FedLap-Cov, BayesADMM (diagonal Laplace
clients, rho = 1, the paper's gamma = 0.1 (the library's default is 0.2); at the server mean and averaged over 32 draws of q_g),
BayesADMM-IVON (the same with IVON clients: Alg. 1 as printed), FedLap-Func
(2 memory points per client, tau = 1, rho = N_k/N), PVI (diagonal Laplace
clients, damping 1/K). The
natural-family methods and FedDyn solve their client problems with
full-batch L-BFGS (the paper uses Adam on minibatches of 4). The prior is
the model's N(0, I) (delta = 1, inside the papers' grids). The papers report
the mean over 3 seeds of the accuracy averaged over the previous 3 rounds;
here one seed, the accuracy at the round itself, and the NLL next to it.

Fashion-MNIST (``--part fmnist``, BayesADMM paper, Table 1): MLP (200, 100)
with sigmoid units and a N(0, 1) prior on 10% of the training rows (6,000)
over 10 clients (sizes Dir(1), classes Dir(0.5); here 2 to 2,555 rows), test
metrics on 2,000 test rows every 5 rounds, Gaussian posteriors also at their
mean and averaged over 32 draws after 10, 25 and 50 rounds. Every local solve
takes about ``--local-epochs`` epochs of a 600-row client on minibatches of
32 (default 5: 94 steps, the middle of the papers' grid of 1, 5 and 10
epochs; Adam 1e-3 for FedAvg, FedProx (mu = 0.01) and FedDyn (alpha 0.01
and 0.001 from the paper's grid of 1e-2 to 1e-6; 0.1 gave 75.7% after 50
rounds), IVON at its defaults for BayesADMM-IVON, started at the server
mean). FedLap-Cov runs
only when ``--methods`` names it (``FMNIST_OPT_IN``): its exact diagonal GGN
over the 178,000 parameters costs minutes a round on two CPU cores (10
rounds: 72.5% at the mean, 14.7% averaged over draws of its untempered
Laplace posterior).
BayesADMM-IVON runs at the model's temperature (``tau = 1``, the default),
at the paper's ``tau = 0.1`` (App. G: "typically 0.1 works well") and at
``tau = 0.03``, the best of 0.01, 0.03 and 0.1 in 10-round runs with 2
local epochs (74.6%, 75.0% and 71.4%; a coarse grid, as the paper's; at
``tau = 0.1``, rho 0.3 and 3, gamma 0.3 and IVON learning rates 0.03 and
0.3 were no better than the defaults, nor was gamma 0.3 at ``tau = 0.03``). Under a N(0, 1)
prior the untempered mean-field posterior of this network is wide (most
weights have a per-point curvature below 1e-3, so their posterior sds stay
near the prior's on clients of a few hundred rows) and its draws predict
poorly: at ``tau = 1`` the averaged prediction trails the one at the mean.
Before IVON's ``min_hess`` floor and beta2 rule, BayesADMM-IVON reached
23.5% after 10 rounds here (the curvature-scaled first steps moved the
weights by 90-185 in norm).

Usage::

    python benchmarks/dual.py            # writes results/dual.{json,md}
    python benchmarks/dual.py --quick    # CI size (Credit, 2 rounds, FedLapCov), writes nothing
    python benchmarks/dual.py --part fmnist               # the MLP part (50 rounds), into the results
    python benchmarks/dual.py --part fmnist --methods FedLapCov --rounds 10 --merge

Data: ``--data``, else ``$FEDPROB_DATA``, else ``../shared/data`` beside the
checkout; without it the script prints a message and exits with status 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import fedprob as fp
from fedprob.algorithms import PVI, BayesADMM, FedAvg, FedDyn, FedLap, FedLapCov, FedLapFunc, FedProx
from fedprob.inference import IVON
from fedprob.metrics import classification_metrics

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS = (10, 20, 25, 50)

#: FedLap paper Table 1 (accuracy %, mean over 3 seeds); BayesADMM paper Table 1 for FMNIST (MLP,
#: 10 heterogeneous clients; its NLLs for BayesADMM: 0.65 / 0.52 / 0.50, FedAvg 0.78 / 0.72 / 0.67)
PAPER = {
    "credit": {"FedAvg": {10: 77.0, 25: 76.3, 50: 78.6}, "FedProx": {10: 73.6, 25: 75.0, 50: 79.3},
               "FedDyn": {10: 73.5, 25: 79.9, 50: 83.5}, "FedLap": {10: 77.1, 25: 80.7, 50: 83.5},
               "FedLapCov": {10: 80.4, 25: 84.2, 50: 85.2}, "FedLapFunc": {10: 77.1, 25: 83.6, 50: 85.8}},
    "heart": {"FedAvg": {10: 72.6, 20: 77.6}, "FedProx": {10: 77.5, 20: 77.7}, "FedDyn": {10: 76.9, 20: 78.1},
              "FedLap": {10: 77.5, 20: 77.7}, "FedLapCov": {10: 79.2, 20: 80.0}},
    "fmnist_mlp": {"FedAvg": {10: 70.4, 25: 74.3, 50: 76.0}, "BayesADMM": {10: 77.0, 25: 81.5, 50: 82.3},
                   # the baselines of the same table (also the FedLap paper's Table 1)
                   "FedProx": {10: 69.9, 25: 74.7, 50: 76.9}, "FedDyn": {10: 73.0, 25: 74.6, 50: 74.6},
                   "FedLapCov": {10: 74.6, 25: 78.3, 50: 80.5}},
}


def find_data_root(arg=None):
    for cand in (arg, os.environ.get("FEDPROB_DATA"), Path(__file__).resolve().parents[2] / "shared" / "data"):
        if cand and Path(cand).is_dir():
            return Path(cand)
    return None


def credit_split(root, seed: int = 0):
    """PVI's heterogeneous Credit split: 5 clients of 36 rows (~6% positive), 5 of 67 (~66%)."""
    ds = fp.data.load_credit_approval(root, seed=seed)
    rng = np.random.default_rng(seed)
    # "positive" is the minority class (approved, label 0: 45% of the rows, as in the paper's description)
    pos, neg = [rng.permutation(np.flatnonzero(ds.y_train == c)).tolist() for c in (0, 1)]
    clients = []
    for n, n_pos in [(36, 2)] * 5 + [(67, 44)] * 5:
        idx = [pos.pop() for _ in range(n_pos)] + [neg.pop() for _ in range(n - n_pos)]
        clients.append((ds.X_train[idx], ds.y_train[idx]))
    return fp.data.FederatedData.from_clients(clients, num_classes=2), (ds.X_test, ds.y_test)


def heart_split(root):
    ds = fp.data.load_heart_disease(root)
    fed = fp.data.partition(ds.X_train, ds.y_train, scheme="groups", groups=ds.group_train, num_classes=2)
    return fed, (ds.X_test, ds.y_test)


#: the Fashion-MNIST MLP part (BayesADMM paper, Table 1: MLP (200, 100), 10% of FMNIST, 10 clients)
FMNIST_ROUNDS = (10, 25, 50)


def fmnist_split(root, seed: int = 0, fraction: float = 0.1, num_clients: int = 10, test_rows: int = 2000):
    """10% of the Fashion-MNIST training rows over 10 clients, sizes ~ Dir(1) and classes ~ Dir(0.5)
    per client; the first ``test_rows`` rows of a fixed permutation of the test set."""
    ds = fp.data.load_fashion_mnist(root)
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(ds.y_train))[: int(fraction * len(ds.y_train))]
    fed = fp.data.partition(ds.X_train[idx], ds.y_train[idx], num_clients, scheme="dirichlet", seed=seed,
                            num_classes=10, alpha=0.5, alpha_size=1.0)
    t = rng.permutation(len(ds.y_test))[:test_rows]
    return fed, (ds.X_test[t], ds.y_test[t])


def fmnist_methods(local_epochs: float):
    """Adam 1e-3 on minibatches of 32 for every local solve (the paper's batch size), about
    ``local_epochs`` passes over a client's rows (a 600-row client: 19 steps per epoch); IVON at its
    defaults with the same steps and batches, started at the server mean (``map_steps=0``), at the
    model's temperature (``tau = 1``), at the paper's ``tau = 0.1`` and at ``tau = 0.03``."""
    steps = int(round(local_epochs * 600 / 32))
    adam = dict(optimizer="adam", learning_rate=1e-3, batch_size=32, num_steps=steps)
    fedavg = dict(client_optimizer="adam", learning_rate=1e-3, batch_size=32, local_epochs=local_epochs)
    ivon = IVON(num_steps=steps, batch_size=32, map_steps=0)
    return {"FedAvg": FedAvg(**fedavg),
            "FedProx": FedProx(mu=0.01, **fedavg),
            "FedDyn": FedDyn(alpha=0.01, **adam),
            "FedDyn-alpha0.001": FedDyn(alpha=0.001, **adam),
            "FedLapCov": FedLapCov(**adam),
            "BayesADMM-IVON": BayesADMM(client=ivon, damping=0.1),
            "BayesADMM-IVON-tau0.1": BayesADMM(client=ivon, tau=0.1, damping=0.1),
            "BayesADMM-IVON-tau0.03": BayesADMM(client=ivon, tau=0.03, damping=0.1)}


#: run only when ``--methods`` names them (none now). FedLap-Cov was, while its diagonal GGN took per-row
#: Jacobians of the 178,000 weights (217 s a round); with the Monte Carlo Fisher that is its default on
#: this network (benchmarks/results/network_curvature.md) its 50 rounds, each client alone, took 4 min
FMNIST_OPT_IN: tuple = ()


def run_fmnist(root, rounds: int, local_epochs: float, only=None, eval_every: int = 5):
    """Every method for ``rounds`` rounds; Gaussian posteriors are also evaluated at their mean and
    averaged over draws at each round of ``FMNIST_ROUNDS`` (a run to 10 rounds resumed from its
    checkpoint to 25: the same states as one run to 25)."""
    fed, test = fmnist_split(root)
    model = fp.models.bnn_mlp((200, 100), num_classes=10, activation="sigmoid", prior_scale=1.0)
    stops = [r for r in FMNIST_ROUNDS if r < rounds] + [rounds]
    out = {}
    with tempfile.TemporaryDirectory() as ckpt:
        for name, algo in fmnist_methods(local_epochs).items():
            if (only and name not in only) or (not only and name in FMNIST_OPT_IN):
                continue
            engine = fp.engine.Local(client_chunk=1 if name == "FedLapCov" else None)
            t = time.perf_counter()
            compile_s, at = 0.0, {}
            for r in stops:
                res = fp.run(algo, model, fed, rounds=r, eval_data=test, eval_every=eval_every, progress=False,
                             engine=engine, checkpoint=fp.Checkpoint(os.path.join(ckpt, name)))
                compile_s += float(res.compile_time)
                post = res.posterior
                if isinstance(post.form, fp.Gaussian):
                    at[str(r)] = {pred: {k: v for k, v in classification_metrics(
                        np.asarray(post.predict(test[0], prediction=pred)), test[1]).items() if k != "reliability"}
                        for pred in ("mean", "average")}
            curve = {"rounds": [h["round"] for h in res.history if "accuracy" in h],
                     "accuracy": [h["accuracy"] for h in res.history if "accuracy" in h],
                     "nll": [h["nll"] for h in res.history if "accuracy" in h],
                     "seconds": float(sum(h["time"] for h in res.history)), "compile_seconds": compile_s}
            if at:
                curve["at_round"] = at
                curve["final_mean"], curve["final_average"] = at[str(rounds)]["mean"], at[str(rounds)]["average"]
            out[name] = curve
            print(f"  fmnist {name}: acc@{rounds} {curve['accuracy'][-1]:.3f} ({time.perf_counter() - t:.0f} s)",
                  flush=True)
    return {"rounds": rounds, "local_epochs": local_epochs, "test_rows": len(test[1]), "methods": out}


def fmnist_report(part) -> str:
    lines = [f"\n### fmnist_mlp: MLP (200, 100), sigmoid, 10% of Fashion-MNIST, 10 clients (sizes Dir(1), "
             f"classes Dir(0.5)); {part['local_epochs']} local epochs on minibatches of 32; test accuracy % "
             f"(NLL) on {part['test_rows']} test rows at each method's default prediction; paper's accuracy "
             "in brackets; Gaussian posteriors also at their mean and averaged over 32 draws\n"]
    rs = [r for r in FMNIST_ROUNDS if r <= part["rounds"]]
    if part["rounds"] not in rs:
        rs.append(part["rounds"])
    lines.append("| method | " + " | ".join(f"R={r}" for r in rs) + " | "
                 + " | ".join(f"R={r} at mean / averaged" for r in rs) + " |")
    lines.append("|---" * (2 * len(rs) + 1) + "|")
    for m, c in part["methods"].items():
        cells = []
        for r in rs:
            paper = PAPER["fmnist_mlp"].get(m.split("-")[0], {}).get(r)
            if r in c["rounds"]:
                i = c["rounds"].index(r)
                cells.append(f"{100 * c['accuracy'][i]:.1f} ({c['nll'][i]:.3f})"
                             + (f" [{paper}]" if paper is not None else ""))
            else:
                cells.append("")
        for r in rs:
            a = c.get("at_round", {}).get(str(r))
            cells.append(f"{100 * a['mean']['accuracy']:.1f} ({a['mean']['nll']:.3f}) / "
                         f"{100 * a['average']['accuracy']:.1f} ({a['average']['nll']:.3f})" if a else "")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def methods(quick: bool):
    local = dict(client_optimizer="adam", learning_rate=1e-3, batch_size=4, local_epochs=10)
    out = {"FedAvg": FedAvg(**local), "FedProx": FedProx(mu=0.1, **local), "FedDyn": FedDyn(alpha=0.1),
           "FedLap": FedLap(), "FedLapCov": FedLapCov(), "FedLapFunc": FedLapFunc(), "BayesADMM": BayesADMM(damping=0.1),
           "BayesADMM-IVON": BayesADMM(client=IVON(), damping=0.1), "PVI": PVI(damping="clients")}
    if quick:
        out = {k: out[k] for k in ("FedLapCov",)}
    return out


def curves(algo, model, fed, test, rounds: int, seed: int = 0):
    """Per-round accuracy/NLL at the posterior's default prediction and, for Gaussians, at the mean too."""
    res = fp.run(algo, model, fed, rounds=rounds, seed=seed, eval_data=test, progress=False)
    out = {"accuracy": res.metric("accuracy").tolist(), "nll": res.metric("nll").tolist(),
           "ece": res.metric("ece").tolist(), "seconds": float(sum(h["time"] for h in res.history)),
           "compile_seconds": float(res.compile_time)}
    post = res.posterior
    if isinstance(post.form, fp.Gaussian):
        for pred in ("mean", "average"):
            m = classification_metrics(np.asarray(post.predict(test[0], prediction=pred)), test[1])
            out[f"final_{pred}"] = m
    return out


def pooled_reference(model, fed, test):
    """What every method that converges to the global posterior converges to: one client holding
    all the rows, its exact full-covariance Laplace posterior (PVI with damping 1, one round), at
    its mean (the global MAP) and averaged over draws."""
    X, y = fed.pooled()
    one = fp.data.FederatedData.from_clients([(X, y)], num_classes=fed.num_classes)
    post = fp.run(PVI(damping=1.0, family="full"), model, one, rounds=1, progress=False).posterior
    return {pred: {k: v for k, v in classification_metrics(np.asarray(post.predict(test[0], prediction=pred)),
                                                           test[1]).items() if k != "reliability"}
            for pred in ("mean", "average")}


def run_problem(name, fed, test, rounds, quick, only=None):
    model = fp.models.logistic_regression(prior_scale=1.0)
    out = {"_pooled": pooled_reference(model, fed, test)}
    for mname, algo in methods(quick).items():
        if only and mname not in only:
            continue
        t = time.perf_counter()
        out[mname] = curves(algo, model, fed, test, rounds)
        print(f"  {name} {mname}: acc@{rounds} {out[mname]['accuracy'][-1]:.3f} ({time.perf_counter() - t:.0f} s)",
              flush=True)
    return out


def report(res) -> str:
    lines = []
    for prob, table in res.get("problems", {}).items():
        rounds = [r for r in ROUNDS if r <= max(len(c["accuracy"]) for m, c in table.items() if m != "_pooled")]
        lines.append(f"\n### {prob}: test accuracy % (NLL) after R rounds; paper's accuracy in brackets\n")
        lines.append("| method | " + " | ".join(f"R={r}" for r in rounds) + " | final at mean / averaged (acc, NLL) |")
        lines.append("|---" * (len(rounds) + 2) + "|")
        pooled = table.get("_pooled")
        for m, c in table.items():
            if m == "_pooled":
                continue
            cells = []
            for r in rounds:
                p = PAPER.get(prob, {}).get(m, {}).get(r)
                cells.append(f"{100 * c['accuracy'][r - 1]:.1f} ({c['nll'][r - 1]:.3f})"
                             + (f" [{p}]" if p is not None else ""))
            fin = ""
            if "final_mean" in c:
                fm, fa = c["final_mean"], c["final_average"]
                fin = (f"{100 * fm['accuracy']:.1f}, {fm['nll']:.3f} / {100 * fa['accuracy']:.1f}, "
                       f"{fa['nll']:.3f}")
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {fin} |")
        if pooled:
            pm, pa = pooled["mean"], pooled["average"]
            lines.append(f"\nPooled data (every row on one client, exact full-covariance Laplace): "
                         f"{100 * pm['accuracy']:.1f}% (NLL {pm['nll']:.3f}) at the global MAP, "
                         f"{100 * pa['accuracy']:.1f}% ({pa['nll']:.3f}) averaged over draws: the answer "
                         "of every method that converges to the global posterior.")
    if "fmnist_mlp" in res:
        lines.append(fmnist_report(res["fmnist_mlp"]))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI size; writes no files")
    p.add_argument("--data", default=None)
    p.add_argument("--problems", default="credit,heart")
    p.add_argument("--methods", default=None, help="comma-separated subset of the methods")
    p.add_argument("--merge", action="store_true", help="update results/dual.json instead of replacing it")
    p.add_argument("--part", default="logistic", choices=("logistic", "fmnist"),
                   help="logistic: Credit and Heart; fmnist: the Fashion-MNIST MLP (merged into the results)")
    p.add_argument("--rounds", type=int, default=None, help="fmnist rounds (default 50)")
    p.add_argument("--local-epochs", type=float, default=5.0, help="fmnist local epochs")
    args = p.parse_args(argv)
    root = find_data_root(args.data)
    if root is None:
        print("dual benchmark: data folder not found; nothing to do")
        return {}
    t0 = time.perf_counter()
    if args.part == "fmnist":
        only = args.methods.split(",") if args.methods else None
        part = run_fmnist(root, args.rounds or max(FMNIST_ROUNDS), args.local_epochs, only)
        res = json.loads((RESULTS / "dual.json").read_text()) if (RESULTS / "dual.json").exists() else {
            "problems": {}}
        old = res.get("fmnist_mlp", {"methods": {}})
        if args.merge and old.get("local_epochs") == part["local_epochs"]:
            # methods run for fewer rounds keep their own rounds (a shorter row in the table)
            old["methods"].update(part["methods"])
            part["methods"] = old["methods"]
            part["rounds"] = max(part["rounds"], old.get("rounds", 0))
        res["fmnist_mlp"] = part
        res["seconds"] = res.get("seconds", 0.0) + time.perf_counter() - t0
        text = report(res)
        print(text)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "dual.json").write_text(json.dumps(res, indent=1, default=float))
        (RESULTS / "dual.md").write_text("# Dual family benchmark\n" + text + "\n")
        return res
    rounds = 2 if args.quick else max(ROUNDS)
    res = {"problems": {}, "rounds": rounds}
    probs = ["credit"] if args.quick else args.problems.split(",")
    for prob in probs:
        fed, test = credit_split(root) if prob == "credit" else heart_split(root)
        only = args.methods.split(",") if args.methods else None
        res["problems"][prob] = run_problem(prob, fed, test, rounds, args.quick, only)
    if args.merge and (RESULTS / "dual.json").exists():
        old = json.loads((RESULTS / "dual.json").read_text())
        for prob, table in res["problems"].items():
            old["problems"].setdefault(prob, {}).update(table)
        old["seconds"] = old.get("seconds", 0.0) + time.perf_counter() - t0
        old["rounds"] = rounds
        res = old
    else:
        res["seconds"] = time.perf_counter() - t0
    text = report(res)
    print(text)
    print(f"total {res['seconds']:.0f} s")
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "dual.json").write_text(json.dumps(res, indent=1, default=float))
        (RESULTS / "dual.md").write_text("# Dual family benchmark\n" + text + "\n")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
