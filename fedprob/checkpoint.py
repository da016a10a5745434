"""``fp.Checkpoint``: round checkpoints of ``fp.run``, arrays as .npz, metadata as JSON, no pickle.

After round r, ``fp.run(..., checkpoint=fp.Checkpoint(DIR))`` writes ``round-00000r.npz``
(the leaves of the server and client states, in tree order) and then
``round-00000r.json`` (round, history, the npz's SHA-256, fingerprints). Each
file is written to a temporary name and moved into place with ``os.replace``,
so a crash mid-write never damages an existing checkpoint; the JSON is
written last and names the hash of its arrays, so a checkpoint counts only
when both files are complete. The newest ``keep`` rounds are kept (default 2).

Loading never unpickles (``allow_pickle=False``): the tree structure comes
from the run itself (``algorithm.init`` on the same inputs), and every leaf's
shape and dtype must match. A checkpoint whose files are damaged is skipped
with a warning and the previous round is used. A checkpoint written for a
different algorithm (its repr), model (function name, parameter layout,
row shapes, and its log prior and log likelihood at two fixed points, which
tell apart closures with different constants), data (SHA-256 of the padded
arrays) or run settings (seed, clients per round, chunking, faults,
privacy) is refused with a message naming what differs.

Resuming is exact: round r uses the key ``fold_in(k_rounds, r)``, so running
rounds 1..3, stopping, and resuming to 6 gives bit for bit the states and
history of running 1..6 at once (up to the wall-clock ``time`` column).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import tempfile
import warnings
from typing import Any, Optional

import jax
import numpy as np
from .names import CheckedKeywords

FORMAT = 1
_NAME = "round-{:06d}"
_KEEP = 2


@dataclasses.dataclass(frozen=True)
class Checkpoint(CheckedKeywords):
    """Checkpoint every round into ``dir`` and resume from it (module docstring).

    dir: the directory (created when needed); a later run with the same inputs
    and directory resumes from its newest checkpoint and gives exactly the
    uninterrupted result. keep: how many of the newest rounds stay on disk (>= 1;
    2 by default, so a damaged newest one falls back to the previous round).
    """

    dir: str
    keep: int = _KEEP

    def __post_init__(self):
        if not isinstance(self.dir, (str, os.PathLike)) or not str(os.fspath(self.dir)):
            raise ValueError(f"Checkpoint.dir must be a directory path, got {self.dir!r}")
        object.__setattr__(self, "dir", os.fspath(self.dir))
        if isinstance(self.keep, bool) or not isinstance(self.keep, (int, np.integer)) or self.keep < 1:
            raise ValueError(f"Checkpoint.keep must be an integer >= 1, got {self.keep!r}")


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _describe(obj) -> str:
    """repr without memory addresses (stable across processes)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(obj))


def _probe(potential, fed) -> list:
    """Log prior and log likelihood at two fixed points on client 0's rows (tells closures apart)."""
    import jax
    import jax.numpy as jnp

    d = potential.dim
    n = int(fed.sizes[0])
    X = jax.tree_util.tree_map(lambda a: jnp.asarray(a[0, :n]), fed.X)
    y = jnp.asarray(fed.y[0, :n])
    out = []
    for z in (jnp.zeros(d), jnp.linspace(-0.5, 0.5, d)):
        out += [float(potential.log_prior(z)), float(potential.log_likelihood(z, X, y))]
    return [float(f"{v:.5g}") for v in out]


def _describe_potential(potential, fed) -> str:
    model = potential.model
    name = f"{getattr(model, '__module__', '?')}.{getattr(model, '__qualname__', type(model).__name__)}"
    sites = ", ".join(f"{s.name}{tuple(s.unconstrained_shape)}" for s in potential.sites)
    kwargs = _describe(sorted(potential.model_kwargs.items()))
    return (f"{name}({sites}; kwargs {kwargs}; x {potential.x_shape}, y {potential.y_shape}, "
            f"observed {potential.observed}; log densities at probe points {_probe(potential, fed)})")


def fingerprints(algorithm, potential, fed, settings: dict) -> dict:
    """What a checkpoint must match to be resumed: ``{field: (description, hash)}``."""
    import jax

    digest = _digest(*jax.tree_util.tree_leaves(fed.X), fed.y, fed.sizes)
    out = {"algorithm": _describe(algorithm), "model": _describe_potential(potential, fed),
           "data": f"{fed!r} sha256 {digest}",
           "settings": json.dumps(settings, sort_keys=True, default=_describe)}
    return {k: [v, hashlib.sha256(v.encode()).hexdigest()] for k, v in out.items()}


