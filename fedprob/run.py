"""``fp.run``: drive an algorithm over a federation: validate, build, loop, collect.

The options are small objects, one concern each: ``engine``
(:class:`fedprob.engine.Local`, :class:`fedprob.engine.Flower`), ``faults``
(:class:`fedprob.Faults` with :class:`fedprob.Stragglers`), ``privacy``
(:class:`fedprob.privacy.GaussianDP`) and ``checkpoint``
(:class:`fedprob.Checkpoint`). The flat keywords of earlier releases still
work for one release (:mod:`fedprob.deprecated`).
"""
from __future__ import annotations

import time
from typing import Optional

import jax
import numpy as np

from . import checkpoint as ckpt
from . import deprecated
from .algorithms.base import Algorithm, Context, check_local_sites
from .checkpoint import Checkpoint
from .data.federated import FederatedData, check_eval_data, check_model_labels
from .engine import Flower, Local, local, sharded
from .engine import rounds as engine_rounds
from .faults import Faults
from .metrics import evaluate
from .names import keywords
from .potential import get_potential
from .result import Result, RunLog, collect


def _check(algorithm, fed, rounds, clients_per_round, engine, faults, privacy, checkpoint):
    """``(M, rounds, engine, faults)`` after checking every argument of :func:`run` that needs no tracing."""
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
    engine = Local() if engine is None else engine
    if not isinstance(engine, (Local, Flower)):
        raise TypeError(f"engine must be fp.engine.Local(...) or fp.engine.Flower(...), got {engine!r}")
    faults = Faults() if faults is None else faults
    if not isinstance(faults, Faults):
        raise TypeError(f"faults must be a fp.Faults, got {type(faults).__name__}")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"checkpoint must be a fp.Checkpoint(dir), got {type(checkpoint).__name__}")
    if privacy is not None:
        from . import privacy as privacy_mod

        if not isinstance(privacy, privacy_mod.GaussianDP):
            raise TypeError(f"privacy must be a fedprob.privacy.GaussianDP, got {type(privacy).__name__}")
        privacy_mod.check_supported(algorithm)
    if isinstance(engine, Flower):
        if checkpoint is not None:
            raise ValueError("engine=fp.engine.Flower() does not support checkpoints; use fp.engine.Local()")
        if faults.straggler_min_fraction > 0:
            raise ValueError("engine=fp.engine.Flower() does not support Stragglers(min_fraction=...) "
                             "(its stragglers send nothing); use fp.engine.Local()")
        if faults.truncates:
            raise ValueError("engine=fp.engine.Flower() simulates stragglers by discarding their messages: pass "
                             "fp.Stragglers(rate, policy='discard') (truncated local work needs fp.engine.Local())")
    return M, int(rounds), engine, faults


