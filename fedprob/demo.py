"""``fedprob demo``: the embedded digits, 10 clients, a Dirichlet split, methods side by side.

Point-estimate methods start at the centre of the prior (their default);
FedPA runs its defaults (IASG clients, two FedAvg burn-in rounds), PVI its
defaults (diagonal Laplace sites, damping 1/K), BayesADMM the paper's IVON
clients;
PredictiveBayes uses its default tempered pooling, and the paper's plain
product is computed from the same client draws as one more row, to show the
difference in calibration (NLL, ECE) at about the same accuracy.

``quick`` keeps every method and shrinks the work: multi-round methods run
4 rounds unless ``rounds`` is given (FedPA: its two burn-in rounds, then two
sampling rounds) and the cyclical SGHMC clients take 200 steps (4 cycles of
50, 3 draws per cycle; no lengthening toward an effective-sample-size target).
``methods`` runs only the named rows (``select_methods``: a row's full name, or its name before the
parenthesis, case-insensitive; "PVI" selects "PVI(Laplace, diag)").
"""
from __future__ import annotations

import time
from typing import Optional

from .algorithms import PredictiveBayes
from .validation import check_int


def demo_methods(rounds: int, quick: bool):
    """(name, algorithm, rounds) triples shown by the demo (``quick``: the samplers run 200 steps instead
    of 1,500 with no ESS stretch, and IVON 500 instead of its default 2,000)."""
    from . import algorithms as A

    from . import inference as I

    local = dict(local_epochs=1, batch_size=32, learning_rate=1.0)
    # quick: 200 steps and no lengthening of the cycles toward an ESS target (the default may stretch them
    # up to 10 times)
    sampler = I.CyclicalSGHMC(num_steps=200 if quick else 1500, num_cycles=4, samples_per_cycle=3,
                              batch_size=32, **({"target_ess": 0.0} if quick else {}))
    laplace = I.Laplace(hessian="diag_ggn")
    return [
        ("FedAvg", A.FedAvg(**local), rounds),
        ("FedProx(mu=0.1)", A.FedProx(mu=0.1, **local), rounds),
        ("FedAdam", A.FedAvg(server_optimizer="adam", server_learning_rate=0.1, **local), rounds),
        ("FedPA(IASG)", A.FedPA(), rounds),
        ("PVI(Laplace, diag)", A.PVI(), rounds),
        ("BayesADMM(IVON)", A.BayesADMM(client=I.IVON(num_steps=500) if quick else I.IVON()), rounds),
        ("OneShotAverage(Laplace)", A.OneShotAverage(client=laplace), 1),
        ("EPMCMC(Laplace, diag)", A.EPMCMC(client=laplace, family="diag"), 1),
        ("Ensemble(cSGHMC)", A.Ensemble(client=sampler), 1),
        ("PredictiveBayes(cSGHMC)", A.PredictiveBayes(client=sampler), 1),
    ]


def select_methods(methods, rows):
    """The demo rows named in ``methods`` (an iterable of names, or one comma-separated string), in the
    demo's order: a name matches a row's full name or its name before "(", ignoring case. ``None``: every
    row. An unknown name raises ValueError listing the rows."""
    if methods is None:
        return list(rows)
    if isinstance(methods, str):
        methods = methods.split(",")
    wanted = [m.strip().lower() for m in methods if m.strip()]
    if not wanted:
        raise ValueError("methods: no method named")

    def keys(name):
        return {name.lower(), name.split("(")[0].strip().lower()}

    names = [r[0] for r in rows]
    unknown = [m for m in wanted if not any(m in keys(n) for n in names)]
    if unknown:
        raise ValueError(f"methods: unknown demo method(s) {', '.join(unknown)}; the demo's methods are "
                         + ", ".join(names))
    return [r for r in rows if keys(r[0]) & set(wanted)]


