"""fedprob's algorithms as Flower message-API strategies (``flwr.serverapp.strategy.Strategy``).

:class:`FedprobStrategy` runs any fedprob algorithm over the nodes of a
Flower ``Grid``; :class:`PVI`, :class:`EPMCMC`, :class:`FedPA` (and
:func:`strategy` for any other algorithm) build one by name, so a Flower
user writes, in their own ServerApp::

    strategy = PVI(model=fp.models.linear_regression(), rounds=4)
    result = strategy.start(grid)          # Flower's Result; strategy.posterior() the fedprob posterior

What :meth:`FedprobStrategy.start` does, in Flower's terms:

1. ``setup``: wrap the grid in :class:`.polling.PromptGrid` (replies seen
   within half a second instead of Flower's 3 s poll), wait for the nodes
   (``num_nodes``, up to ``node_wait_s``), send each a ``query`` message; each replies with its row count and row shapes
   (checked against the model on the node). The clients are the nodes,
   ordered by their file's ``client`` index, then by node id; the server
   builds the potential and the initial states from shapes only (an
   algorithm whose ``init`` reads the rows' values is refused: its client
   states would carry rows).
2. Flower's ``Strategy.start`` loop: the global ``ArrayRecord`` is the
   packed server state. ``configure_train`` draws the round's participants
   and keys exactly as the local engine does
   (:func:`fedprob.engine.local.select` on ``fold_in(k_rounds, r)``) and sends
   each its client state and key; ``aggregate_train`` checks every reply
   against the expected shapes and dtypes (a malformed or non-finite reply is
   quarantined: weight 0, the client's state kept, listed under
   ``quarantined``) and commits with
   :func:`fedprob.engine.local.aggregate_and_commit`, so the answer is the
   local engine's up to float tolerance. ``configure_evaluate`` sends
   nothing: the posterior is evaluated on the server.

A participant without a reply (its node stopped, or it replied with an
error): with ``on_missing="error"`` the run stops with an error naming the
node, the client and the round; with ``"drop"`` the round goes on with the
others and the client keeps its state (listed under ``missing``), as a
dropped-out client in the local engine; the server sends a client's
current state every round, so a node that comes back catches up.

Flower's differential-privacy wrappers (``DifferentialPrivacy*FixedClipping``,
flwr 1.41) do not compose: ``aggregate_train`` clips every reply
``ArrayRecord`` against the global arrays
(``flwr/serverapp/strategy/dp_fixed_clipping.py``, lines 364-372, calling
``compute_clip_model_update``, which zips the two lists with ``strict=True``:
``flwr/supercore/differential_privacy.py``, line 77) and then adds noise to
the aggregated global arrays (line 398); a fedprob reply is an algorithm
message plus client state, not shaped like the server state, and noise on the
server state (a posterior's natural parameters) is not the algorithm's
mechanism. Wrapped around this strategy, the server-side wrapper rewrites
each reply as the global arrays plus a clipped difference of unrelated
arrays (or raises, when their counts differ); :meth:`FedprobStrategy.aggregate_train`
finds the shapes wrong and quarantines every such reply (tested), so nothing
is aggregated. Use
``fedprob.privacy.GaussianDP`` (``privacy=``), which clips and noises the
algorithm's own update part.
"""
from __future__ import annotations

import json
import time
from logging import INFO, WARNING

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy

from .. import algorithms
from ..algorithms.base import Algorithm, Context
from ..engine import local
from ..potential import ClientData, Potential
from ..protocols import finite_flag
from ..toml_text import dumps
from .polling import PromptGrid


def _log(level, msg, *args):
    from flwr.common.logger import log

    log(level, msg, *args)


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(tree)]


def _record(tree) -> ArrayRecord:
    return ArrayRecord(numpy_ndarrays=_leaves(tree))


def _tree(leaves, like, what: str):
    """The pytree shaped like ``like`` from ``leaves``; a ValueError when count, shape or dtype differ."""
    treedef = jax.tree_util.tree_structure(like)
    want = jax.tree_util.tree_leaves(like)
    if len(leaves) != len(want):
        raise ValueError(f"{what} holds {len(leaves)} arrays, expected {len(want)}")
    for i, (a, w) in enumerate(zip(leaves, want)):
        if tuple(np.shape(a)) != tuple(w.shape) or np.asarray(a).dtype != np.dtype(w.dtype):
            raise ValueError(f"{what} array {i} is {np.asarray(a).dtype}{tuple(np.shape(a))}, "
                             f"expected {np.dtype(w.dtype)}{tuple(w.shape)}")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in leaves])


