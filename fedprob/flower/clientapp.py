"""fedprob's ClientApp for Flower's Deployment Engine (``fedprob.flower.clientapp:app``).

Node configuration (``flower-supernode --node-config``): ``data-path`` (the
node's ``.npz``, :mod:`.nodedata`), and, when started by ``fedprob flower
supernode``, ``worker`` / ``worker-key``: the node's long-lived worker
(:mod:`.worker`), to which each message is forwarded so the compiled client
update is kept across rounds. Without a worker the message is computed in
this process. The fedprob configuration comes with every message (its
``meta``), so a node serves any fedprob App.

A ``query`` message is answered with the rows' count and shapes (checked
against the model first); a ``train`` message with ``client_update``'s
result (:mod:`.node`). An error (a file that does not fit, a request that
does not match) is raised, so the server receives Flower's error reply with
its text. This module imports neither JAX nor the ``fedprob`` package when a
worker computes: the app directory's ``fedprob_app/clientapp.py`` loads this
file on its own (importing ``fedprob`` costs about a second, in every
message's process).
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

app = ClientApp()
_LOCAL: dict = {}


def request_of(msg: Message) -> dict:
    """The plain request dict of a fedprob message (:mod:`.node`)."""
    meta = json.loads(msg.content["meta"]["json"])
    arrays = {name: rec.to_numpy_ndarrays() for name, rec in msg.content.array_records.items()}
    return {"type": msg.metadata.message_type.split(".")[0], "config": meta.pop("config"), "meta": meta,
            "arrays": arrays}


def reply_content(reply: dict) -> RecordDict:
    content = {"meta": ConfigRecord({"json": json.dumps(reply["meta"])})}
    for name, leaves in reply["arrays"].items():
        content[name] = ArrayRecord(numpy_ndarrays=list(leaves))
    return RecordDict(content)


def _compute(request: dict, node_config) -> dict:
    worker = node_config.get("worker")
    if worker:
        from multiprocessing.connection import Client

        host, port = str(worker).rsplit(":", 1)
        with Client((host, int(port)), authkey=bytes.fromhex(str(node_config.get("worker-key", "")))) as c:
            c.send(request)
            return c.recv()
    path = node_config.get("data-path")
    if not path:
        raise ValueError("this SuperNode has no data: start it with --node-config \"data-path='FILE.npz'\"")
    from fedprob.flower.node import NodeCompute   # absolute: this file is also loaded on its own

    node = _LOCAL.get(path)
    if node is None:
        node = _LOCAL[path] = NodeCompute(str(path))
    try:
        return node.handle(request)
    except Exception as e:  # noqa: BLE001 - same form as the worker's
        return {"error": f"{type(e).__name__}: {e}"}


def handle(msg: Message, context) -> Message:
    reply = _compute(request_of(msg), context.node_config)
    if "error" in reply:
        raise RuntimeError(f"fedprob node: {reply['error']}")
    return Message(reply_content(reply), reply_to=msg)


@app.query()
def query(msg: Message, context) -> Message:
    return handle(msg, context)


@app.train()
def train(msg: Message, context) -> Message:
    return handle(msg, context)


__all__ = ["app", "request_of", "reply_content"]
