"""Shared machinery of the one-round (one-shot) algorithms.

Every one-round method has the same client side: client k runs its backend
once on its own target

    log pi_k(z) = s * log p0(z) + log p(D_k | z),

with the prior share ``s`` the method asks for (``s = 1``: the client's own
posterior; ``s = 1/K``: a sub-posterior, Scott et al. 2016), starting from a
prior draw, and sends a *message* built from the :class:`ClientResult`
(draws, a Gaussian, a point). A masked client (absent, or whose update
diverged) never enters any aggregate. The server side comes in two kinds:

* :class:`OneRoundAlgorithm` keeps **one slot per client**
  (:class:`OneRoundState`) and combines in ``posterior()``: for methods that
  need every client's draws (Ensemble, PredictiveBayes, the kernel EP-MCMC
  variants) or points. A client that takes part again overwrites its slot.
* :class:`SummingOneRoundAlgorithm` keeps **masked sums of sufficient
  statistics** (:class:`SumState`: natural parameters for EP-MCMC,
  precision-weighted sums for Consensus Monte Carlo) plus a (K,) flag of the
  clients counted, their sizes and effective sample sizes: server memory
  does not grow with K beyond those O(K) scalars, and the aggregate is a sum,
  as secure aggregation and cross-machine engines need. Rule for repeated
  participation (``clients_per_round < K`` over several rounds): a client is
  counted **once**, with its first accepted message; later messages from a
  counted client are ignored (a sum cannot forget a term).

A client learns its id from its client state (``init`` gives client ``k``
the state ``k``), which keeps shapes fixed whatever subset of clients takes
part and works unchanged when client and server run on different machines.

One set of client runs can feed several aggregates without recomputation:
:func:`run_clients` runs a backend once on every client and
:meth:`OneRoundAlgorithm.posterior_from_results` (or :func:`aggregate`)
builds any one-round method's posterior from those results.

Gaussian algebra (moment matching with shrinkage, the prior's Gaussian,
guarded products) lives in :mod:`fedprob.gaussian`.
"""
from __future__ import annotations

import dataclasses
import warnings
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import gaussian as gauss
from ..gaussian import guarded_product as gaussian_product  # noqa: F401  (name kept for importers)
from ..gaussian import prior_draws, prior_gaussian  # noqa: F401  (names kept for importers)
from ..inference import NUTS
from ..inference.sgmcmc import effective_sample_size
from ..posteriors import Gaussian, Samples
from ..client_map import vmap_clients
from ..protocols import ClientBackend, ClientResult, finite_flag, run_chains
from ..potential import make_target
from ..validation import check_choice, check_int  # noqa: F401  (re-exported to the methods)
from .base import Algorithm, Context, masked_sum

Array = jax.Array

#: A product whose mean's Monte Carlo sd exceeds this fraction of its posterior sd warns.
MC_ERROR_WARN = 0.2


