"""``fp.run``: drive an algorithm over a federation with the local engine."""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Optional

import jax
import numpy as np

from . import checkpoint as ckpt
from . import progress as prog
from .algorithms.base import Algorithm, Context
from .data.federated import FederatedData, check_xy
from .engine import client_phase, local, sharded
from .faults import Faults
from .metrics import evaluate
from .posteriors import GlobalPosterior
from .potential import Potential
from .protocols import DRAW_STATS

def get_potential(model, fed: FederatedData, model_kwargs: Optional[dict] = None) -> Potential:
    """The :class:`Potential` of ``model`` (with ``model_kwargs``) on data shaped like ``fed``.

    Building one traces the model abstractly (no FLOPs). Potentials compare
    equal when they trace the same program, so compiled functions are shared
    between equal ones and never between different ``model_kwargs``.
    """
    return Potential(model, fed.X[0], fed.y[0], model_kwargs)


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
    ``compile_time`` includes the client phase's compile.
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

    def report(self, path, name: Optional[str] = None) -> str:
        """Write a self-contained HTML report of this result to ``path``; returns the path."""
        from .report import result_report

        return result_report(self, path, name=name)


def _keep_draw_stats(store: dict, per_draw: dict, participants, included, K: int) -> None:
    """Overwrite ``store``'s (K, C, S) per-draw statistics with this round's for the included participants."""
    ids = np.asarray(participants)[np.asarray(included, bool)]
    for name, v in per_draw.items():
        v = np.asarray(v)                                   # (M, C, S) over the round's participants
        if name not in store or store[name].shape[1:] != v.shape[1:]:
            store[name] = np.zeros((K,) + v.shape[1:], v.dtype)
            store["has"] = np.zeros(K, bool)
        store[name][ids] = v[np.asarray(included, bool)]
    store["has"][ids] = True


def _check_eval(eval_data, potential: Potential):
    if eval_data is None:
        return None
    if not isinstance(eval_data, (tuple, list)) or len(eval_data) != 2:
        raise ValueError("eval_data must be a pair (X_test, y_test)")
    X, y = np.asarray(eval_data[0]), np.asarray(eval_data[1])
    check_xy(X, y)
    if tuple(X.shape[1:]) != potential.x_shape:
        raise ValueError(f"eval_data X rows have shape {X.shape[1:]}, the federation's have {potential.x_shape}")
    if tuple(y.shape[1:]) != potential.y_shape:
        raise ValueError(f"eval_data y rows have shape {y.shape[1:]}, the federation's have {potential.y_shape}")
    if potential.task == "classification":
        _check_labels(y, potential.num_classes, "eval_data")
    return X.astype(np.float32), y


def _check_labels(y, num_classes, what):
    if num_classes is None:
        return
    y = np.asarray(y)
    if not np.all(np.mod(y, 1) == 0):
        raise ValueError(f"{what}: class labels must be integers")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"{what}: labels out of range [{int(y.min())}, {int(y.max())}] for a model "
                         f"with {num_classes} classes")


def _straggler_policy(algorithm, ctx, data, faults) -> str:
    """The policy applied to stragglers: ``"truncate"``, ``"discard"``, or ``"discard (no partial
    result)"`` when truncation was asked of an algorithm whose clients have no local steps."""
    if faults.straggler_policy == "discard":
        return "discard"
    one = jax.tree_util.tree_map(lambda a: a[0], data)
    steps = jax.eval_shape(lambda d: algorithm.local_step_count(ctx, d), one)
    return "truncate" if steps is not None else "discard (no partial result)"


