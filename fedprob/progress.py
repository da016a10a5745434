"""Progress of long compiled runs, reported from inside ``lax.scan`` loops.

The SG-MCMC chain runner calls :func:`report` (a ``jax.debug.callback``) at
about :data:`REPORTS` evenly spaced points of each chain with the fraction
of that chain's steps done (``done`` and ``total`` steps). On the host it goes
to the active :func:`phase` (a tqdm bar counting the chains' steps, the
clients' chunks one after the other, whose rate gives the remaining time; it
reads "compiling" until the program starts) or nowhere. Conventions: clients vmapped together advance
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
    def __init__(self, bar, groups: int, desc: str = ""):
        self.bar, self.groups, self.desc = bar, max(int(groups), 1), desc
        self.group, self.last, self.shown, self.reports, self.total = 0, 0.0, 0, 0, 0
        self.start = time.perf_counter()

    def compiling(self):
        """Say on the bar that the program is being compiled."""
        if self.bar is not None:
            self.bar.set_description(f"{self.desc}: compiling")

    def running(self, compile_s: float):
        """The program is compiled (in ``compile_s`` seconds): the bar counts steps from here."""
        if self.bar is not None:
            self.bar.set_description(self.desc)
            self.bar.set_postfix({"compile_s": f"{compile_s:.1f}"})

    def update(self, frac: float, total: float = 0.0):
        self.reports += 1
        if frac + 0.25 < self.last and self.group + 1 < self.groups:   # the next chunk of clients
            self.group += 1
        self.last = frac
        steps = max(int(round(total)), 1)
        self.total = steps * self.groups
        if self.bar is not None and self.bar.total != self.total:
            self.bar.total = self.total
        shown = int(steps * self.groups * min((self.group + frac) / self.groups, 1.0))
        if shown > self.shown and self.bar is not None:
            self.bar.update(shown - self.shown)
        self.shown = max(shown, self.shown)


def _sink(done, total):
    phase = _ACTIVE
    if phase is not None:
        total = float(np.max(np.asarray(total)))
        phase.update(float(np.max(np.asarray(done))) / max(total, 1.0), total)


def report(done, total):
    """Report ``done`` of ``total`` steps of a chain (traced code; a no-op outside a :func:`phase`,
    and adds nothing to a program traced inside ``tracing(False)``)."""
    if _TRACE_REPORTS:
        jax.debug.callback(_sink, done, total)


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
    """Show the reports of the compiled calls made inside the block as a bar counting chain steps."""
    global _ACTIVE
    bar = None
    if enabled:
        from tqdm.auto import tqdm

        bar = tqdm(total=None, desc=desc, leave=False, unit=" steps")
    prev, _ACTIVE = _ACTIVE, _Phase(bar, groups, desc)
    try:
        yield _ACTIVE
    finally:
        jax.effects_barrier()
        _ACTIVE = prev
        if bar is not None:
            bar.close()


__all__ = ["report", "phase", "tracing", "REPORTS"]
