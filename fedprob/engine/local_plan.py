"""``fp.engine.Local``: run the rounds in this process (or, after ``jax.distributed.initialize``,
in every process of the job).

Each round vmaps the participating clients (:mod:`fedprob.engine.local`);
with several devices the clients are split over a one-axis ``("clients",)``
mesh with ``jax.shard_map`` (:mod:`fedprob.engine.sharded`), and the answer
is the single-device one up to float rounding.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np
from ..names import CheckedKeywords


@dataclasses.dataclass(frozen=True)
class Local(CheckedKeywords):
    """The local engine (the default of ``fp.run``).

    devices: the JAX devices to shard the clients over (default
    ``jax.devices()``: all of this process's, or of every process after
    ``jax.distributed.initialize``); one device runs plain vmap.
    client_chunk: map the clients in ``lax.map`` chunks of this many (vmapped
    inside a chunk) to bound memory; a number at least the participants vmaps
    them all; None (default): the algorithm's choice
    (:meth:`~fedprob.algorithms.base.Algorithm.client_chunk_for`), all at once
    except GGN-Laplace clients of a large model with unequal sizes on the CPU,
    run one at a time so that each pays its own rows, not the largest client's.
    """

    devices: Optional[tuple] = None
    client_chunk: Optional[int] = None

    def __post_init__(self):
        if self.devices is not None:
            if isinstance(self.devices, jax.Device):
                raise ValueError("Local.devices is a sequence of devices: pass [device]")
            try:
                devs = tuple(self.devices)
            except TypeError:
                raise ValueError(f"Local.devices must be a sequence of JAX devices, got {self.devices!r}") from None
            if not devs:
                raise ValueError("Local.devices is empty: give at least one device, or None for jax.devices()")
            bad = [d for d in devs if not isinstance(d, jax.Device)]
            if bad:
                raise ValueError(f"Local.devices must hold JAX devices (jax.devices()), got {bad[0]!r}")
            if len(set(devs)) != len(devs):
                raise ValueError("Local.devices names a device twice")
            object.__setattr__(self, "devices", devs)
        c = self.client_chunk
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1):
            raise ValueError(f"Local.client_chunk must be a positive integer or None, got {c!r}")

    def device_list(self) -> list:
        """The devices the rounds run on."""
        return list(jax.devices() if self.devices is None else self.devices)


__all__ = ["Local"]
