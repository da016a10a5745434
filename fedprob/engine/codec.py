"""Pytrees <-> Flower ``ArrayRecord``: JAX arrays become numpy, any number of arrays per record.

Leaves are stored in ``jax.tree_util`` order under the keys "0", "1", ...;
the structure is not sent: both sides rebuild it from a template pytree
(``like``) of the same structure, which fedprob always has (shapes are
fixed by the algorithm and the federation).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pack(tree):
    """An ``ArrayRecord`` holding every leaf of ``tree`` as a numpy array."""
    from flwr.app import ArrayRecord

    leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves(tree)]
    return ArrayRecord(numpy_ndarrays=leaves)


def unpack(record, like):
    """The pytree shaped like ``like`` from an ``ArrayRecord`` made by :func:`pack`."""
    leaves = record.to_numpy_ndarrays()
    treedef = jax.tree_util.tree_structure(like)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(f"record holds {len(leaves)} arrays, the template {treedef.num_leaves}")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in leaves])


__all__ = ["pack", "unpack"]
