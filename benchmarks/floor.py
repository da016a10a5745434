"""The floors a sampler step is timed against: scans of the bare minibatch gradient and of the
gradient plus one N(0, I) draw over the flat parameter vector.

``floor_steps(potential, batch)`` returns the two steps ``f(w, target, key) -> w`` (one call each,
for XLA's cost analysis: benchmarks/device_speed.py); ``floor_scans(potential, batch, steps)``
returns jitted ``f(w, target, key) -> w`` that run
``steps`` steps of ``lax.scan`` over ``jax.random.split(key, steps)``, each step taking
``jax.grad(potential.log_density)`` on a minibatch of ``batch`` rows (sampling included) and,
for the second floor, one ``jax.random.normal`` of the vector's shape from its own key:

* ``"bare gradient"``: ``w <- w + 1e-6 g`` (1.0 is the limit for any gradient method);
* ``"gradient + noise"``: ``w <- w + 1e-6 g + 1e-6 xi``, ``xi ~ N(0, I)`` (the limit for a
  sampler that injects noise every step: SGLD, SGHMC, cyclical SGHMC).

Used by benchmarks/inference.py and benchmarks/scale.py.
"""
from __future__ import annotations

import jax

GRADIENT = "bare gradient"
FLOOR = "gradient + noise"


def floor_steps(potential, batch) -> dict:
    """``{GRADIENT: step, FLOOR: step}``, each one step ``step(w, target, key) -> w``."""

    def grad_only(w, target, k):
        return w + 1e-6 * jax.grad(potential.log_density)(w, target, k, batch)

    def grad_and_noise(w, target, k):
        kg, kn = jax.random.split(k)
        g = jax.grad(potential.log_density)(w, target, kg, batch)
        return w + 1e-6 * g + 1e-6 * jax.random.normal(kn, w.shape, w.dtype)

    return {GRADIENT: grad_only, FLOOR: grad_and_noise}


def floor_scans(potential, batch, steps: int) -> dict:
    """``{GRADIENT: f, FLOOR: f}``, each a jitted ``f(w, target, key)`` of ``steps`` steps."""

    def scan_of(body):
        def f(w, target, key):
            return jax.lax.scan(lambda w, k: (body(w, target, k), None), w, jax.random.split(key, steps))[0]
        return jax.jit(f)

    return {name: scan_of(body) for name, body in floor_steps(potential, batch).items()}


__all__ = ["floor_scans", "floor_steps", "GRADIENT", "FLOOR"]
