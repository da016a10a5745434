"""The flat keyword arguments of earlier releases, translated to the option objects (one release).

``fp.run`` took its engine, fault and checkpoint settings as 11 flat
keywords; they are now objects (:class:`fedprob.engine.Local`,
:class:`fedprob.engine.Flower`, :class:`fedprob.Faults` with
:class:`fedprob.Stragglers`, :class:`fedprob.Checkpoint`). The old keywords
still work for this release: each call that uses them gets one FutureWarning
that names the new form, and the run is the same, bit for bit.

==============================  ==============================================
old keyword of ``fp.run``        new form
==============================  ==============================================
``engine="local"``               ``engine=fp.engine.Local()``
``devices``, ``client_chunk``    ``engine=fp.engine.Local(devices=..., client_chunk=...)``
``engine="flower"``, ``num_nodes``  ``engine=fp.engine.Flower(num_nodes=...)``
``dropout_rate``                 ``faults=fp.Faults(dropout_rate=...)``
``max_update_norm``              ``faults=fp.Faults(max_update_norm=...)``
``straggler_rate``               ``faults=fp.Faults(stragglers=fp.Stragglers(rate=...))``
``straggler_policy``             ``fp.Stragglers(..., policy=...)``
``straggler_min_fraction``       ``fp.Stragglers(..., min_fraction=...)``
``checkpoint_dir``               ``checkpoint=fp.Checkpoint(dir)``
==============================  ==============================================
"""
from __future__ import annotations

import warnings

from .validation import check_choice, check_fraction

ENGINE_KEYS = ("devices", "client_chunk", "num_nodes")
FAULT_KEYS = ("dropout_rate", "max_update_norm", "straggler_rate", "straggler_policy", "straggler_min_fraction")
STRAGGLER_KEYS = ("straggler_rate", "straggler_policy", "straggler_min_fraction")
CHECKPOINT_KEYS = ("checkpoint_dir",)
ENGINES = ("local", "flower")


def _call(name: str, kwargs: dict) -> str:
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


def warn(old: str, new: str, stacklevel: int) -> None:
    """A FutureWarning: ``old`` is deprecated, pass ``new``."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; pass {new} instead",
                  FutureWarning, stacklevel=stacklevel + 1)


def _stragglers(flat: dict):
    """A :class:`~fedprob.stragglers.Stragglers` (or None) from the flat ``straggler_*`` keywords,
    checked under their old names."""
    from .stragglers import STRAGGLER_POLICIES, Stragglers

    rate = flat.get("straggler_rate", 0.0)
    policy = flat.get("straggler_policy", "truncate")
    min_fraction = flat.get("straggler_min_fraction", 0.0)
    check_fraction("straggler_rate", rate, high_open=True)
    check_choice("straggler_policy", policy, STRAGGLER_POLICIES)
    check_fraction("straggler_min_fraction", min_fraction, high_open=True)
    if not rate and "straggler_policy" not in flat and "straggler_min_fraction" not in flat:
        return None
    return Stragglers(rate, policy, min_fraction)


def _stragglers_call(s) -> str:
    kw = {"rate": s.rate}
    if s.policy != "truncate":
        kw["policy"] = s.policy
    if s.min_fraction:
        kw["min_fraction"] = s.min_fraction
    return _call("fp.Stragglers", kw)


def _engine(engine, given: dict):
    from .engine import Flower, Local

    if engine is not None and not isinstance(engine, str):
        raise ValueError(f"give {', '.join(given)} inside engine={type(engine).__name__}(...), not beside it")
    name = "local" if engine is None else engine
    if name not in ENGINES:
        raise ValueError(f"engine must be fp.engine.Local(...) or fp.engine.Flower(...), got {engine!r}")
    if name == "flower":
        bad = [k for k in ("devices", "client_chunk") if given.get(k) is not None]
        if bad:
            raise ValueError(f"engine='flower' does not support {', '.join(bad)}; use engine='local'")
        kw = {k: v for k, v in given.items() if k == "num_nodes" and v is not None}
        return Flower(**kw), _call("fp.engine.Flower", kw)
    kw = {k: v for k, v in given.items() if k != "num_nodes" and v is not None}   # num_nodes: Flower's only
    return Local(**kw), _call("fp.engine.Local", kw)


def _faults(faults, given: dict):
    from .faults import Faults

    if faults is not None:
        raise ValueError(f"give {', '.join(given)} inside faults=fp.Faults(...), not beside it")
    dropout_rate = given.get("dropout_rate", 0.0)
    check_fraction("dropout_rate", dropout_rate, high_open=True)
    s = _stragglers({k: v for k, v in given.items() if k in STRAGGLER_KEYS})
    f = Faults(dropout_rate, s, given.get("max_update_norm"))
    kw = {k: given[k] for k in ("dropout_rate", "max_update_norm") if k in given}
    new = _call("fp.Faults", kw)
    if s is not None:
        new = new[:-1] + (", " if kw else "") + f"stragglers={_stragglers_call(s)})"
    return f, new


def run_options(engine, faults, checkpoint, old: dict, run_keywords=()):
    """``(engine, faults, checkpoint)`` of an ``fp.run`` call, translating the keywords of earlier
    releases in ``old`` (one FutureWarning naming the new form); a keyword in neither those nor
    ``run_keywords`` (``fp.run``'s own) is a TypeError naming the closest of ``run_keywords``."""
    unknown = sorted(set(old) - set(ENGINE_KEYS + FAULT_KEYS + CHECKPOINT_KEYS))
    if unknown:
        from .names import unexpected_keyword

        raise unexpected_keyword("run", unknown[0], run_keywords)
    olds, news = [], []
    given = {k: old[k] for k in ENGINE_KEYS if k in old}
    if isinstance(engine, str) or given:
        if isinstance(engine, str):
            olds.append(f"engine={engine!r}")
        engine, new = _engine(engine, given)
        olds += list(given)
        news.append(f"engine={new}")
    given = {k: old[k] for k in FAULT_KEYS if k in old}
    if given:
        faults, new = _faults(faults, given)
        olds += list(given)
        news.append(f"faults={new}")
    if "checkpoint_dir" in old:
        from .checkpoint import Checkpoint

        if checkpoint is not None:
            raise ValueError("give checkpoint=fp.Checkpoint(dir) or the deprecated checkpoint_dir, not both")
        if old["checkpoint_dir"] is not None:
            checkpoint = Checkpoint(old["checkpoint_dir"])
            news.append(f"checkpoint=fp.Checkpoint({checkpoint.dir!r})")
        olds.append("checkpoint_dir")
    if olds:
        warn(f"fp.run's keyword arguments {', '.join(olds)}", ", ".join(news) or "nothing", stacklevel=3)
    return engine, faults, checkpoint


__all__ = ["run_options", "warn"]
