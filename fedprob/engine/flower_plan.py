"""``fp.engine.Flower``: run the rounds as a local Flower simulation (``pip install fedprob[flower]``).

The ServerApp and ClientApp are in :mod:`fedprob.engine.flower`; this object
only says how many simulated SuperNodes serve the clients. Checkpoints,
device lists, client chunks and truncated stragglers are features of
:class:`fedprob.engine.Local` (``fp.run`` refuses them here).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from ..names import CheckedKeywords


@dataclasses.dataclass(frozen=True)
class Flower(CheckedKeywords):
    """A local Flower simulation with ``num_nodes`` SuperNodes (default: one per client);
    client ``k`` is served by node ``k mod num_nodes``."""

    num_nodes: Optional[int] = None

    def __post_init__(self):
        from ..extras import require

        require("flower", "fp.engine.Flower()", ("flwr",))      # the simulation's ray: checked by fp.run
        n = self.num_nodes
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
            raise ValueError(f"Flower.num_nodes must be a positive integer or None, got {n!r}")


__all__ = ["Flower"]
