"""Full-batch NUTS and HMC on one client's target (NumPyro's functional kernels).

The potential energy is ``U(z) = -log_density(z, target)`` on the client's
**whole** data (a sum over its points; prior weight, likelihood weight and
Gaussian term as the target says; no minibatches, no temperature: this is the
exact reference sampler for small models). NumPyro's
``numpyro.infer.hmc.hmc(potential_fn=U, algo=...)`` builds the kernels inside
``run``, so ``run`` is a pure traced function: jittable and vmappable over
``(key, target, init)``, with warmup (dual-averaging step size, Welford mass
matrix on NumPyro's windowed schedule) and sampling as one ``lax.scan`` over
``sample_kernel`` (the kernel is traced and compiled once). Under ``vmap`` every client runs its own adaptation; the
tree building of all clients runs in lock step (a step costs the deepest tree
of the batch).

Output: :class:`~fedprob.posteriors.Samples` with ``num_samples`` draws
(every ``thinning``-th transition after warmup) and diagnostics over all
post-warmup transitions: ``accept_prob`` (mean), ``num_divergences``,
``num_warmup_divergences``, ``num_steps`` (mean leapfrog steps per
transition), ``tree_depth`` (NUTS only, mean), ``step_size`` (adapted) and
``finite``; and under ``draw_stats`` the statistics of each kept transition,
(num_samples,) arrays named as ArviZ names them: ``diverging``,
``acceptance_rate``, ``step_size``, ``n_steps`` (leapfrog steps),
``tree_depth`` (NUTS: floor(log2 n_steps) + 1), ``energy`` (the Hamiltonian)
and ``lp`` (the log density, ``-U``). With thinning they are the kept
transition's own, as in NumPyro's MCMC; the scalar counts cover every
transition.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from numpyro.infer.hmc import hmc

from fedprob.posteriors import Samples
from fedprob.protocols import DRAW_STATS, ClientBackend, ClientResult, finite_flag


def _check_common(b) -> None:
    if b.num_warmup < 0:
        raise ValueError(f"num_warmup must be >= 0, got {b.num_warmup}")
    if b.num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {b.num_samples}")
    if b.thinning < 1:
        raise ValueError(f"thinning must be >= 1, got {b.thinning}")
    if not 0.0 < b.target_accept_prob < 1.0:
        raise ValueError(f"target_accept_prob must lie in (0, 1), got {b.target_accept_prob}")
    if not b.step_size > 0:
        raise ValueError(f"step_size must be positive, got {b.step_size}")


def _run_kernel(backend, algo: str, key, potential, target, init, extra: dict) -> ClientResult:
    """Warmup then sampling with NumPyro's functional HMC/NUTS kernels."""

    def potential_fn(z):
        return -potential.log_density(z, target)

    init_kernel, sample_kernel = hmc(potential_fn=potential_fn, algo=algo)
    k_init, k_warm, k_draw = jax.random.split(key, 3)
    state = init_kernel(
        init,
        num_warmup=backend.num_warmup,
        step_size=backend.step_size,
        adapt_step_size=backend.adapt_step_size,
        adapt_mass_matrix=backend.adapt_mass_matrix,
        dense_mass=backend.dense_mass,
        target_accept_prob=backend.target_accept_prob,
        find_heuristic_step_size=backend.find_heuristic_step_size,
        rng_key=k_init,
        **extra,
    )

    # HMC with a trajectory length: draw each transition's length uniformly from
    # trajectory_length * (1 - jitter, 1] (a fixed length can be periodic).
    jitter = getattr(backend, "jitter", 0.0) if extra.get("trajectory_length") is not None else 0.0
    traj = extra.get("trajectory_length")

    def kernel(s, k):
        if jitter > 0:
            u = jax.random.uniform(k, (), dtype=s.adapt_state.step_size.dtype)
            s = s._replace(trajectory_length=traj * (1.0 - jitter * u))
        return sample_kernel(s)

    # One scan over every transition (warmup, then num_samples blocks of thinning), so the kernel is
    # traced, batched and compiled once (a scan for warmup and one for sampling held two copies of the
    # NUTS tree building: twice the compile). The kept transition of block i, the block's last, lands in
    # row i of a buffer in the carry (every transition of the block writes row i; the last write stays);
    # warmup transitions write row 0, which block 0 overwrites.
    W, S, T = backend.num_warmup, backend.num_samples, backend.thinning
    draw_keys = jax.vmap(lambda k: jax.random.split(k, T))(jax.random.split(k_draw, S))
    keys = jnp.concatenate([jax.random.split(k_warm, W), draw_keys.reshape((S * T,) + draw_keys.shape[2:])], 0)

    def record(s):
        return (s.z, {"diverging": s.diverging, "acceptance_rate": s.accept_prob,
                      "step_size": s.adapt_state.step_size, "n_steps": s.num_steps.astype(jnp.int32),
                      "energy": s.energy, "lp": -s.potential_energy})

    def buffer(x):
        return jnp.zeros((S,) + jnp.shape(x), jnp.result_type(x))

    zero = jnp.zeros((), jnp.result_type(float))

    def step(carry, xs):
        s, kept, (warm_div, acc, div, nsteps, depth) = carry
        k, t = xs
        s = kernel(s, k)
        row = jnp.maximum(t - W, 0) // T
        kept = jax.tree_util.tree_map(
            lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, jnp.asarray(x, buf.dtype), row, 0),
            kept, record(s))
        sampling = t >= W
        warm_div = warm_div + jnp.where(sampling, 0, s.diverging.astype(jnp.int32))
        acc = acc + jnp.where(sampling, s.accept_prob, 0.0).astype(acc.dtype)
        div = div + jnp.where(sampling, s.diverging.astype(jnp.int32), 0)
        nsteps = nsteps + jnp.where(sampling, s.num_steps, 0).astype(nsteps.dtype)
        depth = depth + jnp.where(sampling, _tree_depth(s.num_steps), 0)
        return (s, kept, (warm_div, acc, div, nsteps, depth)), None

    kept0 = jax.tree_util.tree_map(buffer, record(state))
    counts0 = (jnp.zeros((), jnp.int32), zero, jnp.zeros((), jnp.int32), zero, jnp.zeros((), jnp.int32))
    (state, (draws, per_draw), (warm_div, acc, div, nsteps, depth)), _ = jax.lax.scan(
        step, (state, kept0, counts0), (keys, jnp.arange(W + S * T)))
    n_post = S * T
    if algo == "NUTS":
        per_draw["tree_depth"] = _tree_depth(per_draw["n_steps"])
    diagnostics = {
        "accept_prob": acc / n_post,
        "num_divergences": div,
        "num_warmup_divergences": warm_div,
        "num_steps": nsteps / n_post,
        "step_size": state.adapt_state.step_size,
    }
    if algo == "NUTS":
        # NumPyro: tree depth = floor(log2(num_steps)) + 1, averaged over the post-warmup transitions
        diagnostics["tree_depth"] = depth.astype(zero.dtype) / n_post
    diagnostics["finite"] = finite_flag(draws)
    diagnostics[DRAW_STATS] = per_draw
    return ClientResult(Samples(draws), state.z, diagnostics)


