"""The Flower engine: fedprob's rounds as a Flower ServerApp and ClientApp.

``fp.run(..., engine="flower", num_nodes=N)`` runs a local Flower
simulation with ``N`` SuperNodes (set explicitly; default one per client).
The ServerApp (:func:`server_app`) is the strategy: it holds fedprob's
server and client states, samples the round's participants with the local
engine's keys, sends each participant a ``"train"`` message (server state,
client state, client id, round key; :mod:`.codec` turns the pytrees into
``ArrayRecord`` s of numpy arrays), and applies ``algorithm.server_update``
with the local engine's masks and commit rule to the replies. The ClientApp
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

import jax
import jax.numpy as jnp
import numpy as np

from . import codec
from .local import _where_tree, compiled_init
from ..algorithms.base import Context
from ..protocols import finite_flag

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")


def _client_fn(algorithm, ctx):
    @jax.jit
    def update(server, client, data, key):
        new_c, msg, diag = algorithm.client_update(ctx, server, client, data, key)
        return new_c, msg, diag, finite_flag(new_c, msg)

    return update


def client_app(algorithm, ctx: Context, data, templates):
    """A ClientApp running ``algorithm.client_update`` for the client named in each message."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()
    update = _client_fn(algorithm, ctx)
    server_t, client_t, key_t = templates

    @app.train()
    def train(msg: Message, context):
        k = int(msg.content["meta"]["client"])
        server = codec.unpack(msg.content["server"], server_t)
        client = codec.unpack(msg.content["client"], client_t)
        key = codec.unpack(msg.content["key"], key_t)
        d = jax.tree_util.tree_map(lambda a: a[k], data)
        out = update(server, client, d, key)
        return Message(RecordDict({"reply": codec.pack(out), "meta": ConfigRecord({"client": k})}),
                       reply_to=msg)

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


def server_app(algorithm, ctx: Context, data, rounds: int, seed: int, num_participants: int, sink: dict,
               num_nodes: int = 1, node_timeout: float = 300.0):
    """A ServerApp holding fedprob's states; the final ones go to ``sink``.

    It waits (up to ``node_timeout`` seconds) until ``num_nodes`` SuperNodes have
    registered, so clients are spread over all of them; none at all is an error."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.serverapp import ServerApp

    app = ServerApp()
    K, M = ctx.num_clients, num_participants
    update = _client_fn(algorithm, ctx)
    server_update = jax.jit(lambda s, m, w, ok: algorithm.server_update(ctx, s, m, w, ok))

    @app.main()
    def main(grid, context):
        k_init, k_rounds = jax.random.split(jax.random.PRNGKey(seed))
        server, clients = compiled_init(algorithm, ctx, data, k_init)(k_init, data)
        nodes = _wait_for_nodes(grid, num_nodes, node_timeout)
        history = []
        for r in range(rounds):
            k_sel, k_cl = jax.random.split(jax.random.fold_in(k_rounds, r))
            idx = np.arange(K) if M == K else np.sort(np.asarray(jax.random.permutation(k_sel, K)[:M]))
            take = lambda tree: jax.tree_util.tree_map(lambda a: a[idx], tree)
            cs = take(clients)
            out_msgs = []
            for j, k in enumerate(idx):
                content = RecordDict({
                    "server": codec.pack(server),
                    "client": codec.pack(jax.tree_util.tree_map(lambda a: a[j], cs)),
                    "key": codec.pack(jax.random.fold_in(k_cl, int(k))),
                    "meta": ConfigRecord({"client": int(k), "round": r})})
                out_msgs.append(Message(content, dst_node_id=nodes[int(k) % len(nodes)], message_type="train"))
            replies = {int(m.content["meta"]["client"]): m for m in grid.send_and_receive(out_msgs)
                       if m.has_content()}
            like = jax.eval_shape(update, server, jax.tree_util.tree_map(lambda a: a[0], cs),
                                  jax.tree_util.tree_map(lambda a: a[0], data), k_cl)
            outs = [codec.unpack(replies[int(k)].content["reply"], like) for k in idx]
            new_cs, msgs, diags, ok = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
            d_n = jnp.asarray(data.n)[idx]
            new_server = server_update(server, msgs, d_n, ok)
            server_ok = finite_flag(new_server) & jnp.any(ok)
            server = _where_tree(server_ok, new_server, server)
            merged = _where_tree(ok & server_ok, new_cs, cs)
            clients = jax.tree_util.tree_map(lambda a, b: a.at[idx].set(b), clients, merged)
            history.append({"round": r + 1, "participants": idx.tolist(),
                            "excluded": idx[~np.asarray(ok)].tolist(), "server_update_ok": bool(server_ok)})
        sink.update(server=server, clients=clients, history=history)

    return app


def run(algorithm, model, fed, rounds=None, seed: int = 0, eval_data=None, clients_per_round=None,
        num_nodes=None, model_kwargs=None, backend_config=None):
    """``fp.run`` on a local Flower simulation (see the module docstring); returns a ``Result``."""
    import time

    from flwr.simulation import run_simulation

    from ..metrics import evaluate
    from ..run import Result, _check_eval, get_potential

    rounds = algorithm.default_rounds if rounds is None else int(rounds)
    K = fed.num_clients
    M = K if clients_per_round is None else int(clients_per_round)
    potential = get_potential(model, fed, model_kwargs)
    evald = _check_eval(eval_data, potential)
    ctx = Context(potential, K, np.asarray(fed.sizes), fed.num_rows)
    data = fed.client_data()
    k_init = jax.random.split(jax.random.PRNGKey(seed))[0]
    server0, clients0 = compiled_init(algorithm, ctx, data, k_init)(k_init, data)
    templates = (server0, jax.tree_util.tree_map(lambda a: a[0], clients0), k_init)
    sink: dict = {}
    nodes = K if num_nodes is None else int(num_nodes)
    t0 = time.perf_counter()
    run_simulation(server_app(algorithm, ctx, data, rounds, seed, M, sink, num_nodes=nodes),
                   client_app(algorithm, ctx, data, templates), num_supernodes=nodes,
                   backend_config=backend_config or {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    wall = time.perf_counter() - t0
    if "server" not in sink:
        raise RuntimeError("the Flower simulation ended without a result (see its log above)")
    server, clients, history = sink["server"], sink["clients"], sink["history"]
    if evald is not None:
        history[-1].update(evaluate(algorithm.posterior(ctx, server, clients), *evald))
    posterior = algorithm.posterior(ctx, server, clients)
    info = {"engine": "flower", "num_nodes": nodes, "wall_s": wall}
    return Result(posterior, history, server, clients, algorithm, ctx, 0.0, 0.0, eval_data=evald, info=info)


__all__ = ["run", "server_app", "client_app"]
