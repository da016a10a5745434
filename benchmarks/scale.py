"""Scale: orchestration cost, clients, memory and sampler steps, measured side by side in one run.

1. Per-round orchestration, local engine vs Flower simulation. FedAvg
   (5 local SGD steps, batch 16) on logistic regression over 10 and 100
   clients, through ``fp.run(engine=fp.engine.Local())`` and ``fp.run(engine=fp.engine.Flower())``
   (one SuperNode per client, Ray backend, one CPU per client). Local: the
   per-round times of ``Result.history`` of a run whose round is already
   compiled, taken before and after the Flower run (median and best over
   both). Flower: the ServerApp's calls to ``grid.send_and_receive`` are
   time-stamped, which splits the run into start-up (``fp.run`` called to
   first message out: Ray, SuperNodes, server init), round 1 (includes each
   Ray worker compiling the client update), the later rounds (per-round
   cost, median) and shut-down. Ratio = Flower per round / local per round.
2. Time vs number of clients. ``OneShotAverage`` with SGLD clients (fixed
   step, ``steps`` steps of batch 8, ESS target off) on logistic regression
   with 20 rows per client, for 10 to 10,000 clients, in one compiled client
   phase (vmapped; ``client_chunk`` clients at a time with ``lax.map`` for
   the large counts). Seconds per round (the client phase plus the server
   round, ``Result.history``, compile excluded: the second ``fp.run`` of the
   same inputs reuses the compiled functions) and microseconds per
   client-step (round time / (clients * steps)).
3. Memory with and without ``client_chunk``: the compiled client phase's
   ``memory_analysis()`` (argument, output and temporary bytes: deterministic,
   from the compiler) and, in the full run, the peak resident set size
   (``VmHWM``, reset after imports and data) of a fresh process running the same
   ``fp.run`` at 10,000 clients.
4. Sampler step vs bare minibatch gradient and vs the floor "bare gradient +
   one N(0, I) draw over the flat vector" (what every noise-injecting sampler
   must do per step): SGLD, SGHMC, CyclicalSGHMC (fixed step sizes, ESS target
   off, so the step count is exact) on one client holding the digits training
   rows, softmax regression (batch 64, 20,000 steps), ``bnn_mlp(hidden_sizes=(100,))``
   and ``cnn`` (batch 256), run through ``fp.run(OneShotAverage(client=sampler))``;
   time = ``Result.info["client_phase_s"]`` (the compiled client phase call, compile
   excluded) / steps, with ``progress=False`` (the chains' progress reports are
   left out of the compiled phase) and ``progress=True`` (a bar fed by about 25
   host calls per chain); ``vmapped``: the client phase vmapped over the batch of
   one client, with the reports, as ``fp.run`` ran it before (the "before" of
   :mod:`fedprob.client_map` and of leaving the reports out; neither in --quick).
   The baselines (benchmarks/floor.py) are ``lax.scan`` s of
   ``jax.grad(potential.log_density)`` (and of it plus ``jax.random.normal``)
   over the same number of steps, minibatch sampling included. Targets:
   <= 1.15 x the floor for noise-injecting samplers; <= 1.3 x the bare
   gradient where the gradient dominates (batch >= 256, MLP, CNN).

Timing: ``jax.block_until_ready``; every function runs once first (compile
excluded); then the functions of a table are called in turn for ``repeats``
rounds, and each one's median and best wall time kept; ratios are of
medians (and of bests). The results are of a CPU shared with other work
(see ``meta``): only the ratios, measured side by side, are comparable.
Every table also gives rates (client-steps per second, steps per second) and the fraction of
the device's measured copy bandwidth that the floor step's bytes take at that rate
(benchmarks/device_speed.py). The script runs unchanged on a GPU: there the sampler steps are
timed by wall clock, and the results are written as ``scale_<device>`` (``scale_nvidia_h200``)
beside the CPU ones.
Prints Markdown tables; the full run writes benchmarks/results/scale.{json,md}.
``--sections steps`` (any of orchestration, clients, memory, steps) runs only those and writes
``scale_<sections>.{json,md}`` instead. Usage: python benchmarks/scale.py [--quick] [--out DIR]
[--no-flower] [--sections ...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

import fedprob as fp
from fedprob.algorithms.base import Context
from fedprob.engine import client_phase
from fedprob.inference import SGHMC, SGLD, CyclicalSGHMC
from fedprob.potential import make_target
from fedprob.run import get_potential

sys.path.insert(0, str(Path(__file__).parent))
from device_speed import bandwidth_fraction, device_facts, result_stem, step_bytes  # noqa: E402
from floor import FLOOR, GRADIENT, floor_scans, floor_steps  # noqa: E402  (benchmarks/ is not a package)


def interleaved_times(fns: dict, repeats: int) -> tuple:
    """({name: [seconds]}, {name: last result}) of each ``fn()``: each runs once first (not timed),
    then all in turn for ``repeats`` rounds. ``fn`` may return ``(seconds, value)`` to report its own
    time (a time measured inside ``fp.run``), else its wall time is taken."""
    last = {name: fn() for name, fn in fns.items()}
    ts = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], float):
                dt, out = out
            last[name] = out
            ts[name].append(dt)
    return ts, last


def med(v) -> float:
    return float(np.median(v))


def synthetic_logistic(K: int, n: int, d: int = 10, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=d)
    X = rng.normal(size=(K * n, d)).astype(np.float32)
    y = (X @ w + rng.logistic(size=K * n) > 0).astype(np.int32)
    return fp.data.partition(X, y, num_clients=K, scheme="iid", seed=seed)


# -- 1. local engine vs Flower simulation --------------------------------------------------------

class _TimedGrid:
    """A Flower grid that time-stamps every ``send_and_receive`` (one per fedprob round)."""

    def __init__(self, grid, marks: list):
        self._grid, self._marks = grid, marks

    def get_node_ids(self, wait_s: float = 120.0):
        """The SuperNodes' ids, waiting (up to ``wait_s``) until some have registered: right after
        start-up the simulation may list none yet."""
        t0 = time.perf_counter()
        ids = list(self._grid.get_node_ids())
        while not ids and time.perf_counter() - t0 < wait_s:
            time.sleep(0.05)
            ids = list(self._grid.get_node_ids())
        self._marks.append(("nodes", time.perf_counter()))
        return ids

    def send_and_receive(self, *args, **kwargs):
        self._marks.append(("send", time.perf_counter()))
        return self._grid.send_and_receive(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._grid, name)


def flower_rounds(algo, model, fed, rounds: int) -> dict:
    """``fp.run(engine=fp.engine.Flower())`` with the ServerApp's rounds time-stamped."""
    from flwr.serverapp import ServerApp

    from fedprob.engine import flower

    marks: list = []
    inner_factory = flower.server_app

    def timed_server_app(*args, **kwargs):
        inner = inner_factory(*args, **kwargs)
        outer = ServerApp()

        @outer.main()
        def main(grid, context):
            inner(_TimedGrid(grid, marks), context)
            marks.append(("end", time.perf_counter()))

        return outer

    flower.server_app = timed_server_app
    try:
        t0 = time.perf_counter()
        res = fp.run(algo, model, fed, rounds=rounds, engine=fp.engine.Flower(), progress=False)
        t_end = time.perf_counter()
    finally:
        flower.server_app = inner_factory
    sends = [t for name, t in marks if name == "send"]
    end = [t for name, t in marks if name == "end"][-1]
    bounds = sends + [end]
    per_round = np.diff(bounds)
    return {"startup_s": sends[0] - t0, "round1_s": float(per_round[0]),
            "later_rounds_s": [float(x) for x in per_round[1:]], "shutdown_s": t_end - end,
            "fp_run_s": t_end - t0, "history_rounds": len(res.history)}


