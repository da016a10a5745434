"""fedprob's ServerApp for Flower's Deployment Engine (``fedprob.flower.serverapp:app``).

Run configuration (written by ``fedprob flower app``, :mod:`.appdir`):
``fedprob-config`` (the fedprob TOML text: the same file ``fedprob run``
takes, plus an optional ``[flower]`` table, :mod:`.spec`) and ``out-dir``
(the run directory, on the SuperLink's machine). The ServerApp builds the
algorithm and model, runs :class:`.strategy.FedprobStrategy` over the
connected SuperNodes (one client per node), streams one line per round to
``flwr run --stream``, evaluates the posterior on the data set's test split
when it loads on the server (``[flower] evaluate``), and writes the run
directory ``fedprob run`` writes (``fedprob report`` reads it), plus
``deployment.json``: the node ids, set-up and per-round seconds, the array
bytes sent to and received from the nodes per round, the longest node
computation per round (``node_compute_s``: the rest of a round is Flower's), and the shape of every
array each reply carried.
"""
from __future__ import annotations

import json
import os
import time
from logging import INFO, WARNING

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.serverapp import ServerApp  # noqa: E402

app = ServerApp()


def run(grid, text: str, out_dir: str):
    """Run the fedprob configuration ``text`` over ``grid``; write the run directory ``out_dir``."""
    from flwr.common.logger import log

    from ..rundir import save_run
    from . import spec
    from .strategy import FedprobStrategy

    t0 = time.perf_counter()
    cfg = spec.parse(text)
    fl = spec.flower_options(cfg)
    algo, model, mkw, run_kw = spec.build_parts(cfg)
    strat = FedprobStrategy(algo, model, {k: v for k, v in cfg.items() if k != "flower"}, model_kwargs=mkw,
                            rounds=run_kw["rounds"], seed=run_kw["seed"],
                            clients_per_round=run_kw["clients_per_round"], faults=run_kw["faults"],
                            on_missing=fl["on_missing"], num_nodes=fl["num_nodes"], node_wait_s=fl["node_wait_s"],
                            round_timeout_s=fl["round_timeout_s"],
                            num_classes=cfg.get("model", {}).get("num_classes"))
    strat.start(grid)
    test = None
    if fl["evaluate"]:
        try:
            test = spec.load_dataset(cfg).test
        except Exception as e:  # noqa: BLE001 - evaluation is optional on the server
            log(WARNING, "fedprob: no evaluation (the test data does not load here: %s)", e)
    result = strat.result(test)
    total = time.perf_counter() - t0
    out = save_run(out_dir, result, cfg, total, name=type(algo).__name__, overwrite=True)
    (out / "deployment.json").write_text(json.dumps({
        "nodes": [int(n) for n in strat.nodes], "client_sizes": strat.sizes.tolist(), "total_s": total,
        **strat.timings, "round_s": [h["time"] for h in strat.history],
        "bytes_sent": [h["bytes_sent"] for h in strat.history],
        "bytes_received": [h["bytes_received"] for h in strat.history],
        "node_compute_s": [h["node_compute_s"] for h in strat.history],
        "reply_shapes": [[r, k, [list(s) for s in shapes]] for r, k, shapes in strat.reply_shapes]}, indent=1))
    last = result.history[-1] if result.history else {}
    shown = {k: f"{v:.4g}" for k, v in last.items() if k in ("accuracy", "nll", "rmse")}
    log(INFO, "fedprob: %s done in %.1f s %s; run directory: %s", type(algo).__name__, total, shown, out_dir)
    return result


@app.main()
def main(grid, context) -> None:
    cfg = context.run_config
    run(grid, str(cfg["fedprob-config"]), str(cfg["out-dir"]))


__all__ = ["app", "run"]
