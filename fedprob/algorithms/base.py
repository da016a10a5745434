"""The server-strategy protocol every federated algorithm implements.

An algorithm is a frozen dataclass of hyperparameters (hashable: the engine
caches compiled rounds on it) with pure methods:

* ``init(ctx, key, data) -> (server_state, client_states)``: ``client_states``
  is a pytree with a leading axis of length K (``()`` when clients keep no
  state); ``data`` is the stacked :class:`~fedprob.potential.ClientData`.
* ``client_update(ctx, server_state, client_state, data, key)
  -> (client_state, message, diagnostics)`` for ONE client; the engine vmaps
  it over the participating clients. ``diagnostics`` is a dict of scalars.
* ``server_update(ctx, server_state, messages, weights, mask) -> server_state``:
  ``messages`` have a leading axis over the participating clients,
  ``weights`` are their sizes N_k, ``mask`` is False for clients left out
  (absent, or whose update was not finite). Aggregation is a masked
  (weighted) sum or mean over that axis.
* ``posterior(ctx, server_state, client_states) -> GlobalPosterior``.

``default_rounds`` is 1 for one-round methods; ``rounds_for(num_clients,
client_sizes, clients_per_round)`` is what ``fp.run`` takes when no rounds
are given (``default_rounds`` unless an algorithm knows better, e.g. damped
PVI). ``ctx`` is a :class:`Context`.

Optional hooks for message transforms (the norm bound of
:mod:`fedprob.faults`, differential privacy of :mod:`fedprob.privacy`):
``update_part(ctx, message)`` names the leaves of ONE client's message that
are an update relative to the server state (``None``: the message has none),
and ``with_update(ctx, message, update)`` is the message sent in place of
``message`` once its update has been transformed.

Optional hook for stragglers truncated at a deadline (:mod:`fedprob.faults`):
``local_step_count(ctx, data)`` is ONE client's full number of local steps
``S_k`` (an int or traced int), or ``None`` (default) when its update has no
meaningful partial result. An algorithm that returns a count accepts
``client_update(..., max_steps=b)`` with a traced ``b <= S_k``: it runs its
fixed-length step loop and leaves its state unchanged at every step
``t >= b``, so that with ``b = S_k`` the result equals the call without
``max_steps``. The engine passes ``max_steps`` only when it truncates.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..names import CheckedKeywords
from ..potential import Potential


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """Static facts about a federation that algorithms may use."""

    potential: Potential
    num_clients: int
    client_sizes: Any          # (K,) numpy int array
    num_rows: int

    @property
    def dim(self) -> int:
        return self.potential.dim


#: parameters from which a client's update fills the CPU's cores on its own (vmapping the clients adds
#: no parallelism there, only the padding of every client to the largest one's rows)
SEQUENTIAL_MIN_DIM = 10_000
#: the mean client size over the largest below which that padding is worth avoiding
SEQUENTIAL_MAX_FILL = 0.5


def sequential_pays(ctx: "Context") -> bool:
    """Whether clients whose updates skip their padded rows should be mapped one at a time: on the
    CPU, a model of at least :data:`SEQUENTIAL_MIN_DIM` parameters and client sizes whose mean is at
    most :data:`SEQUENTIAL_MAX_FILL` of the largest (under ``vmap`` every client pays the largest
    one's rows). Measured on the Fashion-MNIST MLP (178,110 weights, 10 clients of 233 to 2,555
    rows, mean 600): a PVI round with Laplace clients 23.0 s vmapped, 11.9 s one at a time
    (benchmarks/results/network_defaults_fmnist.md). Accelerators keep ``vmap``."""
    sizes = np.asarray(ctx.client_sizes, dtype=float)
    if jax.default_backend() != "cpu" or ctx.dim < SEQUENTIAL_MIN_DIM or sizes.size < 2 or sizes.max() <= 0:
        return False
    return bool(sizes.mean() <= SEQUENTIAL_MAX_FILL * sizes.max())


class Algorithm(CheckedKeywords):
    """Base class of federated algorithms (subclasses are frozen dataclasses; an unknown keyword
    argument is a TypeError naming the closest field, :class:`fedprob.names.CheckedKeywords`)."""

    default_rounds: int = 1
    #: True where the result is a point meant to be the global posterior mode (fedprob.convergence)
    reports_mode: bool = False

    #: dataclass fields that shape only the posterior built after the last round, never a round: runs of
    #: algorithms that differ only in them share compiled rounds (:meth:`round_key`)
    posterior_only: tuple = ()

    def round_key(self):
        """What compiled rounds and inits are cached under (fedprob.engine.local): the algorithm itself, or,
        with :attr:`posterior_only` fields, its type and every other field, so that e.g.
        ``PVI(prediction="mean")`` after ``PVI()`` on the same data compiles nothing."""
        if not self.posterior_only:
            return self
        return (type(self),) + tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                                     if f.name not in self.posterior_only)

    def rounds_for(self, num_clients: int, client_sizes, clients_per_round: int) -> int:
        """Rounds ``fp.run`` takes when none are given: :attr:`default_rounds`."""
        return int(self.default_rounds)

    def init(self, ctx: Context, key, data):  # pragma: no cover - abstract
        raise NotImplementedError

    def client_update(self, ctx: Context, server_state, client_state, data, key):  # pragma: no cover
        raise NotImplementedError

    def server_update(self, ctx: Context, server_state, messages, weights, mask):  # pragma: no cover
        raise NotImplementedError

    def posterior(self, ctx: Context, server_state, client_states):  # pragma: no cover
        raise NotImplementedError

    def local_step_count(self, ctx: Context, data):
        """ONE client's full number of local steps, or None: its update has no partial result."""
        return None

    def client_chunk_for(self, ctx: Context):
        """How the local engine maps the clients when the user set no ``client_chunk``: None (default)
        vmaps them all at once; 1 runs them one at a time (``lax.map``), for client updates whose
        loops over rows stop at the client's own last row, which under ``vmap`` run to the largest
        client's (:func:`sequential_pays`)."""
        return None

    def gaussian_fits(self, ctx: Context, server_state, client_states, data):
        """``(q, targets)`` after the last round of an iterative Gaussian method: the Gaussian ``q``
        that stands for every client's target and those targets (a
        :class:`~fedprob.potential.LocalTarget` stacked over the K clients), whose Pareto k-hats
        :mod:`fedprob.psis` reports; None (default) when the method has no such Gaussian (point
        estimates, samplers) or reports k-hat from its client updates (one-round methods)."""
        return None

    def choose_prediction(self, ctx: "Context", server_state, client_states, data, posterior):
        """The posterior with its default prediction settled from the clients' data (``data``:
        stacked over the K clients, or None where the server holds no rows). Default: unchanged;
        the natural loop's ``prediction="auto"`` scores each client's rows under its cavity
        (:mod:`fedprob.algorithms.prediction_choice`)."""
        return posterior

    def run_message(self, history) -> Optional[str]:
        """A warning for the end of a run, read from its history (a list of per-round dicts), or None
        (default): what a method could not do in its last round that its result should say."""
        return None

    def for_model(self, potential) -> "Algorithm":
        """The configuration a run uses on this model: ``self`` (default), or a copy whose defaulted
        options follow the model (PVI's family on a model with client-local sites). Called by
        every entry point once the potential is built; a choice the user made is never changed."""
        return self

    def local_sites_refusal(self, potential) -> Optional[str]:
        """Why this configuration cannot take the model's client-local sites (``infer={"local":
        True}``), or None when it can: it then sends only the global block and keeps each client's
        local posterior (:func:`check_local_sites`). Default: refused."""
        return f"{type(self).__name__} does not take client-local sites yet"

    def update_part(self, ctx: Context, message):
        """The update leaves of one client's ``message``, or None when it has none."""
        return None

    def with_update(self, ctx: Context, message, update):
        """``message`` with its update part replaced by ``update``."""
        raise NotImplementedError(f"{type(self).__name__} names no update part")