def _tree_depth(n_steps):
    """NUTS tree depth of a transition with ``n_steps`` leapfrog steps: floor(log2(n_steps)) + 1 (NumPyro's)."""
    n = jnp.maximum(n_steps, 1).astype(jnp.int32)
    return (32 - jax.lax.clz(n)).astype(jnp.int32)          # the bit length of n


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Hamiltonian(ClientBackend):
    """The settings NUTS and HMC share (keyword-only): warmup, draws, thinning, the dual-averaging
    target, the mass matrix, the initial step size and the number of chains (see :class:`NUTS`)."""

    num_warmup: int = 500
    num_samples: int = 500
    target_accept_prob: float = 0.8
    dense_mass: bool = False
    thinning: int = 1
    step_size: float = 1.0
    adapt_step_size: bool = True
    adapt_mass_matrix: bool = True
    find_heuristic_step_size: bool = False
    num_chains: int = 1

    output = "samples"

    def __post_init__(self):
        _check_common(self)


@dataclasses.dataclass(frozen=True)
class NUTS(_Hamiltonian):
    """No-U-Turn sampler on the client's full-batch target.

    num_warmup / num_samples: adaptation and kept transitions (after
    thinning); thinning: keep every ``thinning``-th post-warmup transition;
    target_accept_prob: dual-averaging target; max_tree_depth: cap on the
    doubling (2**depth - 1 leapfrog steps at most); dense_mass: adapt a full
    (True) or diagonal (False) inverse mass matrix; step_size: initial step
    size (adapted when ``adapt_step_size``); num_chains: independent chains
    per client (:func:`fedprob.protocols.run_chains`), so client R-hat is real.
    """

    max_tree_depth: int = 10

    def __post_init__(self):
        super().__post_init__()
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {self.max_tree_depth}")

    def run(self, key, potential, target, init) -> ClientResult:
        return _run_kernel(self, "NUTS", key, potential, target, init,
                           {"max_tree_depth": self.max_tree_depth})


@dataclasses.dataclass(frozen=True)
class HMC(_Hamiltonian):
    """Hamiltonian Monte Carlo with a fixed path on the client's full-batch target.

    Either ``num_steps`` leapfrog steps per transition (step size adapted), or,
    with ``num_steps=None``, a path of length ``trajectory_length * u``, ``u``
    uniform on ``(1 - jitter, 1]`` per transition (steps = ceil(length /
    step_size)). A fixed length can be periodic on near-Gaussian targets
    (length pi in whitened units gives antithetic draws, 2 pi returns to the
    start); the default (2 pi, jitter 1) rotates by a uniform angle. Other
    arguments as in :class:`NUTS`.
    """

    num_steps: Optional[int] = None
    trajectory_length: Optional[float] = 2 * math.pi
    jitter: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if self.num_steps is None and self.trajectory_length is None:
            raise ValueError("HMC needs num_steps or trajectory_length")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.trajectory_length is not None and not self.trajectory_length > 0:
            raise ValueError(f"trajectory_length must be positive, got {self.trajectory_length}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must lie in [0, 1], got {self.jitter}")

    def run(self, key, potential, target, init) -> ClientResult:
        # With a fixed number of steps the path length follows the adapted step size.
        traj = None if self.num_steps is not None else self.trajectory_length
        return _run_kernel(self, "HMC", key, potential, target, init,
                           {"num_steps": self.num_steps, "trajectory_length": traj})


__all__ = ["NUTS", "HMC"]
