"""A node's long-lived worker: one process that keeps the node's rows and compiled client update.

Flower's SuperNode starts a new ClientApp process for every message, which
would import JAX and compile the client update every round. ``fedprob flower
supernode`` therefore starts this worker beside the SuperNode and passes its
address and key in the node configuration (``worker`` and ``worker-key``);
fedprob's ClientApp forwards each request to it (:mod:`.clientapp`) over a
local socket authenticated with that key (``multiprocessing.connection``),
so the client update is compiled once per node process and kept across
rounds. The worker listens on the loopback interface only.
"""
from __future__ import annotations

import traceback
from multiprocessing.connection import Listener

from .node import NodeCompute


def serve(data_path: str, listener: Listener, log=print) -> None:
    """Answer requests (:mod:`.node`'s dicts) until the process ends; an error becomes
    ``{"error": message}``."""
    node = NodeCompute(data_path)
    while True:
        try:
            conn = listener.accept()
        except OSError:
            return
        with conn:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                continue
            try:
                reply = node.handle(request)
            except Exception as e:  # noqa: BLE001 - sent back to the ClientApp, which raises it
                log(f"fedprob node worker: {type(e).__name__}: {e}")
                if not isinstance(e, ValueError):
                    traceback.print_exc()
                reply = {"error": f"{type(e).__name__}: {e}"}
            try:
                conn.send(reply)
            except (EOFError, OSError):
                continue


__all__ = ["serve"]