def _atomic_write(path: str, write) -> None:
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"history value of type {type(v).__name__} is not JSON-serialisable")


def save(directory: str, round_: int, server_state, client_states, history: list, prints: dict,
         keep: int = _KEEP) -> str:
    """Write round ``round_``'s checkpoint (atomically) and drop all but the newest ``keep``."""
    os.makedirs(directory, exist_ok=True)
    leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves((server_state, client_states))]
    arrays = {f"leaf_{i:05d}": a for i, a in enumerate(leaves)}
    base = os.path.join(directory, _NAME.format(round_))
    _atomic_write(base + ".npz", lambda f: np.savez(f, **arrays))
    meta = {"format": FORMAT, "round": int(round_), "num_leaves": len(leaves),
            "arrays_sha256": _digest(*leaves), "fingerprints": prints, "history": history}
    text = json.dumps(meta, default=_json_default, allow_nan=True).encode()
    _atomic_write(base + ".json", lambda f: f.write(text))
    for old in _rounds(directory)[keep:]:
        for ext in (".json", ".npz"):
            p = os.path.join(directory, _NAME.format(old) + ext)
            if os.path.exists(p):
                os.remove(p)
    return base


def _rounds(directory: str) -> list:
    """Rounds with a JSON file, newest first."""
    found = []
    for p in glob.glob(os.path.join(directory, "round-*.json")):
        m = re.fullmatch(r"round-(\d+)\.json", os.path.basename(p))
        if m:
            found.append(int(m.group(1)))
    return sorted(found, reverse=True)


def _load(base: str, template) -> tuple:
    with open(base + ".json", "rb") as f:
        meta = json.loads(f.read().decode())
    t_leaves, treedef = jax.tree_util.tree_flatten(template)
    if meta.get("format") != FORMAT or meta.get("num_leaves") != len(t_leaves):
        raise ValueError("its layout does not match this run's state")
    with np.load(base + ".npz", allow_pickle=False) as z:
        leaves = [z[f"leaf_{i:05d}"] for i in range(len(t_leaves))]
    if _digest(*leaves) != meta["arrays_sha256"]:
        raise ValueError("its arrays do not match the hash recorded with them")
    for i, (a, t) in enumerate(zip(leaves, t_leaves)):
        if a.shape != np.shape(t) or a.dtype != np.asarray(t).dtype:
            raise ValueError(f"state leaf {i} has shape {a.shape} {a.dtype}, this run's has "
                             f"{np.shape(t)} {np.asarray(t).dtype}")
    return meta, jax.tree_util.tree_unflatten(treedef, [jax.numpy.asarray(a) for a in leaves])


def restore(directory: str, prints: dict, server_state, client_states) -> Optional[tuple]:
    """``(round, server_state, client_states, history)`` of the newest good checkpoint, or None.

    ``server_state`` / ``client_states`` are this run's initial states (the
    tree structure, shapes and dtypes to load into). A damaged newest
    checkpoint falls back to the previous one with a RuntimeWarning; a
    checkpoint with different fingerprints raises ValueError.
    """
    if not os.path.isdir(directory):
        return None
    for r in _rounds(directory):
        base = os.path.join(directory, _NAME.format(r))
        try:
            meta, (server, clients) = _load(base, (server_state, client_states))
        except Exception as e:  # damaged or truncated files: fall back to the previous round
            warnings.warn(f"checkpoint {base} is unreadable ({type(e).__name__}: {e}); trying the "
                          "previous round", RuntimeWarning, stacklevel=3)
            continue
        theirs = meta["fingerprints"]
        for field in ("data", "algorithm", "model", "settings"):
            if theirs.get(field, [None, None])[1] != prints[field][1]:
                raise ValueError(
                    f"the checkpoint in {directory} was written for a different {field}: it has "
                    f"{theirs.get(field, ['?'])[0]}, this run has {prints[field][0]}; use another "
                    "checkpoint directory or the same inputs")
        return r, server, clients, meta["history"]
    return None


__all__ = ["Checkpoint", "save", "restore", "fingerprints"]
