"""Engine cost, measured side by side in one run.

1. One FedAvg round with the clients vmapped in one compiled function, vs a
   Python loop calling the same compiled single-client update once per
   client (then the same server update), for 10 and 100 clients.
2. One local client step (minibatch sampling, gradient, optax update, step
   masking inside ``lax.scan``) vs the bare minibatch gradient of the same
   potential scanned the same number of times.

Prints a Markdown table of ratios and writes benchmarks/results/engine.{json,md}.
Usage: python benchmarks/engine.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fedprob as fp
from fedprob.algorithms.base import Context
from fedprob.engine import local
from fedprob.potential import make_target
from fedprob.run import get_potential


def synthetic_federation(K: int, n: int, d: int = 64, C: int = 10, seed: int = 0):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(d, C))
    X = rng.normal(size=(K * n, d)).astype(np.float32)
    y = np.argmax(X @ W + rng.gumbel(size=(K * n, C)), 1)
    return fp.data.partition(X, y, num_clients=K, scheme="iid", seed=seed)


def interleaved_times(fns, repeats: int) -> list:
    """Seconds of each of ``fns`` over ``repeats`` rounds, run in turn within each round (after one
    warm call each), so that a swing in the machine's load hits every function alike."""
    for fn in fns:
        fn()
    ts = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, ts):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return ts


def round_vs_loop(K: int, n: int, steps: int, repeats: int) -> dict:
    fed = synthetic_federation(K, n)
    model = fp.models.softmax_regression(num_classes=10)
    algo = fp.algorithms.FedAvg(local_steps=steps, batch_size=32, learning_rate=0.1)
    pot = get_potential(model, fed)
    ctx = Context(pot, K, fed.sizes, fed.num_rows)
    data = fed.client_data()
    key = jax.random.PRNGKey(0)
    server, clients = algo.init(ctx, key, data)
    rnd, _ = local.compiled_round(algo, ctx, K, None, server, clients, data, key)

    def vmapped():
        jax.block_until_ready(rnd(server, clients, data, key)[0])

    one = jax.jit(lambda s, d, k: algo.client_update(ctx, s, (), d, k)[1])
    agg = jax.jit(lambda s, m, w, mask: algo.server_update(ctx, s, m, w, mask))
    per_client = [jax.tree_util.tree_map(lambda a, i=i: a[i], data) for i in range(K)]
    keys = [jax.random.fold_in(key, i) for i in range(K)]
    mask = jnp.ones((K,), bool)

    def loop():
        msgs = [one(server, per_client[i], keys[i]) for i in range(K)]
        jax.block_until_ready(agg(server, jnp.stack(msgs), data.n, mask))

    tv, tl = interleaved_times([vmapped, loop], repeats)
    t_v, t_l = float(np.median(tv)), float(np.median(tl))
    return {"clients": K, "rows_per_client": n, "local_steps": steps, "vmapped_round_ms": 1e3 * t_v,
            "python_loop_round_ms": 1e3 * t_l, "loop_over_vmapped": t_l / t_v,
            "loop_over_vmapped_best": min(tl) / min(tv)}


def step_vs_gradient(model_name: str, n: int, steps: int, repeats: int) -> dict:
    """Per-step time of FedAvg's local step vs the bare minibatch gradient (both sample their batch)."""
    fed = synthetic_federation(1, n)
    model = (fp.models.softmax_regression(num_classes=10) if model_name == "softmax"
             else fp.models.bnn_mlp(hidden_sizes=(100,), num_classes=10))
    pot = get_potential(model, fed)
    ctx = Context(pot, 1, fed.sizes, fed.num_rows)
    data = jax.tree_util.tree_map(lambda a: a[0], fed.client_data())
    algo = fp.algorithms.FedAvg(local_steps=steps, batch_size=32, learning_rate=0.1)
    key = jax.random.PRNGKey(0)
    w0 = pot.init(key)
    client = jax.jit(lambda w, k: algo.client_update(ctx, (w, None), (), data, k)[1])
    target = make_target(data, pot.dim, prior_weight=1.0)

    @jax.jit
    def bare(w, key):
        def body(w, t):
            g = jax.grad(pot.log_density)(w, target, jax.random.fold_in(key, t), 32)
            return w + 1e-6 * g, None

        return jax.lax.scan(body, w, jnp.arange(steps))[0]

    ts, tg = interleaved_times([lambda: jax.block_until_ready(client(w0, key)),
                                lambda: jax.block_until_ready(bare(w0, key))], repeats)
    t_step, t_grad = float(np.median(ts)) / steps, float(np.median(tg)) / steps
    return {"model": f"{model_name} (d={pot.dim})", "batch_size": 32, "steps": steps,
            "client_step_us": 1e6 * t_step, "bare_gradient_us": 1e6 * t_grad,
            "step_over_gradient": t_step / t_grad}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    reps = 9 if args.quick else 10      # quick: best of 9, the 100-client ratio read 0.61-1.26 as best of 3
    steps = 10 if args.quick else 50
    rows = [round_vs_loop(K, 100, steps, reps) for K in (10, 100)]
    step = [step_vs_gradient(m, 1000, 200 if not args.quick else 50, reps) for m in ("softmax", "mlp")]
    meta = {"backend": jax.default_backend(), "devices": str(jax.devices()), "cpu_count": __import__("os").cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__, "quick": args.quick}
    md = ["## Vmapped round vs Python loop over clients (FedAvg, softmax regression, d=650)", "",
          fp.report.format_table(rows), "", "## Local client step vs bare minibatch gradient", "",
          fp.report.format_table(step), "", f"machine: {meta}"]
    text = "\n".join(md)
    print(text)
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine.json").write_text(json.dumps({"rounds": rows, "step": step, "meta": meta}, indent=2))
        (out / "engine.md").write_text(text + "\n")
    return rows, step


if __name__ == "__main__":
    main()