def _bar(progress: bool, rounds: int, start: int, name: str):
    """The rounds' bar, reading "compiling" until :func:`_compiled` says the round is compiled."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=rounds, initial=start, desc=f"{name}: compiling", leave=False, unit=" rounds")


def _compiled(bar, name: str, compile_time: float) -> None:
    if bar is not None:
        bar.set_description(name)
        bar.set_postfix({"compile_s": f"{compile_time:.1f}"})


def run(algorithm: Algorithm, model, fed: FederatedData, rounds: Optional[int] = None, seed: int = 0,
        eval_data=None, clients_per_round: Optional[int] = None, progress: bool = True, *, eval_every: int = 1,
        model_kwargs: Optional[dict] = None, engine=None, faults: Optional[Faults] = None, privacy=None,
        checkpoint: Optional[Checkpoint] = None, **deprecated_kwargs) -> Result:
    """Run ``algorithm`` on ``fed`` with the NumPyro ``model``; same seed, same result.

    rounds: communication rounds (default ``algorithm.rounds_for(K, sizes, M)``:
    ``default_rounds``, 1 for one-round methods, 10 for iterative ones; damped
    PVI/FedLap/FedLap-Cov take enough rounds for their sites to converge).
    clients_per_round: M of the K clients sampled without replacement each
    round (default all); shapes stay fixed, so nothing recompiles between
    rounds. eval_data: (X, y) evaluated every ``eval_every`` rounds and at the
    end. model_kwargs: keyword arguments of ``model``.

    engine: :class:`fedprob.engine.Local` (default: vmap over the clients, or
    one at a time where the algorithm chooses it, sharded over several
    ``devices``, in ``client_chunk`` chunks) or
    :class:`fedprob.engine.Flower` (a Flower simulation; ``pip install
    fedprob[flower]``). faults: a :class:`fedprob.Faults` (dropout,
    :class:`fedprob.Stragglers`, the update-norm bound; :mod:`fedprob.faults`),
    off by default. privacy: a :class:`fedprob.privacy.GaussianDP` (client
    clipping and Gaussian noise, (epsilon, delta) in the history).
    checkpoint: a :class:`fedprob.Checkpoint`: save the states and the history
    after every round; a later run with the same inputs and directory resumes
    from the newest checkpoint and gives exactly the uninterrupted result.

    The keywords of earlier releases (``engine="local"/"flower"``,
    ``devices``, ``client_chunk``, ``num_nodes``, ``dropout_rate``,
    ``straggler_rate``, ``straggler_policy``, ``straggler_min_fraction``,
    ``max_update_norm``, ``checkpoint_dir``) still work with a FutureWarning
    naming the new form (:mod:`fedprob.deprecated`).
    """
    engine, faults, checkpoint = deprecated.run_options(engine, faults, checkpoint, deprecated_kwargs,
                                                        keywords(run, named_only=True))
    M, rounds, engine, faults = _check(algorithm, fed, rounds, clients_per_round, engine, faults, privacy,
                                       checkpoint)
    if isinstance(engine, Flower):
        from .engine import flower

        return flower.run(algorithm, model, fed, rounds=rounds, seed=seed, eval_data=eval_data,
                          clients_per_round=M, num_nodes=engine.num_nodes, model_kwargs=model_kwargs,
                          faults=faults, privacy=privacy)
    multiprocess = sharded.processes(engine.device_list())
    if multiprocess is not None and checkpoint is not None:
        raise ValueError(f"checkpoints are not supported when the devices span several JAX processes "
                         f"({multiprocess}); checkpoint from a single-process run")
    # build: the potential, the checked data, the initial (or restored) states, the compiled round
    K = fed.num_clients
    potential = get_potential(model, fed, model_kwargs)
    algorithm = algorithm.for_model(potential)
    check_local_sites(algorithm, potential)
    if potential.task == "classification":
        check_model_labels(fed.pooled()[1], potential.num_classes, "federation")
    evald = check_eval_data(eval_data, potential)
    ctx = Context(potential, K, np.asarray(fed.sizes), fed.num_rows)
    data = fed.client_data()
    k_init, k_rounds = jax.random.split(jax.random.PRNGKey(seed))
    t0 = time.perf_counter()
    server, clients = jax.block_until_ready(local.compiled_init(algorithm, ctx, data, k_init)(k_init, data))
    init_time = time.perf_counter() - t0
    history, start, prints, posterior = [], 0, None, None
    if checkpoint is not None:
        settings = {"seed": int(seed), "clients_per_round": M, "client_chunk": engine.client_chunk,
                    "faults": faults.fingerprint(), "privacy": privacy}
        prints = ckpt.fingerprints(algorithm, potential, fed, settings)
        restored = ckpt.restore(checkpoint.dir, prints, server, clients)
        if restored is not None:
            start, server, clients, history = restored
            if start > rounds:
                raise ValueError(f"the checkpoint in {checkpoint.dir} is at round {start}, beyond rounds={rounds}")
    bar = _bar(progress and rounds > 1, rounds, start, type(algorithm).__name__)   # one round: the client bar
    compiled = engine_rounds.compile_rounds(engine, algorithm, ctx, M, rounds, start, server, clients, data,
                                            k_rounds, faults, privacy, progress)
    clients, log = compiled.clients, RunLog(K, history)
    bar = bar or _bar(progress, rounds, start, type(algorithm).__name__)
    _compiled(bar, type(algorithm).__name__, compiled.compile_time)
    # loop
    for r in range(start, rounds):
        t = time.perf_counter()
        server, clients, rinfo = compiled.step(server, clients, jax.random.fold_in(k_rounds, r))
        dt = time.perf_counter() - t + (compiled.info.get("client_phase_s", 0.0) if r == 0 else 0.0)
        entry = {"round": r + 1, "time": dt, **local.round_record(rinfo, r + 1, K, faults, privacy)}
        if evald is not None and ((r + 1) % eval_every == 0 or r == rounds - 1):
            host = compiled.host_clients(clients)
            posterior = algorithm.choose_prediction(ctx, server, host, data, algorithm.posterior(ctx, server, host))
            entry.update(evaluate(posterior, *evald))
        log.add(entry, rinfo)
        if checkpoint is not None:
            ckpt.save(checkpoint.dir, r + 1, server, clients, log.history, prints, checkpoint.keep)
        if bar is not None:
            shown = {k: f"{entry[k]:.3g}" for k in ("accuracy", "nll", "rmse") if k in entry}
            bar.set_postfix(shown | {"compile_s": f"{compiled.compile_time:.1f}"})
            bar.update(1)
    if bar is not None:
        bar.close()
    # collect
    info = compiled.info
    # client-local sites: one more client pass re-takes each client's local posterior against the
    # final global one (the last round's evaluation came before it, so the posterior is recomputed);
    # with every client in each round it is the compiled round's own client pass
    everyone = M == K and not (faults is not None and faults.active)
    clients, refresh = local.refresh_local(algorithm, ctx, server, clients, data, jax.random.fold_in(k_rounds, rounds),
                                           step=compiled.step if everyone else None)
    clients = compiled.host_clients(clients)
    if refresh is not None:
        info, posterior = {**info, "local_refresh": refresh}, None
    # the last round's evaluated posterior is the result's (computed once: its Monte Carlo checks warn once)
    return collect(algorithm, ctx, server, clients, log, compiled.compile_time, init_time,
                   evald, info, posterior if evald is not None and start < rounds else None,
                   data=data, seed=seed)


__all__ = ["run", "Result", "get_potential"]
