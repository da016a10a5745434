"""Shared machinery of the one-round (one-shot) algorithms.

Every one-round method has the same client side: client k runs its backend
once on its own target

    log pi_k(z) = s * log p0(z) + log p(D_k | z),

with the prior share ``s`` the method asks for (``s = 1``: the client's own
posterior; ``s = 1/K``: a sub-posterior, Scott et al. 2016), starting from a
prior draw, and sends a *message* built from the :class:`ClientResult`
(draws, a Gaussian, a point). The server keeps one slot per client
(:class:`OneRoundState`): a message lands in its client's slot only when its
client was not masked out (a masked client, e.g. one whose update diverged,
never enters any aggregate). All combining happens in ``posterior()`` over the
valid slots, so clients sampled in different rounds (``clients_per_round``)
accumulate, and a client that takes part again overwrites its slot.

A client learns its slot index from its client state (``init`` gives client
``k`` the state ``k``), which keeps shapes fixed whatever subset of clients
takes part and works unchanged when client and server run on different
machines.

This module also holds helpers the one-round methods share: the draws or the
Gaussian of a client result, the prior as a Gaussian in the flat
unconstrained layout (:func:`prior_gaussian`), and a guarded Gaussian product
(:func:`gaussian_product`).
"""
from __future__ import annotations

import dataclasses
import warnings
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..inference import NUTS
from ..posteriors import Gaussian, Samples
from ..protocols import ClientBackend
from ..potential import make_target
from ..validation import check_choice, check_int
from .base import Algorithm, Context

Array = jax.Array


class OneRoundState(NamedTuple):
    """Server state of a one-round method.

    messages: the clients' messages stacked over a leading axis of length K
    (zeros in slots never filled); valid: (K,) True where a message was
    received from a client that was not masked out; sizes: (K,) N_k of the
    filled slots; key: the key of the server's own randomness (draws made in
    ``posterior``).
    """

    messages: Any
    valid: Array
    sizes: Array
    key: Array


def check_client(client):
    """``client`` if it is a :class:`~fedprob.protocols.ClientBackend`, else a TypeError."""
    if not isinstance(client, ClientBackend):
        raise TypeError(f"client must be a fedprob.inference backend (a fedprob.protocols.ClientBackend), "
                        f"got {type(client).__name__}")
    return client


