"""Progress of long compiled runs, reported from inside ``lax.scan`` loops.

The SG-MCMC chain runner calls :func:`report` (a ``jax.debug.callback``) at
about :data:`REPORTS` evenly spaced points of each chain with the fraction
of that chain's steps done. On the host the fraction goes to the active
:func:`phase` (a tqdm bar in per mille of the phase, whose rate gives the
remaining time) or nowhere. Conventions: clients vmapped together advance
in lockstep, so any one's fraction is the group's; clients run in
``groups`` sequential chunks (``lax.map``) restart at 0, which the sink
counts as the next group. Outside a :func:`phase` a report costs one host
call and nothing else.

Reports are put into a program when it is traced: inside ``with
tracing(False)`` :func:`report` adds nothing, so the compiled program makes no
host call (and JAX's persistent compilation cache can store it: it never
stores programs with host callbacks). ``fp.run`` traces its rounds that way
(no bar shows their reports) and the one-round client phase too when
``progress=False``.
"""
from __future__ import annotations

import contextlib
import time

import jax
import numpy as np

#: Progress reports per chain (evenly spaced in steps).
REPORTS = 50

_ACTIVE = None
_TRACE_REPORTS = True


class _Phase:
    def __init__(self, bar, groups: int):
        self.bar, self.groups = bar, max(int(groups), 1)
        self.group, self.last, self.shown, self.reports = 0, 0.0, 0, 0
        self.start = time.perf_counter()

    def update(self, frac: float):
        self.reports += 1
        if frac + 0.25 < self.last and self.group + 1 < self.groups:   # the next chunk of clients
            self.group += 1
        self.last = frac
        shown = int(1000 * min((self.group + frac) / self.groups, 1.0))
        if shown > self.shown and self.bar is not None:
            self.bar.update(shown - self.shown)
        self.shown = max(shown, self.shown)


def _sink(frac):
    phase = _ACTIVE
    if phase is not None:
        phase.update(float(np.max(np.asarray(frac))))


def report(done, total):
    """Report ``done / total`` steps of a chain (traced code; a no-op outside a :func:`phase`,
    and adds nothing to a program traced inside ``tracing(False)``)."""
    if _TRACE_REPORTS:
        jax.debug.callback(_sink, done / total)


@contextlib.contextmanager
def tracing(enabled: bool):
    """Programs traced inside the block make their reports (``enabled``) or none."""
    global _TRACE_REPORTS
    prev, _TRACE_REPORTS = _TRACE_REPORTS, bool(enabled)
    try:
        yield
    finally:
        _TRACE_REPORTS = prev


@contextlib.contextmanager
def phase(desc: str, groups: int = 1, enabled: bool = True):
    """Show the reports of the compiled calls made inside the block as a bar (per mille)."""
    global _ACTIVE
    bar = None
    if enabled:
        from tqdm.auto import tqdm

        bar = tqdm(total=1000, desc=desc, leave=False, unit="‰")
    prev, _ACTIVE = _ACTIVE, _Phase(bar, groups)
    try:
        yield _ACTIVE
    finally:
        jax.effects_barrier()
        _ACTIVE = prev
        if bar is not None:
            bar.close()


__all__ = ["report", "phase", "tracing", "REPORTS"]
