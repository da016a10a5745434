"""The device a benchmark runs on, what it can move, and what a step must move.

* ``device_facts()``: backend, device kind (``jax.devices()[0].device_kind``: "cpu",
  "NVIDIA H200", ...), device count and the **measured copy bandwidth**: a jitted ``x + 1`` over a
  float32 array of ``nbytes`` (default 1 GiB on an accelerator, 256 MiB on a CPU: well past any cache),
  counted as 2 x its size (read and written) over the fastest of 10 calls, in GB/s (1e9 bytes). It is
  the ceiling the bandwidth fractions below are taken against: what this device sustains on the
  simplest streaming program, not a datasheet figure.
* ``step_bytes(fn, *args)``: the bytes one call of ``jit(fn)`` reads and writes by XLA's cost
  analysis of the compiled program (``"bytes accessed"``: operands and results of every fused
  kernel, caches ignored). Pass one step, not a loop of them: XLA counts a loop body once.
* ``bandwidth_fraction(bytes_per_step, seconds_per_step, copy_GB_per_s)``: the rate at which the
  step's bytes move, as a fraction of the measured copy bandwidth. Small models are latency-bound
  (a step's kernels launch one after another and their data sits in cache), so on them the fraction
  says how far the step is from streaming its data, not that memory is the bottleneck; above 1 (seen
  on CPUs, whose caches hold a small client whole) the bytes come from cache faster than memory streams.
* ``result_stem(stem)``: ``stem`` on a CPU, ``stem_<device kind>`` elsewhere (``scale_nvidia_h200``),
  so a run on an accelerator writes beside the CPU results instead of over them.

``python benchmarks/device_speed.py`` prints the facts as JSON (``--out FILE`` writes them too).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np


def device_kind() -> str:
    return str(jax.devices()[0].device_kind)


def copy_bandwidth(nbytes: int | None = None, repeats: int = 10) -> float:
    """GB/s of a jitted ``x + 1`` over ``nbytes`` of float32 (read + write), fastest of ``repeats``."""
    if nbytes is None:
        nbytes = 2**30 if jax.default_backend() != "cpu" else 2**28
    x = jnp.zeros(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(x))
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def device_facts(nbytes: int | None = None) -> dict:
    """Backend, device kind and count, CPU count, and the measured copy bandwidth (GB/s)."""
    return {"backend": jax.default_backend(), "device": device_kind(), "device_count": jax.device_count(),
            "cpu_count": os.cpu_count(), "copy_GB_per_s": round(copy_bandwidth(nbytes), 1)}


def step_bytes(fn, *args) -> float:
    """XLA's "bytes accessed" of ``jit(fn)`` compiled for ``args`` (one call)."""
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):         # older JAX: one dict per program
        cost = cost[0]
    return float(cost["bytes accessed"])


def bandwidth_fraction(bytes_per_step: float, seconds_per_step: float, copy_GB_per_s: float) -> float:
    """(bytes per step / seconds per step) as a fraction of the measured copy bandwidth."""
    return bytes_per_step / seconds_per_step / (copy_GB_per_s * 1e9)


def result_stem(stem: str) -> str:
    """``stem`` on a CPU backend, else ``stem_<device kind in lower case, words joined by _>``."""
    if jax.default_backend() == "cpu":
        return stem
    return stem + "_" + re.sub(r"[^a-z0-9]+", "_", device_kind().lower()).strip("_")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="also write the facts to this JSON file")
    args = p.parse_args(argv)
    facts = device_facts()
    print(json.dumps(facts))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(facts, f, indent=2)
    return facts


__all__ = ["device_facts", "copy_bandwidth", "step_bytes", "bandwidth_fraction", "result_stem", "device_kind"]

if __name__ == "__main__":
    main()