@dataclasses.dataclass(frozen=True)
class OneRoundAlgorithm(Algorithm):
    """Base of the one-round methods (see the module docstring).

    ``client=None`` uses :meth:`default_client`. ``shared_start=True`` starts
    every client from the same point (drawn with the server's key): the
    parameter-space aggregates of neural networks need it, since hidden units
    of independently started clients do not line up. Subclasses implement
    :meth:`prior_weight`, :meth:`make_message` and :meth:`posterior`.
    """

    client: Any = None
    shared_start: bool = True

    default_rounds = 1

    def __post_init__(self):
        if self.client is not None:
            check_client(self.client)

    # -- hooks ---------------------------------------------------------------------------------
    def default_client(self):
        """The backend used when ``client`` is None (full-batch NUTS unless a method says otherwise)."""
        return NUTS()

    @property
    def backend(self):
        """The client backend (``client``, or :meth:`default_client`)."""
        return self.default_client() if self.client is None else check_client(self.client)

    def prior_weight(self, ctx: Context) -> float:
        """Prior share s of each client's target (1: own posterior; 1/K: sub-posterior)."""
        return 1.0

    def make_message(self, ctx: Context, result, key):  # pragma: no cover - abstract
        """The pytree a client sends, from its :class:`ClientResult`."""
        raise NotImplementedError

    # -- protocol ------------------------------------------------------------------------------
    def run_client(self, ctx: Context, data, key, start_key=None):
        """Run the backend on this client's target (prior share from :meth:`prior_weight`).

        The chain starts from ``potential.init(k, backend.init_strategy)`` with
        ``k = start_key`` (shared by all clients) when ``shared_start`` is set,
        else a key of this client's own.
        """
        k_init, k_run = jax.random.split(key)
        if self.shared_start and start_key is not None:
            k_init = start_key
        backend = self.backend
        target = make_target(data, ctx.dim, prior_weight=self.prior_weight(ctx))
        z0 = ctx.potential.init(k_init, getattr(backend, "init_strategy", "prior"))
        return backend.run(k_run, ctx.potential, target, z0)

    def _client_message(self, ctx: Context, data, key, start_key=None):
        k_run, k_msg = jax.random.split(key)
        result = self.run_client(ctx, data, k_run, start_key)
        return self.make_message(ctx, result, k_msg), result.diagnostics

    def init(self, ctx: Context, key, data):
        """Empty slots shaped like one client's message (traced, not run) and client ids 0..K-1.

        ``key`` is kept in the server state for the server's own draws in ``posterior``.
        """
        K = ctx.num_clients
        one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
        kspec = jax.ShapeDtypeStruct(jnp.shape(key), jnp.asarray(key).dtype)
        shapes, _ = jax.eval_shape(lambda d, k: self._client_message(ctx, d, k, k), one, kspec)
        self.check_message(ctx, shapes)
        messages = jax.tree_util.tree_map(lambda s: jnp.zeros((K,) + s.shape, s.dtype), shapes)
        server = OneRoundState(messages, jnp.zeros((K,), bool), jnp.zeros((K,), jnp.result_type(float)),
                               key)
        return server, jnp.arange(K, dtype=jnp.int32)

    def check_message(self, ctx: Context, shapes) -> None:
        """Validate message shapes at ``init`` (before anything is compiled)."""

    def client_update(self, ctx: Context, server_state, client_state, data, key):
        """Run the backend once; the message is ``(client id, payload)``, the diagnostics the backend's."""
        start_key = jax.random.fold_in(server_state.key, 1)
        message, diagnostics = self._client_message(ctx, data, key, start_key)
        return client_state, (client_state, message), diagnostics

    def server_update(self, ctx: Context, server_state: OneRoundState, messages, weights, mask):
        """Store each unmasked client's payload and size in its slot; masked clients change nothing."""
        ids, payload = messages
        ids = jnp.asarray(ids, jnp.int32)

        def put(slots, new):
            m = jnp.reshape(mask, mask.shape + (1,) * (new.ndim - 1))
            return slots.at[ids].set(jnp.where(m, new, slots[ids]))

        stored = jax.tree_util.tree_map(put, server_state.messages, payload)
        valid = server_state.valid.at[ids].set(server_state.valid[ids] | mask)
        sizes = server_state.sizes.at[ids].set(
            jnp.where(mask, weights.astype(server_state.sizes.dtype), server_state.sizes[ids]))
        return OneRoundState(stored, valid, sizes, server_state.key)

    # -- helpers for posterior() ------------------------------------------------------------------
    @staticmethod
    def received(server_state: OneRoundState):
        """(messages, sizes, ids) of the valid slots only (concrete arrays)."""
        valid = np.asarray(server_state.valid)
        ids = np.flatnonzero(valid)
        if ids.size == 0:
            raise ValueError("no client message was received (every client was masked out or none took "
                             "part): there is no posterior to build")
        msgs = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[ids], server_state.messages)
        return msgs, jnp.asarray(np.asarray(server_state.sizes)[ids]), ids


# -- client results as draws or Gaussians -----------------------------------------------------------

def result_draws(result, key, num_samples: int) -> Array:
    """(S, d) draws of a client result: its Samples, or ``num_samples`` draws of its Gaussian."""
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        return post.draws
    if isinstance(post, Gaussian):
        return post.sample(key, num_samples)
    raise ValueError(f"client backend returned {type(post).__name__}; expected Samples or Gaussian")


def result_gaussian(result, diag: bool, jitter: float = 1e-6) -> Gaussian:
    """The client's Gaussian: moment-matched to Samples, or its Gaussian in the asked form.

    A full Gaussian asked for diagonally keeps its marginal variances; a
    diagonal one asked for fully becomes a diagonal matrix.
    """
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        if post.num_draws < 2:
            raise ValueError("a Gaussian fit needs at least 2 draws per client")
        return _moment_match(post.draws, diag, jitter)
    if isinstance(post, Gaussian):
        return post.to_diag() if diag else post.to_full()
    raise ValueError(f"client backend returned {type(post).__name__}; expected Samples or Gaussian")


