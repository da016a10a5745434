"""Refuse a dense d x d matrix that cannot fit, before compiling it.

A full Laplace curvature (``Laplace(hessian="full")`` or ``"ggn"``) or a full
preconditioner holds a (d, d) matrix per client. On a network of 178,110
weights that is 127 GB, and XLA fails with ``RESOURCE_EXHAUSTED: Out of memory
allocating 1268926884000 bytes`` only after compiling. :func:`check_fits`
raises a ValueError at trace time instead, naming the setting, the size and
the diagonal alternative, when one matrix exceeds the device's memory (a
GPU's ``bytes_limit``; on CPU the machine's physical memory).
"""
from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np


def device_memory_bytes() -> Optional[int]:
    """The default device's memory limit in bytes (CPU: physical memory), or None when unknown."""
    try:
        stats = jax.devices()[0].memory_stats()
        if stats and stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    except Exception:                       # noqa: BLE001 - backends without memory statistics
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(what: str, dim: int, dtype, advice: str) -> None:
    """Raise ValueError when one (dim, dim) matrix of ``dtype`` is larger than the device's memory."""
    have = device_memory_bytes()
    need = int(dim) * int(dim) * np.dtype(dtype).itemsize
    if have is not None and need > have:
        raise ValueError(f"{what} on {dim:,} parameters builds a {dim:,} x {dim:,} matrix per client "
                         f"({_size(need)}), more than this device's memory ({_size(have)}). {advice}")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:,.0f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:,.1f} MiB"


__all__ = ["check_fits", "device_memory_bytes"]