def local_round_times(algo, model, fed, rounds: int) -> list:
    res = fp.run(algo, model, fed, rounds=rounds, progress=False)
    return [h["time"] for h in res.history]


def local_vs_flower(K: int, local_rounds: int, flower_rounds_n: int, with_flower: bool) -> dict:
    fed = synthetic_logistic(K, 50)
    model = fp.models.logistic_regression()
    algo = fp.algorithms.FedAvg(local_steps=5, batch_size=16, learning_rate=0.1)
    t0 = time.perf_counter()
    first = fp.run(algo, model, fed, rounds=1, progress=False)       # compiles
    local_startup = time.perf_counter() - t0
    times = local_round_times(algo, model, fed, local_rounds)
    row = {"clients": K, "local_compile_s": first.compile_time, "local_startup_s": local_startup}
    flower_note = None
    if with_flower:
        try:
            fl = flower_rounds(algo, model, fed, flower_rounds_n)
        except Exception as e:   # reported in the table, not hidden
            fl, flower_note = None, f"Flower simulation failed: {type(e).__name__}: {e}"
        times += local_round_times(algo, model, fed, local_rounds)  # local again, after Flower
    else:
        fl = None
    row |= {"local_round_ms": 1e3 * med(times), "local_round_best_ms": 1e3 * min(times)}
    if fl is not None:
        later = fl["later_rounds_s"] or [fl["round1_s"]]
        row |= {"flower_startup_s": fl["startup_s"], "flower_round1_s": fl["round1_s"],
                "flower_round_s": med(later), "flower_round_best_s": min(later),
                "flower_rounds": fl["history_rounds"], "flower_shutdown_s": fl["shutdown_s"],
                "flower_over_local": med(later) / med(times),
                "flower_over_local_best": min(later) / min(times)}
    return row | ({"note": flower_note} if flower_note else {})