def run(algorithm: Algorithm, model, fed: FederatedData, rounds: Optional[int] = None, seed: int = 0,
        eval_data=None, clients_per_round: Optional[int] = None, progress: bool = True,
        client_chunk: Optional[int] = None, eval_every: int = 1,
        model_kwargs: Optional[dict] = None, checkpoint_dir: Optional[str] = None,
        max_update_norm: Optional[float] = None, dropout_rate: float = 0.0,
        straggler_rate: float = 0.0, privacy=None, engine: str = "local", devices=None,
        num_nodes: Optional[int] = None, straggler_policy: str = "truncate",
        straggler_min_fraction: float = 0.0) -> Result:
    """Run ``algorithm`` on ``fed`` with the NumPyro ``model``.

    rounds: communication rounds (default ``algorithm.rounds_for(K, sizes, M)``:
    ``default_rounds``, 1 for one-round methods, 10 for iterative ones; damped
    PVI/FedLap/FedLap-Cov take enough rounds for their sites to converge).
    clients_per_round: M of the K clients sampled without replacement each
    round (default all); shapes stay fixed, so nothing recompiles between
    rounds. client_chunk: vmap clients in chunks of this
    size (``lax.map``) to bound memory. eval_data: (X, y) evaluated every
    ``eval_every`` rounds and at the end. Same seed, same result.

    checkpoint_dir: save server and client states and the history after every
    round there (:mod:`fedprob.checkpoint`); a later run with the same inputs
    and directory resumes from the newest checkpoint and gives exactly the
    uninterrupted result. max_update_norm / dropout_rate / straggler_rate:
    quarantine and simulated faults (:mod:`fedprob.faults`; off by default).
    A straggler completes ``floor(f * S_k)`` of its ``S_k`` local steps by the
    deadline, ``f ~ Uniform[straggler_min_fraction, 1)``; straggler_policy
    ``"truncate"`` (default) aggregates that partial update where the
    algorithm has local steps (FedAvg/FedProx, FedDyn, the natural loop with
    IVON or VON clients) and discards it otherwise (nothing completed, exact
    Laplace solves, sampler and one-round clients); ``"discard"`` always
    discards a straggler's message.
    privacy: a :class:`fedprob.privacy.GaussianDP` (client clipping and
    Gaussian noise, (epsilon, delta) in the history).

    engine: ``"local"`` (with several ``devices``, default ``jax.devices()``:
    all of this process's, or of every process after ``jax.distributed.initialize``,
    the clients are sharded over them, :mod:`fedprob.engine.sharded`)
    or ``"flower"`` (a local Flower simulation with ``num_nodes`` nodes,
    :mod:`fedprob.engine.flower`; needs ``pip install fedprob[flower]``).
    """
    if engine not in ("local", "flower"):
        raise ValueError(f"engine must be 'local' or 'flower', got {engine!r}")
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be a fedprob algorithm, got {type(algorithm).__name__}")
    if not isinstance(fed, FederatedData):
        raise TypeError("fed must be a FederatedData (see fp.data.partition / FederatedData.from_clients)")
    K = fed.num_clients
    M = K if clients_per_round is None else int(clients_per_round)
    if not 1 <= M <= K:
        raise ValueError(f"clients_per_round must be in [1, {K}], got {clients_per_round}")
    rounds = algorithm.rounds_for(K, fed.client_sizes, M) if rounds is None else rounds
    if not isinstance(rounds, (int, np.integer)) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    faults = Faults(dropout_rate, straggler_rate, max_update_norm, straggler_policy, straggler_min_fraction)
    if privacy is not None:
        from . import privacy as privacy_mod

        if not isinstance(privacy, privacy_mod.GaussianDP):
            raise TypeError(f"privacy must be a fedprob.privacy.GaussianDP, got {type(privacy).__name__}")
        privacy_mod.check_supported(algorithm)
    if engine == "flower":
        from .engine import flower

        given = [name for name, v in (("checkpoint_dir", checkpoint_dir), ("devices", devices),
                                      ("client_chunk", client_chunk),
                                      ("straggler_min_fraction", straggler_min_fraction or None)) if v is not None]
        if given:
            raise ValueError(f"engine='flower' does not support {', '.join(given)}; use engine='local'")
        if faults.truncates:
            raise ValueError("engine='flower' simulates stragglers by discarding their messages: pass "
                             "straggler_policy='discard' (truncated local work needs engine='local')")
        return flower.run(algorithm, model, fed, rounds=rounds, seed=seed, eval_data=eval_data,
                          clients_per_round=M, num_nodes=num_nodes, model_kwargs=model_kwargs,
                          faults=faults, privacy=privacy)
    devs = list(jax.devices() if devices is None else devices)
    multiprocess = sharded.processes(devs)
    if multiprocess is not None and checkpoint_dir is not None:
        raise ValueError(f"checkpoint_dir is not supported when the devices span several JAX processes "
                         f"({multiprocess}); checkpoint from a single-process run")
    potential = get_potential(model, fed, model_kwargs)
    if potential.task == "classification":
        _check_labels(fed.pooled()[1], potential.num_classes, "federation")
    evald = _check_eval(eval_data, potential)
    ctx = Context(potential, K, np.asarray(fed.sizes), fed.num_rows)
    data = fed.client_data()
    key = jax.random.PRNGKey(seed)
    k_init, k_rounds = jax.random.split(key)

    t0 = time.perf_counter()
    init_fn = local.compiled_init(algorithm, ctx, data, k_init)
    server, clients = jax.block_until_ready(init_fn(k_init, data))
    init_time = time.perf_counter() - t0

    history, start = [], 0
    if checkpoint_dir is not None:
        settings = {"seed": int(seed), "clients_per_round": M, "client_chunk": client_chunk,
                    "faults": faults, "privacy": privacy}
        prints = ckpt.fingerprints(algorithm, potential, fed, settings)
        restored = ckpt.restore(checkpoint_dir, prints, server, clients)
        if restored is not None:
            start, server, clients, history = restored
            if start > rounds:
                raise ValueError(f"the checkpoint in {checkpoint_dir} is at round {start}, beyond "
                                 f"rounds={rounds}")
    mesh = sharded.make_mesh(devs) if len(devs) > 1 else None
    info = {"engine": "local" if mesh is None else "sharded", "devices": [str(d) for d in devs],
            "client_chunk": client_chunk}
    round_algo, round_data = algorithm, data
    if mesh is None and start == 0 and client_phase.applies(algorithm, rounds, M, K):
        round_algo, round_data, phase_info = client_phase.run(
            algorithm, ctx, data, server, jax.random.fold_in(k_rounds, 0), client_chunk, progress)
        info.update(phase_info)
    with prog.tracing(False):       # no bar shows the chains' reports inside a round
        if mesh is None:
            round_fn, compile_time = local.compiled_round(round_algo, ctx, M, client_chunk, server,
                                                          clients, round_data, k_rounds, faults, privacy)
        else:
            round_data, clients = sharded.place(round_data, mesh), sharded.place(clients, mesh)
            round_fn, compile_time = sharded.compiled_round(round_algo, ctx, M, client_chunk, server,
                                                            clients, round_data, k_rounds, mesh, faults,
                                                            privacy)
    host_clients = (lambda c: c) if multiprocess is None else sharded.unplace
    info["compile_round_s"] = compile_time
    if faults.straggler_rate > 0:
        info["straggler_policy"] = _straggler_policy(round_algo, ctx, round_data, faults)
    compile_time += info.get("client_phase_compile_s", 0.0)
    client_diag = []    # per-round client diagnostics of this process's rounds (not checkpointed)
    draw_stats = {}     # per-draw statistics of each client's latest included round (not checkpointed)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=rounds, initial=start, desc=type(algorithm).__name__, leave=False)
        bar.set_postfix({"compile_s": f"{compile_time:.1f}"})
    for r in range(start, rounds):
        t = time.perf_counter()
        k_r = jax.random.fold_in(k_rounds, r)
        if mesh is None:
            server, clients, rinfo = round_fn(server, clients, round_data, k_r)
        else:   # the placement the round was compiled with; the server state comes back to this process
            server, clients, rinfo = round_fn(sharded.unplace(server), sharded.place(clients, mesh),
                                              round_data, k_r)
            server = sharded.unplace(server)
        server = jax.block_until_ready(server)
        dt = time.perf_counter() - t + (info.get("client_phase_s", 0.0) if r == 0 else 0.0)
        entry = {"round": r + 1, "time": dt, **local.round_record(rinfo, r + 1, K, faults, privacy)}
        participants, included = np.asarray(rinfo.participants), np.asarray(rinfo.included)
        diags = dict(rinfo.diagnostics)
        per_draw = diags.pop(DRAW_STATS, None)
        if per_draw:
            _keep_draw_stats(draw_stats, per_draw, participants, included, K)
        if evald is not None and ((r + 1) % eval_every == 0 or r == rounds - 1):
            entry.update(evaluate(algorithm.posterior(ctx, server, host_clients(clients)), *evald))
        history.append(entry)
        client_diag.append({"participants": participants, "included": included,
                            **{n: np.asarray(v) for n, v in diags.items()}})
        if checkpoint_dir is not None:
            ckpt.save(checkpoint_dir, r + 1, server, clients, history, prints)
        if bar is not None:
            shown = {k: f"{entry[k]:.3g}" for k in ("accuracy", "nll", "rmse") if k in entry}
            bar.set_postfix(shown | {"compile_s": f"{compile_time:.1f}"})
            bar.update(1)
    if bar is not None:
        bar.close()
    excluded = {h["round"]: h["excluded"] for h in history if h["excluded"]}
    if excluded:
        first = next(iter(excluded))
        warnings.warn(f"{len(excluded)} round(s) left clients out of the aggregate because their updates "
                      f"were not finite or over max_update_norm (first: round {first}, clients "
                      f"{excluded[first]}); see Result.faults", RuntimeWarning, stacklevel=2)
    clients = host_clients(clients)
    posterior = algorithm.posterior(ctx, server, clients)
    return Result(posterior, history, server, clients, algorithm, ctx, compile_time, init_time, evald,
                  client_diag, draw_stats, info)


