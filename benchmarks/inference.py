"""Client inference backends: cost and sampling efficiency, measured side by side in one run.

1. Sampler step vs bare minibatch gradient. Each SG-MCMC backend (SGLD,
   SGLD with the RMSprop preconditioner, SGHMC, CyclicalSGHMC, IASG) runs
   ``steps`` steps on one client (all training rows of the embedded digits)
   and is timed against a ``lax.scan`` of ``jax.grad(potential.log_density)``
   (benchmarks/floor.py, shared with benchmarks/scale.py)
   with the same batch size and number of steps (minibatch sampling
   included in both): ratio = sampler time per step / bare gradient time
   per step (1.0 is the floor, the target is <= 1.3). A second floor adds
   the one ``N(0, I)`` draw over the flat vector that every noise-injecting
   sampler needs per step: on CPU the threefry normals cost about as much as
   a small model's minibatch gradient, so that column says how much of the
   gap is the sampler's own overhead. Models: softmax regression (d = 650,
   batch 32 and 256) and ``bnn_mlp(hidden_sizes=(100,))`` (d = 7510, batch 32).
2. Vmapped clients vs a Python loop. SGHMC on softmax regression over 10 and
   50 iid clients of the digits: ``backend.run_clients`` (one compiled,
   vmapped call) vs a Python loop calling one jitted single-client ``run``
   per client. Ratio = loop / vmapped (> 1: vmapping wins).
3. ESS per second. NUTS vs SGHMC vs CyclicalSGHMC on Bayesian logistic
   regression (UCI Credit Approval when the data folder exists, else the
   digits 1 vs 8), 4 chains as 4 vmapped runs; bulk ESS (ArviZ) of every
   parameter; min and median over parameters divided by the wall time of
   the whole run (warm-up / burn-in included, compile excluded). The SG
   samplers (minibatch 32) run with fixed step sizes (``0.1 / lambda_max``
   equivalent, as in tests/test_samplers_real_data.py) and, in the full
   run, also with their defaults. The moment errors against the NUTS
   draws say what their ESS is worth (SG-MCMC draws carry step-size and
   minibatch bias).

Timing: ``jax.block_until_ready``; every function is called once first
(compile excluded); then the functions of a table are called in turn,
``repeats`` rounds, and each one's median (and best) wall time is kept.
Interleaving spreads load changes of a shared machine over all of them.
Every speed table also gives rates (steps or client-steps per second) and the fraction of the
device's measured copy bandwidth that the floor step's bytes take at that rate
(benchmarks/device_speed.py). The script runs unchanged on a GPU and then writes its results as
``inference_<device>`` (``inference_nvidia_h200``) beside the CPU ones.
Prints Markdown tables and writes benchmarks/results/inference.{json,md}
(not with --quick). Usage: python benchmarks/inference.py [--quick] [--sections steps,clients,...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fedprob as fp
from fedprob.inference import IASG, NUTS, SGHMC, SGLD, CyclicalSGHMC
from fedprob.potential import Potential, make_target

sys.path.insert(0, str(Path(__file__).parent))
from device_speed import bandwidth_fraction, device_facts, result_stem, step_bytes  # noqa: E402
from floor import FLOOR, GRADIENT, floor_scans, floor_steps  # noqa: E402  (benchmarks/ is not a package)


def interleaved_times(fns: dict, repeats: int, warmup: bool = True) -> tuple:
    """({name: median seconds}, {name: best seconds}, {name: last result}) of each ``fn()``.

    Every function is called once first (compile and warm-up, not timed; ``warmup=False``
    for functions compiled ahead), then all are called in turn for ``repeats`` rounds.
    """
    last = {name: fn() for name, fn in fns.items()} if warmup else {}
    ts = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            last[name] = fn()
            ts[name].append(time.perf_counter() - t)
    return ({n: float(np.median(v)) for n, v in ts.items()}, {n: float(np.min(v)) for n, v in ts.items()}, last)


def bulk_ess(draws) -> np.ndarray:
    """Bulk ESS (ArviZ) of (chains, draws, d) samples -> (d,).

    ``fedprob.diagnostics.ess`` hands the 3-D array to ``arviz.ess``, which
    ArviZ 0.23 rejects ("Only uni-dimensional ndarray variables are
    supported"), so each parameter goes to ArviZ as its own (chains, draws)
    array here.
    """
    import arviz as az

    x = np.asarray(draws, np.float64)
    out = []
    for j in range(x.shape[-1]):
        e = az.ess(x[..., j], method="bulk")
        out.append(float(np.asarray(getattr(e, "values", e))))
    return np.array(out)


def one_client(X, y, model):
    """(potential, target) of one client holding all rows (X, y)."""
    fed = fp.data.FederatedData.from_clients([(X, y)], num_classes=int(y.max()) + 1)
    pot = Potential(model, fed.X[0], fed.y[0])
    data = jax.tree_util.tree_map(lambda a: a[0], fed.client_data())
    return pot, make_target(data, pot.dim)


# -- 1. sampler step vs bare gradient ---------------------------------------------------------

def samplers(n: int, steps: int, batch: int, quick: bool) -> dict:
    """Backends running exactly ``steps`` steps (fixed step sizes: the cost does not depend on them).

    ``quick``: SGLD and IASG only (each backend costs seconds of compile; SGHMC is timed in
    the other two tables).
    """
    burn, draws = steps // 2, steps // 20
    out = {
        "SGLD": SGLD(step_size=0.1 / n, num_burnin=burn, num_samples=draws, thinning=10, batch_size=batch,
                     target_ess=0),
        "SGLD rmsprop": SGLD(step_size=0.1 / n, num_burnin=burn, num_samples=draws, thinning=10,
                             batch_size=batch, preconditioner="rmsprop", target_ess=0),
        "SGHMC": SGHMC(step_size=0.01 / n, num_burnin=burn, num_samples=draws, thinning=10, batch_size=batch,
                       target_ess=0),
        "CyclicalSGHMC": CyclicalSGHMC(step_size=0.1 / n, num_cycles=4, cycle_length=steps // 4,
                                       samples_per_cycle=5, batch_size=batch, num_burnin=0, target_ess=0),
        "IASG": IASG(step_size=0.05, num_burnin=burn, steps_per_sample=10, num_samples=draws, batch_size=batch),
    }
    if quick:
        return {k: out[k] for k in ("SGLD", "IASG")}
    return out


def step_vs_gradient(model_name: str, model, X, y, batch: int, steps: int, repeats: int, quick: bool,
                     copy_GB_per_s: float, adapted: bool = False) -> list:
    """Time per step of each sampler, of the bare minibatch gradient and of gradient + N(0, I) noise;
    steps per second and the fraction of the device's copy bandwidth that the floor step's bytes
    (XLA's bytes accessed of one gradient + noise step) take at the sampler's rate."""
    pot, target = one_client(X, y, model)
    key = jax.random.PRNGKey(0)
    z0 = pot.init(key) * 0.1

    fns = {}
    for name, f in floor_scans(pot, batch, steps).items():
        fns[name] = lambda f=f: jax.block_until_ready(f(z0, target, key))
    backends = samplers(X.shape[0], steps, batch, quick)
    if adapted:  # the default: step size estimated by power iteration during burn-in
        backends["SGLD (adapted step)"] = SGLD(num_burnin=steps // 2, num_samples=steps // 20, thinning=10,
                                               batch_size=batch, target_ess=0)
    for name, backend in backends.items():
        run = jax.jit(lambda k, t, z, b=backend: b.run(k, pot, t, z))
        fns[name] = lambda run=run: jax.block_until_ready(run(key, target, z0))
    med, _, _ = interleaved_times(fns, repeats)
    t = {name: v / steps for name, v in med.items()}
    t_grad, t_noise = t.pop(GRADIENT), t.pop(FLOOR)
    nbytes = step_bytes(floor_steps(pot, batch)[FLOOR], z0, target, key)
    return [{"model": model_name, "d": pot.dim, "batch": batch, "sampler": name, "steps": steps,
             "step_us": 1e6 * v, "bare_gradient_us": 1e6 * t_grad, "step_over_gradient": v / t_grad,
             "gradient_plus_noise_us": 1e6 * t_noise, "step_over_gradient_plus_noise": v / t_noise,
             "steps_per_s": 1 / v, "floor_bytes_per_step": nbytes,
             "bandwidth_fraction": bandwidth_fraction(nbytes, v, copy_GB_per_s)}
            for name, v in t.items()]


# -- 2. vmapped clients vs Python loop ---------------------------------------------------------

def clients_vs_loop(X, y, K: int, steps: int, repeats: int, copy_GB_per_s: float, batch: int = 32) -> dict:
    """SGHMC over ``K`` iid clients of the digits: one vmapped call against a Python loop of jitted
    single-client runs; client-steps per second of both, and the fraction of the copy bandwidth that
    the floor step's bytes take at the vmapped rate."""
    fed = fp.data.partition(X, y, num_clients=K, scheme="iid", seed=0)
    pot = Potential(fp.models.softmax_regression(num_classes=10), fed.X[0], fed.y[0])
    targets = jax.vmap(lambda d: make_target(d, pot.dim))(fed.client_data())
    backend = SGHMC(step_size=0.01 / int(fed.sizes.max()), num_burnin=steps // 2, num_samples=steps // 20,
                    thinning=10, batch_size=batch, target_ess=0)
    key = jax.random.PRNGKey(0)
    inits = jnp.zeros((K, pot.dim))
    vmapped = jax.jit(lambda k, t, z: backend.run_clients(k, pot, t, z))
    one = jax.jit(lambda k, t, z: backend.run(k, pot, t, z))
    per_client = [jax.tree_util.tree_map(lambda a, i=i: a[i], targets) for i in range(K)]
    keys = list(jax.random.split(key, K))
    fns = {"vmapped": lambda: jax.block_until_ready(vmapped(key, targets, inits)),
           "loop": lambda: jax.block_until_ready([one(keys[i], per_client[i], inits[i]) for i in range(K)])}
    med, best, _ = interleaved_times(fns, repeats)
    rate = K * steps / med["vmapped"]
    nbytes = step_bytes(floor_steps(pot, batch)[FLOOR], inits[0], per_client[0], key)
    return {"backend": "SGHMC", "clients": K, "rows_per_client": int(fed.sizes.max()), "steps": steps,
            "batch": batch, "vmapped_ms": 1e3 * med["vmapped"], "python_loop_ms": 1e3 * med["loop"],
            "loop_over_vmapped": med["loop"] / med["vmapped"],
            "loop_over_vmapped_best": best["loop"] / best["vmapped"],
            "client_steps_per_s": rate, "loop_client_steps_per_s": K * steps / med["loop"],
            "floor_bytes_per_client_step": nbytes,
            "bandwidth_fraction": bandwidth_fraction(nbytes, 1 / rate, copy_GB_per_s)}


# -- 3. ESS per second --------------------------------------------------------------------------

def data_root():
    env = os.environ.get("FEDPROB_DATA")
    if env and Path(env).is_dir():
        return Path(env)
    cand = Path(__file__).resolve().parents[2] / "shared" / "data"
    return cand if cand.is_dir() else None


def logistic_data():
    """(name, X, y): UCI Credit Approval (train rows) when the data folder exists, else digits 1 vs 8."""
    root = data_root()
    if root is not None and (root / "uci_credit_approval").is_dir():
        ds = fp.data.load_credit_approval(root)
        return "credit_approval", ds.X_train, ds.y_train
    ds = fp.data.load_digits()
    keep = (ds.y_train == 1) | (ds.y_train == 8)
    return "digits_1_vs_8", ds.X_train[keep], (ds.y_train[keep] == 8).astype(np.int32)


def ess_per_second(quick: bool, repeats: int, chains: int = 4, batch: int = 32) -> list:
    name, X, y = logistic_data()
    pot, target = one_client(X, y, fp.models.logistic_regression())
    f = 5 if quick else 1
    keys = jax.random.split(jax.random.PRNGKey(1), chains)
    inits = jnp.zeros((chains, pot.dim))

    def timed(backends: dict) -> dict:
        fns = {}
        for bname, backend in backends.items():     # compiled ahead, so no untimed warm-up run is needed
            run = jax.jit(jax.vmap(lambda k, z, b=backend: b.run(k, pot, target, z))).lower(keys, inits).compile()
            fns[bname] = lambda run=run: jax.block_until_ready(run(keys, inits))
        med, _, last = interleaved_times(fns, repeats, warmup=False)
        return {b: (med[b], np.asarray(last[b].posterior.draws, np.float64)) for b in backends}

    runs = timed({"NUTS": NUTS(num_warmup=500 // f, num_samples=1000 // f)})
    ref = runs["NUTS"][1].reshape(-1, pot.dim)
    ref_mean, ref_sd = ref.mean(0), ref.std(0)
    # Fixed steps from the largest curvature of the log posterior at the NUTS mean (SGHMC moves
    # like SGLD with step 2 eta / friction = 0.1 / lam_max), as in tests/test_samplers_real_data.py.
    H = jax.jit(jax.hessian(pot.log_density))(jnp.asarray(ref_mean, jnp.float32), target)
    lam = float(np.max(np.abs(np.linalg.eigvalsh(np.asarray(H, np.float64)))))
    sg = {
        "SGHMC (eta = 0.005 / lam_max)": SGHMC(step_size=0.005 / lam, num_burnin=2000 // f,
                                               num_samples=1000 // f, thinning=20, batch_size=batch,
                                               target_ess=0),
        "CyclicalSGHMC (eta0 = 0.02 / lam_max)": CyclicalSGHMC(
            step_size=0.02 / lam, num_cycles=10, num_steps=20000 // f, exploration=0.5,
            samples_per_cycle=100 // f, batch_size=batch, num_burnin=0, target_ess=0),
    }
    if not quick:   # the defaults (step sizes adapted during burn-in, then frozen; ESS target on)
        sg["SGHMC (defaults)"] = SGHMC(num_burnin=2000, num_samples=1000, thinning=20, batch_size=batch)
        sg["CyclicalSGHMC (defaults)"] = CyclicalSGHMC(num_cycles=10, num_steps=20000, samples_per_cycle=100,
                                                       batch_size=batch)
    runs.update(timed(sg))
    rows = []
    for bname, (t, draws) in runs.items():                                  # draws: (chains, S, d)
        ess = bulk_ess(draws)
        flat = draws.reshape(-1, pot.dim)
        z = np.abs(flat.mean(0) - ref_mean) / ref_sd
        ratio = flat.std(0) / ref_sd
        rows.append({"data": name, "d": pot.dim, "sampler": bname, "chains": chains,
                     "draws_per_chain": draws.shape[1], "wall_s": t,
                     "min_ess": float(ess.min()), "median_ess": float(np.median(ess)),
                     "min_ess_per_s": float(ess.min()) / t, "median_ess_per_s": float(np.median(ess)) / t,
                     "max_abs_mean_err_sd": float(z.max()), "sd_ratio_min": float(ratio.min()),
                     "sd_ratio_max": float(ratio.max())})
    return rows


# -- 4. ESS per 1,000 gradients: preconditioning and control variates ------------------------------

def conditioned_client(rho: float, n: int = 2000, d: int = 5, seed: int = 0):
    """(potential, target, exact mean, exact sd) of a conjugate regression (noise 0.5, prior N(0, 1)) on
    one client of ``n`` rows whose ``d`` features are equicorrelated at ``rho`` and shifted by 1."""
    from fedprob.potential import ClientData
    rng = np.random.default_rng(seed)
    L = np.linalg.cholesky(np.full((d, d), rho) + (1 - rho) * np.eye(d))
    X = (rng.normal(size=(n, d)) @ L.T + 1.0).astype(np.float32)
    y = (X @ rng.normal(size=d) + 0.5 * rng.normal(size=n)).astype(np.float32)
    model = fp.models.linear_regression(noise_scale=0.5, bias=False)
    pot = Potential(model, X, y)
    P = np.eye(d) + X.T.astype(np.float64) @ X / 0.25
    cov = np.linalg.inv(P)
    mean = cov @ (X.T.astype(np.float64) @ y / 0.25)
    target = make_target(ClientData(jnp.asarray(X), jnp.asarray(y), jnp.asarray(n)), d)
    return pot, target, mean, np.sqrt(np.diag(cov)), float(np.linalg.cond(P))


def ess_per_gradient(quick: bool, batch: int = 32) -> list:
    """ESS (smallest over coordinates, one chain) per 1,000 minibatch gradients of ``batch`` rows, for
    SGLD, SGLD-CV, SGHMC, preconditioned SGHMC (without and with the control variate: the default) and
    cyclical SGHMC, the others with ``precondition=None``, on a well- and an ill-conditioned client.
    Every sampler runs at its defaults apart from the named option, a fixed length (ESS stretch off) and
    ``batch_size``; gradients: steps x (2 with the control variate, else 1), plus the pre-pass (the
    mode search's L-BFGS steps, counted as MODE_STEPS although the search stops once its loss stalls,
    so an upper bound, and ``d`` Hessian-vector products counted as 2 gradients each, on the full
    batch: ``n / batch`` minibatch gradients apiece)."""
    from fedprob.inference.sgmcmc.precondition import MODE_STEPS
    f = 4 if quick else 1
    burn, samples, thin = 1000 // f, 1000 // f, 5
    steps = burn + samples * thin
    common = dict(batch_size=batch, target_ess=0, num_burnin=burn)
    runs = {
        "SGLD": (SGLD(precondition=None, num_samples=samples, thinning=thin, **common), 1, False),
        "SGLD-CV": (SGLD(precondition=None, control_variate=True, num_samples=samples, thinning=thin, **common), 2,
                    True),
        "SGHMC": (SGHMC(precondition=None, num_samples=samples, thinning=thin, **common), 1, False),
        "SGHMC preconditioned": (SGHMC(precondition="full", control_variate=False, num_samples=samples,
                                       thinning=thin, **common), 1, True),
        "SGHMC preconditioned + CV (default)": (SGHMC(num_samples=samples, thinning=thin, **common), 2, True),
        "CyclicalSGHMC": (CyclicalSGHMC(precondition=None, num_steps=samples * thin, num_cycles=10,
                                        samples_per_cycle=samples // 10, **common), 1, False),
    }
    clients = (("well-conditioned (rho = 0)", 0.0), ("ill-conditioned (rho = 0.95)", 0.95))
    if quick:       # CI size: the ill-conditioned client, plain against preconditioned SGHMC
        clients = clients[1:]
        runs = {k: runs[k] for k in ("SGHMC", "SGHMC preconditioned + CV (default)")}
    rows = []
    for label, rho in clients:
        pot, target, mean, sd, cond = conditioned_client(rho)
        n, d = int(target.data.n), pot.dim
        for name, (backend, per_step, prepass) in runs.items():
            run = jax.jit(lambda k, b=backend: b.run(k, pot, target, jnp.zeros(d)))
            res = jax.block_until_ready(run(jax.random.PRNGKey(0)))
            t = time.perf_counter()
            res = jax.block_until_ready(run(jax.random.PRNGKey(1)))
            wall = time.perf_counter() - t
            draws = np.asarray(res.posterior.draws, np.float64)
            ess = bulk_ess(draws[None])
            grads = steps * per_step + (MODE_STEPS + 2 * d) * n / batch * prepass
            z = np.abs(draws.mean(0) - mean) / sd
            ratio = draws.std(0, ddof=1) / sd
            rows.append({"client": label, "condition_number": round(cond), "sampler": name, "steps": steps,
                         "gradients": int(round(grads)), "min_ess": round(float(ess.min()), 1),
                         "ess_per_1000_gradients": round(1000 * float(ess.min()) / grads, 2),
                         "wall_s": round(wall, 3), "max_abs_mean_err_sd": round(float(z.max()), 3),
                         "sd_ratio_min": round(float(ratio.min()), 3), "sd_ratio_max": round(float(ratio.max()), 3)})
            print(rows[-1], flush=True)
    return rows


SECTIONS = ("steps", "clients", "ess", "ess_per_gradient")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="any of " + ", ".join(SECTIONS) + "; a subset writes inference_<sections>.{json,md}")
    args = p.parse_args(argv)
    chosen = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    quick = args.quick
    reps = 3 if quick else 9
    facts = device_facts(2**26 if quick else None)       # the device and its measured copy bandwidth
    bw = facts["copy_GB_per_s"]
    ds = fp.data.load_digits()
    X, y = ds.X_train, ds.y_train
    t0, c0 = time.perf_counter(), time.process_time()
    sections, marks = {}, [(t0, c0)]

    def mark(name):
        t, c = time.perf_counter(), time.process_time()
        sections[name] = {"wall_s": round(t - marks[-1][0], 1), "cpu_s": round(c - marks[-1][1], 1)}
        marks.append((t, c))

    softmax = fp.models.softmax_regression(num_classes=10)
    step_rows, client_rows, ess_rows, grad_rows = [], [], [], []
    if "steps" not in chosen:
        pass
    elif quick:
        step_rows = step_vs_gradient("softmax_regression", softmax, X, y, 32, 200, reps, quick, bw)
    else:
        step_rows = step_vs_gradient("softmax_regression", softmax, X, y, 32, 2000, reps, False, bw, adapted=True)
        step_rows += step_vs_gradient("softmax_regression", softmax, X, y, 256, 1000, reps, False, bw)
        step_rows += step_vs_gradient("bnn_mlp(100)", fp.models.bnn_mlp(hidden_sizes=(100,), num_classes=10),
                                      X, y, 32, 1000, 5, False, bw)
    mark("steps")
    if "clients" in chosen:
        client_rows = [clients_vs_loop(X, y, K, 100 if quick else 400, 5 if quick else reps, bw)
                       for K in ((10,) if quick else (10, 50))]
    mark("clients")
    if "ess" in chosen:
        ess_rows = ess_per_second(quick, 1 if quick else 3)
    mark("ess")
    if "ess_per_gradient" in chosen:
        grad_rows = ess_per_gradient(quick)
    mark("ess_per_gradient")

    meta = {"backend": jax.default_backend(), "devices": str(jax.devices()), "cpu_count": os.cpu_count(),
            "device": facts["device"], "copy_GB_per_s": bw, "chosen_sections": chosen,
            "python": platform.python_version(), "jax": jax.__version__,
            "numpyro": __import__("numpyro").__version__, "quick": quick,
            "total_wall_s": round(time.perf_counter() - t0, 1),
            "total_cpu_s": round(time.process_time() - c0, 1), "sections": sections,
            "load_average": [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None}
    md = [f"Device: {facts['device']} ({facts['backend']}), measured copy bandwidth {bw} GB/s "
          "(benchmarks/device_speed.py).", "",
          "## SG-MCMC step vs bare minibatch gradient (one client; limit 1.0, target <= 1.3)", "",
          fp.report.format_table(step_rows), "",
          "step_over_gradient_plus_noise: against the gradient plus one N(0, I) draw over the flat vector "
          "(the floor for a noise-injecting sampler; IASG injects none). floor_bytes_per_step: XLA's bytes "
          "accessed of one gradient + noise step (an upper estimate of its traffic: a gather is charged its "
          "whole operand); bandwidth_fraction: those bytes at the sampler's steps_per_s over the measured "
          "copy bandwidth.", "",
          "## Vmapped clients vs Python loop over clients (SGHMC, softmax regression, d = 650)", "",
          fp.report.format_table(client_rows), "",
          "loop_over_vmapped from medians; _best from the fastest repeat of each; client_steps_per_s: clients x "
          "steps / the vmapped call's time (loop_client_steps_per_s: the loop's); bandwidth_fraction: the "
          "floor step's bytes at the vmapped rate over the measured copy bandwidth.", "",
          "## ESS per second (logistic regression, vmapped chains, wall time includes warm-up / burn-in)", "",
          fp.report.format_table(ess_rows), "",
          "Moment errors are against the NUTS draws of the same run (max over parameters of "
          "|mean - NUTS mean| / NUTS sd; range of sd / NUTS sd).", "",
          "## ESS per 1,000 minibatch gradients: preconditioning and control variates (batch 32, n = 2,000, "
          "d = 5, conjugate regression)", "",
          fp.report.format_table(grad_rows), "",
          "Smallest bulk ESS over coordinates of one chain; gradients count the pre-pass of the preconditioned "
          "and control-variate runs (50 L-BFGS steps and d Hessian-vector products on the full batch, 2 "
          "gradients each, in units of minibatch gradients). Errors against the exact posterior.", "",
          f"machine: {meta}"]
    text = "\n".join(md)
    print(text)
    if not quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = result_stem("inference" if chosen == list(SECTIONS) else "inference_" + "_".join(chosen))
        (out / f"{stem}.json").write_text(json.dumps(
            {"steps": step_rows, "clients": client_rows, "ess": ess_rows, "ess_per_gradient": grad_rows, "meta": meta}, indent=2))
        (out / f"{stem}.md").write_text(text + "\n")
    return {"steps": step_rows, "clients": client_rows, "ess": ess_rows, "ess_per_gradient": grad_rows, "meta": meta}


if __name__ == "__main__":
    main()
