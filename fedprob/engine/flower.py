"""The Flower engine: fedprob's rounds as a Flower ServerApp and ClientApp.

``fp.run(..., engine=fp.engine.Flower(num_nodes=N))`` runs a local Flower
simulation with ``N`` SuperNodes (set explicitly; default one per client).
The ServerApp (:func:`server_app`) is the strategy: it holds fedprob's
server and client states, samples the round's participants with the local
engine's keys, sends each participant a ``"train"`` message (server state,
client state, client id, round key; :mod:`.codec` turns the pytrees into
``ArrayRecord`` s of numpy arrays), and commits the replies with the local
engine's own pieces (:func:`fedprob.engine.local.select` and
:func:`fedprob.engine.local.aggregate_and_commit`, see :func:`serve`): same
participants, keys, masks and commit rule. A participant whose node sends
no reply (or an error) stops the run with an error naming the node, the
client and the round. The ClientApp
(:func:`client_app`) runs the same ``algorithm.client_update`` (compiled
once per process) on the client's rows. Client ``k`` is served by node
``k mod N``; its rows come from the federation the app was built with
(on real machines: each SuperNode loads its own partition). Same seed, same
answer as the local engine up to float tolerance.

Offline and in tests: ``FLWR_TELEMETRY_ENABLED=0`` and
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` are set before Flower is
imported; the simulation (Ray backend, ``pip install "flwr[simulation]"``)
is shut down when it returns.
"""
from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import codec, local
from .local import compiled_init
from ..algorithms.base import Context

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")


def _client_fn(algorithm, ctx):
    @jax.jit
    def update(server, client, data, key):
        return local.client_step(algorithm, ctx, server)((client, data, key))

    return update


def client_handler(algorithm, ctx: Context, data, templates):
    """``handle(content) -> reply content``: a ``"train"`` request's ``RecordDict`` (server
    state, client state, key, ``meta.client``) to the reply's (the client's new state,
    message, diagnostics and finite flag, packed; ``meta.client``)."""
    from flwr.app import ConfigRecord, RecordDict

    update = _client_fn(algorithm, ctx)
    server_t, client_t, key_t = templates

    def handle(content):
        k = int(content["meta"]["client"])
        server = codec.unpack(content["server"], server_t)
        client = codec.unpack(content["client"], client_t)
        key = codec.unpack(content["key"], key_t)
        d = jax.tree_util.tree_map(lambda a: a[k], data)
        out = update(server, client, d, key)
        return RecordDict({"reply": codec.pack(out), "meta": ConfigRecord({"client": k})})

    return handle


def client_app(algorithm, ctx: Context, data, templates):
    """A ClientApp running ``algorithm.client_update`` for the client named in each message."""
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    app = ClientApp()
    handle = client_handler(algorithm, ctx, data, templates)

    @app.train()
    def train(msg: Message, context):
        return Message(handle(msg.content), reply_to=msg)

    return app


def _wait_for_nodes(grid, num_nodes: int, timeout: float) -> list:
    """The registered node ids once ``num_nodes`` are there (or whatever is there at ``timeout``)."""
    import time

    deadline = time.monotonic() + timeout
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < num_nodes and time.monotonic() < deadline:
        time.sleep(0.2)
        nodes = sorted(grid.get_node_ids())
    if not nodes:
        raise RuntimeError(f"no Flower SuperNode registered within {timeout:.0f} s")
    return nodes


def serve(algorithm, ctx: Context, data, rounds: int, seed: int, num_participants: int, nodes, exchange,
          faults=None, privacy=None):
    """The server's rounds over a transport: ``(server, clients, history)``.

    Each round draws the participants and their keys with :func:`local.select`
    (the local engine's round keys ``fold_in(k_rounds, r)``), sends client ``k``
    to node ``nodes[k mod len(nodes)]`` and commits the replies with
    :func:`local.aggregate_and_commit`, so the answer is the local engine's.
    ``exchange(round, requests) -> (replies, errors)``: requests are
    ``(client, node, RecordDict)``; replies map a client to its reply
    ``RecordDict``, errors a client to the reason its node gave. A participant
    without a reply is an error naming the node, the client and the round.
    faults / privacy: as in the local engine (the norm bound, simulated dropout
    and stragglers, and the differential-privacy transform act on the replies).
    """
    from flwr.app import ConfigRecord, RecordDict

    K, M = ctx.num_clients, num_participants
    if not 1 <= M <= K:
        raise ValueError(f"clients_per_round must be in [1, {K}], got {M}")
    nodes = list(nodes)
    if not nodes:
        raise ValueError("no Flower nodes to send the clients to")
    k_init, k_rounds = jax.random.split(jax.random.PRNGKey(seed))
    server, clients = compiled_init(algorithm, ctx, data, k_init)(k_init, data)
    select = jax.jit(lambda key: local.select(K, M, key))
    commit = jax.jit(lambda s, c, idx, ncs, m, dg, ok, n, key: local.aggregate_and_commit(
        algorithm, ctx, s, c, idx, ncs, m, dg, ok, n, key, faults, privacy))
    first = partial(jax.tree_util.tree_map, lambda a: a[0])
    like = jax.eval_shape(_client_fn(algorithm, ctx), server, first(clients), first(data), k_init)
    history = []
    for r in range(rounds):
        k_r = jax.random.fold_in(k_rounds, r)
        idx, keys = select(k_r)
        ids = np.asarray(idx).tolist()
        requests = []
        for j, k in enumerate(ids):
            content = RecordDict({
                "server": codec.pack(server),
                "client": codec.pack(jax.tree_util.tree_map(lambda a: a[k], clients)),
                "key": codec.pack(keys[j]),
                "meta": ConfigRecord({"client": k, "round": r})})
            requests.append((k, nodes[k % len(nodes)], content))
        replies, errors = exchange(r, requests)
        missing = [(k, node) for k, node, _ in requests if k not in replies]
        if missing:
            k, node = missing[0]
            why = f"replied with an error: {errors[k]}" if k in errors else "sent no reply"
            raise RuntimeError(f"round {r + 1}: Flower node {node} {why} for client (partition) {k}"
                               + (f"; {len(missing)} participants are missing: clients "
                                  f"{[m[0] for m in missing]}" if len(missing) > 1 else ""))
        outs = [codec.unpack(replies[k]["reply"], like) for k in ids]
        new_cs, msgs, diags, ok = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
        server, clients, info = commit(server, clients, idx, new_cs, msgs, diags, ok, data.n, k_r)
        history.append({"round": r + 1, **local.round_record(info, r + 1, K, faults, privacy)})
    return server, clients, history


