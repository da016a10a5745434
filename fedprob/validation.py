"""Argument checks shared by models, backends and algorithms (clear ValueErrors, early)."""
from __future__ import annotations

import math

import numpy as np


def check_int(name: str, value, minimum: int = 1) -> None:
    """ValueError unless ``value`` is an integer >= ``minimum`` (a static size)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_positive(name: str, value, allow_none: bool = False, allow_zero: bool = False) -> None:
    """ValueError unless ``value`` is a positive finite number (or None / 0 when allowed)."""
    if value is None and allow_none:
        return
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    ok = (v >= 0 if allow_zero else v > 0) and math.isfinite(v)
    if not ok:
        what = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {what} finite number, got {value!r}")


def check_fraction(name: str, value, low_open: bool = False, high_open: bool = False) -> None:
    """ValueError unless ``value`` lies in [0, 1] (open ends where asked)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}") from None
    lo_ok = v > 0 if low_open else v >= 0
    hi_ok = v < 1 if high_open else v <= 1
    if not (lo_ok and hi_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")


def check_choice(name: str, value, choices) -> None:
    """ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        from .names import closest

        best = closest(value, [c for c in choices if isinstance(c, str)])
        guess = f"; did you mean {best!r}?" if best is not None else ""
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}{guess}")