def _moment_match(draws, diag: bool, jitter: float) -> Gaussian:
    """Gaussian fit of (S, d) draws with a jitter relative to the mean variance."""
    mean = jnp.mean(draws, 0)
    c = draws - mean
    s = max(draws.shape[0] - 1, 1)
    var = jnp.sum(c * c, 0) / s
    eps = jitter * (jnp.mean(var) + 1e-30)
    if diag:
        return Gaussian.from_moments(mean, var + eps)
    cov = c.T @ c / s
    return Gaussian.from_moments(mean, cov + eps * jnp.eye(draws.shape[1], dtype=draws.dtype))


# -- the prior as a Gaussian --------------------------------------------------------------------------

@partial(jax.jit, static_argnums=(0, 2))
def _prior_check(potential, key, check_points: int):
    """log-prior gradients at 0, at 1 and at prior draws: (b, p, exact mask)."""
    d = potential.dim
    pts = jax.vmap(potential.sample_prior)(jax.random.split(key, check_points))
    z = jnp.concatenate([jnp.zeros((1, d), pts.dtype), jnp.ones((1, d), pts.dtype), pts])
    g = jax.vmap(jax.grad(potential.log_prior))(z)
    b, p, g = g[0], g[0] - g[1], g[2:]
    resid = jnp.abs(g - (b - p * pts))
    tol = 1e-4 * (1.0 + jnp.abs(b) + jnp.abs(p * pts) + jnp.abs(g))
    exact = jnp.all(resid <= tol, 0) & (p > 0) & jnp.all(jnp.isfinite(g), 0)
    return b, p, exact


@partial(jax.jit, static_argnums=(0, 2))
def prior_draws(potential, key, num_samples: int):
    """(num_samples, d) prior draws in the flat unconstrained layout (compiled once per model)."""
    return jax.vmap(potential.sample_prior)(jax.random.split(key, num_samples))


@partial(jax.jit, static_argnums=(0, 2))
def _prior_moments(potential, key, num_samples: int):
    draws = prior_draws(potential, key, num_samples)
    mean = jnp.mean(draws, 0)
    c = draws - mean
    return mean, c.T @ c / (num_samples - 1)


def prior_gaussian(potential, key, diag: bool, num_samples: int = 2000, check_points: int = 8):
    """The prior p0 as a Gaussian in the flat unconstrained layout: ``(Gaussian, exact)``.

    Coordinates on which the log prior is an independent quadratic (checked:
    the gradient at ``check_points`` prior draws, at 0 and at 1 is exactly
    ``b - p * z`` coordinate-wise, as for any ``Normal`` prior site, or a
    ``LogNormal`` one after its log transform) get their exact natural
    parameters ``(b, p)``. The other coordinates (e.g. a HalfNormal noise
    scale, hierarchical or heavy-tailed priors) are moment-matched to
    ``num_samples`` prior draws (``potential.sample_prior``); they are
    assumed independent of the exact ones, which holds because an exact
    coordinate's gradient involves no other coordinate. ``exact`` is True when
    every coordinate was exact.
    """
    k_check, k_draw = jax.random.split(key)
    b, p, exact = _prior_check(potential, k_check, check_points)
    exact = np.asarray(exact)
    if exact.all():
        g0 = Gaussian(b, p)
        return (g0 if diag else g0.to_full()), True
    mean_mm, cov_mm = _prior_moments(potential, k_draw, num_samples)
    ex = jnp.asarray(exact)
    p_safe = jnp.where(ex, p, 1.0)
    mean = jnp.where(ex, b / p_safe, mean_mm)
    if diag:
        var = jnp.where(ex, 1.0 / p_safe, jnp.diag(cov_mm))
        return Gaussian.from_moments(mean, var), False
    block = (~ex)[:, None] & (~ex)[None, :]
    cov = jnp.where(block, cov_mm, 0.0) + jnp.diag(jnp.where(ex, 1.0 / p_safe, 0.0))
    return Gaussian.from_moments(mean, cov), False


# -- guarded Gaussian products ----------------------------------------------------------------------

