"""``fp.run``: drive an algorithm over a federation with the local engine."""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Optional

import jax
import numpy as np

from .algorithms.base import Algorithm, Context
from .data.federated import FederatedData, check_xy
from .engine import client_phase, local, sharded
from .metrics import evaluate
from .posteriors import GlobalPosterior
from .potential import Potential

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
    excluded), ``participants``, ``excluded`` (clients whose update was not
    finite and was left out), ``server_update_ok``, client diagnostics
    (means over participants, prefixed ``client_``) and eval metrics.
    compile_time / init_time: seconds spent compiling the round and the
    client phase (0 when they came from the cache) and initialising.
    info: ``engine``, ``devices``, ``client_chunk``, ``compile_round_s``,
    ``client_phase_compile_s`` / ``client_phase_s`` (one-round methods: the
    client phase runs as its own compiled call, shared between methods with
    the same backend and shapes; see :mod:`fedprob.engine.client_phase`).
    """

    posterior: GlobalPosterior
    history: list
    server_state: Any
    client_states: Any
    algorithm: Algorithm
    context: Context
    compile_time: float
    init_time: float
    info: dict = dataclasses.field(default_factory=dict)

    def metric(self, name: str) -> np.ndarray:
        """One history column as an array (NaN where a round lacks it)."""
        return np.array([h.get(name, np.nan) for h in self.history], dtype=float)

    @property
    def excluded_clients(self) -> dict:
        """round -> client ids left out of that round's aggregate."""
        return {h["round"]: h["excluded"] for h in self.history if h["excluded"]}

    def to_arviz(self, num_draws: int = 1000, seed: int = 0):
        """The global posterior's draws as ArviZ InferenceData (one chain)."""
        from .diagnostics import to_inference_data

        draws = self.posterior.sample(jax.random.PRNGKey(seed), num_draws)
        return to_inference_data({k: np.asarray(v)[None] for k, v in draws.items()})


def _check_eval(eval_data, potential: Potential):
    if eval_data is None:
        return None
    if not isinstance(eval_data, (tuple, list)) or len(eval_data) != 2:
        raise ValueError("eval_data must be a pair (X_test, y_test)")
    X, y = np.asarray(eval_data[0]), np.asarray(eval_data[1])
    check_xy(X, y)
    if tuple(X.shape[1:]) != potential.x_shape:
        raise ValueError(f"eval_data X rows have shape {X.shape[1:]}, the federation's have {potential.x_shape}")
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


def run(algorithm: Algorithm, model, fed: FederatedData, rounds: Optional[int] = None, seed: int = 0,
        eval_data=None, clients_per_round: Optional[int] = None, progress: bool = True,
        client_chunk: Optional[int] = None, eval_every: int = 1,
        model_kwargs: Optional[dict] = None, engine: str = "local", devices=None,
        num_nodes: Optional[int] = None) -> Result:
    """Run ``algorithm`` on ``fed`` with the NumPyro ``model``.

    rounds: communication rounds (default ``algorithm.default_rounds``: 1 for
    one-round methods). clients_per_round: M of the K clients sampled without
    replacement each round (default all); shapes stay fixed, so nothing
    recompiles between rounds. client_chunk: vmap clients in chunks of this
    size (``lax.map``) to bound memory. eval_data: (X, y) evaluated every
    ``eval_every`` rounds and at the end. Same seed, same result.
    engine: ``"local"`` (this process; with several ``devices``, default all
    local ones, the clients are sharded over them, :mod:`fedprob.engine.sharded`)
    or ``"flower"`` (a local Flower simulation with ``num_nodes`` nodes,
    :mod:`fedprob.engine.flower`; needs ``pip install fedprob[flower]``).
    """
    if engine == "flower":
        from .engine import flower

        return flower.run(algorithm, model, fed, rounds=rounds, seed=seed, eval_data=eval_data,
                          clients_per_round=clients_per_round, num_nodes=num_nodes, model_kwargs=model_kwargs)
    if engine != "local":
        raise ValueError(f"engine must be 'local' or 'flower', got {engine!r}")
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be a fedprob algorithm, got {type(algorithm).__name__}")
    if not isinstance(fed, FederatedData):
        raise TypeError("fed must be a FederatedData (see fp.data.partition / FederatedData.from_clients)")
    rounds = algorithm.default_rounds if rounds is None else rounds
    if not isinstance(rounds, (int, np.integer)) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    K = fed.num_clients
    M = K if clients_per_round is None else int(clients_per_round)
    if not 1 <= M <= K:
        raise ValueError(f"clients_per_round must be in [1, {K}], got {clients_per_round}")
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

    devs = list(jax.devices() if devices is None else devices)
    mesh = sharded.make_mesh(devs) if len(devs) > 1 else None
    info = {"engine": "local" if mesh is None else "sharded", "devices": [str(d) for d in devs],
            "client_chunk": client_chunk}
    round_algo, round_data = algorithm, data
    if mesh is None and client_phase.applies(algorithm, rounds, M, K):
        round_algo, round_data, phase_info = client_phase.run(
            algorithm, ctx, data, server, jax.random.fold_in(k_rounds, 0), client_chunk, progress)
        info.update(phase_info)
    if mesh is None:
        round_fn, compile_time = local.compiled_round(round_algo, ctx, M, client_chunk, server,
                                                      clients, round_data, k_rounds)
    else:
        round_data, clients = sharded.place(round_data, mesh), sharded.place(clients, mesh)
        server = sharded.unplace(server)
        round_fn, compile_time = sharded.compiled_round(round_algo, ctx, M, client_chunk, server, clients,
                                                        round_data, k_rounds, mesh)
    info["compile_round_s"] = compile_time
    compile_time += info.get("client_phase_compile_s", 0.0)
    history = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=rounds, desc=type(algorithm).__name__, leave=False)
        bar.set_postfix({"compile_s": f"{compile_time:.1f}"})
    for r in range(rounds):
        t = time.perf_counter()
        k_r = jax.random.fold_in(k_rounds, r)
        if mesh is not None:    # same placement every round (the compiled round expects it)
            server, clients = sharded.unplace(server), sharded.place(clients, mesh)
        server, clients, rinfo = round_fn(server, clients, round_data, k_r)
        server = jax.block_until_ready(server)
        dt = time.perf_counter() - t + (info.get("client_phase_s", 0.0) if r == 0 else 0.0)
        participants = np.asarray(rinfo.participants)
        included = np.asarray(rinfo.included)
        entry = {"round": r + 1, "time": dt, "participants": participants.tolist(),
                 "excluded": participants[~included].tolist(),
                 "server_update_ok": bool(rinfo.server_finite)}
        for name, v in rinfo.diagnostics.items():
            v = np.asarray(v, dtype=float)
            entry["client_" + name] = float(np.mean(v[included])) if included.any() else float("nan")
        if evald is not None and ((r + 1) % eval_every == 0 or r == rounds - 1):
            entry.update(evaluate(algorithm.posterior(ctx, server, clients), *evald))
        history.append(entry)
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
                      f"were not finite (first: round {first}, clients {excluded[first]}); see "
                      "Result.excluded_clients", RuntimeWarning, stacklevel=2)
    posterior = algorithm.posterior(ctx, server, clients)
    return Result(posterior, history, server, clients, algorithm, ctx, compile_time, init_time, info)


