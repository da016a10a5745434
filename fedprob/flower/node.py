"""What a node computes: its checked rows, and ``client_update`` compiled once per federation shape.

A :class:`NodeCompute` lives as long as its process: in the node's
long-lived worker (:mod:`.worker`, started by ``fedprob flower supernode``)
it keeps the compiled client update across rounds; in a ClientApp process of
Flower's own (one per message) it is rebuilt per message.

Requests and replies are plain dicts (no Flower types, so the worker needs
no Flower): a request ``{"type": "query" | "train", "config": TOML text,
"meta": {...}, "arrays": {"server": [...], "client": [...], "key": [...]}}``;
a reply ``{"meta": {...}, "arrays": {"reply": [...]}}``.

* ``query``: checks the rows against the configuration's model (before the
  first round) and replies with what the server needs to set up the
  federation and nothing else: the row count ``n``, the row shapes and dtypes
  of X and y, and the file's ``client`` index (or None).
* ``train``: ``meta`` carries the client index ``client``, the round, the
  federation's client count ``K``, its ``sizes`` and longest client ``n_max``
  (the node pads its rows to ``n_max``, as the local engine does); the reply
  carries the leaves of ``(client state, message, diagnostics, finite)`` of
  ``algorithm.client_update``: never a row.
"""
from __future__ import annotations

import numpy as np

from . import nodedata, spec


class NodeCompute:
    """One node's rows (``data_path``) and its compiled client updates."""

    def __init__(self, data_path: str):
        self.rows = nodedata.load(data_path)
        self._compiled: dict = {}

    def handle(self, request: dict) -> dict:
        kind = request["type"]
        cfg = spec.parse(request["config"])
        if kind == "query":
            return self.query(cfg)
        if kind == "train":
            return self.train(request["config"], cfg, request["meta"], request["arrays"])
        raise ValueError(f"unknown request type {kind!r}")

    def _model(self, cfg):
        algo, model, mkw, _ = spec.build_parts(cfg)
        num_classes = cfg.get("model", {}).get("num_classes")
        return algo, model, mkw, num_classes

    def query(self, cfg) -> dict:
        _, model, mkw, num_classes = self._model(cfg)
        nodedata.check_against(self.rows, model, mkw, num_classes)
        X, y = self.rows["X"], self.rows["y"]
        meta = {"n": int(X.shape[0]), "x_shape": list(X.shape[1:]), "x_dtype": str(X.dtype),
                "y_shape": list(y.shape[1:]), "y_dtype": str(y.dtype), "client": self.rows["client"]}
        return {"meta": meta, "arrays": {}}

    def _update(self, text: str, cfg, K: int, sizes: tuple, n_max: int):
        key = (text, K, sizes, n_max)
        hit = self._compiled.get(key)
        if hit is not None:
            return hit
        import jax
        import jax.numpy as jnp

        from ..algorithms.base import Context
        from ..engine import local
        from ..potential import ClientData

        algo, model, mkw, num_classes = self._model(cfg)
        Xp, yp = nodedata.padded(self.rows, n_max)
        potential = nodedata.check_against(dict(self.rows, X=Xp, y=yp), model, mkw, num_classes)
        algo = algo.for_model(potential)                          # the server's configuration (strategy.py)
        ctx = Context(potential, K, np.asarray(sizes, np.int32), int(sum(sizes)))
        stacked = ClientData(jax.ShapeDtypeStruct((K,) + Xp.shape, Xp.dtype),
                             jax.ShapeDtypeStruct((K,) + yp.shape, yp.dtype),
                             jax.ShapeDtypeStruct((K,), np.int32))
        k0 = jax.random.PRNGKey(0)
        server_t, clients_t = jax.eval_shape(lambda k, d: algo.init(ctx, k, d), k0, stacked)
        client_t = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), clients_t)
        data = ClientData(jnp.asarray(Xp), jnp.asarray(yp), jnp.int32(self.rows["X"].shape[0]))
        fn = jax.jit(lambda s, c, k: local.client_step(algo, ctx, s)((c, data, k)))
        hit = (fn, server_t, client_t)
        self._compiled = {key: hit}          # one federation shape at a time
        return hit

    def train(self, text, cfg, meta: dict, arrays: dict) -> dict:
        import jax
        import jax.numpy as jnp

        import time

        t0 = time.perf_counter()
        K, sizes, n_max = int(meta["K"]), tuple(int(s) for s in meta["sizes"]), int(meta["n_max"])
        if sizes[int(meta["client"])] != self.rows["X"].shape[0]:
            raise ValueError(f"the server expects {sizes[int(meta['client'])]} rows for client "
                             f"{meta['client']}, this node holds {self.rows['X'].shape[0]}")
        fn, server_t, client_t = self._update(text, cfg, K, sizes, n_max)

        def tree(leaves, like):
            treedef = jax.tree_util.tree_structure(like)
            if len(leaves) != treedef.num_leaves:
                raise ValueError(f"request holds {len(leaves)} arrays, expected {treedef.num_leaves}")
            return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in leaves])

        server = tree(arrays["server"], server_t)
        client = tree(arrays["client"], client_t)
        key = jnp.asarray(arrays["key"][0])
        out = fn(server, client, key)
        leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves(out)]
        return {"meta": {"client": int(meta["client"]), "round": int(meta["round"]),
                         "compute_s": time.perf_counter() - t0},
                "arrays": {"reply": leaves}}


__all__ = ["NodeCompute"]