# -- 2. time vs number of clients ---------------------------------------------------------------

def sgld_clients(steps: int) -> SGLD:
    burn = steps // 2
    return SGLD(step_size=1e-3, num_burnin=burn, num_samples=(steps - burn) // 5, thinning=5, batch_size=8,
                target_ess=0)


def client_scaling(counts, chunks: dict, steps: int, repeats: int, copy_GB_per_s: float) -> tuple:
    """Rows of seconds per round / us per client-step / client-steps per second and the fraction of the
    device's copy bandwidth that the floor step's bytes (benchmarks/device_speed.py) at that rate take;
    also returns the runs (for the memory table)."""
    model = fp.models.logistic_regression()
    algo = fp.algorithms.OneShotAverage(client=sgld_clients(steps))
    feds = {K: synthetic_logistic(K, 20) for K in counts}

    def run_of(K):
        def f():
            r = fp.run(algo, model, feds[K], engine=fp.engine.Local(client_chunk=chunks.get(K)), progress=False)
            return float(r.history[0]["time"]), r
        return f

    ts, last = interleaved_times({K: run_of(K) for K in counts}, repeats)
    one = feds[counts[0]]
    pot = get_potential(model, one)
    target = make_target(jax.tree_util.tree_map(lambda a: a[0], one.client_data()), pot.dim)
    nbytes = step_bytes(floor_steps(pot, 8)[FLOOR], pot.init(jax.random.PRNGKey(0)), target,
                        jax.random.PRNGKey(0))
    rows = []
    for K in counts:
        t = med(ts[K])
        rate = K * steps / t
        rows.append({"clients": K, "client_chunk": chunks.get(K) or "-", "steps": steps, "batch": 8,
                     "round_s": t, "round_best_s": min(ts[K]),
                     "us_per_client_step": 1e6 * t / (K * steps),
                     "us_per_client_step_best": 1e6 * min(ts[K]) / (K * steps),
                     "client_steps_per_s": rate, "floor_bytes_per_client_step": nbytes,
                     "bandwidth_fraction": bandwidth_fraction(nbytes, 1 / rate, copy_GB_per_s),
                     "compile_s": float(last[K].compile_time)})
    base = rows[0]["us_per_client_step"]
    for r in rows:
        r["per_client_step_vs_first"] = r["us_per_client_step"] / base
    return rows, (algo, model, feds)


# -- 3. memory with and without chunking --------------------------------------------------------

