"""The server side every one-round method shares: slot-keeping and summing bases.

:class:`OneRoundAlgorithm` keeps one slot per client (:class:`OneRoundState`) and combines in
``posterior()``; :class:`SummingOneRoundAlgorithm` keeps masked sums of sufficient statistics
(:class:`SumState`), so server memory does not grow with K. The rules (prior share, repeated
participation, client ids from client states) are in :mod:`fedprob.algorithms.one_round`.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import local_sites as loc
from ..inference import NUTS
from ..posteriors import Gaussian, Samples
from ..protocols import ClientBackend, ClientResult, run_chains
from ..potential import make_target
from ..validation import check_choice, check_int  # noqa: F401  (re-exported to the methods)
from .aliases import alias_field, resolve_family
from .. import gaussian as gauss
from .base import Algorithm, Context, masked_sum
from .diag_bias import diag_bias_check, diag_probe
from .messages import result_draws, result_gaussian
from .stein import stein_gaussian

#: How a sampling client's Gaussian is fitted (:class:`GaussianProductAlgorithm`).
MOMENTS = ("stein", "sample")

Array = jax.Array


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


class LocalClient(NamedTuple):
    """Client state of a one-round method on a model with client-local sites: the client's id and
    the conditional ``l_k | g`` of its local sites fitted to its joint draws
    (:func:`fedprob.local_sites.conditional_from_draws`)."""

    id: Array
    local: loc.LocalConditional


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

    def gaussian_fit(self, ctx: Context, result):
        """The Gaussian this client's result stands for (its Pareto k-hat is reported), or None.

        Default: a Gaussian backend's output; a sampler's draws stand for themselves (None).
        Methods that moment-match draws (EPMCMC, ConsensusMC) return the fitted Gaussian."""
        post = result.posterior if hasattr(result, "posterior") else result
        return post if isinstance(post, Gaussian) else None

    def client_khat(self, ctx: Context, result, data, key) -> dict:
        """``{"khat": k}``: the Pareto k-hat of :meth:`gaussian_fit` against this client's own
        target (prior share :meth:`prior_weight`, full batch; :mod:`fedprob.psis`), or ``{}``."""
        from .. import psis

        g = self.gaussian_fit(ctx, result) if psis.applies(ctx.potential) else None
        if g is None:
            return {}
        target = make_target(data, ctx.dim, prior_weight=self.prior_weight(ctx), dtype=g.linear.dtype)
        return {"khat": psis.gaussian_khat(jax.random.fold_in(key, 17), ctx.potential, g, target)}

    def client_message(self, ctx: Context, data, result, key):
        """The message of a client whose rows (:class:`~fedprob.potential.ClientData`) are at hand:
        :meth:`make_message`, plus what a method computes from the client's target (the
        off-diagonal curvature probe of a diagonal Gaussian product,
        :mod:`fedprob.algorithms.diag_bias`)."""
        return self.make_message(ctx, result, key)

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

    def split_local(self, ctx: Context, result):
        """``(result of the global block, LocalConditional)`` of a joint client result on a model with
        client-local sites (the draws' global block; the local sites' conditional given the global ones,
        regressed on the joint draws); ``(result, None)`` without local sites. The conditional
        ``p(l_k | g, D_k)`` does not depend on the prior share of the global sites, so a sub-posterior's
        draws give it as well as a full posterior's."""
        pot = ctx.potential
        if not pot.local_sites:
            return result, None
        dg = pot.dim_global
        draws = result.posterior.draws
        cond = loc.conditional_from_draws(draws.reshape(-1, draws.shape[-1]), dg)
        return ClientResult(Samples(draws[..., :dg]), result.params[..., :dg], result.diagnostics), cond

    def _client_message(self, ctx: Context, data, key, start_key=None):
        """``(message, diagnostics, local conditional or None)`` of one client."""
        k_run, k_msg = jax.random.split(key)
        result, cond = self.split_local(ctx, self.run_client(ctx, data, k_run, start_key))
        diagnostics = {**result.diagnostics, **self.client_khat(ctx, result, data, k_msg)}
        return self.client_message(ctx, data, result, k_msg), diagnostics, cond

    def init(self, ctx: Context, key, data):
        """Empty server state shaped like one client's message (traced, not run) and client ids 0..K-1
        (with client-local sites, :class:`LocalClient` states holding an empty conditional each).

        ``key`` is kept in the server state for the server's own draws in ``posterior``.
        """
        one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
        kspec = jax.ShapeDtypeStruct(jnp.shape(key), jnp.asarray(key).dtype)
        shapes, _, cond = jax.eval_shape(lambda d, k: self._client_message(ctx, d, k, k), one, kspec)
        ids = jnp.arange(ctx.num_clients, dtype=jnp.int32)
        if cond is not None:
            K = ctx.num_clients
            ids = LocalClient(ids, jax.tree_util.tree_map(lambda s: jnp.zeros((K,) + s.shape, s.dtype), cond))
        return self.empty_state(ctx, key, shapes), ids

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
        message, diagnostics, cond = self._client_message(ctx, data, key, start_key)
        if cond is None:
            return client_state, (client_state, message), diagnostics
        return LocalClient(client_state.id, cond), (client_state.id, message), diagnostics

    @staticmethod
    def local_of(client_states):
        """The clients' stacked local conditionals, or None (no client-local sites)."""
        return client_states.local if isinstance(client_states, LocalClient) else None

    @staticmethod
    def local_info(info: dict, client_states) -> dict:
        """``info`` with a note on the local posteriors when the clients kept some."""
        if isinstance(client_states, LocalClient):
            info["local_posterior"] = (
                "each client's local sites given the global ones, regressed on its joint draws (p(l_k | g, "
                "D_k) does not depend on the prior share), averaged over the combined global posterior")
        return info

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
    def posterior_from_results(self, ctx: Context, results, key=None, mask=None, sizes=None, data=None):
        """This method's posterior from client results computed elsewhere (no client is re-run).

        results: a :class:`~fedprob.protocols.ClientResult` (or a bare
        ``Samples``/``Gaussian``, whose mean then stands for the client's
        final point) stacked over the K clients of ``ctx``, e.g.
        ``run_clients(...).results``; it must come from the prior share this
        method asks for (:meth:`prior_weight`; not checked here, see
        :func:`aggregate`). key: the server key (default ``PRNGKey(0)``);
        mask: (K,) clients to use (default all); sizes: (K,) N_k (default
        ``ctx.client_sizes``); data: the clients' stacked
        :class:`~fedprob.potential.ClientData` (``run_clients(...).data``), for the parts of a
        message computed from a client's target (:meth:`client_message`; without it they are
        left out). Messages are built, then one ``server_update`` and ``posterior`` run as in
        ``fp.run``.
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
        payload = _messages(self, ctx, results, keys) if data is None else _data_messages(self, ctx, data, results,
                                                                                           keys)
        shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), payload)
        state = self.empty_state(ctx, key, shapes)
        mask = jnp.ones((K,), bool) if mask is None else jnp.asarray(mask, bool)
        sizes = jnp.asarray(ctx.client_sizes if sizes is None else sizes)
        state = self.server_update(ctx, state, (jnp.arange(K, dtype=jnp.int32), payload), sizes, mask)
        return self.posterior(ctx, state, None)


@partial(jax.jit, static_argnums=(0, 1))
def _messages(algo, ctx, results, keys):
    return jax.vmap(lambda r, k: algo.make_message(ctx, r, k))(results, keys)


@partial(jax.jit, static_argnums=(0, 1))
def _data_messages(algo, ctx, data, results, keys):
    return jax.vmap(lambda d, r, k: algo.client_message(ctx, d, r, k))(data, results, keys)


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


@dataclasses.dataclass(frozen=True)
class GaussianProductAlgorithm(SummingOneRoundAlgorithm):
    """Base of the one-round methods that weight clients by Gaussian precisions (EPMCMC, ConsensusMC).

    family: ``"full"`` or ``"diag"`` precisions (alias ``covariance``); None,
    the default: the client backend's own (:func:`~fedprob.algorithms.aliases.resolve_family`:
    ``"diag"`` for IVON, diagonal Laplace and mean-field SVI, ``"full"`` for
    samplers and full Gaussian backends; a diagonal family over a full
    Gaussian backend is refused). num_samples: draws taken from a Gaussian
    client output; jitter: added to each sample covariance, relative to its
    mean variance; num_prior_samples: prior draws for moment matching a
    non-Gaussian prior; bias_probes: with ``family="diag"``, the number of
    Hessian-vector products each client spends probing the off-diagonal
    curvature its diagonal message drops (exact when d <= bias_probes; 0: no
    probe), from which the server estimates the diagonal product's bias and
    warns (:mod:`fedprob.algorithms.diag_bias`). moments: how a sampling
    client's Gaussian is fitted to its draws: ``"stein"`` (the default; the
    regression of the client target's gradients at the draws on the draws,
    :mod:`fedprob.algorithms.stein`: the moment-matched Gaussian with a
    control variate, exact for a Gaussian client from any d + 1 draws; one
    gradient per draw, minibatched with the backend's ``batch_size``; falls
    back to sample moments where the fit is not positive definite, counted in
    ``info["stein_fallbacks"]``, and with fewer than ``2 (d + 1)`` draws for a
    full family; a variational Gaussian, SVI's, is refined by one
    natural-gradient step from ``num_samples`` of its draws, see
    :meth:`stein_fit`) or ``"sample"`` (sample mean and shrunk sample
    covariance).
    """

    family: Optional[str] = None
    num_samples: int = 1000
    jitter: float = 1e-6
    num_prior_samples: int = 2000
    covariance: Any = alias_field()
    bias_probes: int = 16
    moments: str = "stein"

    def __post_init__(self):
        super().__post_init__()
        resolve_family(self, "full")
        check_int("num_samples", self.num_samples, 2)
        check_int("num_prior_samples", self.num_prior_samples, 2)
        check_int("bias_probes", self.bias_probes, 0)
        check_choice("moments", self.moments, MOMENTS)
        if self.family == "diag" and self.bias_probes == 1:
            raise ValueError("bias_probes must be 0 (no probe) or at least 2 (the estimate pairs distinct probes)")
        if not self.jitter >= 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")

    def gaussian_fit(self, ctx: Context, result):
        """The Gaussian the product uses: a Gaussian output, or the Gaussian moment-matched to the draws
        (the kernel variants of EPMCMC use no Gaussian of a sampler's draws: None)."""
        post = result.posterior if hasattr(result, "posterior") else result
        if isinstance(post, Samples) and getattr(self, "method", "parametric") == "parametric":
            return gauss.moment_match(post.draws, self.family == "diag", self.jitter, warn=False)
        return super().gaussian_fit(ctx, result)

    def probes_diag_bias(self) -> bool:
        """True when clients probe the curvature a diagonal product drops (``family="diag"``, a
        summing server, ``bias_probes > 0``)."""
        return self.family == "diag" and self.bias_probes > 0 and self.sums_messages()

    #: True when :meth:`make_message` maps the draws onto the Stein fit's moments: the fit then carries
    #: the map (:func:`fedprob.algorithms.stein.stein_gaussian` with ``transform=True``).
    maps_draws_to_fit = False

    def stein_fit(self, ctx: Context, data, result, key):
        """``(Gaussian, residuals, ok)`` by Stein moments (:func:`fedprob.algorithms.stein.stein_gaussian`,
        the gradients of the client's target with prior share :meth:`prior_weight`), or None
        (``moments="sample"``, a kernel variant, client-local sites, a Gaussian backend that is not a
        variational fixed point, fewer than ``2 (d + 1)`` draws for a full family).

        Sampling clients: their draws (the moment-matched Gaussian with a control variate). A variational
        Gaussian ``q`` (SVI): ``num_samples`` draws of ``q`` drawn with ``key`` (the same draws
        ConsensusMC sends); the regression under ``q`` is one natural-gradient step of unit rate,
        ``P = -E_q[hess log pi]``, ``m + P^-1 E_q[grad log pi]`` (Stein's lemma), whose fixed point is the
        ELBO's optimum, so it removes what is left of the optimiser's noise and is exact for a Gaussian
        target."""
        post = result.posterior if hasattr(result, "posterior") else result
        if (self.moments != "stein" or ctx.potential.local_sites
                or getattr(self, "method", "parametric") != "parametric"):
            return None
        if isinstance(post, Samples):
            draws = post.draws
        elif isinstance(post, Gaussian) and getattr(self.backend, "variational_fixed_point", False):
            draws = result_draws(post, key, self.num_samples)
        else:
            return None
        S, d = draws.shape[-2:]
        if S < (3 if self.family == "diag" else 2 * (d + 1)):
            return None          # too few draws for the regression: sample moments (with their shrinkage)
        target = make_target(data, ctx.dim, prior_weight=self.prior_weight(ctx), dtype=draws.dtype)
        batch = getattr(self.backend, "batch_size", None)
        keys = jax.random.split(jax.random.fold_in(key, 23), draws.shape[0])
        grads = jax.vmap(lambda z, k: jax.grad(ctx.potential.log_density)(z, target, k, batch))(draws, keys)
        return stein_gaussian(draws, grads.astype(draws.dtype), self.family == "diag", self.jitter,
                              transform=self.maps_draws_to_fit)

    def make_message(self, ctx: Context, result, key, fit=None):  # pragma: no cover - abstract
        """The pytree a client sends, from its :class:`ClientResult` and its :meth:`stein_fit` (or None)."""
        raise NotImplementedError

    def client_message(self, ctx: Context, data, result, key):
        """:meth:`make_message` (with the :meth:`stein_fit`), plus the off-diagonal probe when
        :meth:`probes_diag_bias`."""
        msg = self.make_message(ctx, result, key, self.stein_fit(ctx, data, result, key))
        if not self.probes_diag_bias() or ctx.potential.local_sites:
            return msg
        g = result_gaussian(result, True, self.jitter)
        probe = diag_probe(ctx.potential, data, self.prior_weight(ctx), g.mean(), g.precision, self.bias_probes)
        return {**msg, **probe}

    def diag_bias_info(self, name: str, sums: dict, precision, prior=None, num_clients: int = 0) -> dict:
        """The diagonal product's bias from the summed probes (empty when none were sent):
        precision ``sum_k D_k``; prior: the diagonal Gaussian the product added (or None)."""
        if not self.probes_diag_bias() or "probe" not in sums:
            return {}
        lin = sums["probe_linear"]
        p0 = jnp.zeros_like(lin) if prior is None else prior.precision
        l0 = jnp.zeros_like(lin) if prior is None else prior.linear
        mean = (lin + l0) / (precision + p0)
        return diag_bias_check(name, sums, mean, precision, l0, p0, self.bias_probes, num_clients)

    def local_sites_refusal(self, potential):
        """None for sampling clients: the product runs over the global block of their draws, each
        client keeping the conditional of its local sites (:meth:`split_local`)."""
        if self.backend.output != "samples":
            return (f"{type(self).__name__} takes client-local sites with sampling clients only (NUTS, HMC, "
                    f"SG-MCMC), not {type(self.backend).__name__}: use PVI for Gaussian clients")
        return None

    def prior_of(self, ctx: Context, key, diag: bool):
        """``(Gaussian, exact)``: the prior as a Gaussian, of the global block for a model with
        client-local sites (:mod:`fedprob.algorithms.model_prior`)."""
        if ctx.potential.local_sites:
            from .model_prior import _diag_model_prior

            g, exact = _diag_model_prior(ctx.potential)
            return (g if diag else g.to_full()), exact
        return gauss.prior_gaussian(ctx.potential, key, diag, self.num_prior_samples)


__all__ = ["OneRoundState", "SumState", "LocalClient", "check_client", "OneRoundAlgorithm", "SummingOneRoundAlgorithm",
           "GaussianProductAlgorithm", "check_choice", "check_int"]
