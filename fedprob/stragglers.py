"""``fp.Stragglers``: clients that miss the round's deadline on their local work.

A reporting participant is a straggler with probability ``rate`` (one draw
per participant and round). A straggler completes the fraction
``f ~ Uniform[min_fraction, 1)`` of its ``S_k`` local steps by the deadline,
``s_k = floor(f * S_k)``. ``policy``:

* ``"truncate"`` (default): the update after the ``s_k`` completed steps is
  aggregated like any other, where the algorithm has local steps
  (``Algorithm.local_step_count`` is not None); otherwise, and when
  ``s_k = 0``, the straggler's message is discarded.
* ``"discard"``: every straggler's message is discarded.

The simulation itself (the draws, the step budgets, the screening) is in
:mod:`fedprob.faults`; pass ``fp.Faults(stragglers=fp.Stragglers(...))`` to
``fp.run``.
"""
from __future__ import annotations

import dataclasses

from .validation import check_choice, check_fraction
from .names import CheckedKeywords

STRAGGLER_POLICIES = ("truncate", "discard")


@dataclasses.dataclass(frozen=True)
class Stragglers(CheckedKeywords):
    """Straggling clients of a run: ``rate`` in [0, 1), ``policy`` ``"truncate"`` or ``"discard"``,
    ``min_fraction`` in [0, 1): the least fraction of its local steps a straggler completes."""

    rate: float
    policy: str = "truncate"
    min_fraction: float = 0.0

    def __post_init__(self):
        check_fraction("Stragglers.rate", self.rate, high_open=True)
        check_choice("Stragglers.policy", self.policy, STRAGGLER_POLICIES)
        check_fraction("Stragglers.min_fraction", self.min_fraction, high_open=True)

    @property
    def truncates(self) -> bool:
        """Stragglers are simulated and their partial updates kept (where the algorithm has them)."""
        return self.rate > 0 and self.policy == "truncate"


__all__ = ["Stragglers", "STRAGGLER_POLICIES"]