def phase_memory(algo, model, fed, chunk) -> dict:
    """memory_analysis() of the compiled client phase that ``fp.run`` uses for these inputs."""
    pot = get_potential(model, fed)
    K = fed.num_clients
    ctx = Context(pot, K, np.asarray(fed.sizes), fed.num_rows)
    data = fed.client_data()
    keys = jax.random.split(jax.random.PRNGKey(0), K)
    fn, _ = client_phase.compiled_phase(algo, ctx, data, keys, jax.random.PRNGKey(1), chunk)
    m = fn.memory_analysis()
    return {"argument_MB": m.argument_size_in_bytes / 2**20, "output_MB": m.output_size_in_bytes / 2**20,
            "temp_MB": m.temp_size_in_bytes / 2**20}


RSS_CODE = """
import sys
sys.path.insert(0, {here!r})
import numpy as np
import fedprob as fp
from scale import synthetic_logistic, sgld_clients
K, chunk, steps = {K}, {chunk}, {steps}
fed = synthetic_logistic(K, 20)

def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

before = status_kb("VmRSS")
with open("/proc/self/clear_refs", "w") as f:     # reset the peak (VmHWM) to the current RSS
    f.write("5")
fp.run(fp.algorithms.OneShotAverage(client=sgld_clients(steps)), fp.models.logistic_regression(), fed,
       engine=fp.engine.Local(client_chunk=chunk), progress=False)
print(before, status_kb("VmHWM"))
"""


def peak_rss_mb(K: int, chunk, steps: int) -> tuple:
    """(RSS in MB before fp.run, peak RSS during it: compile and run) of a fresh process (Linux)."""
    code = RSS_CODE.format(here=str(Path(__file__).parent), K=K, chunk=chunk, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split()[-2:])
    return before / 1024, after / 1024        # kB


def memory_table(algo, model, feds, cases, steps: int, rss: bool) -> list:
    rows = []
    for K, chunk in cases:
        row = {"clients": K, "client_chunk": chunk or "-"} | phase_memory(algo, model, feds[K], chunk)
        if rss and K == max(k for k, _ in cases):
            before, after = peak_rss_mb(K, chunk, steps)
            row |= {"rss_before_run_MB": before, "peak_rss_MB": after, "run_rss_MB": after - before}
        rows.append(row)
    return rows


# -- 4. sampler step vs bare gradient and vs gradient + noise ------------------------------------

def samplers(n: int, steps: int, batch: int, scale: float) -> dict:
    burn, draws = steps // 2, steps // 20
    return {
        "SGLD": SGLD(step_size=scale * 0.1 / n, num_burnin=burn, num_samples=draws, thinning=10,
                     batch_size=batch, target_ess=0),
        "SGHMC": SGHMC(step_size=scale * 0.01 / n, num_burnin=burn, num_samples=draws, thinning=10,
                       batch_size=batch, target_ess=0),
        "CyclicalSGHMC": CyclicalSGHMC(step_size=scale * 0.1 / n, num_cycles=4, cycle_length=steps // 4,
                                       samples_per_cycle=5, batch_size=batch, num_burnin=0, target_ess=0),
    }


class _TimedPhase:
    """A compiled client phase that logs (CPU seconds, wall seconds) of each call."""

    def __init__(self, fn, log: list):
        self.fn, self.log = fn, log

    def __call__(self, *args):
        c, w = time.process_time(), time.perf_counter()
        out = jax.block_until_ready(self.fn(*args))
        self.log.append((time.process_time() - c, time.perf_counter() - w))
        return out


def run_phase_timed(algo, model, fed, progress: bool = False) -> tuple:
    """``fp.run(algo, model, fed, progress=progress)``; returns ((CPU s, wall s) of its client phase
    call, result)."""
    log: list = []
    orig = client_phase.compiled_phase

    def timed(*args, **kwargs):
        fn, dt = orig(*args, **kwargs)
        return _TimedPhase(fn, log), dt

    client_phase.compiled_phase = timed
    try:
        r = fp.run(algo, model, fed, progress=progress)
    finally:
        client_phase.compiled_phase = orig
    return log[-1], r


def cpu_and_wall(fn):
    c, w = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.process_time() - c, time.perf_counter() - w