def _grid_exchange(grid):
    """``exchange`` for :func:`serve` through a Flower ``Grid``: a reply belongs to the request
    it answers (``reply_to_message_id``; the grid sets the requests' ids when it pushes them)."""
    from flwr.app import Message

    def exchange(r, requests):
        out = [Message(content, dst_node_id=node, message_type="train") for _, node, content in requests]
        received = grid.send_and_receive(out)
        client_of = {m.metadata.message_id: k for (k, _, _), m in zip(requests, out)}
        replies, errors = {}, {}
        for m in received:
            k = client_of.get(m.metadata.reply_to_message_id)
            if m.has_content():
                replies[int(m.content["meta"]["client"]) if k is None else k] = m.content
            elif k is not None:
                errors[k] = f"{m.error.reason} (code {m.error.code})"
        return replies, errors

    return exchange


def server_app(algorithm, ctx: Context, data, rounds: int, seed: int, num_participants: int, sink: dict,
               num_nodes: int = 1, node_timeout: float = 300.0, faults=None, privacy=None):
    """A ServerApp running :func:`serve`; the final states and history go to ``sink``.

    It waits (up to ``node_timeout`` seconds) until ``num_nodes`` SuperNodes have
    registered, so clients are spread over all of them; none at all is an error."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid, context):
        nodes = _wait_for_nodes(grid, num_nodes, node_timeout)
        server, clients, history = serve(algorithm, ctx, data, rounds, seed, num_participants, nodes,
                                         _grid_exchange(grid), faults, privacy)
        sink.update(server=server, clients=clients, history=history)

    return app


def prepare(algorithm, model, fed, seed: int = 0, model_kwargs=None):
    """``(ctx, data, templates)`` for :func:`serve`, :func:`server_app` and :func:`client_app`:
    templates are the shapes of one message's server state, client state and key."""
    from ..potential import get_potential

    potential = get_potential(model, fed, model_kwargs)
    if potential.local_sites:
        raise ValueError(f"the model marks {list(potential.local_sites)} as client-local "
                         "(infer={'local': True}); engine=fp.engine.Flower() does not take client-local "
                         "sites yet: use fp.engine.Local()")
    ctx = Context(potential, fed.num_clients, np.asarray(fed.sizes), fed.num_rows)
    data = fed.client_data()
    k_init = jax.random.split(jax.random.PRNGKey(seed))[0]
    server0, clients0 = compiled_init(algorithm, ctx, data, k_init)(k_init, data)
    return ctx, data, (server0, jax.tree_util.tree_map(lambda a: a[0], clients0), k_init)


def run(algorithm, model, fed, rounds=None, seed: int = 0, eval_data=None, clients_per_round=None,
        num_nodes=None, model_kwargs=None, backend_config=None, faults=None, privacy=None):
    """``fp.run`` on a local Flower simulation (see the module docstring); returns a ``Result``."""
    import time

    from ..extras import require

    require("flower", "fp.run(..., engine=fp.engine.Flower()) (a Flower simulation)")   # before any work
    from flwr.simulation import run_simulation

    from ..data.federated import check_eval_data
    from ..metrics import evaluate
    from ..result import Result

    K = fed.num_clients
    M = K if clients_per_round is None else int(clients_per_round)
    rounds = algorithm.rounds_for(K, fed.client_sizes, M) if rounds is None else int(rounds)
    from ..potential import get_potential

    algorithm = algorithm.for_model(get_potential(model, fed, model_kwargs))   # defaults that follow the model
    ctx, data, templates = prepare(algorithm, model, fed, seed, model_kwargs)
    evald = check_eval_data(eval_data, ctx.potential)
    sink: dict = {}
    nodes = K if num_nodes is None else int(num_nodes)
    t0 = time.perf_counter()
    run_simulation(server_app(algorithm, ctx, data, rounds, seed, M, sink, num_nodes=nodes, faults=faults,
                              privacy=privacy),
                   client_app(algorithm, ctx, data, templates), num_supernodes=nodes,
                   backend_config=backend_config or {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    wall = time.perf_counter() - t0
    if "server" not in sink:
        raise RuntimeError("the Flower simulation ended without a result (see its log above)")
    server, clients, history = sink["server"], sink["clients"], sink["history"]
    posterior = algorithm.choose_prediction(ctx, server, clients, data, algorithm.posterior(ctx, server, clients))
    if evald is not None:
        history[-1].update(evaluate(posterior, *evald))
    info = {"engine": "flower", "num_nodes": nodes, "wall_s": wall}
    return Result(posterior, history, server, clients, algorithm, ctx, 0.0, 0.0, eval_data=evald, info=info)


__all__ = ["run", "prepare", "serve", "server_app", "client_app", "client_handler"]