class OneRoundState(NamedTuple):
    """Server state of a slot-keeping one-round method.

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


class SumState(NamedTuple):
    """Server state of a summing one-round method.

    sums: masked sums over the counted clients of every message entry but
    ``"ess"`` (shapes independent of K); valid: (K,) True for the clients
    counted; sizes: (K,) their N_k; ess: (K,) the smallest per-coordinate
    effective sample size of each counted client's draws (the largest float
    for an exact Gaussian output); key: the server's key (draws in ``posterior``).
    """

    sums: Any
    valid: Array
    sizes: Array
    ess: Array
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
        z0 = ctx.potential.init(k_init, backend.init_strategy)
        return run_chains(backend, k_run, ctx.potential, target, z0)

    def _client_message(self, ctx: Context, data, key, start_key=None):
        k_run, k_msg = jax.random.split(key)
        result = self.run_client(ctx, data, k_run, start_key)
        return self.make_message(ctx, result, k_msg), result.diagnostics

    def init(self, ctx: Context, key, data):
        """Empty server state shaped like one client's message (traced, not run) and client ids 0..K-1.

        ``key`` is kept in the server state for the server's own draws in ``posterior``.
        """
        one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
        kspec = jax.ShapeDtypeStruct(jnp.shape(key), jnp.asarray(key).dtype)
        shapes, _ = jax.eval_shape(lambda d, k: self._client_message(ctx, d, k, k), one, kspec)
        return self.empty_state(ctx, key, shapes), jnp.arange(ctx.num_clients, dtype=jnp.int32)

    def empty_state(self, ctx: Context, key, shapes) -> OneRoundState:
        """The server state before any message: K empty slots shaped like ``shapes`` (one message)."""
        self.check_message(ctx, shapes)
        K = ctx.num_clients
        messages = jax.tree_util.tree_map(lambda s: jnp.zeros((K,) + tuple(s.shape), s.dtype), shapes)
        return OneRoundState(messages, jnp.zeros((K,), bool), jnp.zeros((K,), jnp.result_type(float)), key)

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

    # -- one set of client runs, several aggregates ----------------------------------------------
    def posterior_from_results(self, ctx: Context, results, key=None, mask=None, sizes=None):
        """This method's posterior from client results computed elsewhere (no client is re-run).

        results: a :class:`~fedprob.protocols.ClientResult` (or a bare
        ``Samples``/``Gaussian``, whose mean then stands for the client's
        final point) stacked over the K clients of ``ctx``, e.g.
        ``run_clients(...).results``; it must come from the prior share this
        method asks for (:meth:`prior_weight`; not checked here, see
        :func:`aggregate`). key: the server key (default ``PRNGKey(0)``);
        mask: (K,) clients to use (default all); sizes: (K,) N_k (default
        ``ctx.client_sizes``). Messages are built with :meth:`make_message`,
        then one ``server_update`` and ``posterior`` run as in ``fp.run``.
        """
        K = ctx.num_clients
        lead = {np.shape(a)[0] for a in jax.tree_util.tree_leaves(results)}
        if lead != {K}:
            raise ValueError(f"results must be stacked over the {K} clients (leading axis), got leading "
                             f"axes {sorted(lead)}")
        if isinstance(results, (Samples, Gaussian)):          # a bare form: its mean as the point
            results = ClientResult(results, results.mean(), {})
        key = jax.random.PRNGKey(0) if key is None else key
        keys = jax.random.split(jax.random.fold_in(key, 2), K)
        payload = _messages(self, ctx, results, keys)
        shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), payload)
        state = self.empty_state(ctx, key, shapes)
        mask = jnp.ones((K,), bool) if mask is None else jnp.asarray(mask, bool)
        sizes = jnp.asarray(ctx.client_sizes if sizes is None else sizes)
        state = self.server_update(ctx, state, (jnp.arange(K, dtype=jnp.int32), payload), sizes, mask)
        return self.posterior(ctx, state, None)


@partial(jax.jit, static_argnums=(0, 1))
def _messages(algo, ctx, results, keys):
    return jax.vmap(lambda r, k: algo.make_message(ctx, r, k))(results, keys)


@dataclasses.dataclass(frozen=True)
class SummingOneRoundAlgorithm(OneRoundAlgorithm):
    """Base of the one-round methods whose server sums sufficient statistics (module docstring).

    :meth:`make_message` returns a dict of statistics; every entry except
    ``"ess"`` (the client's smallest effective sample size, a scalar) is
    summed over the counted clients, ``"ess"`` is kept per client (to name
    the clients that limit the Monte Carlo accuracy). :meth:`sums_messages`
    may return False (a method variant that needs the clients' draws); the
    slot-keeping behaviour of :class:`OneRoundAlgorithm` is then used.
    """

    def sums_messages(self) -> bool:
        """True: the server keeps :class:`SumState`; False: one slot per client."""
        return True

    def empty_state(self, ctx: Context, key, shapes):
        if not self.sums_messages():
            return super().empty_state(ctx, key, shapes)
        self.check_message(ctx, shapes)
        K = ctx.num_clients
        fdt = jnp.result_type(float)
        sums = {k: jnp.zeros(tuple(v.shape), v.dtype) for k, v in shapes.items() if k != "ess"}
        return SumState(sums, jnp.zeros((K,), bool), jnp.zeros((K,), fdt), jnp.zeros((K,), fdt), key)

    def server_update(self, ctx: Context, server_state, messages, weights, mask):
        """Add the statistics of each unmasked client not yet counted; others change nothing.

        A client is counted once (its first accepted message): the ids within
        one call are distinct (the engine samples clients without replacement).
        """
        if not self.sums_messages():
            return super().server_update(ctx, server_state, messages, weights, mask)
        ids, payload = messages
        ids = jnp.asarray(ids, jnp.int32)
        new = jnp.asarray(mask, bool) & ~server_state.valid[ids]
        stats = {k: v for k, v in payload.items() if k != "ess"}
        sums = jax.tree_util.tree_map(lambda a, b: a + b, server_state.sums, masked_sum(stats, new))
        valid = server_state.valid.at[ids].set(server_state.valid[ids] | new)
        sizes = server_state.sizes.at[ids].set(
            jnp.where(new, weights.astype(server_state.sizes.dtype), server_state.sizes[ids]))
        ess = server_state.ess.at[ids].set(
            jnp.where(new, payload["ess"].astype(server_state.ess.dtype), server_state.ess[ids]))
        return SumState(sums, valid, sizes, ess, server_state.key)

    @staticmethod
    def counted(server_state: SumState):
        """(sums, ids, ess) of the counted clients (concrete arrays)."""
        ids = np.flatnonzero(np.asarray(server_state.valid))
        if ids.size == 0:
            raise ValueError("no client message was received (every client was masked out or none took "
                             "part): there is no posterior to build")
        return server_state.sums, ids, np.asarray(server_state.ess)[ids]


# -- the client phase as its own compiled function (shared between methods) -------------------------

class PhaseData(NamedTuple):
    """A client's rows (``X, y, n`` as in :class:`~fedprob.potential.ClientData`) and the
    :class:`ClientResult` its backend already produced (``result``)."""

    X: Array
    y: Array
    n: Array
    result: Any


def client_phase_key(algorithm) -> Optional[tuple]:
    """What the client phase of ``algorithm`` depends on beyond the data: ``(backend, prior
    share, shared start)`` for a one-round method (methods with equal keys run identical
    clients), else None. The prior share needs a context, so it is resolved by the caller."""
    if not isinstance(algorithm, OneRoundAlgorithm):
        return None
    return (algorithm.backend, algorithm.shared_start)


def run_client_phase(algorithm, ctx: Context, data, keys, start_key):
    """Every client's :class:`ClientResult` (vmapped; one client runs unbatched,
    :func:`fedprob.client_map.vmap_clients`), with the keys ``client_update`` uses:
    ``keys`` (M,) are the engine's per-client keys, ``start_key`` the shared start key."""

    def one(d, k):
        k_run, _ = jax.random.split(k)
        return algorithm.run_client(ctx, d, k_run, start_key)

    return vmap_clients(one)(data, keys)


@dataclasses.dataclass(frozen=True)
class FromClientPhase(Algorithm):
    """``inner``'s server side on results computed beforehand (:class:`PhaseData`): the
    message, diagnostics, server update and posterior are ``inner``'s, bit for bit the same as
    when ``inner.client_update`` runs the backend itself."""

    inner: Any

    default_rounds = 1

    def client_update(self, ctx, server_state, client_state, data, key):
        _, k_msg = jax.random.split(key)
        message = self.inner.make_message(ctx, data.result, k_msg)
        return client_state, (client_state, message), data.result.diagnostics

    def server_update(self, ctx, server_state, messages, weights, mask):
        return self.inner.server_update(ctx, server_state, messages, weights, mask)

    def posterior(self, ctx, server_state, client_states):
        return self.inner.posterior(ctx, server_state, client_states)


# -- running the clients once -----------------------------------------------------------------------

class ClientRuns(NamedTuple):
    """One client phase: ``results`` (a ClientResult stacked over the K clients), the (K,) ``mask``
    of clients whose results are finite, the ``prior_weight`` they used, the ``context`` and the
    server ``key``."""

    context: Context
    results: Any
    mask: Array
    prior_weight: float
    key: Array


def run_clients(backend, model, fed, seed: int = 0, prior_weight: float = 1.0, shared_start: bool = True,
                model_kwargs: Optional[dict] = None) -> ClientRuns:
    """Run ``backend`` once on every client's target ``prior_weight * log p0 + log p(D_k | z)``.

    Clients start from ``potential.init(key, backend.init_strategy)``, one
    shared key for all (``shared_start``, as the one-round methods do) or
    one per client. Returns :class:`ClientRuns`; feed it to :func:`aggregate`
    (or ``algo.posterior_from_results``) for every one-round method that asks
    for this prior share: ``prior_weight=1`` for EPMCMC (parametric, default),
    Ensemble, PredictiveBayes, OneShotAverage; ``1/K`` for ConsensusMC and
    ``EPMCMC(subposteriors=True)``. Clients whose results are not finite are
    masked out (with a warning).
    """
    from ..potential import get_potential

    check_client(backend)
    potential = get_potential(model, fed, model_kwargs)
    ctx = Context(potential, fed.num_clients, np.asarray(fed.sizes), fed.num_rows)
    key = jax.random.PRNGKey(seed)
    k_server, k_start, k_run = jax.random.split(key, 3)
    results, mask = _run_all(backend, ctx, float(prior_weight), bool(shared_start), fed.client_data(),
                             k_start, k_run)
    bad = np.flatnonzero(~np.asarray(mask))
    if bad.size:
        warnings.warn(f"run_clients: the results of client(s) {bad.tolist()} are not finite; they are masked "
                      "out of every aggregate", RuntimeWarning, stacklevel=2)
    return ClientRuns(ctx, results, mask, float(prior_weight), k_server)


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _run_all(backend, ctx, prior_weight, shared_start, data, k_start, k_run):
    K = ctx.num_clients
    strategy = backend.init_strategy

    def one(d, k):
        k_init, k = jax.random.split(k)
        z0 = ctx.potential.init(k_start if shared_start else k_init, strategy)
        res = run_chains(backend, k, ctx.potential, make_target(d, ctx.dim, prior_weight=prior_weight), z0)
        return res, finite_flag(res.posterior)

    return vmap_clients(one)(data, jax.random.split(k_run, K))


def aggregate(algorithms, runs: ClientRuns, key=None) -> list:
    """The posteriors of several one-round ``algorithms`` from one :class:`ClientRuns` (no re-run).

    Each algorithm must ask for the prior share the clients used
    (``runs.prior_weight``); a mismatch raises ValueError. key: the server key
    (default ``runs.key``).
    """
    ctx = runs.context
    out = []
    for algo in algorithms:
        if not isinstance(algo, OneRoundAlgorithm):
            raise TypeError(f"aggregate takes one-round algorithms, got {type(algo).__name__}")
        s = algo.prior_weight(ctx)
        if abs(s - runs.prior_weight) > 1e-9 * max(1.0, abs(s)):
            raise ValueError(f"{type(algo).__name__} needs clients run with prior share {s:g}, these used "
                             f"{runs.prior_weight:g} (run_clients(..., prior_weight={s:g}))")
        out.append(algo.posterior_from_results(ctx, runs.results, runs.key if key is None else key, runs.mask))
    return out


# -- client results as draws, Gaussians and Monte Carlo statistics --------------------------------------

def result_draws(result, key, num_samples: int) -> Array:
    """(S, d) draws of a client result: its Samples, or ``num_samples`` draws of its Gaussian."""
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        return post.draws
    if isinstance(post, Gaussian):
        return post.sample(key, num_samples)
    raise ValueError(f"client backend returned {type(post).__name__}; expected Samples or Gaussian")


def result_gaussian(result, diag: bool, jitter: float = 1e-6, name: str = "moment_match") -> Gaussian:
    """The client's Gaussian: moment-matched to Samples (with shrinkage), or its Gaussian in the asked form.

    A full Gaussian asked for diagonally keeps its marginal variances; a
    diagonal one asked for fully becomes a diagonal matrix. See
    :func:`fedprob.gaussian.moment_match`.
    """
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        return gauss.moment_match(post.draws, diag, jitter, name=name)
    if isinstance(post, Gaussian):
        return post.to_diag() if diag else post.to_full()
    raise ValueError(f"client backend returned {type(post).__name__}; expected Samples or Gaussian")


def draws_ess(draws) -> Array:
    """(d,) single-chain effective sample size of each coordinate of (S, d) draws (0 where not finite)."""
    ess = effective_sample_size(draws)
    return jnp.where(jnp.isfinite(ess), ess, 0.0)


def mc_message(weight, cov, ess) -> dict:
    """The Monte Carlo entries of a summing message: ``{"mc": W Sigma_mc W, "ess": min ESS}``.

    See :func:`fedprob.gaussian.mean_error_term`; ``ess`` (d,) per coordinate.
    """
    return {"mc": gauss.mean_error_term(weight, cov, ess), "ess": jnp.min(ess)}


def _huge(dtype):
    return jnp.asarray(jnp.finfo(dtype).max, dtype)


def client_gaussian_message(result, diag: bool, jitter: float, name: str) -> dict:
    """A summing message of a client's Gaussian: natural parameters and Monte Carlo terms.

    ``{"linear": P mu, "precision": P, "mc": P Sigma_mc P, "ess": min ESS}``.
    Samples: moment-matched with shrinkage, per-coordinate ESS from the
    draws. A Gaussian output has no Monte Carlo error: ``mc = 0`` and ``ess``
    the largest float (finite, so the engine's finiteness check passes).
    """
    post = result.posterior if hasattr(result, "posterior") else result
    if isinstance(post, Samples):
        g = gauss.moment_match(post.draws, diag, jitter, name=name)
        cov = g.variance() if diag else g.covariance()
        return {"linear": g.linear, "precision": g.precision, **mc_message(g.precision, cov, draws_ess(post.draws))}
    g = result_gaussian(post, diag, jitter)
    return {"linear": g.linear, "precision": g.precision, "mc": jnp.zeros_like(g.precision),
            "ess": _huge(g.linear.dtype)}


def monte_carlo_check(name: str, precision, mc_sum, ids, ess, threshold: float = MC_ERROR_WARN) -> dict:
    """Monte Carlo error of a product's mean as a fraction of its posterior sd; warns above ``threshold``.

    Returns info entries: ``mc_error_sd_ratio`` (the largest over
    coordinates of ``sd_mc(mean_i) / sd(posterior_i)``,
    :func:`fedprob.gaussian.relative_mean_error`), ``mc_error_coordinate``
    (where), ``client_ess`` (client id -> smallest ESS). The product is about
    sqrt(K) narrower than each client, while every client's mean carries its
    own sampling error ``sd_k / sqrt(ESS_k)``: few effective draws per client
    leave the product's mean off by a visible fraction of its sd. The
    estimate covers the sampling error of the client means only (not a
    sampler's bias, nor the error of the fitted precisions, nor an ESS
    overestimated from a short chain), so it is a lower bound on the error.
    """
    ratio = np.asarray(_relative_error(precision, mc_sum), np.float64)
    ratio = np.where(np.isfinite(ratio), ratio, np.inf)
    i = int(np.argmax(ratio))
    r = float(ratio[i])
    ess = np.where(np.asarray(ess) >= 0.99 * np.finfo(np.float32).max, np.inf, ess)    # exact Gaussian output
    info = {"mc_error_sd_ratio": r, "mc_error_coordinate": i,
            "client_ess": {int(k): float(e) for k, e in zip(ids, ess)}}
    if r > threshold:
        order = np.argsort(ess)[:3]
        worst = ", ".join(f"client {int(ids[j])} (ESS {float(ess[j]):.3g})" for j in order)
        factor = (r / threshold) ** 2
        warnings.warn(
            f"{name}: the Monte Carlo error of the combined mean is {r:.2f} of the posterior sd (coordinate "
            f"{i}); the product is about sqrt(K) narrower than each client while each client's mean carries "
            f"its own sampling error. Lowest effective sample sizes: {worst}. Draw about {factor:.1f}x as many "
            "effective samples on every client (more draws, longer chains, a better-mixing sampler) to bring "
            f"it below {threshold}; see posterior.info['mc_error_sd_ratio'].", RuntimeWarning, stacklevel=3)
    return info


_relative_error = jax.jit(gauss.relative_mean_error)


def client_weights(sizes, weighting: str) -> Array:
    """Mixture weights over clients: ∝ N_k (``"size"``) or ``"uniform"``."""
    sizes = jnp.asarray(sizes, jnp.result_type(float))
    if weighting == "size":
        return sizes / jnp.sum(sizes)
    if weighting == "uniform":
        return jnp.full(sizes.shape, 1.0 / sizes.shape[0])
    raise ValueError(f"weighting must be 'size' or 'uniform', got {weighting!r}")


__all__ = ["OneRoundAlgorithm", "OneRoundState", "PhaseData", "FromClientPhase", "run_client_phase",
           "client_phase_key", "SummingOneRoundAlgorithm", "SumState", "ClientRuns",
           "run_clients", "aggregate", "result_draws", "result_gaussian", "draws_ess", "mc_message",
           "client_gaussian_message",
           "monte_carlo_check", "client_weights", "check_client", "prior_gaussian", "prior_draws",
           "gaussian_product"]