def sampler_steps(model_name: str, model, X, y, batch: int, steps: int, repeats: int, names,
                  copy_GB_per_s: float, scale: float = 1.0, direct: bool = True) -> list:
    """Per-step time of each sampler through fp.run (and jitted on its own, and vmapped over the batch
    of one client as fp.run ran it before one client ran unbatched) against the bare gradient and the
    floor. The primary clock is process CPU time on a CPU backend (robust to other work on a shared
    machine) and wall time on an accelerator (where the host mostly waits); wall-time ratios are kept
    beside it. Steps per second and the fraction of the device's copy bandwidth that the floor step's
    bytes take at the sampler's rate (benchmarks/device_speed.py) are of the primary clock."""
    fed = fp.data.FederatedData.from_clients([(X, y)], num_classes=int(y.max()) + 1)
    pot = get_potential(model, fed)
    data = jax.tree_util.tree_map(lambda a: a[0], fed.client_data())
    target = make_target(data, pot.dim)
    key = jax.random.PRNGKey(0)
    z0 = pot.init(key) * 0.1

    fns = {}
    for name, f in floor_scans(pot, batch, steps).items():
        fns[name] = lambda f=f: (cpu_and_wall(lambda: f(z0, target, key)), None)
    backends = samplers(X.shape[0], steps, batch, scale)
    ctx = Context(pot, 1, np.asarray(fed.sizes), fed.num_rows)
    stacked, keys = fed.client_data(), jax.random.split(key, 1)
    for name in names:
        algo = fp.algorithms.OneShotAverage(client=backends[name])
        fns[name] = lambda algo=algo: run_phase_timed(algo, model, fed)
        if direct:
            fns[name + " (progress)"] = lambda algo=algo: run_phase_timed(algo, model, fed, True)

            def vmapped(d, ks, sk, a=algo):
                return jax.vmap(lambda dd, k: a.run_client(ctx, dd, jax.random.split(k)[0], sk))(d, ks)

            f = jax.jit(vmapped)
            fns[name + " (vmapped)"] = lambda f=f: (cpu_and_wall(lambda: f(stacked, keys, key)), None)
    last = {name: fn()[1] for name, fn in fns.items()}          # compile and warm up
    cpu = {name: [] for name in fns}
    wall = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            (c, w), out = fn()
            cpu[name].append(c)
            wall[name].append(w)
            last[name] = out if out is not None else last[name]
    g, fl = GRADIENT, FLOOR
    clock, tm = ("process CPU", cpu) if jax.default_backend() == "cpu" else ("wall", wall)
    nbytes = step_bytes(floor_steps(pot, batch)[FLOOR], z0, target, key)
    rows = []
    for name in names:
        t = med(tm[name])
        row = {"model": model_name, "d": pot.dim, "batch": batch, "sampler": name, "steps": steps,
               "clock": clock, "step_us": 1e6 * t / steps, "bare_gradient_us": 1e6 * med(tm[g]) / steps,
               "floor_us": 1e6 * med(tm[fl]) / steps,
               "over_gradient": t / med(tm[g]), "over_floor": t / med(tm[fl]),
               "over_floor_best": min(tm[name]) / min(tm[fl]),
               "over_floor_wall": med(wall[name]) / med(wall[fl]),
               "steps_per_s": steps / t, "floor_bytes_per_step": nbytes,
               "bandwidth_fraction": bandwidth_fraction(nbytes, t / steps, copy_GB_per_s)}
        if direct:
            d, v = name + " (progress)", name + " (vmapped)"
            row |= {"progress_over_gradient": med(tm[d]) / med(tm[g]),
                    "progress_over_floor": med(tm[d]) / med(tm[fl]),
                    "progress_over_floor_best": min(tm[d]) / min(tm[fl]),
                    "vmapped_over_gradient": med(tm[v]) / med(tm[g]),
                    "vmapped_over_floor": med(tm[v]) / med(tm[fl]),
                    "vmapped_over_floor_best": min(tm[v]) / min(tm[fl])}
        rows.append(row | {"floor_over_gradient": med(tm[fl]) / med(tm[g]),
                           "finite": bool(last[name].history[0].get("client_finite", 1.0) > 0)})
    return rows