class FedprobStrategy(Strategy):
    """A fedprob algorithm as a Flower message-API strategy (module docstring).

    algorithm: a fedprob algorithm; model: its NumPyro model (``model_kwargs``
    its keyword arguments; a classifier's labels are checked against
    ``num_classes``). rounds: default ``algorithm.rounds_for``. seed,
    clients_per_round, faults, privacy: as in ``fp.run``. on_missing:
    ``"error"`` or ``"drop"``. num_nodes / node_wait_s: wait for that many
    nodes (None: the nodes there once their number has not changed for 3 s),
    at most ``node_wait_s`` seconds. round_timeout_s: how long a round waits
    for its replies. config: the fedprob configuration (a dict, sent to the
    nodes, which build the same algorithm and model from it); without it the
    nodes cannot build the model, so a strategy for Flower users takes it
    from :func:`strategy`'s arguments.
    """

    def __init__(self, algorithm: Algorithm, model, config: dict, *, model_kwargs=None, rounds=None, seed: int = 0,
                 clients_per_round=None, faults=None, privacy=None, on_missing: str = "error",
                 num_nodes=None, node_wait_s: float = 60.0, round_timeout_s: float = 600.0,
                 num_classes=None):
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"algorithm must be a fedprob algorithm, got {type(algorithm).__name__}")
        if on_missing not in ("error", "drop"):
            raise ValueError(f"on_missing is 'error' or 'drop', got {on_missing!r}")
        if faults is not None and (faults.straggler_min_fraction > 0 or faults.truncates):
            raise ValueError("on the Deployment Engine stragglers are discarded: pass "
                             "fp.Stragglers(rate, policy='discard')")
        self.algorithm, self.model, self.model_kwargs = algorithm, model, model_kwargs
        self.config_text = dumps(config)
        self.rounds, self.seed, self.M = rounds, int(seed), clients_per_round
        self.faults, self.privacy, self.on_missing = faults, privacy, on_missing
        self.num_nodes, self.node_wait_s, self.round_timeout_s = num_nodes, node_wait_s, round_timeout_s
        self.num_classes = num_classes
        self.history: list = []
        self.reply_shapes: list = []     # (round, client, [shapes of the reply's arrays])
        self.nodes: list = []            # node id of client k
        self.timings: dict = {}

    # ---- set-up -------------------------------------------------------------------------------------
    def _wait_for_nodes(self, grid) -> list:
        t0 = time.monotonic()
        deadline = t0 + self.node_wait_s
        nodes, stable_since = sorted(grid.get_node_ids()), time.monotonic()
        while time.monotonic() < deadline:
            if self.num_nodes is not None and len(nodes) >= self.num_nodes:
                break
            if self.num_nodes is None and nodes and time.monotonic() - stable_since > 3.0:
                break
            time.sleep(0.5)
            now = sorted(grid.get_node_ids())
            if now != nodes:
                nodes, stable_since = now, time.monotonic()
        if not nodes:
            raise RuntimeError(f"no Flower SuperNode connected within {self.node_wait_s:.0f} s")
        if self.num_nodes is not None and len(nodes) < self.num_nodes:
            raise RuntimeError(f"{len(nodes)} of the {self.num_nodes} SuperNodes connected within "
                               f"{self.node_wait_s:.0f} s (node ids {nodes})")
        return nodes[: self.num_nodes] if self.num_nodes is not None else nodes

    def _meta(self, **kw) -> ConfigRecord:
        return ConfigRecord({"json": json.dumps(dict(kw, config=self.config_text))})

    def setup(self, grid) -> None:
        """Ask the nodes for their row counts and shapes; build the context and the initial states."""
        from ..engine.local import compiled_init

        t0 = time.perf_counter()
        nodes = self._wait_for_nodes(grid)
        out = [Message(RecordDict({"meta": self._meta()}), dst_node_id=n, message_type="query") for n in nodes]
        replies = grid.send_and_receive(out, timeout=self.round_timeout_s)
        node_of = {m.metadata.message_id: n for m, n in zip(out, nodes)}
        info = {}
        for m in replies:
            n = node_of.get(m.metadata.reply_to_message_id, m.metadata.src_node_id)
            if not m.has_content():
                raise RuntimeError(f"Flower node {n} refused the run: {m.error.reason}")
            info[n] = json.loads(m.content["meta"]["json"])
        missing = [n for n in nodes if n not in info]
        if missing:
            raise RuntimeError(f"Flower node(s) {missing} did not answer the set-up query within "
                               f"{self.round_timeout_s:.0f} s")
        order = sorted(nodes, key=lambda n: (info[n]["client"] is None, info[n]["client"] or 0, n))
        ids = [info[n]["client"] for n in order]
        if all(i is not None for i in ids) and len(set(ids)) != len(ids):
            raise ValueError(f"two nodes hold the same client index: {ids}")
        first = info[order[0]]
        for n in order[1:]:
            for key in ("x_shape", "x_dtype", "y_shape", "y_dtype"):
                if info[n][key] != first[key]:
                    raise ValueError(f"node {n}'s rows have {key} {info[n][key]}, node {order[0]}'s "
                                     f"{first[key]}: every node needs rows of the same shape")
        self.nodes = order
        K = len(order)
        sizes = np.array([info[n]["n"] for n in order], np.int32)
        n_max = int(sizes.max())
        xs, ys = tuple(first["x_shape"]), tuple(first["y_shape"])
        xdt, ydt = np.dtype(first["x_dtype"]), np.dtype(first["y_dtype"])
        potential = Potential(self.model, np.zeros((2,) + xs, xdt), np.zeros((2,) + ys, ydt), self.model_kwargs)
        if potential.local_sites:
            raise ValueError(f"the model marks {list(potential.local_sites)} as client-local "
                             "(infer={'local': True}); the Flower deployment does not take client-local "
                             "sites yet")
        self.algorithm = self.algorithm.for_model(potential)      # defaults that follow the model, as fp.run's
        self.ctx = ctx = Context(potential, K, sizes, int(sizes.sum()))
        self.sizes, self.n_max = sizes, n_max
        M = K if self.M is None else int(self.M)
        if not 1 <= M <= K:
            raise ValueError(f"clients_per_round must be in [1, {K}] ({K} nodes), got {self.M}")
        self.M_ = M
        if self.rounds is None:
            self.rounds = self.algorithm.rounds_for(K, sizes, M)
        k_init, self.k_rounds = jax.random.split(jax.random.PRNGKey(self.seed))

        def placeholder(fill):
            return ClientData(jnp.full((K, n_max) + xs, fill, xdt), jnp.full((K, n_max) + ys, fill, ydt),
                              jnp.asarray(sizes))

        init = compiled_init(self.algorithm, ctx, placeholder(0), k_init)
        server, clients = init(k_init, placeholder(0))
        other = init(k_init, placeholder(1))
        same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b, equal_nan=True)),
                                      (server, clients), other)
        if not all(jax.tree_util.tree_leaves(same)):
            raise ValueError(f"{type(self.algorithm).__name__}'s init reads the clients' rows; it cannot run "
                             "on the Deployment Engine, where the rows stay on the nodes")
        self.server, self.clients = server, clients
        first_c = jax.tree_util.tree_map(lambda a: a[0], clients)
        d0 = jax.tree_util.tree_map(lambda a: a[0], placeholder(0))
        self.like = jax.eval_shape(lambda s, c, d, k: local.client_step(self.algorithm, ctx, s)((c, d, k)),
                                   server, first_c, d0, k_init)
        self.server_like = jax.eval_shape(lambda: server)
        self._select = jax.jit(lambda key: local.select(K, M, key))
        algo, faults, privacy = self.algorithm, self.faults, self.privacy
        self._commit = jax.jit(lambda s, c, idx, ncs, m, dg, ok, n, key: local.aggregate_and_commit(
            algo, ctx, s, c, idx, ncs, m, dg, ok, n, key, faults, privacy))
        self.timings["setup_s"] = time.perf_counter() - t0
        _log(INFO, "fedprob: %d nodes, clients of %s rows, %s for %d rounds", K, sizes.tolist(),
             type(self.algorithm).__name__, self.rounds)

    # ---- Flower's Strategy -----------------------------------------------------------------------------
    def start(self, grid, initial_arrays=None, num_rounds=None, timeout=None, train_config=None,
              evaluate_config=None, evaluate_fn=None):
        """:meth:`setup`, then Flower's ``Strategy.start`` over ``num_rounds`` (default
        ``rounds``); the initial arrays are the packed initial server state."""
        grid = grid if isinstance(grid, PromptGrid) else PromptGrid(grid)
        self.setup(grid)
        if num_rounds is not None:
            self.rounds = int(num_rounds)
        t0 = time.perf_counter()
        res = super().start(grid, _record(self.server) if initial_arrays is None else initial_arrays,
                            num_rounds=self.rounds, timeout=self.round_timeout_s if timeout is None else timeout,
                            train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)
        self.timings["rounds_s"] = time.perf_counter() - t0
        return res

    def configure_train(self, server_round, arrays, config, grid):
        r = server_round - 1
        self._t_round = time.perf_counter()
        self.server = _tree(arrays.to_numpy_ndarrays(), self.server_like, "the global ArrayRecord")
        k_r = jax.random.fold_in(self.k_rounds, r)
        idx, keys = self._select(k_r)
        self._round = (r, k_r, idx, np.asarray(idx).tolist())
        server_rec = _record(self.server)
        out, self._requests, sent = [], {}, 0
        for j, k in enumerate(self._round[3]):
            node = self.nodes[k]
            content = RecordDict({
                "server": server_rec,
                "client": _record(jax.tree_util.tree_map(lambda a: a[k], self.clients)),
                "key": _record(keys[j]),
                "meta": self._meta(client=k, round=r, K=self.ctx.num_clients, sizes=self.sizes.tolist(),
                                   n_max=self.n_max)})
            msg = Message(content, dst_node_id=node, message_type="train")
            out.append(msg)
            sent += sum(a.nbytes for name in ("server", "client", "key")
                        for a in content.array_records[name].to_numpy_ndarrays())
        self._pending, self._sent_bytes = out, sent
        return out

    def aggregate_train(self, server_round, replies):
        r, k_r, idx, ids = self._round
        client_of = {m.metadata.message_id: k for m, k in zip(self._pending, ids)}
        got, errors, quarantined, received, compute = {}, {}, [], 0, {}
        for m in replies:
            k = client_of.get(m.metadata.reply_to_message_id)
            if k is None:
                continue
            if not m.has_content():
                errors[k] = f"{m.error.reason} (code {m.error.code})"
                continue
            leaves = m.content["reply"].to_numpy_ndarrays() if "reply" in m.content.array_records else []
            self.reply_shapes.append((r + 1, k, [tuple(np.shape(a)) for a in leaves]))
            received += sum(np.asarray(a).nbytes for a in leaves)
            if "meta" in m.content.config_records:
                compute[k] = float(json.loads(m.content["meta"]["json"]).get("compute_s", np.nan))
            try:
                got[k] = _tree(leaves, self.like, f"client {k}'s reply")
            except ValueError as e:
                _log(WARNING, "fedprob: round %d: %s: quarantined", r + 1, e)
                quarantined.append(k)
        missing = [k for k in ids if k not in got and k not in quarantined]
        if missing and self.on_missing == "error":
            k = missing[0]
            why = f"replied with an error: {errors[k]}" if k in errors else \
                f"sent no reply within {self.round_timeout_s:.0f} s"
            raise RuntimeError(f"round {r + 1}: Flower node {self.nodes[k]} {why} for client {k}"
                               + (f"; {len(missing)} participants are missing: clients {missing}"
                                  if len(missing) > 1 else ""))
        outs = []
        for k in ids:
            if k in got:
                new_c, msg, diag, ok = got[k]
                ok = jnp.logical_and(ok, finite_flag(new_c, msg))
            else:      # missing or malformed: placeholder values, weight 0, state kept
                new_c = jax.tree_util.tree_map(lambda a: a[k], self.clients)
                msg, diag = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.like[1:3])
                ok = jnp.asarray(False)
            outs.append((new_c, msg, diag, ok))
        new_cs, msgs, diags, ok = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
        self.server, self.clients, info = self._commit(self.server, self.clients, idx, new_cs, msgs, diags, ok,
                                                       jnp.asarray(self.sizes), k_r)
        entry = {"round": r + 1, "time": time.perf_counter() - self._t_round,
                 "bytes_sent": self._sent_bytes, "bytes_received": received,
                 "node_compute_s": max(compute.values(), default=float("nan")),
                 **local.round_record(info, r + 1, self.ctx.num_clients, self.faults, self.privacy)}
        if missing:
            entry["missing"] = missing
            entry["missing_errors"] = {str(k): errors[k] for k in missing if k in errors}
            _log(WARNING, "fedprob: round %d: no reply for clients %s (nodes %s): left out, their states kept",
                 r + 1, missing, [self.nodes[k] for k in missing])
        if quarantined:
            entry["quarantined"] = quarantined
        self.history.append(entry)
        shown = {k: v for k, v in entry.items() if isinstance(v, float) and k != "time"}
        _log(INFO, "fedprob: round %d/%d done in %.2f s, %d of %d replies used %s", r + 1, self.rounds,
             entry["time"], int(np.sum(np.asarray(info.included))), len(ids),
             " ".join(f"{k}={v:.4g}" for k, v in list(shown.items())[:4]))
        metrics = MetricRecord({"included": int(np.sum(np.asarray(info.included))),
                                "server_update_ok": int(bool(info.server_finite))})
        return _record(self.server), metrics

    def configure_evaluate(self, server_round, arrays, config, grid):
        return []

    def aggregate_evaluate(self, server_round, replies):
        return None

    def summary(self) -> None:
        _log(INFO, "\t├── fedprob algorithm: %s", type(self.algorithm).__name__)
        _log(INFO, "\t└── clients per round: %s of %d, on a missing reply: %s", self.M_, self.ctx.num_clients,
             self.on_missing)

    # ---- results --------------------------------------------------------------------------------------
    def posterior(self):
        """The fedprob global posterior after the rounds run so far."""
        return self.algorithm.posterior(self.ctx, self.server, self.clients)

    def result(self, eval_data=None, info=None):
        """A :class:`fedprob.result.Result` (as ``fp.run`` returns), evaluated on ``eval_data``."""
        from ..data.federated import check_eval_data
        from ..metrics import evaluate
        from ..result import Result

        evald = check_eval_data(eval_data, self.ctx.potential)
        posterior = self.posterior()
        if evald is not None and self.history:
            self.history[-1].update(evaluate(posterior, *evald))
        info = {"engine": "flower-deployment", "num_nodes": len(self.nodes), **self.timings, **(info or {})}
        return Result(posterior, self.history, self.server, self.clients, self.algorithm, self.ctx, 0.0, 0.0,
                      eval_data=evald, info=info)