def gaussian_product(clients: Gaussian, prior: Gaussian, prior_power: float, name: str = "product",
                     warn: bool = True):
    """``prod_k N_k * p0^prior_power`` in natural parameters, guarded: ``(Gaussian, info)``.

    ``clients`` is stacked over a leading client axis (diagonal or full, as
    ``prior``). Natural parameters add: ``sum_k eta_k + prior_power * eta_0``
    (``prior_power = -(K-1)`` divides out the K-1 surplus copies of the prior
    when every client used the full prior).

    Guard: when the precision is not positive definite (or not finite) the
    product falls back to clipping. In the prior-whitened eigenbasis of the
    precision every eigenvalue below 1 (less concentrated than the prior) is
    raised to 1; diagonal: every precision below the prior's is raised to the
    prior's. The linear term is kept, so in a clipped direction with no
    information the mean stays near the prior mean. A Python warning is
    issued and ``info["fallback"]`` records it.
    """
    lin, prec, ok, stats = _product_core(clients, prior, jnp.asarray(prior_power, prior.linear.dtype))
    stats = {k: np.asarray(v).item() for k, v in stats.items()}
    info = {"fallback": None, "min_relative_precision": stats["min_relative_precision"]}
    if not bool(ok):
        info.update(fallback="clip_to_prior", num_clipped=int(stats["num_clipped"]),
                    num_nonpositive=int(stats["num_nonpositive"]))
    if info["fallback"] is not None and warn:
        warnings.warn(
            f"{name}: the product of the client Gaussians (with the prior correction) is not positive "
            f"definite ({info['num_nonpositive']} non-positive direction(s)); falling back to clipping its "
            f"precision at the prior's in {info['num_clipped']} direction(s). The client posteriors are "
            "probably too noisy (more draws, or covariance='diag', or a Gaussian client backend help).",
            RuntimeWarning, stacklevel=3)
    return Gaussian(lin, prec), info


@jax.jit
def _product_core(clients: Gaussian, prior: Gaussian, power):
    """Summed natural parameters and their clipped fallback (selected when not PD or not finite)."""
    lin = jnp.sum(clients.linear, 0) + power * prior.linear
    prec = jnp.sum(clients.precision, 0) + power * prior.precision
    finite = jnp.all(jnp.isfinite(lin)) & jnp.all(jnp.isfinite(prec))
    lin_safe = jnp.where(jnp.isfinite(lin), lin, prior.linear)
    if prior.is_diag:
        rel = jnp.where(jnp.isfinite(prec), prec, 0.0) / prior.precision
        ok = finite & jnp.all(rel > 0)
        keep = rel >= 1.0
        clipped = jnp.where(keep, prec, prior.precision)
        stats = {"min_relative_precision": jnp.min(rel), "num_clipped": jnp.sum(~keep),
                 "num_nonpositive": jnp.sum(~(rel > 0))}
    else:
        L0 = jnp.linalg.cholesky(prior.precision)
        Linv = jax.scipy.linalg.solve_triangular(L0, jnp.eye(prior.dim, dtype=L0.dtype), lower=True)
        A = Linv @ jnp.where(jnp.isfinite(prec), prec, 0.0) @ Linv.T
        a, V = jnp.linalg.eigh(0.5 * (A + A.T))
        ok = finite & (jnp.min(a) > 0)
        clipped = L0 @ (V * jnp.maximum(a, 1.0)) @ V.T @ L0.T
        clipped = 0.5 * (clipped + clipped.T)
        stats = {"min_relative_precision": jnp.min(a), "num_clipped": jnp.sum(a < 1.0),
                 "num_nonpositive": jnp.sum(~(a > 0))}
    prec = jnp.where(ok, prec, clipped)
    lin = jnp.where(ok, lin, lin_safe)
    return lin, prec, ok, stats


def client_weights(sizes, weighting: str) -> Array:
    """Mixture weights over clients: ∝ N_k (``"size"``) or ``"uniform"``."""
    sizes = jnp.asarray(sizes, jnp.result_type(float))
    if weighting == "size":
        return sizes / jnp.sum(sizes)
    if weighting == "uniform":
        return jnp.full(sizes.shape, 1.0 / sizes.shape[0])
    raise ValueError(f"weighting must be 'size' or 'uniform', got {weighting!r}")


__all__ = ["OneRoundAlgorithm", "OneRoundState", "result_draws", "result_gaussian", "prior_gaussian",
           "prior_draws", "gaussian_product", "client_weights", "check_client"]