SECTIONS = ("orchestration", "clients", "memory", "steps")


# -- main ---------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="CI sizes, no Flower, writes no files")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--no-flower", action="store_true")
    p.add_argument("--sections", default="orchestration,clients,memory,steps")
    args = p.parse_args(argv)
    chosen = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    quick = args.quick
    facts = device_facts(2**26 if quick else None)       # the device and its measured copy bandwidth
    bw = facts["copy_GB_per_s"]
    t0, c0 = time.perf_counter(), time.process_time()
    sections, marks = {}, [(t0, c0)]

    def mark(name):
        t, c = time.perf_counter(), time.process_time()
        sections[name] = {"wall_s": round(t - marks[-1][0], 1), "cpu_s": round(c - marks[-1][1], 1)}
        marks.append((t, c))

    with_flower = not (quick or args.no_flower)
    flower_why = None
    if with_flower:
        try:
            import flwr  # noqa: F401
            import ray  # noqa: F401
        except ImportError as e:
            with_flower, flower_why = False, f"Flower simulation not run: {e} (pip install 'flwr[simulation]')"
    elif quick:
        flower_why = "Flower simulation not run in --quick: its start-up alone (Ray) takes tens of seconds"
    else:
        flower_why = "Flower simulation not run: --no-flower"

    orch, clients, memory, step_rows = [], [], [], []
    if "orchestration" in chosen:
        orch = [local_vs_flower(K, 5 if quick else 20, 3 if K <= 10 else 2, with_flower)
                for K in ((10,) if quick else (10, 100))]
    mark("orchestration")

    steps = 20 if quick else 100
    counts = (10, 100) if quick else (10, 100, 1000, 10000)
    chunks = {100: 10} if quick else {10000: 1000}
    if "clients" in chosen or "memory" in chosen:
        clients, (algo, model, feds) = client_scaling(counts, chunks, steps, 2 if quick else 3,
                                                      facts["copy_GB_per_s"])
    mark("clients")

    # --quick: the two phases compiled above (each compile of an SG-MCMC client phase takes seconds)
    cases = ((10, None), (100, 10)) if quick else ((1000, None), (1000, 100), (10000, None), (10000, 1000))
    if "memory" in chosen:
        for K, _ in cases:
            feds.setdefault(K, synthetic_logistic(K, 20))
    if "memory" in chosen:
        memory = memory_table(algo, model, feds, cases, steps, rss=not quick)
    mark("memory")

    ds = fp.data.load_digits()
    X, y = ds.X_train, ds.y_train
    softmax = fp.models.softmax_regression(num_classes=10)
    mlp = fp.models.bnn_mlp(hidden_sizes=(100,), num_classes=10)
    if "steps" not in chosen:
        pass
    elif quick:
        step_rows = sampler_steps("softmax_regression", softmax, X, y, 64, 400, 3, ("SGLD",), bw, direct=False)
    else:
        names = ("SGLD", "SGHMC", "CyclicalSGHMC")
        step_rows = sampler_steps("softmax_regression", softmax, X, y, 64, 20000, 7, names, bw)
        step_rows += sampler_steps("bnn_mlp(100)", mlp, X, y, 256, 1000, 5, names, bw, scale=0.1)
        step_rows += sampler_steps("cnn(8, 16)", fp.models.cnn(num_classes=10), X, y, 256, 200, 5, names, bw,
                                   scale=0.1)
    mark("steps")

    on_cpu = jax.default_backend() == "cpu"
    meta = {"backend": jax.default_backend(), "devices": str(jax.devices()), "cpu_count": os.cpu_count(),
            "device": facts["device"], "copy_GB_per_s": bw,
            "python": platform.python_version(), "jax": jax.__version__, "quick": quick, "sections": chosen,
            "shared_machine": (f"{os.cpu_count()} CPU cores shared with other work during the run: absolute times "
                               "are noisy, only the side-by-side ratios compare") if on_cpu else
                              (f"one {facts['device']} (not shared), {os.cpu_count()} host CPU cores; sampler steps "
                               "timed by wall clock"),
            "total_wall_s": round(time.perf_counter() - t0, 1),
            "total_cpu_s": round(time.process_time() - c0, 1), "section_times": sections,
            "load_average": [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None}
    md = [("# Scale (CPU shared with other work: compare ratios, not absolute times)" if on_cpu else
           f"# Scale on {facts['device']}"), "",
          f"Device: {facts['device']} ({facts['backend']}), measured copy bandwidth {bw} GB/s "
          "(benchmarks/device_speed.py: a jitted x + 1 over 1 GiB on an accelerator, 256 MiB on a CPU).", "",
          "## 1. Per-round orchestration: local engine vs Flower simulation "
          "(FedAvg, 5 local steps, logistic regression, 50 rows per client)", "",
          fp.report.format_table(orch), ""]
    if flower_why:
        md += [flower_why, ""]
    md += ["flower_startup_s: fp.run called to the first round's messages out (server init, first "
           "SuperNodes registered); flower_round1_s includes the Ray workers starting and compiling the client "
           "update (they start lazily); flower_round_s: median of the later rounds. local_*: per-round times of compiled rounds (before and after the "
           "Flower run); local_startup_s: a first one-round fp.run, compile included.", "",
           "## 2. Time vs number of clients (OneShotAverage, SGLD clients, logistic regression d=11, "
           "20 rows per client)", "",
           fp.report.format_table(clients), "",
           "round_s: client phase + server round of a run whose functions are compiled; "
           "per_client_step_vs_first: us per client-step relative to the 10-client row; client_steps_per_s: "
           "clients x steps / round_s; floor_bytes_per_client_step: XLA's bytes accessed of one gradient + "
           "noise step on one client (an upper estimate of its traffic: a gather is charged its whole operand); "
           "bandwidth_fraction: those bytes at that rate over the measured copy bandwidth.", "",
           "## 3. Memory of the compiled client phase, with and without client_chunk", "",
           fp.report.format_table(memory), "",
           "argument/output/temp: the compiler's memory_analysis() of the client phase (deterministic). "
           + ("peak_rss_MB: peak resident set (VmHWM, reset after imports and data) of a fresh process "
              "running fp.run (compile included); rss_before_run_MB: its resident set before fp.run; "
              "run_rss_MB: the difference." if not quick else ""), "",
           "## 4. Sampler step vs bare minibatch gradient and vs gradient + N(0, I) (one client, digits)", "",
           fp.report.format_table(step_rows), "",
           "over_gradient / over_floor: sampler time per step (through fp.run: its compiled client "
           "phase call, compile excluded) over the bare gradient / gradient + one N(0, I) draw over the flat "
           "vector, by the clock named in `clock` (process CPU time on a CPU, wall time on an accelerator), "
           "medians of interleaved repeats (_best: fastest repeats; _wall: wall-time "
           "medians, on a CPU inflated by the other work on the machine); steps_per_s and bandwidth_fraction "
           "(floor_bytes_per_step, XLA's bytes accessed of one gradient + noise step, at the sampler's rate over "
           "the measured copy bandwidth) by the same clock. over_*: fp.run(progress=False), whose client "
           "phase is compiled without the chains' progress reports; progress_*: fp.run(progress=True) (a bar, "
           "about 25 host calls per chain); vmapped_*: the client phase vmapped over the batch of one client, "
           "with the reports, as fp.run ran it before (before / after: vmapped_over_floor / over_floor and "
           "progress_over_floor). Targets: over_floor <= 1.15; over_gradient <= 1.3 where the gradient "
           "dominates (batch >= 256, MLP, CNN).", "",
           f"machine: {meta}"]
    text = "\n".join(md)
    print(text)
    out = {"orchestration": orch, "clients": clients, "memory": memory, "steps": step_rows, "meta": meta,
           "flower_note": flower_why}
    if not quick:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        stem = result_stem("scale" if chosen == list(SECTIONS) else "scale_" + "_".join(chosen))
        (d / f"{stem}.json").write_text(json.dumps(out, indent=2, default=str))
        (d / f"{stem}.md").write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