def summary_row(name: str, result, total: float) -> dict:
    """One row of the demo's table (and of ``fedprob run``'s): the last round's metrics and the times."""
    h = result.history[-1]
    row = {"method": name, "rounds": len(result.history)}
    for k in ("accuracy", "nll", "ece", "rmse", "coverage_95"):
        if k in h:
            row[k] = h[k]
    row["time_s"] = total
    row["compile_s"] = result.compile_time
    return row


def slug(name: str) -> str:
    """A directory name for a method name."""
    import re

    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


#: the demo table's columns, in order
COLUMNS = ("method", "rounds", "accuracy", "nll", "ece", "time_s", "compile_s")

LEGEND = """accuracy: share of test digits classified right; nll: mean negative log predictive density on the
test rows (lower is better); ece: expected calibration error (15 confidence bins; 0 is calibrated);
time_s: wall time of the run, compile_s: the part spent compiling (0 when the persistent cache or an
earlier method with the same client backend had compiled it); rounds: communication rounds."""


def describe(fed, test, rounds: int, quick: bool, seed: int) -> str:
    """The demo's first line: what it runs."""
    sizes = fed.client_sizes
    return (f"digits (8x8, 10 classes): {int(sum(sizes))} training rows over {fed.num_clients} clients, "
            f"Dirichlet(0.5) label split (client sizes {min(sizes)} to {max(sizes)}), {len(test[1])} test rows; "
            f"softmax regression; multi-round methods {rounds} rounds{' (quick)' if quick else ''}; seed {seed}")


def table_line(row: dict, columns=COLUMNS) -> str:
    """One Markdown table line of ``row`` in ``columns`` (floats to 4 significant digits)."""
    from .table import _fmt

    return "| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |"


def table_header(columns=COLUMNS) -> str:
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def run_demo(rounds: Optional[int] = None, quick: bool = False, progress: bool = True, seed: int = 0, out=None,
             on_start=None, on_row=None, methods=None):
    """Run every demo method (or those named in ``methods``: :func:`select_methods`) on digits and return
    one summary row per method.

    out: a directory to write one run directory per method into (:mod:`fedprob.rundir`).
    on_start(text): called first with :func:`describe`'s line; on_row(row): with each row as its
    method finishes.
    """
    from . import data, models
    from .run import run

    ds = data.load_digits(seed=seed)
    fed = data.partition(*ds.train, num_clients=10, scheme="dirichlet", alpha=0.5, seed=seed)
    model = models.softmax_regression(num_classes=10)
    if rounds is None:
        rounds = 4 if quick else 20
    check_int("rounds", rounds)
    chosen = select_methods(methods, demo_methods(rounds, quick))
    text = describe(fed, ds.test, rounds, quick, seed)
    if on_start is not None:
        on_start(text)
    rows = []
    for name, algo, r in chosen:
        t = time.perf_counter()
        result = run(algo, model, fed, rounds=r, seed=seed, eval_data=ds.test, progress=progress,
                     eval_every=max(r, 1))
        total = time.perf_counter() - t
        rows.append(summary_row(name, result, total))
        if on_row is not None:
            on_row(rows[-1])
        if out is not None:
            from pathlib import Path

            from .rundir import federation_info, save_run

            save_run(Path(out) / slug(name), result, total_time=total, name=name, num_draws=200,
                     federation=federation_info(fed, text))
        if isinstance(algo, PredictiveBayes) and algo.pooling != "product":
            rows.append(_product_row(name, algo, result, ds.test))
            if on_row is not None:
                on_row(rows[-1])
    return rows


def _product_row(name: str, algo, result, test) -> dict:
    """The plain product (the paper's rule) from the same client draws as ``result``."""
    import dataclasses

    from .metrics import evaluate

    t = time.perf_counter()
    post = dataclasses.replace(algo, pooling="product", beta=None).posterior(
        result.context, result.server_state, result.client_states)
    m = evaluate(post, *test)
    row = {"method": name.replace(")", ", plain product)") if name.endswith(")") else name + " (plain product)",
           "rounds": len(result.history)}
    row.update({k: m[k] for k in ("accuracy", "nll", "ece") if k in m})
    row["time_s"] = time.perf_counter() - t
    row["compile_s"] = 0.0
    return row