def check_local_sites(algorithm, potential) -> None:
    """A ValueError naming the model's client-local sites when ``algorithm`` cannot take them.

    Called by every entry point right after the potential is built, before
    anything is compiled: an algorithm that does not know local sites would
    otherwise treat them as global ones (averaged or multiplied across
    clients), which is a different model.
    """
    names = getattr(potential, "local_sites", ())
    if not names:
        return
    reason = algorithm.local_sites_refusal(potential)
    if reason is not None:
        listed = ", ".join(f"'{n}'" for n in names)
        raise ValueError(
            f"the model marks {listed} as client-local (infer={{'local': True}}), and {reason}; for a model "
            "with local sites use fp.algorithms.PVI, FedLapCov or BayesADMM (Gaussian clients), EP (sampling "
            "or Gaussian clients), EPMCMC (parametric), ConsensusMC or FedPA (sampling clients), FedAvg or "
            "FedProx (point estimates, local sites kept on each client), Ensemble or PredictiveBayes, or drop "
            "infer={'local': True} to share the site across clients")


def masked_weights(weights, mask):
    """Weights normalised over the clients in ``mask`` (zeros elsewhere)."""
    w = jnp.where(mask, weights.astype(jnp.result_type(float)), 0.0)
    return w / jnp.maximum(jnp.sum(w), 1e-30)


def weighted_mean(tree, weights, mask):
    """sum_k q_k x_k over the leading axis, q ∝ weights on the mask."""
    q = masked_weights(weights, mask)
    return jax.tree_util.tree_map(
        lambda a: jnp.tensordot(q, jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0), 1), tree)


def masked_sum(tree, mask):
    """sum_k x_k over the leading axis for clients in ``mask``."""
    return jax.tree_util.tree_map(
        lambda a: jnp.sum(jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0), 0), tree)


def stack_init(num_clients: int, value):
    """A per-client state: ``value`` repeated over a leading axis of length K."""
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (num_clients,) + jnp.shape(a)), value)


