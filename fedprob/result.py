"""``Result``: what ``fp.run`` returns, and the per-round records it is collected from.

:class:`RunLog` gathers one round at a time (the history entry, the
per-participant client diagnostics, the latest per-draw sampler statistics
of each client); :func:`collect` turns the final states and the log into a
:class:`Result`.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

import numpy as np

from . import convergence, psis
from .algorithms.base import Algorithm, Context
from .posteriors import Gaussian, GlobalPosterior
from .protocols import DRAW_STATS


@dataclasses.dataclass
class Result:
    """What ``fp.run`` returns.

    posterior: the :class:`~fedprob.posteriors.GlobalPosterior`.
    history: one dict per round: ``round``, ``time`` (seconds, compile
    excluded), ``participants``, ``dropped`` / ``stragglers`` (simulated
    faults), ``straggler_steps`` (one per straggler: the local steps it
    completed and sent; 0 when its message was discarded), ``excluded``
    (reporting clients quarantined: update not finite
    or over ``max_update_norm``) with ``faults`` (``{"client", "reason"}``
    each), ``server_update_ok``, client diagnostics (means over the
    aggregated clients, prefixed ``client_``), eval metrics, and under
    differential privacy ``dp_epsilon`` / ``dp_delta`` (cumulative).
    compile_time / init_time: seconds spent compiling the round (0 when it
    came from the cache) and initialising. eval_data: the (X, y) evaluated on
    (None when none was given). client_diagnostics: one dict per round of
    per-participant arrays (``participants``, ``included`` and every scalar
    backend diagnostic), the source of ``to_arviz()``'s ``sample_stats``.
    client_draw_stats: the backends' per-draw sampler statistics
    (:data:`~fedprob.protocols.DRAW_STATS`: NUTS/HMC divergences, acceptance,
    energy, ...), name -> (K, num_chains, S) array from each client's latest
    included round (``"has"``: (K,) which clients have them); empty when the
    backend gives none. Only the latest round is kept, so the memory is one
    set of per-draw scalars per client however many rounds run.
    info: ``engine``, ``devices``, ``client_chunk``, ``compile_round_s``,
    ``straggler_policy`` (with stragglers: ``"truncate"``, ``"discard"`` or
    ``"discard (no partial result)"``, the fallback of algorithms without
    local steps),
    ``client_phase_compile_s`` / ``client_phase_s`` (one-round methods: the
    client phase runs as its own compiled call, shared between methods with
    the same backend and shapes; see :mod:`fedprob.engine.client_phase`);
    ``compile_time`` includes the client phase's compile; ``local_refresh``
    (models with client-local sites): the extra client pass after the last
    round that re-takes every client's local posterior against the final
    global one (``time_s``, ``clients``, ``not_finite``: clients that kept
    their previous local posterior).
    client_khat: (K,) Pareto k-hat of each client's Gaussian against its own
    target (:mod:`fedprob.psis`; NaN where a client has none), None when the
    method has no Gaussian client (or the model more than
    :data:`fedprob.psis.MAX_DIM` parameters). global_khat: the k-hat of a
    Gaussian global posterior against the exact posterior (None for other
    posteriors). Above 0.7 the run warned once.
    """

    posterior: GlobalPosterior
    history: list
    server_state: Any
    client_states: Any
    algorithm: Algorithm
    context: Context
    compile_time: float
    init_time: float
    eval_data: Any = None
    client_diagnostics: list = dataclasses.field(default_factory=list)
    client_draw_stats: dict = dataclasses.field(default_factory=dict)
    info: dict = dataclasses.field(default_factory=dict)
    client_khat: Optional[np.ndarray] = None
    global_khat: Optional[float] = None

    def metric(self, name: str) -> np.ndarray:
        """One history column as an array (NaN where a round lacks it)."""
        return np.array([h.get(name, np.nan) for h in self.history], dtype=float)

    @property
    def excluded_clients(self) -> dict:
        """round -> client ids left out of that round's aggregate."""
        return {h["round"]: h["excluded"] for h in self.history if h["excluded"]}

    @property
    def faults(self) -> list:
        """(round, client, reason) of every quarantined client."""
        return [(h["round"], f["client"], f["reason"]) for h in self.history for f in h.get("faults", ())]

    def to_arviz(self, num_draws: int = 1000, num_chains: int = 4, seed: int = 0, eval_data=None):
        """ArviZ InferenceData (0.23) or DataTree (1.x); see :func:`fedprob.arviz_io.to_arviz`."""
        from .arviz_io import to_arviz

        return to_arviz(self, num_draws=num_draws, num_chains=num_chains, seed=seed, eval_data=eval_data)

    def diagnostics(self, warn: bool = True):
        """Per-scope (global, each client) ESS, R-hat, Gaussian gap and sampler health as a Table."""
        from .arviz_io import diagnostics_table

        return diagnostics_table(self, warn=warn)

    def summary(self, prob: float = 0.94, num_draws: int = 4000, seed: int = 0):
        """The global posterior's summary table (mean, sd, ``prob`` interval, ESS, R-hat per coordinate),
        its chains those of the client backend (:func:`fedprob.summary.summary`)."""
        from .arviz_io import _chains_of
        from .summary import summary

        return summary(self.posterior, chains=_chains_of(self), num_draws=num_draws, seed=seed, prob=prob,
                       title=f"posterior summary: {type(self.algorithm).__name__}")

    def report(self, path, name: Optional[str] = None, reference=None, reference_name: Optional[str] = None) -> str:
        """Write a self-contained HTML report of this result to ``path``; returns the path. ``reference``:
        a reference posterior (e.g. pooled NUTS's draws, dict site -> draws) whose marginals the page
        draws beside this posterior's (:func:`fedprob.report.html_report`)."""
        from .report import result_report

        return result_report(self, path, name=name, reference=reference, reference_name=reference_name)