def strategy(algorithm: str, model: str, model_options: dict = None, client: dict = None, **kw) -> FedprobStrategy:
    """A :class:`FedprobStrategy` for ``fedprob.algorithms.<algorithm>`` on ``fedprob.models.<model>``:
    ``algorithm_options`` (a dict, passed to the algorithm), ``model_options`` (to the model
    builder), ``client`` (``{"name": backend, ...fields}``) and the strategy's keywords ``kw``."""
    from . import spec

    algo_opts = kw.pop("algorithm_options", {}) or {}
    cfg = {"model": {"name": model, **(model_options or {})}, "algorithm": {"name": algorithm, **algo_opts}}
    if client:
        cfg["client"] = dict(client)
    run = {k: kw[k] for k in ("seed", "clients_per_round") if kw.get(k) is not None}
    if kw.get("rounds") is not None:
        run["rounds"] = kw["rounds"]
    if run:
        cfg["run"] = run
    spec.parse(dumps(cfg))
    algo, model_obj, mkw, _ = spec.build_parts(cfg)
    return FedprobStrategy(algo, model_obj, cfg, model_kwargs=mkw,
                           num_classes=cfg["model"].get("num_classes"), **kw)


def _named(name):
    def make(model: str, model_options: dict = None, client: dict = None, **kw) -> FedprobStrategy:
        return strategy(name, model, model_options, client, **kw)

    make.__name__ = make.__qualname__ = name
    make.__doc__ = (f"fedprob's :class:`fedprob.algorithms.{name}` as a Flower strategy: "
                    f"``{name}(model='linear_regression', algorithm_options={{...}}, rounds=...)`` "
                    "(see :func:`strategy`).")
    return make


PVI, EPMCMC, FedPA = _named("PVI"), _named("EPMCMC"), _named("FedPA")
assert all(hasattr(algorithms, n) for n in ("PVI", "EPMCMC", "FedPA"))

__all__ = ["FedprobStrategy", "strategy", "PVI", "EPMCMC", "FedPA"]
