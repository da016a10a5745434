"""JAX's persistent compilation cache for the command line and the test suite.

A compiled XLA program is written to a cache directory keyed by the
program, the compile options, the backend and the JAX version; a later
process that compiles the same program loads it instead. ``enable()``
points JAX at the directory:

* ``FEDPROB_COMPILATION_CACHE`` unset: ``$XDG_CACHE_HOME/fedprob/jax``
  (``~/.cache/fedprob/jax``); set to a path: that directory; set to ``0``,
  ``off``, ``false`` or ``no``: no persistent cache (every process compiles).
* Programs that took at least ``min_compile_s`` seconds to compile are
  stored (default 0: every program; the cache is keyed on the exact program,
  so a stale entry is never used).

JAX sets its cache up at the first compile of a process: call ``enable``
before any computation. Programs
with host callbacks (``jax.debug.callback``: the progress reports of the
SG-MCMC chains, :mod:`fedprob.progress`) are never stored by JAX: they
compile in every process.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ENV = "FEDPROB_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no")


def cache_dir(path=None) -> Optional[Path]:
    """The directory ``enable(path)`` would use (None: the cache is switched off by ``ENV``)."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() in _OFF:
        return None
    if path is not None:
        return Path(path)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fedprob" / "jax"


def enable(path=None, min_compile_s: float = 0.0) -> Optional[Path]:
    """Turn the persistent cache on at ``cache_dir(path)``; returns it (None when switched off)."""
    d = cache_dir(path)
    if d is None:
        return None
    import jax

    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return d


__all__ = ["enable", "cache_dir", "ENV"]