def keep_draw_stats(store: dict, per_draw: dict, participants, included, K: int) -> None:
    """Overwrite ``store``'s (K, C, S) per-draw statistics with this round's for the included participants."""
    ids = np.asarray(participants)[np.asarray(included, bool)]
    for name, v in per_draw.items():
        v = np.asarray(v)                                   # (M, C, S) over the round's participants
        if name not in store or store[name].shape[1:] != v.shape[1:]:
            store[name] = np.zeros((K,) + v.shape[1:], v.dtype)
            store["has"] = np.zeros(K, bool)
        store[name][ids] = v[np.asarray(included, bool)]
    store["has"][ids] = True


class RunLog:
    """The history of a run's rounds and the client statistics kept beside it.

    history: one dict per round (starts with the rounds restored from a
    checkpoint). client_diagnostics: per-participant arrays of this process's
    rounds (not checkpointed). draw_stats: each client's latest included
    round's per-draw statistics (not checkpointed).
    """

    def __init__(self, num_clients: int, history: Optional[list] = None):
        self.num_clients = num_clients
        self.history = [] if history is None else history
        self.client_diagnostics: list = []
        self.draw_stats: dict = {}

    def add(self, entry: dict, rinfo) -> None:
        """Record round ``entry`` and the round's :class:`~fedprob.engine.local.RoundInfo`."""
        participants, included = np.asarray(rinfo.participants), np.asarray(rinfo.included)
        diags = dict(rinfo.diagnostics)
        per_draw = diags.pop(DRAW_STATS, None)
        if per_draw:
            keep_draw_stats(self.draw_stats, per_draw, participants, included, self.num_clients)
        self.history.append(entry)
        self.client_diagnostics.append({"participants": participants, "included": included,
                                        **{n: np.asarray(v) for n, v in diags.items()}})


def collect(algorithm: Algorithm, ctx: Context, server, clients, log: RunLog, compile_time: float,
            init_time: float, eval_data=None, info: Optional[dict] = None, posterior=None, data=None,
            seed: int = 0) -> Result:
    """The :class:`Result` of a finished run; warns (RuntimeWarning) when rounds left clients out, and
    once when a client's Gaussian has a Pareto k-hat above 0.7 (:mod:`fedprob.psis`; ``data``: the
    stacked client data, needed by the iterative Gaussian methods' check after the last round), and
    when a point-estimate method stopped more than 0.3 posterior sd from the global mode
    (:mod:`fedprob.convergence`).

    ``posterior``: the final states' posterior when the caller has it already (the last round's
    evaluation), so that it is not computed, nor its checks warned, twice.
    """
    excluded = {h["round"]: h["excluded"] for h in log.history if h["excluded"]}
    if excluded:
        first = next(iter(excluded))
        unbounded = [h["round"] for h in log.history if h.get("client_unbounded", 0) > 0]
        why = (f"; in {len(unbounded)} round(s) (first: {unbounded[0]}) a Laplace client's local objective "
               "was unbounded below (its Gaussian term, the server's precision less the client's site, is not "
               "positive definite: a diagonal family with rho below a client's share of the curvature)"
               if unbounded else "")
        warnings.warn(f"{len(excluded)} round(s) left clients out of the aggregate because their updates "
                      f"were not finite or over max_update_norm (first: round {first}, clients "
                      f"{excluded[first]}){why}; see Result.faults", RuntimeWarning, stacklevel=3)
    if posterior is None:
        posterior = algorithm.posterior(ctx, server, clients)
    posterior = algorithm.choose_prediction(ctx, server, clients, data, posterior)
    form = getattr(posterior, "form", None)
    khat, gk = psis.run_khats(algorithm, ctx, server, clients, data, log.client_diagnostics,
                              form if isinstance(form, Gaussian) else None, seed)
    result = Result(posterior, log.history, server, clients, algorithm, ctx, compile_time, init_time, eval_data,
                    log.client_diagnostics, log.draw_stats, info or {}, khat, gk)
    if psis.message(khat, gk) is not None:
        result.__dict__.setdefault("_warned", set()).add("khat")
        psis.warn(khat, gk, stacklevel=3)
    note = algorithm.run_message(log.history) if log.history else None
    if note is not None:
        result.info["run_message"] = note
        warnings.warn(note, RuntimeWarning, stacklevel=3)
    dist = convergence.check(algorithm, ctx, posterior, data, len(log.history), stacklevel=3)
    if dist is not None:
        result.info["mode_distance_sd"] = dist
    diag = convergence.diagonal_check(algorithm, ctx, posterior, data, stacklevel=3)
    if diag is not None:
        result.info["diagonal_check"] = diag
    return result


__all__ = ["Result", "RunLog", "collect", "keep_draw_stats"]
