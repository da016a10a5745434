"""One node's rows: the ``.npz`` file a SuperNode reads (``--node-config "data-path='...'"``).

Format: a NumPy ``.npz`` with

* ``X``: (n, ...) inputs, a float or integer array (stored as float32);
* ``y``: (n, ...) targets: integer class labels for classifiers, floats for
  regression;
* ``client`` (optional): an integer, this node's client index. The server
  orders the nodes' clients by it (then by node id), so a federation split
  by ``fedprob flower split`` meets the local engine's client order and
  gives its answer.

:func:`load` reads and checks the file (finite values, matching row counts,
at least one row); :func:`check_against` checks the rows against the model
(its ``data`` plate, the label range) before the first round; both raise a
ValueError that names the file. The rows never leave the node:
:func:`padded` pads them, as :class:`fedprob.data.FederatedData` does, to
the federation's longest client, so the node computes exactly what the
local engine computes for this client.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def load(path) -> dict:
    """``{"X", "y", "client"}`` of the ``.npz`` at ``path`` (module docstring), checked."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"node data file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:  # not a readable npz
        raise ValueError(f"node data file {path} is not a readable .npz ({type(e).__name__}: {e})") from None
    missing = [k for k in ("X", "y") if k not in arrays]
    if missing:
        raise ValueError(f"node data file {path} has no {' and '.join(missing)} (it needs X and y; "
                         f"found {sorted(arrays)})")
    X, y = arrays["X"], arrays["y"]
    if X.ndim < 1 or y.ndim < 1 or X.shape[0] != y.shape[0]:
        raise ValueError(f"node data file {path}: X {X.shape} and y {y.shape} must have the same number of rows")
    if X.shape[0] == 0:
        raise ValueError(f"node data file {path} has no rows")
    for name, a in (("X", X), ("y", y)):
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)
                or a.dtype == np.bool_):
            raise ValueError(f"node data file {path}: {name} has dtype {a.dtype}; it must be numeric")
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            raise ValueError(f"node data file {path}: {name} has non-finite values")
    client = arrays.get("client")
    if client is not None:
        if client.shape != () or not np.issubdtype(client.dtype, np.integer) or int(client) < 0:
            raise ValueError(f"node data file {path}: client must be a non-negative integer scalar")
        client = int(client)
    y = y.astype(np.int32) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)
    return {"X": X.astype(np.float32), "y": y, "client": client, "path": str(path)}


def check_against(rows: dict, model, model_kwargs=None, num_classes=None):
    """The :class:`fedprob.potential.Potential` of ``model`` on these rows; a ValueError naming
    the file when the rows do not fit the model (its ``data`` plate, shapes, labels)."""
    from ..potential import Potential

    X, y, path = rows["X"], rows["y"], rows["path"]
    if num_classes is not None:
        if not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"node data file {path}: a classifier needs integer labels y, got {y.dtype}")
        bad = (y < 0) | (y >= num_classes)
        if bad.any():
            raise ValueError(f"node data file {path}: labels must be in [0, {num_classes}), found "
                             f"{int(y[bad][0])}")
    try:
        return Potential(model, X, y, model_kwargs)
    except Exception as e:
        raise ValueError(f"node data file {path} does not fit the model: {e}") from None


def padded(rows: dict, n_max: int):
    """``(X, y)`` padded to ``n_max`` rows by repeating the first row (as
    :meth:`fedprob.data.FederatedData.from_clients` pads)."""
    X, y = rows["X"], rows["y"]
    n = X.shape[0]
    if n_max < n:
        raise ValueError(f"n_max={n_max} is smaller than this node's {n} rows")

    def pad(a):
        out = np.empty((n_max,) + a.shape[1:], a.dtype)
        out[:n] = a
        out[n:] = a[:1]
        return out

    return pad(X), pad(y)


def write(path, X, y, client=None) -> Path:
    """Write one node's ``.npz`` (the format above)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {} if client is None else {"client": np.int64(client)}
    np.savez(path, X=np.asarray(X), y=np.asarray(y), **extra)
    return path


__all__ = ["load", "check_against", "padded", "write"]
